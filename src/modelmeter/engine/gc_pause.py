"""Pausing the cyclic garbage collector around work that makes many small objects.

The one process-wide setting an analysis changes besides the two torch patches of ``modelmeter._torch_compat``;
it imports nothing (reading a cached trace or a result must not import torch). Kept for two reasons:

- Determinism: while a run is recorded, a storage is freed where the model's code drops its last reference, never
  at whatever allocation happens to trigger a collection (a storage kept by a reference cycle lives to the end of
  the run, the same in every process; ``Recorder.after_import`` collects the one cycle torch's own imports make).
- Speed in a large heap: each collection the tens of thousands of events, lists and counters trigger walks the
  generations they reach, the whole heap for a full one. Measured on Python 3.11 (issue 17): no difference for small
  models (ViT-B/16, ResNet-50, about 1000 events: ratio 0.97-1.01), within the noise of a shared machine for a
  40,000-event backward run with and without 3 million live objects beside it; Python 3.14's incremental collector
  scans part of the old generation at every young collection, which the pause avoids as well.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

_F = TypeVar("_F", bound=Callable[..., Any])


class _Pauses:
    """The pauses open in this process, in every thread, and the collector's state to leave when the last ends.

    The collector is one switch for the whole process: a pause that put back what it found itself would, where two
    overlap in two threads, turn the collector on while the other still runs (the first to end found it on) or
    leave it off for good (the later one found it off). So the first pause to begin remembers the state, every
    pause turns the collector off, and the last to end restores it. A collector found on while paused was turned
    on by someone else meanwhile (the user's code in another thread): that is the state left then. One turned off
    meanwhile cannot be told from the pause's own (``gc.disable()`` of a collector that is off changes nothing):
    the state found at the first pause is put back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._enable_after = False

    def begin(self) -> None:
        with self._lock:
            if self._open == 0:
                self._enable_after = gc.isenabled()
            elif gc.isenabled():  # turned on by someone else during the pauses open
                self._enable_after = True
            self._open += 1
            gc.disable()

    def end(self) -> None:
        with self._lock:
            self._open -= 1
            if gc.isenabled():
                self._enable_after = True
            if self._open == 0 and self._enable_after:
                gc.enable()


_PAUSES = _Pauses()


@contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while many small acyclic objects are made or walked (recording a run,
    building a result, decoding a trace); a collector that was off stays off. Pauses may overlap, in one thread or
    several: the collector is back as found when the last one ends (:class:`_Pauses`)."""
    _PAUSES.begin()
    try:
        yield
    finally:
        _PAUSES.end()


def paused(function: _F) -> _F:
    """``function`` run with the collector paused (:func:`no_gc`), for public calls that record, count and build a
    result in several paused steps: paused once around them all, what they make meets one young collection when the
    call returns rather than one at the end of each step. Each young collection also counts towards the older
    generations' collections, and a full one walks the user's whole heap (in a process holding torchvision's and
    torch._dynamo's modules, ~400,000 objects, ~150 ms): an analysis of fvcore's pair made ~5 young collections,
    and so a full one every ~40 analyses; paused per call, 1, and a full one every ~200."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        with no_gc():
            return function(*args, **kwargs)

    return cast(_F, run)
