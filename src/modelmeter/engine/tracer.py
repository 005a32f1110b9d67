"""Run a model once under the recorders and return its :class:`Trace`.

By default the run is fake: parameters, buffers and inputs are replaced by tensors with metadata and no
storage, so no kernel runs and no memory is used for values — meta stand-ins for a CPU model (recorded as
the CPU tensors they stand for), FakeTensors where the meta run cannot finish. A model built on the meta
device stays there. When a model needs real values (``.item()`` on a real tensor,
data-dependent shapes) the run falls back to real kernels; on the meta device documented
placeholder values are assumed instead, and each assumption is recorded in the trace.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from .._torch_compat import (
    COMPILED_CALL_IMPL,
    COMPILED_MODULE_ATTRIBUTE,
    COMPILED_MODULE_CLASS,
    GRADIENT_HOOKS,
    MODULE_CALL_IMPL,
    POST_ACCUMULATE_GRAD_HOOKS,
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    eager_flex_attention,
    fake_from_meta,
    fake_tensor_log_silenced,
    no_torch_function,
    observed_cpu_rng_states,
    observed_storage_resizes,
    parametrizations_set_aside,
    pytree,
    saved_tensors_hooks_set_aside,
    torch_stacks_kept,
    unseen_global_shape_runs,
    unset_fake_temporarily,
)
from ..errors import (
    InputMismatchError,
    InvalidTypeError,
    InvalidValueError,
    ModelRunError,
    UnsupportedError,
    Wording,
    cuda_failure,
    literal,
    puts_tensors_on_cuda,
)
from .cuda_stand_in import CudaRequests, on_device
from .environment import KeptSettings
from .exclusive import RECORDING
from .expectations import mismatch, token_ids_mismatch
from .gc_pause import no_gc
from .inputs import input_where, map_tensors, tensors_in
from .metadata import describe, is_sparse, meta_stands_for
from .naming import ModuleNames
from .op_tags import op_tags
from .recorder import DispatchRecorder, FunctionRecorder, JaggedTensor, Recorder, autograd_functions
from .recursion import recursion_headroom
from .replay import CallMemo
from .snapshot import Held as _Held
from .snapshot import KeptValues, ModelSnapshot, RandomStates, TensorHooks, kept_random_states
from .spec import Execution, LossFn, RunSpec
from .trace import Trace
from .values import Shadows, note_random_draws

# What a fake run raises where the model needs tensor values (the parallel runner says so in its own terms too)
NEEDS_VALUES = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException)


def record_trace(spec: RunSpec) -> Trace:
    """Run ``spec.model(*spec.args, **spec.kwargs)`` once and record every operator call.

    ``execution``: ``"fake"`` (no kernels: meta stand-ins or FakeTensors), ``"real"`` (real kernels on the given
    tensors) or ``"auto"`` (fake, falling back to real when the model needs values).
    ``backward``: also run the backward pass of ``loss_fn(output)`` (default: the sum of the output's
    floating-point tensors), computing the gradients of the parameters and inputs that require grad; the
    ``.grad`` they held before is put back.

    A model on the meta device runs on meta tensors as they are — PyTorch's meta kernels, no FakeTensor
    conversion, about twice as fast — and under FakeTensors only if an operator has no meta kernel. A CPU model
    runs on meta stand-ins first. The garbage collector is paused during the run: storages are freed by
    reference counts alone, where the model's code drops them.
    """
    if spec.execution not in ("auto", "fake", "real"):
        raise InvalidValueError(f"execution must be 'auto', 'fake' or 'real', got {spec.execution!r}")
    # a model sharded by the user (DTensor) records its rank's operators, not DTensor's runs at global shapes
    # one run at a time in a process: what it replaces is process-wide (engine/exclusive.py)
    with RECORDING, no_gc(), unseen_global_shape_runs(), kept_random_states() as random_states:
        return _record(spec.model, spec.args, spec.kwargs, ModuleNames(spec.model), spec.execution, spec.backward,
                       spec.loss_fn, random_states)


def _record(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], names: ModuleNames,
            execution: Execution, backward: bool, loss_fn: LossFn | None, random_states: RandomStates) -> Trace:
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidTypeError(f"loss_fn must be callable (output -> scalar tensor), got {type(loss_fn).__name__}")
    given = tensors_in((args, kwargs))
    parts = _Parts(names, _objects_in((args, kwargs)), given)
    if backward:
        _refuse_graphs_in_objects(parts)
    model_on_meta = any(t.is_meta for t in parts.state())
    no_values = model_on_meta or any(t.is_meta for t in given)
    run = _Run(model, parts, args, kwargs, names, backward, loss_fn, random_states)
    if any(isinstance(t, JaggedTensor) for t in given):
        return _run_real_only(run, execution, no_values, "jagged nested tensor inputs",
                              "the lengths of their sequences are values")
    quantized_state, sparse_state = _unusual_state(parts)
    quantized = input_where(args, kwargs, _is_quantized) or quantized_state
    if quantized is not None:
        return _run_real_only(run, execution, no_values, f"quantized tensors ({quantized})",
                              "FakeTensors and meta tensors cannot stand for them")
    sparse = input_where(args, kwargs, is_sparse) or sparse_state
    if sparse is not None:
        return _run_real_only(run, execution, no_values, f"sparse tensors ({sparse})",
                              "their FakeTensors and meta copies store no values or indices")
    if execution == "real":
        return run(fake=False, model_on_meta=model_on_meta, no_values=no_values)
    try:
        return _record_fake(run, parts, args, kwargs, execution, model_on_meta, no_values)
    except ModelRunError as exc:
        if not puts_tensors_on_cuda(exc):
            raise
    if backward:
        return _cuda_step(run, parts, args, kwargs, model_on_meta, no_values)
    # The model puts tensors on CUDA itself (x.cuda(), device="cuda"): everything runs as FakeTensors on CUDA, which
    # need no GPU, so its tensors meet on one device and are counted where the model meant them to be.
    trace = run(fake=True, model_on_meta=model_on_meta, no_values=no_values, device=_CUDA)
    trace.assumptions.append(f"the model puts tensors on CUDA: its parameters, buffers and inputs were counted as "
                             f"FakeTensors on {_CUDA} (no GPU was used)")
    return trace


def _cuda_step(run: _Run, parts: _Parts, args: tuple[Any, ...], kwargs: dict[str, Any], model_on_meta: bool,
               no_values: bool) -> Trace:
    """A step with a backward pass of a model that puts tensors on CUDA. Torch's autograd engine starts the CUDA
    device of a graph on CUDA tensors, fake or not, so the step runs as on the CPU, its requests for CUDA sent to
    the CPU stand-ins, and is recorded on ``cuda:0`` (cuda_stand_in.py)."""
    run.cuda_requests = True
    try:
        trace = _record_fake(run, parts, args, kwargs, "fake", model_on_meta, no_values)
    finally:
        run.cuda_requests = False
    on_device(trace, str(_CUDA))
    trace.assumptions.append(f"the model puts tensors on CUDA: its parameters, buffers and inputs were counted on "
                             f"{_CUDA} (no GPU was used; its step ran as on the CPU, as torch's autograd engine needs "
                             "a GPU for a backward pass on CUDA tensors)")
    return trace


_CUDA = torch.device("cuda", 0)
_META = torch.device("meta")  # a device object: a device given by its name is parsed at every call, once per tensor
_CPU = torch.device("cpu")


def _record_fake(run: _Run, parts: _Parts, args: tuple[Any, ...], kwargs: dict[str, Any], execution: Execution,
                 model_on_meta: bool, no_values: bool) -> Trace:
    """The cheapest run that succeeds: meta tensors, then FakeTensors, then (``"auto"``, when the model needs
    values) real kernels. A failure that no other run can mend — an input that does not fit the model, tensors put
    on CUDA — is raised at once."""
    if model_on_meta:
        try:
            return run(fake=True, model_on_meta=True, no_values=True, on_meta=True)
        except ModelRunError as exc:
            if not isinstance(exc.__cause__, NotImplementedError):  # the model's own failure: FakeTensors too
                raise
    elif _on_cpu(parts, args, kwargs):
        # A CPU model runs on meta stand-ins, several times cheaper than FakeTensors; whatever that cannot do
        # (values it does not know, code that mixes in CPU tensors, a missing meta kernel) runs under FakeTensors.
        try:
            return run(fake=True, model_on_meta=False, no_values=False, on_meta=True)
        except ModelRunError as exc:
            if _certain_mismatch(exc):
                raise
    try:
        return run(fake=True, model_on_meta=model_on_meta, no_values=no_values)
    except ModelRunError as exc:
        if execution == "fake" or no_values or _certain_mismatch(exc) or puts_tensors_on_cuda(exc):
            raise
        fake_failure = exc
    # Values are needed (.item(), data-dependent shapes), or an operator has no fake implementation:
    # real kernels answer both. If they fail too, the model itself is at fault, and that error is raised.
    trace = run(fake=False, model_on_meta=False, no_values=False)
    reason = "the model needs real values" if isinstance(fake_failure.__cause__, NEEDS_VALUES) else \
        "FakeTensors could not run it"
    trace.assumptions.append(f"{reason} ({fake_failure.operator or 'the forward'}): ran real kernels")
    return trace


def _run_real_only(run: _Run, execution: Execution, no_values: bool, subject: str, why: str) -> Trace:
    """A run with tensors only real kernels can take: jagged nested tensors (their sequences' lengths are values, for
    which FakeTensors would need symbolic shapes), quantized ones (no fake form)."""
    if execution == "fake" or no_values:
        raise InvalidValueError(f"{subject} need real kernels ({why}): use execution='auto' or 'real', with a model "
                                "and inputs that are not on the meta device")
    trace = run(fake=False, model_on_meta=False, no_values=False)
    if execution == "auto":
        trace.assumptions.append(f"{subject} ({why}): ran real kernels")
    return trace


def _unusual_state(parts: _Parts) -> tuple[str | None, str | None]:
    """The names of the model's first quantized and first sparse parameter, buffer or tensor attribute, or else
    tensor held by an object the model is given (None where there is none): one pass, with no Python call for a
    plain tensor (it runs once per parameter)."""
    held = [("{!r}, held by the model", name, t) for _, name, t in (*parts.held_parameters, *parts.held_others)]
    held += [("a tensor held by an object passed to the model ({})", type(given).__name__, t)
             for given, t in parts.held_by_objects]
    quantized = sparse = None
    for where, name, tensor in held:
        if quantized is None and tensor.is_quantized:
            quantized = where.format(name)
        if sparse is None and tensor.layout is not torch.strided and is_sparse(tensor):
            sparse = where.format(name)
    return quantized, sparse


def _is_quantized(tensor: torch.Tensor) -> bool:
    return tensor.is_quantized


class _Parts:
    """The model's modules (the ones ``names`` walked) and the tensors they hold — parameters, buffers and plain
    tensor attributes, as they were before the run — and, while a run swaps them (:class:`_SwappedState`), their
    stand-ins. ``pristine`` is everything the modules hold, as found (one walk finds the tensors too): each run
    puts it back."""

    def __init__(self, names: ModuleNames, objects: list[Any], arguments: list[torch.Tensor]) -> None:
        self.modules = list(names.modules.values())
        _refuse_script_modules(names)
        self.pristine = ModelSnapshot(self.modules, objects)
        stood_in = {id(t) for t in arguments}  # (a dataclass's tensors are arguments: they get stand-ins)
        self.held_by_objects = [(given, t) for given, t in self.pristine.held_by_objects if id(t) not in stood_in]
        self.held_parameters: list[_Held] = self.pristine.parameters
        self.held_others: list[_Held] = [*self.pristine.buffers, *self.pristine.attributes]
        self.wrappers: list[_Transparent | _Eager] = []
        for module in self.modules:
            wrapped = _wrapped_attribute(module)
            if wrapped is not None:
                self.wrappers.append(_Transparent(module, wrapped))
            if vars(module).get(COMPILED_CALL_IMPL) is not None:
                self.wrappers.append(_Eager(module))
        self.packed = self.pristine.packed  # (packed weights: FakeTensors' cache cannot key them)
        self.parameters = _unique(t for _, _, t in self.held_parameters)
        self.buffers = _unique(t for _, _, t in self.pristine.buffers)
        self.stand_ins: dict[int, torch.Tensor] = {}  # id(original) -> its stand-in, during a run

    def state(self) -> list[torch.Tensor]:
        return [*self.parameters, *self.buffers]

    def running(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` as the running model holds them: their stand-ins where they have one."""
        stand_ins = self.stand_ins
        return [stand_ins.get(id(t), t) for t in tensors]


def _refuse_script_modules(names: ModuleNames) -> None:
    """A TorchScript submodule (``torch.jit.script``, ``torch.jit.trace``) runs its operators in TorchScript's
    interpreter, where neither its modules nor its tensors can be followed or stood in for: refused, named, as a
    TorchScript model is (:func:`~modelmeter.engine.inputs.check_inputs`)."""
    for name, module in names.modules.items():
        if isinstance(module, torch.jit.ScriptModule):
            raise InvalidTypeError(f"module {name!r} is a TorchScript module ({type(module).__name__}, from "
                                   "torch.jit.script or torch.jit.trace), which cannot be analysed: put the nn.Module "
                                   "it was made from in its place")


def _refuse_graphs_in_objects(parts: _Parts) -> None:
    """A tensor of the caller's autograd graph held by an object the model is given (not an argument, which the
    run replaces by a stand-in cut from that graph): a backward pass would run on into the caller's graph, count
    its work as the model's and leave gradients on the caller's tensors."""
    for given, tensor in parts.held_by_objects:
        if tensor.grad_fn is not None:
            raise InvalidValueError(
                f"backward=True: an object passed to the model ({type(given).__name__}) holds a tensor made by your "
                f"autograd graph (grad_fn {tensor.grad_fn.name()}), which the run cannot cut from it: the backward "
                "pass would run on into your graph. Pass it detached (.detach()), or as an argument in a tuple, list, "
                "dict or dataclass")


