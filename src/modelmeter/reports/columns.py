"""The columns of the module table (``render``'s ``table`` and ``markdown``): which there are, their cells in one
unit per column, and which to leave out when the table must fit a width.

A column has a key: ``type``, ``params``, ``shapes``, a metric's name (its values, ``flops``) or ``%`` and the
metric's name (its share of the model's total, ``%flops``). docs/reports.md, "Fitting the width".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidValueError
from .format import Align, format_bytes, format_time, printable
from .fvcore_tables import format_size
from .result import BYTE_METRICS, MEMORY_METRICS, RATIO_METRICS, TIME_METRICS, ModuleRow, Result

# The per-phase metrics' prefixes (``forward_flops``, ``optimizer_time``).
_PHASE_PREFIXES = ("forward_", "backward_", "recompute_", "optimizer_")
# The roofline's per-phase columns: in JSON, CSV and HTML; the text reports give the phases' times in a note.
PHASE_COLUMNS = frozenset(f"{phase}{metric}" for phase in _PHASE_PREFIXES for metric in ("bytes", "time"))
# The headers of the ratios (which have no share of the model's).
RATIO_HEADERS = {"intensity": "flops/byte", "compute_bound": "bound"}
# Words a header is shortened by when the table does not fit (``%forward_flops`` -> ``%fwd_flops``).
_SHORT_WORDS = (("activation_bytes", "act_bytes"), ("activations", "acts"), ("forward_", "fwd_"),
                ("backward_", "bwd_"), ("recompute_", "rcp_"), ("saved_bytes", "saved"), ("peak_memory", "peak"),
                ("flops/byte", "fl/B"), ("#params", "params"), ("output shapes", "output"))


def format_metric(metric: str, value: float) -> str:
    """A metric's value as the reports print it: bytes in binary units, seconds in s/ms/µs/ns, FLOPs per byte with
    three significant figures, the compute-bound share as the bound, counts as fvcore does."""
    if metric in BYTE_METRICS:
        return format_bytes(value)
    if metric in TIME_METRICS:
        return format_time(value)
    if metric == "intensity":
        return _three_figures(value)
    if metric == "compute_bound":
        return format_bound(value)
    return format_size(value)


def _three_figures(value: float) -> str:
    """``value`` with three significant figures, as the HTML page prints a ratio: ``9.54``, ``2350`` (not
    ``2.35e+03``); an exponent only below 1e-4 or from 1e16 on, where the digits would run long."""
    shown = f"{value:.3g}"
    if "e+" in shown and abs(value) < 1e16:
        return f"{float(shown):.0f}"
    return shown


def format_percent(fraction: float) -> str:
    """A fraction as a percentage with one decimal, ``0.25 -> "25.0%"``; one above 0 too small for the decimal is
    ``"<0.1%"``: ``"0.0%"`` is an exact zero (as ``0`` is in a column of values)."""
    text = f"{100 * fraction:.1f}%"
    return "<0.1%" if text == "0.0%" and fraction > 0 else text


def format_share(part: float, total: float) -> str:
    """``part``'s share of ``total`` as :func:`format_percent` prints it (``"0.0%"`` of a total of 0), and
    ``">99.9%"`` for a part below the total that would round to ``"100.0%"``: that is the whole total only."""
    if not total:
        return "0.0%"
    text = format_percent(part / total)
    return ">99.9%" if text == "100.0%" and part < total else text


def format_whole_percent(fraction: float) -> str:
    """A fraction of 0 to 1 as a whole-number percentage, ``0.25 -> "25%"``; one that rounds to ``"0%"`` or
    ``"100%"`` without being exactly 0 or 1 is ``"<1%"`` or ``">99%"`` (``"0%"`` and ``"100%"`` are exact)."""
    text = f"{100 * fraction:.0f}%"
    if text == "0%" and fraction > 0:
        return "<1%"
    if text == "100%" and fraction < 1:
        return ">99%"
    return text


def format_bound(share: float) -> str:
    """``0.9 -> "compute 90%"``: what bounds most of the time, and its share of it (:func:`format_whole_percent`:
    ``"compute >99%"`` for a share that rounds to 100% but is not all of it)."""
    kind, part = ("compute", share) if share >= 0.5 else ("memory", 1 - share)
    return f"{kind} {format_whole_percent(part)}"


@dataclass(frozen=True)
class Column:
    """One column of the table: its key, full and short header, alignment and one cell per row."""

    key: str
    header: str
    short: str
    align: Align
    cells: list[str]


def column_keys(result: Result, shapes: bool = False) -> list[str]:
    """Every column of ``result``'s table, in table order (the module's name comes first and has no key): type,
    #params, then each metric's values and share (a ratio: its value only), and the output shapes when asked."""
    keys = ["type", "params"]
    for metric in result.metrics:
        if metric in PHASE_COLUMNS:
            continue
        keys += [metric] if metric in RATIO_METRICS else [metric, f"%{metric}"]
    return keys + (["shapes"] if shapes else [])


