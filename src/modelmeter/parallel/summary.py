"""The cost of every rank of a parallel plan, from the one trace of one rank: FLOPs, parameters, memory,
communication and step time, ranks of equal cost folded into one entry (docs/parallel.md, "Per-rank summary").

Pure functions over the trace and the settings; nothing runs the model again. Without a pipeline every rank of the
plan runs the same program on its own shards and batch (the plan's ranks are symmetric), so the simulated rank
stands for all of them: one entry. With ``pp`` > 1 the trace is the rank's dp x fsdp x tp work on the whole model;
it is cut into stages (:func:`~modelmeter.parallel.pipeline.stage_costs`), one entry per stage, standing for the
ranks of that stage.

What a number is per: without a pipeline, the inputs given (one rank's micro-batch, one forward and backward pass
of it); with one, a step of ``micro_batches`` micro-batches under 1F1B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..devices.interconnect import Interconnect, get_interconnect
from ..engine.trace import Trace
from ..errors import InvalidValueError
from ..handles.conventions import get_convention
from ..metrics.communication import CollectiveCall, Communication, communication
from ..metrics.counting import Unit, count
from ..metrics.memory import MemoryModel, OptimizerSpec, optimizer_bytes, peak
from ..metrics.parameters import count_by_prefix
from ..metrics.roofline import RooflineSettings, roofline
from ..metrics.step_time import OVERLAP, step_time
from .pipeline import PipelineCost, StageCost, bytes_by_stage, event_stages, flop_units, split_stages, stage_costs
from .schedule import FORWARD

#: What the numbers of an entry are per (``RankCosts.per``).
PER_MICRO_BATCH, PER_STEP = "micro_batch", "step"
# The parts of a pipeline stage's memory that are the largest held at once over the run, not scaled by the stage
_TRANSIENT_KINDS = ("unsharded", "communication")
_PIPELINE_TIME = ("; pipeline: per step of {m} micro-batches under 1F1B, every micro-batch issuing the recorded "
                  "collectives again; a stage's forward and backward times include their exposed communication "
                  "before the schedule is simulated; sends between stages overlap computation and are not timed; "
                  "the optimizer step is not timed")
_ONE_PASS_TIME = "; one forward and backward pass of the inputs given (one rank's micro-batch)"


@dataclass(frozen=True)
class RankTime:
    """Seconds of one rank's step: ``compute`` (the roofline's), ``communication`` (every collective, hidden or
    not), ``exposed`` (what of it the compute does not hide), ``bubble`` (a pipeline stage's idle time; None
    without a pipeline) and the ``step``, under the stated ``assumption``."""

    compute: float
    communication: float
    exposed: float
    step: float
    bubble: float | None
    assumption: str

    def to_dict(self) -> dict[str, Any]:
        return {"compute": self.compute, "communication": self.communication, "exposed": self.exposed,
                "step": self.step, "bubble": self.bubble, "assumption": self.assumption}


@dataclass(frozen=True)
class RankCost:
    """The cost of each of the ranks ``first`` to ``last`` (inclusive; ``count`` of them), all equal: the pipeline
    ``stage`` they run (None without a pipeline), their FLOPs by pass (``backward`` with any recomputation), the
    parameter elements one rank holds (its shards) and the model's in all (``global_parameters``), the peak memory
    and its parts in bytes (None without a memory analysis), what it communicates (plain data: ``sent``,
    ``received``, ``by_kind``, ``by_dim``) and its step time (None without a device)."""

    first: int
    last: int
    count: int
    stage: int | None
    forward_flops: int
    backward_flops: int
    parameters: int
    global_parameters: int
    peak_memory: int | None
    memory_parts: Mapping[str, int] | None
    communication: Mapping[str, Any]
    time: RankTime | None
    #: The coordinates along mesh dimensions the entry's ranks are restricted to, where not every coordinate is
    #: alike (``{"tp": (0, 1, 2)}``: the tensor-parallel ranks holding the larger shards of an uneven split); None
    #: where the entry stands for every coordinate.
    coordinates: Mapping[str, tuple[int, ...]] | None = None

    @property
    def total_flops(self) -> int:
        return self.forward_flops + self.backward_flops

    def to_dict(self) -> dict[str, Any]:
        memory = None
        if self.peak_memory is not None:
            memory = {"peak": self.peak_memory, "parts": dict(self.memory_parts or {})}
        return {"ranks": [self.first, self.last], "count": self.count, "stage": self.stage,
                "flops": {"forward": self.forward_flops, "backward": self.backward_flops, "total": self.total_flops},
                "parameters": {"held": self.parameters, "global": self.global_parameters}, "memory": memory,
                "communication": _plain(self.communication),
                "time": None if self.time is None else self.time.to_dict(),
                "coordinates": None if self.coordinates is None else
                {dim: list(values) for dim, values in self.coordinates.items()}}


@dataclass(frozen=True)
class RankCosts:
    """Every rank of a plan, folded (:class:`RankCost` entries, in rank order), with the plan, the mesh and, under a
    pipeline, its stages, micro-batches and bubble (the share of all ranks' step spent idle). ``per`` says what the
    entries' numbers are per: ``"micro_batch"`` (the inputs given) or ``"step"`` (of ``micro_batches``)."""

    plan: str
    world_size: int
    mesh: Mapping[str, int]
    micro_batches: int | None
    per: str
    entries: tuple[RankCost, ...]
    bubble_fraction: float | None = None  # None: no schedule (a pipeline without a backward pass)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON): ``Result.parallel``."""
        pipeline = None
        if self.micro_batches is not None:
            pipeline = {"stages": len({entry.stage for entry in self.entries}), "micro_batches": self.micro_batches,
                        "bubble_fraction": self.bubble_fraction,
                        "schedule": None if self.bubble_fraction is None else "1F1B"}
        return {"plan": self.plan, "world_size": self.world_size, "mesh": dict(self.mesh),
                "micro_batches": self.micro_batches, "per": self.per,
                "ranks": [entry.to_dict() for entry in self.entries], "pipeline": pipeline}


def rank_costs(trace: Trace, *, convention: str = "fvcore", flops: Mapping[str, float] | None = None,
               memory: MemoryModel | None = None, optimizer: OptimizerSpec | None = None,
               time: RooflineSettings | None = None, compute: Mapping[str, float] | None = None,
               interconnect: Interconnect | None = None, calls: Communication | None = None,
               count_units: Callable[[], Sequence[Unit]] | None = None) -> RankCosts:
    """The per-rank cost of the parallel run ``trace`` records (``trace.parallel`` set).

    ``flops``: the rank's FLOPs by phase, when counted already (else counted under ``convention``). ``memory``: the
    trace's memory model, for the peak and its parts with ``optimizer``'s state (None: no memory). ``time``: the
    roofline's settings, for the step time (None: no time), with ``compute`` (seconds by phase, a roofline's
    ``summary["time"]``, when predicted already) and ``interconnect`` (default: the device's own). ``calls``: the
    trace's communication, when totalled already (else totalled here). ``count_units``: counts the rank's FLOPs
    event by event as ``flops`` were counted (an analysis's handles and attention settings:
    :meth:`~modelmeter.FlopCountAnalysis.units`), what a pipeline's stages are summed from (else the stages count
    under ``convention``'s table).
    """
    parallel = trace.parallel
    if not isinstance(parallel, dict):
        raise InvalidValueError("rank_costs needs the trace of a parallel run: analyse with parallel=")
    links = None
    if time is not None:
        links = interconnect if interconnect is not None else get_interconnect(time.device)
    mesh = {str(k): int(v) for k, v in parallel["mesh"].items()}
    world = int(parallel["world_size"])
    plan = str(parallel["plan"])
    whole = sum(info.global_params for info in trace.modules)
    if calls is None:
        calls = communication(trace)
    pp = mesh.get("pp", 1)
    if pp == 1:
        entry = _every_rank(trace, calls, world, whole, convention, flops, memory, optimizer, time, compute, links)
        return _own_class(RankCosts(plan, world, mesh, None, PER_MICRO_BATCH, (entry,)), parallel)
    micro_batches = int(parallel["options"]["micro_batches"])
    counted = _Counted(convention, flop_units(trace, convention) if count_units is None else count_units())
    entries, bubble = _pipeline(trace, calls, pp, micro_batches, world, whole, counted, memory, optimizer, time,
                                links)
    return _own_class(RankCosts(plan, world, mesh, micro_batches, PER_STEP, entries, bubble), parallel)


def tp_peers(trace: Trace) -> list[int]:
    """The ranks whose runs :func:`rank_costs` needs besides the one ``trace`` records, to cost every rank of an
    uneven tensor-parallel split: one of each other group of tensor-parallel coordinates holding other shards (the
    simulated rank's other coordinates kept). Empty when every tensor-parallel rank holds alike."""
    parallel = trace.parallel or {}
    classes = parallel.get("tp_classes") or []
    own = int(parallel.get("coordinates", {}).get("tp", 0))
    rank = int(parallel.get("rank", 0))
    return [rank - own + group[0] for group in classes if own not in group]


def with_peers(own: RankCosts, peers: Iterable[RankCosts]) -> RankCosts:
    """``own``'s entries and those of its :func:`tp_peers`' costs in one summary, in rank order (by stage first):
    each entry stands for its own group of tensor-parallel coordinates."""
    entries: list[RankCost] = []
    for entry in [*own.entries, *(entry for costs in peers for entry in costs.entries)]:
        alike = next((i for i, kept in enumerate(entries) if _same_cost(kept, entry)), None)
        if alike is None:
            entries.append(entry)
        else:  # shards of other sizes, and yet the same cost: one row, as ranks of equal cost are
            entries[alike] = _joined(entries[alike], entry, own.mesh["tp"])
    entries.sort(key=lambda entry: (-1 if entry.stage is None else entry.stage, entry.first))
    return replace(own, entries=tuple(entries))


def _same_cost(one: RankCost, other: RankCost) -> bool:
    """Whether two entries of one stage cost the same (all but the ranks they stand for)."""
    return replace(one, first=0, last=0, count=0, coordinates=None) == \
        replace(other, first=0, last=0, count=0, coordinates=None)


def _joined(one: RankCost, other: RankCost, tp: int) -> RankCost:
    """One entry for the ranks of two of equal cost (groups of tensor-parallel coordinates of one stage)."""
    coordinates = tuple(sorted({*(one.coordinates or {}).get("tp", ()), *(other.coordinates or {}).get("tp", ())}))
    return replace(one, first=min(one.first, other.first), last=max(one.last, other.last),
                   count=one.count + other.count, coordinates=None if len(coordinates) == tp else {"tp": coordinates})


def _own_class(costs: RankCosts, parallel: Mapping[str, Any]) -> RankCosts:
    """``costs`` with every entry restricted to the ranks whose tensor-parallel coordinate is in the simulated rank's
    group (``parallel["tp_classes"]``), when the plan's tensor-parallel ranks do not all hold alike; the others hold
    other shards, and are other runs' (:func:`tp_peers`)."""
    own = int(parallel.get("coordinates", {}).get("tp", 0))
    group = next((g for g in parallel.get("tp_classes") or [] if own in g), None)
    if group is None:
        return costs
    tp = costs.mesh["tp"]  # innermost: a rank's tensor-parallel coordinate is its rank modulo tp
    entries = tuple(replace(entry, first=entry.first + min(group), last=entry.last - (tp - 1 - max(group)),
                            count=entry.count // tp * len(group), coordinates={"tp": tuple(group)})
                    for entry in costs.entries)
    return replace(costs, entries=entries)


def _every_rank(trace: Trace, calls: Communication, world: int, whole: int, convention: str,
                flops: Mapping[str, float] | None, memory: MemoryModel | None, optimizer: OptimizerSpec | None,
                time: RooflineSettings | None, compute: Mapping[str, float] | None,
                links: Interconnect | None) -> RankCost:
    """The one entry of a plan without a pipeline: the simulated rank, standing for all ``world`` ranks."""
    by_phase = dict(flops) if flops is not None else _flops_by_phase(trace, convention)
    forward = round(by_phase.get("forward", 0))
    backward = round(sum(value for phase, value in by_phase.items() if phase != "forward"))
    top = None if memory is None else peak(memory, optimizer)
    rank_time = None
    if time is not None and links is not None:
        if compute is None:
            compute = roofline(trace, time, optimizer=optimizer).summary["time"]
        step = step_time(calls, compute, links)
        seconds = sum(step.compute.values())
        rank_time = RankTime(seconds, step.communication, step.total - seconds, step.total, None,
                             step.assumption + _ONE_PASS_TIME)
    return RankCost(0, world - 1, world, None, forward, backward, count_by_prefix(trace.modules)[""], whole,
                    None if top is None else top.bytes, None if top is None else dict(top.by_kind),
                    _volumes(calls.calls), rank_time)


def _flops_by_phase(trace: Trace, convention: str) -> dict[str, float]:
    chosen = get_convention(convention)
    stats = count(trace, chosen.handles, elementwise=chosen.elementwise)
    return {phase: sum(table.get("", {}).values()) for phase, table in stats.by_phase.items()}


@dataclass(frozen=True)
class _Counted:
    """How a pipeline's stages count FLOPs: the ``convention``'s name and the rank's counts event by event (``units``,
    taken as the rank's FLOPs were: with the analysis's handles)."""

    convention: str
    units: Sequence[Unit]


def _pipeline(trace: Trace, calls: Communication, pp: int, micro_batches: int, world: int, whole: int,
              counted: _Counted, memory: MemoryModel | None, optimizer: OptimizerSpec | None,
              time: RooflineSettings | None, links: Interconnect | None) -> tuple[tuple[RankCost, ...], float | None]:
    """One entry per stage (the stage's share of the rank's work, per step of ``micro_batches``) and the share of
    the step all ranks spend idle (None for a run without a backward pass, which has no 1F1B schedule)."""
    stages = event_stages(trace, pp)
    stage_calls = [Communication([call for call in calls.calls if stages[call.event] == s]) for s in range(pp)]
    if not trace.backward:
        return _forward_pipeline(trace, stage_calls, micro_batches, world, whole, counted), None
    cost = stage_costs(trace, pp, micro_batches, convention=counted.convention, device=time, units=counted.units)
    times: list[RankTime | None] = [None] * pp
    if time is not None and links is not None:
        cost, times = _timed(trace, cost, stage_calls, links, counted.units)
    per_stage = world // pp
    trained = _trained_shares(trace, cost)
    entries = []
    for rank in cost.ranks:
        first = rank.stage * per_stage
        top, parts = _stage_memory(memory, optimizer, cost, rank, trained)
        entries.append(RankCost(
            first, first + per_stage - 1, per_stage, rank.stage, round(rank.forward_flops),
            round(rank.backward_flops), rank.parameters, whole, top, parts,
            _volumes(stage_calls[rank.stage].calls, micro_batches, _pipeline_transfers(cost, rank)),
            times[rank.stage]))
    return tuple(entries), cost.bubble_fraction


def _forward_pipeline(trace: Trace, stage_calls: list[Communication], micro_batches: int, world: int, whole: int,
                      counted: _Counted) -> tuple[RankCost, ...]:
    """The stages of a run without a backward pass (inference): FLOPs, parameters and communication per step of
    ``micro_batches``, each stage sending its last block's activation forward; no memory or time (the 1F1B schedule
    and its held activations are a training step's)."""
    _, stages = split_stages(trace, len(stage_calls), convention=counted.convention, units=counted.units)
    per_stage = world // len(stages)
    entries = []
    for stage in stages:
        received = stages[stage.index - 1].activation_out if stage.index > 0 else 0
        m = micro_batches
        transfers = {"send": _transfer(m * (stage.activation_out > 0), m * stage.activation_out, True),
                     "recv": _transfer(m * (received > 0), m * received, False)}
        first = stage.index * per_stage
        entries.append(RankCost(
            first, first + per_stage - 1, per_stage, stage.index, round(micro_batches * stage.forward_flops), 0,
            stage.parameters, whole, None, None,
            _volumes(stage_calls[stage.index].calls, m, transfers), None))
    return tuple(entries)


def _transfer(count: int, nbytes: int, sent: bool) -> dict[str, float]:
    """A send (``sent``) or a receive of ``nbytes`` in ``count`` transfers, as a kind's volume."""
    return {"count": count, "payload": nbytes, "sent": float(nbytes) if sent else 0.0,
            "received": 0.0 if sent else float(nbytes)}


def _timed(trace: Trace, compute_only: PipelineCost, stage_calls: list[Communication], links: Interconnect,
           units: Sequence[Unit]) -> tuple[PipelineCost, list[RankTime | None]]:
    """The pipeline simulated again with every stage's forward and backward times including the exposed part of the
    stage's collectives (per micro-batch, as :func:`~modelmeter.metrics.step_time.step_time` times them), and
    each stage's time per step."""
    m = compute_only.micro_batches
    steps = []
    for s, calls in enumerate(stage_calls):
        slots = compute_only.timeline.slots[s]
        forward = next(slot.end - slot.start for slot in slots if slot.action.kind == FORWARD)
        backward = next(slot.end - slot.start for slot in slots if slot.action.kind != FORWARD)
        steps.append(step_time(calls, {"forward": forward, "backward": backward}, links))
    passes = [(step.phase("forward"), sum(step.phase(p) for p in step.phases() if p != "forward")) for step in steps]
    cost = stage_costs(trace, compute_only.pp, m, convention=compute_only.convention, times=passes, units=units)
    assumption = OVERLAP + _PIPELINE_TIME.format(m=m)
    times: list[RankTime | None] = []
    for step, rank in zip(steps, cost.ranks, strict=True):
        seconds = m * sum(step.compute.values())
        times.append(RankTime(seconds, m * step.communication, rank.busy_time - seconds, rank.step_time,
                              rank.bubble_time, assumption))
    return cost, times


def _pipeline_transfers(cost: PipelineCost, rank: StageCost) -> dict[str, dict[str, float]]:
    """The stage's sends and receives between stages, per step: one activation forward and one gradient backward
    per micro-batch and neighbour (kind -> count, payload, sent, received)."""
    n = cost.micro_batches * ((rank.stage > 0) + (rank.stage < cost.pp - 1))
    return {"send": _transfer(n, rank.send_bytes, True), "recv": _transfer(n, rank.recv_bytes, False)}


def _volumes(calls: Iterable[CollectiveCall], times: int = 1,
             transfers: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """The communication of an entry as plain data: every call ``times`` over, and the pipeline's ``transfers``
    (mesh dimension ``pp``)."""
    by_kind: dict[str, dict[str, float]] = {}
    by_dim: dict[str, dict[str, float]] = {}
    for call in calls:
        kind = by_kind.setdefault(call.kind, {"count": 0, "payload": 0, "sent": 0.0, "received": 0.0})
        dim = by_dim.setdefault(call.dim, {"count": 0, "sent": 0.0, "received": 0.0})
        for table in (kind, dim):
            table["count"] += times
            table["sent"] += times * call.sent
            table["received"] += times * call.received
        kind["payload"] += times * call.payload
    for kind_name, volume in (transfers or {}).items():
        if volume["count"]:
            by_kind[kind_name] = dict(volume)
            dim = by_dim.setdefault("pp", {"count": 0, "sent": 0.0, "received": 0.0})
            for key in ("count", "sent", "received"):
                dim[key] += volume[key]
    return {"sent": sum(v["sent"] for v in by_kind.values()), "received": sum(v["received"] for v in by_kind.values()),
            "by_kind": by_kind, "by_dim": by_dim}


def _trained_shares(trace: Trace, cost: PipelineCost) -> list[float]:
    """Each stage's share of the bytes of the parameters the rank trains (its parameter bytes less those of its
    frozen parameters, ``trace.parallel["frozen"]``): the share of the gradients and optimizer state it keeps."""
    frozen = (trace.parallel or {}).get("frozen") or {}
    held = [stage.parameter_bytes for stage in cost.stages]
    if frozen:
        held = [total - part for total, part in zip(held, bytes_by_stage(trace, cost, frozen), strict=True)]
    total = sum(held)
    return [part / total if total else 0.0 for part in held]


def _stage_memory(memory: MemoryModel | None, optimizer: OptimizerSpec | None, cost: PipelineCost,
                  rank: StageCost, trained: list[float]) -> tuple[int | None, dict[str, int] | None]:
    """A pipeline stage's memory, an upper bound: its parameter bytes; the rank's gradients and optimizer state in
    the stage's share of the trained parameters' bytes (``trained``); the activations of its in-flight
    micro-batches; the most unsharded parameters and communication buffers the rank's run held at once; all taken
    as live together."""
    if memory is None:
        return None, None
    trace = memory.trace
    share = trained[rank.stage]
    at_end = memory.live_by_kind(len(trace.events))
    state = optimizer_bytes(trace, optimizer)[0] if optimizer is not None else 0
    parts = {"parameter": rank.parameter_bytes, "gradient": round(share * at_end.get("gradient", 0)),
             "optimizer_state": round(share * state), "activation": rank.activation_bytes,
             **{kind: _most_live(trace, kind) for kind in _TRANSIENT_KINDS}}
    parts = {kind: value for kind, value in parts.items() if value}
    return sum(parts.values()), parts


def _most_live(trace: Trace, kind: str) -> int:
    """The most bytes of storages of ``kind`` live at once over the run."""
    changes: list[tuple[int, int]] = []
    for storage in trace.storages:
        if storage.kind == kind:
            changes.append((storage.born, storage.nbytes))
            if storage.died >= 0:
                changes.append((storage.died, -storage.nbytes))
    most = live = 0
    for _, delta in sorted(changes):  # at one event, frees (negative) come first: freed before it runs
        live += delta
        most = max(most, live)
    return most


def _plain(communication: Mapping[str, Any]) -> dict[str, Any]:
    return {key: ({k: dict(v) for k, v in value.items()} if isinstance(value, Mapping) else value)
            for key, value in communication.items()}
