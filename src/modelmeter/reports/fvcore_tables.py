"""The renderers of fvcore's printed reports (``flop_count_table``, ``flop_count_str``, ``parameter_count_table``)
over plain data: per-module numbers and the trace's module table, never an analysis or a model (the public
functions, in ``modelmeter.fvcore_api``, collect the data and call these).

The output matches fvcore character for character, as fvcore printed it with tabulate 0.9 (indentation
kept). The pipe table is rendered here, so tabulate (whose 0.10 release drops fvcore's indentation) is
not needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from ..engine.trace import ModuleInfo

Align = Literal["left", "right"]

UNCALLED_NOTE = ("N/A indicates a possibly missing statistic due to how the module was called. "
                 "Missing values are still included in the parent's total.")


# numbers ---------------------------------------------------------------------------------------
_UNITS = ((1e14, 1e15, "P"), (1e11, 1e12, "T"), (1e8, 1e9, "G"), (1e5, 1e6, "M"), (1e2, 1e3, "K"))


def format_size(x: float, sig_figs: int = 3) -> str:
    """A count in human units, as fvcore prints it: ``13000 -> "13K"``, ``654321 -> "0.654M"``.

    Above 100 the value is scaled to K, M, G, T or P (thresholds are strict: 100 stays ``"100"``,
    101 is ``"0.101K"``) and printed with ``sig_figs`` decimals, trailing zeros stripped. A value that is not 0
    but too small for the last decimal is ``"<0.001"`` (``">-0.001"`` below 0): ``"0"`` is an exact zero.
    """
    size = abs(x)
    for threshold, scale, suffix in _UNITS:
        if size > threshold:
            return _fixed(x / scale, sig_figs) + suffix
    if x == 0:
        return "0"  # (-0.0 too)
    text = _fixed(x, sig_figs)
    if text.lstrip("-") != "0":
        return text
    last = f"{10.0 ** -sig_figs:.{sig_figs}f}"
    return f"<{last}" if x > 0 else f">-{last}"


def _fixed(value: float, sig_figs: int) -> str:
    """``value`` with ``sig_figs`` decimals, trailing zeros (and a trailing point) stripped."""
    text = f"{value:.{sig_figs}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _sizes(rows: Mapping[str, Mapping[str, Any]], sig_figs: int) -> dict[str, dict[str, str]]:
    """Every value of ``rows`` (module -> column -> count) as :func:`format_size` prints it; an integer met again is
    not formatted again (report tables repeat counts: identical blocks, zeros)."""
    made: dict[int, str] = {}
    out: dict[str, dict[str, str]] = {}
    for name, row in rows.items():
        cells = out[name] = {}
        for column, value in row.items():
            if type(value) is int:  # (exactly int: a float or a bool is formatted on its own)
                text = made.get(value)
                if text is None:
                    text = made[value] = format_size(value, sig_figs)
            else:
                text = format_size(value, sig_figs)
            cells[column] = text
    return out


def _format_param_size(x: int) -> str:
    """``parameter_count_table``'s own units: one decimal, no stripping, ``str(x)`` up to 100."""
    for threshold, scale, suffix in _UNITS[2:]:
        if x > threshold:
            return f"{x / scale:.1f}{suffix}"
    return str(x)


# the pipe table --------------------------------------------------------------------------------
def _is_int(cell: str) -> bool:
    try:
        int(cell)
    except ValueError:
        return False
    return True


def _is_number(cell: str) -> bool:
    try:
        value = float(cell)
    except ValueError:
        return False
    return not (math.isinf(value) or math.isnan(value)) or cell.lower() in ("inf", "-inf", "nan")


def _digits_after_point(cell: str) -> int:
    if _is_int(cell):
        return -1
    point = cell.rfind(".")
    if point < 0:
        point = cell.lower().rfind("e")
    return len(cell) - point - 1 if point >= 0 else -1


def _numeric_column(cells: list[str]) -> list[str] | None:
    """The cells as tabulate 0.9 prints a numeric column (decimal points lined up), or None if not numeric.

    A column is numeric when every cell parses as a number (an empty cell does not). Integer cells
    stay as they are, leading spaces included; a column with a fraction is reprinted with ``"g"``.
    """
    if not cells or not all(_is_number(c) for c in cells):
        return None
    if not all(_is_int(c) for c in cells):
        cells = [format(float(c), "g") for c in cells]
    after = [_digits_after_point(c) for c in cells]
    most = max(after)
    return [c + " " * (most - a) for c, a in zip(cells, after, strict=True)]


