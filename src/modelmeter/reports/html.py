"""A :class:`Result` as one self-contained, interactive HTML file: an icicle chart, sortable tables, the run's notes.

Everything is inlined (styles, a small hand-written script, the data as JSON), so the file opens offline and
makes no requests; a Content-Security-Policy forbids any. With ``compare`` (a second Result, e.g. before/after a
change) each module and operator also carries its difference, value - compare's value. Byte metrics (memory,
traffic) show in binary units, times in s/ms/µs/ns; a metric that does not add up over a module's children
(``peak_memory``, ``intensity``, ``compute_bound``) is a table column but cannot size the chart. A result with a
roofline summary (a device was chosen) also gets a roofline chart, whose geometry :func:`roofline_chart` computes;
one with the memory analysis the step's memory timeline and the operator mix (:mod:`.html_memory`).
"""

from __future__ import annotations

import html
import math
import os
import re
from collections.abc import Iterable
from typing import Any

from .. import _version
from ..errors import InvalidTypeError
from ..io.atomic import atomic_write
from . import html_memory, html_parallel, jsontext
from .columns import shapes_cell
from .format import printable
from .fvcore_tables import format_size
from .render import convention_note, memory_note
from .result import BYTE_METRICS, NOT_ADDITIVE, RATIO_METRICS, TIME_METRICS, Result

__all__ = ["html_data", "module_deltas", "render_html", "roofline_chart", "write_html"]

# How the page shows the roofline's two ratios (docs/roofline.md): FLOPs per byte, and a share of the time.
_RATIO_UNITS = {"intensity": "intensity", "compute_bound": "share"}
assert set(_RATIO_UNITS) == RATIO_METRICS


def _input_text(spec: dict[str, Any]) -> str:
    """``"1x3x64x64 float32"`` for a tensor input, its JSON otherwise."""
    if "shape" in spec:
        dtype = spec.get("dtype")
        return "x".join(str(d) for d in spec["shape"]) + (f" {dtype}" if dtype else "")
    return jsontext.dumps(spec, default=str)


def _values_by_name(result: Result) -> dict[str, dict[str, float]]:
    """``{module name: {"params": ..., metric: ...}}`` of ``result``, built once: a lookup per module would make a
    comparison of two large models quadratic."""
    values: dict[str, dict[str, float]] = {}
    for row in result.modules:
        values.setdefault(row.name, {"params": row.params, **row.metrics})  # as Result.row, the first of a name
    return values


def module_deltas(result: Result, compare: Result) -> dict[str, dict[str, float | None]]:
    """Per module of either side: ``{"params" or metric: value - compare's value}`` for ``result``'s metrics.

    A module only one side has counts 0 on the other; a metric ``compare`` did not measure gives ``None``.
    """
    keys = ["params", *result.metrics]
    now, before = _values_by_name(result), _values_by_name(compare)
    deltas = {}
    for name in {**now, **before}:  # result's modules in its order, then those only compare has
        mine, theirs = now.get(name, {}), before.get(name, {})
        deltas[name] = {key: (mine.get(key, 0) - theirs.get(key, 0)
                              if key == "params" or key in compare.metrics else None) for key in keys}
    return deltas


def _additive(metric: str) -> bool:
    """Whether a module's ``metric`` is the sum of its children's and its own work (it can size the icicle)."""
    return metric not in NOT_ADDITIVE


def _units(result: Result) -> dict[str, str]:
    """``{metric: "time" | "intensity" | "share"}`` for the result's roofline metrics, shown in their own units."""
    units = {metric: "time" for metric in result.metrics if metric in TIME_METRICS}
    units.update((metric, _RATIO_UNITS[metric]) for metric in result.metrics if metric in _RATIO_UNITS)
    return units


def _operator_metrics(result: Result) -> list[str]:
    """The metrics that split by operator: all but a module's peak (a ratio is one per operator too)."""
    return [metric for metric in result.metrics if metric not in NOT_ADDITIVE or metric in RATIO_METRICS]


def _operators(result: Result, compare: Result | None) -> list[list[Any]]:
    """``[op, [value per metric], [delta per metric] or None]``, the model's totals by operator, costliest first,
    for the :func:`_operator_metrics`."""
    by_op = result.root.by_operator
    before = compare.root.by_operator if compare is not None else {}
    metrics = _operator_metrics(result)
    ops = {op for metric in metrics for op in [*by_op.get(metric, {}), *before.get(metric, {})]}
    first = by_op.get(metrics[0], {}) if metrics else {}
    rows = []
    for op in sorted(ops, key=lambda op: (-first.get(op, 0), op)):  # the costliest first
        values = [by_op.get(metric, {}).get(op, 0) for metric in metrics]
        deltas = None
        if compare is not None:
            deltas = [value - before.get(metric, {}).get(op, 0) if metric in compare.metrics else None
                      for metric, value in zip(metrics, values, strict=True)]
        rows.append([op, values, deltas])
    return rows


