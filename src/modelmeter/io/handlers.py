"""Path handlers: the base class, local paths and ``file://`` URLs."""

from __future__ import annotations

import errno
import os
import shutil
import urllib.parse
import urllib.request
from typing import IO, Any, ClassVar

from ..errors import InvalidTypeError, InvalidValueError, UnsupportedError
from .atomic import atomic_write

__all__ = ["FileURLHandler", "NativePathHandler", "PathHandler", "PathType", "check_open"]

#: What the path methods accept: a ``str``, a :class:`LazyPath` or any other ``os.PathLike[str]``.
PathType = str | os.PathLike[str]

_OPEN_KWARGS = frozenset({"buffering", "encoding", "errors", "newline", "closefd", "opener"})
_TEXT_KWARGS = ("encoding", "errors", "newline")


def check_open(path: PathType, mode: object, kwargs: dict[str, Any]) -> None:
    """Refuse, naming ``path``, a ``mode`` or keyword arguments the builtin ``open`` would refuse (its own errors
    name neither), before anything is opened or downloaded."""
    if not isinstance(mode, str):
        raise InvalidTypeError(f"open({os.fspath(path)}): mode must be a str such as 'rb', got {type(mode).__name__}")
    kinds = [c for c in mode if c in "rwxa"]
    if set(mode) - set("rwxabt+") or len(set(mode)) != len(mode) or len(kinds) != 1 or {"b", "t"} <= set(mode):
        raise InvalidValueError(f"open({os.fspath(path)}): invalid mode {mode!r}: one of r, w, x, a, optionally "
                                "with + and one of b, t")
    unused = set(kwargs) - _OPEN_KWARGS
    if unused:
        raise InvalidValueError(f"Unused arguments: {sorted(unused)} (open() takes {sorted(_OPEN_KWARGS)})")
    text_only = [name for name in _TEXT_KWARGS if kwargs.get(name) is not None]
    if "b" in mode and text_only:
        raise InvalidValueError(f"open({os.fspath(path)}): binary mode {mode!r} takes no {', '.join(text_only)}")


class PathHandler:
    """Base class of a storage backend, chosen by :class:`PathManagerBase` by the prefixes it supports.

    Subclasses set ``PREFIXES`` (or override :meth:`supported_prefixes`) and override the methods they support;
    the others raise :class:`~modelmeter.errors.UnsupportedError` (a ``NotImplementedError``) naming the handler,
    the operation and the path.
    """

    PREFIXES: ClassVar[tuple[str, ...]] = ()

    def supported_prefixes(self) -> list[str]:
        """The path prefixes this handler serves, e.g. ``["http://", "https://"]``."""
        return list(self.PREFIXES)

    def _unsupported(self, operation: str, path: PathType) -> UnsupportedError:
        return UnsupportedError(f"{type(self).__name__} does not support {operation}() (path: {os.fspath(path)})")

    def open(self, path: PathType, mode: str = "r", **kwargs: Any) -> IO[Any]:
        """Open ``path``; ``kwargs`` as for the builtin ``open``."""
        raise self._unsupported("open", path)

    def get_local_path(self, path: PathType, force: bool = False) -> str:
        """A local file with the contents of ``path`` (``force``: refresh any cached copy)."""
        raise self._unsupported("get_local_path", path)

    def copy_from_local(self, local_path: PathType, dst_path: PathType, overwrite: bool = False) -> bool:
        """Copy the local file ``local_path`` to ``dst_path``."""
        raise self._unsupported("copy_from_local", dst_path)

    def copy(self, src_path: PathType, dst_path: PathType, overwrite: bool = False) -> bool:
        """Copy ``src_path`` to ``dst_path``, both served by this handler."""
        raise self._unsupported("copy", src_path)

    def exists(self, path: PathType) -> bool:
        """Whether ``path`` exists."""
        raise self._unsupported("exists", path)

    def isfile(self, path: PathType) -> bool:
        """Whether ``path`` is a file."""
        raise self._unsupported("isfile", path)

    def isdir(self, path: PathType) -> bool:
        """Whether ``path`` is a directory."""
        raise self._unsupported("isdir", path)

    def ls(self, path: PathType) -> list[str]:
        """The names in directory ``path``."""
        raise self._unsupported("ls", path)

    def mkdirs(self, path: PathType) -> None:
        """Create directory ``path`` and its parents (no error if it exists)."""
        raise self._unsupported("mkdirs", path)

    def rm(self, path: PathType) -> None:
        """Remove the file ``path``."""
        raise self._unsupported("rm", path)


