"""Record operator calls: a function mode for what the user wrote, a dispatch mode for what ran.

Module scopes come from global module hooks (the way ``torch.utils.module_tracker`` does it):
every call of one of the model's modules pushes its canonical name on a stack, and every recorded
event refers to the stack it ran under.
"""

from __future__ import annotations

import contextlib
import gc
import random
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._torch_compat import (
    EagerDispatchMode,
    FakeTensor,
    HigherOrderOperator,
    JaggedTensor,
    OpOverload,
    OpOverloadPacket,
    any_autocast_enabled,
    counted_by_kernels,
    current_autograd_node,
    function_modes,
    intercepted_function_apply,
    no_torch_function,
    pop_mode_temporarily,
    pytree,
    qualified_name,
    schema_of,
    sharded_tensor_type,
)
from ..errors import ModelRunError, UnsupportedError
from .attention_masks import ATTENTION_CALLS, summarize_mask
from .collectives import group_name_positions, name_groups
from .higher_order import COUNTED_WHOLE, RUNNERS, refuse, run_body
from .inputs import tensors_in
from .kernel_checks import Check, attention_call_check, kernel_check
from .meta_kernels import direct_kernel, fused_on_meta, with_cpu_dtypes
from .metadata import bind_by_name, flat_outputs, place_arguments
from .naming import ModuleNames
from .recurrent import RECURRENT_CALLS, Target, emulate
from .replay import CallMemo, replayable
from .storages import StorageTracker
from .trace import Level, OpEvent, Phase, Trace
from .values import Shadows, written_arguments

_redispatch = getattr(torch.overrides, "redispatch_function", None)
_NODE_TAG = "modelmeter.origin"  # autograd node metadata: (scope, user-level call or -1) of the call that made it

# Python operators whose aten name differs from the dunder's name (``&``, ``|``, ``^``, ``<<``, ``>>`` keep theirs:
# ``aten::__and__`` & co. exist, and they are what torch.jit, and so fvcore, records).
_DUNDER = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_",
    "__sub__": "sub", "__rsub__": "rsub", "__isub__": "sub_",
    "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_",
    "__truediv__": "div", "__rtruediv__": "div", "__itruediv__": "div_", "__div__": "div",
    "__floordiv__": "floor_divide", "__rfloordiv__": "floor_divide",
    "__matmul__": "matmul", "__rmatmul__": "matmul",
    "__pow__": "pow", "__rpow__": "pow", "__ipow__": "pow_",
    "__neg__": "neg", "__abs__": "abs", "__mod__": "remainder",
    "__getitem__": "index", "__setitem__": "index_put_",
    "__invert__": "bitwise_not",
    "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
}


_OWN_DUNDERS = frozenset({"__and__", "__or__", "__xor__", "__lshift__", "__rshift__"})
# Conversion methods: ``x.float()`` is ``x.to(torch.float32)``, recorded by torch.jit as ``aten::to``.
_CONVERSIONS = {name: "to" for name in ("float", "double", "half", "bfloat16", "long", "int", "short", "char",
                                        "byte", "bool", "cpu", "cuda")}
