"""Where modelmeter keeps cached files, and a cross-process lock for them."""

from __future__ import annotations

import getpass
import logging
import os
import re
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import filelock

from ..errors import InvalidTypeError, InvalidValueError, ModelMeterError

__all__ = ["LOCK_TIMEOUT", "CacheDirError", "directory_lock", "file_lock", "get_cache_dir"]

logger = logging.getLogger("modelmeter.io")

#: Seconds :func:`file_lock` waits for another process before raising ``filelock.Timeout``.
LOCK_TIMEOUT = 3600.0

_APP = "modelmeter"
_CACHE_VARIABLES = ("MODELMETER_CACHE", "FVCORE_CACHE")  # in this order, before the platform's directory
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class CacheDirError(ModelMeterError, OSError):
    """No cache directory can be written: neither the one chosen (``MODELMETER_CACHE``, the platform's) nor the
    private fallback. The message names both and why each failed."""


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _platform_cache_dir(platform: str | None = None) -> str:
    """The per-user cache directory of ``platform`` (default: this one), not yet created."""
    platform = sys.platform if platform is None else platform
    if platform == "darwin":
        return os.path.join(os.path.expanduser("~"), "Library", "Caches", _APP)
    if platform.startswith(("win32", "cygwin")):
        base = _env("LOCALAPPDATA") or os.path.join(os.path.expanduser("~"), "AppData", "Local")
        return os.path.join(base, _APP, "Cache")
    xdg = _env("XDG_CACHE_HOME")
    if xdg is not None and os.path.isabs(os.path.expanduser(xdg)):  # the XDG spec ignores relative values
        return os.path.join(os.path.expanduser(xdg), _APP)
    return os.path.join(os.path.expanduser("~"), ".cache", _APP)


def _user_tag() -> str:
    try:
        name = getpass.getuser()
    except Exception:  # no $USER and no passwd entry (containers)
        name = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "user"


def _fallback_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"{_APP}_cache_{_user_tag()}")


def _make_writable_dir(path: str, *, private: bool = False) -> str | None:
    """Create ``path`` and write a probe file in it; ``None`` on success, else why it failed."""
    try:
        os.makedirs(path, mode=0o700 if private else 0o777, exist_ok=True)
        if private and hasattr(os, "getuid"):
            # A shared temp dir: refuse a directory (or symlink) planted by another user.
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                return "not a real directory (symlink or file)"
            if st.st_uid != os.getuid():
                return f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _configured_cache_dir() -> tuple[str, str]:
    """(where it was set, the directory) for the first of the environment variables set, else the platform's."""
    for name in _CACHE_VARIABLES:
        value = _env(name)
        if value is not None:
            return f"${name}", value
    return "the platform's cache directory", _platform_cache_dir()


def chosen_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The directory :func:`get_cache_dir` tries first, as an absolute path, neither created nor checked.

    ``~`` is expanded, and so are environment variables in a setting read from the environment
    (``MODELMETER_CACHE='$SCRATCH/cache'``; a ``cache_dir`` given is a path as written, ``$`` and all);
    ``InvalidTypeError`` or ``InvalidValueError`` name a ``cache_dir`` or variable that cannot be a directory.
    """
    if cache_dir is not None:
        source = "cache_dir"
        raw = os.fspath(cache_dir) if isinstance(cache_dir, (str, os.PathLike)) else cache_dir
        if not isinstance(raw, str):
            raise InvalidTypeError(f"cache_dir must be a str or an os.PathLike of str, got {type(cache_dir).__name__}")
    else:
        source, raw = _configured_cache_dir()
        raw = os.path.expandvars(raw)
    if "\0" in raw:
        raise InvalidValueError(f"{source} holds a NUL character, which no directory name holds: {raw!r}")
    return os.path.abspath(os.path.expanduser(raw))


def get_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The directory for cached files, created and checked writable; returned as an absolute path.

    Order: ``cache_dir``, ``$MODELMETER_CACHE``, ``$FVCORE_CACHE``, the platform's user cache directory
    (``$XDG_CACHE_HOME/modelmeter`` or ``~/.cache/modelmeter`` on Linux, ``~/Library/Caches/modelmeter`` on
    macOS, ``%LOCALAPPDATA%\\modelmeter\\Cache`` on Windows). ``~`` is expanded, and ``$VARIABLES`` in the
    variables' values. If that directory cannot be written, ``<tempdir>/modelmeter_cache_<user>`` is used with a
    logged WARNING; if neither works, ``OSError``.
    """
    chosen = chosen_cache_dir(cache_dir)
    problem = _make_writable_dir(chosen)
    if problem is None:
        return chosen
    fallback = os.path.abspath(_fallback_cache_dir())
    fallback_problem = _make_writable_dir(fallback, private=True)
    if fallback_problem is not None:
        raise CacheDirError(
            f"No writable cache directory: {chosen} ({problem}) and the fallback {fallback} "
            f"({fallback_problem}). Set MODELMETER_CACHE to a writable directory."
        )
    with _warned_lock:
        first = (chosen, fallback) not in _warned
        _warned.add((chosen, fallback))
    if first:
        logger.warning("Cache directory %s is not writable (%s); using %s instead.", chosen, problem, fallback)
    return fallback


def file_lock(path: str | os.PathLike[str], timeout: float = LOCK_TIMEOUT) -> filelock.FileLock:
    """A cross-process lock guarding ``path``: a ``filelock.FileLock`` on ``path + ".lock"``.

    The parent directory is created if missing. Use as ``with file_lock(path): ...``.
    """
    target = os.fspath(path)
    parent = os.path.dirname(target)
    if parent:
        with suppress(OSError):
            os.makedirs(parent, exist_ok=True)
    return filelock.FileLock(target + ".lock", timeout=timeout)


@contextmanager
def directory_lock(directory: str | os.PathLike[str], timeout: float = LOCK_TIMEOUT) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on the directory itself while the block runs; no file is created in it.

    Waits up to ``timeout`` seconds for another holder (``TimeoutError`` after that); the kernel releases the lock
    when its holder dies. Yields False, without locking, where directories cannot be locked (Windows, file
    systems that refuse ``flock`` on a directory, such as some NFS mounts).
    """
    try:
        import fcntl

        fd = os.open(os.fspath(directory), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (ImportError, OSError):
        yield False
        return
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{directory} stayed locked by another process for {timeout:g} s") from None
                time.sleep(0.02)
            except OSError:
                yield False
                return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock
