"""Every private PyTorch API modelmeter uses, and the patches of torch a run makes: the one place to read on a torch
upgrade (docs/torch.md).

No other module of the package names a private ``torch`` module, class, function or attribute
(``tests/test_torch_compat.py`` enforces it); they import what they need from here. Each name says why it is needed
and, where known, since which torch version it exists; all were checked against torch 2.14.1, the version this
release is tested with. torch promises nothing about any of them, so an upgrade may move one. Operators are not
listed: ``torch.ops.aten._to_copy`` and the like are dispatcher operators, named by their schema as the trace
records them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

# Operator types (torch._ops, since 1.13): what a mode is called with, an aten overload (``aten.addmm.default``), a
# packet called directly (``torch.ops.quantized.linear``) or a higher-order operator (``flex_attention``).
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

# FakeTensors (torch._subclasses.fake_tensor, since 2.0): a fake run replaces parameters, buffers and inputs by
# FakeTensors (metadata, no storage); FakeTensorMode and FakeTensor have no public home. The three ``...Exception``s
# tell "the model needs values" (fall back to real kernels) from a failure of the model; FakeTensorDeviceMismatchError
# tells a model that mixes in CUDA tensors; unset_fake_temporarily makes a meta tensor inside the mode that stays meta.
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorDeviceMismatchError,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    unset_fake_temporarily,
)

# Jagged nested tensors (torch.nested._internal.nested_tensor): inputs of ``torch.jagged`` layout have no public
# class to test for.
from torch.nested._internal.nested_tensor import NestedTensor as JaggedTensor
from torch.nn.utils import parametrize

# pytree (torch.utils._pytree): maps over the nested containers of a call's arguments.
from torch.utils import _pytree as pytree

# Dispatch modes (torch.utils._python_dispatch): TorchDispatchMode is documented but lives in a private module.
# _disable_current_modes runs real kernels for the values of small tensors in the middle of a fake run;
# _pop_mode_temporarily runs a higher-order operator or a jagged attention call with the dispatch recorder set aside.
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._python_dispatch import _pop_mode as pop_dispatch_mode
from torch.utils._python_dispatch import _pop_mode_temporarily as pop_mode_temporarily

__all__ = [  # what the package imports from here
    "COMPILED_CALL_IMPL", "COMPILED_MODULE_ATTRIBUTE", "COMPILED_MODULE_CLASS", "FLEX_ATTENTION_MODULE",
    "GRADIENT_HOOKS", "MODULE_CALL_IMPL", "MODULE_TABLES", "POST_ACCUMULATE_GRAD_HOOKS",
    "TENSOR_HOOK_TABLES", "WEIGHTS_ONLY_UNPICKLER", "DataDependentOutputException",
    "DynamicOutputShapeException", "EagerDispatchMode", "FakeTensor", "FakeTensorDeviceMismatchError",
    "FakeTensorMode", "HigherOrderOperator", "JaggedTensor", "OpOverload", "OpOverloadPacket", "TorchDispatchMode",
    "UnsupportedFakeTensorException", "any_autocast_enabled", "backward_hooks", "buffers_of",
    "caller_modes_set_aside", "children_of",
    "class_name",
    "conv_memory_format", "counted_by_kernels", "cuda_lazy_init_code", "current_autograd_node", "default_device_set",
    "disable_current_modes", "eager_flex_attention", "fake_from_meta", "fake_store", "fake_tensor_log_silenced",
    "flat_dcp_state", "flattened_mesh",
    "forward_hook_tables", "function_modes", "global_backward_hooks", "global_forward_hooks",
    "intercepted_function_apply",
    "kept_distributed_globals", "local_tensor", "no_dispatch", "no_torch_function", "non_persistent_buffers",
    "observed_cpu_rng_states", "observed_storage_resizes", "parameters_of", "parametrizations_cached",
    "parametrizations_set_aside",
    "pop_mode_temporarily", "python2_pickle_mappings", "pytree", "qualified_name", "replicate_module",
    "resolve_group_name", "saved_tensors_hooks_set_aside", "schema_of", "script_object_type",
    "set_state_dict_metadata", "sharded_tensor_type", "state_dict_metadata",
    "torch_stacks_kept", "unseen_global_shape_runs", "unset_fake_temporarily",
    "version_counter", "weights_only_allowed_globals",
]

# The logger FakeTensorMode writes a traceback to (ERROR) before it raises; the CLI silences it.
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


def fake_from_meta(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A FakeTensor of ``mode`` on ``device`` wrapping ``meta`` (``FakeTensorConverter.from_meta_and_device``, in
    2.14.1): ten times faster than ``mode.from_tensor`` converting the original, which matters for large models."""
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)