# Calls that may return their input as it is, running no operator (dropout in eval mode, ``contiguous`` of a
# contiguous tensor, a conversion to the tensor's own dtype): still calls, kept for handles set on them.
_MAY_RUN_NOTHING = frozenset(f"aten::{name}" for name in (
    "dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "contiguous", "to", "type_as"))

# Calls that run a pass rather than an operator (a re-entrant checkpoint calls backward inside the backward pass).
_NOT_OPERATORS = frozenset({torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward})


def function_op_name(func: Any) -> str | None:
    """The aten-style name of a user-level call, or None for calls that are not operators."""
    if isinstance(func, OpOverloadPacket):  # torch.ops.quantized.linear(...): its own namespace
        return qualified_name(func)
    name = getattr(func, "__name__", None)
    if name is None or name in ("__get__", "__set__") or func in _NOT_OPERATORS:
        return None
    if name.startswith("__") and name.endswith("__"):
        name = name if name in _OWN_DUNDERS else _DUNDER.get(name)
        if name is None:
            return None
    return f"aten::{_CONVERSIONS.get(name, name)}"


def dispatch_op_name(func: OpOverload) -> str:
    """``aten::addmm`` for ``aten.addmm.default``: the operator without its overload."""
    ns, _, rest = func.name().partition("::")
    return f"{ns}::{rest.split('.')[0]}"


class Recorder:
    """Collects :class:`OpEvent` records into a :class:`Trace` while the model runs.

    For a backward pass (``track_autograd``), every autograd node the forward creates is tagged with the
    module scope of the call that created it; an operator of the backward pass is then attributed to the
    scope of the node autograd is running. Modules that run during the backward pass (activation
    checkpointing re-running a block) make their operators ``"recompute"`` events of their own scope.
    """

    def __init__(self, names: ModuleNames, phase: Phase = "forward", track_autograd: bool = False) -> None:
        self.names = names
        self.trace = Trace()
        self._by_id, self._called = names.by_id, self.trace.called  # read at every module call
        self.phase: Phase = phase
        self.track_autograd = track_autograd
        self.paused = False
        self._stack: list[str] = []  # the names of the modules running, outermost first
        self._outer_scopes: list[int] = []  # the scope each of them was entered from
        self._scope_ids: dict[tuple[str, ...], int] = {}
        self._entered: dict[tuple[int, str], int] = {}  # (scope, module entered) -> the scope inside it
        self._scope = self._scope_index(())
        self._root_scope = self._scope
        self._open: list[int] = []
        self._attention_calls = 0  # open events of attention calls
        self.failed_op: str | None = None
        self.failed_event = -1  # the index of the user-level call that failed (-1: none did)
        self._failed_level: str | None = None
        self.placeholders = False
        self.cpu_stand_ins = False  # meta tensors stand for the CPU's, which CPU autocast would cast (not them)
        self.guessed_values: list[str] = []  # values of meta tensors the run read and assumed (placeholders), in order
        self.noted_guesses: set[str] = set()  # the distinct ones, each listed once in the trace's assumptions
        self.shadows: Shadows | None = None  # values of the small value-determined tensors of a fake run
        self._noted_masks = False
        self.storages = StorageTracker(lambda: len(self.trace.events))
        self.modules_loaded = len(sys.modules)
        self.memo: CallMemo | None = None  # repeated calls replayed (engine/replay.py): set for a forward on meta
        # told the tensors an operator is about to write (real kernels: the parameters a run must put back)
        self.before_write: Callable[[list[torch.Tensor]], None] | None = None
        self.unreplayable = 0  # operators run whose record is not their arguments' metadata alone (replay.py)
        self.imports = 0  # operators that imported modules
        self._thread = _thread_id()  # the recording thread: the recorder modes are its own
        self.elsewhere: list[str] = []  # the model's modules called on another thread during the run (unrecorded)
        self.drew_random = False  # a seeded operator's real kernel drew from torch's default generator

    # module scopes ---------------------------------------------------------------------------
    def _scope_index(self, stack: tuple[str, ...]) -> int:
        index = self._scope_ids.get(stack)
        if index is None:
            index = self._scope_ids[stack] = len(self.trace.scopes)
            self.trace.scopes.append(stack)
        return index

    def enter_module(self, module: nn.Module, *_: Any) -> None:
        name = self._by_id.get(id(module))
        if name is None or (_thread_id() != self._thread and not self._elsewhere_in_run(name)):
            return
        outer = self._scope
        self._stack.append(name)
        self._outer_scopes.append(outer)
        self._called.add(name)
        key = (outer, name)
        scope = self._entered.get(key)
        if scope is None:
            scope = self._entered[key] = self._scope_index((*self.trace.scopes[outer], name))
        self._scope = scope

    def exit_module(self, module: nn.Module, _args: Any = None, output: Any = None) -> None:
        name = self._by_id.get(id(module))
        if name is None or not self._stack or (_thread_id() != self._thread and not self._elsewhere_in_run(name)):
            return
        with no_torch_function():  # what the hook reads of the output is no call of the model's
            if self.track_autograd:  # nodes made by operators no user-level call covered belong to this module
                self.tag_nodes(output, self._scope, -1)
            if self.phase == "forward":  # a checkpointed block re-run in the backward pass is no call of the model's
                self._note_output(name, output)
        # Pop back to this module's entry (robust when an inner call raised).
        while self._stack:
            self._scope = self._outer_scopes.pop()
            if self._stack.pop() == name:
                break

    def _elsewhere_in_run(self, name: str) -> bool:
        """Whether a call of the model's module ``name`` made on another thread than the recording one belongs to the
        run: made on one of autograd's threads running the run's backward pass (it has the recording thread's modes).
        The module hooks are process-wide: a call on another thread — one the model's ``forward`` started, or the
        user's own, running the model meanwhile — runs operators no recorder sees (the modes are the recording
        thread's), and must not push its module on the run's stack: it is noted (:attr:`elsewhere`), and the run
        fails when it ends. (The hooks check the thread first: nearly every call is the recording thread's.)"""
        if any(isinstance(mode, FunctionRecorder) and mode.recorder is self for mode in function_modes()):
            return True
        if name not in self.elsewhere:
            self.elsewhere.append(name)
        return False

    def _note_output(self, name: str, output: Any) -> None:
        """Count the call's output shapes (:func:`output_shapes`) under the module's name; a call that returned
        no tensor is not noted."""
        if isinstance(output, torch.Tensor):  # the common case: the text of one tensor's shape, found by the shape
            shapes = _ONE_SHAPE_TEXTS.get(output.shape) or _one_shape_text(output)
        else:
            shapes = output_shapes(tensors_in(output))
        if shapes:
            calls = self.trace.output_shapes.setdefault(name, {})
            calls[shapes] = calls.get(shapes, 0) + 1

    # autograd ----------------------------------------------------------------------------------
    def tag_nodes(self, value: Any, scope: int, origin: int) -> None:
        """Give the autograd nodes behind ``value`` that have none yet the scope ``scope`` and the user-level
        call ``origin`` (an event index, or -1 for a module's own operators).

        Calls close inner-first, so a node is tagged by the innermost call (or module) that made it; the
        walk stops at nodes tagged before, so every node is visited once. The tag lives in the node's own
        ``metadata``: holding the nodes would keep what they saved alive beyond the real run's lifetimes.
        """
        pending: list[Any] = [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]
        while pending:
            node = pending.pop()
            if node is None:
                continue
            metadata = _metadata(node)
            if _NODE_TAG in metadata:
                continue
            metadata[_NODE_TAG] = (scope, origin)
            pending.extend(next_node for next_node, _ in node.next_functions)

    def start_backward(self, loss: Any) -> None:
        """Switch to the backward phase; nodes of the forward not yet tagged belong to the model itself."""
        self.tag_nodes(loss, self._root_scope, -1)
        self.phase = "backward"

    def pack_saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """Autograd's pack hook: note what the forward saves. The alias returned keeps the storage alive as
        the saved tensor would, without the reference cycle that saving an output by itself makes."""
        if self.phase == "forward":
            self.storages.saved(tensor, self._scope)
        if self.shadows is not None and not (tensor.is_meta or isinstance(tensor, FakeTensor)):  # (inlined: hot)
            return tensor  # a real tensor in a fake run (a loss's target): detached, it would become a fake copy
        paused, self.paused = self.paused, True
        try:
            return tensor.detach()
        finally:
            self.paused = paused

    def after_import(self) -> None:
        """An operator imported modules (PyTorch's first call of some kernels imports ``torch._dynamo``). Module code
        that keeps its own frame (``inspect.currentframe()`` in a local) makes a reference cycle holding the whole
        call stack of the import — the model's tensors in its frames among it — which only the cyclic collector,
        paused while recording, would free: collected now, so tensors die where the model drops them, the first
        run of a process as every other."""
        gc.collect(0)  # the young generation: nothing is collected while recording, so the cycle is young
        self.modules_loaded = len(sys.modules)
        self.imports += 1  # the collection may have freed storages of any call open now: not a template (replay.py)

    def finish_storages(self, parameters: list[torch.Tensor]) -> None:
        """The run is over: what lives now outlives it; ``parameters`` are the model's, as the run leaves them.
        Their storages are read with the recorder's function mode set aside: reading them is no call of the model's
        (under the mode, each read would be a user-level call opened and dropped again)."""
        if self.storages.open:
            with no_torch_function():
                self.storages.parameters_at_end(parameters)
            self.trace.storages = self.storages.close()
            self.trace.gradients = self.storages.gradients

    def _event_context(self) -> tuple[int, Phase, int]:
        """Scope, phase and origin (the user-level forward call whose autograd node runs, or -1) of an event."""
        if self.phase == "forward":
            return self._scope, "forward", -1
        if self._stack:  # a module runs inside the backward pass: recomputation
            return self._scope, "recompute", -1
        node = current_autograd_node()
        scope, origin = _metadata(node).get(_NODE_TAG, (self._root_scope, -1)) if node is not None else \
            (self._root_scope, -1)
        return scope, "backward", origin

    # events ----------------------------------------------------------------------------------
    def open_call(self) -> int:
        """The index of the innermost user-level call open now (the parent of an event made now), or -1."""
        return self._open[-1] if self._open else -1

    def current_scope(self) -> int:
        return self._scope

    def refines(self, op: str) -> bool:
        """Whether a call of ``op`` made now refines the call open around it (see :meth:`open_function`)."""
        events, open_calls = self.trace.events, self._open
        return bool(open_calls) and open_calls[-1] == len(events) - 1 and events[-1].op == op

    def open_function(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                      python: bool = False) -> tuple[int, bool]:
        """Start a user-level event (``python``: the call is Python code, see :attr:`OpEvent.python`); a call
        nested directly in one of the same name refines it."""
        events = self.trace.events
        if self.refines(op):
            top = self._open[-1]
            events[top].inputs, events[top].kwargs, events[top].overload = self._bind(op, args, kwargs)
            events[top].python = python
            return top, False
        inputs, extra, overload = self._bind(op, args, kwargs)
        scope, phase, origin = self._event_context()
        events.append(OpEvent(op, "function", self._open[-1] if self._open else -1, scope, phase, inputs, [], extra,
                              origin, python, overload))
        self._open.append(len(events) - 1)
        if op in ATTENTION_CALLS:
            self._attention_calls += 1
            self.unreplayable += 1  # its record holds what its mask's values let through (replay.py)
        return len(events) - 1, True

    def _bind(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any], str]:
        inputs, extra, overload = bind_by_name(op, args, kwargs)
        if op not in ATTENTION_CALLS:
            return inputs, extra, overload
        values = self.shadows.get if self.shadows is not None else None
        if not summarize_mask(op, inputs, args, kwargs, values) and not self._noted_masks:
            self._noted_masks = True
            self.trace.assumptions.append(
                f"{_where(self)}: an attention mask's values are unknown (it depends on weights or activations, "
                "or was given on the meta device), so masked attention is counted dense; is_causal is counted "
                "exactly, and execution='real' reads the masks")
        return inputs, extra, overload

    def close_function(self, index: int, opened: bool, result: Any, operator: bool = False) -> None:
        """End a user-level event; one that ran nothing inside is no operator call (dropped), unless
        ``operator`` says it is one (a higher-order operator runs with the dispatch recorder set aside) or it is a
        call that may leave its input as it is (``_MAY_RUN_NOTHING``)."""
        events = self.trace.events
        if not opened:
            return
        self._pop_open(index)
        if index == len(events) - 1 and not operator and events[index].op not in _MAY_RUN_NOTHING:
            events.pop()
            return
        events[index].outputs = flat_outputs(result)
        if self.track_autograd and self.phase != "backward":
            self.tag_nodes(result, events[index].scope, index)

    def in_attention_call(self) -> bool:
        """True inside an attention call: its mask was read at the call, nothing inside needs values (and the
        masks a math kernel builds for itself are large)."""
        return self._attention_calls > 0

    def abandon_function(self, index: int, opened: bool) -> None:
        if opened and self._open and self._open[-1] == index:
            self._pop_open(index)

    def _pop_open(self, index: int) -> None:
        self._open.pop()
        if self.trace.events[index].op in ATTENTION_CALLS:
            self._attention_calls -= 1

    def add_dispatch(self, op: str, schema: torch.FunctionSchema, args: tuple[Any, ...], kwargs: dict[str, Any],
                     result: Any) -> None:
        scope, phase, origin = self._event_context()
        self.trace.events.append(OpEvent(op, "dispatch", self._open[-1] if self._open else -1, scope, phase,
                                         place_arguments(schema, args, kwargs), flat_outputs(result), origin=origin,
                                         overload=schema.overload_name or "default"))

    def synthetic_target(self) -> Target:
        """Where events written without running their operators go (engine/recurrent.py): inside the call open now,
        in its scope and phase."""
        scope, phase, origin = self._event_context()
        return Target(self.trace.events, self.storages.records, self._open[-1], scope, phase, origin,
                      self.storages.outputs, self.storages.knows)

    def call(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any], run: Callable[[], Any], *,
             python: bool = False, operator: bool = False) -> Any:
        """Record ``run()`` as a user-level call of ``op`` on ``args``/``kwargs`` (see :meth:`open_function` and
        :meth:`close_function`); a failure is noted as the call's and leaves no open event behind."""
        index, opened = self.open_function(op, args, kwargs, python)
        try:
            result = run()
        except BaseException:
            self.note_failure(op, "function", index)
            self.abandon_function(index, opened)
            raise
        self.close_function(index, opened, result, operator=operator)
        return result

    def note_failure(self, op: str, level: Level, event: int = -1) -> None:
        """Remember where the model failed: the innermost user-level call (``event``, its index), else the aten
        operator."""
        if self.failed_op is None or (level == "function" and self._failed_level == "dispatch"):
            self.failed_op, self._failed_level, self.failed_event = op, level, event