def _objects_in(inputs: Any) -> list[Any]:
    """The inputs that are neither tensors nor the containers that hold them nor plain values (a key-value cache):
    the run may change them, and :class:`ModelSnapshot` puts them back."""
    return [leaf for leaf in pytree.tree_leaves(inputs)
            if not isinstance(leaf, torch.Tensor) and hasattr(leaf, "__dict__")]  # (plain values have none)


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once (by identity), in order."""
    return list({id(t): t for t in tensors}.values())


def _on_cpu(parts: _Parts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True for a model whose state and inputs are plain dense CPU tensors (what a meta stand-in can replace), run
    outside CPU autocast (which casts CPU tensors and FakeTensors on the CPU, never meta ones)."""
    if torch.is_autocast_enabled("cpu"):
        return False
    tensors = [*parts.state(), *tensors_in((args, kwargs))]
    return all(t.is_cpu and t.layout == torch.strided and type(t) in (torch.Tensor, nn.Parameter)
               and not t.is_quantized for t in tensors)


class _Run:
    """One recorded run of the model (forward, and backward when asked), fake or real."""

    def __init__(self, model: nn.Module, parts: _Parts, args: tuple[Any, ...], kwargs: dict[str, Any],
                 names: ModuleNames, backward: bool, loss_fn: LossFn | None, random_states: RandomStates) -> None:
        self.model, self.parts, self.args, self.kwargs, self.names = model, parts, args, kwargs, names
        self.backward, self.loss_fn = backward, loss_fn
        self.random_states = random_states  # as the caller left them: every run draws what its call would draw
        self.cuda_requests = False  # a fake run sends the model's requests for CUDA to its own device

    def __call__(self, *, fake: bool, model_on_meta: bool, no_values: bool, on_meta: bool = False,
                 device: torch.device | None = None) -> Trace:
        """One run; ``device``: a fake run's FakeTensors all stand on that device (the model's and the inputs')."""
        model, parts, names = self.model, self.parts, self.names
        args, kwargs = self.args, self.kwargs
        recorder = Recorder(names, track_autograd=self.backward)
        recorder.placeholders = no_values
        held = [t for _, t in parts.held_by_objects]  # the inputs' objects' tensors, as the run meets them
        if on_meta and not self.backward:  # a forward on meta tensors: repeated calls are replayed (replay.py)
            recorder.memo = CallMemo(recorder)
        try:
            with ExitStack() as stack:
                stack.enter_context(KeptSettings())  # the model's changes of torch's settings are undone after the run
                # The caller's grad mode must not change what runs: under inference mode, composite operators
                # (conv2d, linear, batch_norm) reach the recorder undecomposed. The run sets its own mode below.
                stack.enter_context(torch.inference_mode(False))
                stack.enter_context(TensorHooks(t for t in tensors_in((args, kwargs)) if t.is_leaf))  # as passed
                if on_meta:  # the model's tensors have no values (or are stood in for by ones that have none)
                    shadows = recorder.shadows = Shadows()
                    with shadows.seeding():
                        args, kwargs = _meta_inputs((args, kwargs), shadows)
                        if model_on_meta:
                            stack.enter_context(_SwappedState(parts, torch.Tensor.clone, keep_parameters=True))
                        else:  # a CPU model: meta stand-ins, recorded as the CPU tensors they stand for
                            recorder.cpu_stand_ins = True
                            stack.enter_context(_SwappedState(parts, _MetaStandIn(shadows)))
                            stack.enter_context(meta_stands_for("cpu"))
                elif fake:
                    fake_mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
                    stack.enter_context(fake_tensor_log_silenced())  # a rejected input: reported in a line, below
                    if parts.packed:  # torch's cache of fake results compares packed weights with ==, which they lack
                        fake_mode.cache_enabled = False
                    shadows = recorder.shadows = Shadows()
                    with shadows.seeding():
                        args, kwargs = _fake_inputs(parts, args, kwargs, fake_mode, model_on_meta, shadows, device)
                        stack.enter_context(_SwappedState(parts, _Faker(fake_mode, shadows, device)))
                    held = [fake_mode.from_tensor(t) for t in held]  # (the conversion its operators make: memoised)
                else:
                    _reject_meta_inputs_for_real_model(parts, args, kwargs)
                    stack.enter_context(KeptValues(tensors_in((args, kwargs))))
                    # the parameters run as they are: each copied only if an operator writes it (Embedding's max_norm)
                    recorder.before_write = stack.enter_context(KeptValues(parts.parameters, when_written=True)).written
                    args, kwargs = _real_inputs((args, kwargs))
                    stack.enter_context(_SwappedState(parts, torch.Tensor.clone, keep_parameters=True))
                stack.enter_context(recursion_headroom())
                stack.enter_context(_ModuleHooks(recorder))
                stack.enter_context(warnings.catch_warnings())
                # Our global hooks are meant; the compiled wrapper is bypassed anyway.
                warnings.filterwarnings("ignore",
                                        message=r"Using `torch.compile\(module\)` when there are global hooks")
                for wrapper in parts.wrappers:
                    stack.enter_context(wrapper)
                stack.enter_context(eager_flex_attention())
                stack.enter_context(parametrizations_set_aside())  # parametrize.cached()'s weights: not the run's
                # the CPU RNG states an activation checkpoint keeps: made outside the dispatcher, unseen otherwise
                stack.enter_context(observed_cpu_rng_states(
                    lambda state: recorder.storages.outputs(state, len(recorder.trace.events), "other")))
                # storages freed and allocated again by hand (FSDP2's unsharded parameters): lifetimes of their own
                stack.enter_context(observed_storage_resizes(recorder.storages.resized))
                _note_existing_storages(recorder, parts, [*tensors_in((args, kwargs)), *held])
                if self.backward:  # training: autograd records the graph; what it saves is noted
                    stack.enter_context(torch.enable_grad())
                    pack = recorder.pack_saved  # one object: the hooks are told apart by it
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _unpack))
                    stack.enter_context(saved_tensors_hooks_set_aside(pack))  # for torch.func.grad & co.
                else:  # inference: no graph, nothing saved for a backward pass
                    stack.enter_context(torch.no_grad())
                if fake and self.cuda_requests:
                    stack.enter_context(CudaRequests(_run_device(parts, args, kwargs)))
                stack.enter_context(autograd_functions(recorder))
                stack.enter_context(FunctionRecorder(recorder))
                stack.enter_context(DispatchRecorder(recorder))
                try:
                    with torch_stacks_kept():  # a mode the model leaves pushed goes before the recorder's own exit
                        output = model(*args, **kwargs)
                        _refuse_unrun_output(model, output)
                        if self.backward:
                            self._backward(output, args, kwargs, recorder)
                    recorder.finish_storages(parts.running(parts.parameters))
                except (_LossFnError, _OutputRefused):
                    raise
                except Exception as exc:
                    raise _describe_failure(model, names, recorder, exc) from exc
        finally:  # every run starts from the model as found (a fallback too) and leaves it so, also when it raises
            parts.pristine.restore()
            if self.random_states.drawn():  # the trace may follow the numbers drawn: the caches must know
                note_random_draws()
                self.random_states.restore(torch_drawn=recorder.drew_random)
        trace = recorder.trace
        trace.execution = "fake" if fake else "real"
        trace.inputs = [describe(_packed(t)) for t in tensors_in((args, kwargs))]
        trace.backward = self.backward
        trace.modules = names.infos()
        trace.aliases = dict(names.aliases)
        trace.model = type(model).__name__
        trace.versions = {"torch": str(torch.__version__)}
        trace.op_tags = op_tags(dict.fromkeys(map(_op_of, trace.events)))  # each operator once, in order
        return trace

    def _backward(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any], recorder: Recorder) -> None:
        """Gradients of the loss with respect to the parameters and inputs that require grad."""
        loss: torch.Tensor | None
        if self.loss_fn is not None:  # the user's loss is work of the step: recorded, at the model's level
            loss = _user_loss(self.loss_fn, output, recorder)
        else:
            if not any(t.is_floating_point() for t in tensors_in(output)):  # not "nothing requires grad": say so
                raise _OutputRefused(
                    f"backward=True: the model's output ({type(output).__name__}) holds no floating-point tensor for "
                    "the default loss (the sum of the floating-point tensors in tuples, lists, dicts and dataclasses "
                    "of the output): pass loss_fn=lambda output: <a scalar tensor of it>")
            recorder.paused = True
            try:
                loss = _sum_of_outputs(output)
            finally:
                recorder.paused = False
        if loss is None or not loss.requires_grad:
            recorder.trace.assumptions.append(
                "backward: the loss does not depend on anything that requires grad (no parameter or input "
                "requires grad, or the model ran without autograd), so the backward pass is empty")
            return
        recorder.start_backward(loss)
        # backward() rather than autograd.grad(): a re-entrant activation checkpoint accepts nothing else. The
        # gradients it leaves on parameters and inputs are dropped again (see _Gradients).
        parameters = self.parts.running(self.parts.parameters)
        with _Gradients([*parameters, *tensors_in((args, kwargs))]):
            loss.backward()
            with no_torch_function():  # reading the gradients is no call of the model's: the function mode set aside
                for param in parameters:
                    grad = param.grad
                    if grad is not None:
                        recorder.storages.gradient(grad, param)
            recorder.finish_storages(parameters)  # before the gradients are dropped again: they outlive the step