def conv_memory_format(x: torch.Tensor, weight: torch.Tensor, **geometry: Any) -> torch.memory_format:
    """The memory format a convolution's output and gradients get on the device of the FakeTensors ``x`` and
    ``weight`` (with ``geometry``: stride, padding, ..., ``bias`` or ``bias_sizes``): the backend torch selects for
    them and that backend's layout (``torch._C._select_conv_backend``, ``_conv_determine_backend_memory_format``), as
    FakeTensors' own convolution does (``fake_impls.conv``, 2.14.1). Called under the FakeTensors' mode."""
    backend = torch._C._select_conv_backend(x, weight, **geometry)
    return torch._C._conv_determine_backend_memory_format(x, weight, backend)


class EagerDispatchMode(TorchDispatchMode):
    """A TorchDispatchMode whose ``__torch_dispatch__`` is not wrapped in ``torch._disable_dynamo``.

    ``TorchDispatchMode.__init_subclass__`` wraps a subclass's ``__torch_dispatch__`` unless the private class hook
    ``_should_skip_dynamo`` says False (2.14.1; "a temporary measure", its docstring says): the guard costs
    microseconds per operator, and a second to import ``torch._dynamo`` on its first use in a process. A recorded run
    is eager (compiled wrappers are made transparent), so the guard is not needed. Should torch drop the hook, the
    override is inert and only the speed changes.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def schema_of(op: OpOverload) -> torch.FunctionSchema:
    """An overload's schema (``OpOverload._schema``, since 1.13): argument names, defaults, aliasing, mutability."""
    return op._schema


def qualified_name(packet: OpOverloadPacket) -> str:
    """``quantized::linear`` for ``torch.ops.quantized.linear`` (``OpOverloadPacket._qualified_op_name``, 1.13)."""
    return str(packet._qualified_op_name)


# --- autograd (torch._C, since 2.0) ----------------------------------------------------------------------------------
# The autograd node running now (None outside a backward pass): attributes a backward operator to the forward call
# that made the node. torch.autograd.graph uses it itself; there is no public wrapper.
current_autograd_node: Callable[[], Any] = torch._C._current_autograd_node

# A tensor's own hook tables (attributes of every tensor, since 2.1): ``register_hook`` and
# ``register_post_accumulate_grad_hook`` make one on a tensor that has none; the snapshot empties those a run made.
# The second is an optimizer's when it steps in the backward pass (a run's backward sets it aside).
# The first holds hooks of the gradient (``register_hook``), which a fake run's stand-ins of parameters run too.
GRADIENT_HOOKS = "_backward_hooks"
POST_ACCUMULATE_GRAD_HOOKS = "_post_accumulate_grad_hooks"
TENSOR_HOOK_TABLES = (GRADIENT_HOOKS, POST_ACCUMULATE_GRAD_HOOKS)


_FORWARD_AD = torch.autograd.forward_ad
_PEEK_TRANSFORMS: Callable[[], Any] = torch._C._functorch.peek_interpreter_stack


def counted_by_kernels(arguments: Any) -> bool:
    """Whether a function-level call's shapes miss work its kernels do, so the operators they run are what counts:
    forward-mode AD is on (a ``forward_ad.dual_level`` open, ``_current_level`` since 1.10, or ``torch.func.jvp``),
    whose tangents are computed inside the call by operators of their own; or a tensor among ``arguments`` (a tree)
    is batched by ``torch.func.vmap``, at any level of functorch's wrappers, so the call sees one row of what its
    kernels run on (torch._C._functorch, since 2.0; neither has a public test)."""
    if _FORWARD_AD._current_level >= 0:
        return True
    if _PEEK_TRANSFORMS() is None:  # no transform running: the common case, one call (at every function-level call)
        return False
    functorch = torch._C._functorch
    if any(interpreter.key() == functorch.TransformType.Jvp for interpreter in functorch.get_interpreter_stack()):
        return True
    for tensor in pytree.tree_leaves(arguments):
        while isinstance(tensor, torch.Tensor) and functorch.is_functorch_wrapped_tensor(tensor):
            if functorch.is_batchedtensor(tensor):
                return True
            tensor = functorch.get_unwrapped(tensor)
    return False