class FunctionRecorder(TorchFunctionMode):
    """Sees the calls the user's code made (``F.linear``, ``x @ w``), nested ones included."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self._active: list[Any] = []

    def __torch_function__(self, func: Any, types_: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        rec = self.recorder
        call = _function_call(func)
        if call is None or rec.paused:
            return func(*args, **kwargs)
        # CPU autocast entered by the model, which FakeTensors on the CPU follow (any device's first: one call)
        if rec.cpu_stand_ins and any_autocast_enabled() and torch.is_autocast_enabled("cpu"):
            raise UnsupportedError("CPU autocast does not cast the meta tensors that stand for CPU ones")
        if counted_by_kernels((args, kwargs)):  # under vmap or forward-mode AD: see counted_by_kernels
            return _as_on_the_cpu(func, args, kwargs)
        op, python_function, higher_order = call
        if JaggedTensor in types_:
            try:
                if op in ATTENTION_CALLS:
                    return _jagged_attention(rec, func, op, args, kwargs)
                return func(*args, **kwargs)  # counted by the dense operators it runs on the values
            except BaseException:
                rec.note_failure(op, "function")
                raise
        indexing = func is _GETITEM or func is _SETITEM

        def record() -> Any:
            return rec.call(op, args, kwargs, lambda: self._run(func, types_, args, kwargs, python_function,
                                                                   higher_order),
                            python=python_function or indexing, operator=higher_order)

        memo = rec.memo
        if memo is None or higher_order or op in _NOT_REPLAYED or func in self._active or rec.refines(op):
            return record()
        return memo.run(func, args, kwargs, record)

    def _run(self, func: Any, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any], python_function: bool,
             higher_order: bool) -> Any:
        """Run a user-level call. Python-level functions run with the mode re-entered, so the calls they make are
        seen too; a function that reaches the mode again through its own C implementation runs plainly."""
        body = RUNNERS.get(func) if python_function else None
        if body is not None:  # as torch's eager kernel runs it: the body's operators, every call in them seen
            with self:
                return run_body(body, args, kwargs)
        if python_function and func not in self._active and _redispatch is not None:
            self._active.append(func)
            try:
                with self:
                    return _redispatch(func, types_, args, kwargs)
            finally:
                self._active.pop()
        if higher_order:  # run as a whole, set aside: flex_attention counted by its own rule, print doing no work
            if func.name() not in COUNTED_WHOLE:
                raise refuse(func.name())
            with pop_mode_temporarily():
                return func(*args, **kwargs)
        if func in RECURRENT_CALLS:  # LSTM, GRU, RNN on meta tensors: their decomposition written, not run
            emulated = emulate(self.recorder.synthetic_target, func, args, kwargs)
            if emulated is not None:
                return emulated
        return _as_on_the_cpu(func, args, kwargs)


def _as_on_the_cpu(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)``; on meta tensors, attention runs as the CPU's fused kernel would (meta_kernels.py),
    after the CPU's check of its mask (kernel_checks.attention_call_check)."""
    if func is not F.scaled_dot_product_attention:
        return func(*args, **kwargs)
    attention_call_check(args, kwargs)
    fused = fused_on_meta(*args, **kwargs)
    return func(*args, **kwargs) if fused is None else fused


