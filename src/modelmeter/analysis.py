"""The fvcore-compatible analysis objects: one trace of the model, any number of metrics over it."""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from torch import nn

from .engine.inputs import check_inputs, split_inputs
from .engine.naming import ModuleNames
from .engine.trace import PHASES, Phase, Trace
from .engine.tracer import Execution, LossFn, record_trace
from .handles.base import CountInside, Handle
from .handles.conventions import get_convention
from .handles.fvcore import ACTIVATION_HANDLES
from .metrics.counting import AncestorMode, Statistics, count
from .metrics.parameters import parameter_count

if TYPE_CHECKING:
    import torch

    from .cache import TraceCache
    from .memory import MemoryAnalysis
    from .metrics.memory import OptimizerSpec
    from .reports.result import Result

logger = logging.getLogger("modelmeter")
T = TypeVar("T", bound="ModelAnalysis")

_NO_FORWARD = (nn.ModuleList, nn.ModuleDict, nn.Identity)
_NONE: Counter[str] = Counter()  # what a module without counts has (read only, never handed out)


class ModelAnalysis:
    """Counts a metric over one run of ``model`` on ``inputs``, by module and by operator.

    The model runs once, lazily, on FakeTensors by default (``execution="auto"``); every query and
    every change of handles or ancestor mode is answered from that one recorded trace.
    ``inputs``: a tensor, a tuple of positional arguments, a dict of keyword arguments, or
    :class:`modelmeter.Args`. ``trace``: the trace of another analysis of the same model and
    inputs, so a second metric reuses it instead of running the model again.

    ``cache=True`` (or a ``cache_dir``, or a :class:`modelmeter.cache.TraceCache`) keeps the trace on disk
    under ``get_cache_dir(cache_dir)/traces``, keyed by a fingerprint of the model, the inputs and the run
    options, and reads it from there next time instead of running the model (docs/caching.md). Off by default.

    ``backward=True`` runs the backward pass too: the gradients of ``loss_fn(output)`` (default: the sum
    of the output's floating-point tensors) with respect to the parameters and inputs that require grad.
    Backward operators count toward the module whose forward made them; :meth:`by_phase` splits the totals.
    """

    _default_handles: ClassVar[dict[str, Handle | CountInside]] = {}
    # The phases this metric counts: every phase by default.
    _phases: ClassVar[tuple[Phase, ...]] = PHASES

    def __init__(self, model: nn.Module, inputs: Any, *, execution: Execution = "auto",
                 trace: Trace | None = None, cache: bool | TraceCache | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, backward: bool = False,
                 loss_fn: LossFn | None = None) -> None:
        args, kwargs = split_inputs(inputs)
        check_inputs(model, args, kwargs)
        if loss_fn is not None and not backward:
            raise ValueError("loss_fn is only used for the backward pass: pass backward=True with it")
        self._model = model
        self._inputs = inputs
        self._args, self._kwargs = args, kwargs
        self._execution: Execution = execution
        self._backward = backward
        self._loss_fn = loss_fn
        self._cache = cache
        self._cache_dir = cache_dir
        self._trace_was_cached = False
        self._module_names: ModuleNames | None = None  # made on first use; analyses of one Analysis share them
        self._op_handles: dict[str, Handle | CountInside | None] = dict(self._default_handles)  # the convention's
        self._user_handles: dict[str, Handle | CountInside | None] = {}  # set_op_handle's, keyed by fvcore's names
        self._elementwise: Handle | None = None
        self._trace: Trace | None = trace
        self._stats: Statistics | None = None
        self._ancestor_mode: AncestorMode = "owner"
        self._warn_unsupported = True
        self._warn_uncalled = True
        self._tracer_warnings = "no_tracer_warning"

    @property
    def _names(self) -> ModuleNames:
        if self._module_names is None:
            self._module_names = ModuleNames(self._model)
        return self._module_names

    # results ---------------------------------------------------------------------------------
    def total(self, module_name: str = "") -> int:
        """The count of ``module_name`` (the whole model by default)."""
        stats = self._analyze()
        return sum(stats.counts.get(self.canonical_module_name(module_name), _NONE).values())

    def by_operator(self, module_name: str = "") -> Counter[str]:
        """Counts of one module by operator (a copy)."""
        return Counter(self._analyze().counts.get(self.canonical_module_name(module_name), _NONE))

    def by_module_and_operator(self, phase: str | None = None) -> dict[str, Counter[str]]:
        """Counts by canonical module name, then by operator (copies); of one phase only when ``phase`` is
        given (``"forward"``, ``"backward"``, ``"recompute"``)."""
        stats = self._analyze()
        if phase is not None and phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}; got {phase!r}")
        table = stats.counts if phase is None else stats.by_phase.get(phase, {})
        return {name: Counter(table.get(name, _NONE)) for name in self._names.canonical}

    def phases(self) -> list[str]:
        """The phases this analysis counts that the recorded run has events of, in run order."""
        trace = self.trace
        present = {event.phase for event in trace.events} if trace.backward else {"forward"} if trace.events else set()
        return [phase for phase in self._phases if phase in present]

    def by_module(self) -> Counter[str]:
        """Total count of every canonical module name, in model order."""
        counts = self._analyze().counts
        return Counter({name: sum(counts.get(name, _NONE).values()) for name in self._names.canonical})

    def by_phase(self, module_name: str = "") -> dict[str, int]:
        """The count of ``module_name`` split by phase: ``{"forward": n, "backward": n}`` (backward is 0
        unless the analysis ran it), plus ``"recompute"`` — forward work re-run during the backward pass by
        activation checkpointing — when there was any. The values add up to :meth:`total`."""
        stats = self._analyze()
        module = self.canonical_module_name(module_name)
        out = {phase: sum(stats.by_phase.get(phase, {}).get(module, Counter()).values())
               for phase in ("forward", "backward")}
        recompute = stats.by_phase.get("recompute", {})
        if any(recompute.values()):
            out["recompute"] = sum(recompute.get(module, Counter()).values())
        return out

    def by_phase_and_operator(self, module_name: str = "") -> dict[str, Counter[str]]:
        """Counts of one module by phase, then by operator (copies)."""
        stats = self._analyze()
        module = self.canonical_module_name(module_name)
        return {phase: Counter(table.get(module, Counter())) for phase, table in stats.by_phase.items()}

    def by_dtype(self, module_name: str = "") -> Counter[str]:
        """The count of ``module_name`` by the dtype the work was done in (``"float32"``, ``"bfloat16"``, ...;
        the dtype of an operator's first floating-point input), e.g. to compute model FLOPs utilisation."""
        return Counter(self._analyze().dtypes.get(self.canonical_module_name(module_name), Counter()))

    def unsupported_ops(self, module_name: str = "") -> Counter[str]:
        """Operators no handle counted, with how often each ran inside ``module_name``."""
        return Counter(self._analyze().unsupported.get(self.canonical_module_name(module_name), _NONE))

    def uncalled_modules(self) -> set[str]:
        """Canonical names of the modules that never ran (called neither directly nor via a child)."""
        return set(self._analyze().uncalled)

    def canonical_module_name(self, name: str) -> str:
        """The name results are keyed by, for any name (or alias) of a submodule."""
        return self.trace.module_table().resolve(name)

    @property
    def model(self) -> nn.Module:
        """The analysed model."""
        return self._model

    @property
    def trace(self) -> Trace:
        """The recorded run (plain data), recorded on first use (or read from the cache, when enabled)."""
        if self._trace is None:
            with warnings.catch_warnings():
                if self._tracer_warnings == "none":
                    warnings.simplefilter("ignore")
                self._trace = self._load_or_record()
        return self._trace

    def _load_or_record(self) -> Trace:
        def record() -> Trace:
            return record_trace(self._model, self._args, self._kwargs, self._names, self._execution,
                                backward=self._backward, loss_fn=self._loss_fn)

        store = self._trace_cache()
        if store is None:
            return record()
        from .cache import cached_trace

        trace, self._trace_was_cached = cached_trace(store, self._model, self._args, self._kwargs,
                                                     self._execution, record, backward=self._backward,
                                                     loss_fn=self._loss_fn)
        return trace

    def _trace_cache(self) -> TraceCache | None:
        from .cache import TraceCache

        if isinstance(self._cache, TraceCache):
            return self._cache
        if self._cache is False or (self._cache is None and self._cache_dir is None):
            return None
        try:
            return TraceCache(self._cache_dir)
        except OSError as exc:
            logger.warning("The trace cache is unavailable (%s); running the model without it.", exc)
            return None

    def assumptions(self) -> list[str]:
        """Placeholder values and fallbacks the run needed (empty when it needed none)."""
        return list(self.trace.assumptions)

    # settings --------------------------------------------------------------------------------
    def set_op_handle(self: T, *args: Any, **kwargs: Handle | None) -> T:
        """Set handles by ``(name, handle)`` pairs or ``name=handle``; a ``None`` handle ignores the op.

        Names are fvcore's: a handle counts the calls ``torch.jit`` would record under that name
        (``aten::_convolution`` for every convolution, ``prim::PythonOp.<class name>`` for a custom autograd
        Function; see docs/handles.md), and replaces whatever counted them before."""
        if len(args) % 2:
            raise TypeError("set_op_handle should be called with pairs of names and handles!")
        pairs = dict(zip(args[::2], args[1::2], strict=True))
        pairs.update(kwargs)
        for name, handle in pairs.items():
            if not isinstance(name, str):
                raise TypeError(f"operator names must be strings like 'aten::linear', got {name!r}")
            if handle is not None and not callable(handle) and not isinstance(handle, CountInside):
                raise TypeError(f"the handle for {name} must be callable or None, got {type(handle).__name__}")
            self._user_handles[name] = handle
        self._stats = None
        return self

    def clear_op_handles(self: T) -> T:
        """Remove every handle: afterwards every formerly counted operator is reported unsupported
        (element-wise operators become free)."""
        self._op_handles = {}
        self._user_handles = {}
        self._elementwise = None
        self._stats = None
        return self

    def ancestor_mode(self: T, mode: str) -> T:
        """``"owner"``: an op counts toward the module that owns it and that module's parents by name.
        ``"caller"``: toward every module whose call is on the stack. Recomputes from the trace."""
        if mode not in ("owner", "caller"):
            raise ValueError(f"Unrecognized ancestor mode: {mode}")
        if mode != self._ancestor_mode:
            self._ancestor_mode = mode  # type: ignore[assignment]
            self._stats = None
        return self

    def unsupported_ops_warnings(self: T, enabled: bool) -> T:
        self._warn_unsupported = enabled
        return self

    def uncalled_modules_warnings(self: T, enabled: bool) -> T:
        self._warn_uncalled = enabled
        return self

    def tracer_warnings(self: T, mode: str) -> T:
        """``"all"`` or ``"no_tracer_warning"`` keep warnings the model raises while it runs; ``"none"`` hides them."""
        if mode not in ("all", "no_tracer_warning", "none"):
            raise ValueError(f"Unrecognized tracer warning mode {mode}.")
        self._tracer_warnings = mode
        return self

    def copy(self: T, new_model: nn.Module | None = None, new_inputs: Any = None) -> T:
        """The same analysis (class, handles, modes, warnings) of a new model and/or inputs.

        With neither given, the copy shares this one's recorded trace.
        """
        model = self._model if new_model is None else new_model
        inputs = self._inputs if new_inputs is None else new_inputs
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        same = new_model is None and new_inputs is None
        ModelAnalysis.__init__(other, model, inputs, execution=self._execution, trace=self._trace if same else None,
                               cache=self._cache, cache_dir=self._cache_dir, backward=self._backward,
                               loss_fn=self._loss_fn)
        other._trace_was_cached = self._trace_was_cached and same
        other._op_handles = dict(self._op_handles)
        other._user_handles = dict(self._user_handles)
        other._elementwise = self._elementwise
        other._ancestor_mode = self._ancestor_mode
        other._warn_unsupported = self._warn_unsupported
        other._warn_uncalled = self._warn_uncalled
        other._tracer_warnings = self._tracer_warnings
        return other

    # internals -------------------------------------------------------------------------------
    def _analyze(self) -> Statistics:
        if self._stats is None:
            self._stats = count(self.trace, self._names, self._op_handles, self._ancestor_mode,
                                user=self._user_handles, elementwise=self._elementwise, phases=self._phases)
            self._warn(self._stats)
        return self._stats

    def _warn(self, stats: Statistics) -> None:
        if self._warn_unsupported:
            for op, freq in stats.unsupported.get("", Counter()).items():
                logger.warning("Unsupported operator %s encountered %d time(s)", op, freq)
        if self._warn_uncalled:
            uncalled = sorted(n for n in stats.uncalled if self._has_forward(n))
            if uncalled:
                logger.warning(
                    "The following submodules of the model were never called during the trace of the graph. "
                    "They may be unused, or they were accessed by direct calls to .forward() or via other "
                    "python methods. In the latter case they will have zeros for statistics, though their "
                    "statistics will still contribute to their parent calling module.\n%s", ", ".join(uncalled))

    def _has_forward(self, name: str) -> bool:
        module = self._model.get_submodule(name) if name else self._model
        forward = type(module).forward
        return not isinstance(module, _NO_FORWARD) and forward is not nn.Module.forward