def atomic_copy(src: str, dst: str, overwrite: bool) -> None:
    """Copy file ``src`` (contents and mode) to ``dst`` with :func:`atomic_write`: a reader of ``dst`` sees the old
    file or the complete copy."""
    if os.path.isdir(dst):
        raise IsADirectoryError(errno.EISDIR, "Copy destination is a directory", dst)
    if not overwrite and os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "Copy destination exists (pass overwrite=True to replace it)", dst)

    def write(out: IO[bytes]) -> None:
        shutil.copyfileobj(source, out, 1 << 20)
        shutil.copymode(src, out.name)

    with open(src, "rb") as source:
        atomic_write(os.path.abspath(dst), write)


class NativePathHandler(PathHandler):
    """Local paths: ``str``, :class:`LazyPath` and other ``os.PathLike``; the fallback of every path manager."""

    def _local(self, path: PathType) -> str:
        return os.fspath(path)

    def open(self, path: PathType, mode: str = "r", **kwargs: Any) -> IO[Any]:
        """The builtin ``open``; an invalid mode or unknown keyword arguments raise ``ValueError`` naming ``path``."""
        check_open(path, mode, kwargs)
        return open(self._local(path), mode, **kwargs)

    def get_local_path(self, path: PathType, force: bool = False) -> str:
        """The path itself, as a ``str``."""
        return self._local(path)

    def copy(self, src_path: PathType, dst_path: PathType, overwrite: bool = False) -> bool:
        """Copy a file atomically; ``FileExistsError`` if ``dst_path`` exists and not ``overwrite``. Returns True."""
        atomic_copy(self._local(src_path), self._local(dst_path), overwrite)
        return True

    def copy_from_local(self, local_path: PathType, dst_path: PathType, overwrite: bool = False) -> bool:
        """Like :meth:`copy`, from a local path."""
        atomic_copy(os.fspath(local_path), self._local(dst_path), overwrite)
        return True

    def exists(self, path: PathType) -> bool:
        return os.path.exists(self._local(path))

    def isfile(self, path: PathType) -> bool:
        return os.path.isfile(self._local(path))

    def isdir(self, path: PathType) -> bool:
        return os.path.isdir(self._local(path))

    def ls(self, path: PathType) -> list[str]:
        """The sorted names in the directory (not full paths)."""
        return sorted(os.listdir(self._local(path)))

    def mkdirs(self, path: PathType) -> None:
        os.makedirs(self._local(path), exist_ok=True)

    def rm(self, path: PathType) -> None:
        os.remove(self._local(path))


class FileURLHandler(NativePathHandler):
    """``file://`` URLs (``file:///abs/path``, percent-encoded), served as local paths; also RFC 8089's short
    ``file:/abs/path`` (Java's ``File.toURI()`` writes it), which would otherwise be a relative local path."""

    PREFIXES: ClassVar[tuple[str, ...]] = ("file://", "file:/")

    def _local(self, path: PathType) -> str:
        url = os.fspath(path)
        parts = urllib.parse.urlsplit(url)
        if parts.scheme.lower() != "file":
            raise InvalidValueError(f"Not a file:// URL: {url}")
        if "?" in url or "#" in url:
            # A file URL has no query: a '?' or '#' there is part of a file name that was not percent-encoded.
            raise InvalidValueError(f"file:// URL with '?' or '#': {url} (percent-encode them as %3F and %23, as "
                                    "pathlib.Path.as_uri() does)")
        if parts.netloc not in ("", "localhost"):
            if os.name == "nt":  # file://server/share/x -> \\server\share\x
                return urllib.request.url2pathname(f"//{parts.netloc}{parts.path}")
            raise InvalidValueError(f"file:// URL with host {parts.netloc!r} is not supported: {url} (use file:///abs/path)")
        local = urllib.request.url2pathname(parts.path)
        if "\0" in local:
            raise InvalidValueError(f"file:// URL with a NUL character (%00), which no file name holds: {url}")
        return local
