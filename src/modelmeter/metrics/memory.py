"""Memory over a trace: live bytes event by event, the peak, what was saved for backward, what each module made.

Pure functions of the trace's storage records (:class:`~modelmeter.engine.trace.Storage`) and, for a
training step, of an :class:`OptimizerSpec`: changing the optimizer or its state dtype recomputes without
running the model. Live bytes during event ``i`` are the bytes of every storage born at or before ``i`` and
not yet freed (a storage freed after event ``i - 1`` no longer counts); storages of the model's state and
inputs are live throughout.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import torch

from ..engine.trace import OpEvent, Storage, TensorMeta, Trace
from ..errors import InvalidTypeError, InvalidValueError
from ..handles.sizes import itemsize
from .counting import Ancestors, Statistics

OPTIMIZER_PHASE = "optimizer"


@dataclass(frozen=True)
class OptimizerSpec:
    """What an optimizer keeps, and what its ``step()`` allocates for a while, per parameter with a gradient.

    ``states``: state tensors the size of the parameter (momentum buffer: 1; Adam's two moments: 2);
    ``scalars``: bytes of 0-d state tensors per parameter (Adam's float32 ``step``). The temporaries of one
    ``step()``, as torch's implementations allocate them: the per-parameter loop (the CPU default) holds
    ``temporaries`` parameter-sized tensors for parameter ``i`` while ``carried`` of parameter ``i - 1`` are
    still bound to a loop variable; the multi-tensor ``foreach`` implementation (the CUDA default) holds
    ``foreach_temporaries`` copies of every parameter of one device and dtype at once (torch steps one such group
    after the other, the previous group's copies still bound while the next's are made); ``overhead``: bytes of the
    0-d tensors a Python-number operand becomes with float32 state (a float64 tensor and its float32 copy, 12 bytes;
    the copy takes the state's dtype, and float64 state needs none). ``state_dtype``: the dtype of the states when
    not the parameter's.

    Mixed precision and sharding: ``master_weights`` keeps a copy of every parameter in the state dtype besides
    the states (low-precision parameters with float32 master weights, ZeRO's 2 + 2 + 12 bytes per parameter with
    Adam); ``shards`` splits the state, and the step's temporaries, evenly across that many ranks (ZeRO stage 1:
    each rank keeps and updates its share while parameters and gradients are replicated; stage 2's sharded
    gradients are not modelled). Under FSDP2 the trace's gradients are this rank's shards already, and ``shards``
    stays 1.
    """

    name: str
    states: int
    scalars: int = 0
    temporaries: int = 0
    carried: int = 0
    foreach_temporaries: int = 0
    overhead: int = 0
    foreach: bool = False
    state_dtype: str | None = None
    master_weights: bool = False
    shards: int = 1

    def __post_init__(self) -> None:
        for name in ("states", "scalars", "temporaries", "carried", "foreach_temporaries", "overhead"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise InvalidValueError(f"OptimizerSpec {name} must be a whole number >= 0, got {value!r}")
        for name in ("foreach", "master_weights"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidTypeError(f"OptimizerSpec {name} must be True or False, got {getattr(self, name)!r}")
        if type(self.shards) is not int or self.shards < 1:
            raise InvalidValueError(f"shards must be a whole number of ranks, at least 1; got {self.shards!r}")


# torch.optim's SGD and Adam(W) in their default settings (no weight decay for Adam, no amsgrad, no nesterov),
# as measured against the CPU allocator with torch 2.14 (tests/test_memory.py): the loop Adam holds sqrt(v)
# and its quotient for one parameter while the previous parameter's denominator is still bound; foreach Adam
# keeps the list of sqrt(v); every Python-number operand costs a float64 and a float32 0-d tensor (12 bytes).
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "sgd": OptimizerSpec("sgd", states=0),
    "momentum": OptimizerSpec("momentum", states=1, overhead=12),
    "adam": OptimizerSpec("adam", states=2, scalars=4, temporaries=2, carried=1, foreach_temporaries=1, overhead=12),
    "adamw": OptimizerSpec("adamw", states=2, scalars=4, temporaries=2, carried=1, foreach_temporaries=1,
                           overhead=12),
}

# The dtypes an optimizer's state may be kept in (8-bit ones for 8-bit optimizers)
STATE_DTYPES = ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "float8_e4m3fn",
                "float8_e5m2", "int8", "uint8")


def optimizer_spec(name: str | OptimizerSpec, *, state_dtype: str | None = None, foreach: bool | None = None,
                   master_weights: bool | None = None, shards: int | None = None) -> OptimizerSpec:
    """The spec of a torch optimizer by name (``"sgd"``, ``"momentum"``, ``"adam"``, ``"adamw"``), with the
    options given (None: the spec's own)."""
    if isinstance(name, OptimizerSpec):
        spec = name
    else:
        if not isinstance(name, str):
            raise InvalidTypeError(f"optimizer must be a name ({', '.join(OPTIMIZERS)}) or an OptimizerSpec, got "
                                   f"{_described(name)}")
        key = name.lower()
        if key not in OPTIMIZERS:
            raise InvalidValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)} (or an OptimizerSpec); "
                                    f"got {name!r}")
        spec = OPTIMIZERS[key]
    if state_dtype is not None:
        state_dtype = str(state_dtype).removeprefix("torch.")
        if state_dtype not in STATE_DTYPES:
            raise InvalidValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)} (8-bit types for 8-bit "
                                    f"optimizer states); got {state_dtype!r}")
    return replace(spec, foreach=spec.foreach if foreach is None else foreach,
                   state_dtype=state_dtype or spec.state_dtype,
                   master_weights=spec.master_weights if master_weights is None else master_weights,
                   shards=spec.shards if shards is None else shards)