JitModelAnalysis = ModelAnalysis


class FlopCountAnalysis(ModelAnalysis):
    """FLOPs under a counting ``convention`` (docs/handles.md has every operator's formula under each):

    - ``"fvcore"`` (default): one fused multiply-add is one flop, element-wise operators are free — fvcore's
      numbers;
    - ``"macs"``: multiply-adds of matrix products, convolutions and attention only (torchvision's "GFLOPS");
    - ``"flops"``: real floating-point operations — a multiply-add is two, plus the documented per-element
      costs of element-wise operators, norms, softmax, pooling and bias adds.

    Masked attention (``is_causal``, causal or sliding-window masks whose values are known) counts only the
    attended (query, key) pairs; ``dense_attention=True`` counts every pair. ``backward=True`` adds the
    backward pass (see :class:`ModelAnalysis`). ``attention_kernel``: the kernel whose cost attention is counted
    at, ``"fused"`` (default) or ``"math"`` (every pair, no recomputation backward; docs/attention.md).

    Example::

        flops = FlopCountAnalysis(model, torch.randn(1, 3, 224, 224))
        flops.total(); flops.by_module(); flops.by_operator("layer1")
        FlopCountAnalysis(model, x, convention="flops", backward=True).by_phase()
    """

    def __init__(self, model: nn.Module, inputs: Any, *, convention: str = "fvcore", dense_attention: bool = False,
                 execution: Execution = "auto", trace: Trace | None = None, cache: bool | TraceCache | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, backward: bool = False,
                 loss_fn: LossFn | None = None, attention_kernel: str = "fused") -> None:
        chosen = get_convention(convention, dense_attention=dense_attention, attention_kernel=attention_kernel)
        super().__init__(model, inputs, execution=execution, trace=trace, cache=cache, cache_dir=cache_dir,
                         backward=backward, loss_fn=loss_fn)
        self._convention = chosen.name
        self._dense_attention = dense_attention
        self._op_handles = dict(chosen.handles)
        self._elementwise = chosen.elementwise

    @property
    def convention(self) -> str:
        """The counting convention: ``"fvcore"``, ``"macs"`` or ``"flops"``."""
        return self._convention