# --- __torch_function__ handling (torch._C, since 1.12) -------------------------------------------------------------
# Turns __torch_function__ handling off for a block, modes included: the recorder's module hooks read the shapes of a
# module's outputs without the function recorder seeing every attribute access (a microsecond each). What
# torch.overrides uses itself; there is no public name.
no_torch_function: Callable[[], Any] = torch._C.DisableTorchFunction


def function_modes() -> list[Any]:
    """The ``TorchFunctionMode`` instances active on this thread, outermost first (``torch.overrides`` has the same
    walk in a private function). Autograd's threads run a backward pass with the modes of the thread that started
    it (``at::ThreadLocalState`` carries them): the recorder's module hooks tell its calls from another thread's."""
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]

# --- dispatch switches (torch._C, since 2.0) -------------------------------------------------------------------------
# Turns the Python dispatch modes off for a block: a replayed call (engine/replay.py) makes its outputs unseen by the
# dispatch recorder (``torch.utils._python_dispatch`` uses it the same way). Whether autocast is on for any device:
# one call, where ``torch.is_autocast_enabled(device)`` is one per device type (2.4 on).
no_dispatch: Callable[[], Any] = torch._C._DisableTorchDispatch
any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled


# --- nn.Module's own tables ----------------------------------------------------------------------------------------
# A module keeps its parameters, buffers and submodules in the dicts ``_parameters``, ``_buffers`` and ``_modules``
# (all versions): the walks read them directly, as ``named_modules()`` does, but see every path to a shared module
# and every ``None`` entry, and the snapshot puts their entries back after a run.
MODULE_TABLES = ("_parameters", "_buffers", "_modules")


