"""The persistent trace cache: one gzipped JSON file per key in ``<cache dir>/traces/``, and beside it the results
counted from that trace, one file per key and counting settings.

Writes are atomic (a temporary file in the same directory, flushed and fsynced, then ``os.replace``), so a
reader sees a whole entry or none. A process that misses takes a per-key file lock before running the
model, so concurrent processes analysing the same model run it once and the others read the entry. An
entry that cannot be read back (truncated, garbage, another format version, one that would decompress to
more than :data:`MAX_ENTRY_BYTES`) is discarded with a WARNING and the trace recomputed. The directory is
kept under a size limit by evicting the least recently used entries (a hit refreshes an entry's
modification time).

A result file is named by its trace's key and a digest of the counting settings (modelmeter's version and source
among them), and holds the digest of the trace entry it was counted from: a result of other settings, of another
modelmeter or of an entry since replaced is never read as this trace's result.

The cache only ever deletes files it names itself — ``<64 hex digits>.json.gz`` entries, their ``.lock`` files,
``<64 hex digits>-<64 hex digits>.result.json.gz`` results and the temporary files of its atomic writes — so a
cache directory shared with other files (a project folder) never loses them. A lock file is removed only when no
process holds it, a temporary file only when the process that wrote it has ended (or, when that cannot be told,
after an hour).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from .. import _version
from ..engine.gc_pause import no_gc
from ..engine.serialize import MAX_ENTRY_BYTES, gunzip, parse, to_data, trace_from_parsed, trace_to_dict
from ..engine.trace import Trace
from ..errors import InvalidValueError
from ..io.atomic import atomic_write, owner_gone

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("modelmeter.cache")

DEFAULT_SIZE_LIMIT = 1 << 30  # 1 GiB
SIZE_ENV = "MODELMETER_CACHE_SIZE"
SUBDIR = "traces"
SUFFIX = ".json.gz"
RESULT_SUFFIX = ".result" + SUFFIX
_LOCK_SUFFIX = SUFFIX + ".lock"
_STALE_SECONDS = 3600.0
_ENTRY = "modelmeter-trace-cache-entry"
_RESULT = "modelmeter-result-cache-entry"
_KEY = re.compile(r"[0-9a-f]{64}")
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}" + re.escape(SUFFIX))
_RESULT_NAME = re.compile(r"(?P<key>[0-9a-f]{64})-[0-9a-f]{64}" + re.escape(RESULT_SUFFIX))
_MEMO_NAME = re.compile(r"source-digest-[0-9a-f]{16}\.json")  # fingerprint.package_digest's memos
_LOCK_NAME = re.compile(r"[0-9a-f]{64}" + re.escape(_LOCK_SUFFIX))
_TEMP_NAME = re.compile(r"\.[0-9a-f]{64}(?:-[0-9a-f]{64}\.result)?" + re.escape(SUFFIX)
                        + r"\.(?P<owner>.+\.\d+)\.[0-9a-f]{8}\.tmp")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str) -> int:
    """A size in bytes from ``1073741824``, ``"500M"``, ``"1G"``, ``"1.5GiB"``, ``"64k"`` (binary units)."""
    if isinstance(value, bool):
        raise InvalidValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidValueError(f"a size cannot be negative: {value}")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]?)(?:i?b)?\s*", str(value).lower())
    if match is None:
        raise InvalidValueError(f"not a size: {value!r} (expected bytes, or a number with K, M, G or T)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def default_size_limit() -> int:
    """``$MODELMETER_CACHE_SIZE`` if set and valid (a WARNING otherwise), else 1 GiB."""
    text = os.environ.get(SIZE_ENV, "").strip()
    if not text:
        return DEFAULT_SIZE_LIMIT
    try:
        return parse_size(text)
    except ValueError as exc:
        logger.warning("Ignoring %s=%r (%s); using %d bytes.", SIZE_ENV, text, exc, DEFAULT_SIZE_LIMIT)
        return DEFAULT_SIZE_LIMIT


class TraceCache:
    """Traces on disk under ``get_cache_dir(cache_dir)/traces``, at most ``size_limit`` bytes in all.

    ``size_limit``: bytes or a string like ``"500M"``; default ``$MODELMETER_CACHE_SIZE`` or 1 GiB. 0 keeps
    nothing. Raises ``OSError`` when no writable cache directory can be found.
    """

    #: Seconds a process waits for another one recording the same trace before recording it itself.
    lock_timeout: float = 1800.0

    def __init__(self, cache_dir: str | os.PathLike[str] | None = None, size_limit: int | str | None = None) -> None:
        self.root = _cache_root(cache_dir)  #: the cache directory (the traces are in its ``traces`` folder)
        self.path = os.path.join(self.root, SUBDIR)
        os.makedirs(self.path, exist_ok=True)
        self.size_limit = default_size_limit() if size_limit is None else parse_size(size_limit)

    def __repr__(self) -> str:
        return f"TraceCache({self.path!r}, size_limit={self.size_limit})"

    def entry_path(self, key: str) -> str:
        if not _KEY.fullmatch(key):
            raise InvalidValueError(f"a cache key is 64 lowercase hex digits, got {key!r}")
        return os.path.join(self.path, key + SUFFIX)

    # reading ------------------------------------------------------------------------------------
    def load(self, key: str) -> Trace | None:
        """The trace stored under ``key`` (its entry marked as just used), or None.

        A damaged entry is deleted with a WARNING and None returned.
        """
        found = self._read(key)
        return None if found is None else found[0]

    def _read(self, key: str) -> tuple[Trace, str] | None:
        """The trace stored under ``key`` and the digest of its entry, or None (see :meth:`load`)."""
        path = self.entry_path(key)
        data = self._bytes(path, "trace cache entry")
        if data is None:
            return None
        try:
            trace = _decode_entry(data, key)
        except ValueError as exc:
            logger.warning("Discarding the damaged trace cache entry %s (%s); the model runs again.", path, exc)
            with suppress(OSError):
                os.remove(path)
            return None
        return trace, _used(path, data)

    def entry_digest(self, key: str) -> str | None:
        """The digest of the entry stored under ``key`` (marked as just used), what results kept beside it are bound
        to; None when there is none. The entry is not decoded: a result is only read when it names this digest."""
        path = self.entry_path(key)
        data = self._bytes(path, "trace cache entry")
        return None if data is None else _used(path, data)

    def get_or_record(self, key: str, record: Callable[[], Trace],
                      storable: Callable[[Trace], bool] = lambda _: True) -> tuple[Trace, bool, str | None]:
        """The trace under ``key``, else ``record()`` (stored when ``storable``); whether it was a hit; and the
        digest of its entry (what results kept beside it are bound to), None when it was not stored.

        While one process records a key, others asking for it wait on the key's lock and then read its entry.
        """
        found = self._read(key)
        if found is not None:
            return found[0], True, found[1]
        from ..io import file_lock

        lock = file_lock(self.entry_path(key), timeout=self.lock_timeout)
        try:
            lock.acquire()
            locked = True
        except Exception as exc:  # filelock.Timeout, or a lock file that cannot be created
            logger.warning("Cannot lock the trace cache entry for %s (%s: %s); recording without waiting.",
                           key, type(exc).__name__, exc)
            locked = False
        try:
            if locked:
                found = self._read(key)  # another process may have recorded it meanwhile
                if found is not None:
                    return found[0], True, found[1]
            trace = record()
            digest = self._store(key, trace) if storable(trace) else None
            return trace, False, digest
        finally:
            if locked:
                lock.release()

    def load_result(self, key: str, entry: str, settings: str) -> Any:
        """What :meth:`store_result` kept for the trace entry of digest ``entry`` under ``key`` and the
        ``settings`` digest (tags decoded, see :func:`~modelmeter.engine.serialize.parse`), else None.

        A result of another entry (one that has since been replaced) is deleted and None returned; a damaged one
        likewise, with a WARNING.
        """
        path = self.result_path(key, settings)
        data = self._bytes(path, "result cache entry")
        if data is None:
            return None
        try:
            with no_gc():
                kept = parse(gunzip(data))
            if type(kept) is not dict or kept.get("format") != _RESULT or kept.get("key") != key \
                    or kept.get("settings") != settings or "result" not in kept:
                raise InvalidValueError("not a modelmeter result cache entry of this key and these settings")
        except ValueError as exc:
            logger.warning("Discarding the damaged result cache entry %s (%s); counting again.", path, exc)
            self._remove(path)
            return None
        if kept.get("entry") != entry:
            logger.info("Discarding the result cache entry %s: it was counted from another trace entry.", path)
            self._remove(path)
            return None
        with suppress(OSError):
            os.utime(path)
        return kept["result"]

    def _bytes(self, path: str, what: str) -> bytes | None:
        """The contents of ``path``; None when it does not exist or cannot be read (with a WARNING)."""
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("Cannot read the %s %s (%s); continuing without it.", what, path, exc)
            return None

    # writing ------------------------------------------------------------------------------------
    def store(self, key: str, trace: Trace) -> bool:
        """Write ``trace`` under ``key`` atomically, then evict down to the size limit; False if not kept."""
        return self._store(key, trace) is not None

    def _store(self, key: str, trace: Trace) -> str | None:
        """:meth:`store`, returning the digest of the entry written (None if not kept)."""
        try:
            data = _encode_entry(key, trace)
        except (TypeError, ValueError) as exc:
            logger.warning("Cannot cache this trace (%s); it is used without being stored.", exc)
            return None
        path = self.entry_path(key)
        return hashlib.sha256(data).hexdigest() if self._write(path, data, "trace") else None

    def result_path(self, key: str, settings: str) -> str:
        if not _KEY.fullmatch(settings):
            raise InvalidValueError(f"a settings digest is 64 lowercase hex digits, got {settings!r}")
        return self.entry_path(key)[:-len(SUFFIX)] + f"-{settings}{RESULT_SUFFIX}"

    def store_result(self, key: str, entry: str, settings: str, result: Any) -> bool:
        """Keep ``result`` (data the trace format can hold) beside the trace entry of digest ``entry`` under
        ``key``, for the counting ``settings`` digest; False if not kept."""
        path = self.result_path(key, settings)
        try:
            with no_gc():
                text = json.dumps({"format": _RESULT, "key": key, "settings": settings, "entry": entry,
                                   "modelmeter": _version.__version__, "result": to_data(result)},
                                  separators=(",", ":"), allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            logger.warning("Cannot cache this result (%s); it is used without being stored.", exc)
            return False
        raw = text.encode("utf-8")
        if len(raw) > MAX_ENTRY_BYTES:
            logger.info("Not caching a result of %d bytes of JSON: over the limit of an entry.", len(raw))
            return False
        return self._write(path, gzip.compress(raw, compresslevel=6, mtime=0), "result")

    def _write(self, path: str, data: bytes, what: str) -> bool:
        """Write ``data`` to ``path`` atomically within the size limit, then evict; whether it was kept."""
        if len(data) > self.size_limit:
            logger.info("Not caching a %d-byte %s: the cache is limited to %d bytes.", len(data), what,
                        self.size_limit)
            return False
        try:
            atomic_write(path, lambda f: f.write(data))
        except OSError as exc:
            logger.warning("Cannot write the %s cache entry %s (%s); continuing without it.", what, path, exc)
            return False
        self.evict()
        return True

    def evict(self) -> int:
        """Remove least recently used files until the total fits the size limit — a trace entry with the
        results kept beside it —; the number of files removed.

        Also removes what killed processes left behind: lock files nobody holds that are over an hour old,
        and temporary files whose writer has ended.
        """
        files = self._entries(_ENTRY_NAME) + self._entries(_RESULT_NAME)
        sizes = {path: size for path, size, _ in files}
        total = sum(sizes.values())
        removed = 0
        for path, _, _ in sorted(files, key=lambda e: (e[2], e[0])):
            if total <= self.size_limit:
                break
            if path not in sizes:  # a result that went with its trace
                continue
            is_entry = _ENTRY_NAME.fullmatch(os.path.basename(path)) is not None
            for gone in [path, *self._results_of(path, sizes)] if is_entry else [path]:
                removed += self._remove(gone)
                total -= sizes.pop(gone)
        self._remove_leftovers(time.time() - _STALE_SECONDS)
        return removed

    def clear(self) -> int:
        """Remove every entry and result, the source-digest memos, every lock file nobody holds and every temporary
        file whose writer has ended; the number of trace entries removed. Files the cache did not write are left
        alone."""
        for path, _, _ in self._entries(_RESULT_NAME) + self._entries(_MEMO_NAME):
            self._remove(path)
        removed = sum(self._remove(path) for path, _, _ in self._entries(_ENTRY_NAME))
        self._remove_leftovers(None)
        return removed

    def info(self) -> dict[str, Any]:
        """``{"path", "entries", "bytes", "limit"}`` of this cache (its trace entries, and the bytes of all its
        files: entries and the results kept beside them)."""
        entries = self._entries(_ENTRY_NAME)
        size = sum(size for _, size, _ in entries + self._entries(_RESULT_NAME))
        return {"path": self.path, "entries": len(entries), "bytes": size, "limit": self.size_limit}

    # internals ----------------------------------------------------------------------------------
    def _files(self, pattern: re.Pattern[str]) -> list[os.DirEntry[str]]:
        """The regular files (not links) of the cache directory whose whole name matches ``pattern``."""
        try:
            with os.scandir(self.path) as listing:
                return [item for item in listing
                        if pattern.fullmatch(item.name) and item.is_file(follow_symlinks=False)]
        except FileNotFoundError:
            return []

    def _entries(self, pattern: re.Pattern[str]) -> list[tuple[str, int, int]]:
        """``(path, bytes, mtime in ns)`` of every file of the cache whose name matches ``pattern``."""
        found = []
        for item in self._files(pattern):
            with suppress(OSError):
                st = item.stat(follow_symlinks=False)
                found.append((item.path, st.st_size, st.st_mtime_ns))
        return found

    @staticmethod
    def _results_of(entry: str, paths: dict[str, int]) -> list[str]:
        """The results among ``paths`` kept beside the trace entry ``entry``."""
        key = os.path.basename(entry)[:64]
        return [path for path in paths
                if (match := _RESULT_NAME.fullmatch(os.path.basename(path))) is not None and match["key"] == key]

    @staticmethod
    def _remove(path: str) -> bool:
        try:
            os.remove(path)
        except OSError:
            return False
        return True

    def _remove_leftovers(self, older_than: float | None) -> None:
        """Lock files no process holds (last touched before ``older_than``, if given) and temporary files of
        writers that ended (or, on another host, last touched over an hour ago)."""
        stale = time.time() - _STALE_SECONDS
        for item in self._files(_LOCK_NAME):
            with suppress(OSError):
                if older_than is None or item.stat(follow_symlinks=False).st_mtime < older_than:
                    _remove_unlocked(item.path)
        for item in self._files(_TEMP_NAME):
            match = _TEMP_NAME.fullmatch(item.name)
            with suppress(OSError):
                if (match is not None and owner_gone(match["owner"])) or item.stat().st_mtime < stale:
                    os.remove(item.path)


def _used(path: str, data: bytes) -> str:
    """Mark the entry at ``path`` as just used (least recently *used* goes first: a hit counts as a use); the
    digest of its contents ``data``."""
    with suppress(OSError):
        os.utime(path)
    return hashlib.sha256(data).hexdigest()


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> str:
    """:func:`~modelmeter.io.get_cache_dir`'s directory for ``cache_dir``, without its probe file where that
    directory already has a ``traces`` folder this user may write in: a cache in use, whose directory passed the
    probe before. (Writing and removing a probe file can cost a cached analysis of a small model more than its
    hit saves; a write that fails later is reported and the trace used without being stored.)"""
    from ..io.cache_dir import chosen_cache_dir, get_cache_dir

    chosen = chosen_cache_dir(cache_dir)
    traces = os.path.join(chosen, SUBDIR)
    if os.path.isdir(traces) and all(os.access(d, os.W_OK | os.X_OK) for d in (chosen, traces)):
        return chosen
    return get_cache_dir(cache_dir)


def _remove_unlocked(path: str) -> bool:
    """Remove the lock file ``path`` if no process holds it; whether it was removed.

    A process that opened the file just before it went may still lock the removed file, so two processes
    can then record the same trace: both write it atomically, so that costs time, never an entry.
    """
    if fcntl is None:  # Windows refuses to remove a file another process holds open
        try:
            os.remove(path)
        except OSError:
            return False
        return True
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # OSError while a live process holds it
        os.remove(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _encode_entry(key: str, trace: Trace) -> bytes:
    with no_gc():
        entry = {"format": _ENTRY, "key": key, "modelmeter": _version.__version__, "trace": trace_to_dict(trace)}
        text = json.dumps(entry, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    raw = text.encode("utf-8")
    if len(raw) > MAX_ENTRY_BYTES:  # never write what could not be read back
        raise InvalidValueError(f"the trace is {len(raw)} bytes of JSON, over the {MAX_ENTRY_BYTES}-byte limit of an "
                                "entry")
    return gzip.compress(raw, compresslevel=6, mtime=0)


def _decode_entry(data: bytes, key: str) -> Trace:
    with no_gc():
        entry = parse(gunzip(data))  # ValueError (json.JSONDecodeError included) for anything malformed
        if type(entry) is not dict or entry.get("format") != _ENTRY:
            raise InvalidValueError("not a modelmeter trace cache entry")
        if entry.get("key") != key:
            raise InvalidValueError("the entry was written for another key")
        return trace_from_parsed(entry.get("trace"))
