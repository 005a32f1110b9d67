"""Trace caching: a recorded :class:`~modelmeter.Trace` kept on disk, keyed by a fingerprint of the model,
its inputs and the run options, so analysing the same model again does not run it (docs/caching.md).

Opt-in for the library (``analyze(model, x, cache=True)``, or ``cache=`` / ``cache_dir=`` on any analysis
class), on by default in the ``modelmeter`` command (``--no-cache`` turns it off).

>>> from modelmeter.cache import cache_info, clear_cache
>>> cache_info()   # doctest: +SKIP
{'path': '/home/me/.cache/modelmeter/traces', 'entries': 3, 'bytes': 412331, 'limit': 1073741824}
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.serialize import FORMAT_VERSION, trace_from_dict, trace_to_dict
from ..engine.spec import RunSpec
from ..engine.trace import Trace
from ..engine.values import watch_given_reads
from .fingerprint import Uncacheable, cache_key, package_digest, trace_key, watch_code
from .store import DEFAULT_SIZE_LIMIT, SIZE_ENV, TraceCache, parse_size

__all__ = [
    "DEFAULT_SIZE_LIMIT",
    "FORMAT_VERSION",
    "SIZE_ENV",
    "StoredTrace",
    "TraceCache",
    "Uncacheable",
    "cache_info",
    "cache_key",
    "cached_trace",
    "clear_cache",
    "package_digest",
    "parse_size",
    "stored_entry",
    "trace_from_dict",
    "trace_key",
    "trace_to_dict",
]

logger = logging.getLogger("modelmeter.cache")

CacheDir = str | os.PathLike[str] | None


def cache_info(cache_dir: CacheDir = None) -> dict[str, Any]:
    """``{"path", "entries", "bytes", "limit"}``: where traces are cached, how many, their size and the limit."""
    return TraceCache(cache_dir).info()


def clear_cache(cache_dir: CacheDir = None) -> int:
    """Delete every cached trace; the number of entries removed."""
    return TraceCache(cache_dir).clear()


@dataclass(frozen=True)
class StoredTrace:
    """A trace kept in a :class:`TraceCache`: its ``key`` and the digest of its ``entry``, where results counted
    from it are kept (bound to that entry: a result of a trace entry since replaced is not read)."""

    cache: TraceCache
    key: str
    entry: str

    def load_result(self, settings: str) -> Any:
        """The result kept for the ``settings`` digest, as data (see :meth:`TraceCache.load_result`), else None."""
        return self.cache.load_result(self.key, self.entry, settings)

    def store_result(self, settings: str, result: Any) -> bool:
        """Keep ``result`` (data) for the ``settings`` digest; False if not kept."""
        return self.cache.store_result(self.key, self.entry, settings, result)


def cached_trace(cache: TraceCache, spec: RunSpec,
                 record: Callable[[], Trace]) -> tuple[Trace, bool, StoredTrace | None]:
    """The trace of the run ``spec`` describes from ``cache``, else ``record()`` (then stored); whether it hit;
    and where it is kept (None when it is not in the cache).

    Never fails because of the cache: a model or inputs that cannot be fingerprinted, or a trace that cannot
    be stored, are recorded as without a cache (with a WARNING). Nothing is cached where the key cannot be
    sure (:class:`Uncacheable`, logged at INFO). A recorded trace is not stored when its run executed code of
    the user's that the key does not cover, ran real kernels under ``execution="auto"``, or read the values of
    the inputs or buffers (values the key does not cover may have steered it).
    """
    try:
        key = cache_key(spec, cache.path)
    except Uncacheable as exc:
        logger.info("Not caching the trace: %s.", exc)
        return record(), False, None
    except Exception as exc:  # an attribute that cannot be walked, say: the cache is an optimisation
        logger.warning("Cannot fingerprint the model and inputs for the trace cache (%s: %s); running the model.",
                       type(exc).__name__, exc)
        return record(), False, None
    executed: dict[Any, bool] | None = None
    read_values = False

    def watched_record() -> Trace:
        nonlocal executed, read_values
        with watch_code() as seen, watch_given_reads() as read:
            trace = record()
        executed, read_values = seen, bool(read)
        return trace

    def storable(trace: Trace) -> bool:
        if spec.execution == "auto" and trace.execution != "fake":
            logger.info("Not caching the trace: the fake run fell back to real kernels, whose run may depend on "
                        "values the cache key does not cover.")
            return False
        if read_values:
            logger.info("Not caching the trace: the fake run read values of the inputs or buffers (an attention "
                        "mask, .item() of a counter) or drew random numbers, which the cache key does not cover.")
            return False
        if executed is None:
            logger.info("Not caching the trace: another profiler is active, so the code the run executed "
                        "cannot be checked against the cache key.")
            return False
        uncovered = key.uncovered(executed)
        if uncovered:
            logger.info("Not caching the trace: the run executed code the cache key does not cover (%s%s).",
                        ", ".join(uncovered[:5]), ", ..." if len(uncovered) > 5 else "")
            return False
        return True

    trace, hit, entry = cache.get_or_record(key.digest, watched_record, storable)
    return trace, hit, None if entry is None else StoredTrace(cache, key.digest, entry)


def stored_entry(cache: TraceCache, spec: RunSpec) -> StoredTrace | None:
    """Where ``cache`` keeps the trace of ``spec``'s run, if it does (nothing is read, recorded or stored): for an
    analysis that took its trace from another one in this process that did not look in ``cache``."""
    try:
        key = cache_key(spec, cache.path)
    except Exception:  # Uncacheable, or a model that cannot be fingerprinted: not kept there
        return None
    entry = cache.entry_digest(key.digest)
    return None if entry is None else StoredTrace(cache, key.digest, entry)
