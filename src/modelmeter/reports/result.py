"""The structured result every renderer reads: module tree x metrics x operators, with totals.

Built by the session layer from a trace (``modelmeter.session.result_from_trace``, ``Analysis.result()``);
plain data, so it serialises to JSON (a documented, versioned schema, see docs/reports.md) and back without a
model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import InvalidNameError, InvalidTypeError, InvalidValueError
from . import jsontext
from .summaries import MAX_NUMBER, check_summaries, shown

SCHEMA_VERSION = 1
# Metrics in bytes (rendered in binary units); "peak_memory" is a module's peak, not a sum over its children.
MEMORY_METRICS = frozenset({"activation_bytes", "saved_bytes", "peak_memory"})  # the memory analysis's
# The roofline's metrics: they come with a device (bytes moved, seconds, and the two ratios below).
TRAFFIC_METRICS = frozenset({"bytes", "forward_bytes", "backward_bytes", "recompute_bytes", "optimizer_bytes"})
BYTE_METRICS = MEMORY_METRICS | TRAFFIC_METRICS
# Metrics in seconds: the roofline time on a device, in all and per phase.
TIME_METRICS = frozenset({"time", "forward_time", "backward_time", "recompute_time", "optimizer_time"})
# Ratios of two sums (FLOPs per byte; the share of the time spent in compute-bound operators): a module's ratio is
# its own, not the sum of its children's, and has no share of the model's.
RATIO_METRICS = frozenset({"intensity", "compute_bound"})
NOT_ADDITIVE = frozenset({"peak_memory"}) | RATIO_METRICS
ROOFLINE_METRICS = TRAFFIC_METRICS | TIME_METRICS | RATIO_METRICS
# Every metric a result of modelmeter's analyses may have: asked of one that lacks it, its total is 0.
KNOWN_METRICS = (frozenset({"flops", "activations", "forward_flops", "backward_flops", "recompute_flops"})
                 | MEMORY_METRICS | ROOFLINE_METRICS)


@dataclass
class ModuleRow:
    """One module: its canonical name (``""`` is the model), class, parameters and metric values.

    ``metrics`` maps a metric name (``"flops"``, ``"activations"``; after a backward pass also
    ``"forward_flops"``, ``"backward_flops"`` and, with activation checkpointing, ``"recompute_flops"``; with
    the memory analysis ``"activation_bytes"``, ``"peak_memory"`` — the most bytes live while the module ran —
    and for a training step ``"saved_bytes"``; on a device, the roofline's ``"bytes"`` moved and ``"time"`` in
    seconds (each also per phase after a backward pass), ``"intensity"`` — FLOPs per byte — and
    ``"compute_bound"`` — the share of the module's time in compute-bound operators) to the module's total;
    ``by_operator`` maps the same names to per-operator values (none for ``peak_memory``).
    ``called`` is False for a module that never ran (its metrics are then 0). ``output_shapes`` maps each shape its
    forward calls returned (``"1x64x56x56"``; several tensors ``"2x5x8, 1x2x8"``) to how many calls returned it, in
    the order first seen (``{}`` for a module that returned no tensor, or a result saved before it was recorded).
    """

    name: str
    type: str
    params: int
    metrics: dict[str, float] = field(default_factory=dict)
    by_operator: dict[str, dict[str, float]] = field(default_factory=dict)
    called: bool = True
    output_shapes: dict[str, int] = field(default_factory=dict)

    @property
    def depth(self) -> int:
        """0 for the model, 1 for its children, ..."""
        return 0 if not self.name else self.name.count(".") + 1


@dataclass
class Result:
    """What a model costs, by module and operator, for one set of inputs.

    ``convention`` is the FLOP counting convention; ``dtypes`` maps each metric to the model's total by the
    dtype the work was done in (``{"flops": {"bfloat16": ...}}``). ``memory`` summarises the memory analysis
    when there was one: ``peak`` bytes, where it happened (``phase``, ``module``, ``operator``), the live
    bytes at the peak ``by_kind``, ``training``, ``optimizer``, ``saved_bytes`` and the ``timeline`` (live bytes
    by kind over the run, at most 1000 points, the peak kept; docs/memory.md). ``roofline`` summarises the
    predicted time on a device when one was chosen (``{}`` otherwise): the ``device`` (``label``, ``bandwidth``,
    ``peak``, ``vector_peak``, ``ridge``), ``dtype``, ``time`` per phase, ``predicted_mfu``, ``mfu``/``hfu`` of a
    measured time, ``throughput`` of ``items`` and the ``operators`` (flops, bytes, time, bound) by dtype.
    ``device`` is where the model's parameters, buffers and inputs were counted (``"cpu"``, ``"meta"``,
    ``"cuda:0"`` for a model that puts its tensors on CUDA, faked where no GPU is; several joined by ``", "``).
    ``parallel`` is the per-rank cost of a parallel plan (None for a run on one device): ``plan``, ``world_size``,
    ``mesh``, ``micro_batches``, ``per``, ``ranks`` (ranks of equal cost folded) and ``pipeline``; docs/parallel.md,
    "Per-rank summary".
    """

    model: str
    inputs: list[dict[str, Any]]
    metrics: list[str]
    modules: list[ModuleRow]
    convention: str = "fvcore"
    execution: str = "fake"
    device: str = ""
    unsupported: dict[str, int] = field(default_factory=dict)
    assumptions: list[str] = field(default_factory=list)
    dtypes: dict[str, dict[str, float]] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    roofline: dict[str, Any] = field(default_factory=dict)
    parallel: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def root(self) -> ModuleRow:
        return self.modules[0]

    def total(self, metric: str) -> float:
        """The model's total of ``metric``: 0 for a metric of modelmeter's that this result was not counted with
        (``"time"`` without a device); ``KeyError`` for a name that is no metric (a typo, ``"params"``: that is
        ``root.params``)."""
        if not isinstance(metric, str) or (metric not in self.metrics and metric not in KNOWN_METRICS):
            raise InvalidNameError(f"no metric {metric!r:.60} in the result; its metrics: {', '.join(self.metrics)}")
        return self.root.metrics.get(metric, 0)

    def row(self, name: str) -> ModuleRow:
        for module in self.modules:
            if module.name == name:
                return module
        raise InvalidNameError(f"no module named {name!r} in the result")

    def share(self, name: str, metric: str) -> float:
        """A module's fraction of the model's total (0 when the total is 0)."""
        total = self.total(metric)
        return self.row(name).metrics.get(metric, 0) / total if total else 0.0

    def children(self, name: str) -> list[ModuleRow]:
        prefix = f"{name}." if name else ""
        depth = self.row(name).depth + 1
        return [m for m in self.modules if m.name.startswith(prefix) and m.depth == depth and m.name != name]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | str | None = 2) -> str:
        """Strict JSON: a cost that is not a finite number (a user handle's NaN) is written as ``null``."""
        if isinstance(indent, str):  # the string each level is indented with, as json.dumps takes it ("\t")
            if indent.strip():
                raise InvalidValueError(f"indent must be whitespace, a number of spaces or None, got {indent!r:.40}")
        elif indent is not None and (isinstance(indent, bool) or not isinstance(indent, int) or indent < 0):
            raise InvalidValueError(f"indent must be a number of spaces from 0 or None, got {indent!r:.40}")
        return jsontext.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        """The Result :meth:`to_dict` wrote. Strict, since what it reads is printed as it is: ``ValueError`` for
        another ``schema_version``, a field of the wrong type, a first row that is not the model's or a cost (a
        row's ``params``, metric or operator value) that is not a number from 0 to :data:`~.summaries.MAX_NUMBER`;
        ``TypeError`` for a field it does not know or a required one missing."""
        if type(data) is not dict:
            raise InvalidValueError(f"a result is a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if type(version) is not int or version != SCHEMA_VERSION:
            raise InvalidValueError(f"unsupported result schema_version {version!r:.40}; this modelmeter reads "
                                    f"{SCHEMA_VERSION}")
        _check_types(data, _FIELD_TYPES, "the result")
        if not all(type(metric) is str for metric in data.get("metrics", [])):
            raise InvalidValueError("the result's metrics are not names")
        _check_notes(data)
        check_summaries(data)
        rows = [_row_from_dict(row) for row in data.get("modules", [])]
        if not rows or rows[0].name:
            raise InvalidValueError("the result's first module row must be the model's (name '')")
        return cls(**{**data, "modules": rows})

    @classmethod
    def from_json(cls, text: str) -> Result:
        """:meth:`from_dict` of JSON text; ``ValueError`` for JSON that is invalid, holds NaN or Infinity or is
        nested too deeply to parse."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise InvalidTypeError(f"a result's JSON is text, got {type(text).__name__}")
        try:
            data = jsontext.loads(text, "a result")
        except RecursionError:
            raise InvalidValueError("the result's JSON is nested too deeply") from None
        return cls.from_dict(data)


def check_reportable(result: Result) -> None:
    """Refuse a result just made that its own JSON could not be read back from: :meth:`Result.from_dict`'s checks
    of the JSON :meth:`Result.to_json` writes, on every part a report prints but the rows below the model's (its
    costs bound theirs: they are sums of parts >= 0). A cost over :data:`~.summaries.MAX_NUMBER` (shapes no real
    model has, a handle's absurd count) or a summary's time under ``MIN_POSITIVE`` is an InvalidValueError here,
    where it is made, not a file that ``modelmeter report`` and ``load_trace`` refuse later."""
    data = {f.name: getattr(result, f.name) for f in fields(Result) if f.name != "modules"}
    data["memory"] = {name: value for name, value in result.memory.items() if name in _MEMORY_TYPES}
    data["modules"] = [asdict(result.root)]
    try:
        Result.from_dict(jsontext.loads(jsontext.dumps(data), "a result"))
    except ValueError as exc:
        raise InvalidValueError(f"this run's result cannot be reported or saved: {exc}") from None


# The types of a Result's fields and of its rows', as JSON holds them.
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "inputs": (list,), "metrics": (list,), "modules": (list,), "convention": (str,),
    "execution": (str,), "device": (str,), "unsupported": (dict,), "assumptions": (list,), "dtypes": (dict,),
    "memory": (dict,), "roofline": (dict,), "parallel": (dict, type(None)), "schema_version": (int,)}
_ROW_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "type": (str,), "params": (int,), "metrics": (dict,), "by_operator": (dict,), "called": (bool,),
    "output_shapes": (dict,)}


def _check_notes(data: dict[str, Any]) -> None:
    """The result's flat fields that every report prints, each as :meth:`Result.to_dict` writes it: the inputs
    objects, the assumptions text, the unsupported operators' calls and the totals by dtype costs."""
    if not all(type(spec) is dict for spec in data.get("inputs", [])):
        raise InvalidValueError("the result's inputs are not objects")
    if not all(type(text) is str for text in data.get("assumptions", [])):
        raise InvalidValueError("the result's assumptions are not text")
    if not all(type(calls) is int and calls >= 0 for calls in data.get("unsupported", {}).values()):
        raise InvalidValueError("the result's unsupported operators' calls are not counts")
    for metric, by_dtype in data.get("dtypes", {}).items():
        if type(by_dtype) is not dict:
            raise InvalidValueError(f"the result's dtypes of {metric!r:.80} are not an object")
        _check_costs(by_dtype, f"the result's dtypes of {metric!r:.80}")
    memory = data.get("memory")
    if memory:  # the peak's line, which every report prints
        _check_types(memory, _MEMORY_TYPES, "the result's memory", known_only=False)
        if "peak" not in memory:
            raise InvalidValueError("the result's memory lacks its peak")
        costs = {name: memory[name] for name in ("peak", "saved_bytes") if name in memory}
        _check_costs({**memory.get("by_kind", {}), **costs}, "the result's memory")


# The types of the memory summary's fields the reports read (all but the peak optional: a file of an older
# modelmeter may lack one; the timeline is drawn only by the HTML page).
_MEMORY_TYPES: dict[str, tuple[type, ...]] = {
    "peak": (int, float), "phase": (str,), "module": (str,), "operator": (str,), "by_kind": (dict,),
    "training": (bool,), "optimizer": (dict, type(None)), "saved_bytes": (int, float)}


def _check_types(data: dict[str, Any], types: dict[str, tuple[type, ...]], what: str, known_only: bool = True) -> None:
    """Each field of ``data`` that ``types`` names is of one of its types (a missing one is left to the caller);
    ``known_only``: a field ``types`` does not name is a ``TypeError``."""
    unknown = sorted(set(data) - set(types))
    if unknown and known_only:
        raise InvalidTypeError(f"{what} has unknown fields: {', '.join(map(repr, unknown))}"[:200])
    for name, kinds in types.items():
        if name in data and type(data[name]) not in kinds:
            raise InvalidValueError(f"{what}: {name} is a {type(data[name]).__name__}, not a {kinds[0].__name__}")


def _row_from_dict(row: Any) -> ModuleRow:
    if type(row) is not dict:
        raise InvalidValueError(f"a module row of the result is a {type(row).__name__}, not an object")
    where = f"module {row.get('name')!r:.80} of the result"
    _check_types(row, _ROW_TYPES, where)
    _check_costs({"params": row.get("params", 0), **row.get("metrics", {})}, where)
    for operator, values in row.get("by_operator", {}).items():
        if type(values) is not dict:
            raise InvalidValueError(f"{where}: by_operator {operator!r:.80} is not an object")
        _check_costs(values, f"{where}, by_operator {operator!r:.80}")
    if not all(type(n) is int and n > 0 for n in row.get("output_shapes", {}).values()):
        raise InvalidValueError(f"{where}: output_shapes holds a count that is not a positive integer")
    by_operator = {operator: _nulls_as_nan(values) for operator, values in row.get("by_operator", {}).items()}
    return ModuleRow(**{**row, "metrics": _nulls_as_nan(row.get("metrics", {})), "by_operator": by_operator})


def _nulls_as_nan(values: dict[str, Any]) -> dict[str, Any]:
    """A row's costs with each ``null`` (what :meth:`Result.to_json` writes for a non-finite one) as NaN."""
    return {name: math.nan if value is None else value for name, value in values.items()}


def _check_costs(values: dict[str, Any], where: str) -> None:
    """Every value of ``values`` a number (not a boolean) from 0 to :data:`~.summaries.MAX_NUMBER`, or ``null`` (a
    cost that was not a finite number, as :meth:`Result.to_json` writes it)."""
    for name, value in values.items():
        if value is None:
            continue
        if type(value) not in (int, float) or not 0 <= value <= MAX_NUMBER:  # NaN fails both comparisons
            raise InvalidValueError(f"{where}: {name} is {shown(value)}, not a number from 0 to {MAX_NUMBER:g}")
