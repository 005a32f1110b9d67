"""Pipeline parallelism derived from one recorded trace: the model cut into ``pp`` stages between its repeated
blocks, what every stage computes, holds and sends per micro-batch, and the cost of a 1F1B step on every rank.

torch.distributed.pipelining's schedules pass activations between live stages with send/recv, which one process on
a fake process group cannot run; so nothing here runs torch's pipelining: the stages are cut out of the trace of the
whole model (one micro-batch, forward and backward) and the schedule is simulated (:mod:`.schedule`).
docs/parallel.md, "The pipeline (1F1B)", says what is assumed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..devices import Device, get_device
from ..engine.trace import ModuleInfo, Trace
from ..errors import InvalidValueError, ModelMeterError
from ..handles.conventions import Convention, get_convention
from ..handles.sizes import itemsize
from ..metrics.counting import Unit, count
from ..metrics.roofline import RooflineSettings, unit_times
from . import schedule
from .schedule import Timeline

# The containers a model keeps its repeated blocks in (torchtitan keeps them in a ModuleDict)
BLOCK_CONTAINERS = ("ModuleList", "ModuleDict", "Sequential")


class PipelineSplitError(ModelMeterError, ValueError):
    """The model cannot be cut into the pipeline stages asked for; the message says why and what is needed."""


@dataclass(frozen=True)
class BlockList:
    """The model's repeated blocks, which stages are cut between: the container's canonical name, the blocks' class
    and their canonical names in order."""

    container: str
    block_type: str
    blocks: tuple[str, ...]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage, per micro-batch (the recorded run): its blocks (the first stage also runs what comes
    before the first block, the last what comes after the last), FLOPs by phase (``recompute``: forward work run
    again in the backward pass), its parameters, the activation bytes its forward pass saves for the backward pass,
    and the bytes it sends: forward to the next stage, the activation its last block returns (``activation_out``);
    backward to the previous stage, the gradient of the activation it got from there (``gradient_out``: of its
    floating-point tensors)."""

    index: int
    blocks: tuple[str, ...]
    forward_flops: float
    backward_flops: float
    recompute_flops: float
    parameters: int
    parameter_bytes: int
    saved_bytes: int
    activation_out: int
    gradient_out: int


@dataclass(frozen=True)
class StageCost:
    """One pipeline rank's cost of a training step of ``micro_batches`` micro-batches under 1F1B.

    FLOPs are per step (backward includes recomputation); ``activation_bytes`` is the most saved activation bytes
    held at once (``in_flight`` micro-batches' worth); ``send_bytes`` and ``recv_bytes`` are per step, activations
    forward and gradients backward together. Times are in the pipeline's ``time_unit``."""

    stage: int
    blocks: tuple[str, ...]
    forward_flops: float
    backward_flops: float
    parameters: int
    parameter_bytes: int
    in_flight: int
    activation_bytes: int
    send_bytes: int
    recv_bytes: int
    busy_time: float
    bubble_time: float
    step_time: float


@dataclass(frozen=True)
class PipelineCost:
    """The per-rank cost of a 1F1B pipeline (``ranks``, one per stage), the stages it was derived from (per
    micro-batch), the block list they were cut from and the simulated timeline. ``time_unit`` is ``"s"`` when
    times were given or derived from a FLOP rate, else ``"flop"`` (a stage's time is its FLOP count)."""

    pp: int
    micro_batches: int
    convention: str
    time_unit: str
    block_list: BlockList
    stages: tuple[Stage, ...]
    ranks: tuple[StageCost, ...]
    timeline: Timeline
    schedule: str = "1F1B"

    @property
    def step_time(self) -> float:
        return self.timeline.makespan

    @property
    def bubble_fraction(self) -> float:
        """The share of all ranks' step time spent idle."""
        if self.step_time == 0:
            return 0.0
        return sum(rank.bubble_time for rank in self.ranks) / (self.pp * self.step_time)


