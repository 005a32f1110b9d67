"""Render a :class:`Result` as a terminal table, markdown, JSON, CSV or an annotated module tree."""

from __future__ import annotations

import csv
import io
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import InvalidTypeError, InvalidValueError, check_flag
from ..handles.catalog import CONVENTIONS, DESCRIPTIONS
from .columns import (
    PHASE_COLUMNS,
    RATIO_HEADERS,
    Column,
    build_columns,
    chosen_keys,
    column_keys,
    dropped_note,
    fit,
    fit_keys,
    format_bound,
    format_metric,
    format_percent,
    format_whole_percent,
    ratio_cell,
    shapes_cell,
)
from .format import aligned_table, format_bytes, format_rate, format_time, printable
from .fvcore_tables import UNCALLED_NOTE, Align, annotated_repr, format_size, pipe_table
from .ranks import rank_table
from .result import BYTE_METRICS, RATIO_METRICS, TIME_METRICS, ModuleRow, Result

__all__ = ["FORMATS", "format_bound", "format_bytes", "format_metric", "format_size", "render"]

FORMATS: tuple[str, ...] = ("table", "markdown", "json", "csv", "tree")
# The formats a parallel plan's per-rank table follows the modules in (JSON holds the dict; CSV is one table)
_WITH_RANKS = ("table", "markdown", "tree")


def render(result: Result, fmt: str = "table", depth: int = 3, *, width: int | None = None,
           columns: Sequence[str] | None = None, shapes: bool = False) -> str:
    """``result`` as text in format ``fmt`` (one of :data:`FORMATS`), without a trailing newline.

    ``depth`` limits the modules shown by ``table``, ``markdown`` and ``tree`` (0: the model only);
    ``json`` and ``csv`` always hold every module. ``width`` (``table`` and ``tree``): the widest line wanted;
    headers are shortened, then columns left out by :func:`~.columns.drop_rank` until it fits, and a line under
    the table names them (``None``: every column). ``columns`` (``table`` and ``markdown``): the column keys to
    show, in that order (``["all"]``: every one; none left out to fit). ``shapes``: a column of each module's
    output shapes. A result of a parallel plan (``result.parallel``) has its per-rank table after the modules'
    (``table``, ``markdown`` and ``tree``; :mod:`.ranks`), fitted to the same width.
    """
    if not isinstance(result, Result):
        raise InvalidTypeError(f"result must be a modelmeter Result (Analysis.result(), Result.from_json), got "
                               f"{type(result).__name__}")
    renderer = _RENDERERS.get(fmt) if isinstance(fmt, str) else None
    if renderer is None:
        raise InvalidValueError(f"unknown report format {fmt!r:.60}; choose one of: {', '.join(FORMATS)}")
    if columns is not None and (not isinstance(columns, (list, tuple)) or not all(isinstance(k, str) for k in columns)):
        raise InvalidTypeError(f"columns must be a list of column keys such as ['flops', 'params'], got "
                               f"{columns!r:.60}")
    check_flag("shapes", shapes)
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise InvalidValueError(f"depth must be a non-negative integer, got {depth!r}")
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        raise InvalidValueError(f"width must be a positive integer or None, got {width!r}")
    text = renderer(result, _Layout(depth, width, tuple(columns) if columns is not None else None, shapes))
    parallel = result.parallel  # a parallel plan's ranks (docs/parallel.md, "The command")
    if parallel and fmt in _WITH_RANKS:
        text += "\n\n" + rank_table(parallel, fmt, width)
    return text


@dataclass(frozen=True)
class _Layout:
    """How a renderer lays the result out: the depth shown, the width to fit, the columns chosen."""

    depth: int
    width: int | None = None
    columns: tuple[str, ...] | None = None
    shapes: bool = False


def convention_note(name: str) -> str:
    """``"macs (multiply-adds of ...)"``: a convention's name with what it counts."""
    return f"{name} ({DESCRIPTIONS[name]})" if name in CONVENTIONS else name


def format_change(metric: str, delta: float) -> str:
    """A signed change of a metric: seconds and bytes (moved, or held by the memory analysis) in their units
    (``+14.7ns``, ``-1.5KiB``), a ratio with three significant figures (``+0.25``), counts as whole numbers with
    separators (``+22,208,512``, every digit of an integer) and a fraction of a count in full (``+0.5``, not ``+0``)."""
    sign = "-" if delta < 0 else "+"
    if metric in TIME_METRICS:
        return sign + format_time(abs(delta))
    if metric in BYTE_METRICS:
        return sign + format_bytes(abs(delta))
    if metric in RATIO_METRICS:
        return f"{delta:+.3g}"
    if isinstance(delta, int) or delta.is_integer():
        return f"{int(delta):+,}"
    return f"{delta:+,}"


