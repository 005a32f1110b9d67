"""Baselines: a file of models' costs, module by module, and the comparison that says which block grew.

The file is JSON, stable across machines (no timings, no paths), and holds several models, each keyed by a
name (the command uses the model spec)::

    {"format": "modelmeter-baseline", "schema_version": 1, "modelmeter": "0.1.0", "torch": "2.14.1",
     "models": {"resnet50": {"spec": ["resnet50"], "inputs": [{"shape": [1, 3, 224, 224], "dtype": "float32"}],
                             "convention": "fvcore", "backward": false, "model": "ResNet", "mode": "eval",
                             "modules": {"": {"params": 25557032, "flops": 4111512576, ...}, "layer1": {...}}}}}

A comparison refuses to compare runs that are not comparable — other inputs, convention, passes, run options or
the model's training mode — and reports, per metric and module, what grew beyond the tolerance (a failure) and
what shrank (a note).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from fractions import Fraction
from typing import Any

import torch
from torch import nn

from .. import _version
from ..errors import ModelMeterError
from ..io import file_lock, get_cache_dir
from ..io.atomic import atomic_write
from ..io.cache_dir import directory_lock
from ..reports.render import format_change
from ..reports.result import RATIO_METRICS, Result
from .budget import missing_metrics_hint, with_recompute
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
    """One model's costs: what was run (spec, inputs, convention, backward, the model's training mode) and every
    module's metrics."""

    model: str
    inputs: list[dict[str, Any]]
    convention: str
    backward: bool
    modules: dict[str, dict[str, float]]
    spec: list[str] = field(default_factory=list)
    # The device the time was predicted on and the roofline's settings ({} without a device): a time is only
    # comparable with a time on the same device.
    roofline: dict[str, Any] = field(default_factory=dict)
    # The model's training flag (training_mode): BatchNorm and dropout count otherwise in training. None: not
    # recorded (an entry saved before modelmeter kept it; recorded_mode says what that means).
    mode: str | None = None

    def total(self, metric: str) -> float:
        return self.modules.get("", {}).get(metric, 0)


def entry_from_result(result: Result, *, spec: list[str] | None = None, mode: str | None = None) -> Entry:
    """The baseline entry of an analysed model (``spec``: how the command builds it again, if it does; ``mode``:
    the model's :func:`training_mode` as it ran, if known)."""
    backward = any(m.startswith("backward_") for m in result.metrics)
    costs = [m for m in result.metrics if m not in RATIO_METRICS]  # a ratio is no cost that can grow
    modules = {row.name: with_recompute({"params": row.params, **{m: row.metrics.get(m, 0) for m in costs}})
               for row in result.modules}
    roofline = {}
    if result.roofline:
        roofline = {"device": result.roofline["device"]["name"], **result.roofline["settings"]}
    return Entry(result.model, [dict(i) for i in result.inputs], result.convention, backward, modules, list(spec or []),
                 roofline, mode)


def training_mode(model: nn.Module) -> str:
    """The training flag of ``model`` as an entry keeps it: ``"train"`` or ``"eval"``, and ``" except a, b"``
    naming the modules whose own flag is the other one (a frozen BatchNorm in a model in training): each module
    counts by its own flag (BatchNorm's statistics, dropout)."""
    mode = "train" if model.training else "eval"
    other = [name for name, module in model.named_modules() if module.training != model.training]
    return f"{mode} except {', '.join(other)}" if other else mode


# The mode the command puts every model it builds in (cli/models.py, _to_eval_mode), and the one its entries record;
# an entry with a spec that records no mode (saved before entries kept it) was run in it. A torch.export module cannot
# switch and runs in the mode it was exported in, which its flags do not tell (``training`` is True either way): its
# entry records the command's mode too, and a check runs the same exported graph, so the costs compare alike.
COMMAND_MODE = "eval"


def recorded_mode(entry: Entry) -> str | None:
    """The training mode ``entry`` was run in: its own, the command's for an entry the command saved before entries
    kept it, and None (not known) for such an entry of ``assert_cost`` (no spec)."""
    if entry.mode is not None:
        return entry.mode
    return COMMAND_MODE if entry.spec else None


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
    notes: list[str] = field(default_factory=list)  # what was not compared, and why

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
        lines += [f"  note: {note}" for note in self.notes]
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
    modes = [recorded_mode(baseline), recorded_mode(current)]
    if None in modes:  # compared only when both runs record it (_mode_notes)
        modes = [None, None]
    pairs: list[tuple[str, Any, Any]] = [("inputs", baseline.inputs, current.inputs),
                                         ("convention", baseline.convention, current.convention),
                                         ("backward pass", baseline.backward, current.backward),
                                         ("run options", run_options(baseline.spec, modes[0]),
                                          run_options(current.spec, modes[1]))]
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
            new = after.get(metric, 0)  # (in both for an entry of entry_from_result: _check_metrics_computed)
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
    return Comparison(name, tolerance, grew, shrank, added, removed, list(baseline.modules.get("", {})), compared,
                      _mode_notes(baseline, current))