def find_blocks(trace: Trace) -> BlockList:
    """The model's repeated block list: the largest ModuleList, ModuleDict or Sequential whose children are two or
    more distinct modules of one class that all ran (the first such, on a tie), among those that lie in no block of
    another: a layer's own list (its experts, a stage's blocks) is not where a pipeline is cut."""
    table = trace.module_table()
    found: list[BlockList] = []
    for info in trace.modules:
        children = tuple(child for _, child in info.children if child is not None)
        if info.type not in BLOCK_CONTAINERS or len(children) < 2 or len(children) != len(info.children):
            continue
        kinds = {table[child].type for child in children}
        if len(kinds) != 1 or len(set(children)) != len(children) or not trace.called.issuperset(children):
            continue
        found.append(BlockList(info.name, kinds.pop(), children))
    best: BlockList | None = None
    for candidate in found:
        nested = any(_within(candidate.container, block) for other in found for block in other.blocks)
        if not nested and (best is None or len(candidate.blocks) > len(best.blocks)):
            best = candidate
    if best is None:
        raise PipelineSplitError(
            f"{trace.model or 'the model'} has no repeated block list to cut into pipeline stages: pipeline "
            f"parallelism needs a {', '.join(BLOCK_CONTAINERS[:-1])} or {BLOCK_CONTAINERS[-1]} of two or more "
            "modules of one class (the model's layers) that its forward calls")
    return best


def check_stages(trace: Trace, pp: int) -> None:
    """Raise :class:`PipelineSplitError` unless the model of ``trace`` can be cut into ``pp`` stages of at least one
    block each (with ``pp`` > 1: a repeated block list of ``pp`` or more blocks), naming ``pp`` and the blocks found:
    what the plan's runner checks as soon as the rank's run is recorded, before anything is counted."""
    if pp > 1:
        _layout(find_blocks(trace), pp, None, trace.model)


def _within(name: str, module: str) -> bool:
    """Whether module ``name`` is ``module`` or lies inside it."""
    return name == module or name.startswith(f"{module}.")


def even_layout(blocks: int, pp: int) -> list[int]:
    """Blocks per stage, as even as possible; the first ``blocks % pp`` stages take one more."""
    base, extra = divmod(blocks, pp)
    return [base + 1 if s < extra else base for s in range(pp)]


def split_stages(trace: Trace, pp: int, *, convention: str = "fvcore", layout: Sequence[int] | None = None,
                 units: Sequence[Unit] | None = None) -> tuple[BlockList, list[Stage]]:
    """Cut the model of ``trace`` into ``pp`` stages between its repeated blocks (:func:`find_blocks`).

    ``layout`` gives the number of blocks of every stage (default :func:`even_layout`); everything before the first
    block goes to the first stage, everything after the last to the last stage. An event belongs to the stage of the
    innermost block on its module stack; a forward event outside every block to the stage of the block that ran last
    before it (the first stage before any); a backward event outside every block to the stage of the forward call
    whose autograd node ran it, else to the last stage its module ran forward work in (the loss: the last stage); a
    recomputed one (activation checkpointing) outside every block to the stage of the backward pass it feeds.
    FLOPs are counted under ``convention``, or summed from ``units``: the trace's counts as an analysis took them
    (:meth:`~modelmeter.FlopCountAnalysis.units`: its handles and attention settings). With ``pp=1`` the one stage
    is the whole model, repeated blocks or not.
    """
    cut = _cut(trace, pp, layout)
    return cut.blocks, _stages(trace, cut, _units(trace, convention, units))


def event_stages(trace: Trace, pp: int, *, layout: Sequence[int] | None = None) -> list[int]:
    """The stage of every event of ``trace`` (by index) when the model is cut into ``pp`` stages as
    :func:`split_stages` cuts it: what a per-stage metric (the collectives of a stage) splits the trace by."""
    return list(_cut(trace, pp, layout).placement.events)


@dataclass(frozen=True)
class _Cut:
    """Where the stages of a trace are: the block list, the blocks per stage, and every event's stage."""

    blocks: BlockList
    counts: list[int]
    placement: _Placement