_op_of = attrgetter("op")


class _LossFnError(ModelRunError):
    """The user's ``loss_fn`` failed, or returned no one-element tensor: named as such, not as the model's."""


class _OutputRefused(UnsupportedError):
    """What the model returned cannot be analysed as asked (a generator; no tensor for the default loss)."""


def _refuse_unrun_output(model: nn.Module, output: Any) -> None:
    """A forward that returns a generator or a coroutine has run none of its body yet: counting what ran so far
    would be a silent zero, and consuming it is the caller's choice (it may never end)."""
    if not (inspect.isgenerator(output) or inspect.iscoroutine(output) or inspect.isasyncgen(output)):
        return
    if not inspect.isasyncgen(output):  # (an async generator's close is a coroutine itself)
        output.close()  # unstarted, it runs none of the body; a coroutine closed warns of no missing await
    raise _OutputRefused(
        f"{type(model).__name__}.forward returned an object of type {type(output).__name__}, whose body runs only as "
        "it is iterated or awaited: none of it ran. Analyse a module whose forward iterates or awaits it")


def _user_loss(loss_fn: LossFn, output: Any, recorder: Recorder) -> torch.Tensor:
    """``loss_fn(output)``, a tensor of one element; a :class:`_LossFnError` naming the operator where it failed."""
    try:
        loss = loss_fn(output)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise InvalidTypeError(f"loss_fn must return a tensor with one element, got {got}")
    except Exception as exc:
        op = recorder.failed_op
        at = literal(f" at operator {op}") if op else ""
        hint = " (the loss needs real tensor values: {advice})" if isinstance(exc, NEEDS_VALUES) else ""
        wording = Wording(f"the loss_fn failed{at}: {literal(f'{type(exc).__name__}: {exc}')}{hint}",
                          advice=VALUES_ADVICE)
        raise _LossFnError(wording.text(), None, op, wording) from exc
    return loss


