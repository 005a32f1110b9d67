"""``http://`` and ``https://`` URLs: downloaded once into the cache directory, then served locally."""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import secrets
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import suppress
from typing import IO, Any, ClassVar, TextIO

from tqdm import tqdm

from ..errors import InvalidValueError, ModelMeterError, UnsupportedError
from .atomic import fsync_dir, owner_gone, owner_tag
from .cache_dir import file_lock, get_cache_dir
from .handlers import PathHandler, PathType, check_open

__all__ = ["DownloadError", "HTTPURLHandler", "cache_relpath"]

logger = logging.getLogger("modelmeter.io")

_USER_AGENT = "modelmeter (python urllib)"
_MAX_COMPONENT_BYTES = 120  # well under the usual 255-byte limit on a file name
_MAX_RELPATH_CHARS = 240  # beyond this the URL's directories are dropped (the hash keeps names unique)
_PART_SUFFIX = ".part"
_STALE_PART_SECONDS = 3600.0  # a live download writes all the time; an hour untouched is abandoned
_UNSAFE_CHARS = re.compile(r'[\x00-\x1f\x7f<>:"/\\|?*]')
_WINDOWS_RESERVED = frozenset(
    {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(10)), *(f"LPT{i}" for i in range(10))}
)


class DownloadError(ModelMeterError, OSError):
    """A URL could not be downloaded; nothing was cached. ``url`` (credentials hidden) and ``status`` (HTTP)."""

    def __init__(self, url: str, reason: str, status: int | None = None) -> None:
        self.url = redact_url(url)
        self.reason = reason
        self.status = status
        super().__init__(f"Failed to download {self.url}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.url, self.reason, self.status))


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@``."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def _shown(path: PathType) -> str:
    """``path`` as an error message shows it: credentials hidden."""
    return redact_url(os.fspath(path))


def _short_hash(text: str, n: int) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:n]


