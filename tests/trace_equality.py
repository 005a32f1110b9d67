"""Two traces, compared whole: the oracle of the recorder's fast paths (a written decomposition, a replayed call)
is the trace the plain recording makes, event by event and storage by storage."""

from __future__ import annotations

import math
from typing import Any

from modelmeter.engine.trace import Trace


def _plain(value: Any) -> Any:
    """Arguments with their scalars' types (1 and 1.0 are different descriptions) and a float's sign (-0.0)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return "float", value, math.copysign(1.0, value)
    if isinstance(value, (bool, int)):
        return type(value).__name__, value
    return value


def described(trace: Trace) -> tuple[list[Any], list[Any], Any, Any]:
    """Everything a trace records of a run: events, storages, scopes, and what the modules and the run left."""
    events = [(e.op, e.level, e.parent, e.scope, e.phase, _plain(e.inputs), _plain(e.outputs), e.kwargs, e.origin,
               e.python) for e in trace.events]
    storages = [(s.nbytes, s.dtype, s.device, s.kind, s.born, s.died, s.saved, s.saved_scope, s.order)
                for s in trace.storages]
    return events, storages, trace.scopes, (trace.output_shapes, trace.op_tags, trace.called, trace.assumptions)


def assert_same_trace(fast: Trace, slow: Trace) -> None:
    """``fast`` records exactly what ``slow`` does (the first difference named)."""
    (fast_events, fast_storages, *fast_rest), (slow_events, slow_storages, *slow_rest) = \
        described(fast), described(slow)
    assert len(fast_events) == len(slow_events)
    for i, (mine, theirs) in enumerate(zip(fast_events, slow_events, strict=True)):
        assert mine == theirs, f"event {i}"
    assert len(fast_storages) == len(slow_storages)
    for i, (mine, theirs) in enumerate(zip(fast_storages, slow_storages, strict=True)):
        assert mine == theirs, f"storage {i}"
    assert fast_rest == slow_rest
    assert fast.modules == slow.modules and fast.inputs == slow.inputs