class ActivationCountAnalysis(ModelAnalysis):
    """Activations in fvcore's sense: elements of the first output of conv, linear and matrix products,
    in the forward pass (a backward pass, when run, is not counted: its outputs are gradients)."""

    _default_handles = ACTIVATION_HANDLES
    _phases: ClassVar[tuple[Phase, ...]] = ("forward",)


def _per_operator(analysis: ModelAnalysis, supported_ops: dict[str, Handle | None] | None, scale: float
                  ) -> tuple[defaultdict[str, float], Counter[str]]:
    if supported_ops:
        analysis.set_op_handle(**supported_ops)
    result: defaultdict[str, float] = defaultdict(float)
    for op, value in analysis.by_operator().items():
        result[op] = value / scale
    return result, analysis.unsupported_ops()


def flop_count(model: nn.Module, inputs: Any, supported_ops: dict[str, Handle | None] | None = None
               ) -> tuple[defaultdict[str, float], Counter[str]]:
    """GFLOPs by operator and the unsupported operators, as fvcore's ``flop_count``."""
    return _per_operator(FlopCountAnalysis(model, inputs), supported_ops, 1e9)


def activation_count(model: nn.Module, inputs: Any, supported_ops: dict[str, Handle | None] | None = None
                     ) -> tuple[defaultdict[str, float], Counter[str]]:
    """Mega-activations by operator and the unsupported operators, as fvcore's ``activation_count``."""
    return _per_operator(ActivationCountAnalysis(model, inputs), supported_ops, 1e6)


