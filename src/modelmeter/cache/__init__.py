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
from typing import Any

from torch import nn

from ..engine.trace import Trace
from .fingerprint import trace_key
from .serialize import FORMAT_VERSION, trace_from_dict, trace_to_dict
from .store import DEFAULT_SIZE_LIMIT, SIZE_ENV, TraceCache, parse_size

__all__ = [
    "DEFAULT_SIZE_LIMIT",
    "FORMAT_VERSION",
    "SIZE_ENV",
    "TraceCache",
    "cache_info",
    "cached_trace",
    "clear_cache",
    "parse_size",
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


def cached_trace(cache: TraceCache, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 execution: str, record: Callable[[], Trace], *, backward: bool = False,
                 loss_fn: Callable[[Any], Any] | None = None) -> tuple[Trace, bool]:
    """The trace of ``model(*args, **kwargs)`` from ``cache``, else ``record()`` (then stored); and whether it hit.

    Never fails because of the cache: a model or inputs that cannot be fingerprinted, or a trace that cannot
    be stored, are recorded as without a cache (with a WARNING). Runs that fell back to real kernels under
    ``execution="auto"`` may depend on values the key does not cover, so they are not stored.
    """
    try:
        key = trace_key(model, args, kwargs, execution, backward=backward, loss_fn=loss_fn)
    except Exception as exc:  # an attribute that cannot be walked, say: the cache is an optimisation
        logger.warning("Cannot fingerprint the model and inputs for the trace cache (%s: %s); running the model.",
                       type(exc).__name__, exc)
        key = None
    if key is None:
        return record(), False

    def storable(trace: Trace) -> bool:
        if execution == "auto" and trace.execution != "fake":
            logger.info("Not caching the trace: the fake run fell back to real kernels, whose run may depend on "
                        "values the cache key does not cover.")
            return False
        return True

    return cache.get_or_record(key, record, storable)