def _cut(trace: Trace, pp: int, layout: Sequence[int] | None) -> _Cut:
    schedule.check_counts(pp, 1)
    try:
        found = find_blocks(trace)
    except PipelineSplitError:
        if pp > 1 or layout is not None:
            raise
        found = BlockList("", "", ())  # one stage is the whole model, blocks or not
    counts = [len(found.blocks)] if pp == 1 and layout is None else _layout(found, pp, layout, trace.model)
    block_stage: dict[str, int] = {}
    first = 0
    for s, n in enumerate(counts):
        block_stage.update((name, s) for name in found.blocks[first:first + n])
        first += n
    return _Cut(found, counts, _Placement(trace, block_stage, pp - 1))


def flop_units(trace: Trace, convention: str | Convention = "fvcore") -> list[Unit]:
    """The FLOP counts of ``trace``'s events (:class:`~modelmeter.metrics.counting.Unit`) under ``convention``'s
    table: a name, or a :class:`~modelmeter.handles.conventions.Convention` got with its attention settings."""
    chosen = get_convention(convention) if isinstance(convention, str) else convention
    units: list[Unit] = []
    count(trace, chosen.handles, elementwise=chosen.elementwise, units=units, tables=False)
    return units


def _units(trace: Trace, convention: str, units: Sequence[Unit] | None) -> Sequence[Unit]:
    """``units`` when given, else the FLOP counts of ``trace`` under ``convention``'s table."""
    return flop_units(trace, convention) if units is None else units


def _stages(trace: Trace, cut: _Cut, units: Sequence[Unit]) -> list[Stage]:
    pp, found, where = len(cut.counts), cut.blocks, cut.placement
    ends = [sum(cut.counts[:s + 1]) for s in range(pp)]
    last_blocks = [found.blocks[end - 1] for end in ends[:-1]]  # what sends to the next stage
    flops = _flops_by_stage(trace, where, pp, units)
    params, param_bytes = _parameters_by_stage(trace, where, found, pp)
    sent = [_returned(trace, block) for block in last_blocks]
    saved = _saved_by_stage(trace, where, last_blocks, sent)
    stages = []
    for s in range(pp):
        blocks = found.blocks[ends[s] - cut.counts[s]:ends[s]]
        out = sum(t.nbytes for t in sent[s]) if s < pp - 1 else 0
        grad = sum(t.nbytes for t in sent[s - 1] if t.floating) if s > 0 else 0
        stages.append(Stage(s, blocks, flops[s]["forward"], flops[s]["backward"], flops[s]["recompute"], params[s],
                            param_bytes[s], saved[s], out, grad))
    return stages