def _described(value: object) -> str:
    """``value`` as an error names it: a torch optimizer (its class or an instance) by its class, with what to pass
    instead — the spec is a name, torch.optim's settings are not read; anything else by its type."""
    kind = value if isinstance(value, type) else type(value)
    if issubclass(kind, torch.optim.Optimizer):
        return (f"torch.optim's {kind.__name__}, whose settings are not read: pass the name of the optimizer it is "
                f"(state_dtype= and foreach= describe it further)")
    return type(value).__name__


_FULL_PRECISION = "float32"


def for_plan(spec: OptimizerSpec | None, trace: Trace) -> OptimizerSpec | None:
    """``spec`` as the parallel plan the trace was recorded under (``trace.parallel["options"]``) asks for it;
    ``spec`` itself for a trace without a plan, and for options it sets already.

    ZeRO-1 (``zero=1``): the optimizer state is sharded over the ``fsdp`` ranks (the trace's gradients are whole, as
    ``replicate`` leaves them; under ZeRO-2/3 they are this rank's shards already). Mixed precision (``mp=bf16``):
    the state is float32, and float32 master weights are kept besides the parameters when the rank's parameters are
    in a lower precision (a float32 model's FSDP2 shards are the master weights themselves)."""
    parallel = trace.parallel
    if spec is None or not isinstance(parallel, dict):
        return spec
    options = parallel.get("options") or {}
    shards, state_dtype, master = spec.shards, spec.state_dtype, spec.master_weights
    if options.get("zero") == 1 and shards == 1:
        shards = int(parallel.get("mesh", {}).get("fsdp", 1))
    if options.get("param_dtype") is not None:
        state_dtype = state_dtype or _FULL_PRECISION
        master = master or any(g.dtype != _FULL_PRECISION for g in trace.gradients)
    return replace(spec, shards=shards, state_dtype=state_dtype, master_weights=master)


