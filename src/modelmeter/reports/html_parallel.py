"""The HTML report's "Parallel plan" section (``Result.parallel``, docs/parallel.md "The command"): the per-rank
table as the terminal prints it (:mod:`.ranks`, every column) and, when the memory was analysed, each row's peak
as a bar stacked by its parts (parameter, gradient, optimizer state, unsharded, activation, ...) in the memory
timeline's colours (:mod:`.html_memory`'s ``k-`` classes).

Static markup, computed here (nothing for the page's script to do); every text escaped."""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from .format import format_bytes, printable
from .ranks import folded_ranks, plan_notes, rank_columns

__all__ = ["STYLE", "memory_bars", "parallel_section"]

_BAR_WIDTH = 760  # the bars' viewBox width
_BAR_LEFT, _BAR_RIGHT = 150.0, 660.0  # the bars span this (room for the ranks on the left, the peak on the right)
_BAR_ROW, _BAR_HEIGHT = 24.0, 16.0

STYLE = """
#rank-memory { width: 100%; max-width: 960px; display: block; font-size: 11px; }
#rank-memory text { fill: #333; }
"""


def memory_bars(parallel: Mapping[str, Any]) -> dict[str, Any] | None:
    """Each row's peak stacked by its parts, in the pixels of an SVG viewBox: ``rows`` with the ranks' ``label``,
    the ``y`` of its bar, its ``parts`` (``kind``, ``x``, ``width``, ``bytes``; the widest peak spans the bars'
    room) and where they ``end``; ``kinds`` in stacking order. None when no row has its memory's parts."""
    entries = [entry for entry in parallel["ranks"] if entry.get("memory")]
    highest = max((entry["memory"]["peak"] for entry in entries), default=0)
    if not highest:
        return None
    scale = (_BAR_RIGHT - _BAR_LEFT) / highest
    kinds: dict[str, None] = {}
    rows = []
    for row, entry in enumerate(entries):
        x = _BAR_LEFT
        parts = []
        for kind, size in entry["memory"]["parts"].items():
            if size <= 0:
                continue
            kinds[kind] = None
            parts.append({"kind": kind, "x": round(x, 2), "width": round(size * scale, 2), "bytes": size})
            x += size * scale
        rows.append({"label": folded_ranks(entry), "y": 4 + row * _BAR_ROW, "peak": entry["memory"]["peak"],
                     "parts": parts, "end": round(x, 2)})
    return {"width": _BAR_WIDTH, "height": 8 + len(rows) * _BAR_ROW, "bar": _BAR_HEIGHT, "rows": rows,
            "kinds": list(kinds)}


def _text(text: str) -> str:
    """``text`` for the markup: escaped, and each character that is not printable written as its escape (as the
    text reports and the page's script show a name: no control character or bidi override reaches the page)."""
    return html.escape(printable(text))


def parallel_section(parallel: Mapping[str, Any]) -> str:
    """The section's markup: a title, the per-rank table, the memory bars and the plan's notes."""
    notes = plan_notes(parallel)
    columns = rank_columns(parallel)
    head = "".join(f'<th class="{"text" if c.align == "left" else "num"}">{_text(c.header)}</th>'
                   for c in columns)
    body = "".join("<tr>" + "".join(f'<td class="{"text" if c.align == "left" else "num"}">{_text(cell)}</td>'
                                    for c, cell in zip(columns, cells, strict=True)) + "</tr>\n"
                   for cells in zip(*(c.cells for c in columns), strict=True))
    parts = ['<section id="parallel">', "<h2>Parallel plan</h2>", f'<p class="note">{_text(notes[0])}</p>',
             f'<table id="ranks"><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>']
    bars = memory_bars(parallel)
    if bars is not None:
        parts.append(_bars_svg(bars))
    parts += [f'<p class="note">{_text(note)}</p>' for note in notes[1:]]
    return "\n".join([*parts, "</section>", ""])


def _bars_svg(bars: Mapping[str, Any]) -> str:
    height = bars["bar"]
    shapes = []
    for row in bars["rows"]:
        middle = row["y"] + height / 2 + 4
        shapes.append(f'<text x="{_BAR_LEFT - 6}" y="{middle}" text-anchor="end">{_text(row["label"])}</text>')
        for part in row["parts"]:
            tip = f"{row['label']}: {part['kind'].replace('_', ' ')} {format_bytes(part['bytes'])}"
            shapes.append(f'<rect class="k-{_text(part["kind"])}" x="{part["x"]}" y="{row["y"]}" '
                          f'width="{part["width"]}" height="{height}"><title>{_text(tip)}</title></rect>')
        shapes.append(f'<text x="{row["end"] + 6}" y="{middle}">peak {format_bytes(row["peak"])}</text>')
    legend = "".join(f'<span class="legend-item"><span class="swatch k-{_text(kind)}"></span>'
                     f'{_text(kind.replace("_", " "))}</span>' for kind in bars["kinds"])
    return (f'<svg id="rank-memory" viewBox="0 0 {bars["width"]} {bars["height"]}" role="img" '
            f'aria-label="peak memory per rank, by part">{"".join(shapes)}</svg>\n'
            f'<p class="note">{legend}<br>Each row\'s peak memory, stacked by its parts.</p>')