def html_data(result: Result, compare: Result | None = None, torch_version: str | None = None) -> dict[str, Any]:
    """The JSON the page reads: the header, one compact row per module, operator totals, notes, deltas.

    ``modules`` rows are ``[name, type, called, params, value per metric]``; with ``compare``, modules only it
    has follow (zero values, ``status`` ``"-"``; ``"+"`` marks modules only ``result`` has) and ``deltas`` holds
    ``[params delta, delta per metric]`` per row. ``byte_metrics`` are shown in binary units, ``chart_metrics``
    (params and the additive metrics) can size the chart, ``operators`` rows hold the ``operator_metrics``;
    ``memory`` is the peak's summary line (or None). ``torch_version``: the torch that recorded the run (a saved
    trace's), by default this process's. ``shapes`` (only when the result has output shapes) holds each row's
    output shapes as the table prints them. Only a result with roofline metrics has ``units`` (``{metric: "time",
    "intensity" or "share"}``) and ``roofline`` (:func:`roofline_chart`), and only a result with the memory
    analysis has ``operator_mix`` and, when it holds a timeline, ``memory_timeline``
    (:mod:`~modelmeter.reports.html_memory`), so other pages stay as they were. ``exact`` (only when some integer
    of the data is 2**53 or beyond, which the page's JSON.parse would round) maps the double each became, in digits,
    to the integer's digits (None where two became one double), so the page shows every digit.
    """
    rows: list[list[Any]] = [
        [row.name, row.type, row.called, row.params, *(row.metrics.get(m, 0) for m in result.metrics)]
        for row in result.modules]
    data: dict[str, Any] = {
        "model": result.model,
        "inputs": [_input_text(spec) for spec in result.inputs],
        "convention": convention_note(result.convention),
        "execution": result.execution,
        "version": _version.__version__,
        "torch": _this_torch() if torch_version is None else torch_version,
        "metrics": result.metrics,
        "byte_metrics": [metric for metric in result.metrics if metric in BYTE_METRICS],
        "chart_metrics": ["params", *(metric for metric in result.metrics if _additive(metric))],
        "operator_metrics": _operator_metrics(result),
        "memory": memory_note(result.memory) if result.memory else None,
        "modules": rows,
        "operators": _operators(result, compare),
        "unsupported": sorted(result.unsupported.items(), key=lambda item: (-item[1], item[0])),
        "assumptions": result.assumptions,
        "compare": None,
    }
    units = _units(result)
    if units:
        data["units"] = units
    if result.roofline:
        data["roofline"] = roofline_chart(result.roofline)
    if result.memory:
        data["operator_mix"] = html_memory.operator_mix_chart(result)
        if result.memory.get("timeline", {}).get("length"):  # a result saved before it had one has none
            data["memory_timeline"] = html_memory.memory_timeline_chart(result.memory)
    if compare is not None:
        deltas = module_deltas(result, compare)
        own = {row.name for row in result.modules}
        theirs = {row.name for row in compare.modules}
        for row in compare.modules:
            if row.name not in own:
                rows.append([row.name, row.type, row.called, 0, *(0 for _ in result.metrics)])
        keys = ["params", *result.metrics]
        data["compare"] = {
            "model": compare.model,
            "inputs": [_input_text(spec) for spec in compare.inputs],
            "deltas": [[deltas[row[0]][key] for key in keys] for row in rows],
            "status": ["" if row[0] in own and row[0] in theirs else "+" if row[0] in own else "-" for row in rows],
        }
    shapes = {row.name: shapes_cell(row) for row in result.modules if row.output_shapes}
    if shapes:
        data["shapes"] = [shapes.get(row[0], "-") for row in rows]
    exact = _unsafe_integers(data)
    if exact:
        data["exact"] = exact
    return data


# Number.MAX_SAFE_INTEGER: JavaScript's numbers hold every integer up to it; from 2**53 on a double stands for
# several integers (JSON.parse reads 2**53 + 1 as 2**53), so the page needs the digits of every larger one
_SAFE = 2**53 - 1


def _unsafe_integers(data: Any) -> dict[str, str | None]:
    """``{the double an integer from 2**53 on becomes, in digits: the integer's digits}`` for every such integer in
    ``data``, so that the page shows the result's exact values (``None`` where two integers become one double)."""
    found: dict[str, str | None] = {}
    stack = [data]
    while stack:
        value = stack.pop()
        kind = type(value)  # the data is plain JSON: exact types, looked at once (it is walked per page)
        if kind is dict:
            stack.extend(value.values())
        elif kind is list or kind is tuple:
            stack.extend(value)
        elif kind is int and not -_SAFE <= value <= _SAFE:
            rounded, digits = str(int(float(value))), str(value)
            found[rounded] = digits if found.get(rounded, digits) == digits else None
    return found


# the roofline chart ----------------------------------------------------------------------------
_WIDTH, _HEIGHT = 760, 440  # the chart's viewBox
_PLOT = (80.0, 12.0, 744.0, 384.0)  # the plot box in it: left, top, right, bottom (room for the axes' labels)
_RADIUS = (3.0, 18.0)  # the points' radii: the area grows with the operator's time, the longest gets the largest
_PAD = _RADIUS[1] + 2  # the decades start this far inside the plot box, so that no point sticks out of it
_MAX_TICKS = 8


class _LogScale:
    """Whole decades ``lo..hi`` (10**lo to 10**hi) mapped linearly in log10 onto pixels ``start..end``; a tick
    every ``step`` decades (more than one when there are many), one at each end."""

    def __init__(self, values: Iterable[float], start: float, end: float) -> None:
        logs = [math.log10(value) for value in values]
        self.lo = math.floor(min(logs))
        decades = max(math.ceil(max(logs)) - self.lo, 1)
        self.step = math.ceil(decades / _MAX_TICKS)
        self.hi = self.lo + self.step * math.ceil(decades / self.step)
        self.start, self.end = start, end

    def __call__(self, value: float) -> float:
        return self.start + (math.log10(value) - self.lo) / (self.hi - self.lo) * (self.end - self.start)

    def ticks(self) -> list[list[Any]]:
        """``[pixel, label]`` of the ticks."""
        return [[round(self(10.0 ** d), 2), _decade(d)] for d in range(self.lo, self.hi + 1, self.step)]