INTENSITY_NOTE = ("flops/byte and the time count real FLOPs (a multiply-add is 2, element-wise work included), "
                  "whatever the convention of the #flops column")


# table and markdown ----------------------------------------------------------------------------
def _shown(result: Result, depth: int) -> list[ModuleRow]:
    return [row for row in result.modules if row.depth <= depth]


def _summary(result: Result, rows: list[ModuleRow], layout: _Layout) -> tuple[list[Column], bool, list[str]]:
    """The table's columns (module, type, #params, then #metric and %metric per metric — a ratio gets one
    column —, each in one unit), whether their headers are short, and the columns left out to fit the width."""
    if layout.columns is not None:
        return build_columns(result, rows, chosen_keys(result, layout.columns, layout.shapes)), False, []
    built = build_columns(result, rows, column_keys(result, layout.shapes))
    if layout.width is None:
        return built, False, []
    return fit(built, layout.width)


def _grid(columns: list[Column], short: bool) -> tuple[list[str], list[Align], list[list[str]]]:
    headers = [column.short if short else column.header for column in columns]
    rows = [list(cells) for cells in zip(*(column.cells for column in columns), strict=True)]
    return headers, [column.align for column in columns], rows


def _footer(result: Result, rows: list[ModuleRow], code: Callable[[str], str],
            text: Callable[[str], str] = str) -> list[str]:
    """The notes under a table: the convention (unless fvcore's, the default), what N/A means, operators not
    counted, assumptions the run made. Each part is :func:`printable` (an operator's name or an assumption read from
    a file); ``code`` then writes an operator's name, ``text`` all else (markdown escapes each its own way)."""
    def note(line: str) -> str:
        return text(printable(line))

    lines = [] if result.convention == "fvcore" else [note(f"Convention: {convention_note(result.convention)}")]
    if any(not row.called for row in rows):
        lines.append(note(UNCALLED_NOTE))
    if result.unsupported:
        ops = sorted(result.unsupported.items(), key=lambda item: (-item[1], item[0]))
        lines.append(note("Unsupported operators (not counted): ")
                     + ", ".join(f"{code(printable(op))} ({n} call{'s' if n != 1 else ''})" for op, n in ops))
    if result.memory:
        lines.append(note(memory_note(result.memory)))
    if result.roofline:
        lines.append(note(roofline_note(result.roofline)))
        if result.convention != "flops":  # a ReLU of 0 fvcore flops has 0.125 flops/byte: say which flops
            lines.append(note(INTENSITY_NOTE))
        if result.memory and result.memory["peak"] > result.roofline["device"]["memory"]:
            device = result.roofline["device"]
            lines.append(note(f"Warning: the predicted peak memory, {format_bytes(result.memory['peak'])}, is over "
                              f"the memory of {device['label']} ({device['memory'] / 1e9:.3g} GB = "
                              f"{format_bytes(device['memory'])}): the run does not fit on one such device as it is"))
    lines += [note(f"Assumption: {assumption}") for assumption in result.assumptions]
    return lines


def memory_note(memory: dict[str, Any]) -> str:
    """One line on the peak: how much, where, and what it was made of."""
    kinds = memory.get("by_kind") or {}
    parts = ", ".join(f"{kind.replace('_', ' ')} {format_bytes(n)}" for kind, n in kinds.items() if n)
    return (f"Peak memory ({memory_step(memory)}): {format_bytes(memory['peak'])} during the {peak_place(memory)} "
            f"({parts})")


def peak_place(memory: Mapping[str, Any]) -> str:
    """Where the peak was: ``"forward of layer1 at conv2d"``; ``"forward of the model, before its first operator"``
    for a run whose peak is what it started with (a model that runs no operator)."""
    where = f"{memory.get('phase')} of {memory.get('module') or 'the model'}"
    operator = memory.get("operator")
    return f"{where} at {operator}" if operator else f"{where}, before its first operator"


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
    parts.append(f"{format_whole_percent(summary['compute_bound_share'])} of it compute-bound")
    if summary.get("predicted_mfu") is not None:
        parts.append(f"predicted MFU {format_percent(summary['predicted_mfu'])}")
    if summary.get("measured_time") is not None:
        parts.append(_measured(summary))
    return "; ".join(parts)


def _measured(summary: dict[str, Any]) -> str:
    """The measured time's MFU and HFU, with a warning when either is over 100% (no kernel beats the peak)."""
    text = (f"measured {format_time(summary['measured_time'])}: MFU {format_percent(summary['mfu'])}, "
            f"HFU {format_percent(summary['hfu'])}")
    if max(summary["mfu"], summary["hfu"]) > 1:
        text += (" (over 100%: the measured step ran faster than the device's peak allows; check the measured "
                 "time, the device and the dtype)")
    return text