def parameters_of(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own parameters by name (``None`` for one registered as None)."""
    return module._parameters


# --- DTensor (torch.distributed.tensor, since 2.4) ------------------------------------------------------------------
@contextlib.contextmanager
def unseen_global_shape_runs() -> Iterator[None]:
    """While open, the operators DTensor runs to work out an operator's global output shape reach no mode of ours.

    DTensor's sharding propagation runs each new operator once on FakeTensors of the global shapes
    (``ShardingPropagator._propagate_tensor_meta_non_cached``, 2.14.1) with the modes of the run active: a recorder
    would count that work, which no rank does (and only the first time, the result being cached). The only seam is
    ``ShardingPropagator._fake_mode_lock``, a ``nullcontext`` that torch's multi-threaded tests replace by a lock and
    that encloses exactly that run: replaced here by a context that sets every dispatch mode aside (sharding
    propagation then makes a FakeTensorMode of its own), and put back on exit. Nothing to do, and nothing
    imported, when DTensor was never imported (no DTensor can run)."""
    propagation = sys.modules.get("torch.distributed.tensor._sharding_prop")
    if propagation is None:
        yield
        return
    propagator = propagation.ShardingPropagator
    original = propagator.__dict__["_fake_mode_lock"]
    propagator._fake_mode_lock = _ModesAside()
    try:
        yield
    finally:
        propagator._fake_mode_lock = original


def fake_store() -> Any:
    """The store of torch's fake process group (``torch.testing._internal.distributed.fake_pg``, since 2.1: what
    PyTorch's own tests simulate ranks with); importing it registers the ``"fake"`` backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def flattened_mesh(mesh: Any, name: str) -> Any:
    """``mesh``'s dimensions flattened into one named ``name`` (``DeviceMesh._flatten``, since 2.6: torchtitan's way
    to one data-parallel group over several dimensions; no public spelling yet)."""
    return mesh._flatten(name)


def replicate_module() -> Callable[..., Any]:
    """torch's ``replicate`` — DDP as a composable API, on FSDP2's machinery: gradients all-reduced per parameter
    group (``torch.distributed._composable.replicate_with_fsdp``, 2.14.1; its home is not public yet)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate


@contextlib.contextmanager
def kept_distributed_globals() -> Iterator[None]:
    """Put back on exit what ``init_process_group`` and ``destroy_process_group`` leave set: c10d's legacy
    ``_backend`` name (2.14.1), the ``sys.excepthook`` that prefixes tracebacks with ``[rank0]:``, and DTensor's
    random-number tracker (made by its first random operator) — and empty DTensor's caches of sharding decisions
    (Python's and the C++ fast path's), redistribution plans and mesh topologies. Their keys compare meshes by
    layout, not by process group, so an entry made under this run's mesh would answer a later run on an equal mesh
    with this run's destroyed process groups ("Could not resolve the process group")."""
    from torch.distributed import distributed_c10d
    from torch.distributed.tensor import _collective_utils, _random, _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    backend, tracker, excepthook = distributed_c10d._backend, _random._rng_tracker, sys.excepthook
    try:
        yield
    finally:
        distributed_c10d._backend, _random._rng_tracker, sys.excepthook = backend, tracker, excepthook
        _clear_sharding_prop_cache()
        ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
        _redistribute._gen_transform_infos.cache_clear()
        _redistribute.clear_redistribute_planner_cache()
        _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def default_device_set() -> torch.device | None:
    """The device ``torch.set_default_device`` set, None where none is (tensors are made on the CPU): what that
    function takes to put it back. ``torch.get_default_device()`` says ``cpu`` for both, and setting ``cpu`` back
    leaves a ``DeviceContext`` on the function-mode stack, which turns torch's fast paths off for the process."""
    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    if context is None:
        return None
    return cast(torch.device, context.device)


@contextlib.contextmanager
def caller_modes_set_aside() -> Iterator[None]:
    """While open, the caller's ``TorchFunctionMode``s and ``TorchDispatchMode``s are off the stacks, and are put back
    as they were after (also what a body left pushed is dropped). An analysis is not a call of the model in the
    caller's program: the caller's modes (a ``FlopCounterMode``, a logging mode, an analysis whose model's forward
    starts another) neither see its work — which differs by the run it picks, and a cached one has none — nor change
    what it records. The default device (``torch.set_default_device``, ``with torch.device(...)``: a ``DeviceContext``
    at the bottom of the function-mode stack, torch's own rule) is the model's environment, not an observer: kept.
    The caller's ``torch.autograd.graph.disable_saved_tensors_hooks`` is lifted while open, and put back after: a
    training step's analysis notes what the forward saves with hooks of its own (a plain step, hook-free, runs).
    ``torch._C``'s stack calls are what ``torch.utils._device`` uses itself; ``_disable_current_modes`` (above) sets
    the dispatch modes aside."""
    depth = torch._C._len_torch_function_stack()
    bottom = torch._C._get_function_stack_at(0) if depth else None
    keep = 1 if isinstance(bottom, DeviceContext) else 0
    aside: list[Any] = []
    refusal = None
    autograd = torch._C._autograd
    try:  # (what is set aside is put back whatever fails on the way)
        for _ in range(depth - keep):
            aside.append(torch._C._pop_torch_function_stack())
        enabled: bool = autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]
        refusal = None if enabled else autograd._saved_tensors_hooks_get_disabled_error_message()
        if refusal is not None:
            autograd._saved_tensors_hooks_enable()
        with disable_current_modes():
            yield
    finally:
        while torch._C._len_torch_function_stack() > depth - len(aside):  # (a mode the body pushed and left)
            torch._C._pop_torch_function_stack()
        for mode in reversed(aside):
            torch._C._push_on_torch_function_stack(mode)
        if refusal is not None:
            autograd._saved_tensors_hooks_disable(refusal)