def drop_rank(key: str) -> int:
    """When a column is left out to fit a width: the lowest rank first (ties: the rightmost first).

    0 shares of per-phase and memory metrics, 1 per-phase values, 2 other shares but of flops and time, 3 ratios
    (flops/byte, bound), 4 bytes but the peak, 5 %flops and %time, 6 type, 7 activations, 8 peak memory,
    9 #params, 10 output shapes, 11 time, 12 flops and any other metric.
    """
    share = key.startswith("%")
    metric = key.removeprefix("%")
    phase = metric.startswith(_PHASE_PREFIXES)
    ranks = ((share and (phase or metric in MEMORY_METRICS), 0), (phase, 1),
             (share and metric not in ("flops", "time"), 2), (metric in RATIO_METRICS, 3),
             (metric in BYTE_METRICS and metric != "peak_memory", 4), (share, 5), (key == "type", 6),
             (metric == "activations", 7), (metric == "peak_memory", 8), (key == "params", 9), (key == "shapes", 10),
             (metric == "time", 11))
    return next((rank for matches, rank in ranks if matches), 12)


def chosen_keys(result: Result, columns: Sequence[str], shapes: bool) -> list[str]:
    """The columns named in ``columns`` (``"all"``: every one), in the order given; a :class:`ValueError` naming
    any the result has not."""
    available = column_keys(result, shapes=shapes or "shapes" in columns)
    if list(columns) == ["all"]:
        return available
    unknown = [key for key in columns if key not in available]
    if unknown:
        raise InvalidValueError(f"no column {', '.join(map(repr, unknown))} in this result; its columns: "
                                f"{', '.join(available)} (or all)")
    return list(dict.fromkeys(columns))


def build_columns(result: Result, rows: list[ModuleRow], keys: Sequence[str]) -> list[Column]:
    """The module column then one :class:`Column` per key, for ``rows``."""
    names = ["  " * row.depth + printable(row.name or "model") for row in rows]
    return [Column("module", "module", "module", "left", names), *(_column(result, rows, key) for key in keys)]


def _column(result: Result, rows: list[ModuleRow], key: str) -> Column:
    if key == "type":
        return _text_column(key, "type", [printable(row.type) for row in rows])
    if key == "shapes":
        return _text_column(key, "output shapes", [shapes_cell(row) for row in rows])
    if key == "params":
        return _numbers(key, "#params", [row.params for row in rows], _count_unit, [True] * len(rows))
    called = [row.called for row in rows]
    if key.startswith("%"):
        metric = key[1:]
        total = result.total(metric)
        shares = [format_share(row.metrics.get(metric, 0), total) for row in rows]
        return _right(key, key, [cell if row.called else "N/A" for cell, row in zip(shares, rows, strict=True)])
    if key in RATIO_METRICS:
        return _right(key, RATIO_HEADERS[key], [ratio_cell(key, row) for row in rows])
    return _numbers(key, f"#{key}", [row.metrics.get(key, 0) for row in rows], _unit_of(key), called)


def shapes_cell(row: ModuleRow) -> str:
    """A module's output shapes: each distinct one, with its number of calls when more than one
    (``"1x64x56x56"``, ``"2x5x8 (3 calls); 1x5x8"``), ``"-"`` for none."""
    if not row.output_shapes:
        return "-"
    return "; ".join(shape if calls == 1 else f"{shape} ({calls} calls)" for shape, calls in row.output_shapes.items())


def ratio_cell(metric: str, row: ModuleRow) -> str:
    if not row.called:
        return "N/A"
    return format_metric(metric, row.metrics.get(metric, 0)) if row.metrics.get("time") else "-"


def _text_column(key: str, header: str, cells: list[str]) -> Column:
    return Column(key, header, shorten(header), "left", cells)


def _right(key: str, header: str, cells: list[str]) -> Column:
    return Column(key, header, shorten(header), "right", cells)


def shorten(header: str) -> str:
    """The header as a narrow table prints it (``#activation_bytes`` -> ``#act_bytes``)."""
    for word, short in _SHORT_WORDS:
        header = header.replace(word, short)
    return header


# One unit per column ---------------------------------------------------------------------------------
Unit = tuple[float, str]
UnitKind = Literal["count", "bytes", "time"]
_COUNT_UNITS: tuple[tuple[float, float, str], ...] = (
    (1e14, 1e15, "P"), (1e11, 1e12, "T"), (1e8, 1e9, "G"), (1e5, 1e6, "M"), (1e2, 1e3, "K"))
_BYTE_UNITS: tuple[Unit, ...] = ((2.0 ** 40, "TiB"), (2.0 ** 30, "GiB"), (2.0 ** 20, "MiB"), (2.0 ** 10, "KiB"))
_TIME_UNITS: tuple[Unit, ...] = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"))