@dataclass(frozen=True)
class Point:
    """Live bytes during one event of the run (``event`` -1: before it; ``len(trace.events)``: the
    optimizer's step)."""

    event: int
    phase: str
    module: str
    operator: str
    live: int


@dataclass(frozen=True)
class Peak:
    """The most bytes live at once, where it happened, and what they were (by storage kind, plus
    ``"optimizer_state"`` and ``"optimizer_temporary"``)."""

    bytes: int
    at: Point
    by_kind: dict[str, int] = field(default_factory=dict)


def in_state_dtype(gradient: TensorMeta, spec: OptimizerSpec) -> int:
    """Bytes of one parameter-sized tensor in the state dtype (a gradient has its parameter's size and dtype)."""
    return gradient.numel() * itemsize(spec.state_dtype or gradient.dtype)


def optimizer_bytes(trace: Trace, spec: OptimizerSpec) -> tuple[int, int]:
    """(persistent state, most temporary bytes of one ``step()``) for the parameters that got a gradient, in
    the optimizer's order (the model's parameter order): this rank's share of them with ``spec.shards``."""
    sizes = [-(-in_state_dtype(g, spec) // spec.shards) for g in trace.gradients]
    state = sum((spec.states + spec.master_weights) * size + spec.scalars for size in sizes)
    if not sizes:
        return state, 0
    overheads = [scalar_overhead(spec, spec.state_dtype or g.dtype) for g in trace.gradients]
    if spec.foreach:
        return state, _foreach_temporary(spec, trace.gradients, sizes, overheads)
    previous = [0, *sizes[:-1]]
    held = (spec.temporaries * size + spec.carried * prior + overhead
            for size, prior, overhead in zip(sizes, previous, overheads, strict=True))
    return state, max(held)


def _foreach_temporary(spec: OptimizerSpec, gradients: list[TensorMeta], sizes: list[int],
                       overheads: list[int]) -> int:
    """The most temporary bytes of a multi-tensor ``step()``: torch groups the parameters by device and dtype (in
    order of first appearance) and runs one group after the other; a group's temporaries are made while the previous
    group's are still bound to the loop's variable, and its Python-number operands are wrapped while either group's
    are held (measured against the CPU allocator)."""
    totals: dict[tuple[str, str], int] = {}
    wrapped: dict[tuple[str, str], int] = {}
    for gradient, size, overhead in zip(gradients, sizes, overheads, strict=True):
        key = (gradient.device, gradient.dtype)
        totals[key] = totals.get(key, 0) + spec.foreach_temporaries * size
        wrapped[key] = overhead
    held = [0, *totals.values()]
    return max(max(previous + max(current, overhead), current + overhead)
               for previous, current, overhead in zip(held[:-1], held[1:], wrapped.values(), strict=True))


def scalar_overhead(spec: OptimizerSpec, dtype: str) -> int:
    """Bytes of the 0-d tensors a Python-number operand becomes while the step updates state of ``dtype``:
    ``spec.overhead`` counts a float64 tensor and its float32 copy; the copy is made in ``dtype``, and none is made
    for float64 (measured against the CPU allocator for float64, float32, bfloat16 and float16 parameters)."""
    if not spec.overhead:
        return 0
    copy = 0 if dtype == "float64" else itemsize(dtype)
    return spec.overhead - itemsize(_FULL_PRECISION) + copy


# The matrix products whose kernels (CPU and CUDA alike) hand BLAS row- or column-major operands only, and the
# positions of those operands: one broadcast along a dimension (a stride of 0, as the gradient of a sum) is first
# copied to a contiguous temporary, which the kernel frees before it returns.
_MATRIX_OPERANDS = {"aten::mm": (0, 1), "aten::addmm": (1, 2)}

# The binary element-wise operators (and their in-place forms) that CPU kernels run through a TensorIterator which
# promotes its inputs to their common dtype by copying them, with the positions of the two operands; a Python number
# operand is first made a 0-d tensor (float64, int64, bool or complex128). Measured against the CPU allocator: other
# operators taking a number (``clamp``, ``masked_fill``, ``pow(x, 2)``, ``add``'s ``alpha``) use it as it is.
_PROMOTING = {name: (0, 1) for name in ("add", "sub", "rsub", "mul", "div", "remainder", "floor_divide", "eq", "ne",
                                        "lt", "le", "gt", "ge", "maximum", "minimum", "atan2", "pow", "bitwise_and",
                                        "bitwise_or", "bitwise_xor")}
_PROMOTING["where"] = (1, 2)
_POW_PROMOTING = ("Tensor_Tensor", "Scalar")  # pow(x, 2) (Tensor_Scalar) keeps its exponent a number
_WRAPPED_DTYPES = {bool: "bool", int: "int64", float: "float64", complex: "complex128"}
_PROMOTING_DEVICES = ("cpu", "meta")  # CUDA kernels cast while they read; a meta run stands for the CPU's
# Kernels that allocate a scratch tensor the size of one of their inputs (at this position) and free it before they
# return: the CPU backward of CTC computes its beta variables, ``log_beta``, the size of the ``log_alpha`` the forward
# kept (measured against the CPU allocator).
_SCRATCH = {"aten::_ctc_loss_backward": 6}
_COPYING = frozenset([*_MATRIX_OPERANDS, "aten::mean", *_SCRATCH, *(f"aten::{name}{suffix}" for name in _PROMOTING
                                                                    for suffix in ("", "_"))])


def operand_copies(trace: Trace) -> dict[int, int]:
    """Per event: the bytes its kernel allocates for its operands and frees before returning, live during that event
    only — no tensor of the run holds them, so no storage record sees them. A matrix product copies a broadcast
    operand contiguous (a Linear's backward on the default loss's gradient, the size of the layer's output); a CPU
    element-wise kernel copies an operand of another dtype than the operation's, and a Python number becomes a 0-d
    tensor (``x * 0.5`` on float32: 8 + 4 bytes)."""
    copies: dict[int, int] = {}
    for i, ev in enumerate(trace.events):
        if ev.op in _COPYING and ev.level == "dispatch":
            extra = _matrix_copies(ev.op, ev.inputs) + _promotion_copies(ev) + _mean_copies(ev) + _scratch(ev)
            if extra:
                copies[i] = extra
    return copies


def _operands(inputs: list[Any], positions: tuple[int, ...]) -> list[Any]:
    return [inputs[position] if position < len(inputs) else None for position in positions]


def _matrix_copies(op: str, inputs: list[Any]) -> int:
    """Bytes of the contiguous copies a matrix product makes of its broadcast operands."""
    positions = _MATRIX_OPERANDS.get(op, ())
    return sum(operand.numel() * itemsize(operand.dtype) for operand in _operands(inputs, positions)
               if isinstance(operand, TensorMeta) and _broadcast(operand))


def _broadcast(tensor: TensorMeta) -> bool:
    """Whether ``tensor``'s footprint is a broadcast's: the product of the sizes of the dimensions whose stride is
    not 0. A sparse tensor's footprint is what it stores (a 512 x 512 identity: 2,560 elements), which its kernels
    never copy dense; :class:`TensorMeta` keeps no layout, and a sparse footprint is almost never such a product."""
    if tensor.footprint is None:
        return False
    products = {1}
    for size in tensor.shape:
        products |= {product * size for product in products}
    return tensor.footprint in products


def _promotion_copies(ev: OpEvent) -> int:
    """Bytes of the 0-d tensors a CPU element-wise kernel makes of Python numbers, and of the copies it makes of its
    operands (and, in place, of its result) in the operation's dtype when theirs differ."""
    name = ev.op.removeprefix("aten::")
    in_place = name.endswith("_")
    positions = _PROMOTING.get(name.removesuffix("_"))
    if positions is None or (name.startswith("pow") and ev.overload not in _POW_PROMOTING):
        return 0
    operands = _operands(ev.inputs, positions)
    tensors = [operand for operand in operands if isinstance(operand, TensorMeta)]
    if not tensors or any(t.device not in _PROMOTING_DEVICES for t in tensors):
        return 0
    if any(type(operand) not in _WRAPPED_DTYPES and not isinstance(operand, TensorMeta) for operand in operands):
        return 0  # an operand this rule does not know (None, a string): claim nothing
    common = _common_dtype(*(_dtype_kind(operand) for operand in operands))
    if common is None:
        return 0
    if _true_division(name, ev.inputs) and ev.outputs and isinstance(ev.outputs[0], TensorMeta):
        common = ev.outputs[0].dtype  # integers divided in the default floating-point dtype
    total = 0
    for operand in operands:
        if isinstance(operand, TensorMeta):
            total += operand.numel() * itemsize(common) if operand.dtype != common else 0
        else:
            wrapped = _WRAPPED_DTYPES[type(operand)]
            total += itemsize(wrapped) + (itemsize(common) if wrapped != common else 0)
    result = operands[0]
    if in_place and isinstance(result, TensorMeta) and result.dtype != common:
        total += result.numel() * itemsize(common)  # the result, made in the common dtype and copied back
    return total


def _mean_copies(ev: OpEvent) -> int:
    """Bytes a CPU ``mean`` allocates besides its result: it sums, then divides by the count, a Python number (a 0-d
    int64 tensor and its copy in the result's dtype). A half-precision input is summed in float32, from a float32
    copy of it into a float32 result; with a ``dtype`` asked for, from a copy of the input in that dtype."""
    x = ev.inputs[0] if ev.op == "aten::mean" and ev.inputs else None
    out = ev.outputs[0] if ev.outputs else None
    if not isinstance(x, TensorMeta) or not isinstance(out, TensorMeta) or x.device not in _PROMOTING_DEVICES:
        return 0
    count = itemsize("int64") + itemsize(out.dtype)
    asked = [argument.removeprefix("torch.") for argument in ev.inputs[1:] if isinstance(argument, str)]
    if asked and asked[0] != x.dtype:
        return max(x.numel() * itemsize(asked[0]), count)
    if x.dtype in ("float16", "bfloat16"):
        single = itemsize(_FULL_PRECISION)
        return out.numel() * single + max(x.numel() * single, itemsize("int64") + single)
    return count


def _scratch(ev: OpEvent) -> int:
    """Bytes of the scratch tensor a CPU kernel of :data:`_SCRATCH` allocates beside its outputs."""
    position = _SCRATCH.get(ev.op)
    operand = ev.inputs[position] if position is not None and position < len(ev.inputs) else None
    if not isinstance(operand, TensorMeta) or operand.device not in _PROMOTING_DEVICES:
        return 0
    return operand.numel() * itemsize(operand.dtype)


def _dtype_kind(operand: Any) -> tuple[str, str]:
    """What type promotion reads of an operand: its dtype and its category (a tensor with dimensions, a 0-d one, or
    a Python number, which promotes less)."""
    if isinstance(operand, TensorMeta):
        return operand.dtype, "tensor" if operand.shape else "zero-dim"
    return _WRAPPED_DTYPES[type(operand)], "number"


@cache
def _common_dtype(first: tuple[str, str], second: tuple[str, str]) -> str | None:
    """The dtype torch computes two operands in (``torch.result_type``); None where torch promotes none (float8)."""
    stand_ins = [_stand_in(dtype, category) for dtype, category in (first, second)]
    try:
        return str(torch.result_type(*stand_ins)).removeprefix("torch.")
    except (RuntimeError, TypeError):
        return None


def _true_division(name: str, inputs: list[Any]) -> bool:
    """``div`` without a rounding mode, which computes integers in floating point (the output's dtype)."""
    return name.removesuffix("_") == "div" and (len(inputs) < 3 or inputs[2] is None)


def _stand_in(dtype: str, category: str) -> Any:
    """An operand of ``dtype`` in ``category`` as ``torch.result_type`` takes it."""
    if category == "number":
        return {"bool": True, "int64": 1, "float64": 1.0, "complex128": 1j}[dtype]
    return torch.empty((1,) if category == "tensor" else (), dtype=getattr(torch, dtype), device="meta")


class MemoryModel:
    """Live bytes of one trace, event by event, with module and operator names resolved once. ``copies``: what the
    kernels of some events allocate and free inside them besides their outputs (:func:`operand_copies`)."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        events = trace.events
        self.copies = operand_copies(trace)
        allocated = [0] * (len(events) + 1)
        self.resident = 0
        for s in trace.storages:
            if s.born < 0:
                self.resident += s.nbytes
            else:
                allocated[s.born] += s.nbytes
            if s.died >= 0:
                allocated[s.died] -= s.nbytes
        live, running = [], self.resident
        for event, delta in enumerate(allocated[:-1]):
            running += delta
            live.append(running + self.copies.get(event, 0))
        self.live = live  # bytes live during each event
        self.at_end = running + allocated[-1]  # after the last event: outputs, gradients, the model's state
        self._ancestors = Ancestors(trace, "owner")

    def module(self, event: int) -> str:
        stack = self.trace.scopes[self.trace.events[event].scope]
        return stack[-1] if stack else ""

    def operator(self, event: int) -> str:
        """The user-level call an event belongs to (its outermost enclosing event); in the backward pass, the
        forward call whose gradient it computes (``"conv2d backward"``) when one is known."""
        events = self.trace.events
        while events[event].parent >= 0:
            event = events[event].parent
        ev = events[event]
        if ev.phase == "backward" and ev.origin >= 0:
            return f"{events[ev.origin].op.split('::', 1)[-1]} backward"
        return ev.op.split("::", 1)[-1]

    def point(self, event: int, extra: int = 0) -> Point:
        """The point of ``event``, with ``extra`` bytes live besides the run's (the optimizer's state)."""
        ev = self.trace.events[event]
        return Point(event, ev.phase, self.module(event), self.operator(event), self.live[event] + extra)

    def modules_of(self, scope: int) -> frozenset[str]:
        return self._ancestors(scope)

    def live_by_kind(self, event: int) -> dict[str, int]:
        """What was live during ``event`` (or at the end, for ``len(trace.events)``), by storage kind."""
        out: Counter[str] = Counter()
        for s in self.trace.storages:
            if s.born <= event and (s.died < 0 or s.died > event):
                out[s.kind] += s.nbytes
        if event in self.copies:
            out["activation"] += self.copies[event]
        return dict(out)


def timeline(model: MemoryModel, spec: OptimizerSpec | None = None) -> list[Point]:
    """Live bytes during every dispatched operator, in run order, plus the optimizer's step when ``spec``
    is given (the optimizer's state is live throughout a training step)."""
    state, temporary = optimizer_bytes(model.trace, spec) if spec is not None else (0, 0)
    points = [model.point(i, state) for i in dispatched(model)]
    if spec is not None:
        points.append(step_point(model, spec, state + temporary))
    return points


def peak(model: MemoryModel, spec: OptimizerSpec | None = None) -> Peak:
    """The highest point of the timeline (the first, when several are equal) and its make-up; found without
    building the timeline."""
    state, temporary = optimizer_bytes(model.trace, spec) if spec is not None else (0, 0)
    busiest = max(dispatched(model), key=model.live.__getitem__, default=None)
    if spec is not None and (busiest is None or model.at_end + temporary > model.live[busiest]):
        top = step_point(model, spec, state + temporary)
    elif busiest is not None:
        top = model.point(busiest, state)
    else:
        top = Point(-1, "forward", "", "", model.resident)
    by_kind = model.live_by_kind(top.event)
    if spec is not None:
        by_kind["optimizer_state"] = state
        if top.phase == OPTIMIZER_PHASE:
            by_kind["optimizer_temporary"] = temporary
    return Peak(top.live, top, {k: v for k, v in by_kind.items() if v})


def dispatched(model: MemoryModel) -> list[int]:
    """The events a timeline has a point for: the dispatched (aten) operators, in run order."""
    return [i for i, ev in enumerate(model.trace.events) if ev.level == "dispatch"]


def step_point(model: MemoryModel, spec: OptimizerSpec, extra: int) -> Point:
    """The optimizer's step, after the last event: what outlives the run, plus ``extra`` bytes."""
    return Point(len(model.trace.events), OPTIMIZER_PHASE, "", f"{spec.name}.step", model.at_end + extra)


def module_peaks(model: MemoryModel, spec: OptimizerSpec | None = None) -> Counter[str]:
    """Per module: the most bytes live while one of its operators ran (forward, backward or recompute); for the
    model (``""``), its peak."""
    state = optimizer_bytes(model.trace, spec)[0] if spec is not None else 0
    by_scope: dict[int, int] = {}
    for i, ev in enumerate(model.trace.events):
        if ev.level == "dispatch" and model.live[i] > by_scope.get(ev.scope, -1):
            by_scope[ev.scope] = model.live[i]
    out: Counter[str] = Counter()
    for scope, live in by_scope.items():
        for module in model.modules_of(scope):
            out[module] = max(out[module], live + state)
    out[""] = peak(model, spec).bytes  # the model's: also before and after its operators (the optimizer's step)
    return out


def _forward_allocations(model: MemoryModel) -> Iterator[tuple[Storage, int]]:
    """The storages the forward pass's operators allocated, with the event that did."""
    events = model.trace.events
    for s in model.trace.storages:
        if 0 <= s.born < len(events) and s.kind == "activation" and events[s.born].phase == "forward":
            yield s, s.born


def activation_bytes(model: MemoryModel) -> dict[str, Counter[str]]:
    """Per module, by operator: bytes of the storages the forward pass allocated (outputs of operators;
    views and in-place results allocate nothing)."""
    out: defaultdict[str, Counter[str]] = defaultdict(Counter)  # not setdefault: a Counter made per storage
    for s, event in _forward_allocations(model):
        op = model.operator(event)
        for module in model.modules_of(model.trace.events[event].scope):
            out[module][op] += s.nbytes
    return dict(out)


def activation_dtypes(model: MemoryModel) -> dict[str, Counter[str]]:
    """Per module: the bytes its forward pass allocated, by dtype."""
    out: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for s, event in _forward_allocations(model):
        for module in model.modules_of(model.trace.events[event].scope):
            out[module][s.dtype] += s.nbytes
    return dict(out)


def saved_bytes(model: MemoryModel) -> dict[str, Counter[str]]:
    """Per module, by the operator that made it: bytes of the storages the forward pass saved for the
    backward pass that it allocated itself (each storage once, views and shared storages included; the
    parameters, buffers and inputs autograd also saves cost nothing extra and are left out)."""
    out: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for s in model.trace.storages:
        if s.saved >= 0 and s.kind == "activation":
            op = model.operator(s.born) if s.born < len(model.trace.events) else "loss"
            for module in model.modules_of(s.saved_scope):
                out[module][op] += s.nbytes
    return dict(out)


def activation_statistics(model: MemoryModel) -> Statistics:
    """Activation bytes as a counted metric (forward pass only): by module and operator, by dtype, and the modules
    that never ran (neither directly nor through a child)."""
    counts = activation_bytes(model)
    uncalled = Ancestors(model.trace, "owner").uncalled  # found when read
    return Statistics(counts, {"forward": counts}, activation_dtypes(model), {}, uncalled)