def stage_costs(trace: Trace, pp: int, micro_batches: int, *, convention: str = "fvcore",
                layout: Sequence[int] | None = None, device: str | Device | RooflineSettings | None = None,
                flops_per_second: float | None = None, times: Sequence[tuple[float, float]] | None = None,
                bandwidth: float | None = None, units: Sequence[Unit] | None = None) -> PipelineCost:
    """The per-rank cost of one training step of ``micro_batches`` micro-batches on a ``pp``-stage 1F1B pipeline.

    ``trace`` is the run of one micro-batch with a backward pass; the stages are cut as :func:`split_stages` says
    (``layout``), their FLOPs counted as it counts them (``convention``, or the analysis's ``units``).
    A stage's time per micro-batch (one of these at most) is ``times[s]`` (forward, backward seconds); or the
    roofline time of its operators on ``device`` (a name, a :class:`~modelmeter.devices.Device`, or
    :class:`~modelmeter.metrics.roofline.RooflineSettings` with an efficiency; docs/roofline.md); or its FLOPs
    divided by ``flops_per_second``; else its FLOP count (``time_unit`` ``"flop"``: only ratios mean anything then).
    ``bandwidth`` (bytes per second between neighbouring stages, needs times in seconds) adds the transfer of the
    boundary activation and gradient to the simulated timeline, overlapped with computation.
    """
    schedule.check_counts(pp, micro_batches)
    if not trace.backward:
        raise InvalidValueError("stage_costs needs the trace of a training step: record it with backward=True")
    if sum(option is not None for option in (times, device, flops_per_second)) > 1:
        raise InvalidValueError("pass one of times, device and flops_per_second, not several")
    cut = _cut(trace, pp, layout)
    stages = _stages(trace, cut, _units(trace, convention, units))
    if device is not None:
        forward, backward = _roofline_by_stage(trace, cut.placement, pp, device)
        unit = "s"
    else:
        forward, backward, unit = _stage_times(stages, flops_per_second, times)
    transfer = None
    if bandwidth is not None:
        if unit != "s":
            raise InvalidValueError("bandwidth needs times in seconds: pass times, device or flops_per_second with it")
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
            raise InvalidValueError(f"bandwidth must be a number of bytes per second > 0, got {bandwidth!r}")
        transfer = [max(stage.activation_out, stages[s + 1].gradient_out) / bandwidth
                    for s, stage in enumerate(stages[:-1])]
    timeline = schedule.simulate(forward, backward, micro_batches, transfer=transfer)
    m = micro_batches
    ranks = []
    for s, stage in enumerate(stages):
        sends = stage.activation_out + stage.gradient_out
        receives = (stages[s - 1].activation_out if s > 0 else 0) + (stages[s + 1].gradient_out if s < pp - 1 else 0)
        held = schedule.in_flight(pp, m, s)
        ranks.append(StageCost(
            stage=s, blocks=stage.blocks, forward_flops=m * stage.forward_flops,
            backward_flops=m * (stage.backward_flops + stage.recompute_flops), parameters=stage.parameters,
            parameter_bytes=stage.parameter_bytes, in_flight=held, activation_bytes=held * stage.saved_bytes,
            send_bytes=m * sends, recv_bytes=m * receives, busy_time=timeline.busy(s), bubble_time=timeline.bubble(s),
            step_time=timeline.makespan))
    return PipelineCost(pp, m, get_convention(convention).name, unit, cut.blocks, tuple(stages), tuple(ranks),
                        timeline)


def _layout(found: BlockList, pp: int, layout: Sequence[int] | None, model: str) -> list[int]:
    """Blocks per stage: ``layout`` checked, or :func:`even_layout`."""
    blocks = len(found.blocks)
    where = f"{model or 'the model'}'s {found.container!r}" if found.container else (model or "the model")
    if layout is None:
        if pp > blocks:
            raise PipelineSplitError(f"pp={pp} stages need at least {pp} blocks, but {where} holds {blocks} "
                                     f"{found.block_type} blocks: use pp <= {blocks}")
        return even_layout(blocks, pp)
    counts = list(layout)
    if len(counts) != pp or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts) \
            or sum(counts) != blocks:
        raise PipelineSplitError(f"layout must give {pp} block counts >= 1 (one per stage) adding up to the {blocks} "
                                 f"{found.block_type} blocks of {where}, got {layout!r}")
    return counts


class _Placement:
    """The stage of every event of a trace and of every module (see :func:`split_stages`)."""

    def __init__(self, trace: Trace, block_stage: dict[str, int], last: int) -> None:
        self.last = last
        self.in_block: dict[int, int | None] = {}  # scope -> stage of its innermost block, None outside every block
        for index, stack in enumerate(trace.scopes):
            stage = None
            for name in reversed(stack):
                stage = _block_of(name, block_stage)
                if stage is not None:
                    break
            self.in_block[index] = stage
        self.events = [0] * len(trace.events)
        self.modules: dict[str, int] = {}  # module -> stage of its first forward event
        latest: dict[int, int] = {}  # scope -> the last stage it ran forward work in
        current = 0
        for i, event in enumerate(trace.events):
            if event.phase != "forward":
                continue
            block = self.in_block[event.scope]
            if block is not None:
                current = block
            self.events[i] = current
            if event.scope not in latest:
                for name in trace.scopes[event.scope]:
                    self.modules.setdefault(name, current)
            latest[event.scope] = max(current, latest.get(event.scope, 0))
        following = last  # the stage of the backward event after it: the one a recomputation outside blocks feeds
        for i in reversed(range(len(trace.events))):
            event = trace.events[i]
            if event.phase == "forward":
                continue
            block = self.in_block[event.scope]
            if block is not None:
                self.events[i] = block
            elif event.phase == "recompute":
                self.events[i] = following
            elif event.origin >= 0:
                self.events[i] = self.events[event.origin]
            else:
                self.events[i] = latest.get(event.scope, last)
            if event.phase == "backward":
                following = self.events[i]

    def module(self, name: str, before: bool) -> int:
        """The stage of module ``name``: of its first forward event; for a module that never ran, the first stage
        when it comes ``before`` the block list in the model, else the last."""
        found = self.modules.get(name)
        if found is not None:
            return found
        return 0 if before else self.last