def pipe_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
               aligns: Sequence[Align] | None = None) -> str:
    """A markdown pipe table with every cell kept verbatim (leading spaces too).

    Without ``aligns`` the columns are aligned as tabulate 0.9 aligns fvcore's tables: numeric
    columns right, the others left. Each column is at least its header plus two wide.
    """
    columns: list[list[str]] = [[str(row[i]) for row in rows] for i in range(len(headers))]
    chosen: list[Align] = []
    for i, cells in enumerate(columns):
        if aligns is not None:
            chosen.append(aligns[i])
            continue
        numeric = _numeric_column(cells)
        if numeric is None:
            chosen.append("left")
        else:
            columns[i] = numeric
            chosen.append("right")
    widths = [max([len(h) + 2, *map(len, cells)]) for h, cells in zip(headers, columns, strict=True)]

    def line(cells: Iterable[str]) -> str:
        padded = (c.ljust(w) if a == "left" else c.rjust(w) for c, w, a in zip(cells, widths, chosen, strict=True))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(":" + "-" * (w + 1) if a == "left" else "-" * (w + 1) + ":"
                          for w, a in zip(widths, chosen, strict=True)) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in zip(*columns, strict=True))])


# module repr -----------------------------------------------------------------------------------
def _indent_tail(text: str, spaces: int) -> str:
    first, *rest = text.split("\n")
    return "\n".join([first, *(" " * spaces + line for line in rest)])


def annotated_repr(head: str, lines: Sequence[str], children: Sequence[tuple[str, str]]) -> str:
    """``repr(module)``'s layout: ``head(`` + ``lines`` + ``(key): child`` blocks, each indented by 2.

    A block with exactly one line and no children prints inline, e.g. ``ReLU(#params: 0)``.
    """
    body = list(lines) + [f"({key}): {_indent_tail(text, 2)}" for key, text in children]
    if not body:
        return f"{head}()"
    if len(lines) == 1 and not children:
        return f"{head}({lines[0]})"
    return head + "(\n  " + "\n  ".join(body) + "\n)"


# statistics ------------------------------------------------------------------------------------
Stats = dict[str, dict[str, Any]]


def _children(names: Iterable[str]) -> dict[str, list[str]]:
    """Each parent's children among ``names`` (by dotted name: ``"a.b"``'s parent is ``"a"``, ``"a"``'s ``""``)."""
    kids: dict[str, list[str]] = {}
    for name in names:
        if name:
            parent = name.rpartition(".")[0]
            found = kids.get(parent)
            if found is None:
                kids[parent] = [name]
            else:
                found.append(name)
    return kids


def _group_by_module(columns: Mapping[str, Mapping[str, Any]]) -> Stats:
    """``{column: {module: value}}`` -> ``{module: {column: value}}``, modules in order of first appearance."""
    out: Stats = {}
    for column, values in columns.items():
        for module, value in values.items():
            out.setdefault(module, {})[column] = value
    return out


def _drop_zero_rows(stats: Stats, keep: set[str], keep_parents: bool) -> Stats:
    """Rows with a non-zero value, or in ``keep``, or (``keep_parents``) with a kept child; reachable from the root."""
    kids = _children(stats)
    kept: set[str] = set()

    def visit(name: str) -> bool:
        child_kept = False
        for child in kids.get(name, ()):
            if visit(child):  # (every child visited: each decides its own row)
                child_kept = True
        if (keep_parents and child_kept) or name in keep or any(v != 0 for v in stats[name].values()):
            kept.add(name)
            return True
        return False

    visit("")
    return {name: row for name, row in stats.items() if name in kept}


def _stats_table(stats: dict[str, dict[str, str]], max_depth: int, columns: Sequence[str]) -> str:
    """fvcore's statistics table: single-child chains with compatible values merged into one row."""
    kids = _children(stats)

    def merge(a: dict[str, str], b: dict[str, str]) -> dict[str, str] | None:
        if a.keys() != b.keys() or any(a[k] != b[k] and a[k] and b[k] for k in a):
            return None
        return {k: a[k] or b[k] for k in a}

    def fast_forward(name: str) -> str:
        while len(kids.get(name, [])) == 1:
            child = kids[name][0]
            merged = merge(stats[name], stats[child])
            if merged is None:
                break
            stats[child] = merged
            name = child
        return name

    root = fast_forward("")
    strip = len(root) + 1 if root else 0
    table: list[list[str]] = []

    def add_row(name: str, label: str, level: int) -> None:
        indent = " " * level
        table.append([indent + label, *(indent + stats[name][c] if c in stats[name] else "" for c in columns)])

    def fill(parent: str, level: int) -> None:
        if level > max_depth:
            return
        for child in kids.get(parent, []):
            name = fast_forward(child)
            add_row(name, name[strip:], level)
            fill(name, level + 1)

    add_row(root, root or "model", 0)
    fill(root, 1)
    return pipe_table(["module", *columns], table)


