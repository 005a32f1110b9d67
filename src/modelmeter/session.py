"""The session: one run spec, the trace recorded from it once (or read from the disk cache), and what is computed
over that trace — and the :class:`~modelmeter.Result`, built from a trace alone.

The analyses (``FlopCountAnalysis``, ``ActivationCountAnalysis``, ``MemoryAnalysis``) are views over a session:
views that share a session share its one run. :func:`result_from_trace` needs no model at all: every column of
a Result is a pure function of the trace and the settings (convention, optimizer), so a saved trace can be
reported on in a process that never built the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from functools import partial
from typing import Any, NamedTuple, cast

from torch import nn

from ._torch_compat import caller_modes_set_aside
from ._version import __version__
from .cache import StoredTrace, TraceCache, cached_trace, package_digest, stored_entry
from .cache.shared import SHARED, Shared
from .devices import DEVICES, Device, device_from_dict, device_to_dict, get_device
from .engine.gc_pause import no_gc, paused
from .engine.serialize import to_data
from .engine.snapshot import refuse_uninitialised
from .engine.spec import Execution, LossFn, RunSpec
from .engine.trace import PHASES, Trace
from .engine.tracer import record_trace
from .errors import InvalidTypeError, InvalidValueError, check_flag
from .handles.conventions import get_convention
from .handles.fvcore import ACTIVATION_HANDLES
from .metrics.counting import Statistics, count
from .metrics.memory import (
    MemoryModel,
    OptimizerSpec,
    activation_statistics,
    for_plan,
    module_peaks,
    optimizer_spec,
    peak,
    saved_bytes,
)
from .metrics.memory_timeline import memory_timeline
from .metrics.parameters import count_by_module, count_by_prefix
from .metrics.roofline import Roofline, RooflineSettings, roofline
from .reports.result import SCHEMA_VERSION, ModuleRow, Result, check_reportable

__all__ = ["Execution", "LossFn", "RunSpec", "Session", "plain_settings", "result_from_trace"]

logger = logging.getLogger("modelmeter")
CacheSetting = bool | TraceCache | None
TRACER_WARNING_MODES = ("all", "no_tracer_warning", "none")


class Session:
    """One run of a model: its :class:`RunSpec`, the trace recorded from it (once, on first use, or read from the
    disk cache), and what is computed over that trace and shared by every view of it.

    ``trace``: a trace recorded before (of the same model and inputs), used instead of running the model.
    ``cache=True`` (or a ``cache_dir``, or a :class:`modelmeter.cache.TraceCache`) keeps the trace on disk,
    keyed by a fingerprint of the spec (docs/caching.md).
    """

    def __init__(self, spec: RunSpec, *, trace: Trace | None = None, cache: CacheSetting = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        if trace is not None:
            spec.check_trace(trace)
        if cache is not None and not isinstance(cache, (bool, TraceCache)):  # a truthy "no" would turn it on
            raise InvalidTypeError(f"cache must be True, False, None or a TraceCache, got {cache!r:.60}")
        self.spec = spec
        self._trace = trace
        self._cache = cache
        self._cache_dir = cache_dir
        self._from_cache = False
        self._stored: StoredTrace | None = None  # where the disk cache keeps the trace, when it does
        self._tracer_warnings = "no_tracer_warning"
        self._memory: MemoryModel | None = None

    @property
    def model(self) -> nn.Module:
        """The model of the run (``spec.model``)."""
        return self.spec.model

    @property
    def trace(self) -> Trace:
        """The recorded run (plain data), recorded on first use (or read from the cache, when enabled)."""
        if self._trace is None:
            with warnings.catch_warnings():
                if self._tracer_warnings == "none":
                    warnings.simplefilter("ignore")
                self._trace = self._load_or_record()
        return self._trace

    @property
    def recorded(self) -> bool:
        """True once the session has its trace (recorded, read from the cache, or given)."""
        return self._trace is not None

    @property
    def from_cache(self) -> bool:
        """True when the trace was read from the persistent cache instead of running the model."""
        return self._from_cache

    @property
    def tracer_warnings_mode(self) -> str:
        """What happens to warnings the model raises while it runs (see :meth:`tracer_warnings`)."""
        return self._tracer_warnings

    def tracer_warnings(self, mode: str) -> Session:
        """``"all"`` or ``"no_tracer_warning"`` keep warnings the model raises while it runs; ``"none"`` hides
        them."""
        if mode not in TRACER_WARNING_MODES:
            raise InvalidValueError(f"Unrecognized tracer warning mode {mode}.")
        self._tracer_warnings = mode
        return self

    def with_spec(self, spec: RunSpec) -> Session:
        """A new session of ``spec`` with this one's cache settings and tracer warning mode (nothing recorded)."""
        other = Session(spec, cache=self._cache, cache_dir=self._cache_dir)
        other._tracer_warnings = self._tracer_warnings
        return other

    def memory_model(self) -> MemoryModel:
        """Live bytes of the trace, event by event (made once per session)."""
        trace = self.trace
        if self._memory is None or self._memory.trace is not trace:
            self._memory = MemoryModel(trace)
        return self._memory

    def parameters(self) -> defaultdict[str, int]:
        """Parameter elements under every name prefix (``""`` is the total), from the trace's module table."""
        return count_by_prefix(self.trace.modules)

    @paused
    def _load_or_record(self) -> Trace:
        """The trace another analysis of this call recorded in the same state (:mod:`modelmeter.cache.shared`),
        else the disk cache's, else a new recording."""
        def record() -> Trace:
            if self.spec.parallel is None:
                return record_trace(self.spec)
            from .parallel.runner import record_parallel  # imports torch.distributed: only for a plan

            return record_parallel(self.spec)

        store = self._trace_cache()

        def load_or_record() -> Trace:
            if store is None:
                return record()
            trace, self._from_cache, self._stored = cached_trace(store, self.spec, record)
            return trace

        try:
            with caller_modes_set_aside():  # the caller's modes see none of the analysis, and change none of it
                shared = SHARED.share(self.spec, load_or_record)
        except ValueError as exc:  # torch refuses to touch an uninitialised parameter; say which and why
            refuse_uninitialised(self.spec.model, exc)
            raise
        if store is not None:
            self._stored = self._kept_in(store, shared)
        return shared.trace

    def _kept_in(self, store: TraceCache, shared: Shared) -> StoredTrace | None:
        """Where ``store`` keeps the trace ``shared`` (None where it does not), so that results are kept beside it
        whichever analysis of the call recorded it: what this session found, or another analysis sharing the
        trace, or else the entry of its key in ``store``, if there is one."""
        if shared.recorded:
            shared.kept[store.path] = self._stored
        elif store.path not in shared.kept:
            shared.kept[store.path] = stored_entry(store, self.spec)
        return cast(StoredTrace | None, shared.kept[store.path])

    def kept_result(self, digest: str) -> Result | None:
        """The Result kept in the disk cache beside this session's trace under ``digest`` (of
        :meth:`result_digest`), as a new object; None when none is kept, or it cannot be read (then with a
        WARNING)."""
        if self._stored is None:
            return None
        data = self._stored.load_result(digest)
        if data is None:
            return None
        try:
            return _result_of(data)
        except (TypeError, ValueError) as exc:
            logger.warning("Ignoring a result kept in the trace cache that cannot be read (%s); counting again.", exc)
            return None

    def keep_result(self, digest: str, result: Result) -> None:
        """Keep ``result``, counted from this session's trace with the settings of ``digest``, beside the trace in
        the disk cache, so that the next analysis of the same run and settings does not count."""
        if self._stored is not None:
            self._stored.store_result(digest, _result_data(result))

    def result_digest(self, settings: Mapping[str, Any]) -> str | None:
        """What a result of ``settings`` is kept under: the settings, the trace's fields that its user may change
        in place (the command adds its loader's assumptions), the result schema, modelmeter's version and the
        digest of its source. None without a trace kept in the cache, or for settings that are not data."""
        if self._stored is None or self._trace is None:
            return None
        trace = self._trace
        described = {"settings": plain_settings(settings), "assumptions": trace.assumptions, "model": trace.model,
                     "execution": trace.execution,
                     "sizes": [trace.size("events"), trace.size("storages"), len(trace.modules)],  # counted, not made
                     "schema": SCHEMA_VERSION, "modelmeter": __version__,
                     "source": package_digest(self._stored.cache.path)}
        try:
            text = json.dumps(to_data(described), separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            logger.info("Not keeping the result in the cache: its settings are not plain data (%s).", exc)
            return None
        return hashlib.sha256(text.encode()).hexdigest()

    def _trace_cache(self) -> TraceCache | None:
        if isinstance(self._cache, TraceCache):
            return self._cache
        if self._cache is False or (self._cache is None and self._cache_dir is None):
            return None
        try:
            return TraceCache(self._cache_dir)
        except OSError as exc:
            logger.warning("The trace cache is unavailable (%s); running the model without it.", exc)
            return None


# warnings ----------------------------------------------------------------------------------------
def log_statistics(trace: Trace, stats: Statistics, *, unsupported: bool = True, uncalled: bool = True) -> None:
    """Log (WARNING) the operators no handle counted and the modules with a ``forward`` that never ran."""
    log_warnings(trace, stats.unsupported.get("", Counter()), stats.uncalled if uncalled else (),
                 unsupported=unsupported, uncalled=uncalled)


def log_warnings(trace: Trace, unsupported_ops: Mapping[str, int], uncalled_modules: Collection[str], *,
                 unsupported: bool = True, uncalled: bool = True) -> None:
    """:func:`log_statistics` of the whole model's ``unsupported_ops`` (operator -> calls) and the
    ``uncalled_modules`` (canonical names)."""
    if unsupported:
        for op, freq in unsupported_ops.items():
            logger.warning("Unsupported operator %s encountered %d time(s)", op, freq)
    if uncalled:
        table = trace.module_table()
        names = sorted(n for n in uncalled_modules if table[n].has_forward)
        if names:
            logger.warning(
                "The following submodules of the model were never called during the trace of the graph. "
                "They may be unused, or they were accessed by direct calls to .forward() or via other "
                "python methods. In the latter case they will have zeros for statistics, though their "
                "statistics will still contribute to their parent calling module.\n%s", ", ".join(names))


# memory ------------------------------------------------------------------------------------------
def memory_optimizer(training: bool, optimizer: str | OptimizerSpec | None, state_dtype: Any,
                     foreach: bool | None, *, switch: str = "training=True") -> OptimizerSpec | None:
    """The optimizer a memory analysis models, its options checked (``state_dtype`` may be a ``torch.dtype``);
    ``switch`` names what makes the run a training step, for the caller's error."""
    if optimizer is not None and not training:
        raise InvalidValueError(f"optimizer is part of a training step: pass {switch} with it")
    if (state_dtype is not None or foreach is not None) and optimizer is None:
        raise InvalidValueError("state_dtype and foreach describe the optimizer: pass optimizer= with them")
    if optimizer is None:
        return None
    return optimizer_spec(optimizer, state_dtype=None if state_dtype is None else str(state_dtype), foreach=foreach)


@dataclass(frozen=True)
class MemoryColumns:
    """What the memory analysis adds to a Result: saved-for-backward bytes by module and operator, each module's
    peak, and the summary (``Result.memory``, with the downsampled timeline the HTML report draws)."""

    training: bool
    saved: Mapping[str, Mapping[str, int]]
    peaks: Counter[str]
    summary: dict[str, Any]


def memory_columns(model: MemoryModel, spec: OptimizerSpec | None) -> MemoryColumns:
    """The memory columns of a trace (a training step when it has a backward pass) with optimizer ``spec``."""
    training = model.trace.backward
    saved = saved_bytes(model)
    top = peak(model, spec)
    summary = {"peak": top.bytes, "phase": top.at.phase, "module": top.at.module, "operator": top.at.operator,
               "by_kind": dict(top.by_kind), "training": training,
               "optimizer": None if spec is None else {"name": spec.name, "state_dtype": spec.state_dtype,
                                                       "foreach": spec.foreach},
               "saved_bytes": sum(saved.get("", Counter()).values()), "timeline": memory_timeline(model, spec)}
    return MemoryColumns(training, saved, module_peaks(model, spec), summary)


# the result --------------------------------------------------------------------------------------
class Counted(NamedTuple):
    """One counted metric of a Result: its statistics and the phases it counts that the run has."""

    stats: Statistics
    phases: Sequence[str]


def counted_phases(trace: Trace, counts: Sequence[str]) -> list[str]:
    """The phases of ``counts`` (the phases a metric counts) that the run has events of, in run order."""
    return [phase for phase in trace.phases() if phase in counts]


def assemble_result(trace: Trace, metrics: Mapping[str, Counted], *, name: str | None = None,
                    convention: str = "fvcore", memory: MemoryColumns | None = None,
                    time: Roofline | None = None, parallel: dict[str, Any] | None = None) -> Result:
    """The Result of ``metrics`` (metric name -> statistics over ``trace``; the first gives the unsupported
    operators and the uncalled modules), with rows from the trace's module table and, with ``memory``, the
    memory columns, with ``time`` the roofline's, with ``parallel`` the per-rank costs (``RankCosts.to_dict()``).
    A metric counted over several phases is followed by one column per phase."""
    if not metrics:
        raise InvalidValueError("a result needs at least one metric, e.g. the flops")
    with no_gc():
        result = _assemble(trace, metrics, name, convention, memory, time)
    result.parallel = parallel
    check_reportable(result)
    return result


def _with_phases(per_metric: dict[str, Mapping[str, Mapping[str, Any]]], metric: str, counted: Counted) -> None:
    """Add ``metric``'s column and, after a backward pass, one column per phase."""
    stats, phases = counted
    per_metric[metric] = stats.counts
    if len(phases) > 1:
        for phase in phases:
            per_metric[f"{phase}_{metric}"] = stats.by_phase.get(phase, {})


def _ratio(numerator: Mapping[str, Any], denominator: Mapping[str, Any]) -> tuple[float, dict[str, float]]:
    """A module's ratio of two metrics, in all and per operator (0 where the denominator is 0)."""
    per_op = {op: numerator.get(op, 0) / value for op, value in denominator.items() if value}
    below = sum(denominator.values())
    return (sum(numerator.values()) / below if below else 0.0), per_op


def _assemble(trace: Trace, metrics: Mapping[str, Counted], name: str | None, convention: str,
              memory: MemoryColumns | None, time: Roofline | None) -> Result:
    per_metric: dict[str, Mapping[str, Mapping[str, Any]]] = {}
    for metric, counted in metrics.items():
        _with_phases(per_metric, metric, counted)
    peaks: Counter[str] = Counter()
    if memory is not None:
        if memory.training:
            per_metric["saved_bytes"] = memory.saved
        peaks = memory.peaks
    columns = list(per_metric) + (["peak_memory"] if memory is not None else [])
    ratios: dict[str, tuple[Statistics, Statistics]] = {}
    if time is not None:
        traffic: dict[str, Mapping[str, Mapping[str, Any]]] = {}
        for metric, stats in (("bytes", time.bytes), ("time", time.time)):
            _with_phases(traffic, metric, Counted(stats, time.phases))
        per_metric.update(traffic)
        ratios = {"intensity": (time.flops, time.bytes), "compute_bound": (time.compute_bound_time, time.time)}
        columns += [*traffic, *ratios]
    first = next(iter(metrics.values())).stats
    empty: dict[str, Any] = {}
    rows = _rows(trace, list(per_metric.items()), first.uncalled, peaks if memory is not None else None)
    for metric, (numerator, denominator) in ratios.items():
        for row in rows:
            row.metrics[metric], row.by_operator[metric] = _ratio(numerator.counts.get(row.name, empty),
                                                                  denominator.counts.get(row.name, empty))
    return Result(
        model=name or trace.model,
        inputs=[{"shape": list(t.shape), "dtype": t.dtype} for t in trace.inputs],
        metrics=columns,
        modules=rows,
        convention=convention,
        execution=trace.execution,
        device=_counted_on(trace),
        unsupported=dict(first.unsupported.get("", empty)),
        assumptions=list(trace.assumptions),
        dtypes={metric: dict(stats.dtypes.get("", empty)) for metric, (stats, _) in metrics.items()},
        memory=memory.summary if memory is not None else {},
        roofline=time.summary if time is not None else {},
    )


def _rows(trace: Trace, tables: list[tuple[str, Mapping[str, Mapping[str, Any]]]], uncalled: Collection[str],
          peaks: Mapping[str, int] | None) -> list[ModuleRow]:
    """One row per module of the trace's table: its total and per-operator copy of every column of ``tables``
    (0 and ``{}`` where the column has no counts of it: a row owns its dicts, the statistics stay the views'),
    then its ``peak_memory`` when ``peaks`` are given (one loop: a result has a row per module)."""
    params = count_by_module(trace.modules)
    shapes_of = trace.output_shapes
    rows: list[ModuleRow] = []
    append = rows.append
    for info in trace.modules:
        module = info.name
        values: dict[str, Any] = {}
        by_operator: dict[str, dict[str, Any]] = {}
        for metric, table in tables:
            ops = table.get(module)
            if ops:
                own = by_operator[metric] = dict(ops)
                values[metric] = sum(own.values())
            else:
                by_operator[metric] = {}
                values[metric] = 0
        if peaks is not None:
            values["peak_memory"] = peaks.get(module, 0)
        shapes = shapes_of.get(module)
        append(ModuleRow(module, info.type, params.get(module, 0), values, by_operator, module not in uncalled,
                         dict(shapes) if shapes else {}))
    return rows


def _counted_on(trace: Trace) -> str:
    """The devices the model's parameters, buffers and inputs were on during the run, in order of first sight."""
    devices = {s.device: None for s in trace.storages if s.kind in ("parameter", "buffer", "input")}
    return ", ".join(devices)


def result_from_trace(trace: Trace, *, name: str | None = None, convention: str = "fvcore",
                      dense_attention: bool = False, attention_kernel: str = "fused", memory: bool = False,
                      optimizer: str | OptimizerSpec | None = None, state_dtype: str | None = None,
                      foreach: bool | None = None, quiet: bool = True, device: str | Device | None = None,
                      efficiency: float = 1.0, launch_overhead: float = 0.0, tf32: bool = False,
                      measured_time: float | None = None) -> Result:
    """The :class:`~modelmeter.Result` of a recorded run, from the trace alone (no model): what
    ``analyze(model, inputs, <the same options>).result(name)`` gives for the run the trace records.

    ``convention``, ``dense_attention`` and ``attention_kernel`` choose what the FLOPs count; ``memory=True``
    adds the memory columns (of a training step when the trace has a backward pass, with ``optimizer``,
    ``state_dtype`` and ``foreach`` as for :class:`~modelmeter.MemoryAnalysis`). ``device`` adds the roofline's
    bytes, time, intensity and bound on that device, with ``efficiency``, ``launch_overhead``, ``tf32`` and
    ``measured_time`` as for :func:`~modelmeter.analyze`. ``quiet=False`` logs the unsupported operators and the
    modules that never ran, as an analysis does. ``name`` defaults to the model's class name (``trace.model``).
    """
    if not isinstance(trace, Trace):
        raise InvalidTypeError(f"trace must be a modelmeter Trace (an analysis's .trace, load_trace), got "
                               f"{type(trace).__name__}")
    if name is not None and not isinstance(name, str):
        raise InvalidTypeError(f"name must be a string or None, got {type(name).__name__}")
    check_flag("memory", memory)
    check_flag("quiet", quiet)
    time = roofline_settings(device, efficiency=efficiency, launch_overhead=launch_overhead, tf32=tf32,
                             measured_time=measured_time)
    if not memory and (optimizer is not None or state_dtype is not None or foreach is not None):
        raise InvalidValueError("optimizer, state_dtype and foreach are memory options: pass memory=True with them")
    spec = for_plan(memory_optimizer(trace.backward, optimizer, state_dtype, foreach,
                                     switch="a trace recorded with backward=True"), trace) if memory else None
    chosen = get_convention(convention, dense_attention=dense_attention, attention_kernel=attention_kernel)
    flops = count(trace, chosen.handles, elementwise=chosen.elementwise)
    if not quiet:
        log_statistics(trace, flops)
    activations = count(trace, ACTIVATION_HANDLES, phases=("forward",))
    metrics = {"flops": Counted(flops, counted_phases(trace, PHASES)),
               "activations": Counted(activations, counted_phases(trace, ("forward",)))}
    columns = None
    model = MemoryModel(trace) if memory else None
    if model is not None:
        metrics["activation_bytes"] = Counted(activation_statistics(model), counted_phases(trace, ("forward",)))
        columns = memory_columns(model, spec)
    predicted = None
    if time is not None:
        predicted = roofline(trace, time, attention_kernel=attention_kernel, dense_attention=dense_attention,
                             optimizer=spec)
    parallel = None
    if trace.parallel is not None:
        from .parallel.pipeline import flop_units  # imports the pipeline: only for a parallel run
        from .parallel.summary import rank_costs

        by_phase = {phase: sum(table.get("", {}).values()) for phase, table in flops.by_phase.items()}
        parallel = rank_costs(trace, convention=chosen.name, flops=by_phase, memory=model, optimizer=spec, time=time,
                              compute=None if predicted is None else predicted.summary["time"],
                              count_units=partial(flop_units, trace, chosen)).to_dict()
    return assemble_result(trace, metrics, name=name, convention=chosen.name, memory=columns, time=predicted,
                           parallel=parallel)


def plain_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` (an analysis's) as JSON data: an OptimizerSpec as its fields, a ``torch.dtype`` as its name, a
    device as its name when it is the catalog's, else as its fields."""
    out = dict(settings)
    device = out.get("device")
    if isinstance(device, Device):
        out["device"] = device.name if DEVICES.get(device.name) == device else device_to_dict(device)
    if isinstance(out.get("optimizer"), OptimizerSpec):
        out["optimizer"] = asdict(out["optimizer"])
    if out.get("state_dtype") is not None:
        out["state_dtype"] = str(out["state_dtype"]).removeprefix("torch.")
    return out


# a Result kept in the cache ----------------------------------------------------------------------
# The fields of a Result and of its rows with their types, checked on reading (a field added to either class and not
# here makes a kept result unreadable: it is counted again, never read without it).
_ROW_TYPES = {"name": str, "type": str, "params": int, "metrics": dict, "by_operator": dict, "called": bool,
              "output_shapes": dict}
_RESULT_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "model": str, "inputs": list, "metrics": list, "modules": list, "convention": str, "execution": str,
    "device": str, "unsupported": dict, "assumptions": list, "dtypes": dict, "memory": dict, "roofline": dict,
    "parallel": (dict, type(None)), "schema_version": int}


def _result_data(result: Result) -> dict[str, Any]:
    """``result`` as data :func:`~modelmeter.engine.serialize.to_data` writes exactly (rows as dicts of fields)."""
    data = {f.name: getattr(result, f.name) for f in fields(Result)}
    data["modules"] = [{f.name: getattr(row, f.name) for f in fields(ModuleRow)} for row in result.modules]
    return data


def _result_of(data: Any) -> Result:
    """The Result :func:`_result_data` described; ValueError for data of another shape."""
    _check_fields(data, _RESULT_FIELD_TYPES, "result")
    if not all(type(row) is dict and row.keys() == _ROW_TYPES.keys() for row in data["modules"]):
        raise InvalidValueError("a result row of other fields")
    for name, kind in _ROW_TYPES.items():  # one field of every row at a time: a row is a thousand in a large model
        if not all(type(row[name]) is kind for row in data["modules"]):
            raise InvalidValueError(f"a result row whose {name} is not a {kind.__name__}")
    return Result(**{**data, "modules": [ModuleRow(**row) for row in data["modules"]]})


def _check_fields(data: Any, types: Mapping[str, type | tuple[type, ...]], what: str) -> None:
    if type(data) is not dict or data.keys() != types.keys() \
            or not all(type(data[name]) in _as_tuple(kind) for name, kind in types.items()):
        raise InvalidValueError(f"a {what} of other fields or types")


def _as_tuple(kinds: type | tuple[type, ...]) -> tuple[type, ...]:
    return kinds if isinstance(kinds, tuple) else (kinds,)


# time --------------------------------------------------------------------------------------------
def roofline_settings(device: str | Device | Mapping[str, Any] | None, *, efficiency: float = 1.0,
                      launch_overhead: float = 0.0, tf32: bool = False,
                      measured_time: float | None = None) -> RooflineSettings | None:
    """The roofline's settings, checked; None without a ``device`` (a name in the catalog, a :class:`Device`, or
    a device's fields as a saved trace keeps a user's device). A ValueError names the option that is wrong."""
    if device is None:
        if (efficiency, launch_overhead, tf32, measured_time) != (1.0, 0.0, False, None):
            raise InvalidValueError("efficiency, launch_overhead, tf32 and measured_time describe the time on a "
                                    "device: pass device= with them (e.g. device='h100')")
        return None
    if isinstance(device, str):
        device = get_device(device)
    elif isinstance(device, Mapping):
        device = device_from_dict(device)
    elif not isinstance(device, Device):
        raise InvalidTypeError(f"device must be a device name (see `modelmeter devices`) or a Device, got "
                               f"{type(device).__name__}")
    return RooflineSettings(device, efficiency=efficiency, launch_overhead=launch_overhead, tf32=tf32,
                            measured_time=measured_time)  # which checks its options