def _run_device(parts: _Parts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The device the run's tensors are on: its model's state as it runs, else its inputs."""
    tensors = [*parts.running(parts.state()), *tensors_in((args, kwargs))]
    return str(tensors[0].device) if tensors else "cpu"


def _packed(tensor: torch.Tensor) -> torch.Tensor:
    """A jagged nested tensor's values (its sequences packed one after the other); any other tensor itself."""
    return tensor.values() if isinstance(tensor, JaggedTensor) else tensor


def _note_existing_storages(recorder: Recorder, parts: _Parts, inputs: list[torch.Tensor]) -> None:
    """The storages the run starts with: the model's state (as it runs: the stand-ins) and the inputs (those the
    objects it is given hold too: a key-value cache)."""
    for tensor in parts.running(parts.parameters):
        recorder.storages.existing(tensor, "parameter")
    for tensor in parts.running(parts.buffers):
        recorder.storages.existing(tensor, "buffer")
    for tensor in inputs:
        recorder.storages.existing(tensor, "input")


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _Gradients:
    """Clear ``.grad`` of the given leaves for a backward pass, and put back what they held before, so a
    backward pass neither adds into a user's gradients nor leaves new ones. The hooks run once a leaf's gradient is
    accumulated (``register_post_accumulate_grad_hook``: an optimizer stepping in the backward pass) are set aside
    meanwhile: they would step the caller's optimizer, and a fake run's stand-ins never carry them."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        with no_torch_function():  # as every access below: no call of the model's, so not one the function mode sees
            self.saved = list({id(t): (t, t.grad) for t in tensors if t.requires_grad and t.is_leaf}.values())
            self.hooks = [(table, dict(table)) for t, _ in self.saved
                          if (table := getattr(t, POST_ACCUMULATE_GRAD_HOOKS, None))]

    def __enter__(self) -> None:
        with no_torch_function():
            for tensor, _ in self.saved:
                tensor.grad = None
        for table, _ in self.hooks:
            table.clear()

    def __exit__(self, *_: Any) -> None:
        with no_torch_function():
            for tensor, grad in self.saved:
                tensor.grad = grad
        for table, hooks in self.hooks:
            table.update(hooks)


def _sum_of_outputs(output: Any) -> torch.Tensor | None:
    """The default loss: the sum of every floating-point output tensor that requires grad (of a jagged one, of its
    values: a plain sum, whose backward is free as for a dense output)."""
    parts = [_packed(t).sum() for t in tensors_in(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        return None
    loss = parts[0]
    for part in parts[1:]:
        loss = loss + part
    return loss


def _input_stand_ins(tree: Any, leaf_of: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The inputs as the run passes them: ``leaf_of(t)`` is the stand-in of input ``t`` as a leaf (cut from the
    caller's graph: the model's gradient work starts at its inputs, and a backward pass must not run into, or
    accumulate gradients in, the caller's graph). An input that is no leaf stays none — a copy of that leaf — so
    an in-place operation of the model on it behaves as on the caller's tensor (allowed on a non-leaf, refused on a
    leaf that requires grad), and leaves the caller's tensor as it was. A tensor passed several times (``mha(x, x,
    x)``) has one stand-in, as real kernels see one tensor: one input's memory, and ``query is key`` holds."""
    made: dict[int, torch.Tensor] = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        stand_in = made.get(id(t))
        if stand_in is None:
            stand_in = made[id(t)] = _stand_in(t, leaf_of)
        return stand_in

    return map_tensors(convert, tree)


def _stand_in(t: torch.Tensor, leaf_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    leaf = leaf_of(t)
    if t.is_leaf:
        return leaf if leaf is t else _with_hooks_of(t, leaf)
    with torch.enable_grad():  # the copy must have a grad_fn whatever the caller's grad mode
        return _with_hooks_of(t, leaf.clone())


def _with_hooks_of(original: torch.Tensor, stand_in: torch.Tensor) -> torch.Tensor:
    """``stand_in`` running the hooks ``register_hook`` set on the gradient of ``original`` (a clipped gradient): a
    real step fires them, and what they compute is work of the step. The original keeps its own; the stand-in, and
    what was registered on it, is dropped after. (Hooks run once a leaf's gradient is accumulated — an optimizer
    stepping in the backward pass — are set aside by the run, :class:`_Gradients`: not carried.)"""
    hooks = getattr(original, GRADIENT_HOOKS, None)
    # (a tensor that stopped requiring grad keeps hooks that cannot fire; a real run's clone passes its gradient on
    # to the original, whose hooks fire then)
    if hooks and stand_in.requires_grad and (stand_in.is_meta or isinstance(stand_in, FakeTensor)):
        for hook in hooks.values():
            stand_in.register_hook(hook)
    return stand_in


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a leaf that requires grad as ``t`` does (``t`` itself when it is one)."""
    return t if t.is_leaf else t.detach().requires_grad_(t.requires_grad)


def _real_inputs(tree: Any) -> Any:
    """Inputs for real kernels. An inference tensor (made under ``torch.inference_mode``) is copied into a normal
    one: the run is outside inference mode, where an inference tensor can be neither updated in place nor saved
    for backward."""
    return _input_stand_ins(tree, lambda t: t.clone() if t.is_inference() else _detached(t))


def _meta_inputs(tree: Any, shadows: Shadows) -> Any:
    """Inputs on the meta device (the values of small ones kept as shadows), leaves or not as the originals, those
    that share a storage on one stand-in of it (:class:`_InputStorages`)."""
    storages = _InputStorages()

    def leaf_of(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return t.clone() if t.is_inference() else _detached(t)
        meta = storages.meta(t)
        if meta is None:
            meta = t.detach().to(_META)
        return meta.requires_grad_(t.requires_grad)

    return _seeded(_input_stand_ins(tree, leaf_of), tree, shadows)


class _InputStorages:
    """Meta stand-ins of the inputs' storages, one per storage, as large as it: inputs that share a storage (views
    of one base, a tensor and its transpose) share its stand-in, which the run counts once at its size, and views
    keep their strides and offsets (a ``contiguous()`` copies as it would)."""

    def __init__(self) -> None:
        self._made: dict[tuple[torch.device, int], torch.UntypedStorage] = {}

    def meta(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A meta tensor as ``tensor`` (shape, strides, offset, dtype) on the stand-in of its storage, a leaf that
        does not require grad; None for a tensor without a plain storage of its own to stand in for."""
        if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.is_quantized:
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None
        if storage.nbytes() == 0 or storage.device.type == "meta":  # (no address to tell storages apart by)
            return None
        key = (storage.device, storage.data_ptr())
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = torch.empty(storage.nbytes(), dtype=torch.uint8, device=_META).untyped_storage()
        with unset_fake_temporarily():
            return torch.empty(0, dtype=tensor.dtype, device=_META).set_(made, tensor.storage_offset(),
                                                                           tensor.shape, tensor.stride())


def _seeded(stand_ins: Any, originals: Any, shadows: Shadows) -> Any:
    """``stand_ins``, each with the values of its original as a shadow (where they are known and small)."""
    for stand_in, original in zip(tensors_in(stand_ins), tensors_in(originals), strict=True):
        if stand_in is not original:
            shadows.seed(stand_in, original)
    return stand_ins


def _fake_inputs(parts: _Parts, args: tuple[Any, ...], kwargs: dict[str, Any], mode: FakeTensorMode,
                 model_on_meta: bool, shadows: Shadows, device: torch.device | None = None
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inputs as FakeTensors (their values kept as shadows when small), leaves or not as the originals, all on
    ``device`` when given; else meta inputs of a real model, and any input of a meta model, move to its device."""
    target = _META if model_on_meta else _model_device(parts)
    storages = _InputStorages()

    def leaf_of(t: torch.Tensor) -> torch.Tensor:
        if device is not None:
            return fake_like(mode, t, device, storages)
        return fake_like(mode, t, target if (model_on_meta or t.is_meta) and target is not None else t.device,
                         storages)

    fake_args, fake_kwargs = _seeded(_input_stand_ins((args, kwargs), leaf_of), (args, kwargs), shadows)
    return fake_args, fake_kwargs


def _model_device(parts: _Parts) -> torch.device | None:
    """Where the model's tensors are: its first parameter's or buffer's device; the CPU for a model whose weights
    are all packed (``quantize_dynamic``'s: quantized kernels run on the CPU only, so meta inputs must stand there);
    None for a model without either."""
    state = parts.state()
    if state:
        return state[0].device
    return _CPU if parts.packed else None


def fake_like(mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device | None = None,
              storages: _InputStorages | None = None) -> torch.Tensor:
    """A FakeTensor with ``tensor``'s shape, strides and dtype (on ``device``, its own by default), a leaf that
    requires grad as ``tensor`` does; on the stand-in of its storage in ``storages`` when given. Made from a meta
    tensor: ten times faster than converting ``tensor``, which matters for models with many parameters; other
    layouts and tensor subclasses are converted."""
    if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.is_quantized:
        return mode.from_tensor(tensor, static_shapes=True)
    meta = None if storages is None else storages.meta(tensor)
    if meta is None:
        with unset_fake_temporarily():
            meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=_META)
    fake = fake_from_meta(mode, meta, device or tensor.device)
    return fake.requires_grad_(True) if tensor.requires_grad else fake


class _Faker:
    """A model tensor's FakeTensor stand-in; a buffer or tensor attribute (not a parameter) keeps its values
    as a shadow, so masks and positions derived from it are known."""

    def __init__(self, mode: FakeTensorMode, shadows: Shadows, device: torch.device | None = None) -> None:
        self.mode = mode
        self.shadows = shadows
        self.device = device  # where every stand-in stands (None: on its original's device)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        fake = fake_like(self.mode, tensor, self.device)
        if not isinstance(tensor, nn.Parameter):
            self.shadows.seed(fake, tensor)
        return fake


class _MetaStandIn:
    """A CPU tensor's meta stand-in (same shape, strides, dtype and ``requires_grad``); a buffer or tensor
    attribute keeps its values as a shadow, as with FakeTensors."""

    def __init__(self, shadows: Shadows) -> None:
        self.shadows = shadows

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_contiguous():  # the common case, and the quicker call
            meta = torch.empty_like(tensor, device=_META, requires_grad=tensor.requires_grad)
        else:
            meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=_META)
            meta.requires_grad_(tensor.requires_grad)
        if not isinstance(tensor, nn.Parameter):
            self.shadows.seed(meta, tensor)
        return meta


class _SwappedState:
    """Replace every parameter, buffer and plain tensor attribute by a stand-in for the run, and put
    the originals back.

    A tensor shared by several modules gets one stand-in, so tied weights stay tied. In-place updates
    (BatchNorm statistics, a counter kept as an attribute) and reassignments during the run land on
    the stand-ins.
    """

    def __init__(self, parts: _Parts, make: Callable[[torch.Tensor], torch.Tensor], keep_parameters: bool = False):
        self.parts = parts
        self.make = make
        self.keep_parameters = keep_parameters
        self.saved: list[tuple[dict[str, Any], str, Any]] = []

    def __enter__(self) -> _SwappedState:
        made: dict[int, torch.Tensor] = {}
        make = self.make
        self.saved = self.parts.held_others if self.keep_parameters else \
            [*self.parts.held_parameters, *self.parts.held_others]
        for table, name, tensor in self.saved:
            stand_in = made.get(id(tensor))
            if stand_in is None:
                stand_in = made[id(tensor)] = make(tensor)
                if getattr(tensor, GRADIENT_HOOKS, None):  # (one check: nearly no parameter has any)
                    _with_hooks_of(tensor, stand_in)
            table[name] = stand_in
        self.parts.stand_ins = made
        return self

    def __exit__(self, *_: Any) -> None:
        for table, name, tensor in reversed(self.saved):
            table[name] = tensor
        self.parts.stand_ins = {}


def _reject_meta_inputs_for_real_model(parts: _Parts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    has_meta_input = any(t.is_meta for t in tensors_in((args, kwargs)))
    if has_meta_input and not all(t.is_meta for t in parts.state()):
        raise InvalidValueError("inputs on the meta device need execution='fake' (or 'auto'): real kernels "
                                "cannot run a model whose parameters hold values on meta inputs")


class _ModuleHooks:
    """Global forward hooks that keep the recorder's module stack. A run in which a module of the model was called
    on another thread (:meth:`Recorder._elsewhere_in_run`) fails when it ends: that call's operators were not
    recorded."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.handles: list[Any] = []

    def __enter__(self) -> _ModuleHooks:
        hooks = nn.modules.module
        self.handles = [hooks.register_module_forward_pre_hook(self.recorder.enter_module),
                        hooks.register_module_forward_hook(self.recorder.exit_module, always_call=True)]
        return self

    def __exit__(self, failure: type[BaseException] | None, *_: Any) -> None:
        for handle in self.handles:
            handle.remove()
        elsewhere = self.recorder.elsewhere
        if elsewhere and failure is None:
            raise ModelRunError(f"module {elsewhere[0]!r} of the model was called on another thread than the run's "
                                "(one its forward started, or another of the process's running the model meanwhile): "
                                "its operators cannot be recorded (the recorders see the running thread only), so the "
                                "count would miss them; run that work on the calling thread to count it",
                                elsewhere[0], None)


class _Transparent:
    """Make a wrapper call the module it wraps directly while tracing.

    DataParallel/DDP would scatter to devices and run threads; a ``torch.compile`` wrapper would
    compile. The wrapped module runs eagerly instead, and the wrapper is left exactly as it was: a ``forward`` of
    its own (``OptimizedModule`` keeps its compiled one in its ``__dict__``) is put back, none is left where it had
    none. The instance dictionary is written directly: a wrapper's ``__setattr__`` may forward to the wrapped module.
    """

    def __init__(self, wrapper: nn.Module, attribute: str) -> None:
        self.wrapper = wrapper
        self.attribute = attribute
        self.own_forward: Any = None

    def __enter__(self) -> _Transparent:
        inner = getattr(self.wrapper, self.attribute)
        attributes = vars(self.wrapper)
        self.own_forward = attributes.get("forward", _NONE)
        attributes["forward"] = lambda *a, **k: inner(*a, **k)
        return self

    def __exit__(self, *_: Any) -> None:
        attributes = vars(self.wrapper)
        if self.own_forward is _NONE:
            attributes.pop("forward", None)
        else:
            attributes["forward"] = self.own_forward


_NONE = object()  # no such attribute


class _Eager:
    """Make a module compiled in place (``module.compile()``) make its eager call while tracing: its compiled call
    would compile the recorders along with the model. The compiled call is put back as it was."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.compiled: Any = None

    def __enter__(self) -> _Eager:
        attributes = vars(self.module)
        self.compiled = attributes[COMPILED_CALL_IMPL]
        attributes[COMPILED_CALL_IMPL] = None
        return self

    def __exit__(self, *_: Any) -> None:
        vars(self.module)[COMPILED_CALL_IMPL] = self.compiled


def _wrapped_attribute(module: nn.Module) -> str | None:
    """The attribute under which a wrapper (DataParallel, DDP, a ``torch.compile`` wrapper) keeps its module."""
    if type(module) in _PLAIN_CLASSES:
        return None
    if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return "module"
    if type(module).__name__ == COMPILED_MODULE_CLASS and hasattr(module, COMPILED_MODULE_ATTRIBUTE):
        return COMPILED_MODULE_ATTRIBUTE
    if len(_PLAIN_CLASSES) < 4096:
        _PLAIN_CLASSES.add(type(module))
    return None


_PLAIN_CLASSES: set[type] = set()  # module classes that are no wrapper
_MODULE_CALL_FRAMES = (MODULE_CALL_IMPL, "forward")  # the frames of a module's call


def _describe_failure(model: nn.Module, names: ModuleNames, recorder: Recorder, exc: Exception) -> ModelRunError:
    """The error of a failed run, naming the module and operator; its :class:`~modelmeter.errors.Wording` keeps the
    modules' classes and the advice as fields of their own (the parallel runner names its copy's modules by the
    model's classes)."""
    module = _innermost_module(exc, names)
    modules, classes = [module or ""], [type(names_module(model, module) if module else model).__name__]
    where = f"module {literal(repr(module))} ({{class_0}})" if module else "{class_0}.forward"
    op = recorder.failed_op
    at = literal(f" at operator {op}") if op else ""
    hint = " (the model needs real tensor values: {advice})" if isinstance(exc, NEEDS_VALUES) else ""
    if not recorder.track_autograd and _took_gradients(exc):
        hint += (" (a forward-only analysis runs under torch.no_grad(), as inference does: a model that takes "
                 "gradients or hooks them inside forward is analysed with backward=True)")
    if recorder.guessed_values:  # a meta model's own values were read: the failure may follow from the guess
        hint += literal(f" (before it, {recorder.guessed_values[0]}: a model on the meta device cannot read the "
                        "values of its own tensors; build it on the CPU for a run that reads them)")
    failure = literal(f"{type(exc).__name__}: {exc}")
    error_type, who, template = ModelRunError, module, f"the model failed in {where}{at}: {failure}{hint}"
    cuda = cuda_failure(exc)
    misfit, lookup, certain = _misfit(model, recorder)
    if cuda is not None:
        template = f"the model failed in {where}{at}: {literal(cuda)}"
    elif misfit is not None:
        error_type = InputMismatchError if certain else _LikelyMismatch
        template = f"the model failed in {where}{at}: {misfit}"
        if lookup is not None:
            modules.append(lookup[0])
            classes.append(lookup[1])
    elif recorder.phase == "backward" and module is None:
        who, template = None, f"the backward pass failed{at}: {failure}{hint}"
    wording = Wording(template, tuple(modules), tuple(classes), VALUES_ADVICE)
    return error_type(wording.text(), who, op, wording)


#: What a failure that needs tensor values advises (the ``advice`` of its wording)
VALUES_ADVICE = "use execution='auto' or 'real'"


class _LikelyMismatch(InputMismatchError):
    """An input mismatch inferred from what happened before the failure (ids of more than (batch, seq) taken by the
    first embedding lookup), not from the failing call itself: some models take such ids, and fail for another
    reason a fallback run can get past (values they need), so the fallbacks still run."""


def _certain_mismatch(exc: ModelRunError) -> bool:
    """An input the failing call itself refuses: no other way of running the model gets past it."""
    return isinstance(exc, InputMismatchError) and not isinstance(exc, _LikelyMismatch)


def _misfit(model: nn.Module, recorder: Recorder) -> tuple[str | None, tuple[str, str] | None, bool]:
    """What the failing call expected of its input when the input does not fit its parameters (certain); else, for a
    model that failed after its first embedding lookup took ids of more than (batch, seq), what that lookup expected
    (likely), as wording whose ``{class_1}`` is the class of the lookup's module, given with its name."""
    events, index = recorder.trace.events, recorder.failed_event
    if index >= 0:
        expected = mismatch(events[index])
        if expected is not None:
            return literal(expected), None, True
    lookup = token_ids_mismatch(events)
    if lookup is None:
        return None, None, False
    index, expected = lookup
    scope = recorder.trace.scopes[events[index].scope]
    name = scope[-1] if scope else ""
    return (f"the input of module {literal(repr(name))} ({{class_1}}) at operator aten::embedding does not fit it: "
            f"{literal(expected)}"), (name, type(names_module(model, name)).__name__), False


def names_module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


# The calls of autograd's a model can make in forward, that need grad mode (a gradient penalty, a hook on an activation)
_AUTOGRAD_CALLS = frozenset(f.__code__ for f in (torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward,
                                                 torch.Tensor.register_hook))


def _took_gradients(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside one of :data:`_AUTOGRAD_CALLS` (told by origin, not by torch's wording)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in _AUTOGRAD_CALLS:
            return True
        tb = tb.tb_next
    return False


def _innermost_module(exc: BaseException, names: ModuleNames) -> str | None:
    """The canonical name of the innermost model module on the failing call stack."""
    found = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name in _MODULE_CALL_FRAMES:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in names.by_id:
                found = names.by_id[id(owner)]
        tb = tb.tb_next
    return found
