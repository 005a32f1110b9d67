"""Render a :class:`Result` as a terminal table, markdown, JSON, CSV or an annotated module tree."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Mapping
from typing import Any

from ..handles.catalog import CONVENTIONS, DESCRIPTIONS
from .format import aligned_table, format_bytes, format_rate, format_time
from .fvcore_tables import UNCALLED_NOTE, Align, annotated_repr, format_size, pipe_table
from .result import BYTE_METRICS, RATIO_METRICS, TIME_METRICS, TRAFFIC_METRICS, ModuleRow, Result

__all__ = ["FORMATS", "format_bytes", "format_size", "render"]

FORMATS: tuple[str, ...] = ("table", "markdown", "json", "csv", "tree")


def render(result: Result, fmt: str = "table", depth: int = 3) -> str:
    """``result`` as text in format ``fmt`` (one of :data:`FORMATS`), without a trailing newline.

    ``depth`` limits the modules shown by ``table``, ``markdown`` and ``tree`` (0: the model only);
    ``json`` and ``csv`` always hold every module.
    """
    renderer = _RENDERERS.get(fmt)
    if renderer is None:
        raise ValueError(f"unknown report format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"depth must be a non-negative integer, got {depth!r}")
    return renderer(result, depth)


def convention_note(name: str) -> str:
    """``"macs (multiply-adds of ...)"``: a convention's name with what it counts."""
    return f"{name} ({DESCRIPTIONS[name]})" if name in CONVENTIONS else name


def format_metric(metric: str, value: float) -> str:
    """A metric's value as the reports print it: bytes in binary units, seconds in s/ms/µs/ns, FLOPs per byte with
    three significant figures, the compute-bound share as the bound, counts as fvcore does."""
    if metric in BYTE_METRICS:
        return format_bytes(value)
    if metric in TIME_METRICS:
        return format_time(value)
    if metric == "intensity":
        return f"{value:.3g}"
    if metric == "compute_bound":
        return format_bound(value)
    return format_size(value)


def format_change(metric: str, delta: float) -> str:
    """A signed change of a metric: seconds and bytes in their units (``+14.7ns``, ``-1.5KiB``), counts as whole
    numbers with separators (``+22,208,512``)."""
    sign = "-" if delta < 0 else "+"
    if metric in TIME_METRICS:
        return sign + format_time(abs(delta))
    if metric in TRAFFIC_METRICS:
        return sign + format_bytes(abs(delta))
    return f"{delta:+,.0f}"


def format_bound(share: float) -> str:
    """``0.9 -> "compute 90%"``: what bounds most of the time, and its share of it."""
    if share >= 0.5:
        return f"compute {100 * share:.0f}%"
    return f"memory {100 * (1 - share):.0f}%"


INTENSITY_NOTE = ("flops/byte and the time count real FLOPs (a multiply-add is 2, element-wise work included), "
                  "whatever the convention of the #flops column")

# The column a metric of no share (a ratio) is shown under.
_HEADERS = {"intensity": "flops/byte", "compute_bound": "bound"}


# table and markdown ----------------------------------------------------------------------------
def _shown(result: Result, depth: int) -> list[ModuleRow]:
    return [row for row in result.modules if row.depth <= depth]


# The roofline's per-phase columns: in JSON, CSV and HTML; the text reports give the phases' times in a note.
_PHASE_COLUMNS = frozenset(f"{phase}_{metric}" for phase in ("forward", "backward", "recompute", "optimizer")
                           for metric in ("bytes", "time"))


def _columns(result: Result) -> list[str]:
    """The metrics a table or tree shows."""
    return [metric for metric in result.metrics if metric not in _PHASE_COLUMNS]


