"""Per-module differences of two saved analyses (``--format json`` results, saved traces or baseline files)."""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from typing import Any

from ..reports.format import Align, aligned_table
from ..reports.render import format_change, format_metric
from ..reports.result import RATIO_METRICS
from ..reports.saved import SavedTraceError, is_saved_trace, read_saved_trace
from .baseline import FORMAT as BASELINE_FORMAT
from .baseline import BaselineFile
from .budget import with_recompute
from .values import GuardFileError, check_amount, check_name, percent, read_json

Costs = dict[str, dict[str, float]]  # "model/module" or "module" -> metric -> value


def load_costs(path: str | os.PathLike[str]) -> Costs:
    """Module costs from a saved Result (``modelmeter MODEL --format json -o FILE``), a saved trace (the result it
    was saved with, ``--save-trace FILE``) or a baseline file; the modules of a baseline are named
    ``model:module`` when it holds several models. :class:`GuardFileError` naming the file and the value for
    anything else (every cost a finite number >= 0)."""
    if is_saved_trace(path):  # (False for what is not a regular file: read_json refuses that, unopened)
        try:
            saved = read_saved_trace(path)
        except SavedTraceError as exc:
            raise GuardFileError(str(exc)) from None
        return _result_costs(saved.result.to_dict()["modules"], repr(os.fspath(path)))
    try:
        data = read_json(path)
    except FileNotFoundError:
        raise GuardFileError(f"no such file: {os.fspath(path)!r}") from None
    if isinstance(data, dict) and data.get("format") == BASELINE_FORMAT:
        entries = BaselineFile.from_data(data, path).entries
        single = len(entries) == 1
        return {(module if single else f"{name}:{module}"): dict(values)
                for name, entry in entries.items() for module, values in entry.modules.items()}
    if isinstance(data, dict) and "modules" in data and "metrics" in data:
        return _result_costs(data["modules"], repr(os.fspath(path)))
    raise GuardFileError(f"{os.fspath(path)!r} is neither a modelmeter result (--format json), a saved "
                         f"trace (--save-trace) nor a baseline")