def _block_of(name: str, block_stage: dict[str, int]) -> int | None:
    """The stage of the block module ``name`` is (a canonical name under a block's is inside it; a block re-run by
    activation checkpointing is on no stack of its own), or None."""
    while True:
        found = block_stage.get(name)
        if found is not None or "." not in name:
            return found
        name = name.rpartition(".")[0]


def _flops_by_stage(trace: Trace, where: _Placement, pp: int, units: Sequence[Unit]) -> list[dict[str, float]]:
    out = [{"forward": 0.0, "backward": 0.0, "recompute": 0.0} for _ in range(pp)]
    for unit in units:
        out[where.events[unit.event]][trace.events[unit.event].phase] += unit.total
    return out


def _parameters_by_stage(trace: Trace, where: _Placement, found: BlockList, pp: int) -> tuple[list[int], list[int]]:
    """Parameter elements and bytes per stage (each parameter once, under its first owner, as the module table
    counts it)."""
    return (_by_stage(trace, where, found, pp, lambda info: info.params),
            _by_stage(trace, where, found, pp, lambda info: info.param_bytes))


def bytes_by_stage(trace: Trace, cost: PipelineCost, by_module: Mapping[str, int]) -> list[int]:
    """``by_module`` (bytes of a module's own parameters, by module name) summed per stage of the model of ``trace``
    cut as ``cost`` cut it (its stages' blocks, an uneven layout given to :func:`stage_costs` included), each
    module's on the stage its parameters belong to."""
    layout = None if cost.pp == 1 else [len(stage.blocks) for stage in cost.stages]
    cut = _cut(trace, cost.pp, layout)
    return _by_stage(trace, cut.placement, cut.blocks, cost.pp, lambda info: by_module.get(info.name, 0))


def _by_stage(trace: Trace, where: _Placement, found: BlockList, pp: int,
              value: Callable[[ModuleInfo], int]) -> list[int]:
    """``value`` of every module holding parameters, summed per stage: a module's parameters belong to the stage of
    its first forward call (before the first block: the first stage)."""
    totals = [0] * pp
    before = True
    for info in trace.modules:
        if info.name == found.container:
            before = False
        if info.parameters:
            totals[where.module(info.name, before)] += value(info)
    return totals


def _saved_by_stage(trace: Trace, where: _Placement, last_blocks: list[str], sent: list[list[_Returned]]) -> list[int]:
    """Activation bytes each stage holds for its backward pass, per micro-batch: what its forward pass saves (as
    :func:`~modelmeter.metrics.memory.saved_bytes` counts it: each storage once, parameters and inputs left out;
    saved inside a block: that block's stage, else the stage that ran the event saving it), and every activation it
    sends to the next stage or receives from the previous one — torch's ``PipelineStage`` keeps both until the
    micro-batch's backward pass (``sent[s]``: what the last block of stage ``s``, ``last_blocks[s]``, returns)."""
    pp = len(sent) + 1
    out = [0] * pp
    boundary: set[int] = set()
    for s, tensors in enumerate(sent):
        boundary |= _returned_storages(trace, last_blocks[s], tensors)
        out[s] += sum(t.nbytes for t in tensors)
        out[s + 1] += sum(t.nbytes for t in tensors)
    for index, storage in enumerate(trace.storages):
        if storage.saved < 0 or storage.kind != "activation" or index in boundary:
            continue
        stage = where.in_block.get(storage.saved_scope)
        if stage is None:
            stage = where.events[max(storage.saved - 1, 0)]
        out[stage] += storage.nbytes
    return out


@dataclass(frozen=True)
class _Returned:
    """One tensor a block's forward call returned: its bytes and whether it is floating-point."""

    nbytes: int
    floating: bool