@contextlib.contextmanager
def torch_stacks_kept() -> Iterator[None]:
    """While open, a body may push modes and register global module hooks and leave them: on exit the function- and
    dispatch-mode stacks are cut back to their depths on entry, and ``torch.nn.modules.module``'s ``_global_*`` hook
    tables (and its full-backward flag) hold what they held. A forward that enters a mode and never leaves it (a
    ``FlopCounterMode`` entered by hand, whose ``ModuleTracker`` registers global hooks) would otherwise make the
    run's own dispatch recorder pop that mode in its place and stay on the stack, recording every later operator of
    the process. The tables are found by their prefix, as torch names them (since 1.13)."""
    functions, dispatch = torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()
    hooks = nn.modules.module
    tables = {name: dict(table) for name, table in vars(hooks).items()
              if name.startswith("_global_") and isinstance(table, dict)}
    full_backward = getattr(hooks, "_global_is_full_backward_hook", None)
    try:
        yield
    finally:
        while torch._C._len_torch_function_stack() > functions:
            torch._C._pop_torch_function_stack()
        while torch._C._len_torch_dispatch_stack() > dispatch:
            pop_dispatch_mode()
        for name, found in tables.items():
            table = getattr(hooks, name)
            if table != found:
                table.clear()
                table.update(found)
        hooks._global_is_full_backward_hook = full_backward


class _ModesAside:
    """A re-entrant context manager: the dispatch modes set aside while it is open (see
    :func:`unseen_global_shape_runs`)."""

    def __init__(self) -> None:
        self.open: list[contextlib.AbstractContextManager[Any]] = []

    def __enter__(self) -> None:
        aside = disable_current_modes()
        aside.__enter__()
        self.open.append(aside)

    def __exit__(self, *exc: Any) -> None:
        self.open.pop().__exit__(*exc)


def sharded_tensor_type() -> type | None:
    """The DTensor class once ``torch.distributed.tensor`` is imported, else None (no DTensor can exist yet): looked
    up, not imported, so an analysis without a parallel plan never imports torch.distributed."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (``DTensor._local_tensor``: ``to_local()`` would be a recorded autograd call);
    any other tensor itself."""
    dtensor = sharded_tensor_type()
    if dtensor is None or not isinstance(tensor, dtensor):
        return tensor
    local: torch.Tensor = tensor._local_tensor  # type: ignore[attr-defined]
    return local


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffers by name (``None`` for one registered as None)."""
    return module._buffers


def children_of(module: nn.Module) -> dict[str, nn.Module | None]:
    """The module's direct submodules by name, a shared one under each of its names (``None`` kept)."""
    return module._modules


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of buffers left out of the state dict (``persistent=False``; ``_non_persistent_buffers_set``, 1.6)."""
    return module._non_persistent_buffers_set


def forward_hook_tables(module: nn.Module) -> tuple[tuple[dict[int, Any], ...], tuple[dict[int, Any], ...]]:
    """The module's forward pre-hooks and forward hooks, each with the tables of their flags: (pre-hooks, with
    kwargs), (hooks, with kwargs, always called). ``with_kwargs`` since 2.0, ``always_called`` since 2.1."""
    return ((module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs),
            (module._forward_hooks, module._forward_hooks_with_kwargs, module._forward_hooks_always_called))


def global_forward_hooks() -> tuple[dict[int, Any], dict[int, Any]]:
    """The hooks ``register_module_forward_pre_hook`` / ``register_module_forward_hook`` added (every module's
    call runs them): the module globals ``_global_forward_pre_hooks`` and ``_global_forward_hooks`` (since 1.13)."""
    hooks = nn.modules.module
    return getattr(hooks, "_global_forward_pre_hooks", {}), getattr(hooks, "_global_forward_hooks", {})


def backward_hooks(module: nn.Module) -> tuple[dict[int, Any], dict[int, Any], bool | None]:
    """The module's backward pre-hooks and backward hooks, and whether those are full ones (a full hook wraps the
    module's call in ``BackwardHookFunction``s, in the forward pass too): ``_backward_pre_hooks`` (since 2.0),
    ``_backward_hooks`` and ``_is_full_backward_hook``."""
    return (getattr(module, "_backward_pre_hooks", {}), module._backward_hooks,
            getattr(module, "_is_full_backward_hook", None))


def global_backward_hooks() -> tuple[dict[int, Any], dict[int, Any], bool | None]:
    """:func:`backward_hooks` registered for every module (``register_module_full_backward_pre_hook`` / ``_hook``)."""
    hooks = nn.modules.module
    return (getattr(hooks, "_global_backward_pre_hooks", {}), getattr(hooks, "_global_backward_hooks", {}),
            getattr(hooks, "_global_is_full_backward_hook", None))


def version_counter(tensor: torch.Tensor) -> int:
    """How often ``tensor`` was changed in place (``Tensor._version``, since 0.4): what autograd checks saved tensors
    against, and what tells a recorded run's inputs and parameters apart from the same objects changed since."""
    return int(tensor._version)