class Analysis:
    """Every metric of one model on one set of inputs, answered from one trace (see :func:`analyze`).

    ``flops`` and ``activations`` are the fvcore-compatible analyses, sharing the trace; ``parameters`` is
    :func:`parameter_count`; ``result()`` collects them into a :class:`~modelmeter.Result`; ``table()`` is
    fvcore's ``flop_count_table`` with both columns. With ``memory=True``, ``memory`` is a
    :class:`~modelmeter.MemoryAnalysis` of the same trace (of a training step when ``backward=True``, with
    ``optimizer``), and the result has memory columns. Handles and modes of each analysis can be changed as
    usual: they recompute from the trace. ``quiet=True`` logs no unsupported operators or uncalled modules
    and hides warnings the model raises while it runs (the command's choice: it reports them itself).
    """

    def __init__(self, model: nn.Module, inputs: Any, *, convention: str = "fvcore", dense_attention: bool = False,
                 backward: bool = False, loss_fn: LossFn | None = None, execution: Execution = "auto",
                 cache: bool | TraceCache | None = None, cache_dir: str | os.PathLike[str] | None = None,
                 quiet: bool = False, memory: bool = False, optimizer: str | OptimizerSpec | None = None,
                 state_dtype: str | torch.dtype | None = None, foreach: bool | None = None,
                 attention_kernel: str = "fused") -> None:
        if not memory and (optimizer is not None or state_dtype is not None or foreach is not None):
            raise ValueError("optimizer, state_dtype and foreach are memory options: pass memory=True with them")
        self.model = model
        self.inputs = inputs
        self.flops = FlopCountAnalysis(model, inputs, convention=convention, dense_attention=dense_attention,
                                       backward=backward, loss_fn=loss_fn, execution=execution, cache=cache,
                                       cache_dir=cache_dir, attention_kernel=attention_kernel)
        if quiet:
            self.flops.unsupported_ops_warnings(False).uncalled_modules_warnings(False).tracer_warnings("none")
        trace = self.flops.trace
        self.activations = ActivationCountAnalysis(model, inputs, execution=execution, trace=trace)
        self.activations._module_names = self.flops._names  # one model, one walk of its modules
        # Activation handles count only a few operators, and uncalled modules are the flops' to report.
        self.activations.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
        self.memory: MemoryAnalysis | None = None
        if memory:
            from .memory import MemoryAnalysis

            self.memory = MemoryAnalysis(model, inputs, training=backward, optimizer=optimizer,
                                         state_dtype=state_dtype, foreach=foreach, loss_fn=loss_fn,
                                         execution=execution, trace=trace)
            self.memory._module_names = self.flops._names

    @property
    def trace(self) -> Trace:
        """The one recorded run every metric is computed from."""
        return self.flops.trace

    @property
    def from_cache(self) -> bool:
        """True when the trace was read from the persistent cache instead of running the model."""
        return self.flops._trace_was_cached

    @property
    def parameters(self) -> defaultdict[str, int]:
        """Parameter elements under every name prefix (``""`` is the total), as :func:`parameter_count`."""
        return parameter_count(self.model)

    @property
    def metrics(self) -> dict[str, ModelAnalysis]:
        """Metric name -> analysis, in report order."""
        found: dict[str, ModelAnalysis] = {"flops": self.flops, "activations": self.activations}
        if self.memory is not None:
            found["activation_bytes"] = self.memory
        return found

    def assumptions(self) -> list[str]:
        """Placeholder values and fallbacks the run needed."""
        return list(self.trace.assumptions)

    def result(self, name: str | None = None) -> Result:
        """The structured :class:`~modelmeter.Result` (modules x metrics x operators)."""
        from .reports.result import build_result

        return build_result(self.model, self.metrics, name=name, memory=self.memory)

    def table(self, max_depth: int = 3, show_param_shapes: bool = True) -> str:
        """fvcore's ``flop_count_table`` with parameters, flops and activations."""
        from .reports.fvcore_tables import flop_count_table

        return flop_count_table(self.flops, max_depth, self.activations, show_param_shapes)

    def __repr__(self) -> str:
        return (f"Analysis({type(self.model).__name__}: {self.flops.total()} flops, "
                f"{self.activations.total()} activations, {self.parameters['']} parameters)")