def _summary(result: Result, rows: list[ModuleRow]) -> tuple[list[str], list[Align], list[list[str]]]:
    """Headers, alignments and cells: module (indented), type, #params, then #metric and %metric per metric (a
    ratio gets one column)."""
    headers = ["module", "type", "#params"]
    aligns: list[Align] = ["left", "left", "right"]
    columns = _columns(result)
    for metric in columns:
        if metric in RATIO_METRICS:
            headers.append(_HEADERS[metric])
            aligns.append("right")
        else:
            headers += [f"#{metric}", f"%{metric}"]
            aligns += ["right", "right"]
    totals = {metric: result.total(metric) for metric in columns}
    cells = []
    for row in rows:
        line = ["  " * row.depth + (row.name or "model"), row.type, format_size(row.params)]
        for metric in columns:
            ratio = metric in RATIO_METRICS
            if not row.called:
                line += ["N/A"] if ratio else ["N/A", "N/A"]
                continue
            value = row.metrics.get(metric, 0)
            if ratio:
                line.append(_ratio_cell(row, metric))
                continue
            share = value / totals[metric] if totals[metric] else 0.0
            line += [format_metric(metric, value), f"{100 * share:.1f}%"]
        cells.append(line)
    return headers, aligns, cells


def _ratio_cell(row: ModuleRow, metric: str) -> str:
    """A module's intensity or bound; "-" for a module that takes no time (it has neither)."""
    return format_metric(metric, row.metrics.get(metric, 0)) if row.metrics.get("time") else "-"


def _footer(result: Result, rows: list[ModuleRow], code: Callable[[str], str]) -> list[str]:
    """The notes under a table: the convention (unless fvcore's, the default), what N/A means, operators not
    counted, assumptions the run made."""
    lines = [] if result.convention == "fvcore" else [f"Convention: {convention_note(result.convention)}"]
    if any(not row.called for row in rows):
        lines.append(UNCALLED_NOTE)
    if result.unsupported:
        ops = sorted(result.unsupported.items(), key=lambda item: (-item[1], item[0]))
        lines.append("Unsupported operators (not counted): "
                     + ", ".join(f"{code(op)} ({n} call{'s' if n != 1 else ''})" for op, n in ops))
    if result.memory:
        lines.append(memory_note(result.memory))
    if result.roofline:
        lines.append(roofline_note(result.roofline))
        if result.convention != "flops":  # a ReLU of 0 fvcore flops has 0.125 flops/byte: say which flops
            lines.append(INTENSITY_NOTE)
        if result.memory and result.memory["peak"] > result.roofline["device"]["memory"]:
            device = result.roofline["device"]
            lines.append(f"Warning: the predicted peak memory, {format_bytes(result.memory['peak'])}, is over the "
                         f"memory of {device['label']} ({device['memory'] / 1e9:.3g} GB = "
                         f"{format_bytes(device['memory'])}): the run does not fit on one such device as it is")
    lines += [f"Assumption: {text}" for text in result.assumptions]
    return lines


def memory_note(memory: dict[str, Any]) -> str:
    """One line on the peak: how much, where, and what it was made of."""
    kinds = memory.get("by_kind") or {}
    parts = ", ".join(f"{kind.replace('_', ' ')} {format_bytes(n)}" for kind, n in kinds.items() if n)
    where = f"{memory.get('phase')} of {memory.get('module') or 'the model'} at {memory.get('operator')}"
    return f"Peak memory ({memory_step(memory)}): {format_bytes(memory['peak'])} during the {where} ({parts})"


def memory_step(memory: Mapping[str, Any]) -> str:
    """What the memory analysis modelled: ``"inference"``, ``"training step"``, ``"training step with adamw"``."""
    step = "training step" if memory.get("training") else "inference"
    optimizer = memory.get("optimizer")
    if isinstance(optimizer, dict):
        step += f" with {optimizer['name']}"
    return step


def roofline_note(summary: dict[str, Any]) -> str:
    """One line on the predicted time: where, how long per phase, the throughput, the bound, the MFU, and the
    measured MFU and HFU (flagged when over 100%: the measurement beat the device's peak)."""
    device = summary["device"]
    times = summary["time"]
    phases = [f"{phase} {format_time(seconds)}" for phase, seconds in times.items() if phase != "total"]
    if len(phases) != 1:  # several phases, or none at all (a model that computes and moves nothing)
        phases.append(f"total {format_time(times['total'])}")
    parts = [f"Predicted time on {device['label']} ({summary['dtype']}, roofline): {', '.join(phases)}"]
    if summary.get("throughput"):
        unit = (summary.get("items") or {}).get("unit", "samples")
        parts.append(f"{format_rate(summary['throughput'])} {unit}/s")
    parts.append(f"{100 * summary['compute_bound_share']:.0f}% of it compute-bound")
    if summary.get("predicted_mfu") is not None:
        parts.append(f"predicted MFU {100 * summary['predicted_mfu']:.1f}%")
    if summary.get("measured_time") is not None:
        parts.append(_measured(summary))
    return "; ".join(parts)