def class_name(module: nn.Module) -> str:
    """The name ``repr(module)`` shows (``Module._get_name``, all versions): a class may override it."""
    return module._get_name()


# The function a module's call runs its hooks and ``forward`` in (``Module._call_impl``, all versions; the module's
# ``self`` is a local there): a failure is attributed to the innermost model module on its stack.
MODULE_CALL_IMPL = "_call_impl"

# ``torch.compile(module)`` returns an ``OptimizedModule`` (since 2.0) keeping the module under ``_orig_mod``.
COMPILED_MODULE_CLASS = "OptimizedModule"
COMPILED_MODULE_ATTRIBUTE = "_orig_mod"
# ``module.compile()`` (since 2.2) compiles in place: the module's call runs ``_compiled_call_impl`` when not None.
COMPILED_CALL_IMPL = "_compiled_call_impl"


# --- state dicts -----------------------------------------------------------------------------------------------------
def state_dict_metadata(state_dict: Any) -> Any:
    """The per-module versions ``Module.state_dict()`` attaches to its result as ``_metadata`` (all versions), or
    None; ``load_state_dict`` hands them to each module's ``_load_from_state_dict``."""
    return getattr(state_dict, "_metadata", None)


def set_state_dict_metadata(state_dict: Any, metadata: Any) -> None:
    state_dict._metadata = metadata