def _table(result: Result, layout: _Layout) -> str:
    rows = _shown(result, layout.depth)
    columns, short, dropped = _summary(result, rows, layout)
    headers, aligns, cells = _grid(columns, short)
    text = "\n".join(aligned_table([headers, *cells], aligns, rule=True))
    footer = _footer(result, rows, code=str)
    if layout.width is not None:
        footer = [dropped_note(dropped, layout.width)] * bool(dropped) + footer
        footer = [wrapped for line in footer for wrapped in _wrap(line, layout.width)]
    return text + "\n\n" + "\n".join(footer) if footer else text


# What markdown could read as markup in a name: a character that ends a table's cell, opens a code span or starts
# an HTML tag or entity, and a backslash that would escape the punctuation after it (CommonMark escapes only ASCII
# punctuation: the `\n` of a printable name stays as it is). Each is written with a backslash before it, so a renderer
# shows the name as text and never as a tag.
_MARKDOWN_SPECIAL = re.compile(r"[`|<>&]|\\(?=[!-/:-@\[-`{-~])")


def _markdown_text(text: str) -> str:
    """``text`` for markdown: each of :data:`_MARKDOWN_SPECIAL` backslash-escaped (``a\\|b``, ``\\<img>``)."""
    return _MARKDOWN_SPECIAL.sub(lambda match: "\\" + match.group(), text)


def _code_span(text: str) -> str:
    """``text`` as a markdown code span no backtick of it ends: fenced by a run of backticks longer than any inside,
    padded with a space when it holds one (CommonMark strips one space from each side)."""
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _markdown(result: Result, layout: _Layout) -> str:
    rows = _shown(result, layout.depth)
    columns, _, _ = _summary(result, rows, replace(layout, width=None))
    headers, aligns, cells = _grid(columns, short=False)
    cells = [[_markdown_text(cell) for cell in row] for row in cells]
    text = pipe_table(headers, cells, aligns)
    footer = _footer(result, rows, code=_code_span, text=_markdown_text)
    return text + "\n\n" + "\n".join(f"- {note}" for note in footer) if footer else text


# json and csv ----------------------------------------------------------------------------------
def _json(result: Result, layout: _Layout) -> str:
    return result.to_json()


def _exact(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _csv(result: Result, layout: _Layout) -> str:
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
def _tree(result: Result, layout: _Layout) -> str:
    kids: dict[str, list[ModuleRow]] = {}
    for row in result.modules[1:]:
        if row.depth <= layout.depth:
            kids.setdefault(row.name.rsplit(".", 1)[0] if "." in row.name else "", []).append(row)

    def block(row: ModuleRow, metrics: list[str]) -> str:
        values = [row.metrics.get(metric, 0) for metric in metrics]
        lines = []
        if row.params or any(values) or not row.called or layout.shapes:
            stats = [f"#params: {format_size(row.params)}"]
            for metric, value in zip(metrics, values, strict=True):
                header = RATIO_HEADERS.get(metric, f"#{metric}")  # a ratio named as the table's column
                if not row.called:
                    stats.append(f"{header}: N/A")
                elif metric in RATIO_METRICS:
                    stats.append(f"{header}: {ratio_cell(metric, row)}")
                else:
                    stats.append(f"{header}: {format_metric(metric, value)}")
            if layout.shapes:
                stats.append(f"output: {shapes_cell(row)}")
            lines.append(", ".join(stats))
        children = [(printable(child.name.rsplit(".", 1)[-1]), block(child, metrics))
                    for child in kids.get(row.name, [])]
        return annotated_repr(printable(row.type), lines, children)

    metrics = [metric for metric in result.metrics if metric not in PHASE_COLUMNS]
    notes = [UNCALLED_NOTE] if any(not row.called for row in _shown(result, layout.depth)) else []
    width = layout.width
    if width is not None:
        metrics, dropped = fit_keys(metrics, lambda keys: _widest(block(result.root, keys)) <= width)
        notes = [line for note in [*notes, *[dropped_note(dropped, width)] * bool(dropped)]
                 for line in _wrap(note, width)]
    return "\n".join([*notes, block(result.root, metrics)])


def _wrap(note: str, width: int) -> list[str]:
    """A note's lines, at most ``width`` wide where its words allow, the later ones indented."""
    return textwrap.wrap(note, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def _widest(text: str) -> int:
    return max(map(len, text.splitlines()))


_RENDERERS: dict[str, Callable[[Result, _Layout], str]] = {
    "table": _table,
    "markdown": _markdown,
    "json": _json,
    "csv": _csv,
    "tree": _tree,
}
