"""The units and plain tables every report prints: the library's renderers and the command's own reports
(sweeps, ``--fit``, the trace cache). Pure string functions; fvcore's counts are
:func:`modelmeter.reports.fvcore_tables.format_size`, its pipe tables :func:`~.fvcore_tables.pipe_table`."""

from __future__ import annotations

import math
import re
import textwrap
import unicodedata
from collections.abc import Sequence
from typing import Literal

from ..errors import InvalidValueError

Align = Literal["left", "right"]


def format_bytes(n: float, digits: int = 3) -> str:
    """Bytes in binary units with ``digits`` significant figures: ``1536 -> "1.5KiB"``, ``225699420 -> "215MiB"``
    (whole units where there are more of them than ``digits`` shows: ``2000 TiB``, not ``2e+03TiB``)."""
    for scale, suffix in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(n) >= scale:
            value = n / scale
            shown = f"{value:.{digits}g}"
            return f"{shown}{suffix}" if "e" not in shown else f"{value:.0f}{suffix}"
    return f"{int(n)}B"


_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))
# A duration is divided by its unit per second (1e3, 1e6, 1e9 are exact floats): "5us" is the float nearest to
# 5e-06, as a time computed in seconds is, where 5 * 1e-6 would be 4.9999999999999996e-06 (below a time of 5us)
_PER_SECOND = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}


def format_time(seconds: float) -> str:
    """Seconds with three significant figures in the largest unit that keeps them at least 1:
    ``0.00123 -> "1.23ms"``, ``4.5e-8 -> "45ns"``, ``0 -> "0s"``; below a picosecond or from a million seconds on,
    in seconds with an exponent (``"1.2e-15s"``)."""
    if seconds == 0:
        return "0s"
    if not 1e-12 <= abs(seconds) < 1e6:  # beyond any unit: a device file's extreme numbers, never 300 digits
        return f"{seconds:.3g}s"
    if abs(seconds) >= 999.5:
        return f"{seconds:.0f}s"
    for suffix, scale in _TIME_UNITS:
        shown = f"{seconds / scale:.3g}"
        if abs(float(shown)) >= 1 or suffix == "ns":  # rounded first: 999.9µs is 1ms, not 1e+03µs
            return f"{shown}{suffix}"
    raise AssertionError("unreachable")


def format_rate(per_second: float) -> str:
    """A rate (items per second) with three significant figures and a decimal suffix: ``14100 -> "14.1K"``,
    ``9.21e7 -> "92.1M"``; from 1e15 on, with an exponent."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if scale * 0.9995 <= abs(per_second) < 1e15:  # rounded first: 999,999 is 1M, not 1e+03K
            return f"{per_second / scale:.3g}{suffix}"
    return f"{per_second:.3g}"


def parse_duration(text: str) -> float:
    """``"5ms"`` -> 0.005, ``"120us"`` (or ``µs``) -> 1.2e-4, ``"2s"`` or ``"2"`` -> 2.0; a ``ValueError`` for
    anything else (a negative, infinite or NaN duration included)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)(e-?\d+)?\s*(s|ms|us|µs|ns)?\s*", text.strip().lower())
    if match is None:
        raise InvalidValueError(f"not a duration: {text!r} (e.g. 5ms, 120us, 0.25s, 0.25)")
    number, exponent, unit = match.groups()
    value = float(number + (exponent or "")) / _PER_SECOND[unit or ""]
    if not math.isfinite(value):
        raise InvalidValueError(f"out of range: {text!r}")
    return value


def printable(text: str) -> str:
    """``text`` with each character that is not printable written as its escape (``\\n``, ``\\x1b``): a name
    from a model or a file cannot break a table's lines or send the terminal an escape sequence."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def text_width(text: str) -> int:
    """The columns ``text`` takes on a terminal: 2 for a wide character (CJK, most emoji), 0 for a combining one."""
    if text.isascii():
        return len(text)
    return sum(map(_char_width, text))


def _char_width(char: str) -> int:
    if unicodedata.combining(char):
        return 0
    return 2 if unicodedata.east_asian_width(char) in "WF" else 1


def _padded(cell: str, width: int, align: Align) -> str:
    fill = " " * (width - text_width(cell))
    return cell + fill if align == "left" else fill + cell


def wrapped(lines: Sequence[str], width: int | None) -> list[str]:
    """``lines`` wrapped to ``width`` (as they are when None), continuations indented two spaces; a word longer
    than the width (a path, a name) is not cut, and an empty line stays."""
    if width is None:
        return list(lines)
    return [part for line in lines for part in textwrap.wrap(line, width, subsequent_indent="  ",
                                                             break_long_words=False, break_on_hyphens=False) or [""]]


def aligned_table(rows: Sequence[Sequence[str]], aligns: Sequence[Align], rule: bool = False) -> list[str]:
    """The lines of a terminal table: columns two spaces apart, each padded to its widest cell on the side
    ``aligns`` says, no trailing spaces; ``rule``: a line of dashes under the first row (the header)."""
    widths = [max(text_width(row[i]) for row in rows) for i in range(len(aligns))]
    lines = ["  ".join(_padded(cell, width, align) for cell, width, align in zip(row, widths, aligns, strict=True))
             .rstrip() for row in rows]
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
