"""The fvcore-compatible counting analyses: views over a :class:`~modelmeter.session.Session` that count a metric
(FLOPs, activations) by module and operator with a handle table, a convention and an ancestor mode.

:class:`MetricView` holds the read-only queries every metric view answers from its statistics — the counting
views here and :class:`~modelmeter.MemoryAnalysis` — and nothing more.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping
from typing import Any, ClassVar, TypeVar

from torch import nn

from .engine.gc_pause import paused
from .engine.spec import Execution, LossFn, RunSpec
from .engine.trace import PHASES, Phase, Trace
from .errors import InvalidTypeError, InvalidValueError, check_flag
from .handles.base import CountInside, Handle
from .handles.binding import Formula
from .handles.conventions import get_convention
from .handles.fvcore import ACTIVATION_HANDLES
from .metrics.counting import AncestorMode, Statistics, Unit, count
from .parallel.plan import ParallelPlan
from .session import CacheSetting, Session, counted_phases, log_statistics, log_warnings

V = TypeVar("V", bound="MetricView")
T = TypeVar("T", bound="ModelAnalysis")
F = TypeVar("F", bound="FlopCountAnalysis")
_NONE: Counter[str] = Counter()  # what a module without counts has (read only, never handed out)


def _counted(ops: Mapping[str, Any]) -> Counter[str]:
    """A copy of one module's counts by operator without the operators that counted 0 (a handle's 0 for an empty
    batch, say): fvcore adds the counts up with ``Counter`` addition, which keeps no zero, so its results never
    name an operator that counted nothing, and a total of only such operators is the integer 0."""
    return Counter({op: value for op, value in ops.items() if value != 0})


def _total(ops: Mapping[str, Any]) -> Any:
    """The sum of one module's counts as fvcore adds them: an operator that counted 0 (or 0.0) adds nothing."""
    return sum(value for value in ops.values() if value != 0)


def _operator_name(name: Any) -> str:
    """``name`` if it can name an operator a handle is set for (fvcore's ``namespace::name``)."""
    if not isinstance(name, str):
        raise InvalidTypeError(f"operator names must be strings like 'aten::linear', got {name!r:.60}")
    if "::" not in name:  # (a handle under such a name would count nothing: every operator has one)
        raise InvalidValueError(f"operator names are fvcore's 'namespace::name' ('aten::linear', "
                                f"'prim::PythonOp.MyFunction'); got {name!r:.60}")
    return name


def _user_handle(name: str, handle: Any) -> Handle | CountInside | None:
    """``handle`` as set for operator ``name``: a formula bound to its schema; anything but a callable, a
    :class:`CountInside` or None refused."""
    if isinstance(handle, Formula):
        return handle.bind(name)
    if handle is not None and not callable(handle) and not isinstance(handle, CountInside):
        raise InvalidTypeError(f"the handle for {name} must be callable or None, got {type(handle).__name__}")
    return handle


def check_same_model(first: MetricView, other: MetricView, other_name: str, first_name: str) -> None:
    """Refuse ``other`` (an analysis called ``other_name``) when it is not of ``first``'s model: its counts would be
    put on ``first``'s rows, under names of another model's modules (other inputs of the same model are fine: each
    analysis counts its own run, as in fvcore)."""
    if other.model is not first.model:
        raise InvalidValueError(f"{other_name} analyses another model ({type(other.model).__name__}) than "
                                f"{first_name} ({type(first.model).__name__}): pass analyses of one model")