def _returned(trace: Trace, block: str) -> list[_Returned]:
    """The tensors ``block``'s forward calls returned (``Trace.output_shapes``), each in the dtype of the last tensor
    of its shape the run had made by the end of the block's last forward event (tensors beyond the first four of a
    call, which ``output_shapes`` does not describe, are left out)."""
    out = []
    for shapes, calls in trace.output_shapes.get(block, {}).items():
        for text in shapes.split(", "):
            if text.startswith("+"):
                continue
            shape = () if text == "scalar" else tuple(int(n) for n in text.split("x"))
            dtype = _dtype_of(trace, block, shape)
            elements = 1
            for n in shape:
                elements *= n
            out += [_Returned(elements * itemsize(dtype), dtype.startswith(("float", "bfloat", "complex")))] * calls
    return out


def _dtype_of(trace: Trace, block: str, shape: tuple[int, ...]) -> str:
    """The dtype of the last tensor of ``shape`` an event had returned by the end of ``block``'s last forward event
    (the model's inputs when none had); float32 when no tensor of that shape is in the trace."""
    end = max(_block_events(trace, block), default=-1)
    for event in reversed(trace.events[:end + 1]):
        for value in event.outputs:
            for meta in value if isinstance(value, list) else (value,):
                if getattr(meta, "shape", None) == shape:
                    return str(meta.dtype)
    for meta in trace.inputs:
        if meta.shape == shape:
            return meta.dtype
    return "float32"


def _block_events(trace: Trace, block: str) -> list[int]:
    """The forward events run inside ``block``."""
    scopes = {i for i, stack in enumerate(trace.scopes) if block in stack}
    return [i for i, event in enumerate(trace.events) if event.phase == "forward" and event.scope in scopes]


def _returned_storages(trace: Trace, block: str, returned: list[_Returned]) -> set[int]:
    """The storages holding what ``block`` returned: for each tensor, the storage of its size born last inside the
    block (none for a tensor the block passed through unchanged)."""
    inside = set(_block_events(trace, block))
    born = [i for i, s in enumerate(trace.storages) if s.kind == "activation" and s.born in inside]
    found: set[int] = set()
    for tensor in returned:
        match = next((i for i in reversed(born) if trace.storages[i].nbytes == tensor.nbytes and i not in found), None)
        if match is not None:
            found.add(match)
    return found


def _roofline_by_stage(trace: Trace, where: _Placement, pp: int,
                       device: str | Device | RooflineSettings) -> tuple[list[float], list[float]]:
    """Roofline seconds per micro-batch of every stage: (forward, backward with recomputation)."""
    if isinstance(device, str):
        device = get_device(device)
    settings = device if isinstance(device, RooflineSettings) else RooflineSettings(device)
    forward, backward = [0.0] * pp, [0.0] * pp
    for event, phase, seconds in unit_times(trace, settings):
        (forward if phase == "forward" else backward)[where.events[event]] += seconds
    return forward, backward


def _stage_times(stages: list[Stage], flops_per_second: float | None,
                 times: Sequence[tuple[float, float]] | None) -> tuple[list[float], list[float], str]:
    """(forward, backward) time per micro-batch of every stage, and their unit."""
    if times is not None:
        pairs = [tuple(pair) for pair in times]
        if len(pairs) != len(stages) or any(len(pair) != 2 for pair in pairs):
            raise InvalidValueError(f"times must give (forward, backward) seconds for each of the {len(stages)} "
                                    f"stages, got {times!r}")
        return [pair[0] for pair in pairs], [pair[1] for pair in pairs], "s"
    rate, unit = 1.0, "flop"
    if flops_per_second is not None:
        if isinstance(flops_per_second, bool) or not isinstance(flops_per_second, (int, float)) \
                or not flops_per_second > 0:
            raise InvalidValueError(f"flops_per_second must be a number > 0, got {flops_per_second!r}")
        rate, unit = float(flops_per_second), "s"
    return ([stage.forward_flops / rate for stage in stages],
            [(stage.backward_flops + stage.recompute_flops) / rate for stage in stages], unit)