def _run_of(path: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """The convention and the device a saved analysis counted with (a result's or saved trace's, a baseline's
    entries' when they share one); each None where it has none, or several. Read after :func:`load_costs` has
    checked the file."""
    convention: Any
    summary: Any
    if is_saved_trace(path):
        result = read_saved_trace(path).result
        convention, summary = result.convention, result.roofline
    else:
        data = read_json(path)
        if isinstance(data, dict) and data.get("format") == BASELINE_FORMAT:
            entries = BaselineFile.from_data(data, path).entries.values()
            return (_one({entry.convention for entry in entries}),
                    _one({entry.roofline.get("device") for entry in entries}))
        convention = data.get("convention") if isinstance(data, dict) else None
        summary = data.get("roofline") if isinstance(data, dict) else None
    device = summary.get("device") if isinstance(summary, dict) else None
    name = device.get("name") if isinstance(device, dict) else None
    return (convention if isinstance(convention, str) else None), (name if isinstance(name, str) else None)


def _one(values: set[Any]) -> str | None:
    """The value all of ``values`` share, if it is a string."""
    value = values.pop() if len(values) == 1 else None
    return value if isinstance(value, str) else None


def diff_notes(before_path: str | os.PathLike[str], after_path: str | os.PathLike[str], before: Costs,
               after: Costs) -> list[str]:
    """What a reader of :func:`diff`'s table must know: FLOPs of different conventions or times on different
    devices (their changes compare those, not the models), metrics only one side holds (not compared)."""
    notes = []
    runs = zip(_run_of(before_path), _run_of(after_path), strict=True)  # (conventions, devices): each file read once
    for (what, meaning), (first, second) in zip(
            (("the FLOPs are counted in different conventions", "the conventions"),
             ("the times are predicted on different devices", "the devices")), runs, strict=True):
        if None not in (first, second) and first != second:
            notes.append(f"{what} ({first} before, {second} after): their changes compare {meaning}, not the models")
    for side, mine, other in (("before", before, after), ("after", after, before)):
        only = sorted(_held(mine) - _held(other))
        if only:
            notes.append(f"not compared, only the {side} file has them: {', '.join(only)}")
    return notes


def _held(costs: Costs) -> set[str]:
    """The metrics any module of ``costs`` holds."""
    return {metric for values in costs.values() for metric in values}


def _result_costs(rows: Any, where: str) -> Costs:
    """``params`` and the metrics of each module row of a saved Result, checked."""
    if not isinstance(rows, list):
        raise GuardFileError(f"{where}: modules must be a list of module rows")
    costs: Costs = {}
    for i, row in enumerate(rows):
        if not (isinstance(row, dict) and isinstance(row.get("name"), str) and isinstance(row.get("metrics"), dict)):
            raise GuardFileError(f"{where}: modules[{i}] is not a module row (name, params, metrics)")
        check_name(row["name"], f"{where}: modules[{i}]'s name")
        values = {"params": row.get("params", 0), **{metric: value for metric, value in row["metrics"].items()
                                                      if metric not in RATIO_METRICS}}  # costs only
        try:
            for metric, value in values.items():
                check_amount(value, f"{where}: module {row['name']!r}: {metric}")
        except (TypeError, ValueError) as exc:
            raise GuardFileError(str(exc)) from None
        costs[row["name"]] = with_recompute(values)  # as a baseline's entry holds them
    return costs


@dataclass(frozen=True)
class Difference:
    module: str
    metric: str
    before: float
    after: float

    @property
    def change(self) -> float:
        return self.after - self.before

    def row(self) -> list[str]:
        share = percent(self.change / self.before) if self.before else "new"
        # each metric as the reports print it: seconds and bytes (moved or held) in their units, counts as fvcore
        before, after = format_metric(self.metric, self.before), format_metric(self.metric, self.after)
        # the model's row: "(model)", as no module is named (a Hugging Face causal LM's body is named "model")
        return [self.module or "(model)", self.metric, before, after, format_change(self.metric, self.change), share]


def diff(before: Costs, after: Costs, metrics: list[str] | None = None) -> list[Difference]:
    """Every (module, metric) whose value differs, largest absolute change first; a module only one side has
    counts from 0. A metric only one side holds is not compared (its absence is no 0: a run without a device has
    no time; :func:`diff_notes` names it)."""
    out = []
    shared = _held(before) & _held(after)
    for module in [*before, *(m for m in after if m not in before)]:
        old, new = before.get(module, {}), after.get(module, {})
        for metric in sorted((set(old) | set(new)) & shared):
            if metrics and metric not in metrics:
                continue
            a, b = old.get(metric, 0), new.get(metric, 0)
            if a != b:
                out.append(Difference(module, metric, a, b))
    out.sort(key=lambda d: -abs(d.change))
    return out


# The diff's columns, and those a narrow table leaves out first: the exact change, then the value before
_DIFF_COLUMNS = ("module", "metric", "before", "after", "change", "%")
_DIFF_DROPPED = ("change", "before")


def render_diff(differences: list[Difference], limit: int | None = None, width: int | None = None) -> str:
    """A table of ``differences`` (the first ``limit``), or a line saying there are none; with ``width``, the
    exact change and then the value before are left out (said under it) while it is wider."""
    if not differences:
        return "no differences"
    rows = [list(_DIFF_COLUMNS), *(d.row() for d in differences[:limit])]
    dropped: list[str] = []
    for name in _DIFF_DROPPED:
        if width is None or max(map(len, aligned_table(rows, ["left"] * len(rows[0])))) <= width:
            break
        index = rows[0].index(name)
        rows = [row[:index] + row[index + 1:] for row in rows]
        dropped.append(name)
    right: list[Align] = ["right"] * (len(rows[0]) - 2)
    aligns: list[Align] = ["left", "left", *right]
    lines = aligned_table(rows, aligns)
    more = len(differences) - len(rows) + 1
    notes = [f"... and {more} more"] * (more > 0)
    if dropped:
        left_out = f"(left out to fit {width} characters: {', '.join(dropped)}; --format json has every value)"
        notes += textwrap.wrap(left_out, width or len(left_out), subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(lines + notes)
