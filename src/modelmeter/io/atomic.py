"""Atomic file writes: a reader sees the old file or the complete new one, whatever happens to the writer.

Shared by the download cache, the trace cache and the checkpointer.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import hashlib
import os
import socket
import sys
import uuid
from collections.abc import Callable
from typing import IO

__all__ = [
    "atomic_write",
    "exchange",
    "fsync_dir",
    "hidden_name",
    "is_temp_file",
    "owner_gone",
    "owner_tag",
    "remove_stale_temp_files",
]

_TMP_SUFFIX = ".tmp"
_NAME_MAX = 255  # bytes in one file name on the usual file systems (ext4, xfs, btrfs, APFS, tmpfs)


def _host() -> str:
    return socket.gethostname().replace(".", "-") or "host"


def owner_tag() -> str:
    """``host.pid`` of this process, for the names of files it writes and may abandon if killed."""
    return f"{_host()}.{os.getpid()}"


def owner_gone(tag: str) -> bool:
    """Whether the process of an :func:`owner_tag` has ended; False when unknown (another host, a bad tag)."""
    host, _, pid = tag.rpartition(".")
    return host == _host() and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))


def hidden_name(base: str, suffix: str) -> str:
    """``.<base><suffix>``, a hidden name beside ``base`` that fits in 255 bytes whenever ``base`` does.

    A ``base`` too long for that is cut (on a character boundary) and ends in a hash of the whole of it, so
    that two long names that differ only at their ends still get different hidden names.
    """
    raw = os.fsencode(base)
    budget = _NAME_MAX - 1 - len(os.fsencode(suffix))
    if len(raw) <= budget:
        return f".{base}{suffix}"
    digest = "~" + hashlib.sha256(raw).hexdigest()[:8]
    return "." + raw[: budget - len(digest)].decode("utf-8", "ignore") + digest + suffix


def _temp_path(path: str) -> str:
    directory, base = os.path.split(path)
    return os.path.join(directory, hidden_name(base, f".{owner_tag()}.{uuid.uuid4().hex[:8]}{_TMP_SUFFIX}"))


def fsync_dir(directory: str) -> None:
    """Make a rename inside ``directory`` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _create(tmp: str, path: str) -> IO[bytes]:
    """Open the new temporary file ``tmp`` for writing; an error names ``path``, the file the caller asked for
    (a missing or unwritable directory is the same for both), not the hidden temporary name."""
    try:
        return open(tmp, "xb")
    except OSError as e:
        e.filename = path
        raise


def atomic_write(path: str, write: Callable[[IO[bytes]], object]) -> None:
    """Write ``path`` so that it is either the old file or the complete new one, whatever happens.

    The data goes to a temporary file in the same directory, is flushed and fsync'ed, then renamed over
    ``path`` with ``os.replace``; the directory is fsync'ed so the rename survives a crash.
    """
    tmp = _temp_path(path)
    try:
        with _create(tmp, path) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(path))


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_NO_EXCHANGE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EPERM, getattr(errno, "ENOTSUP", errno.EINVAL)})


@functools.lru_cache(maxsize=1)
def _renameat2() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    except OSError:
        return None


def exchange(a: str, b: str) -> bool:
    """Swap the existing paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).

    False, with nothing changed, where the platform or the file system cannot; then the caller renames in two
    steps and must cope with a crash between them. Other failures raise ``OSError``.
    """
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), a, None, b)


def remove_stale_temp_files(directory: str) -> None:
    """Remove temp files that a killed writer on this host left behind (their process no longer exists)."""
    host = _host()
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not (name.startswith(".") and name.endswith(_TMP_SUFFIX)):
            continue
        parts = name[: -len(_TMP_SUFFIX)].rsplit(".", 3)
        if len(parts) != 4 or parts[1] != host or not parts[2].isdigit():
            continue
        pid = int(parts[2])
        if pid == os.getpid() or _pid_alive(pid):
            continue
        with contextlib.suppress(OSError):
            os.remove(os.path.join(directory, name))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def is_temp_file(name: str) -> bool:
    """True for the name of a temporary file :func:`atomic_write` creates."""
    return name.startswith(".") and name.endswith(_TMP_SUFFIX)