def _measured(summary: dict[str, Any]) -> str:
    """The measured time's MFU and HFU, with a warning when either is over 100% (no kernel beats the peak)."""
    text = (f"measured {format_time(summary['measured_time'])}: MFU {100 * summary['mfu']:.1f}%, "
            f"HFU {100 * summary['hfu']:.1f}%")
    if max(summary["mfu"], summary["hfu"]) > 1:
        text += (" (over 100%: the measured step ran faster than the device's peak allows; check the measured "
                 "time, the device and the dtype)")
    return text


def _table(result: Result, depth: int) -> str:
    rows = _shown(result, depth)
    headers, aligns, cells = _summary(result, rows)
    text = "\n".join(aligned_table([headers, *cells], aligns, rule=True))
    footer = _footer(result, rows, code=str)
    return text + "\n\n" + "\n".join(footer) if footer else text


def _markdown(result: Result, depth: int) -> str:
    rows = _shown(result, depth)
    headers, aligns, cells = _summary(result, rows)
    text = pipe_table(headers, cells, aligns)
    footer = _footer(result, rows, code=lambda s: f"`{s}`")
    return text + "\n\n" + "\n".join(f"- {note}" for note in footer) if footer else text


# json and csv ----------------------------------------------------------------------------------
def _json(result: Result, depth: int) -> str:
    return result.to_json()


def _exact(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _csv(result: Result, depth: int) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    shared = [m for m in result.metrics if m not in RATIO_METRICS]  # a ratio has no share of the model's
    writer.writerow(["name", "type", "depth", "params", *result.metrics, *(f"{m}_share" for m in shared)])
    totals = {metric: result.total(metric) for metric in shared}
    for row in result.modules:
        values = [row.metrics.get(metric, 0) for metric in result.metrics]
        shares = [row.metrics.get(m, 0) / totals[m] if totals[m] else 0.0 for m in shared]
        writer.writerow([row.name, row.type, row.depth, row.params,
                         *map(_exact, values), *(f"{s:.6f}" for s in shares)])
    return out.getvalue().rstrip("\n")


# tree ------------------------------------------------------------------------------------------
def _tree(result: Result, depth: int) -> str:
    kids: dict[str, list[ModuleRow]] = {}
    for row in result.modules[1:]:
        if row.depth <= depth:
            kids.setdefault(row.name.rsplit(".", 1)[0] if "." in row.name else "", []).append(row)

    columns = _columns(result)

    def block(row: ModuleRow) -> str:
        values = [row.metrics.get(metric, 0) for metric in columns]
        lines = []
        if row.params or any(values) or not row.called:
            stats = [f"#params: {format_size(row.params)}"]
            for metric, value in zip(columns, values, strict=True):
                if not row.called:
                    stats.append(f"{_HEADERS.get(metric, '#' + metric)}: N/A")
                elif metric in RATIO_METRICS:  # named as the table's column, without a count's "#"
                    stats.append(f"{_HEADERS[metric]}: {_ratio_cell(row, metric)}")
                else:
                    stats.append(f"#{metric}: {format_metric(metric, value)}")
            lines.append(", ".join(stats))
        children = [(child.name.rsplit(".", 1)[-1], block(child)) for child in kids.get(row.name, [])]
        return annotated_repr(row.type, lines, children)

    text = block(result.root)
    uncalled = any(not row.called for row in _shown(result, depth))
    return f"{UNCALLED_NOTE}\n{text}" if uncalled else text


_RENDERERS: dict[str, Callable[[Result, int], str]] = {
    "table": _table,
    "markdown": _markdown,
    "json": _json,
    "csv": _csv,
    "tree": _tree,
}
