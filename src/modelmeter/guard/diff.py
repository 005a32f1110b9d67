"""Per-module differences of two saved analyses (``--format json`` results or baseline files)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..errors import ModelMeterError
from ..reports.fvcore_tables import format_size
from .baseline import FORMAT as BASELINE_FORMAT
from .baseline import BaselineFile

Costs = dict[str, dict[str, float]]  # "model/module" or "module" -> metric -> value


def load_costs(path: str | os.PathLike[str]) -> Costs:
    """Module costs from a saved Result (``modelmeter MODEL --format json -o FILE``) or a baseline file; the
    modules of a baseline are named ``model:module`` when it holds several models."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ModelMeterError(f"cannot read {os.fspath(path)!r}: {exc}") from None
    if isinstance(data, dict) and data.get("format") == BASELINE_FORMAT:
        entries = BaselineFile.load(path).entries
        single = len(entries) == 1
        return {(module if single else f"{name}:{module}"): dict(values)
                for name, entry in entries.items() for module, values in entry.modules.items()}
    if isinstance(data, dict) and "modules" in data and "metrics" in data:
        return {row["name"]: {"params": row.get("params", 0), **row.get("metrics", {})} for row in data["modules"]}
    raise ModelMeterError(f"{os.fspath(path)!r} is neither a modelmeter result (--format json) nor a baseline")


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
        share = f"{100 * self.change / self.before:+.1f}%" if self.before else "new"
        return [self.module or "model", self.metric, format_size(self.before), format_size(self.after),
                f"{self.change:+,.0f}", share]


def diff(before: Costs, after: Costs, metrics: list[str] | None = None) -> list[Difference]:
    """Every (module, metric) whose value differs, largest absolute change first; a module only one side has
    counts from 0."""
    out = []
    for module in [*before, *(m for m in after if m not in before)]:
        old, new = before.get(module, {}), after.get(module, {})
        for metric in sorted(set(old) | set(new)):
            if metrics and metric not in metrics:
                continue
            a, b = old.get(metric, 0), new.get(metric, 0)
            if a != b:
                out.append(Difference(module, metric, a, b))
    out.sort(key=lambda d: -abs(d.change))
    return out


def render_diff(differences: list[Difference], limit: int | None = None) -> str:
    """A table of ``differences`` (the first ``limit``), or a line saying there are none."""
    if not differences:
        return "no differences"
    rows = [["module", "metric", "before", "after", "change", "%"], *(d.row() for d in differences[:limit])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    more = len(differences) - len(rows) + 1
    return "\n".join(lines + ([f"... and {more} more"] if more > 0 else []))
