"""The units and plain tables every report prints: the library's renderers and the command's own reports
(sweeps, ``--fit``, the trace cache). Pure string functions; fvcore's counts are
:func:`modelmeter.reports.fvcore_tables.format_size`, its pipe tables :func:`~.fvcore_tables.pipe_table`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Align = Literal["left", "right"]


def format_bytes(n: float) -> str:
    """Bytes in binary units with three significant figures: ``1536 -> "1.5KiB"``, ``225699420 -> "215MiB"``."""
    for scale, suffix in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.3g}{suffix}" if abs(value) < 999.5 else f"{value:.0f}{suffix}"
    return f"{int(n)}B"


def aligned_table(rows: Sequence[Sequence[str]], aligns: Sequence[Align], rule: bool = False) -> list[str]:
    """The lines of a terminal table: columns two spaces apart, each padded to its widest cell on the side
    ``aligns`` says, no trailing spaces; ``rule``: a line of dashes under the first row (the header)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(aligns))]
    lines = ["  ".join(cell.ljust(width) if align == "left" else cell.rjust(width)
                       for cell, width, align in zip(row, widths, aligns, strict=True)).rstrip()
             for row in rows]
    if rule:
        lines.insert(1, "  ".join("-" * width for width in widths))
    return lines


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a compact markdown table (no padding): the first column left-aligned, the others right."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---", *["---:"] * (len(header) - 1)]) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def titled_table(header: list[str], rows: list[list[str]], fmt: str, title: str) -> list[str]:
    """A table of one row per run (the command's ``--sweep`` and ``--fit``): ``markdown``, or a terminal table
    under ``title`` for any other ``fmt``; the first column left-aligned, the others right."""
    if fmt == "markdown":
        return markdown_table(header, rows)
    aligns: list[Align] = ["right"] * len(header)
    aligns[0] = "left"
    return [title, *aligned_table([header, *rows], aligns)]