def _mode_notes(baseline: Entry, current: Entry) -> list[str]:
    """A note when the training modes were not compared: an entry of ``assert_cost`` saved before entries kept
    the mode is checked on its costs as before (its file stays usable) and says so."""
    missing = [what for what, entry in (("the baseline", baseline), ("this run", current))
               if recorded_mode(entry) is None]
    if not missing:
        return []
    return [f"{' and '.join(missing)} record{'s' * (len(missing) == 1)} no training mode (saved before modelmeter "
            "kept it), so the modes were not compared: save the baseline again to compare them"]


# The options of the command's arguments (cli/job.py, job_argv) that a comparison does not take as run options:
# those it compares on their own (the inputs, the convention, the passes, the device and the roofline's settings;
# not --dtype, which a language model's token ids do not show: the model's parameters take it)
# and those that change nothing it compares (--execution: fake tensors count as real ones do; --memory: its
# metrics, checked as metrics; --measured-time: the MFU, which is no cost). Every other option changes what a run
# measures (an optimizer's step in the peak, the attention's FLOPs, a rank's share) and is a run option: one added
# to the command is compared from the start, never forgotten here (tests/test_guard_leftovers.py).
COMPARED_APART = frozenset({"--input", "--batch", "--resolution", "--seq-len", "--convention", "--backward",
                            "--device", "--devices-file", "--efficiency", "--launch-overhead", "--tf32"})
NOT_MEASURED = frozenset({"--execution", "--memory", "--measured-time"})


def run_options(spec: list[str], mode: str | None = None) -> str:
    """The options of ``spec`` (an entry's command-line arguments) that change what a run measures, as written
    (``"--foreach --optimizer adamw"``), and the model's training ``mode`` when given (``"--foreach --optimizer
    adamw; mode: eval"``); ``"none"`` for neither (an entry without a spec, ``assert_cost``'s, has no options)."""
    picked = [" ".join(option) for option in _options(spec) if option[0] not in COMPARED_APART | NOT_MEASURED]
    text = " ".join(sorted(picked))
    if mode is not None:
        text = f"{text}; mode: {mode}" if text else f"mode: {mode}"
    return text or "none"


def _options(spec: list[str]) -> list[list[str]]:
    """The options of an entry's command-line arguments, each its flag and values (``--flag=value`` split); the
    model and its key=value arguments before them are none."""
    options: list[list[str]] = []
    for token in spec:
        if token.startswith("--"):
            flag, sep, value = token.partition("=")
            options.append([flag, value] if sep else [flag])
        elif options:
            options[-1].append(token)
    return options


def _beyond(old: float, new: float, tolerance: float) -> bool:
    """``new`` differs from ``old`` by more than ``tolerance`` (a fraction of ``old``), exactly: a change of
    exactly 0.7% is within a tolerance of 0.7% (the decimal it is written as, not the float just below it),
    where (new - old) / old in floats can come out over it."""
    if old == 0:
        return new != 0
    return abs(Fraction(new) - Fraction(old)) > Fraction(repr(tolerance)) * Fraction(old)


def _check_metrics_computed(name: str, baseline: Entry, current: Entry, hint: str) -> None:
    """Every metric of the baseline is one this run computed: a metric left out (the memory analysis's without
    ``--memory``, a time without the device) would go unchecked, a silent pass. (A backward pass always holds
    ``recompute_*``, 0 without activation checkpointing: budget.with_recompute.)"""
    missing = sorted(metric for metric in baseline.modules.get("", {}) if metric not in current.modules.get("", {}))
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
    modules = {module: with_recompute(metrics) for module, metrics in modules.items()}  # (an entry saved without)
    return Entry(_field(data, "model", str, what), inputs, _field(data, "convention", str, what),
                 _field(data, "backward", bool, what), modules, spec, roofline, _parse_mode(data, what))


def _parse_mode(data: dict[str, Any], what: str) -> str | None:
    """The entry's training mode, None when it records none; an error for one no run has (``"Train"`` would never
    equal a run's mode: every check of it would be refused as another run)."""
    if "mode" not in data:
        return None
    mode: str = _field(data, "mode", str, what)
    if not mode.isprintable() or re.fullmatch(r"(train|eval)( except .+)?", mode) is None:  # (printed in errors)
        raise GuardFileError(f"{what}: mode must be 'train' or 'eval' (then ' except ' and the modules whose flag is "
                             f"the other), got {_kind(mode)}")
    return mode


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
    """An entry as JSON data; ``roofline`` only when it has a device (files without one stay as they were), and
    ``mode`` only when known."""
    data = asdict(entry)
    if not entry.roofline:
        del data["roofline"]
    if entry.mode is None:
        del data["mode"]
    return data


def record(baseline: str | os.PathLike[str], name: str, entry: Entry) -> None:
    """Write ``entry`` as ``name`` into the baseline file, keeping its other entries; parallel writers (e.g.
    pytest-xdist workers) take turns through one lock in the user's cache directory, not a lock file left
    next to the baseline in the project, and a ``flock`` on the baseline's directory (no file: writers with
    other cache directories, such as CI jobs each given their own, lost each other's entries). A baseline that is a
    symbolic link is written where it points (the rename of an atomic write replaced the link with a file, and the
    file it pointed to, shared by other projects, never got the entry)."""
    path = os.path.realpath(baseline)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with file_lock(os.path.join(get_cache_dir(), "baselines")), directory_lock(os.path.dirname(path)):
        file = BaselineFile.load(path) if os.path.exists(path) else BaselineFile()
        file.entries[name] = entry
        file.save(path)