class MetricView(ABC):
    """What a view of one metric over a session answers: counts by module, operator and dtype, the modules
    that never ran, and the session's model, trace and assumptions. Subclasses give :meth:`statistics`."""

    _session: Session
    # The phases this metric counts: every phase by default.
    _phases: ClassVar[tuple[Phase, ...]] = PHASES

    @abstractmethod
    def statistics(self) -> Statistics:
        """The metric's tables over the trace (computed once per setting; read them, do not change them)."""

    @property
    def session(self) -> Session:
        """The session this view reads: its run spec and its one trace (shared with the views of it)."""
        return self._session

    def total(self, module_name: str = "") -> int:
        """The count of ``module_name`` (the whole model by default)."""
        stats = self.statistics()
        return _total(stats.counts.get(self.canonical_module_name(module_name), _NONE))

    def by_operator(self, module_name: str = "") -> Counter[str]:
        """Counts of one module by operator (a copy)."""
        return _counted(self.statistics().counts.get(self.canonical_module_name(module_name), _NONE))

    def by_module_and_operator(self, phase: str | None = None) -> dict[str, Counter[str]]:
        """Counts by canonical module name, then by operator (copies); of one phase only when ``phase`` is
        given (``"forward"``, ``"backward"``, ``"recompute"``)."""
        stats = self.statistics()
        if phase is not None and phase not in PHASES:
            raise InvalidValueError(f"phase must be one of {', '.join(PHASES)}; got {phase!r}")
        table = stats.counts if phase is None else stats.by_phase.get(phase, {})
        return {name: _counted(table.get(name, _NONE)) for name in self.trace.module_table().canonical}

    def phases(self) -> list[str]:
        """The phases this analysis counts that the recorded run has events of, in run order."""
        return counted_phases(self.trace, self._phases)

    def by_module(self) -> Counter[str]:
        """Total count of every canonical module name, in model order."""
        counts = self.statistics().counts
        return Counter({name: _total(counts.get(name, _NONE)) for name in self.trace.module_table().canonical})

    def by_dtype(self, module_name: str = "") -> Counter[str]:
        """The count of ``module_name`` by the dtype the work was done in (``"float32"``, ``"bfloat16"``, ...;
        the dtype of an operator's first floating-point input), e.g. to compute model FLOPs utilisation."""
        return Counter(self.statistics().dtypes.get(self.canonical_module_name(module_name), Counter()))

    def uncalled_modules(self) -> set[str]:
        """Canonical names of the modules that never ran (called neither directly nor via a child)."""
        return set(self.statistics().uncalled)

    def canonical_module_name(self, name: str) -> str:
        """The name results are keyed by, for any name (or alias) of a submodule."""
        return self.trace.module_table().resolve(name)

    @property
    def model(self) -> nn.Module:
        """The analysed model."""
        return self._session.model

    @property
    def trace(self) -> Trace:
        """The recorded run (plain data), recorded on first use (or read from the cache, when enabled)."""
        return self._session.trace

    def assumptions(self) -> list[str]:
        """Placeholder values and fallbacks the run needed (empty when it needed none)."""
        return list(self.trace.assumptions)

    def tracer_warnings(self: V, mode: str) -> V:
        """``"all"`` or ``"no_tracer_warning"`` keep warnings the model raises while it runs; ``"none"`` hides them
        (a setting of the session: it applies to the one run every view of it shares)."""
        self._session.tracer_warnings(mode)
        return self


