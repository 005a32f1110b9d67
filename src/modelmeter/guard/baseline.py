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

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..errors import ModelMeterError
from ..io import file_lock, get_cache_dir
from ..io.atomic import atomic_write
from ..reports.render import format_metric
from ..reports.result import Result

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

    def total(self, metric: str) -> float:
        return self.modules.get("", {}).get(metric, 0)


def entry_from_result(result: Result, *, spec: list[str] | None = None) -> Entry:
    """The baseline entry of an analysed model (``spec``: how the command builds it again, if it does)."""
    backward = any(m.startswith("backward_") for m in result.metrics)
    modules = {row.name: {"params": row.params, **{m: row.metrics.get(m, 0) for m in result.metrics}}
               for row in result.modules}
    return Entry(result.model, [dict(i) for i in result.inputs], result.convention, backward, modules, list(spec or []))


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
        share = f"{100 * self.relative:+.1f}%" if self.before else "new"
        return (f"{where}: {self.metric} {format_metric(self.metric, self.before)} -> "
                f"{format_metric(self.metric, self.after)} "
                f"({self.after - self.before:+,.0f}, {share})")


@dataclass
class Comparison:
    """What grew (fails the check) and what shrank (a note: update the baseline) beyond the tolerance."""

    name: str
    tolerance: float
    grew: list[Change]
    shrank: list[Change]
    added: list[str]
    removed: list[str]

    @property
    def ok(self) -> bool:
        return not self.grew

    def report(self) -> str:
        head = f"{self.name}: " + ("within" if self.ok else "over") + f" its baseline (tolerance {self.tolerance:.2%})"
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


SAVE_HINT = "save a new baseline for it (--save-baseline) or run as before"


def compare(name: str, baseline: Entry, current: Entry, tolerance: float = 0.0, *, hint: str = SAVE_HINT
            ) -> Comparison:
    """Compare ``current`` with ``baseline`` per metric and module (the model first, then its modules in order,
    the largest absolute change first). :class:`BaselineMismatch` when the runs are not comparable, ending with
    ``hint`` (how to record a new baseline)."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    pairs: list[tuple[str, Any, Any]] = [("inputs", baseline.inputs, current.inputs),
                                         ("convention", baseline.convention, current.convention),
                                         ("backward pass", baseline.backward, current.backward)]
    for what, before, after in pairs:
        if before != after:
            raise BaselineMismatch(f"{name}: the baseline was recorded with {what} {_show(before)}, this run has "
                                   f"{_show(after)}; {hint}")
    grew: list[Change] = []
    shrank: list[Change] = []
    for module, before in baseline.modules.items():
        after = current.modules.get(module)
        if after is None:
            continue
        for metric, old in before.items():
            new = after.get(metric)
            if new is None or old == new:
                continue
            change = Change(module, metric, old, new)
            if new > old and (old == 0 or change.relative > tolerance):
                grew.append(change)
            elif new < old and (old == 0 or -change.relative > tolerance):
                shrank.append(change)
    order = {module: i for i, module in enumerate(current.modules)}
    for changes in (grew, shrank):
        changes.sort(key=lambda c: (c.module != "", -abs(c.after - c.before), order.get(c.module, 0)))
    added = [m for m in current.modules if m not in baseline.modules]
    removed = [m for m in baseline.modules if m not in current.modules]
    return Comparison(name, tolerance, grew, shrank, added, removed)


def _show(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join("x".join(map(str, i.get("shape", []))) + f" {i.get('dtype', '')}".rstrip()
                         for i in value) or "no tensors"
    return repr(value)


class BaselineFile:
    """Several models' entries, read from and written to one JSON file (atomically)."""

    def __init__(self, entries: dict[str, Entry] | None = None) -> None:
        self.entries: dict[str, Entry] = dict(entries or {})

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BaselineFile:
        """The baseline in ``path``; a :class:`ModelMeterError` naming the file when it is not one."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ModelMeterError(f"no baseline file {os.fspath(path)!r} (write one with --save-baseline)") from None
        except (OSError, ValueError) as exc:
            raise ModelMeterError(f"cannot read the baseline {os.fspath(path)!r}: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ModelMeterError(f"{os.fspath(path)!r} is not a modelmeter baseline")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ModelMeterError(f"{os.fspath(path)!r} has baseline schema {data.get('schema_version')!r}; this "
                                  f"modelmeter reads {SCHEMA_VERSION}")
        try:
            return cls({name: Entry(**entry) for name, entry in data.get("models", {}).items()})
        except TypeError as exc:
            raise ModelMeterError(f"a malformed entry in the baseline {os.fspath(path)!r}: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        import modelmeter

        data = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "modelmeter": modelmeter.__version__,
                "torch": torch.__version__.split("+")[0],
                "models": {name: asdict(entry) for name, entry in sorted(self.entries.items())}}
        target = os.path.abspath(path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        text = (json.dumps(data, indent=1) + "\n").encode("utf-8")
        atomic_write(target, lambda f: f.write(text))

    def entry(self, name: str, path: str | os.PathLike[str] = "") -> Entry:
        """The entry called ``name``; a clear error listing the entries there are."""
        if name not in self.entries:
            where = f" {os.fspath(path)!r}" if path else ""
            known = ", ".join(sorted(self.entries)) or "none"
            raise BaselineMismatch(f"the baseline{where} has no entry {name!r} (entries: {known}); add it with "
                                   "--save-baseline")
        return self.entries[name]


def record(baseline: str | os.PathLike[str], name: str, entry: Entry) -> None:
    """Write ``entry`` as ``name`` into the baseline file, keeping its other entries; parallel writers (e.g.
    pytest-xdist workers) take turns through one lock in the user's cache directory, not a lock file left
    next to the baseline in the project."""
    path = os.path.abspath(baseline)
    with file_lock(os.path.join(get_cache_dir(), "baselines")):
        file = BaselineFile.load(path) if os.path.exists(path) else BaselineFile()
        file.entries[name] = entry
        file.save(path)