# renderers ---------------------------------------------------------------------------------------
def flop_count_table_text(params: Mapping[str, int], shapes: Mapping[str, tuple[int, ...]],
                          counts: Mapping[str, Mapping[str, Any]], uncalled: Mapping[str, set[str]],
                          max_depth: int = 3, show_param_shapes: bool = True) -> str:
    """fvcore's ``flop_count_table``: ``params`` (parameter elements by name prefix) and ``counts`` (column ->
    count by canonical module name, e.g. ``{"#flops": ...}``) per module; ``shapes`` (parameter name -> shape)
    as rows when ``show_param_shapes``; ``uncalled`` (column -> modules never called) left blank.

    Rows to ``max_depth`` levels; all-zero modules dropped; a chain of single children with equal values shown
    as one row named by the deepest module.
    """
    params_header = "#parameters or shape" if show_param_shapes else "#parameters"
    columns: dict[str, Mapping[str, Any]] = {params_header: params, **counts}
    numbers = _drop_zero_rows(_group_by_module(columns), keep={""}, keep_parents=True)
    stats = _sizes(numbers, 3)
    for column, names in uncalled.items():
        for name in names & stats.keys():
            stats[name][column] = ""
    for name, shape in shapes.items():
        if name in stats:
            if show_param_shapes:
                stats[name][params_header] = str(shape)
            else:
                del stats[name]
    return _stats_table(stats, max_depth, list(columns))


def flop_count_str_text(modules: Sequence[ModuleInfo], columns: Mapping[str, Mapping[str, Any]],
                        uncalled: Mapping[str, set[str]]) -> str:
    """fvcore's ``flop_count_str``: ``repr(model)``, rebuilt from the module table (``Trace.modules``: labels,
    ``extra_repr`` and child slots), with ``columns`` (e.g. ``{"#params": ..., "#flops": ...}``, by canonical
    module name) added to every module. Modules whose values are all zero get no line; ``uncalled`` (column ->
    modules never called) show ``N/A``, with a note on top."""
    table = {info.name: info for info in modules}
    values = {column: {name: numbers.get(name, 0) for name in (*numbers, *table)}
              for column, numbers in columns.items()}
    all_uncalled = set().union(*uncalled.values())
    # fvcore keeps the root only when no module is uncalled (its force-keep set replaces the root)
    numbers = _drop_zero_rows(_group_by_module(values), keep=all_uncalled or {""}, keep_parents=False)
    stats = _sizes(numbers, 2)
    for column, names in uncalled.items():
        for name in names:
            stats.setdefault(name, {})[column] = "N/A"

    def block(info: ModuleInfo | None, path: str) -> str:
        """One module's repr; ``path`` is how it was reached (a shared module's second path has no numbers)."""
        if info is None:
            return "None"
        lines = info.extra_repr.split("\n") if info.extra_repr else []
        if stats.get(path):
            lines.append(", ".join(f"{k}: {v}" for k, v in stats[path].items()))
        children = [(key, block(None if child is None else table[child], f"{path}.{key}" if path else key))
                    for key, child in info.children]
        return annotated_repr(info.label, lines, children)

    text = block(modules[0], "")
    return f"{UNCALLED_NOTE}\n{text}" if all_uncalled else text


def parameter_count_table_text(counts: Mapping[str, int], shapes: Mapping[str, tuple[int, ...]],
                               max_depth: int = 3) -> str:
    """fvcore's ``parameter_count_table``: ``counts`` (parameter elements by name prefix) per module and
    ``shapes`` (parameter name -> shape) to ``max_depth`` levels."""
    kids = _children(counts)
    table = [["model", _format_param_size(counts.get("", 0))]]

    def fill(parent: str, level: int) -> None:
        if level >= max_depth:
            return
        indent = " " * (level + 1)
        for name in kids.get(parent, []):
            if name in shapes:
                table.append([indent + name, indent + str(shapes[name])])
            else:
                table.append([indent + name, indent + _format_param_size(counts[name])])
                fill(name, level + 1)

    fill("", 0)
    return pipe_table(["name", "#elements or shape"], table)