class ModelAnalysis(MetricView):
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

    An analysis is a view over a :class:`~modelmeter.Session` (its own, unless made by :meth:`from_session`):
    views of one session share its run.

    ``parallel`` (a plan's text such as ``"fsdp=8,tp=2"``, or a :class:`~modelmeter.ParallelPlan`) counts one
    rank of that plan, ``inputs`` being that rank's batch (docs/parallel.md).
    """

    _default_handles: ClassVar[dict[str, Handle | CountInside]] = {}

    def __init__(self, model: nn.Module, inputs: Any, *, execution: Execution = "auto",
                 trace: Trace | None = None, cache: CacheSetting = None,
                 cache_dir: str | os.PathLike[str] | None = None, backward: bool = False,
                 loss_fn: LossFn | None = None, parallel: str | ParallelPlan | None = None) -> None:
        spec = RunSpec.of(model, inputs, execution=execution, backward=backward, loss_fn=loss_fn, parallel=parallel)
        self._attach(Session(spec, trace=trace, cache=cache, cache_dir=cache_dir))

    @classmethod
    def from_session(cls: type[T], session: Session) -> T:
        """A view of ``session`` (with the class's default handles), sharing its run with its other views."""
        view = cls.__new__(cls)
        view._attach(session)
        return view

    def _attach(self, session: Session) -> None:
        self._session = session
        self._op_handles: dict[str, Handle | CountInside | None] = dict(self._default_handles)  # the convention's
        self._user_handles: dict[str, Handle | CountInside | None] = {}  # set_op_handle's, keyed by fvcore's names
        self._elementwise: Handle | None = None
        self._stats: Statistics | None = None
        self._ancestor_mode: AncestorMode = "owner"
        self._warn_unsupported = True
        self._warn_uncalled = True
        self._custom = False  # set_op_handle or clear_op_handles was called
        self._warned = False  # the current settings' warnings were logged (by counting, or from a kept result)

    def _recount(self) -> None:
        """Forget the statistics (and that their warnings were logged): the settings changed."""
        self._stats = None
        self._warned = False

    # results ---------------------------------------------------------------------------------
    @paused
    def statistics(self) -> Statistics:
        """The counts over the trace with the current handles and ancestor mode (computed once per setting, and
        the unsupported operators and uncalled modules logged then, unless turned off); read them, do not
        change them."""
        if self._stats is None:
            self._stats = count(self.trace, self._op_handles, self._ancestor_mode, user=self._user_handles,
                                elementwise=self._elementwise, phases=self._phases)
            if not self._warned:
                log_statistics(self.trace, self._stats, unsupported=self._warn_unsupported,
                               uncalled=self._warn_uncalled)
            self._warned = True
        return self._stats

    def units(self) -> list[Unit]:
        """Every count the view's handles take over the trace, event by event
        (:class:`~modelmeter.metrics.counting.Unit`): what a count split otherwise than by module (a pipeline's
        stages) is summed from, so that it agrees with :meth:`statistics`."""
        found: list[Unit] = []
        count(self.trace, self._op_handles, self._ancestor_mode, user=self._user_handles,
              elementwise=self._elementwise, phases=self._phases, units=found, tables=False)
        return found

    def counts_as_made(self) -> bool:
        """True while the view counts with the handles and ancestor mode it was made with (no
        :meth:`set_op_handle`, :meth:`clear_op_handles` or ancestor mode ``"caller"``): the only counts a result
        kept in the trace cache may stand for, since handles are code."""
        return not self._custom and self._ancestor_mode == "owner"

    def log_kept_warnings(self, unsupported: Mapping[str, int], uncalled: Collection[str]) -> None:
        """Log what :meth:`statistics` would log, from a result kept in the cache that stands in for counting
        (the whole model's ``unsupported`` operators and the ``uncalled`` modules); once, as counting does."""
        if self._stats is None and not self._warned:
            log_warnings(self.trace, unsupported, uncalled, unsupported=self._warn_unsupported,
                         uncalled=self._warn_uncalled)
            self._warned = True

    def by_phase(self, module_name: str = "") -> dict[str, int]:
        """The count of ``module_name`` split by phase: ``{"forward": n, "backward": n}`` (backward is 0
        unless the analysis ran it), plus ``"recompute"`` — forward work re-run during the backward pass by
        activation checkpointing — when there was any. The values add up to :meth:`total`."""
        stats = self.statistics()
        module = self.canonical_module_name(module_name)
        out = {phase: sum(stats.by_phase.get(phase, {}).get(module, Counter()).values())
               for phase in ("forward", "backward")}
        recompute = stats.by_phase.get("recompute", {})
        if any(recompute.values()):
            out["recompute"] = sum(recompute.get(module, Counter()).values())
        return out

    def by_phase_and_operator(self, module_name: str = "") -> dict[str, Counter[str]]:
        """Counts of one module by phase, then by operator (copies)."""
        stats = self.statistics()
        module = self.canonical_module_name(module_name)
        return {phase: _counted(table.get(module, _NONE)) for phase, table in stats.by_phase.items()}

    def unsupported_ops(self, module_name: str = "") -> Counter[str]:
        """Operators no handle counted, with how often each ran inside ``module_name``."""
        return Counter(self.statistics().unsupported.get(self.canonical_module_name(module_name), _NONE))

    # settings --------------------------------------------------------------------------------
    def set_op_handle(self: T, *args: Any, **kwargs: Handle | Formula[Any] | None) -> T:
        """Set handles by ``(name, handle)`` pairs or ``name=handle``; a ``None`` handle ignores the op.

        Names are fvcore's: a handle counts the calls ``torch.jit`` would record under that name
        (``aten::_convolution`` for every convolution, ``prim::PythonOp.<class name>`` for a custom autograd
        Function; see docs/handles.md), and replaces whatever counted them before. A
        :func:`~modelmeter.handles.binding.by_name` formula is bound to the operator's schema here."""
        if len(args) % 2:
            raise InvalidTypeError("set_op_handle should be called with pairs of names and handles!")
        checked: dict[str, Handle | CountInside | None] = {}  # all checked before any is set
        for name, handle in [*zip(args[::2], args[1::2], strict=True), *kwargs.items()]:
            checked[_operator_name(name)] = _user_handle(name, handle)
        self._user_handles.update(checked)
        self._custom = True
        self._recount()
        return self

    def clear_op_handles(self: T) -> T:
        """Remove every handle: afterwards every formerly counted operator is reported unsupported
        (element-wise operators become free)."""
        self._op_handles = {}
        self._user_handles = {}
        self._elementwise = None
        self._custom = True
        self._recount()
        return self

    def ancestor_mode(self: T, mode: str) -> T:
        """``"owner"``: an op counts toward the module that owns it and that module's parents by name.
        ``"caller"``: toward every module whose call is on the stack. Recomputes from the trace."""
        if mode not in ("owner", "caller"):
            raise InvalidValueError(f"Unrecognized ancestor mode: {mode}")
        if mode != self._ancestor_mode:
            self._ancestor_mode = mode  # type: ignore[assignment]
            self._recount()
        return self

    def unsupported_ops_warnings(self: T, enabled: bool) -> T:
        """Whether counting logs the operators no handle counted (the whole model's; on by default)."""
        check_flag("enabled", enabled)
        self._warn_unsupported = enabled
        return self

    def uncalled_modules_warnings(self: T, enabled: bool) -> T:
        """Whether counting logs the modules that never ran (on by default)."""
        check_flag("enabled", enabled)
        self._warn_uncalled = enabled
        return self

    def quiet_view(self: T) -> T:
        """A view of the same session and settings that logs nothing (what the printed reports read), with this
        one's statistics when they were counted: the same handles over the same trace count the same."""
        other = self.copy().unsupported_ops_warnings(False).uncalled_modules_warnings(False)
        other._stats = self._stats
        return other

    def copy(self: T, new_model: nn.Module | None = None, new_inputs: Any = None) -> T:
        """The same analysis (class, handles, modes, warnings) of a new model and/or inputs.

        With neither given, the copy is a view of the same session: it shares this one's run.
        """
        session = self._session
        if new_model is not None or new_inputs is not None:
            session = session.with_spec(session.spec.with_call(new_model, new_inputs))
        return self.on_session(session)

    def on_session(self: T, session: Session) -> T:
        """The same analysis (class, handles, modes, warnings) as a view of ``session``: another rank's run of a
        parallel plan is counted as this one is (:meth:`~modelmeter.Analysis.rank_costs`)."""
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._session = session
        other._op_handles = dict(self._op_handles)
        other._user_handles = dict(self._user_handles)
        other._recount()
        return other

    def __copy__(self: T) -> T:
        """``copy.copy(analysis)``: :meth:`copy` — a view of the same run whose handles and modes are its own
        (a shallow copy would share the handle tables, so its ``set_op_handle`` would change this one's counts)."""
        return self.copy()


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
                 execution: Execution = "auto", trace: Trace | None = None, cache: CacheSetting = None,
                 cache_dir: str | os.PathLike[str] | None = None, backward: bool = False,
                 loss_fn: LossFn | None = None, attention_kernel: str = "fused",
                 parallel: str | ParallelPlan | None = None) -> None:
        get_convention(convention, dense_attention=dense_attention, attention_kernel=attention_kernel)  # checked first
        spec = RunSpec.of(model, inputs, execution=execution, backward=backward, loss_fn=loss_fn, parallel=parallel)
        self._attach_counting(Session(spec, trace=trace, cache=cache, cache_dir=cache_dir), convention,
                              dense_attention, attention_kernel)

    @classmethod
    def from_session(cls: type[F], session: Session, *, convention: str = "fvcore", dense_attention: bool = False,
                     attention_kernel: str = "fused") -> F:
        """A view of ``session`` counting under ``convention``, sharing its run with its other views."""
        view = cls.__new__(cls)
        view._attach_counting(session, convention, dense_attention, attention_kernel)
        return view

    def _attach_counting(self, session: Session, convention: str, dense_attention: bool,
                         attention_kernel: str) -> None:
        chosen = get_convention(convention, dense_attention=dense_attention, attention_kernel=attention_kernel)
        self._attach(session)
        self._convention = chosen.name
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
    if supported_ops is not None and not isinstance(supported_ops, Mapping):
        raise InvalidTypeError(f"supported_ops must be a dict of operator names to handles (or None), got "
                               f"{type(supported_ops).__name__}")
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
