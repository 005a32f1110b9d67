"""One analysis of a model: a session (one run spec, one trace) with the FLOPs, activations and memory views over
it, and the :class:`~modelmeter.Result` they make (see :func:`analyze`)."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from .devices import Device, Interconnect, get_interconnect
from .engine.gc_pause import paused
from .engine.spec import Execution, LossFn, RunSpec
from .engine.trace import Trace
from .errors import InvalidTypeError, InvalidValueError, check_flag
from .fvcore_api import flop_count_table
from .handles.conventions import has_registered_handles
from .memory import MemoryAnalysis
from .metrics.communication import Communication, communication
from .metrics.memory import OptimizerSpec
from .metrics.roofline import Roofline, roofline
from .metrics.step_time import StepTime, step_time
from .parallel.plan import ParallelPlan
from .parallel.summary import RankCosts, rank_costs, tp_peers, with_peers
from .reports.result import Result
from .session import CacheSetting, Counted, Session, assemble_result, roofline_settings
from .views import (
    ActivationCountAnalysis,
    FlopCountAnalysis,
    JitModelAnalysis,
    MetricView,
    ModelAnalysis,
    activation_count,
    check_same_model,
    flop_count,
)

__all__ = [
    "ActivationCountAnalysis",
    "Analysis",
    "FlopCountAnalysis",
    "JitModelAnalysis",
    "ModelAnalysis",
    "activation_count",
    "analyze",
    "build_result",
    "flop_count",
]


def build_result(model: nn.Module, analyses: dict[str, MetricView], *, name: str | None = None,
                 memory: MemoryAnalysis | None = None, time: Roofline | None = None,
                 parallel: RankCosts | None = None) -> Result:
    """Collect ``analyses`` (metric name -> analysis of ``model``, ideally sharing one trace) into a Result.

    Rows follow the trace's module table (canonical names only, in the model's order); parameters are counted
    as :func:`parameter_count` does, so shared parameters count once. ``memory`` adds the saved-for-backward
    bytes and module peaks of a :class:`~modelmeter.MemoryAnalysis` and its summary; ``time`` the roofline's
    columns (:attr:`Analysis.roofline`); ``parallel`` the per-rank costs (:meth:`Analysis.rank_costs`). The same
    builder as
    :func:`modelmeter.session.result_from_trace`, over the analyses' own statistics.
    """
    first = _checked_analyses(model, analyses)
    _check_parts(name=(name, str), memory=(memory, MemoryAnalysis), time=(time, Roofline),
                 parallel=(parallel, RankCosts))
    metrics = {metric: Counted(analysis.statistics(), analysis.phases()) for metric, analysis in analyses.items()}
    return assemble_result(first.trace, metrics, name=name or type(model).__name__,
                           convention=str(getattr(first, "convention", "fvcore")),
                           memory=None if memory is None else memory.columns(), time=time,
                           parallel=None if parallel is None else parallel.to_dict())


def _check_parts(**parts: tuple[Any, type]) -> None:
    """Refuse an optional argument (name -> (value, the type it must be)) of another type than its own."""
    for argument, (value, kind) in parts.items():
        if value is not None and not isinstance(value, kind):
            raise InvalidTypeError(f"{argument} must be a {kind.__name__} or None, got {type(value).__name__}")


def _checked_analyses(model: Any, analyses: Any) -> MetricView:
    """The first of ``analyses`` (for :func:`build_result`), each checked to be an analysis of ``model``: the rows
    are the first one's trace's modules, so another model's counts would be put on them."""
    if not isinstance(model, nn.Module):
        raise InvalidTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(analyses, dict) or not analyses:
        raise InvalidValueError("build_result needs a dict of at least one analysis, e.g. "
                                f"{{'flops': FlopCountAnalysis(...)}}; got {analyses!r:.60}")
    for metric, analysis in analyses.items():
        if not isinstance(metric, str) or not isinstance(analysis, MetricView):
            raise InvalidTypeError(f"build_result's analyses map metric names to analyses; got {metric!r:.40}: "
                                   f"{type(analysis).__name__}")
    first = next(iter(analyses.values()))
    if first.model is not model:
        raise InvalidValueError(f"the analyses are of another model ({type(first.model).__name__}) than model "
                                f"({type(model).__name__})")
    for metric, analysis in analyses.items():
        check_same_model(first, analysis, f"the {metric!r:.40} analysis", "the first one")
    return first