def flat_dcp_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` flattened as torch.distributed.checkpoint names its entries in a checkpoint's metadata
    (``optimizer:<name>.state.<param>.exp_avg``): the private ``_nested_dict.flatten_state_dict`` (since 2.0) that
    DCP's save and load use themselves."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    return dict(flat)


# --- torch.load (torch._weights_only_unpickler, torch._utils) --------------------------------------------------------
# The module whose frames raise a weights-only refusal (since 1.13): a refusal is told from a corrupt file by origin.
WEIGHTS_ONLY_UNPICKLER = "torch._weights_only_unpickler"


def weights_only_allowed_globals() -> frozenset[str] | None:
    """``module.name`` of every global the weights-only unpickler accepts now: its defaults and what
    ``add_safe_globals``/``safe_globals`` added (``_get_allowed_globals``/``_get_user_allowed_globals``, since 2.4);
    ``None`` if this torch does not say."""
    from torch import _weights_only_unpickler as unpickler

    try:
        return frozenset(unpickler._get_allowed_globals()) | frozenset(unpickler._get_user_allowed_globals())
    except (AttributeError, TypeError, ValueError):  # torch moved its internals, or a malformed safe_globals entry
        return None


def python2_pickle_mappings() -> tuple[dict[str, str], dict[tuple[str, str], tuple[str, str]]]:
    """torch's (IMPORT_MAPPING, NAME_MAPPING) from Python 2 names to Python 3 ones (``torch._utils``, in 2.14.1),
    which its unpickler applies before looking a global up."""
    from torch._utils import IMPORT_MAPPING, NAME_MAPPING

    return IMPORT_MAPPING, NAME_MAPPING


# --- torch.distributed (c10d) -----------------------------------------------------------------------------------------
def script_object_type(value: torch.ScriptObject) -> str:
    """The TorchScript class of a script object (``ScriptObject._type()``, all versions):
    ``__torch__.torch.classes.c10d.ProcessGroup`` for the group c10d's collective operators take."""
    return str(value._type().qualified_name())


def resolve_group_name(name: str) -> Any:
    """The process group registered under ``name`` (``distributed_c10d._resolve_process_group``, since 2.3: what the
    functional collectives resolve their ``group_name`` argument with); a RuntimeError or ValueError when none is."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(distributed_c10d.GroupName(name))


# --- CUDA ------------------------------------------------------------------------------------------------------------
def cuda_lazy_init_code() -> Any:
    """The code of ``torch.cuda._lazy_init`` (all versions), on the stack of every failure to initialise CUDA: a
    failure is told by origin, not by the wording of its message."""
    return torch.cuda._lazy_init.__code__


# --- patches made while recording ------------------------------------------------------------------------------------
# The only changes a run makes to torch, each because torch offers no public alternative. Two calls a run must see
# have no hook (neither is a torch function, which a TorchFunctionMode would see, nor an operator, which a
# TorchDispatchMode would see): each is replaced for the run only, on torch's own object, acts on the recording thread
# only (another thread calls straight through, unrecorded) and is put back afterwards, also when the run raises. The
# third is flex attention's compile switch, a module flag. (The collector pause is in engine/gc_pause.py.)

@contextlib.contextmanager
def intercepted_function_apply(intercept: Callable[[type, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
                               ) -> Iterator[None]:
    """While open, ``SomeFunction.apply(*args, **kwargs)`` on this thread returns ``intercept(SomeFunction, run,
    args, kwargs)``, ``run`` calling the original ``apply``.

    A custom ``torch.autograd.Function``'s ``apply`` is implemented in C (``_FunctionBase.apply``) and reaches
    neither mode, so ``torch.autograd.Function.apply`` is replaced (a classmethod since 1.3, all versions since).
    """
    function = torch.autograd.Function
    original = function.__dict__["apply"]
    thread = threading.get_ident()  # the recorder modes are the running thread's: so is this

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        run = original.__get__(None, cls)
        if threading.get_ident() != thread:
            return run(*args, **kwargs)
        return intercept(cls, run, args, kwargs)

    function.apply = classmethod(apply)
    try:
        yield
    finally:
        function.apply = original


@contextlib.contextmanager
def observed_cpu_rng_states(observe: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """While open, every ``torch.get_rng_state()`` on this thread passes the state it returns to ``observe``.

    An activation checkpoint keeps the CPU RNG state of each call (``torch.utils.checkpoint``, all versions) to replay
    dropout: a tensor made by the generator in C, outside the dispatcher, that no mode sees; its bytes are memory of
    the step. ``torch.get_rng_state`` is looked up on ``torch`` at each call, so the attribute is replaced for the
    run. (Python 3.12's ``sys.monitoring`` could watch its code object instead; this package supports 3.10.)
    """
    original = torch.get_rng_state
    thread = threading.get_ident()

    def get_rng_state() -> torch.Tensor:
        state = original()
        if threading.get_ident() == thread:
            observe(state)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


@contextlib.contextmanager
def observed_storage_resizes(observe: Callable[[torch.UntypedStorage, int], None]) -> Iterator[None]:
    """While open, every ``UntypedStorage.resize_(nbytes)`` on this thread calls ``observe(storage, nbytes)`` once the
    storage has its new size.

    FSDP2 frees an unsharded parameter after its forward and backward with ``storage.resize_(0)`` and allocates it
    again before the next all-gather with ``storage.resize_(nbytes)`` (``_fsdp_param.free_storage`` /
    ``alloc_storage``, since torch 2.4): calls on the storage object, in C (``StorageBase.resize_``), that no mode
    sees. ``UntypedStorage`` inherits the method, so a Python one set on the class for the run covers every
    storage; the class is put back exactly as it was (torch 2.14 defines none of its own).
    """
    storage_class = torch.UntypedStorage
    own = storage_class.__dict__.get("resize_")
    original = storage_class.resize_
    thread = threading.get_ident()

    def resize_(storage: torch.UntypedStorage, nbytes: int) -> Any:
        result = original(storage, nbytes)
        if threading.get_ident() == thread:
            observe(storage, int(nbytes))
        return result

    storage_class.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own is None:
            del storage_class.resize_
        else:
            storage_class.resize_ = own  # type: ignore[method-assign]


FLEX_ATTENTION_MODULE = "torch.nn.attention.flex_attention"


@contextlib.contextmanager
def saved_tensors_hooks_set_aside(pack: Callable[[torch.Tensor], Any]) -> Iterator[None]:
    """While open, a ``torch.func`` transform that refuses saved-tensor hooks (``grad``, ``vjp``, ``jacrev``,
    ``hessian``) runs on this thread with the run's own hooks (those whose pack hook is ``pack``, on top of torch's
    stack) taken off the stack, and put back after it: the transform runs as in the model's real step, which has no
    such hooks. Hooks of the model's own (a non-re-entrant checkpoint's) are left in place, so it fails as it would.

    The transforms enter ``torch.autograd.graph.disable_saved_tensors_hooks`` (since 2.0), looked up on the module at
    each call, which refuses any hook on the stack: the attribute is replaced for the run. The stack itself is read and
    changed with torch._C._autograd's ``_top_``, ``_pop_`` and ``_push_saved_tensors_default_hooks`` (since 2.0, what
    ``saved_tensors_hooks`` uses).
    """
    graph = torch.autograd.graph
    original = graph.disable_saved_tensors_hooks
    thread = threading.get_ident()
    hooks = torch._C._autograd

    @contextlib.contextmanager
    def disable(error_message: str) -> Iterator[None]:
        top = hooks._top_saved_tensors_default_hooks(False)
        if threading.get_ident() != thread or top is None or top[0] is not pack:
            with original(error_message):
                yield
            return
        hooks._pop_saved_tensors_default_hooks()
        try:
            with original(error_message):
                yield
        finally:
            hooks._push_saved_tensors_default_hooks(*top)

    graph.disable_saved_tensors_hooks = disable
    try:
        yield
    finally:
        graph.disable_saved_tensors_hooks = original


def parametrizations_cached() -> bool:
    """Whether the caller is inside ``parametrize.cached()`` (torch's module counter ``_cache_enabled``): each
    parametrized weight is then computed once per run, else at every access — a model reading one twice runs its
    parametrization twice, so the caches key it."""
    return parametrize._cache_enabled > 0


@contextlib.contextmanager
def parametrizations_set_aside() -> Iterator[None]:
    """While open, ``torch.nn.utils.parametrize``'s cache of computed weights is empty; afterwards it holds what it
    held before, the same objects, and nothing the run computed.

    Inside ``parametrize.cached()`` torch keeps each parametrized tensor, once computed, in the module global
    ``_cache`` (keyed by the module's ``id`` and the tensor's name, since 1.9) until the block ends. A run computes
    the weight from its stand-ins (meta tensors, FakeTensors, clones): left there, the caller's next forward in the
    block would read it (garbage, or a graph that never reaches the parameters). The caller's entries are set aside
    too: they hold the real parameters' graph, which the run's backward pass must not run through; the run computes
    each weight once, as the first forward in a ``cached()`` block does.
    """
    cache = parametrize._cache
    kept = dict(cache)
    cache.clear()
    try:
        yield
    finally:
        cache.clear()
        cache.update(kept)


@contextlib.contextmanager
def fake_tensor_log_silenced() -> Iterator[None]:
    """Silence torch's FakeTensor logger while open: when an operator rejects its fake inputs (a model given an input
    that does not fit it), it logs the whole traceback at ERROR before raising the error the analysis reports in a
    line, naming the module. Its level is put back after."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def eager_flex_attention() -> Iterator[None]:
    """Run ``flex_attention`` as its plain higher-order operator while open (torch otherwise compiles a wrapper around
    it, which cannot run under the recorders: dynamo refuses the modes' calls).

    The module flag ``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` (since 2.9, pytorch/pytorch#158534, meant for debugging
    ``score_mod``) is the only switch, and a module global cannot be set for one thread: ``flex_attention`` reads it
    on each call, so it is set for the run, only where the module is imported already (a model that calls
    ``flex_attention`` has imported it; importing it pulls in ``torch._dynamo``, sympy and triton, seconds in a fresh
    process), and put back afterwards.
    """
    flex = sys.modules.get(FLEX_ATTENTION_MODULE)
    flag = "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"
    before = getattr(flex, flag, None)
    if before is None:
        yield
        return
    setattr(flex, flag, True)
    try:
        yield
    finally:
        setattr(flex, flag, before)
