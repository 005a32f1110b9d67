"""``PathManagerBase``: dispatches path operations to the handler with the longest matching prefix."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable
from typing import IO, Any

from ..errors import InvalidTypeError, InvalidValueError, UnsupportedError
from .download import HTTPURLHandler, redact_url
from .handlers import FileURLHandler, NativePathHandler, PathHandler, PathType

__all__ = ["PathManager", "PathManagerBase"]

logger = logging.getLogger("modelmeter.io")

# ``scheme://`` at the start of a path (RFC 3986 schemes; two letters at least, so ``C://`` stays a drive).
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+://")


def _fold_scheme(text: str) -> str:
    """``text`` with its ``scheme://`` lower-cased: schemes are case-insensitive (``HTTP://`` is ``http://``)."""
    match = _SCHEME.match(text)
    return text if match is None else match.group(0).lower() + text[match.end():]


def _path_text(path: object) -> str:
    """``os.fspath(path)`` for a ``str`` or ``os.PathLike[str]``; ``InvalidTypeError`` naming anything else."""
    text = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise InvalidTypeError(f"A path must be a str or an os.PathLike of str, got {type(path).__name__} {path!r}")
    if "\0" in text:
        raise InvalidValueError(f"A path cannot hold a NUL character: {text!r}")
    return text


def _checked_prefixes(handler: PathHandler) -> list[str]:
    """``handler.supported_prefixes()``, each a non-empty ``str``: a bare string or an empty prefix would take
    over every path."""
    prefixes = handler.supported_prefixes()
    if isinstance(prefixes, (str, bytes)) or not isinstance(prefixes, Iterable):
        raise InvalidTypeError(f"{type(handler).__name__}.supported_prefixes() must return a list of str, got "
                               f"{prefixes!r}")
    listed = list(prefixes)
    bad = [p for p in listed if not isinstance(p, str) or not p]
    if bad:
        raise InvalidValueError(f"{type(handler).__name__}.supported_prefixes() has prefixes that are not non-empty "
                                f"str: {bad!r}")
    return [_fold_scheme(p) for p in listed]


class PathManagerBase:
    """Routes ``open``, ``exists``, ``copy``... to the registered :class:`PathHandler` whose prefix is the longest
    match of the path; paths that match none (and ``os.PathLike`` objects) go to :class:`NativePathHandler`."""

    def __init__(self) -> None:
        self._handlers: dict[str, PathHandler] = {}
        self._prefixes: list[str] = []  # longest first
        self._native = NativePathHandler()
        self._lock = threading.Lock()

    def register_handler(self, handler: PathHandler, allow_override: bool = True) -> None:
        """Serve ``handler.supported_prefixes()`` with ``handler``.

        A prefix already registered is taken over if ``allow_override`` (logged), else ``ValueError``. The
        ``scheme://`` part of a prefix matches in any case.
        """
        if not isinstance(handler, PathHandler):
            raise InvalidTypeError(f"register_handler needs a PathHandler, got {type(handler).__name__}")
        prefixes = _checked_prefixes(handler)
        with self._lock:
            taken = [p for p in prefixes if p in self._handlers]
            if taken and not allow_override:
                raise InvalidValueError(
                    f"Prefixes {taken} are already served by "
                    f"{sorted({type(self._handlers[p]).__name__ for p in taken})}; pass allow_override=True"
                )
            for prefix in prefixes:
                if prefix in self._handlers:
                    logger.info("PathManager: %s now served by %s", prefix, type(handler).__name__)
                self._handlers[prefix] = handler
            self._prefixes = sorted(self._handlers, key=len, reverse=True)

    def get_path_handler(self, path: PathType) -> PathHandler:
        """The handler for ``path``: the longest registered prefix it starts with, else the native handler.

        ``InvalidTypeError`` for what is not a path; ``UnsupportedError`` for a ``scheme://`` URL that no handler
        serves (``s3://...`` is not a local file: it would be created as ``./s3:/...``).
        """
        text = _fold_scheme(_path_text(path))
        for prefix in self._prefixes:
            if text.startswith(prefix):
                return self._handlers[prefix]
        scheme = _SCHEME.match(text)
        if scheme is not None:
            raise UnsupportedError(f"No handler serves {scheme.group(0)} paths such as {redact_url(text)}; "
                                   f"registered: {', '.join(sorted(self._prefixes)) or 'none'} "
                                   "(register one with register_handler)")
        return self._native

    def open(self, path: PathType, mode: str = "r", **kwargs: Any) -> IO[Any]:
        """Open ``path`` (``kwargs``: those of the builtin ``open``; others raise ``ValueError``)."""
        return self.get_path_handler(path).open(path, mode, **kwargs)

    def get_local_path(self, path: PathType, force: bool = False) -> str:
        """A local file path with the contents of ``path`` (downloads URLs; ``force`` re-downloads)."""
        return self.get_path_handler(path).get_local_path(path, force=force)

    def exists(self, path: PathType) -> bool:
        """Whether ``path`` exists."""
        return self.get_path_handler(path).exists(path)

    def isfile(self, path: PathType) -> bool:
        """Whether ``path`` is a file."""
        return self.get_path_handler(path).isfile(path)

    def isdir(self, path: PathType) -> bool:
        """Whether ``path`` is a directory."""
        return self.get_path_handler(path).isdir(path)

    def ls(self, path: PathType) -> list[str]:
        """The names in directory ``path``."""
        return self.get_path_handler(path).ls(path)

    def mkdirs(self, path: PathType) -> None:
        """Create directory ``path`` with its parents; no error if it exists."""
        self.get_path_handler(path).mkdirs(path)

    def rm(self, path: PathType) -> None:
        """Remove the file ``path``."""
        self.get_path_handler(path).rm(path)

    def copy(self, src_path: PathType, dst_path: PathType, overwrite: bool = False) -> bool:
        """Copy a file; ``FileExistsError`` if ``dst_path`` exists and not ``overwrite``. Returns True.

        Between different handlers (e.g. a URL to a local path) the source is fetched with ``get_local_path``.
        """
        src_handler, dst_handler = self.get_path_handler(src_path), self.get_path_handler(dst_path)
        if src_handler is dst_handler:
            return src_handler.copy(src_path, dst_path, overwrite=overwrite)
        local = src_handler.get_local_path(src_path)
        return dst_handler.copy_from_local(local, dst_path, overwrite=overwrite)

    def copy_from_local(self, local_path: PathType, dst_path: PathType, overwrite: bool = False) -> bool:
        """Copy the local file ``local_path`` to ``dst_path``; as :meth:`copy`."""
        return self.get_path_handler(dst_path).copy_from_local(local_path, dst_path, overwrite=overwrite)


def _default_manager() -> PathManagerBase:
    manager = PathManagerBase()
    manager.register_handler(FileURLHandler())
    manager.register_handler(HTTPURLHandler())
    return manager


#: The shared path manager: local paths, ``file://`` and ``http(s)://`` URLs.
PathManager = _default_manager()