class Analysis:
    """Every metric of one model on one set of inputs, answered from one trace (see :func:`analyze`).

    ``flops`` and ``activations`` are the fvcore-compatible analyses, sharing the trace; ``parameters`` is
    :func:`parameter_count`; ``result()`` collects them into a :class:`~modelmeter.Result`; ``table()`` is
    fvcore's ``flop_count_table`` with both columns. With ``memory=True``, ``memory`` is a
    :class:`~modelmeter.MemoryAnalysis` of the same trace (of a training step when ``backward=True``, with
    ``optimizer``), and the result has memory columns. Handles and modes of each analysis can be changed as
    usual: they recompute from the trace. ``quiet=True`` logs no unsupported operators or uncalled modules
    and hides warnings the model raises while it runs (the command's choice: it reports them itself). With a
    ``device``, :attr:`roofline` predicts the time on it and the result has the roofline's columns.
    """

    def __init__(self, model: nn.Module, inputs: Any, *, convention: str = "fvcore", dense_attention: bool = False,
                 backward: bool = False, loss_fn: LossFn | None = None, execution: Execution = "auto",
                 cache: CacheSetting = None, cache_dir: str | os.PathLike[str] | None = None,
                 quiet: bool = False, memory: bool = False, optimizer: str | OptimizerSpec | None = None,
                 state_dtype: str | torch.dtype | None = None, foreach: bool | None = None,
                 attention_kernel: str = "fused", device: str | Device | None = None, efficiency: float = 1.0,
                 launch_overhead: float = 0.0, tf32: bool = False, measured_time: float | None = None,
                 parallel: str | ParallelPlan | None = None) -> None:
        check_flag("quiet", quiet)
        check_flag("memory", memory)
        if not memory and (optimizer is not None or state_dtype is not None or foreach is not None):
            raise InvalidValueError("optimizer, state_dtype and foreach are memory options: pass memory=True with them")
        self.model = model
        self.inputs = inputs
        self._settings: dict[str, Any] = {
            "convention": convention, "dense_attention": dense_attention, "attention_kernel": attention_kernel,
            "memory": memory, "optimizer": optimizer,
            "state_dtype": None if state_dtype is None else str(state_dtype).removeprefix("torch."),
            "foreach": foreach, "device": device, "efficiency": efficiency, "launch_overhead": launch_overhead,
            "tf32": tf32, "measured_time": measured_time}
        self._time = roofline_settings(device, efficiency=efficiency, launch_overhead=launch_overhead, tf32=tf32,
                                       measured_time=measured_time)
        self._roofline: Roofline | None = None
        self._communication: Communication | None = None
        spec = RunSpec.of(model, inputs, execution=execution, backward=backward, loss_fn=loss_fn, parallel=parallel)
        #: The one run every view reads: its spec, its trace, the caches.
        self.session = Session(spec, cache=cache, cache_dir=cache_dir)
        self._cache = (cache, cache_dir)  # the other ranks' runs of an uneven plan (rank_costs) share the cache
        self._peers: dict[int, Analysis] = {}  # those runs, by rank: recorded once, counted with this one's handles
        self.flops = FlopCountAnalysis.from_session(self.session, convention=convention,
                                                    dense_attention=dense_attention, attention_kernel=attention_kernel)
        # Activation handles count only a few operators, and uncalled modules are the flops' to report.
        self.activations = ActivationCountAnalysis.from_session(self.session)
        self.activations.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
        self.memory: MemoryAnalysis | None = None
        if memory:
            self.memory = MemoryAnalysis.from_session(self.session, optimizer=optimizer, state_dtype=state_dtype,
                                                      foreach=foreach)
        if quiet:
            self.flops.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
            self.session.tracer_warnings("none")
        _ = self.session.trace  # the model runs now, so a failure surfaces here

    @property
    def trace(self) -> Trace:
        """The one recorded run every metric is computed from."""
        return self.session.trace

    @property
    def settings(self) -> dict[str, Any]:
        """The options the result was counted with — ``convention``, ``dense_attention``, ``attention_kernel``,
        ``memory``, ``optimizer``, ``state_dtype``, ``foreach``, and the time's ``device``, ``efficiency``,
        ``launch_overhead``, ``tf32``, ``measured_time`` — so that ``result_from_trace(trace, **settings)``
        gives :meth:`result` from the trace alone (handles set with ``set_op_handle`` are not among them)."""
        return dict(self._settings)

    @property
    def from_cache(self) -> bool:
        """True when the trace was read from the persistent cache instead of running the model."""
        return self.session.from_cache

    @property
    def parameters(self) -> defaultdict[str, int]:
        """Parameter elements under every name prefix (``""`` is the total), as :func:`parameter_count`."""
        return self.session.parameters()

    @property
    def metrics(self) -> dict[str, MetricView]:
        """Metric name -> analysis, in report order."""
        found: dict[str, MetricView] = {"flops": self.flops, "activations": self.activations}
        if self.memory is not None:
            found["activation_bytes"] = self.memory
        return found

    @property
    def roofline(self) -> Roofline | None:
        """The predicted time on the analysis's ``device`` (bytes, FLOPs, seconds, bound, by module, operator and
        phase; docs/roofline.md), None without a device. Computed once, from the trace."""
        if self._time is None:
            return None
        if self._roofline is None:
            settings = self._settings
            optimizer = None if self.memory is None else self.memory.optimizer
            self._roofline = roofline(self.trace, self._time, attention_kernel=settings["attention_kernel"],
                                      dense_attention=settings["dense_attention"], optimizer=optimizer)
        return self._roofline

    @property
    def communication(self) -> Communication:
        """The collectives the run issued, with what each moved, by kind, module, phase and group
        (docs/parallel.md, "Communication"). Made once per analysis: the step time and the per-rank costs read it."""
        if self._communication is None:
            self._communication = communication(self.trace)
        return self._communication

    def step_time(self, interconnect: str | Device | Interconnect | None = None) -> StepTime | None:
        """One rank's step on the analysis's ``device``: the roofline's compute time and the communication time
        on ``interconnect`` (default: the device's own), combined under the overlap assumption the result states
        (docs/parallel.md, "Step time"); None without a device."""
        self._check_interconnect(interconnect)
        time = self.roofline
        if time is None or self._time is None:
            return None
        links = get_interconnect(self._time.device if interconnect is None else interconnect)
        return step_time(self.communication, time.summary["time"], links)

    def rank_costs(self, interconnect: str | Device | Interconnect | None = None) -> RankCosts | None:
        """What every rank of the parallel plan computes, holds, sends and takes, ranks of equal cost folded into
        one entry (one per pipeline stage, and per group of tensor-parallel coordinates under an uneven split):
        FLOPs counted as the analysis counts them (its convention and handles, ``set_op_handle``'s included),
        parameters, the peak memory and its parts (with ``memory=True``), communication, and the step time on the
        analysis's ``device`` over ``interconnect`` (default: the device's own). None for a run on one device
        (docs/parallel.md, "Per-rank summary")."""
        own = self.simulated_rank_costs(interconnect)
        plan = self.session.spec.parallel
        if own is None or plan is None:
            return None
        # an uneven tensor-parallel split: the ranks holding other shards are runs of their own, counted as this one
        peers = (self._peer(plan, rank).simulated_rank_costs(interconnect) for rank in tp_peers(self.trace))
        return with_peers(own, [costs for costs in peers if costs is not None])

    def simulated_rank_costs(self, interconnect: str | Device | Interconnect | None = None) -> RankCosts | None:
        """:meth:`rank_costs` of the ranks that hold the simulated rank's shards only: all of them but under an
        uneven tensor-parallel split, whose other ranks :meth:`rank_costs` simulates (docs/parallel.md, "Per-rank
        summary"). None for a run on one device."""
        self._check_interconnect(interconnect)
        if self.trace.parallel is None:
            return None
        time = self.roofline
        links = None
        if interconnect is not None and self._time is not None:
            links = get_interconnect(interconnect)
        memory = None if self.memory is None else self.session.memory_model()
        return rank_costs(self.trace, convention=self.flops.convention, flops=self.flops.by_phase(), memory=memory,
                          optimizer=None if self.memory is None else self.memory.optimizer, time=self._time,
                          compute=None if time is None else time.summary["time"], interconnect=links,
                          calls=self.communication, count_units=self.flops.units)

    def _peer(self, plan: ParallelPlan, rank: int) -> Analysis:
        """This analysis of another rank of its ``plan``: its run recorded once, its FLOPs counted with this one's
        current handles (set with ``set_op_handle``)."""
        peer = self._peers.get(rank)
        if peer is None:
            spec = self.session.spec
            peer = self._peers[rank] = Analysis(
                self.model, self.inputs, **self._settings, backward=spec.backward, loss_fn=spec.loss_fn,
                execution=spec.execution, cache=self._cache[0], cache_dir=self._cache[1], quiet=True,
                parallel=plan.with_rank(rank))
        peer.flops = self.flops.on_session(peer.session).quiet_view()
        return peer

    def _check_interconnect(self, interconnect: str | Device | Interconnect | None) -> None:
        """Refuse an ``interconnect`` that names none, or one given without a device (its time is not counted)."""
        if interconnect is None:
            return
        if self._time is None:
            raise InvalidValueError("interconnect describes the time on a device: pass device= to analyze with it")
        get_interconnect(interconnect)

    def assumptions(self) -> list[str]:
        """Placeholder values and fallbacks the run needed."""
        return list(self.trace.assumptions)

    @paused
    def result(self, name: str | None = None) -> Result:
        """The structured :class:`~modelmeter.Result` (modules x metrics x operators).

        With the trace cache on, the result is kept beside the trace, keyed by the settings and ``name``: the
        next analysis of the same run with the same settings reads it instead of counting (not when the views'
        handles or ancestor mode were changed: handles are code, which the cache does not keep)."""
        if name is not None and not isinstance(name, str):
            raise InvalidTypeError(f"name must be a string (the model's name in the result) or None, got "
                                   f"{type(name).__name__}")
        settings = self._result_settings(name)
        digest = None if settings is None else self.session.result_digest(settings)
        if digest is not None:
            kept = self.session.kept_result(digest)
            if kept is not None:
                self.flops.log_kept_warnings(kept.unsupported, [row.name for row in kept.modules if not row.called])
                return kept
        result = build_result(self.model, self.metrics, name=name, memory=self.memory, time=self.roofline,
                              parallel=self.rank_costs())
        if digest is not None:
            self.session.keep_result(digest, result)
        return result

    def _result_settings(self, name: str | None) -> dict[str, Any] | None:
        """What :meth:`result` depends on besides the trace — the settings (the device as the one resolved, not a
        name or file that may say something else later) and the name —, or None when formulas of the user's count
        (a view's handles or ancestor mode, :func:`~modelmeter.register_handle`)."""
        if has_registered_handles() or not (self.flops.counts_as_made() and self.activations.counts_as_made()):
            return None
        device = None if self._time is None else self._time.device
        return {**self._settings, "device": device, "name": name or type(self.model).__name__}

    def table(self, max_depth: int = 3, show_param_shapes: bool = True) -> str:
        """fvcore's ``flop_count_table`` with parameters, flops and activations."""
        return flop_count_table(self.flops, max_depth, self.activations, show_param_shapes)

    def __repr__(self) -> str:
        return (f"Analysis({type(self.model).__name__}: {self.flops.total()} flops, "
                f"{self.activations.total()} activations, {self.parameters['']} parameters)")