def unit_column(key: str, header: str, values: Sequence[float | None], kind: UnitKind,
                short: str | None = None) -> Column:
    """A right-aligned column of ``values`` in one unit of ``kind`` (that of the largest value), as the module
    table's metric columns are printed; ``"-"`` for a value that is None (not known for that row)."""
    unit_of = {"count": _count_unit, "bytes": _byte_unit, "time": _time_unit}[kind]
    known = [value is not None for value in values]
    column = _numbers(key, header, [0.0 if value is None else value for value in values], unit_of, known)
    cells = [cell if present else "-" for cell, present in zip(column.cells, known, strict=True)]
    return Column(key, header, short or shorten(header), "right", cells)


def _unit_of(metric: str) -> Callable[[float], Unit]:
    """How a metric's column picks its unit from its largest value."""
    if metric in BYTE_METRICS:
        return _byte_unit
    if metric in TIME_METRICS:
        return _time_unit
    return _count_unit


def _count_unit(largest: float) -> Unit:
    """fvcore's units for a count (K above 100, M above 100K, ...: ``format_size``'s thresholds)."""
    return next(((scale, suffix) for threshold, scale, suffix in _COUNT_UNITS if largest > threshold), (1.0, ""))


def _byte_unit(largest: float) -> Unit:
    return next((unit for unit in _BYTE_UNITS if largest >= unit[0]), (1.0, "B"))


def _time_unit(largest: float) -> Unit:
    return next((unit for unit in _TIME_UNITS if largest >= unit[0]), (1e-9, "ns"))


def _numbers(key: str, header: str, values: list[float], unit_of: Callable[[float], Unit],
             called: list[bool]) -> Column:
    """Values in the one unit of the column's largest, trailing zeros stripped: a count with three decimals, as
    ``format_size`` prints it (the model's row reads as fvcore's), bytes and times with the decimals that give the
    largest four significant figures. A value too small to show is ``<0.01G``, a zero ``0``, a module never
    called ``N/A``; a value that is not finite (a handle's NaN) as Python prints it, leaving the unit to the others."""
    largest = max((abs(v) for v, c in zip(values, called, strict=True) if c and math.isfinite(v)), default=0.0)
    scale, suffix = unit_of(largest)
    whole = len(str(int(largest / scale))) if largest else 1
    decimals = 3 if unit_of is _count_unit else max(0, 4 - whole)
    cells = []
    for value, ran in zip(values, called, strict=True):
        if not ran:
            cells.append("N/A")
        elif value == 0:
            cells.append("0")
        elif not math.isfinite(value):
            cells.append(str(value))
        else:
            cells.append(_fixed(value / scale, decimals, suffix))
    return _right(key, header, cells)


def _fixed(value: float, decimals: int, suffix: str) -> str:
    text = f"{value:.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    if text.lstrip("-") in ("0", ""):  # not zero, but less than the column's last digit
        text = f"{'-' if value < 0 else ''}<{10.0 ** -decimals:.{decimals}f}" if decimals else "<1"
    return text + suffix


# fitting a width -----------------------------------------------------------------------------------
def table_width(columns: Sequence[Column], short: bool) -> int:
    """The widest line of the table: columns two spaces apart."""
    widths = [max(len(c.short if short else c.header), *map(len, c.cells)) for c in columns]
    return sum(widths) + 2 * (len(widths) - 1)


def fit(columns: list[Column], width: int,
        rank: Callable[[str], int] = drop_rank) -> tuple[list[Column], bool, list[str]]:
    """The columns that fit in ``width`` characters, whether their headers are the short ones, and the keys left
    out: the full headers if all fit, else the short ones, leaving out columns by ``rank`` (the lowest first;
    the module table's :func:`drop_rank` by default) until the table fits or only the first column and one more
    are left."""
    if table_width(columns, short=False) <= width:
        return columns, False, []
    module, by_key = columns[0], {column.key: column for column in columns[1:]}

    def fits(keys: list[str]) -> bool:
        return table_width([module, *(by_key[key] for key in keys)], short=True) <= width

    kept, dropped = fit_keys(list(by_key), fits, rank)
    return [module, *(by_key[key] for key in kept)], True, dropped


def fit_keys(keys: list[str], fits: Callable[[list[str]], bool],
             rank: Callable[[str], int] = drop_rank) -> tuple[list[str], list[str]]:
    """``keys`` less those ``rank`` (:func:`drop_rank` by default) leaves out first, until ``fits`` says yes (or
    one key is left); and the keys left out."""
    kept = list(keys)
    dropped: list[str] = []
    while not fits(kept) and len(kept) > 1:
        index = min(range(len(kept)), key=lambda i: (rank(kept[i]), -i))
        dropped.append(kept.pop(index))
    return kept, dropped


def dropped_note(dropped: Sequence[str], width: int) -> str:
    """The line under a table that left columns out."""
    return (f"Left out to fit {width} characters: {', '.join(dropped)} "
            "(all columns: --wide or --columns all; choose: --columns NAME,...)")
