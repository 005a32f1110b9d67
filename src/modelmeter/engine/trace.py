"""The recorded trace: plain data describing every operator call of one model run.

A :class:`Trace` holds no tensors and no modules, only metadata, so it can be kept, cached,
serialised and re-read by any metric without running the model again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..errors import InvalidNameError, InvalidTypeError

Level = Literal["function", "dispatch"]
# What a storage held: the model's state, the caller's inputs, or what an operator made; "gradient" is a
# parameter's ``.grad`` left by the backward pass; "other" was made outside the model's operators (the default
# loss, the RNG state an activation checkpoint keeps). Under a parallel plan: "unsharded" is a storage freed and
# allocated again by hand (``UntypedStorage.resize_``), as FSDP2 does with the unsharded (all-gathered) parameters
# around each forward and backward; "communication" a buffer a collective wrote (FSDP2's all-gather and
# reduce-scatter buffers, DDP's buckets) that is not a parameter's gradient.
StorageKind = Literal["parameter", "buffer", "input", "activation", "gradient", "other", "unsharded", "communication"]
STORAGE_KINDS: tuple[StorageKind, ...] = ("parameter", "buffer", "input", "activation", "gradient", "other",
                                          "unsharded", "communication")
# "recompute": forward work run again during the backward pass (activation checkpointing).
Phase = Literal["forward", "backward", "recompute"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "recompute")


@dataclass(frozen=True)
class TensorMeta:
    """What a handle may know about a tensor: its shape, dtype and device, never its values.

    ``attended`` is set on the mask argument of attention operators only: how many (query, key) pairs the
    mask lets through, broadcast to the attention's full ``(..., L, S)`` shape — or None when the mask had
    no values to read (fake and meta tensors).

    ``footprint`` is the number of distinct elements the tensor addresses when that is fewer than its
    ``numel()`` because some stride is 0 (a broadcast: ``expand``, a scalar expanded to a shape), None otherwise:
    a kernel reads such a tensor's memory once, not once per element. Of a sparse tensor, it is what the tensor
    stores (values and indices, in elements of its dtype), whatever its dense shape.
    """

    shape: tuple[int, ...]
    dtype: str
    device: str
    attended: int | None = None
    footprint: int | None = None

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        """``torch.Tensor.size`` look-alike, so fvcore-style handles port unchanged."""
        return self.shape if dim is None else self.shape[dim]

    # fvcore's handles read a tensor argument as a torch._C.Value: ``value.isCompleteTensor()``, then
    # ``value.type().sizes()`` (fvcore.nn.jit_handles.get_shape); these let such handles run unchanged.
    def isCompleteTensor(self) -> bool:
        """``torch._C.Value.isCompleteTensor`` look-alike: the shape is always known."""
        return True

    def type(self) -> TensorMeta:
        """``torch._C.Value.type`` look-alike: an object whose ``sizes()`` is the shape."""
        return self

    def sizes(self) -> list[int]:
        """``torch._C.TensorType.sizes`` look-alike: the shape as a list."""
        return list(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_floating_point(self) -> bool:
        return self.dtype.startswith(("float", "bfloat", "complex"))


@dataclass(frozen=True)
class GroupMeta:
    """The process group a collective operator ran over, in place of the group itself (a ``ProcessGroup`` object,
    or a functional collective's group name): its name as torch.distributed registers it, its size, and the
    global ranks it spans (``()`` when torch could not say), so the communication metric can pick the link the
    group crosses without the group."""

    name: str
    size: int
    ranks: tuple[int, ...] = ()


@dataclass(slots=True)
class OpEvent:
    """One operator call.

    ``level`` is ``"function"`` for a user-level call seen by the function mode (``F.linear``,
    ``torch.matmul``, ``Tensor.__add__``) and ``"dispatch"`` for an aten operator that reached the
    dispatcher. ``parent`` is the index of the innermost enclosing function event, or -1.
    ``inputs`` follow the operator's schema order (keyword arguments placed in their positions),
    with tensors replaced by :class:`TensorMeta` and a collective's process group by :class:`GroupMeta`.
    ``origin``, for a backward-phase event, is the index of the user-level forward call whose autograd node ran
    it (-1 when none did), so the backward work of a call can be counted by a formula of the call (see
    ``backward:`` handle keys in docs/handles.md).
    ``python`` marks a user-level call that is Python code (``F.interpolate``, ``F.relu``) or Python indexing
    (``x[i]``, ``x[i] = v``), whose inner calls are recorded as calls of their own — the calls ``torch.jit``,
    and so fvcore, would record in its place.
    ``overload`` is the name of the schema overload that placed ``inputs`` (``"default"``, ``"dim"``,
    ``"unary_out"``), "" when none did (a call without an aten schema, an event written without running): where
    overloads with as many arguments read them differently (``max.other(self, other)`` and
    ``max.unary_out(self, *, out)``), it tells the formulas which one ran.
    The events of a call replayed from an earlier one (engine/replay.py) share its ``inputs``, ``outputs`` and
    ``kwargs`` objects, as they share its values: read them, do not change them in place.
    """

    op: str
    level: Level
    parent: int
    scope: int
    phase: Phase
    inputs: list[Any]
    outputs: list[Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    origin: int = -1
    python: bool = False
    overload: str = ""


@dataclass(slots=True)
class Storage:
    """One tensor storage of the run: how many bytes it held, and when it lived.

    ``born`` is the index of the event whose output it first was (-1: it existed before the run — a
    parameter, buffer or input); ``died`` is the number of events recorded when it was freed (it was freed
    after event ``died - 1`` and before event ``died``), -1 when it outlived the run (outputs, gradients, the
    model's state). ``saved`` is the number of events recorded when autograd first saved a tensor on it for
    the backward pass (-1: never), and ``saved_scope`` the module scope that saved it. ``order``, for a
    gradient, is its parameter's position among the model's parameters that got one (the order an optimizer
    updates them in; the first's, when several share it). Storages are in order of first sight; views share their
    base's storage. A storage freed by hand and allocated again (``UntypedStorage.resize_(0)``, then
    ``resize_(n)``: FSDP2's unsharded parameters) has one record per lifetime. A DTensor counts as its local
    shard: the bytes this rank holds. The recorder fills a record in while the run goes on; metrics only read it.
    """

    nbytes: int
    dtype: str
    device: str
    kind: StorageKind
    born: int = -1
    died: int = -1
    saved: int = -1
    saved_scope: int = -1
    order: int = -1


@dataclass(frozen=True)
class ParameterInfo:
    """A parameter a module holds itself (not through a child): its attribute name, shape, dtype and bytes.

    Of a parameter sharded across ranks (a DTensor, in a parallel run), ``shape`` and ``nbytes`` are the simulated
    rank's shard and ``global_shape`` the whole parameter's; ``global_shape`` is None for a parameter held whole."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    global_shape: tuple[int, ...] | None = None

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def global_numel(self) -> int:
        """Elements of the whole parameter, on all ranks (:meth:`numel` when it is not sharded)."""
        n = 1
        for s in self.shape if self.global_shape is None else self.global_shape:
            n *= s
        return n


@dataclass(frozen=True)
class ModuleInfo:
    """One module of the model (under its canonical name), as metrics and reports need it without the model.

    ``type`` is the class name, ``label`` what ``repr(module)`` prints for it (``module._get_name()``) and
    ``extra_repr`` its ``extra_repr()``. ``children`` are its submodule slots in order, ``(attribute,
    canonical name of the child)`` — ``None`` for an empty slot; a shared child appears under every parent
    that holds it. ``parameters`` are its own parameters seen here first (a parameter shared with an earlier
    module is counted there only, as ``parameter_count`` does). ``has_forward`` is False for containers that
    are never called (``ModuleList``, ``ModuleDict``, ``Identity``, a module without its own ``forward``).
    """

    name: str
    type: str
    label: str = ""
    extra_repr: str = ""
    children: tuple[tuple[str, str | None], ...] = ()
    parameters: tuple[ParameterInfo, ...] = ()
    has_forward: bool = True

    @property
    def params(self) -> int:
        """Elements of the module's own (first-seen) parameters."""
        return sum(p.numel() for p in self.parameters)

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.parameters)

    @property
    def global_params(self) -> int:
        """Elements of the module's own (first-seen) parameters on all ranks: :attr:`params` unless sharded."""
        return sum(p.global_numel() for p in self.parameters)


class ModuleTable:
    """The model's modules by canonical name (in ``named_modules()`` order), and every alias that leads to one.

    A view over :attr:`Trace.modules` and :attr:`Trace.aliases`; built by :meth:`Trace.module_table`.
    """

    def __init__(self, modules: list[ModuleInfo], aliases: dict[str, str]) -> None:
        self.source = modules
        self.infos: dict[str, ModuleInfo] = {m.name: m for m in modules}
        self.canonical: list[str] = list(self.infos)
        self.aliases = aliases

    def resolve(self, name: str) -> str:
        """The canonical name for ``name``; a clear error for anything else."""
        if not isinstance(name, str):
            raise InvalidTypeError(f"module_name must be a string, got {type(name).__name__}")
        try:
            return self.aliases[name]
        except KeyError:
            raise InvalidNameError(
                f"Requested module name {name!r} is not among the descendants of the analyzed model."
            ) from None

    def __getitem__(self, name: str) -> ModuleInfo:
        return self.infos[name]

    def __contains__(self, name: object) -> bool:
        return name in self.infos


@dataclass
class Trace:
    """The record of one model run.

    ``scopes`` are the distinct module call stacks (tuples of canonical module names, outermost
    first); each event refers to one by index. ``called`` are canonical names of the modules whose
    ``__call__`` ran; ``assumptions`` describe placeholder values used where a meta tensor had none.
    ``inputs`` describe the tensors the model was called with, in argument order. ``backward`` is True
    when the run included a backward pass (its events have phase ``"backward"`` or ``"recompute"``); a run
    without one ran under ``torch.no_grad()``, as inference does. ``storages`` is every tensor storage the run
    touched, with its size and lifetime (see :class:`Storage`): what the memory metrics replay.

    The trace describes the model and the run too, so it can be reported on without them: ``modules`` are the
    model's modules (:class:`ModuleInfo`, canonical names in ``named_modules()`` order), ``aliases`` map every
    path to a module to its canonical name, ``model`` is the model's class name and ``versions`` the versions
    of the software that recorded it (``{"torch": ...}``). ``op_tags`` is what torch's operator registry says
    about every operator of the run (``"view"``, ``"pointwise"``; see :mod:`modelmeter.engine.op_tags`), so
    that counting it needs no torch. ``output_shapes`` maps a module's canonical name to the shapes its forward
    calls returned (``"1x64x56x56"``, several tensors joined by ``", "``) and how many calls returned each, in
    the order first seen; calls that returned no tensor are not in it. ``gradients`` describe every parameter
    that got a gradient, in the model's parameter order, as the optimizer updates it and keeps state for: the
    parameter's local shard (a DTensor's), which its gradient has too, except where tensor parallelism leaves a
    gradient replicated on a sharded parameter (the vocabulary-sharded embedding's); the gradients' storages are
    the ``"gradient"`` storages — several may share one (FSDP2 reduce-scatters a group's gradients into one).

    ``parallel`` describes the parallel plan of a run that simulated one rank of it (None for a run on one
    device), as plain data: ``{"plan": its text, "world_size", "rank", "mesh": {dimension: ranks},
    "coordinates": {dimension: the rank's index}, "groups": {process group name: mesh dimension},
    "options": {...}}`` (see :mod:`modelmeter.parallel`). Its events and module table are that rank's: local
    shapes, the rank's parameter shards, the collectives it issued.
    """

    events: list[OpEvent] = field(default_factory=list)
    scopes: list[tuple[str, ...]] = field(default_factory=list)
    called: set[str] = field(default_factory=set)
    assumptions: list[str] = field(default_factory=list)
    execution: str = "fake"
    inputs: list[TensorMeta] = field(default_factory=list)
    backward: bool = False
    storages: list[Storage] = field(default_factory=list)
    modules: list[ModuleInfo] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)
    model: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    op_tags: dict[str, tuple[str, ...]] = field(default_factory=dict)
    output_shapes: dict[str, dict[str, int]] = field(default_factory=dict)
    gradients: list[TensorMeta] = field(default_factory=list)
    parallel: dict[str, Any] | None = None

    def defer(self, sizes: dict[str, int], make: Callable[[], dict[str, Any]]) -> None:
        """Leave the fields named in ``sizes`` (lists of those lengths) to ``make``, called the first time one of
        them is read: a trace read from the cache makes its events and storages only when a metric reads them (a
        result kept beside it needs none). ``make`` must not fail: check what it reads before."""
        for name in sizes:
            del self.__dict__[name]
        self.__dict__["_deferred"] = (sizes, make)

    def size(self, name: str) -> int:
        """``len(getattr(self, name))``, without making a deferred field (see :meth:`defer`)."""
        deferred = self.__dict__.get("_deferred")
        if deferred is not None and name in deferred[0] and name not in self.__dict__:
            return int(deferred[0][name])
        return len(getattr(self, name))

    if not TYPE_CHECKING:  # for type checkers, a Trace has its fields and nothing else
        def __getattr__(self, name: str) -> Any:
            """A deferred field, made now (Python asks here only for an attribute the instance does not hold)."""
            deferred = self.__dict__.get("_deferred")
            if deferred is None or name not in deferred[0]:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            for key, value in deferred[1]().items():
                self.__dict__.setdefault(key, value)  # a field assigned meanwhile keeps its value
            self.__dict__.pop("_deferred", None)
            return self.__dict__[name]

    def module_table(self) -> ModuleTable:
        """The modules by canonical name, with their aliases (made once per trace)."""
        table = self.__dict__.get("_module_table")
        if table is None or table.source is not self.modules:
            table = self.__dict__["_module_table"] = ModuleTable(self.modules, self.aliases)
        return table

    def phases(self) -> list[Phase]:
        """The phases the run has events of, in run order."""
        if not self.backward:
            return ["forward"] if self.events else []
        present = {event.phase for event in self.events}
        return [phase for phase in PHASES if phase in present]

    def children(self) -> list[list[int]]:
        """Indices of the direct children of every event, plus the roots at position ``-1`` (made once per list
        of events: every metric walks it; treat it as read-only)."""
        made = self.__dict__.get("_children")
        if made is not None and made[0] is self.events and made[1] == len(self.events):
            return made[2]
        kids: list[list[int]] = [[] for _ in range(len(self.events) + 1)]
        for i, ev in enumerate(self.events):
            kids[ev.parent].append(i)
        self.__dict__["_children"] = (self.events, len(self.events), kids)
        return kids