@paused
def analyze(model: nn.Module, inputs: Any, *, convention: str = "fvcore", dense_attention: bool = False,
            backward: bool = False, loss_fn: LossFn | None = None, execution: Execution = "auto",
            cache: CacheSetting = None, cache_dir: str | os.PathLike[str] | None = None,
            quiet: bool = False, memory: bool = False, optimizer: str | OptimizerSpec | None = None,
            state_dtype: str | torch.dtype | None = None, foreach: bool | None = None,
            attention_kernel: str = "fused", device: str | Device | None = None, efficiency: float = 1.0,
            launch_overhead: float = 0.0, tf32: bool = False, measured_time: float | None = None,
            parallel: str | ParallelPlan | None = None) -> Analysis:
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

    ``device`` (a name from ``modelmeter devices``, or a :class:`~modelmeter.Device`) predicts the time on that
    accelerator by the roofline (docs/roofline.md): every operator takes ``max(FLOPs / peak, bytes / bandwidth)``;
    ``efficiency`` (a fraction of the peaks reached, default 1), ``launch_overhead`` (seconds per kernel, default
    0) and ``tf32`` (float32 products on tensor cores) adjust it; ``measured_time``, the seconds a measured step
    took, gives the MFU and HFU. The result then has the ``bytes``, ``time``, ``intensity`` and
    ``compute_bound`` columns and a ``roofline`` summary.

    ``parallel`` (a plan's text such as ``"dp=2,fsdp=64,tp=8"``, or a :class:`~modelmeter.ParallelPlan`) analyses
    one rank of that plan — ``inputs`` are that rank's batch — on PyTorch's own FSDP2/DTensor machinery over a fake
    process group: its FLOPs, the collectives it issues, its parameter shards (docs/parallel.md).
    ``trace.parallel`` describes the plan and the rank.
    """
    return Analysis(model, inputs, convention=convention, dense_attention=dense_attention, backward=backward,
                    loss_fn=loss_fn, execution=execution, cache=cache, cache_dir=cache_dir, quiet=quiet,
                    memory=memory, optimizer=optimizer, state_dtype=state_dtype, foreach=foreach,
                    attention_kernel=attention_kernel, device=device, efficiency=efficiency,
                    launch_overhead=launch_overhead, tf32=tf32, measured_time=measured_time, parallel=parallel)
