"""Baselines: a file of models' costs, module by module, and the comparison that says which block grew.

The file is JSON, stable across machines (no timings, no paths), and holds several models, each keyed by a
name (the command uses the model spec)::

    {"format": "modelmeter-baseline", "schema_version": 1, "modelmeter": "0.1.0", "torch": "2.14.1",
     "models": {"resnet50": {"spec": ["resnet50"], "inputs": [{"shape": [1, 3, 224, 224], "dtype": "float32"}],
                             "convention": "fvcore", "backward": false, "model": "ResNet",
                             "modules": {"": {"params": 25557032, "flops": 4111512576, ...}, "layer1": {...}}}}}

A comparison refuses to compare runs that are not comparable — other inputs, convention or passes — and
reports, per metric and module, what grew beyond the tolerance (a failure) and what shrank (a note).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction
from typing import Any

import torch

from .. import _version
from ..errors import ModelMeterError
from ..io import file_lock, get_cache_dir
from ..io.atomic import atomic_write
from ..io.cache_dir import directory_lock
from ..reports.render import format_change
from ..reports.result import RATIO_METRICS, Result
from .budget import missing_metrics_hint
from .values import (
    MAX_AMOUNT,
    GuardFileError,
    check_amount,
    check_name,
    check_tolerance,
    percent,
    read_json,
    shorten,
    with_exact,
)

FORMAT = "modelmeter-baseline"
SCHEMA_VERSION = 1


class BaselineMismatch(ModelMeterError):
    """The current run cannot be compared with the baseline: other inputs, convention or passes."""


@dataclass
class Entry:
    """One model's costs: what was run (spec, inputs, convention, backward) and every module's metrics."""

    model: str
    inputs: list[dict[str, Any]]
    convention: str
    backward: bool
    modules: dict[str, dict[str, float]]
    spec: list[str] = field(default_factory=list)
    # The device the time was predicted on and the roofline's settings ({} without a device): a time is only
    # comparable with a time on the same device.
    roofline: dict[str, Any] = field(default_factory=dict)

    def total(self, metric: str) -> float:
        return self.modules.get("", {}).get(metric, 0)


def entry_from_result(result: Result, *, spec: list[str] | None = None) -> Entry:
    """The baseline entry of an analysed model (``spec``: how the command builds it again, if it does)."""
    backward = any(m.startswith("backward_") for m in result.metrics)
    costs = [m for m in result.metrics if m not in RATIO_METRICS]  # a ratio is no cost that can grow
    modules = {row.name: {"params": row.params, **{m: row.metrics.get(m, 0) for m in costs}}
               for row in result.modules}
    roofline = {}
    if result.roofline:
        roofline = {"device": result.roofline["device"]["name"], **result.roofline["settings"]}
    return Entry(result.model, [dict(i) for i in result.inputs], result.convention, backward, modules, list(spec or []),
                 roofline)


@dataclass(frozen=True)
class Change:
    """A metric of a module that moved beyond the tolerance."""

    module: str
    metric: str
    before: float
    after: float

    @property
    def relative(self) -> float:
        return (self.after - self.before) / self.before if self.before else float("inf")

    def __str__(self) -> str:
        where = f"module {self.module!r}" if self.module else "the model"
        share = percent(self.relative) if self.before else "new"
        before, after = (with_exact(self.metric, value) for value in (self.before, self.after))
        change = format_change(self.metric, self.after - self.before)
        return f"{where}: {self.metric} {before} -> {after} ({change}, {share})"


@dataclass
class Comparison:
    """What grew (fails the check) and what shrank (a note: update the baseline) beyond the tolerance."""

    name: str
    tolerance: float
    grew: list[Change]
    shrank: list[Change]
    added: list[str]
    removed: list[str]
    # what was compared: the metrics, and how many modules (not counting the model) both runs have, so that
    # a pass says what it checked
    metrics: list[str] = field(default_factory=list)
    modules: int = 0

    @property
    def ok(self) -> bool:
        return not self.grew

    def report(self) -> str:
        verdict = "within" if self.ok else "over"
        head = f"{self.name}: {verdict} its baseline (tolerance {_tolerance_text(self.tolerance)})"
        if self.ok and self.metrics:
            head += (f": {', '.join(self.metrics)} of the model and {self.modules} module{'s' * (self.modules != 1)} "
                     "compared")
        lines = [head]
        lines += [f"  grew   {change}" for change in self.grew]
        lines += [f"  shrank {change}" for change in self.shrank]
        if self.added:
            lines.append(f"  new modules: {', '.join(self.added)}")
        if self.removed:
            lines.append(f"  modules gone: {', '.join(self.removed)}")
        if self.shrank and self.ok:
            lines.append("  (costs went down: save the baseline again to keep the gain)")
        return "\n".join(lines)


def _tolerance_text(tolerance: float) -> str:
    """A tolerance as a percentage, ``1.00%``, with the digits it has beyond two (``0.005%``, not ``0.01%``)."""
    hundredths = Fraction(repr(tolerance)) * 10000
    return f"{tolerance:.2%}" if hundredths.denominator == 1 else f"{float(hundredths / 100):.12g}%"


SAVE_HINT = "save a new baseline for it (--save-baseline) or run as before"


def compare(name: str, baseline: Entry, current: Entry, tolerance: float = 0.0, *, hint: str = SAVE_HINT
            ) -> Comparison:
    """Compare ``current`` with ``baseline`` per metric and module (the model first, then its modules in order,
    the largest absolute change first). :class:`BaselineMismatch` when the runs are not comparable, ending with
    ``hint`` (how to record a new baseline)."""
    tolerance = check_tolerance(tolerance)
    for what, entry in (("the baseline", baseline), ("this run", current)):
        for module, metrics in entry.modules.items():
            _check_costs(module, metrics, f"{name}: {what}")
    pairs: list[tuple[str, Any, Any]] = [("inputs", baseline.inputs, current.inputs),
                                         ("convention", baseline.convention, current.convention),
                                         ("backward pass", baseline.backward, current.backward),
                                         ("run options", run_options(baseline.spec), run_options(current.spec))]
    if baseline.roofline:  # a baseline without a device has no time to compare: a run with one is checked too
        pairs.append(("device", _device(baseline.roofline), _device(current.roofline)))
    for what, before, after in pairs:
        if before != after:
            raise BaselineMismatch(f"{name}: the baseline was recorded with {what} {_show(before)}, this run has "
                                   f"{_show(after)}; {hint}")
    _check_metrics_computed(name, baseline, current, hint)
    grew: list[Change] = []
    shrank: list[Change] = []
    for module, before in baseline.modules.items():
        after = current.modules.get(module)
        if after is None:
            continue
        for metric, old in before.items():
            new = after.get(metric, 0)  # (recompute_* only: the rest is in both, _check_metrics_computed)
            if old == new:
                continue
            change = Change(module, metric, old, new)
            if _beyond(old, new, tolerance):
                (grew if new > old else shrank).append(change)
    order = {module: i for i, module in enumerate(current.modules)}
    for changes in (grew, shrank):
        changes.sort(key=lambda c: (c.module != "", -abs(c.after - c.before), order.get(c.module, 0)))
    added = [m for m in current.modules if m not in baseline.modules]
    removed = [m for m in baseline.modules if m not in current.modules]
    compared = sum(module in current.modules for module in baseline.modules if module)
    return Comparison(name, tolerance, grew, shrank, added, removed, list(baseline.modules.get("", {})), compared)


# What a command-line run writes into its spec that changes what it measures, beyond the inputs, convention,
# passes and device compared on their own: an optimizer's step in the peak, the attention's FLOPs, a rank's share
_RUN_FLAGS = ("--foreach", "--dense-attention")
_RUN_VALUES = ("--optimizer", "--state-dtype", "--attention-kernel", "--parallel")


def run_options(spec: list[str]) -> str:
    """The options of ``spec`` (an entry's command-line arguments) that change what a run measures, as written
    (``"--optimizer adamw --foreach"``), or ``"none"``: an entry without a spec (``assert_cost``'s) has none."""
    picked = [[token] for token in spec if token in _RUN_FLAGS]
    picked += [[token, value] for token, value in itertools.pairwise(spec) if token in _RUN_VALUES]
    return " ".join(sorted(" ".join(option) for option in picked)) or "none"


def _beyond(old: float, new: float, tolerance: float) -> bool:
    """``new`` differs from ``old`` by more than ``tolerance`` (a fraction of ``old``), exactly: a change of
    exactly 0.7% is within a tolerance of 0.7% (the decimal it is written as, not the float just below it),
    where (new - old) / old in floats can come out over it."""
    if old == 0:
        return new != 0
    return abs(Fraction(new) - Fraction(old)) > Fraction(repr(tolerance)) * Fraction(old)


def _check_metrics_computed(name: str, baseline: Entry, current: Entry, hint: str) -> None:
    """Every metric of the baseline is one this run computed: a metric left out (the memory analysis's without
    ``--memory``, a time without the device) would go unchecked, a silent pass. ``recompute_*`` are the
    exception: a run holds them only with activation checkpointing, and without it they are 0."""
    missing = sorted(metric for metric in baseline.modules.get("", {})
                     if metric not in current.modules.get("", {}) and not metric.startswith("recompute_"))
    if missing:
        raise BaselineMismatch(f"{name}: the baseline holds {', '.join(missing)}, which this run did not compute"
                               f"{missing_metrics_hint(missing)}; {hint}")


def _device(roofline: dict[str, Any]) -> str:
    """``"h100 (efficiency 0.7, launch_overhead 4e-06)"``: the device and the settings that are not the default;
    ``"none"`` without a device."""
    if not roofline:
        return "none"
    defaults = {"efficiency": 1.0, "launch_overhead": 0.0, "tf32": False}
    options = [f"{key} {value}" for key, value in roofline.items() if key in defaults and value != defaults[key]]
    return str(roofline.get("device")) + (f" ({', '.join(options)})" if options else "")


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join("x".join(map(str, i.get("shape", []))) + f" {i.get('dtype', '')}".rstrip()
                         for i in value) or "no tensors"
    return repr(value)


_REQUIRED = ("model", "inputs", "convention", "backward", "modules")
_ALWAYS = ("params", "flops", "activations")  # the costs of every entry, whatever its options
_FIELDS = {f.name for f in fields(Entry)}


def _parse_entry(data: Any, what: str) -> Entry:
    """An :class:`Entry` from its JSON ``data``; :class:`GuardFileError` starting with ``what`` for a missing,
    unknown or mistyped field and for a cost that is not a finite number >= 0."""
    if not isinstance(data, dict):
        raise GuardFileError(f"{what} is {_kind(data)}, not an object")
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise GuardFileError(f"{what} lacks {', '.join(missing)}")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise GuardFileError(f"{what} has unknown fields: {', '.join(unknown)}")
    inputs = _field(data, "inputs", list, what)
    for i, item in enumerate(inputs):
        if not _is_input(item):
            raise GuardFileError(f"{what}: inputs[{i}] is not {{\"shape\": [sizes], \"dtype\": name}}: "
                                 f"{_kind(item)}")
    roofline = _field(data, "roofline", dict, what) if "roofline" in data else {}
    spec = _field(data, "spec", list, what) if "spec" in data else []
    if not all(isinstance(token, str) for token in spec):
        raise GuardFileError(f"{what}: spec must be a list of command-line arguments (strings)")
    modules = _field(data, "modules", dict, what)
    for module, metrics in modules.items():
        check_name(module, f"{what}: a module's name")
        if not isinstance(metrics, dict):
            raise GuardFileError(f"{what}: module {module!r} must be an object of metric -> value, got "
                                 f"{_kind(metrics)}")
        try:
            _check_costs(module, metrics, what)
        except (TypeError, ValueError) as exc:
            raise GuardFileError(str(exc)) from None
    _check_metrics(modules, what)
    return Entry(_field(data, "model", str, what), inputs, _field(data, "convention", str, what),
                 _field(data, "backward", bool, what), modules, spec, roofline)


def _check_metrics(modules: dict[str, dict[str, Any]], what: str) -> None:
    """An entry holds the model (module ``""``) and the same metrics for every module, among them those every
    run has: a metric or a model's totals missing from an edited file would never be compared (a silent pass)."""
    if "" not in modules:
        raise GuardFileError(f"{what} has no module '' (the model's totals)")
    metrics = set(modules[""])
    missing = [metric for metric in _ALWAYS if metric not in metrics]
    if missing:
        raise GuardFileError(f"{what}: the model (module '') lacks {', '.join(missing)}")
    for module, values in modules.items():
        if set(values) != metrics:
            differ = sorted(set(values) ^ metrics)
            raise GuardFileError(f"{what}: module {module!r} has other metrics than the model ({', '.join(differ)})")


def _check_costs(module: str, metrics: dict[str, Any], what: str) -> None:
    for metric, value in metrics.items():
        check_amount(value, f"{what}: module {module!r}: {metric}")


def _field(data: dict[str, Any], key: str, kind: type, what: str) -> Any:
    value = data.get(key)
    if not isinstance(value, kind):
        raise GuardFileError(f"{what}: {key} must be {_KINDS[kind]}, got {_kind(value)}")
    return value


def _is_input(item: Any) -> bool:
    return (isinstance(item, dict) and set(item) == {"shape", "dtype"} and isinstance(item["dtype"], str)
            and isinstance(item["shape"], list)
            and all(type(size) is int and 0 <= size <= MAX_AMOUNT for size in item["shape"]))


_KINDS: dict[type, str] = {dict: "an object", list: "a list", str: "a string", bool: "true or false"}


def _kind(value: Any) -> str:
    """What a JSON value is, in words, for an error: ``null``, ``a string 'abc'``, ``a list``..."""
    if value is None:
        return "null"
    if isinstance(value, bool | int | float | str):
        return f"{type(value).__name__} {shorten(value)}"
    if isinstance(value, dict | list):
        return _KINDS[type(value)]
    return type(value).__name__


class BaselineFile:
    """Several models' entries, read from and written to one JSON file (atomically)."""

    def __init__(self, entries: dict[str, Entry] | None = None) -> None:
        self.entries: dict[str, Entry] = dict(entries or {})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BaselineFile:
        """The baseline in ``path``; a :class:`GuardFileError` naming the file and the value when it is not one
        (every cost a finite number >= 0, every field of the type the command writes)."""
        try:
            data = read_json(path)
        except FileNotFoundError:
            raise GuardFileError(f"no baseline file {os.fspath(path)!r} (write one with --save-baseline)") from None
        return cls.from_data(data, path)

    @classmethod
    def from_data(cls, data: Any, path: str | os.PathLike[str]) -> BaselineFile:
        """The baseline in ``data`` (read from ``path``, named in errors), checked field by field."""
        where = repr(os.fspath(path))
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise GuardFileError(f"{where} is not a modelmeter baseline")
        if type(data.get("schema_version")) is not int or data.get("schema_version") != SCHEMA_VERSION:
            raise GuardFileError(f"{where} has baseline schema {data.get('schema_version')!r}; this modelmeter "
                                 f"reads {SCHEMA_VERSION}")
        models = _field(data, "models", dict, where)
        for name in models:
            check_name(name, f"{where}: an entry's name")
        return cls({name: _parse_entry(value, f"{where}: the entry {name!r}") for name, value in models.items()})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the entries to ``path`` atomically; a :class:`GuardFileError` instead when :meth:`load` would
        refuse the file (a name with control characters, a negative count from a registered handle): the file
        is shared by every model in it, and one unreadable entry would fail all of their checks."""
        data = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "modelmeter": _version.__version__,
                "torch": torch.__version__.split("+")[0],
                "models": {name: _entry_data(entry) for name, entry in sorted(self.entries.items())}}
        target = os.path.abspath(path)
        try:
            text = (json.dumps(data, indent=1, allow_nan=False) + "\n").encode("utf-8")
        except ValueError:  # (a user handle's NaN or infinity: no check could compare against it)
            raise GuardFileError(f"a baseline for {os.fspath(path)!r} holds a cost that is not a finite number "
                                 "(NaN or infinite: a registered handle returned it); it is not written") from None
        try:
            BaselineFile.from_data(json.loads(text), path)
        except GuardFileError as exc:
            raise GuardFileError(f"{exc}; the baseline is not written (a check could not read it)") from None
        os.makedirs(os.path.dirname(target), exist_ok=True)
        atomic_write(target, lambda f: f.write(text))

    def entry(self, name: str, path: str | os.PathLike[str] = "") -> Entry:
        """The entry called ``name``; a clear error listing the entries there are."""
        if name not in self.entries:
            where = f" {os.fspath(path)!r}" if path else ""
            known = ", ".join(sorted(self.entries)) or "none"
            raise BaselineMismatch(f"the baseline{where} has no entry {name!r} (entries: {known}); add it with "
                                   "--save-baseline")
        return self.entries[name]


def _entry_data(entry: Entry) -> dict[str, Any]:
    """An entry as JSON data; ``roofline`` only when it has a device (files without one stay as they were)."""
    data = asdict(entry)
    if not entry.roofline:
        del data["roofline"]
    return data


def record(baseline: str | os.PathLike[str], name: str, entry: Entry) -> None:
    """Write ``entry`` as ``name`` into the baseline file, keeping its other entries; parallel writers (e.g.
    pytest-xdist workers) take turns through one lock in the user's cache directory, not a lock file left
    next to the baseline in the project, and a ``flock`` on the baseline's directory (no file: writers with
    other cache directories, such as CI jobs each given their own, lost each other's entries)."""
    path = os.path.abspath(baseline)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with file_lock(os.path.join(get_cache_dir(), "baselines")), directory_lock(os.path.dirname(path)):
        file = BaselineFile.load(path) if os.path.exists(path) else BaselineFile()
        file.entries[name] = entry
        file.save(path)