def _decade(exponent: int) -> str:
    """``"1e-5"``, ``"0.01"``, ``"1"``, ``"10K"``: a power of ten in the report's units."""
    if exponent < -3:
        return f"1e{exponent}"
    return f"{10.0 ** exponent:g}" if exponent < 0 else format_size(10 ** exponent)


def _plotted(operators: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operators a log-log chart can place: some FLOPs, some bytes, some time."""
    return [op for op in operators if op["flops"] > 0 and op["bytes"] > 0 and op["time"] > 0]


def _roof(name: str, peak: float, bandwidth: float, x: _LogScale, y: _LogScale) -> dict[str, Any]:
    """One roof in pixels: the bandwidth slope from the chart's left (or bottom) edge up to the ridge, then flat."""
    ridge = peak / bandwidth
    start = max(10.0 ** x.lo, 10.0 ** y.lo / bandwidth)  # where the slope enters the plot
    corners = [(start, start * bandwidth), (ridge, peak), (10.0 ** x.hi, peak)]
    return {"name": name, "peak": peak, "ridge": ridge, "label": f"{name} peak {format_size(peak)}FLOP/s",
            "points": [[round(x(i), 2), round(y(f), 2)] for i, f in corners]}


def roofline_chart(summary: dict[str, Any]) -> dict[str, Any]:
    """The roofline chart of a ``Result.roofline`` summary, in the pixels of an SVG viewBox (``width`` x ``height``).

    Log-log over whole decades, drawn inside the ``plot`` box (left, top, right, bottom) with room for the largest
    point: x = arithmetic intensity (FLOPs per byte), y = attainable FLOP/s (FLOPs / time). ``points`` are the
    summary's operators, longest first (``x``, ``y``, radius ``r`` growing with time, plus the operator's own
    numbers); those with 0 FLOPs, 0 bytes or 0 time have no place on a log scale and are only counted in
    ``omitted``. ``roofs``: the matrix roof (``device.peak``) and the vector roof (``device.vector_peak``), each
    a polyline of the bandwidth slope up to its ridge, then flat; ``ridge`` is the matrix ridge
    ``peak / bandwidth`` in FLOPs per byte and pixels. ``summary``: the totals, without the operators.
    """
    device = summary["device"]
    bandwidth = device["bandwidth"]
    peaks = {"matrix": device["peak"]}
    if device.get("vector_peak"):
        peaks["vector"] = device["vector_peak"]
    operators = summary.get("operators", [])
    shown = sorted(_plotted(operators), key=lambda op: -op["time"])
    left, top, right, bottom = _PLOT
    x = _LogScale([*(op["flops"] / op["bytes"] for op in shown), *(p / bandwidth for p in peaks.values())],
                  left + _PAD, right - _PAD)
    y = _LogScale([*(op["flops"] / op["time"] for op in shown), *peaks.values()], bottom - _PAD, top + _PAD)
    longest = shown[0]["time"] if shown else 1.0
    points = []
    for op in shown:
        intensity, rate = op["flops"] / op["bytes"], op["flops"] / op["time"]
        radius = _RADIUS[0] + (_RADIUS[1] - _RADIUS[0]) * math.sqrt(op["time"] / longest)
        points.append({"x": round(x(intensity), 2), "y": round(y(rate), 2), "r": round(radius, 2),
                       "operator": op["operator"], "dtype": op["dtype"], "flops": op["flops"],
                       "bytes": op["bytes"], "time": op["time"], "intensity": intensity, "rate": rate,
                       "compute_bound": bool(op["compute_bound"])})
    ridge = device["peak"] / bandwidth
    dtype = summary.get("dtype")  # None when the run did no matrix work
    return {
        "width": _WIDTH, "height": _HEIGHT, "plot": list(_PLOT),
        "title": f"Roofline on {device['label']}" + (f" ({dtype})" if dtype else ""),
        "x_label": "arithmetic intensity (FLOPs/byte)", "y_label": "attainable FLOP/s (FLOPs / time)",
        "x_ticks": x.ticks(), "y_ticks": y.ticks(),
        "roofs": [_roof(name, peak, bandwidth, x, y) for name, peak in peaks.items()],
        "ridge": {"intensity": ridge, "x": round(x(ridge), 2), "y": round(y(device["peak"]), 2)},
        "points": points, "omitted": len(operators) - len(shown),
        "summary": {key: value for key, value in summary.items() if key != "operators"},
    }


def _json_for_script(data: dict[str, Any]) -> str:
    """JSON that cannot end its ``<script>`` element early: ``<``, ``>`` and ``&`` become ``\\u`` escapes."""
    text = jsontext.dumps(data, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _this_torch() -> str:
    import torch  # here: a report of a saved trace names the torch that recorded it and needs none

    return str(torch.__version__)


def render_html(result: Result, *, compare: Result | None = None, torch_version: str | None = None) -> str:
    """The report page of ``result`` (and its differences to ``compare``), as one self-contained HTML string;
    ``torch_version`` as for :func:`html_data`."""
    for argument, value in (("result", result), ("compare", compare)):
        if not isinstance(value, Result) and (argument == "result" or value is not None):
            raise InvalidTypeError(f"{argument} must be a modelmeter Result (Analysis.result(), Result.from_json), "
                                   f"got {type(value).__name__}")
    title = f"modelmeter: {result.model}" + (f" vs {compare.model}" if compare is not None else "")
    data = html_data(result, compare, torch_version)
    memory = bool(result.memory)  # the memory analysis's pictures: a page without them stays as it was
    parallel = result.parallel  # a parallel plan's ranks: a section of static markup
    # the memory bars of the ranks take the timeline's colours
    style = _STYLE + (html_memory.STYLE if memory or parallel else "") + (html_parallel.STYLE if parallel else "")
    parts = {"TITLE": html.escape(printable(title)), "ROOFLINE": _ROOFLINE_SECTION if result.roofline else "",
             "MEMORY": html_memory.sections(data), "STYLE": style,
             "PARALLEL": html_parallel.parallel_section(parallel) if parallel else "",
             "SCRIPT": _SCRIPT + (html_memory.SCRIPT if memory else ""), "DATA": _json_for_script(data)}
    # one pass over the template: a part that holds "{{...}}" (a model's name can) is not filled in again
    return re.sub(r"\{\{([A-Z]+)\}\}", lambda match: parts[match.group(1)], _PAGE)


def write_html(result: Result, path: str | os.PathLike[str], *, compare: Result | None = None,
               torch_version: str | None = None) -> None:
    """Write :func:`render_html`'s page to ``path`` atomically (a reader never sees half a file)."""
    page = render_html(result, compare=compare, torch_version=torch_version).encode("utf-8")
    atomic_write(os.fspath(path), lambda f: f.write(page))


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{{TITLE}}</title>
<style>{{STYLE}}</style>
</head>
<body>
<header id="header"></header>
<section>
<div class="controls">
<label>size by <select id="metric"></select></label>
<label>levels <select id="depth"></select></label>
<nav id="breadcrumb"></nav>
</div>
<svg id="chart" role="img" aria-label="icicle chart of the module hierarchy"></svg>
<p id="legend" class="note"></p>
</section>
{{PARALLEL}}{{MEMORY}}{{ROOFLINE}}<section><h2>Modules</h2><table id="modules" class="sortable"></table></section>
<section><h2>Operators</h2><table id="operators" class="sortable"></table></section>
<section id="notes"><h2>Notes</h2></section>
<div id="tooltip" hidden></div>
<script type="application/json" id="data">{{DATA}}</script>
<script>{{SCRIPT}}</script>
</body>
</html>
"""

_ROOFLINE_SECTION = """<section id="roofline">
<h2 id="roofline-title"></h2>
<dl id="roofline-summary"></dl>
<svg id="roofline-chart" role="img" aria-label="roofline chart of the operators"></svg>
<p id="roofline-legend" class="note"></p>
</section>
"""

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 20px 0 6px; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 12px; margin: 4px 0; }
dt { color: #666; } dd { margin: 0; }
.controls { display: flex; gap: 16px; align-items: center; margin: 8px 0; flex-wrap: wrap; }
#breadcrumb button { border: none; background: none; color: #0645ad; cursor: pointer; padding: 0 2px; font: inherit; }
#breadcrumb span { color: #999; }
#chart { width: 100%; display: block; }
#chart rect { stroke: #fff; stroke-width: 1; cursor: pointer; }
#chart rect:hover { stroke: #000; }
#chart text { font-size: 11px; pointer-events: none; fill: #111; }
#tooltip { position: fixed; pointer-events: none; background: #fff; border: 1px solid #888; padding: 6px 8px;
  box-shadow: 0 2px 6px rgba(0,0,0,.2); font-size: 13px; white-space: pre; z-index: 10; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 2px 8px; border-bottom: 1px solid #eee; text-align: right; white-space: nowrap; }
th { cursor: pointer; user-select: none; background: #f4f4f4; position: sticky; top: 0; }
th.text, td.text { text-align: left; }
th.asc::after { content: " \\25B2"; } th.desc::after { content: " \\25BC"; }
.up { color: #b00; } .down { color: #070; } .note { color: #555; }
.badge { font-size: 11px; padding: 0 4px; margin-left: 4px; border-radius: 3px; background: #eee; }
code { background: #f4f4f4; padding: 0 3px; }
#roofline-chart { width: 100%; max-width: 960px; display: block; font-size: 11px; }
#roofline-chart .frame { fill: none; stroke: #888; }
#roofline-chart .grid { stroke: #eee; }
#roofline-chart .roof { fill: none; stroke: #333; stroke-width: 2; }
#roofline-chart .roof.vector { stroke-dasharray: 6 4; stroke-width: 1.5; }
#roofline-chart .ridge { stroke: #333; stroke-dasharray: 2 3; }
#roofline-chart circle { fill-opacity: .55; stroke-width: 1; cursor: default; }
#roofline-chart circle.compute { fill: #e6852e; stroke: #a0521a; }
#roofline-chart circle.memory { fill: #3b7dd8; stroke: #1f4f94; }
#roofline-chart circle:hover { stroke: #000; stroke-width: 2; }
#roofline-chart text { fill: #333; }
.key { display: inline-block; width: 10px; height: 10px; border-radius: 50%; margin: 0 4px 0 10px; }
.key.compute { background: #e6852e; } .key.memory { background: #3b7dd8; }
"""

_SCRIPT = r"""
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
// A name from the model as the text reports print it (reports.format.printable): each character that is not
// printable (a newline, a control character, a bidi override, a lone surrogate) written as its escape, so that no
// name can start a line of its own, reverse the numbers after it or hide in the page. The data keeps it exact.
const ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"};
function shown(text) {
  return String(text).replace(/(?! )[\p{C}\p{Z}]/gu, c => {
    if (ESCAPES[c]) return ESCAPES[c];
    const code = c.codePointAt(0);
    if (code < 0x100) return "\\x" + code.toString(16).padStart(2, "0");
    if (code < 0x10000) return "\\u" + code.toString(16).padStart(4, "0");
    return "\\U" + code.toString(16).padStart(8, "0");
  });
}
const KEYS = ["params"].concat(D.metrics);
const C = D.compare;
const byName = new Map();
const mods = D.modules.map((r, i) => {
  const m = {i, name: r[0], type: r[1], called: r[2], v: {}, d: {}, status: C ? C.status[i] : "", kids: [],
             shownType: shown(r[1])};
  KEYS.forEach((k, j) => { m.v[k] = r[3 + j]; m.d[k] = C ? C.deltas[i][j] : null; });
  m.depth = m.name === "" ? 0 : m.name.split(".").length;
  byName.set(m.name, m);
  return m;
});
function parentOf(name) {
  let p = name;
  while (p !== "") {
    p = p.includes(".") ? p.slice(0, p.lastIndexOf(".")) : "";
    if (byName.has(p)) return byName.get(p);
  }
  return null;
}
mods.slice(1).forEach(m => { m.parent = parentOf(m.name); if (m.parent) m.parent.kids.push(m); });
const root = mods[0];

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function svgEl(tag, attrs) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}
const UNITS = [[1e14, 1e15, "P"], [1e11, 1e12, "T"], [1e8, 1e9, "G"], [1e5, 1e6, "M"], [1e2, 1e3, "K"]];
function fixed(v) {  // three decimals, trailing zeros stripped; a value too small for them is not shown as 0
  const t = v.toFixed(3), shortened = t.includes(".") ? t.replace(/0+$/, "").replace(/\.$/, "") : t;
  if (v !== 0 && Number(shortened) === 0) return v > 0 ? "<0.001" : ">-0.001";
  return shortened;
}
function size(x) {
  for (const [threshold, scale, suffix] of UNITS) if (Math.abs(x) > threshold) return fixed(x / scale) + suffix;
  return fixed(x);
}
const EXACT = D.exact || {};  // the digits of the integers from 2**53 on (JSON.parse rounds them), by their double
function exact(x) {  // every digit of a value: an integer grouped in thousands, a fraction as its shortest exact form
  if (Number.isInteger(x)) {
    if (Number.isSafeInteger(x)) return x.toLocaleString("en-US");
    const digits = EXACT[BigInt(x).toString()];  // null: two integers of the page became this double
    return digits ? BigInt(digits).toLocaleString("en-US") : "≈" + x.toLocaleString("en-US");
  }
  const text = String(x);
  if (text.includes("e")) return text;
  const [whole, fraction] = text.split(".");
  return Number(whole).toLocaleString("en-US") + "." + fraction;
}
function signed(x, f) { return (x > 0 ? "+" : "") + f(x); }
const BYTES = new Set(D.byte_metrics);
const BINARY = [[2 ** 40, "TiB"], [2 ** 30, "GiB"], [2 ** 20, "MiB"], [2 ** 10, "KiB"]];
function bytes(x) {  // as reports.render.format_bytes: binary units, three significant figures
  for (const [scale, suffix] of BINARY) {
    if (Math.abs(x) >= scale) {
      const v = x / scale;
      return (Math.abs(v) < 999.5 ? Number(v.toPrecision(3)) : Math.round(v)) + suffix;
    }
  }
  return Math.trunc(x) + "B";
}
const UNIT = D.units || {};  // the roofline's metrics: "time", "intensity" or "share"
const TIMES = [[1, "s"], [1e-3, "ms"], [1e-6, "µs"], [1e-9, "ns"]];
function plain(x) { return String(Number(x.toPrecision(3))); }  // three significant figures
function seconds(x) {  // in the largest of s, ms, µs, ns that shows at least 1 (0 in s), three significant figures
  const unit = TIMES.find(([scale]) => Math.abs(Number((x / scale).toPrecision(3))) >= 1);
  const [scale, suffix] = unit || (x === 0 ? TIMES[0] : TIMES[TIMES.length - 1]);
  return Number((x / scale).toPrecision(3)) + suffix;
}
function percent(x) {  // three significant figures; "100%" only for all of it
  if (x === null || x === undefined) return "–";
  const t = plain(100 * x);
  return (t === "100" && x < 1 ? ">99.9" : t) + "%";
}
function short(k, x) {
  if (BYTES.has(k)) return bytes(x);
  if (UNIT[k] === "time") return seconds(x);
  if (UNIT[k] === "intensity") return plain(x);
  if (UNIT[k] === "share") return percent(x);
  return size(x);
}
function full(k, x) {
  if (BYTES.has(k)) return exact(x) + " bytes";
  if (UNIT[k] === "time") return Number(x.toPrecision(6)) + " s";
  return exact(x);
}
function pct(x, total) {  // two decimals; a part not 0 is never "0.00%", a part below the total never "100.00%"
  if (!total) return "0.00%";
  const t = (100 * x / total).toFixed(2);
  if (x !== 0 && Number(t) === 0) return (x / total > 0 ? "<0.01" : ">-0.01") + "%";
  return (t === "100.00" && x < total ? ">99.99" : t) + "%";
}
const MODEL = shown(D.model), OTHER = C ? shown(C.model) : "";
function label(m) { return m.name === "" ? MODEL : shown(m.name); }

// header and notes -------------------------------------------------------------------------------
(function header() {
  const h = document.getElementById("header");
  h.append(el("h1", {}, MODEL));
  const dl = el("dl");
  const rows = [["inputs", D.inputs.join(", ") || "none"], ["convention", D.convention], ["execution", D.execution],
                ["versions", "modelmeter " + D.version + ", torch " + D.torch]];
  if (D.memory) rows.push(["memory", D.memory]);
  if (C) rows.push(["compared with", OTHER + " (" + (C.inputs.join(", ") || "no inputs") +
                    "): differences are this run's value minus that run's"]);
  for (const [k, v] of rows) dl.append(el("dt", {}, k), el("dd", {}, shown(v)));  // names of the model, of a file
  h.append(dl);
  const notes = document.getElementById("notes");
  if (D.unsupported.length) {
    notes.append(el("h3", {}, "Unsupported operators (not counted)"));
    const ul = el("ul", {id: "unsupported"});
    for (const [op, n] of D.unsupported) {
      const li = el("li");
      li.append(el("code", {}, shown(op)), document.createTextNode(" " + n + " call" + (n === 1 ? "" : "s")));
      ul.append(li);
    }
    notes.append(ul);
  } else notes.append(el("p", {id: "unsupported"}, "Every operator of the run was counted."));
  if (D.assumptions.length) {
    notes.append(el("h3", {}, "Assumptions of the run"));
    const ul = el("ul", {id: "assumptions"});
    for (const a of D.assumptions) ul.append(el("li", {}, shown(a)));
    notes.append(ul);
  } else notes.append(el("p", {id: "assumptions"}, "The run made no assumptions."));
})();

// icicle chart -----------------------------------------------------------------------------------
const metricSel = document.getElementById("metric"), depthSel = document.getElementById("depth");
D.chart_metrics.forEach(k => metricSel.append(el("option", {value: k}, k)));
metricSel.value = D.metrics.includes("flops") ? "flops" : D.chart_metrics[D.chart_metrics.length > 1 ? 1 : 0];
const maxDepth = Math.max(...mods.map(m => m.depth));
for (let d = 1; d <= Math.max(maxDepth, 1); d++) depthSel.append(el("option", {value: d}, d));
depthSel.value = String(Math.min(3, Math.max(maxDepth, 1)));
let focus = root;
const ROW = 26, chart = document.getElementById("chart"), tip = document.getElementById("tooltip");

function colour(m, metric) {
  if (C) {
    const d = m.d[metric], before = m.v[metric] - (d || 0);
    if (d === null || d === 0) return "#d0d0d0";
    const rel = Math.min(1, Math.abs(d) / Math.max(Math.abs(before), Math.abs(m.v[metric]), 1));
    const light = 88 - 45 * rel;
    return d > 0 ? `hsl(0,70%,${light}%)` : `hsl(130,55%,${light}%)`;
  }
  let h = 0;
  for (const ch of m.type) h = (h * 31 + ch.charCodeAt(0)) % 360;
  return `hsl(${h},55%,${78 - 4 * (m.depth % 3)}%)`;
}

function draw() {
  const metric = metricSel.value, levels = Number(depthSel.value);
  const width = chart.clientWidth || 1000;
  chart.replaceChildren();
  chart.setAttribute("height", ROW * (levels + 1));
  chart.setAttribute("viewBox", `0 0 ${width} ${ROW * (levels + 1)}`);
  const place = (m, x, w, level) => {
    const rect = svgEl("rect", {x, y: level * ROW, width: w, height: ROW - 1, fill: colour(m, metric)});
    rect.dataset.module = m.name;
    chart.append(rect);
    const last = shown(m.name.slice(m.name.lastIndexOf(".") + 1));
    const name = level === 0 ? label(m) : /^\d+$/.test(last) ? last + ": " + m.shownType : last;
    const text = name + " " + short(metric, m.v[metric]);
    if (w > 30) {
      const t = svgEl("text", {x: x + 4, y: level * ROW + 17});
      const fits = Math.max(1, Math.floor((w - 8) / 6.5) - 1);
      t.textContent = text.length * 6.5 > w - 8 ? name.slice(0, fits) + "…" : text;
      chart.append(t);
    }
    if (level >= levels) return;
    const kids = m.kids.filter(k => k.v[metric] > 0);
    const sum = kids.reduce((s, k) => s + k.v[metric], 0);
    const scale = w / Math.max(m.v[metric], sum, 1e-300);
    let cx = x;
    for (const k of kids) { const kw = k.v[metric] * scale; place(k, cx, kw, level + 1); cx += kw; }
  };
  place(focus, 0, width, 0);
  const bc = document.getElementById("breadcrumb");
  bc.replaceChildren();
  const path = [];
  for (let m = focus; m; m = m.parent) path.unshift(m);
  path.forEach((m, i) => {
    if (i) bc.append(el("span", {}, " › "));
    const b = el("button", {type: "button"}, m === root ? MODEL : shown(m.name.slice(m.name.lastIndexOf(".") + 1)));
    b.addEventListener("click", () => { focus = m; draw(); });
    bc.append(b);
  });
  document.getElementById("legend").textContent = C
    ? "Width: " + metric + " of this run. Colour: red grew, green shrank, grey unchanged, compared with " +
      OTHER + "."
    : "Width: " + metric + " (a module's children share its width; the rest is its own work). Click to zoom in, " +
      "click the top bar or the path above to zoom out.";
}

function describe(m, metric) {
  const total = root.v[metric];
  const v = m.v[metric];
  const value = BYTES.has(metric) || UNIT[metric] === "time" ? full(metric, v) + " = " + short(metric, v) : exact(v);
  const lines = [label(m) + "  (" + m.shownType + ")", metric + ": " + value + "  (" + pct(m.v[metric], total) +
                 " of total)"];
  if (!m.called) lines.push("not called as a module: N/A");
  if (C) {
    const d = m.d[metric], before = m.v[metric] - d;
    const rel = m.status === "+" ? "new: not in " + OTHER
      : before ? pct(d, before) + " of " + OTHER + "'s" : OTHER + " had 0";
    lines.push(d === null ? "difference: not measured in " + OTHER
      : "difference: " + signed(d, x => full(metric, x)) + "  (" + rel + ")");
  }
  return lines.join("\n");
}

function showTip(e, text) {
  tip.textContent = text;
  tip.hidden = false;
  const x = Math.min(e.clientX + 14, window.innerWidth - tip.offsetWidth - 4);
  tip.style.left = Math.max(0, x) + "px";
  tip.style.top = (e.clientY + 14) + "px";
}
chart.addEventListener("mousemove", e => {
  const r = e.target.closest("rect[data-module]");
  if (!r) { tip.hidden = true; return; }
  showTip(e, describe(byName.get(r.dataset.module), metricSel.value));
});
chart.addEventListener("mouseleave", () => { tip.hidden = true; });
chart.addEventListener("click", e => {
  const r = e.target.closest("rect[data-module]");
  if (!r) return;
  const m = byName.get(r.dataset.module);
  focus = m === focus ? (focus.parent || root) : m;
  draw();
});
metricSel.addEventListener("change", draw);
depthSel.addEventListener("change", draw);
window.addEventListener("resize", draw);

// sortable tables --------------------------------------------------------------------------------
function cell(value, kind, metric) {
  if (kind === "delta") {
    if (value === null) return el("td", {}, "–");
    const cls = value > 0 ? "up" : value < 0 ? "down" : "";
    return el("td", {class: cls, title: signed(value, x => full(metric, x))}, signed(value, x => short(metric, x)));
  }
  if (value === null) return el("td", {}, "N/A");
  return el("td", {title: full(metric, value)}, short(metric, value));
}
function table(id, columns, rows) {
  // columns: [title, kind]; rows: {key: sort keys per column, cells: td per column}
  const t = document.getElementById(id);
  const head = el("tr");
  const body = el("tbody");
  let sorted = -1, dir = 1;
  const fill = () => { body.replaceChildren(...rows.map(r => r.tr)); };
  columns.forEach(([title], c) => {
    const th = el("th", {class: columns[c][1]}, title);
    th.addEventListener("click", () => {
      dir = sorted === c ? -dir : (columns[c][1] === "text" ? 1 : -1);
      sorted = c;
      head.querySelectorAll("th").forEach(h => h.classList.remove("asc", "desc"));
      th.classList.add(dir > 0 ? "asc" : "desc");
      rows.sort((a, b) => {
        const x = a.key[c], y = b.key[c];
        if (x === y) return a.order - b.order;
        if (x === null) return 1;
        if (y === null) return -1;
        return (x < y ? -1 : 1) * dir;
      });
      fill();
    });
    head.append(th);
  });
  rows.forEach((r, i) => {
    r.order = i;
    r.tr = el("tr");
    r.cells.forEach((td, c) => { if (columns[c][1] === "text") td.classList.add("text"); r.tr.append(td); });
  });
  const thead = el("thead"); thead.append(head);
  t.append(thead, body);
  fill();
}
(function modulesTable() {
  const cols = [["module", "text"], ["type", "text"]];
  KEYS.forEach(k => { cols.push([k, "value"]); if (C) cols.push(["Δ" + k, "delta"]); });
  if (D.shapes) cols.push(["output shapes", "text"]);
  const rows = mods.map(m => {
    const nameCell = el("td", {title: shown(m.name)}, label(m));
    nameCell.style.paddingLeft = (8 + 12 * m.depth) + "px";
    if (m.status) nameCell.append(el("span", {class: "badge"}, m.status === "+" ? "new" : "only in " + OTHER));
    const key = [m.name, m.type], cells = [nameCell, el("td", {}, m.shownType)];
    KEYS.forEach(k => {
      const v = k === "params" || m.called ? m.v[k] : null;
      key.push(v); cells.push(cell(v, "value", k));
      if (C) { key.push(m.d[k]); cells.push(cell(m.d[k], "delta", k)); }
    });
    if (D.shapes) { key.push(D.shapes[m.i]); cells.push(el("td", {}, shown(D.shapes[m.i]))); }
    return {key, cells};
  });
  table("modules", cols, rows);
  rows.forEach((r, i) => r.tr.dataset.module = mods[i].name);
})();
(function operatorsTable() {
  const cols = [["operator", "text"]];
  D.operator_metrics.forEach(k => { cols.push([k, "value"]); if (C) cols.push(["Δ" + k, "delta"]); });
  const rows = D.operators.map(([op, values, deltas]) => {
    const key = [op], cells = [el("td", {}, shown(op))];
    values.forEach((v, j) => {
      const k = D.operator_metrics[j];
      key.push(v); cells.push(cell(v, "value", k));
      if (C) { key.push(deltas[j]); cells.push(cell(deltas[j], "delta", k)); }
    });
    return {key, cells};
  });
  table("operators", cols, rows);
})();

// roofline chart: the geometry comes computed (html.roofline_chart), the script only draws it -----------------
(function roofline() {
  const R = D.roofline;
  if (!R) return;
  const S = R.summary, dev = S.device, svg = document.getElementById("roofline-chart");
  document.getElementById("roofline-title").textContent = shown(R.title);
  const phases = Object.entries(S.time).filter(([k]) => k !== "total").map(([k, v]) => k + " " + seconds(v));
  const rows = [
    ["device", dev.label + ": " + size(dev.peak) + "FLOP/s " + (S.dtype ? S.dtype + " " : "") + "matrix, " +
               (dev.vector_peak ? size(dev.vector_peak) + "FLOP/s vector, " : "") + size(dev.bandwidth) + "B/s, " +
               "ridge " + plain(dev.ridge) + " FLOPs/byte"],
    ["predicted time", seconds(S.time.total) + (phases.length ? " (" + phases.join(", ") + ")" : "")]];
  if (S.throughput) {
    const unit = S.items.unit;
    rows.push(["throughput", size(S.throughput) + " " + unit + "/s (" + S.items.count + " " + unit + " a run)"]);
  }
  rows.push(["predicted MFU", percent(S.predicted_mfu)]);
  if (S.measured_time !== null && S.measured_time !== undefined) {
    rows.push(["measured", seconds(S.measured_time) + ": MFU " + percent(S.mfu) + ", HFU " + percent(S.hfu)]);
  }
  rows.push(["compute-bound", percent(S.compute_bound_share) + " of the time"],
            ["work", size(S.flops) + " FLOPs, " + bytes(S.bytes) + " moved"]);
  const set = S.settings || {};
  if (set.efficiency !== undefined && set.efficiency !== 1) rows.push(["efficiency", percent(set.efficiency)]);
  if (set.launch_overhead) rows.push(["launch overhead", seconds(set.launch_overhead) + " a kernel"]);
  if (set.tf32) rows.push(["tf32", "float32 matrix work at the TF32 peak"]);
  const dl = document.getElementById("roofline-summary");
  for (const [k, v] of rows) dl.append(el("dt", {}, k), el("dd", {}, shown(v)));

  const [left, top, right, bottom] = R.plot;
  svg.setAttribute("viewBox", `0 0 ${R.width} ${R.height}`);
  const add = (tag, attrs, text) => {
    const e = svgEl(tag, attrs);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
    return e;
  };
  for (const [x, text] of R.x_ticks) {
    add("line", {class: "grid", x1: x, x2: x, y1: top, y2: bottom});
    add("text", {x, y: bottom + 16, "text-anchor": "middle"}, text);
  }
  for (const [y, text] of R.y_ticks) {
    add("line", {class: "grid", x1: left, x2: right, y1: y, y2: y});
    add("text", {x: left - 6, y: y + 4, "text-anchor": "end"}, text);
  }
  add("rect", {class: "frame", x: left, y: top, width: right - left, height: bottom - top});
  add("text", {x: (left + right) / 2, y: bottom + 40, "text-anchor": "middle"}, R.x_label);
  add("text", {"text-anchor": "middle", transform: `translate(16 ${(top + bottom) / 2}) rotate(-90)`}, R.y_label);
  for (const roof of R.roofs) {
    add("polyline", {class: "roof " + roof.name, points: roof.points.map(p => p.join(",")).join(" ")});
    const [x, y] = roof.points[1];  // at the ridge, clear of the compute-bound points at the right end
    add("text", {x: x + 6, y: y - 5}, roof.label);
  }
  add("line", {class: "ridge", x1: R.ridge.x, x2: R.ridge.x, y1: R.ridge.y, y2: bottom});
  add("text", {x: R.ridge.x + 4, y: bottom - 6}, "ridge " + plain(R.ridge.intensity) + " FLOPs/byte");
  R.points.forEach((p, i) => {
    add("circle", {cx: p.x, cy: p.y, r: p.r, class: p.compute_bound ? "compute" : "memory", "data-point": i});
  });

  const legend = document.getElementById("roofline-legend");
  legend.append(el("span", {class: "key compute"}), "compute-bound", el("span", {class: "key memory"}),
                "memory-bound. One point per operator and dtype over the whole run, its area proportional to its " +
                "time; solid roof: the matrix peak, dashed: the vector peak, both reached from the bandwidth slope.");
  if (R.omitted) {
    legend.append(" ", el("span", {id: "roofline-omitted"}, R.omitted + " operator" + (R.omitted === 1 ? "" : "s") +
                  " with no FLOPs or no bytes (copies, views, ...) not drawn: a log scale has no place for 0."));
  }
  svg.addEventListener("mousemove", e => {
    const c = e.target.closest("circle[data-point]");
    if (!c) { tip.hidden = true; return; }
    const p = R.points[Number(c.dataset.point)];
    const bound = p.compute_bound ? "compute" : "memory";
    showTip(e, [shown(p.operator) + "  (" + shown(p.dtype) + ", " + bound + "-bound)",
                "FLOPs: " + exact(p.flops) + " = " + size(p.flops), "bytes: " + exact(p.bytes) + " = " + bytes(p.bytes),
                "time: " + seconds(p.time), "intensity: " + plain(p.intensity) + " FLOPs/byte",
                "attained: " + size(p.rate) + "FLOP/s"].join("\n"));
  });
  svg.addEventListener("mouseleave", () => { tip.hidden = true; });
})();
draw();
"""
