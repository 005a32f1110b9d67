"""File utilities: the cache directory, lazily computed paths, a cross-process file lock, and ``PathManager``,
which opens local paths, ``file://`` URLs and ``http(s)://`` URLs (downloaded once into the cache).

>>> from modelmeter.io import PathManager
>>> with PathManager.open("https://example.com/model.pkl", "rb") as f:  # doctest: +SKIP
...     data = f.read()
"""

from .cache_dir import CacheDirError, file_lock, get_cache_dir
from .download import DownloadError, HTTPURLHandler
from .handlers import FileURLHandler, NativePathHandler, PathHandler
from .lazy_path import LazyPath
from .manager import PathManager, PathManagerBase

__all__ = [
    "CacheDirError",
    "DownloadError",
    "FileURLHandler",
    "HTTPURLHandler",
    "LazyPath",
    "NativePathHandler",
    "PathHandler",
    "PathManager",
    "PathManagerBase",
    "file_lock",
    "get_cache_dir",
]
