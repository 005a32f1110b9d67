"""The 1F1B pipeline schedule (PipeDream-Flush; Megatron-LM's non-interleaved schedule): the order every stage runs
its micro-batches' forward and backward passes in, and the timeline that order makes for given per-stage times.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC '21,
arXiv:2104.04473), section 2.2.1: stage ``s`` of ``p`` first runs ``p - s - 1`` warm-up forward passes, then
alternates one forward and one backward pass, then drains the backward passes left; at most ``p - s`` micro-batches'
activations are in flight on it, and with equal stages the pipeline's idle time is ``(p - 1)(t_f + t_b)`` per
step — ``(p - 1) / m`` of the ideal ``m (t_f + t_b)``, ``(p - 1) / (m + p - 1)`` of the step.
torch's ``Schedule1F1B`` runs the same order (tests/test_parallel_pipeline.py compares them).

Pure functions of numbers: no model, no trace, no process group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidValueError

Kind = Literal["F", "B"]
FORWARD: Kind = "F"
BACKWARD: Kind = "B"


@dataclass(frozen=True)
class Action:
    """One pass of one micro-batch through a stage: ``kind`` is ``"F"`` (forward) or ``"B"`` (backward)."""

    kind: Kind
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


@dataclass(frozen=True)
class Slot:
    """When one action ran on its stage."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The schedule as it runs: every stage's slots in the order it ran them, and the step's length (the last
    slot's end: the pipeline is flushed at the end of every step)."""

    slots: tuple[tuple[Slot, ...], ...]
    makespan: float

    def busy(self, stage: int) -> float:
        """Time ``stage`` spent computing during the step."""
        return sum(slot.end - slot.start for slot in self.slots[stage])

    def bubble(self, stage: int) -> float:
        """Time ``stage`` spent waiting during the step."""
        return self.makespan - self.busy(stage)


def check_counts(stages: object, micro_batches: object) -> None:
    """A ValueError naming the argument unless both are integers >= 1."""
    for name, value in (("pp", stages), ("micro_batches", micro_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidValueError(f"{name} must be an integer >= 1, got {value!r}")


def one_f_one_b(stages: int, micro_batches: int, stage: int) -> list[Action]:
    """The actions of ``stage`` (0-based) of ``stages`` in 1F1B order, for ``micro_batches`` micro-batches."""
    check_counts(stages, micro_batches)
    if not 0 <= stage < stages:
        raise InvalidValueError(f"stage must be in [0, {stages}), got {stage!r}")
    warmup = min(stages - stage - 1, micro_batches)
    order = [Action(FORWARD, i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
    order += [Action(BACKWARD, i) for i in range(micro_batches - warmup, micro_batches)]
    return order


def in_flight(stages: int, micro_batches: int, stage: int) -> int:
    """The most micro-batches whose activations ``stage`` holds at once under 1F1B: ``min(p - s, m)``."""
    check_counts(stages, micro_batches)
    return min(stages - stage, micro_batches)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The share of a step every stage spends idle when all stages cost the same: ``(p - 1) / (m + p - 1)``."""
    check_counts(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def simulate(forward: Sequence[float], backward: Sequence[float], micro_batches: int, *,
             transfer: Sequence[float] | None = None) -> Timeline:
    """The 1F1B timeline of a pipeline whose stage ``s`` takes ``forward[s]`` and ``backward[s]`` per micro-batch.

    Every stage runs its :func:`one_f_one_b` actions in order, each as soon as the stage is free and its input is
    there: a forward pass needs the previous stage's forward pass of the same micro-batch, a backward pass the next
    stage's backward pass (the last stage's, its own forward pass, which comes earlier in its order).
    ``transfer[s]`` (default 0) is the time an activation or a gradient takes between stages ``s`` and ``s + 1``;
    transfers are assumed to overlap with computation (asynchronous send/recv). Exact for the given times.
    """
    stages = len(forward)
    check_counts(stages, micro_batches)
    links = [0.0] * (stages - 1) if transfer is None else list(transfer)
    _check_times("forward", forward, stages)
    _check_times("backward", backward, stages)
    _check_times("transfer", links, stages - 1)
    orders = [one_f_one_b(stages, micro_batches, s) for s in range(stages)]
    done: dict[tuple[int, Action], float] = {}
    slots: list[list[Slot]] = [[] for _ in range(stages)]
    free = [0.0] * stages
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for s, order in enumerate(orders):
            while len(slots[s]) < len(order):
                action = order[len(slots[s])]
                ready = _ready(done, s, action, stages, links)
                if ready is None:
                    break
                start = max(free[s], ready)
                cost = forward[s] if action.kind == FORWARD else backward[s]
                free[s] = done[(s, action)] = start + cost
                slots[s].append(Slot(action, start, free[s]))
                remaining -= 1
                progressed = True
        if not progressed:  # the 1F1B order never deadlocks; this guards the loop, not the schedule
            raise RuntimeError("the 1F1B simulation made no progress")
    return Timeline(tuple(tuple(stage) for stage in slots), max(free))


def _ready(done: dict[tuple[int, Action], float], stage: int, action: Action, stages: int,
           links: Sequence[float]) -> float | None:
    """When the input of ``action`` on ``stage`` is there, or None when the pass it waits for has not run."""
    if action.kind == FORWARD:
        if stage == 0:
            return 0.0
        before = done.get((stage - 1, action))
        return None if before is None else before + links[stage - 1]
    if stage == stages - 1:
        return done.get((stage, Action(FORWARD, action.micro_batch)))
    after = done.get((stage + 1, action))
    return None if after is None else after + links[stage]


def _check_times(name: str, times: Sequence[float], length: int) -> None:
    if len(times) != length:
        per = "stage boundary" if name == "transfer" else "stage"
        raise InvalidValueError(f"{name} must have {length} times (one per {per}), got {len(times)}")
    for value in times:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise InvalidValueError(f"{name} times must be finite numbers >= 0, got {value!r}")