def sanitize_component(name: str) -> str:
    """One safe file name from one (decoded) URL path component: never empty, ``.``/``..``, or too long."""
    name = name.encode("utf-8", "replace").decode("utf-8")  # lone surrogates
    safe = _UNSAFE_CHARS.sub("_", name).strip(" ").rstrip(". ")  # Windows drops trailing dots and spaces
    if not safe or set(safe) == {"."}:
        safe = "_"
    if safe.split(".")[0].upper() in _WINDOWS_RESERVED:
        safe = "_" + safe
    if len(safe.encode("utf-8")) > _MAX_COMPONENT_BYTES:
        stem, ext = os.path.splitext(safe)
        if len(ext) > 16:
            stem, ext = safe, ""
        suffix = f"-{_short_hash(name, 16)}{ext}"
        budget = _MAX_COMPONENT_BYTES - len(suffix.encode("utf-8"))
        while len(stem.encode("utf-8")) > budget:
            stem = stem[: max(0, len(stem) - max(1, (len(stem.encode("utf-8")) - budget) // 4))]
        safe = stem + suffix
    return safe


def cache_relpath(url: str) -> str:
    """Where ``url`` is cached, relative to ``<cache>/downloads``: ``<host>/<hash>/<dirs...>/<name>``.

    Every component is percent-decoded and sanitised (no ``..``, separators, NUL, control or Windows-reserved
    characters; long names shortened with a hash); ``<hash>`` is a digest of the full URL, query included, so
    different URLs never share a file (a ``#fragment`` is ignored). The last component keeps the URL's file name
    (and so its extension).
    """
    url = urllib.parse.urldefrag(url).url  # the fragment is never sent to the server
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "no-host"
    try:
        port = parts.port
    except ValueError as e:
        raise InvalidValueError(f"Invalid port in URL {redact_url(url)}") from e
    host_dir = sanitize_component(f"{host}_{port}" if port else host)
    path = urllib.parse.unquote(parts.path, errors="replace")
    pieces = [p for p in re.split(r"[/\\]", path) if p not in ("", ".", "..")]
    if path.endswith(("/", "\\")) or not pieces:
        pieces.append("index")
    names = [sanitize_component(p) for p in pieces]
    dirs, basename = names[:-1], names[-1]
    rel = os.path.join(host_dir, _short_hash(url, 16), *dirs, basename)
    if len(rel) > _MAX_RELPATH_CHARS:
        rel = os.path.join(host_dir, _short_hash(url, 16), basename)
    return rel


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _content_length(response: http.client.HTTPResponse) -> int | None:
    value = response.headers.get("Content-Length")
    try:
        length = int(value) if value is not None else None
    except ValueError:
        return None
    return length if length is not None and length >= 0 else None


def _quote_url(url: str) -> str:
    """Percent-encode spaces and non-ASCII characters, keeping existing escapes and URL syntax."""
    return urllib.parse.quote(url, safe=":/?#[]@!$&'()*+,;=%~")


def download(url: str, dst: str, *, timeout: float, chunk_size: int = 1 << 20, progress_over: int = 1 << 20) -> None:
    """Download ``url`` to ``dst`` atomically: a temporary file beside ``dst``, fsync, ``os.replace``.

    Raises :class:`DownloadError` (and leaves no file) on any network or HTTP error, or when fewer or more bytes
    arrive than ``Content-Length`` announced. A progress bar goes to stderr for files over ``progress_over``
    bytes or of unknown size, when stderr is a terminal.
    """
    directory, name = os.path.split(dst)
    tmp = os.path.join(directory, f".{name[:64]}.{owner_tag()}.{secrets.token_hex(6)}{_PART_SUFFIX}")
    request = urllib.request.Request(_quote_url(url), headers={"User-Agent": _USER_AGENT})
    logger.info("Downloading %s to %s", redact_url(url), dst)
    try:
        expected: int | None = None
        received = 0
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(request, timeout=timeout) as response:
                expected = _content_length(response)
                large = expected is None or expected > progress_over
                with tqdm(
                    total=expected,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1024,
                    desc=name,
                    file=sys.stderr,
                    disable=not (large and _isatty(sys.stderr)),
                ) as bar:
                    while True:
                        chunk = response.read(chunk_size)
                        if not chunk:
                            break
                        out.write(chunk)
                        received += len(chunk)
                        bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
        except urllib.error.HTTPError as e:
            e.close()
            raise DownloadError(url, f"HTTP {e.code} {e.reason}", status=e.code) from e
        except urllib.error.URLError as e:
            raise DownloadError(url, f"{e.reason}") from e
        except (OSError, http.client.HTTPException) as e:
            raise DownloadError(url, f"{type(e).__name__}: {e}") from e
        if expected is not None and received != expected:
            raise DownloadError(
                url, f"received {received} bytes but Content-Length is {expected} (connection closed early?)"
            )
        _store(url, tmp, dst)
        fsync_dir(directory)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def _store(url: str, tmp: str, dst: str) -> None:
    """Rename the complete download ``tmp`` to ``dst``; :class:`DownloadError` naming ``dst`` if it cannot be
    (a directory or another user's file in its place)."""
    try:
        os.replace(tmp, dst)
    except OSError as e:
        raise DownloadError(url, f"cannot store it as {dst}: {type(e).__name__}: {e.strerror}") from e


def remove_abandoned_parts(dst: str) -> int:
    """Remove the partial downloads of ``dst`` that killed processes left beside it; how many.

    A ``.part`` file goes when the process that wrote it (named in the file name) has ended, or when nobody
    has written to it for an hour (a process on another host, an older name without its writer).
    """
    directory, name = os.path.split(dst)
    prefix = f".{name[:64]}."
    stale = time.time() - _STALE_PART_SECONDS
    removed = 0
    try:
        with os.scandir(directory or ".") as listing:
            parts = [item for item in listing if item.name.startswith(prefix) and item.name.endswith(_PART_SUFFIX)
                     and item.is_file(follow_symlinks=False)]
    except OSError:
        return 0
    for item in parts:
        owner = item.name[len(prefix):-len(_PART_SUFFIX)].rpartition(".")[0]  # host.pid, before the token
        with suppress(OSError):
            if owner_gone(owner) or item.stat(follow_symlinks=False).st_mtime < stale:
                os.remove(item.path)
                removed += 1
    return removed


class HTTPURLHandler(PathHandler):
    """``http://`` and ``https://`` URLs, downloaded once into ``get_cache_dir(cache_dir)/downloads``.

    One process downloads while the others wait (file lock) and then reuse the file. Read-only: ``open`` takes
    read modes only; ``ls``, ``mkdirs``, ``rm`` and copying to a URL raise ``NotImplementedError``.
    """

    PREFIXES: ClassVar[tuple[str, ...]] = ("http://", "https://")

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None, timeout: float = 60.0) -> None:
        """``cache_dir``: as for :func:`get_cache_dir` (looked up on every call); ``timeout``: seconds per
        connection attempt and per read."""
        self.cache_dir = cache_dir
        self.timeout = timeout

    def cache_path(self, path: PathType) -> str:
        """The local file that does or will hold the download of the URL ``path``."""
        url = os.fspath(path)
        if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
            raise InvalidValueError(f"HTTPURLHandler serves http:// and https:// URLs only, not {redact_url(url)}")
        root = os.path.join(get_cache_dir(self.cache_dir), "downloads")
        local = os.path.join(root, cache_relpath(url))
        real_root, real_local = os.path.realpath(root), os.path.realpath(local)
        if os.path.commonpath([real_root, real_local]) != real_root:  # cannot happen; never write outside
            raise InvalidValueError(f"Cache path {local} for {redact_url(url)} escapes {root}")
        return local

    def get_local_path(self, path: PathType, force: bool = False) -> str:
        """The downloaded file, fetched on first use (or again with ``force``); :class:`DownloadError` on failure."""
        url = os.fspath(path)
        local = self.cache_path(url)
        if not force and os.path.isfile(local):
            return local
        lock = file_lock(local)
        try:
            lock.acquire()
        except OSError as e:  # a file where a directory of the cache path goes; a lock held for LOCK_TIMEOUT
            raise DownloadError(url, f"cannot lock its cache file {local}: {type(e).__name__}: {e}") from e
        try:
            remove_abandoned_parts(local)  # killed downloads of this file (a live one would hold the lock)
            if force or not os.path.isfile(local):  # another process may have finished it while we waited
                download(url, local, timeout=self.timeout)
            else:
                logger.debug("%s was downloaded by another process", redact_url(url))
        finally:
            lock.release()
        return local

    def open(self, path: PathType, mode: str = "r", **kwargs: Any) -> IO[Any]:
        """Open the downloaded copy for reading (``"r"``/``"rb"``); write modes raise ``ValueError``."""
        check_open(_shown(path), mode, kwargs)  # before downloading
        if any(c in mode for c in "wax+"):
            raise InvalidValueError(f"HTTPURLHandler: URLs are read-only; cannot open {_shown(path)} in mode "
                                    f"{mode!r}")
        return open(self.get_local_path(path), mode, **kwargs)

    def exists(self, path: PathType) -> bool:
        """True if cached, else asks the server (``HEAD``): 2xx/3xx True, 404/410 False, else ``DownloadError``."""
        url = os.fspath(path)
        if os.path.isfile(self.cache_path(url)):
            return True
        request = urllib.request.Request(_quote_url(url), method="HEAD", headers={"User-Agent": _USER_AGENT})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout):
                return True
        except urllib.error.HTTPError as e:
            e.close()
            if e.code in (404, 410):
                return False
            raise DownloadError(url, f"HEAD: HTTP {e.code} {e.reason}", status=e.code) from e
        except urllib.error.URLError as e:
            raise DownloadError(url, f"HEAD: {e.reason}") from e
        except (OSError, http.client.HTTPException) as e:
            raise DownloadError(url, f"HEAD: {type(e).__name__}: {e}") from e

    def isfile(self, path: PathType) -> bool:
        """Same as :meth:`exists` (a URL names a file)."""
        return self.exists(path)

    def isdir(self, path: PathType) -> bool:
        """Always False."""
        return False

    def ls(self, path: PathType) -> list[str]:
        raise UnsupportedError(f"HTTPURLHandler cannot list URLs (ls {_shown(path)})")

    def mkdirs(self, path: PathType) -> None:
        raise UnsupportedError(f"HTTPURLHandler cannot create directories on a web server ({_shown(path)})")

    def rm(self, path: PathType) -> None:
        raise UnsupportedError(f"HTTPURLHandler cannot remove URLs ({_shown(path)})")

    def copy(self, src_path: PathType, dst_path: PathType, overwrite: bool = False) -> bool:
        raise UnsupportedError(f"HTTPURLHandler cannot upload to URLs (copy to {_shown(dst_path)})")

    def copy_from_local(self, local_path: PathType, dst_path: PathType, overwrite: bool = False) -> bool:
        raise UnsupportedError(f"HTTPURLHandler cannot upload to URLs (copy to {_shown(dst_path)})")
