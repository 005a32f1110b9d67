"""The roofline: the time every operator would take on a named accelerator, and where that time goes.

Pure functions of a trace and a :class:`RooflineSettings`: FLOPs (the ``flops`` convention: real floating-point
operations) and bytes (:func:`~.traffic.count_bytes`) are counted over the trace, paired into *units* (one per
kernel call the two counts agree on) and each unit's time is the roofline of Williams, Waterman and Patterson
(2009): the larger of its compute time at the device's peak and its memory time at the device's bandwidth.
docs/roofline.md says what the numbers mean and what they assume.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass
from functools import cache
from numbers import Real
from typing import Any

from ..devices import Device, DeviceError
from ..engine.gc_pause import no_gc
from ..engine.trace import PHASES, OpEvent, TensorMeta, Trace
from ..errors import InvalidTypeError, InvalidValueError
from ..handles import attention, products
from ..handles.base import CountInside, backward_key
from ..handles.classify import Classifier
from ..handles.conventions import get_convention
from ..handles.sizes import itemsize
from ..handles.traffic import traffic_table
from .counting import Ancestors, Statistics, Unit, count, work_dtype
from .memory import OPTIMIZER_PHASE, OptimizerSpec, in_state_dtype
from .traffic import count_bytes

logger = logging.getLogger("modelmeter")

# Roofline.summary["items"]["unit"] values
IMAGES, TOKENS, SAMPLES = "images", "tokens", "samples"

# The optimizer's step per parameter element, as torch.optim's default (non-fused) implementations compute it:
# (FLOPs, kernels a per-parameter step launches). SGD: p -= lr·g; momentum: b = μb + g, p -= lr·b; Adam: the two
# moments (3 + 4), the bias-corrected denominator sqrt(v)/c + eps (3) and p -= lr·m/denom (3); AdamW adds the
# decoupled weight decay p *= 1 - lr·λ (1). A multi-tensor (foreach) step launches the same kernels once per list.
OPTIMIZER_STEPS: dict[str, tuple[int, int]] = {"sgd": (2, 1), "momentum": (4, 2), "adam": (13, 7), "adamw": (14, 8)}


@dataclass(frozen=True)
class RooflineSettings:
    """The accelerator and how the time is predicted on it: ``efficiency`` (in (0, 1]) is the fraction of the
    peak compute and bandwidth every kernel reaches, ``launch_overhead`` the seconds added per kernel launched,
    ``tf32`` puts float32 matrix work on the tensor cores at the TF32 peak, and ``measured_time`` (seconds of a
    measured run of the same step) gives the MFU and HFU. The defaults are the pure roofline."""

    device: Device
    efficiency: float = 1.0
    launch_overhead: float = 0.0
    tf32: bool = False
    measured_time: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device, Device):
            raise InvalidTypeError(f"device must be a modelmeter.devices.Device (e.g. get_device('h100')), got "
                                   f"{type(self.device).__name__}")
        if not _real(self.efficiency) or not 0 < self.efficiency <= 1:
            raise InvalidValueError(f"efficiency must be a number in (0, 1] (the fraction of the peak reached), "
                                    f"got {self.efficiency!r}")
        if not _real(self.launch_overhead) or not 0 <= self.launch_overhead < math.inf:
            raise InvalidValueError("launch_overhead must be a finite number of seconds >= 0, got "
                                    f"{self.launch_overhead!r}")
        if not isinstance(self.tf32, bool):
            raise InvalidTypeError(f"tf32 must be True or False, got {self.tf32!r}")
        if self.measured_time is not None and (not _real(self.measured_time)
                                               or not 0 < self.measured_time < math.inf):
            raise InvalidValueError(f"measured_time must be a finite number of seconds > 0, got {self.measured_time!r}")


def _real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and not math.isnan(value)


@dataclass
class Roofline:
    """The roofline of one run. The four statistics share their operator keys (a unit's key: the key of its
    outermost count, ``linear`` for a ``linear`` whose bytes were counted at its ``addmm``), so that
    ``flops / bytes`` of one module and key is its arithmetic intensity and ``compute_bound_time / time`` the
    share of its time that is compute-bound. ``summary`` is plain JSON data (see :func:`roofline`)."""

    bytes: Statistics
    flops: Statistics
    time: Statistics
    compute_bound_time: Statistics
    summary: dict[str, Any]

    @property
    def phases(self) -> list[str]:
        """The phases the time is split into, in run order: the run's, then ``"optimizer"`` when its step was
        timed (the keys of ``summary["time"]`` but its total)."""
        return [phase for phase in self.summary["time"] if phase != "total"]


@dataclass
class _Unit:
    """One unit of time: the counts paired into it, and where it is attributed."""

    phase: str
    scope: int
    key: str
    dtype_event: int  # whose work dtype is the unit's when it ran no matrix kernel
    dtype: str = ""
    matrix_flops: float = 0
    vector_flops: float = 0
    bytes: float = 0
    kernels: int = 0
    time: float = 0.0
    compute_bound: bool = False

    @property
    def flops(self) -> float:
        return self.matrix_flops + self.vector_flops


def roofline(trace: Trace, settings: RooflineSettings, *, attention_kernel: str = "fused",
             dense_attention: bool = False, optimizer: OptimizerSpec | None = None) -> Roofline:
    """The roofline time of every operator of ``trace`` on ``settings.device``, by module, operator and phase.

    A unit of time is the outermost event counted by either metric (a ``linear`` whose FLOPs were counted there
    and whose bytes at its ``addmm`` is one unit), and the backward operators a ``backward:`` formula covers
    form one unit per forward call. Its time is ``max(matrix_flops / peak(dtype, matrix) + vector_flops /
    peak(dtype, vector), bytes / bandwidth) / efficiency + kernels x launch_overhead``; it is compute-bound when
    its compute term is positive and at least its memory term. Matrix FLOPs are those of the matrix products,
    convolutions and attention (:mod:`~modelmeter.handles.products`, :mod:`~modelmeter.handles.attention`,
    ``einsum``); the dtype is the work dtype of the unit's first matrix kernel, else of its outermost event.
    ``attention_kernel`` and ``dense_attention`` count attention as for the FLOPs (docs/attention.md).

    ``optimizer`` (a training step's: the trace has a backward pass) adds its ``step()`` as the phase
    ``"optimizer"`` of the model as a whole: every parameter with a gradient read and written with its states,
    its gradient read (:data:`OPTIMIZER_STEPS` has the FLOPs and kernels per element; an optimizer it does not name
    is left out, with a WARNING); the trace records no optimizer, so this part is a model of torch.optim's step,
    not a count.
    """
    with no_gc():  # thousands of small counters made and walked
        units = _units(trace, attention_kernel, dense_attention)
        if optimizer is not None:
            units += _optimizer_units(trace, optimizer)
        for unit in units:
            _time(unit, settings)
        moved, flops, time, bound = _statistics(trace, units)
        summary = _summary(trace, settings, units)
        _check_finite(summary, settings)
        return Roofline(moved, flops, time, bound, summary)


def unit_times(trace: Trace, settings: RooflineSettings, *, attention_kernel: str = "fused",
               dense_attention: bool = False) -> list[tuple[int, str, float]]:
    """Every unit of time of the run (no optimizer step) as ``(event, phase, seconds)`` on ``settings.device``, as
    :func:`roofline` times it: ``event`` is the unit's outermost counted event, or the forward call whose whole
    backward pass a ``backward:`` formula covered, so a caller can attribute the time by event (pipeline stages)."""
    with no_gc():
        units = _units(trace, attention_kernel, dense_attention)
    for unit in units:
        _time(unit, settings)
    return [(unit.dtype_event, unit.phase, unit.time) for unit in units]


def _units(trace: Trace, attention_kernel: str, dense_attention: bool) -> list[_Unit]:
    """The units of time of the run: the ``flops`` convention's FLOPs and the bytes, paired (not yet timed)."""
    convention = get_convention("flops", dense_attention=dense_attention, attention_kernel=attention_kernel)
    flop_units: list[Unit] = []
    byte_units: list[Unit] = []
    count(trace, convention.handles, elementwise=convention.elementwise, units=flop_units, tables=False)
    count_bytes(trace, attention_kernel, units=byte_units)
    matrix_ops = _matrix_ops() | {op for op, entry in convention.handles.items() if isinstance(entry, CountInside)}
    return _group(trace, flop_units, byte_units, matrix_ops, _moves_nothing(attention_kernel))


@cache
def _matrix_ops() -> frozenset[str]:
    """The operators of the matrix families: products, convolutions and attention (their tables' keys)."""
    return frozenset(products.handles("flops")) | frozenset(attention.handles("flops"))


@cache
def _moves_nothing(attention_kernel: str) -> frozenset[str]:
    """Operators the bytes table declares free (metadata, allocations): they launch no kernel."""
    return frozenset(op for op, entry in traffic_table(attention_kernel).items() if entry is None)


# --- units -----------------------------------------------------------------------------------------------
def _group(trace: Trace, flop_units: list[Unit], byte_units: list[Unit], matrix_ops: Collection[str],
           free: Collection[str]) -> list[_Unit]:
    """Pair the counts of both metrics into units of time, each with its kernels and work dtype."""
    events = trace.events
    covered = {events[u.event].origin for units in (flop_units, byte_units) for u in units if u.whole_backward}
    counted = {u.event for u in flop_units}
    counted.update(u.event for u in byte_units)
    group, kernels, matrix_kernel = _walk(trace, counted, covered, matrix_ops, free)
    units = _open_units(events, group, flop_units, byte_units)
    for index, unit in units.items():
        unit.kernels = kernels.get(index, 0)
        first = matrix_kernel.get(index)
        unit.dtype = work_dtype(events[unit.dtype_event if first is None else first])
    for u in flop_units:
        event = events[u.event]
        op = backward_key(events[event.origin].op) if u.whole_backward else event.op
        if op in matrix_ops:
            units[group[u.event]].matrix_flops += u.total
        else:
            units[group[u.event]].vector_flops += u.total
    for u in byte_units:
        units[group[u.event]].bytes += u.total
    return list(units.values())


def _walk(trace: Trace, counted: set[int], covered: set[int], matrix_ops: Collection[str],
          free: Collection[str]) -> tuple[list[int], dict[int, int], dict[int, int]]:
    """The unit of every event (-1: none): the outermost counted event on its parent chain, or (``len(events)
    + origin``) the forward call whose backward pass a ``backward:`` formula covered; the kernels launched per unit
    (dispatch events that are not views and move bytes), and each unit's first matrix kernel (its work dtype is the
    unit's: under autocast, a ``linear`` called in float32 runs its ``addmm`` in bfloat16)."""
    events = trace.events
    offset = len(events)
    group = [-1] * offset
    kernels: dict[int, int] = {}
    matrix_kernel: dict[int, int] = {}
    classify = Classifier(trace.op_tags)
    launches: dict[str, bool] = {}
    for index, event in enumerate(events):  # a parent comes before its children
        if event.phase == "backward" and event.origin in covered:
            unit = offset + event.origin
        elif event.parent >= 0 and group[event.parent] >= 0:
            unit = group[event.parent]
        elif index in counted:
            unit = index
        else:
            continue
        group[index] = unit
        if event.level != "dispatch":
            continue
        op = event.op
        launch = launches.get(op)
        if launch is None:
            launch = launches[op] = op not in free and not classify.is_view(op)
        if launch:
            kernels[unit] = kernels.get(unit, 0) + 1
            if unit not in matrix_kernel and op in matrix_ops:
                matrix_kernel[unit] = index
    return group, kernels, matrix_kernel


def _open_units(events: list[OpEvent], group: list[int], flop_units: list[Unit],
                byte_units: list[Unit]) -> dict[int, _Unit]:
    """One :class:`_Unit` per unit of time, with its phase, scope and key, from the count taken at its outermost
    event (the FLOPs' count where both metrics counted that event)."""
    units: dict[int, _Unit] = {}
    for u in (*byte_units, *flop_units):  # FLOPs last: their key wins
        event = events[u.event]
        if u.whole_backward:
            origin = event.origin
            units[group[u.event]] = _Unit("backward", event.scope, u.key or f"{_short(events[origin].op)}_backward",
                                          origin)
        elif group[u.event] == u.event:
            units[u.event] = _Unit(event.phase, event.scope, u.key or _short(event.op), u.event)
    return units


def _short(op: str) -> str:
    return op.split("::", 1)[-1]


def _time(unit: _Unit, settings: RooflineSettings) -> None:
    """The unit's roofline time and bound on the device of ``settings``."""
    device = settings.device
    compute = 0.0
    if unit.matrix_flops:
        compute += unit.matrix_flops / device.peak(unit.dtype, matrix=True, tf32=settings.tf32)
    if unit.vector_flops:
        compute += unit.vector_flops / device.peak(unit.dtype, matrix=False)
    memory = unit.bytes / device.bandwidth
    unit.time = max(compute, memory) / settings.efficiency + unit.kernels * settings.launch_overhead
    unit.compute_bound = compute > 0 and compute >= memory


def _optimizer_units(trace: Trace, spec: OptimizerSpec) -> list[_Unit]:
    """The optimizer's step, one unit per dtype of the parameters it updates, owned by the model as a whole."""
    name = spec.name.lower()
    if name not in OPTIMIZER_STEPS:  # an OptimizerSpec of the user's: its memory is known, its update is not
        logger.warning("The time of the step of optimizer %r is not known (known: %s); the predicted time leaves "
                       "it out.", spec.name, ", ".join(OPTIMIZER_STEPS))
        return []
    flops_per_element, kernels_per_parameter = OPTIMIZER_STEPS[name]
    units: dict[str, _Unit] = {}
    for gradient in trace.gradients:
        elements = gradient.numel()
        nbytes = elements * itemsize(gradient.dtype)
        state = in_state_dtype(gradient, spec)
        unit = units.get(gradient.dtype)
        if unit is None:
            unit = units[gradient.dtype] = _Unit(OPTIMIZER_PHASE, len(trace.scopes), f"{name}.step", -1,
                                                 gradient.dtype)
        unit.vector_flops += flops_per_element * elements
        unit.bytes += 3 * nbytes + 2 * spec.states * state  # p read and written, g read; states both
        unit.kernels += 0 if spec.foreach else kernels_per_parameter
    if spec.foreach:
        for unit in units.values():
            unit.kernels = kernels_per_parameter
    return list(units.values())


def _check_finite(summary: dict[str, Any], settings: RooflineSettings) -> None:
    """A DeviceError when a number of the summary overflows (a device's rates, bandwidth or the efficiency so
    extreme that a division gives inf): a report never shows an infinite time or rate, nor a NaN share."""
    numbers = [*summary["time"].values(), *summary["device"].values(), summary["throughput"],
               summary["predicted_mfu"], summary["mfu"], summary["hfu"]]
    if not all(math.isfinite(n) for n in numbers if isinstance(n, float)):
        raise DeviceError(f"the predicted time on device {settings.device.name!r} overflows: its rates and "
                          f"bandwidth, or the efficiency ({settings.efficiency!r}), are too extreme to divide by")


# --- statistics by module ------------------------------------------------------------------------------------
def _statistics(trace: Trace, units: list[_Unit]) -> list[Statistics]:
    """Bytes, FLOPs, time and compute-bound time of the units, attributed to the module that owns each and to its
    parents by name (counting's ``"owner"`` mode) under the unit's key, phase and dtype: the shape
    :func:`~.counting.count` gives. The four are summed together (one cell of four per module and key), per owner
    first, then added up the module names from the deepest, then told apart."""
    by_phase: dict[str, dict[str, dict[str, list[Any]]]] = {phase: {} for phase in (*PHASES, OPTIMIZER_PHASE)}
    dtypes: dict[str, dict[str, list[Any]]] = {}
    owners = [stack[-1] if stack else "" for stack in trace.scopes] + [""]  # the last: the optimizer's step
    for unit in units:
        values = [unit.bytes, unit.flops, unit.time, unit.time if unit.compute_bound else None]
        owner = owners[unit.scope]
        _add(by_phase[unit.phase].setdefault(owner, {}), unit.key, values)
        _add(dtypes.setdefault(owner, {}), unit.dtype, values)
    present = [phase for phase, table in by_phase.items() if table]
    for table in (*(by_phase[phase] for phase in present), dtypes):
        _add_up(table)
    totals = None if len(present) == 1 else _merged([by_phase[phase] for phase in present])
    find_uncalled = Ancestors(trace, "owner").uncalled  # (each Statistics finds its own set, when read)
    out = []
    for index in range(4):
        phases = {phase: _column(table, index) for phase, table in by_phase.items()}
        counts = phases[present[0]] if totals is None else _column(totals, index)  # one phase: its own total
        out.append(Statistics(counts, phases, _column(dtypes, index), {}, find_uncalled))
    return out


def _add_up(table: dict[str, dict[str, list[Any]]]) -> None:
    """Add every module's row into its parent's by name (``"a.b"`` into ``"a"``, ``"a"`` into ``""``), deepest
    first, so that each row holds its module's own units and those of every module under it."""
    for name in list(table):
        while name:  # parents by name that own no unit themselves get a row too
            name = name.rpartition(".")[0]
            table.setdefault(name, {})
    for name in sorted(table, key=lambda name: -name.count(".") if name else 1):
        if name:
            target = table[name.rpartition(".")[0]]
            for key, cell in table[name].items():
                _add(target, key, cell)


def _merged(tables: list[dict[str, dict[str, list[Any]]]]) -> dict[str, dict[str, list[Any]]]:
    """The cells of several phases' tables summed."""
    out: dict[str, dict[str, list[Any]]] = {}
    for table in tables:
        for module, row in table.items():
            target = out.setdefault(module, {})
            for key, cell in row.items():
                _add(target, key, cell)
    return out


def _add(row: dict[str, list[Any]], key: str, values: list[Any]) -> None:
    """Add the four values to ``row[key]`` (a compute-bound time of None: the unit was memory-bound)."""
    cell = row.get(key)
    if cell is None:
        row[key] = values[:]
        return
    cell[0] += values[0]
    cell[1] += values[1]
    cell[2] += values[2]
    if values[3] is not None:
        cell[3] = values[3] if cell[3] is None else cell[3] + values[3]


def _column(table: dict[str, dict[str, list[Any]]], index: int) -> dict[str, dict[str, Any]]:
    """Value ``index`` of the cells, by module and key (a key without one, a module without any, left out)."""
    if index < 3:  # bytes, FLOPs and time: every cell has them
        return {module: {key: cell[index] for key, cell in row.items()} for module, row in table.items()}
    out = {}
    for module, row in table.items():
        values = {key: cell[index] for key, cell in row.items() if cell[index] is not None}
        if values:
            out[module] = values
    return out


# --- the summary --------------------------------------------------------------------------------------------
def _summary(trace: Trace, settings: RooflineSettings, units: list[_Unit]) -> dict[str, Any]:
    """``Result.roofline``: the device, the totals, MFU/HFU, throughput and the operators (docs/roofline.md)."""
    device = settings.device
    dtype = _dominant_dtype(trace, units)
    peak = device.peak(dtype, matrix=True, tf32=settings.tf32)
    # the one place that decides whether the time has an optimizer phase (Roofline.phases reads it back)
    phases = [*trace.phases(), *([OPTIMIZER_PHASE] if any(u.phase == OPTIMIZER_PHASE for u in units) else [])]
    times = {phase: sum(u.time for u in units if u.phase == phase) for phase in phases}
    total = sum(u.time for u in units)
    flops = sum(u.flops for u in units if u.phase != OPTIMIZER_PHASE)  # the model's FLOPs: MFU and HFU
    model_flops = sum(u.flops for u in units if u.phase in ("forward", "backward"))
    measured = settings.measured_time
    items, unit_name = _items(trace)
    return {
        "device": {"name": device.name, "label": device.label, "memory": device.memory,
                   "bandwidth": device.bandwidth, "peak": peak, "vector_peak": device.peak(dtype, matrix=False),
                   "ridge": peak / device.bandwidth},
        "dtype": dtype,
        "settings": {"efficiency": settings.efficiency, "launch_overhead": settings.launch_overhead,
                     "tf32": settings.tf32},
        "time": {**times, "total": total},
        "flops": flops,
        "model_flops": model_flops,
        "bytes": sum(u.bytes for u in units),
        "compute_bound_share": sum(u.time for u in units if u.compute_bound) / total if total else 0.0,
        "predicted_mfu": model_flops / (total * peak) if total else None,
        "measured_time": measured,
        "mfu": None if measured is None else model_flops / (measured * peak),
        "hfu": None if measured is None else flops / (measured * peak),
        "items": {"count": items, "unit": unit_name},
        "throughput": items / total if total else None,
        "operators": _operators(units),
    }


def _dominant_dtype(trace: Trace, units: list[_Unit]) -> str:
    """The dtype most matrix FLOPs were done in (else most FLOPs, else the first floating-point input's)."""
    for flops_of in (lambda u: u.matrix_flops, lambda u: u.flops):
        by_dtype: dict[str, float] = {}
        for unit in units:
            if unit.dtype != "other" and flops_of(unit):
                by_dtype[unit.dtype] = by_dtype.get(unit.dtype, 0) + flops_of(unit)
        if by_dtype:
            return max(by_dtype, key=lambda d: by_dtype[d])
    floating = [t.dtype for t in trace.inputs if t.is_floating_point]
    return floating[0] if floating else "float32"


def _items(trace: Trace) -> tuple[int, str]:
    """What one run processes: the first input's first dimension, as tokens (x its second dimension) when it is
    an integer 2-D tensor, images when it is a floating-point 4-D tensor, else samples."""
    if not trace.inputs:
        return 1, SAMPLES
    first: TensorMeta = trace.inputs[0]
    shape = first.shape
    if not shape:
        return 1, SAMPLES
    if len(shape) == 2 and not first.is_floating_point and first.dtype != "bool":
        return shape[0] * shape[1], TOKENS
    if len(shape) == 4 and first.is_floating_point:
        return shape[0], IMAGES
    return shape[0], SAMPLES


def _operators(units: list[_Unit]) -> list[dict[str, Any]]:
    """Every operator key x dtype over the whole run, the longest first; compute-bound when at least half its
    time is."""
    rows: dict[tuple[str, str], list[float]] = {}
    for unit in units:
        row = rows.setdefault((unit.key, unit.dtype), [0, 0, 0.0, 0.0])
        row[0] += unit.flops
        row[1] += unit.bytes
        row[2] += unit.time
        row[3] += unit.time if unit.compute_bound else 0.0
    ordered = sorted(rows.items(), key=lambda item: (-item[1][2], item[0]))
    return [{"operator": key, "dtype": dtype, "flops": flops, "bytes": moved, "time": time,
             "compute_bound": bound_time > 0 and 2 * bound_time >= time,
             "intensity": flops / moved if moved else None}
            for (key, dtype), (flops, moved, time, bound_time) in ordered]
