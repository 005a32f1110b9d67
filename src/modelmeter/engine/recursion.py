"""Room on Python's stack for a recorded run: the recorder's global module hooks add a frame to every module call.

A module call takes three Python frames in a plain run (``_wrapped_call_impl``, ``_call_impl``, ``forward``) and four
under the hooks, and the recorder's modes, handlers and kernels run below the innermost call. Without more room, a
model nested 200 modules deep, which PyTorch runs, failed with a RecursionError under the recorder.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

_PLAIN_FRAMES = 3  # Python frames per nested module call, plain
_RECORDED_FRAMES = 4  # the same, under the recorder's hooks
_BELOW = 200  # frames the recorder's modes, handlers and kernels add below the innermost call, at most


@contextmanager
def recursion_headroom() -> Iterator[None]:
    """Raise Python's recursion limit while a run is recorded, so that a model nests as deep under the recorder as it
    does without it. The C stack is no deeper for it on Python 3.11+: the frames the hooks add are Python functions
    called from Python code (no C recursion there; on 3.10 each takes a little C stack too), and a module call makes
    as many C frames as in a plain run, so a model too deep for PyTorch still fails at about the depth where
    PyTorch's own run does. The limit is the
    process's: put back when the run ends, unless the model's code set one of its own meanwhile (a plain run would
    have left that one)."""
    found = sys.getrecursionlimit()
    raised = found * _RECORDED_FRAMES // _PLAIN_FRAMES + _BELOW
    sys.setrecursionlimit(raised)
    try:
        yield
    finally:
        if sys.getrecursionlimit() == raised:
            sys.setrecursionlimit(found)