def _jagged_attention(rec: Recorder, func: Any, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Attention on jagged nested tensors, recorded as one call per sequence (dense, a batch of one).

    PyTorch runs it per sequence on nested tensors of strided layout, whose operators cannot be described; the
    call runs with the dispatch recorder set aside. Its backward pass would run such operators too: refused."""
    tensors = tensors_in((args, kwargs))
    if rec.track_autograd and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise UnsupportedError("the backward pass of attention on jagged nested tensors cannot be counted "
                               "(PyTorch runs it per sequence, unseen): count the forward pass, or run each "
                               "sequence as a dense tensor")
    with pop_mode_temporarily():
        result = func(*args, **kwargs)
        count = len(next(t for t in tensors if isinstance(t, JaggedTensor)).offsets()) - 1
        calls = [(_sequence(args, i), _sequence(kwargs, i), _sequence(result, i)) for i in range(count)]
    for sequence_args, sequence_kwargs, sequence_result in calls:
        index, opened = rec.open_function(op, sequence_args, sequence_kwargs)
        rec.close_function(index, opened, sequence_result, operator=True)
    return result


def _sequence(tree: Any, index: int) -> Any:
    """Sequence ``index`` of every jagged tensor in ``tree``, as a dense batch of one."""
    return pytree.tree_map_only(JaggedTensor, lambda t: t.unbind()[index].unsqueeze(0), tree)


def _function_call(func: Any) -> tuple[str, bool, bool] | None:
    """(operator name, a Python function, a higher-order operator) of a user-level call, or None for calls that
    are not operators; remembered per function (the same few are called again and again)."""
    try:
        return _FUNCTION_CALLS[func]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    op = None if isinstance(func, OpOverload) else function_op_name(func)
    # (a higher-order operator run here runs as Python code does: engine/higher_order.py)
    call = None if op is None else (op, isinstance(func, types.FunctionType) or func in RUNNERS,
                                    isinstance(func, HigherOrderOperator) and func not in RUNNERS)
    with contextlib.suppress(TypeError):
        _FUNCTION_CALLS[func] = call
    return call


_FUNCTION_CALLS: dict[Any, tuple[str, bool, bool] | None] = {}
_thread_id = threading.get_ident

# Calls never replayed (engine/replay.py): attention reads its mask's values, a recurrent call writes its events itself.
_NOT_REPLAYED = frozenset({*ATTENTION_CALLS, *(function_op_name(f) for f in RECURRENT_CALLS)})
# Indexing runs one operator per index (``slice``, ``select``, ``index``): Python-level, as far as the record goes.
_GETITEM, _SETITEM = torch.Tensor.__getitem__, torch.Tensor.__setitem__


def python_op_name(function: type) -> str:
    """The operator name of a custom ``torch.autograd.Function`` (fvcore's: ``prim::PythonOp.<class name>``)."""
    return f"prim::PythonOp.{function.__name__}"


@contextlib.contextmanager
def autograd_functions(recorder: Recorder) -> Iterator[None]:
    """Record every ``torch.autograd.Function.apply`` on this thread as a user-level call named
    :func:`python_op_name`.

    ``apply`` is implemented in C and reaches neither recorder mode: it is intercepted for the run (the one patch of
    torch a run makes, see :func:`intercepted_function_apply`). What the Function's forward runs is recorded inside
    the call; its outputs tag the autograd node, so its backward is attributed to it as well.
    """

    def record(cls: type, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if recorder.paused:
            return run(*args, **kwargs)
        recorder.unreplayable += 1  # its forward is the user's code: a call around it is recorded every time
        # The tensor arguments, in order: what fvcore passes a PythonOp's handle.
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        return recorder.call(python_op_name(cls), tensors, {}, lambda: run(*args, **kwargs), operator=True)

    with intercepted_function_apply(record):
        yield


class DispatchRecorder(EagerDispatchMode):
    """Sees every aten operator that reaches the dispatcher, and records its metadata (with no guard against
    torch.compile around each operator: see :class:`EagerDispatchMode`).

    A call on DTensors is not recorded itself: it is handed to DTensor (``NotImplemented``, as torch's
    ``CommDebugMode`` does), whose implementation runs the rank's local operators and the collectives of any
    redistribution, and those come back here, with the shapes of the rank's shards."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.sharded = sharded_tensor_type()  # DTensor, when torch.distributed.tensor is in use

    def __torch_dispatch__(self, func: Any, types_: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if self.sharded is not None and self.sharded in types_:
            return NotImplemented
        kwargs = kwargs or {}
        rec = self.recorder
        operator = _OPERATORS.get(func) or _operator(func)
        if operator.prim:  # device and layout queries are not operators
            return func(*args, **kwargs)
        if JaggedTensor in types_:
            return self._on_jagged(func, operator.name, types_, args, kwargs)
        if rec.paused:  # not the model's work (the default loss), but its memory is the step's
            result = _kernel(operator, func, args, kwargs)
            rec.storages.outputs(result, len(rec.trace.events), "other")
            return result
        shadows = rec.shadows
        try:
            if not operator.replayable:
                rec.unreplayable += 1
            if operator.check is not None:  # what the CPU kernel refuses and the meta kernel lets through
                operator.check(args, kwargs)
            known = shadows.answer(func, args, kwargs) if shadows is not None else None
            if known is not None:  # .item() or nonzero of value-determined tensors: no need for real kernels
                result = known
            elif rec.placeholders and func in _PLACEHOLDERS:
                result = _PLACEHOLDERS[func](rec, args)
            elif func is _GROUPED_MM and args[0].dtype == torch.float32 and _without_values(args[0]):
                result = _grouped_mm_in_float32(func, args, kwargs)
            else:
                if operator.mutable and rec.before_write is not None:
                    rec.before_write(written_arguments(operator.schema, args, kwargs))
                result = _kernel(operator, func, args, kwargs)
            if len(sys.modules) != rec.modules_loaded:
                rec.after_import()
            if shadows is not None and not rec.in_attention_call():
                shadows.propagate(func, args, kwargs, result, operator.schema, operator.mutable, operator.seeded)
            rec.add_dispatch(operator.name, operator.schema, args, kwargs, result)  # fails on what it cannot describe
            if operator.groups:  # a functional collective: its group by name
                name_groups(rec.trace.events[-1].inputs, operator.groups)
        except BaseException:
            rec.note_failure(operator.name, "dispatch")
            raise
        if operator.seeded and kwargs.get("generator") is None and not any(map(_without_values, _tensors(result))):
            rec.drew_random = True  # a real kernel drew from torch's default generator: the run puts it back
        rec.storages.outputs(result, len(rec.trace.events) - 1)
        if operator.collective:
            rec.storages.communication(_written(operator.schema, args, kwargs, result))
        return result

    def _on_jagged(self, func: Any, name: str, types_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An operator on jagged nested tensors is not recorded itself: the operators its implementation runs on
        the dense values (all sequences packed together) are, so it counts as the sum over the sequences."""
        if self.recorder.paused:
            return func(*args, **kwargs)
        try:
            with self:
                return JaggedTensor.__torch_dispatch__(func, types_, args, kwargs)
        except BaseException:
            self.recorder.note_failure(name, "dispatch")
            raise


class _Operator(NamedTuple):
    """What the dispatch recorder needs of an aten operator, worked out once per operator."""

    name: str
    schema: torch.FunctionSchema
    prim: bool
    mutable: bool
    direct: tuple[Callable[[tuple[Any, ...]], bool], Callable[..., Any]] | None
    check: Check | None
    groups: tuple[int, ...]  # where a functional collective takes its group's name
    collective: bool
    replayable: bool  # its record is its arguments' metadata alone (engine/replay.py)
    seeded: bool  # draws from a random number generator (torch's tag)



# The namespaces of the operators that fill communication buffers: c10d's collectives (all-gather, reduce-scatter,
# all-reduce into given tensors) and FSDP2's copies into and out of them. Functional collectives
# (``_c10d_functional``) return the tensors the model goes on with: activations.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "fsdp"})


def _kernel(operator: _Operator, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func``: its direct meta kernel where it has one for these arguments (engine/meta_kernels.py)."""
    direct = operator.direct
    if direct is not None and direct[0](args):
        return direct[1](*args, **kwargs)
    if operator.collective:  # a fake process group's work draws its id from Python's random: not a draw of the model's
        state = random.getstate()  # (a run that draws is neither shared nor cached: tracer.py)
        try:
            return func(*args, **kwargs)
        finally:
            random.setstate(state)
    return with_cpu_dtypes(func, args, func(*args, **kwargs))


def _operator(func: OpOverload) -> _Operator:
    placeholder = _LIBRARY_PLACEHOLDERS.get(dispatch_op_name(func))
    if placeholder is not None:  # a library's operator: known once called (its library need not be loaded)
        _PLACEHOLDERS[func] = placeholder
    schema = schema_of(func)
    groups = group_name_positions(func.namespace, schema)
    collective = func.namespace in _COLLECTIVE_NAMESPACES
    found = _OPERATORS[func] = _Operator(dispatch_op_name(func), schema, func.namespace == "prim", schema.is_mutable,
                                         direct_kernel(func), kernel_check(func), groups, collective,
                                         replayable(func, collective or bool(groups)) and func not in _PLACEHOLDERS,
                                         torch.Tag.nondeterministic_seeded in func.tags)
    return found


def _written(schema: torch.FunctionSchema, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any
             ) -> list[torch.Tensor]:
    """The tensors an operator wrote: the arguments its schema marks as written (``Tensor(a!)``), and its outputs."""
    return [*_tensors(result), *written_arguments(schema, args, kwargs)]


_OPERATORS: dict[Any, _Operator] = {}


def _metadata(node: Any) -> dict[str, Any]:
    """An autograd node's metadata: a dict kept by the node itself (its Python wrapper may be made anew)."""
    return node.metadata


# The most tensors one module call's output is described by; the rest are counted (``+20 more``).
_SHAPES_SHOWN = 4


def output_shapes(tensors: list[torch.Tensor]) -> str:
    """``"1x64x56x56"``, ``"2x5x8, 1x2x8"`` for several tensors (in the output's order), ``"scalar"`` for a 0-d
    one; ``""`` for none. Made once per distinct list of shapes: it runs at the end of every module call."""
    key = (tuple([t.shape for t in tensors[:_SHAPES_SHOWN]]), len(tensors))
    text = _SHAPE_TEXTS.get(key)
    if text is None:
        shapes = ["x".join(map(str, shape)) if shape else "scalar" for shape in key[0]]
        if len(tensors) > _SHAPES_SHOWN:
            shapes.append(f"+{len(tensors) - _SHAPES_SHOWN} more")
        if len(_SHAPE_TEXTS) > 4096:  # bounded, whatever the run
            _SHAPE_TEXTS.clear()
        text = _SHAPE_TEXTS[key] = ", ".join(shapes)
    return text


_SHAPE_TEXTS: dict[tuple[tuple[torch.Size, ...], int], str] = {}


def _one_shape_text(tensor: torch.Tensor) -> str:
    """:func:`output_shapes` of one tensor, remembered by its shape."""
    if len(_ONE_SHAPE_TEXTS) > 4096:  # bounded, whatever the run
        _ONE_SHAPE_TEXTS.clear()
    text = _ONE_SHAPE_TEXTS[tensor.shape] = output_shapes([tensor])
    return text


_ONE_SHAPE_TEXTS: dict[torch.Size, str] = {}


def _tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else tensors_in(value)


def _scalar_placeholder(rec: Recorder, args: tuple[Any, ...]) -> Any:
    tensor = args[0]
    value: Any = True if tensor.dtype == torch.bool else (1 if not tensor.is_floating_point() else 1.0)
    _guessed(rec, f"{_where(rec)}: value of a {tensor.dtype} meta tensor read with .item() assumed to be {value!r}")
    return value


def _nonzero_placeholder(rec: Recorder, args: tuple[Any, ...]) -> Any:
    tensor = args[0]
    _guessed(rec, f"{_where(rec)}: every element of a meta tensor of shape {tuple(tensor.shape)} assumed non-zero")
    return torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)


def _nms_placeholder(rec: Recorder, args: tuple[Any, ...]) -> Any:
    """torchvision's ``nms`` keeps every box, best first: an upper bound (which boxes it keeps depends on values)."""
    boxes = args[0]
    _guessed(rec, f"{_where(rec)}: torchvision's nms of {boxes.shape[0]} meta boxes assumed to keep every one (an "
                  "upper bound: the boxes kept depend on values)")
    return torch.empty((boxes.shape[0],), dtype=torch.long, device=boxes.device)


def _guessed(rec: Recorder, text: str) -> None:
    if len(rec.guessed_values) >= GUESSES:  # a loop until a value changes (``while err > tol``) would never end
        raise ModelRunError(f"the model read {GUESSES} values of meta tensors, each assumed: it likely loops until a "
                            "value it computes changes, which an assumed value never does", None, None)
    if text not in rec.noted_guesses:  # a loop reading the same value lists its assumption once
        rec.noted_guesses.add(text)
        rec.trace.assumptions.append(text)
    rec.guessed_values.append(text)


GUESSES = 10_000  # the placeholder values one run may assume


def _where(rec: Recorder) -> str:
    scope = rec.trace.scopes[rec._scope]
    return f"module {scope[-1]!r}" if scope and scope[-1] else "the model's own forward"


def _without_values(tensor: torch.Tensor) -> bool:
    return tensor.is_meta or isinstance(tensor, FakeTensor)


def _grouped_mm_in_float32(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``_grouped_mm`` of float32 operands without values: the CPU kernel takes float32, but the meta kernel
    (which fake and meta runs use) rejects it. The output is what the meta kernel gives for bfloat16 operands,
    in float32: the shape checks and the output shape are torch's own."""
    cast = torch.ops.aten._to_copy.default  # an aten call: not seen by the function recorder
    low = [cast(a, dtype=torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
           for a in args]
    return cast(func(*low, **kwargs), dtype=torch.float32)


_GROUPED_MM = torch.ops.aten._grouped_mm.default
_ITEM = torch.ops.aten._local_scalar_dense.default
_PLACEHOLDERS = {
    _ITEM: _scalar_placeholder,
    torch.ops.aten.nonzero.default: _nonzero_placeholder,
}
_LIBRARY_PLACEHOLDERS = {"torchvision::nms": _nms_placeholder}