def analyze(model: nn.Module, inputs: Any, *, convention: str = "fvcore", dense_attention: bool = False,
            backward: bool = False, loss_fn: LossFn | None = None, execution: Execution = "auto",
            cache: bool | TraceCache | None = None, cache_dir: str | os.PathLike[str] | None = None,
            quiet: bool = False, memory: bool = False, optimizer: str | OptimizerSpec | None = None,
            state_dtype: str | torch.dtype | None = None, foreach: bool | None = None,
            attention_kernel: str = "fused") -> Analysis:
    """Run ``model`` on ``inputs`` once (or read the run from the cache) and return every metric of it.

    Example::

        a = modelmeter.analyze(model, torch.randn(1, 3, 224, 224), cache=True)
        a.flops.total(); a.activations.by_module(); a.parameters[""]; a.result(); print(a.table())

    ``convention``, ``dense_attention``, ``attention_kernel``, ``backward`` and ``loss_fn`` choose what the FLOPs
    count, as for :class:`FlopCountAnalysis`; ``execution``: ``"auto"``, ``"fake"`` or ``"real"``. ``cache=True``
    keeps the trace on disk (in ``get_cache_dir(cache_dir)/traces``; a ``cache_dir`` alone turns it on too);
    off by default. The model runs when ``analyze`` is called, so a failure surfaces here. ``quiet=True``
    keeps the log and the model's own warnings silent. ``memory=True`` adds the memory analysis (inference, or
    a training step with ``backward=True`` and an ``optimizer``; see :class:`~modelmeter.MemoryAnalysis`).
    """
    return Analysis(model, inputs, convention=convention, dense_attention=dense_attention, backward=backward,
                    loss_fn=loss_fn, execution=execution, cache=cache, cache_dir=cache_dir, quiet=quiet,
                    memory=memory, optimizer=optimizer, state_dtype=state_dtype, foreach=foreach,
                    attention_kernel=attention_kernel)
