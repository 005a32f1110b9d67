"""The memory timeline as plain data for a report: live bytes by kind over the run, downsampled, the peak kept.

A pure function of a :class:`~modelmeter.metrics.memory.MemoryModel` and the optimizer's spec, over the points of
:func:`~modelmeter.metrics.memory.timeline` (one per dispatched operator, then the optimizer's step). A big model
has hundreds of thousands of them; a report keeps at most ``max_points``: the run is cut into equal buckets of
consecutive points and each bucket keeps its highest point (the first, when several are equal), so the chart is
the run's upper envelope and the peak is always one of the kept points.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ..engine.gc_pause import no_gc
from ..engine.trace import Storage
from ..errors import InvalidValueError
from .memory import OPTIMIZER_PHASE, MemoryModel, OptimizerSpec, Point, dispatched, optimizer_bytes, step_point

__all__ = ["TIMELINE_KINDS", "TIMELINE_POINTS", "memory_timeline"]

TIMELINE_POINTS = 1000
# The stack, bottom first: what lives through the whole step, then what comes and goes. The memory model's
# "activation" storages are split in two: "activation", what autograd saved for the backward pass (it lives from
# the forward pass until the backward pass has used it), and "temporary", every other storage the operators made.
# Under a parallel plan, the unsharded parameters and the communication buffers come and go with each module.
TIMELINE_KINDS = ("parameter", "buffer", "input", "optimizer_state", "gradient", "unsharded", "communication",
                  "activation", "temporary", "other", "optimizer_temporary")


def memory_timeline(model: MemoryModel, spec: OptimizerSpec | None = None,
                    max_points: int = TIMELINE_POINTS) -> dict[str, Any]:
    """The timeline of ``model`` (with the optimizer ``spec``) as compact plain data (``Result.memory["timeline"]``).

    ``length``: the points of the whole timeline; ``bucket``: how many consecutive points each kept point stands
    for (1: none was dropped); kept point ``i`` is the highest of positions ``i * bucket`` to ``(i + 1) * bucket
    - 1``, at ``position[i]``. Per kept point, ``module`` and ``operator`` index the ``modules`` and ``operators``
    lists, and ``bytes`` maps each kind of ``kinds`` (those with bytes somewhere, in stacking order) to its live
    bytes; the kinds add up to the live total. ``phases``: ``[phase, first position]`` of each run of points in
    one phase. ``peak``: the position of the highest point (the first of equals, as ``peak()``), or None for a
    run without operators.
    """
    if max_points < 1:
        raise InvalidValueError(f"max_points must be at least 1, got {max_points}")
    with no_gc():  # a list per event and a record per storage: in a large heap, collections would cost the most
        return _timeline(model, spec, max_points)


def _timeline(model: MemoryModel, spec: OptimizerSpec | None, max_points: int) -> dict[str, Any]:
    state, temporary = optimizer_bytes(model.trace, spec) if spec is not None else (0, 0)
    events = dispatched(model)
    live = [model.live[event] + state for event in events]
    if spec is not None:
        events.append(len(model.trace.events))
        live.append(model.at_end + state + temporary)
    bucket = max(1, math.ceil(len(live) / max_points))
    kept = [_highest(live, start, start + bucket) for start in range(0, len(live), bucket)]
    points = [_point(model, spec, events[j]) for j in kept]
    stacks = _stacks(model.trace.storages, [events[j] for j in kept])
    stacks["temporary"] = [live + model.copies.get(events[j], 0) for live, j in zip(stacks["temporary"], kept,
                                                                                     strict=True)]
    if spec is not None:
        stacks["optimizer_state"] = [state] * len(kept)
        stacks["optimizer_temporary"] = [temporary if p.event == len(model.trace.events) else 0 for p in points]
    modules = _index([p.module for p in points])
    operators = _index([p.operator for p in points])
    kinds = [kind for kind in TIMELINE_KINDS if any(stacks[kind])]
    return {
        "length": len(live), "bucket": bucket, "position": kept,
        "kinds": kinds, "bytes": {kind: stacks[kind] for kind in kinds},
        "module": [modules[p.module] for p in points], "modules": list(modules),
        "operator": [operators[p.operator] for p in points], "operators": list(operators),
        "phases": _phase_runs(model, events), "peak": _highest(live, 0, len(live)) if live else None,
    }


def _highest(live: list[int], start: int, stop: int) -> int:
    """The position of the highest point in ``live[start:stop]``, the first of equals."""
    return max(range(start, min(stop, len(live))), key=live.__getitem__)


def _point(model: MemoryModel, spec: OptimizerSpec | None, event: int) -> Point:
    """Where ``event`` happened (its module and operator; the step's after the run)."""
    if spec is not None and event == len(model.trace.events):
        return step_point(model, spec, 0)
    return model.point(event)


def _phase_runs(model: MemoryModel, events: list[int]) -> list[list[Any]]:
    """``[phase, first position]`` of each run of consecutive points in one phase (the step: the optimizer's)."""
    runs: list[list[Any]] = []
    for position, event in enumerate(events):
        phase = model.trace.events[event].phase if event < len(model.trace.events) else OPTIMIZER_PHASE
        if not runs or runs[-1][0] != phase:
            runs.append([phase, position])
    return runs


def _index(names: list[str]) -> dict[str, int]:
    """Each distinct name's index, in order of first appearance."""
    return {name: i for i, name in enumerate(dict.fromkeys(names))}


def _timeline_kind(storage: Storage) -> str:
    if storage.kind == "activation":
        return "activation" if storage.saved >= 0 else "temporary"
    return storage.kind


def _stacks(storages: Iterable[Storage], events: list[int]) -> dict[str, list[int]]:
    """Per timeline kind, the bytes live during each of ``events`` (ascending; ``len(trace.events)``: after the
    run), as :meth:`MemoryModel.live_by_kind` counts them, in one sweep over the storages' births and deaths."""
    changes = []
    for s in storages:
        kind = _timeline_kind(s)
        changes.append((max(s.born, -1), kind, s.nbytes))
        if s.died >= 0:
            changes.append((s.died, kind, -s.nbytes))
    changes.sort()  # by event (then kind and bytes: the order within one event does not change the sums)
    stacks: dict[str, list[int]] = {kind: [] for kind in TIMELINE_KINDS}
    running = dict.fromkeys(TIMELINE_KINDS, 0)
    done = 0
    for event in events:
        while done < len(changes) and changes[done][0] <= event:
            _, kind, delta = changes[done]
            running[kind] += delta
            done += 1
        for kind, stack in stacks.items():
            stack.append(running[kind])
    return stacks
