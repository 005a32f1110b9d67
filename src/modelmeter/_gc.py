"""Pausing the cyclic garbage collector around work that makes many small objects."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while many small acyclic objects are made or walked.

    Recording a run, building a result or decoding a trace allocates tens of thousands of events, lists and
    counters; in a process holding a large heap (torch, a model) each collection they trigger walks that heap,
    which makes the work several times slower (and a recorded run's storages are freed by reference counts
    only, deterministically).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
