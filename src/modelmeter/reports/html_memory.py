"""The HTML report's pictures of a memory analysis: the step's memory timeline and the operator mix.

As for the roofline chart, the geometry is computed here (pixels of an SVG viewBox, tested in Python) and the
page's script only draws it: :func:`memory_timeline_chart` turns ``Result.memory["timeline"]`` (see
:func:`modelmeter.metrics.memory_timeline.memory_timeline`) into stacked areas, one per kind of memory, with the
phases and the peak marked; :func:`operator_mix_chart` turns the model's totals by operator into horizontal bars,
the costliest operators and the rest as "other". :func:`sections`, ``STYLE`` and ``SCRIPT`` are the page's parts,
added by :mod:`modelmeter.reports.html` to a result with the memory analysis only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from .format import format_bytes
from .render import memory_step, peak_place
from .result import NOT_ADDITIVE, Result

__all__ = ["memory_timeline_chart", "operator_mix_chart"]

_WIDTH, _HEIGHT = 760, 370  # the timeline's viewBox
_PLOT = (80.0, 30.0, 744.0, 326.0)  # left, top, right, bottom: room for the phases' names above, the axes' labels
_MAX_STEPS = 8  # the most intervals between the byte axis's ticks
_PHASE_LABEL = 60.0  # a phase's band this wide (pixels) or wider is named above the plot
# A tick step is one of these times a binary unit (or times 1 byte, from 1 up, below 1KiB).
_MULTIPLES = (0.125, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500)

_MIX_WIDTH = 760
_MIX_PLOT = (230.0, 8.0, 640.0)  # left (room for the names), top, right (room for the value and its share)
_MIX_ROW, _MIX_BAR = 24.0, 18.0  # a bar's row and the bar's height
_MIX_TOP = 10  # the operators shown by name; the rest are one "other" bar (unless only one is left)


def _byte_ticks(highest: float) -> list[int]:
    """Ticks from 0 to the first at or above ``highest``, evenly spaced by a round number of bytes (``128MiB``,
    ``2GiB``, ``500B``), at most :data:`_MAX_STEPS` intervals."""
    unit = next((scale for scale in (2**40, 2**30, 2**20, 2**10) if highest >= scale), 1)
    multiples = [m for m in _MULTIPLES if m >= 1] if unit == 1 else list(_MULTIPLES)
    step = next((int(m * unit) for m in multiples if math.ceil(highest / (m * unit)) <= _MAX_STEPS),
                math.ceil(highest / _MAX_STEPS))  # over 4000TiB: no round step is left
    return [i * step for i in range(max(1, math.ceil(highest / step)) + 1)]


def memory_timeline_chart(memory: Mapping[str, Any]) -> dict[str, Any]:
    """The memory timeline of a ``Result.memory`` summary with a ``timeline``, in the pixels of an SVG viewBox
    (``width`` x ``height``, the areas inside the ``plot`` box: left, top, right, bottom).

    x: the timeline's positions (one per operator, in run order, then the optimizer's step) spread evenly over the
    plot's width; kept point ``i`` covers the ``bucket`` positions it stands for, from ``edges[i]`` to
    ``edges[i + 1]`` (a step chart: the bytes were live during the whole operator). y: live bytes, linear from 0 to
    ``y_max``, the last of ``y_ticks`` (``[pixel, label]``) and the first at or above the peak. ``layers``: one per
    kind, in stacking order (bottom first), with the ``top`` pixel of its area at each kept point (its bottom is the
    layer below's top, or the plot's bottom) and its bytes ``at_peak``. ``phases``: a band per run of one phase
    (``x0``..``x1``, ``label`` when wide enough to be named). ``peak``: its position's centre and height, bytes,
    module, operator and phase, and the kept point it is. ``timeline``: the data itself (for the tooltips), and
    ``live`` the total bytes of each kept point, exact.
    """
    data = memory["timeline"]
    left, top, right, bottom = _PLOT
    length, bucket = data["length"], data["bucket"]

    def x(position: float) -> float:
        return round(left + position / max(length, 1) * (right - left), 2)

    ticks = _byte_ticks(memory["peak"])

    def y(value: float) -> float:
        return round(bottom - value / ticks[-1] * (bottom - top), 2)

    count = len(data["position"])
    below = [0] * count
    peak_point = data["position"].index(data["peak"]) if data["peak"] is not None else None
    layers = []
    for kind in data["kinds"]:
        below = [under + value for under, value in zip(below, data["bytes"][kind], strict=True)]
        layers.append({"kind": kind, "label": kind.replace("_", " "), "top": [y(value) for value in below],
                       "at_peak": None if peak_point is None else data["bytes"][kind][peak_point]})
    runs = [*data["phases"], [None, length]]
    phases = [{"phase": phase, "x0": x(start), "x1": x(end), "label": x(end) - x(start) >= _PHASE_LABEL}
              for (phase, start), (_, end) in itertools.pairwise(runs)]
    peak = None
    if peak_point is not None:
        peak = {"x": x(data["peak"] + 0.5), "y": y(memory["peak"]), "bytes": memory["peak"], "point": peak_point,
                "position": data["peak"], "module": memory["module"], "operator": memory["operator"],
                "phase": memory["phase"],
                "label": f"peak {format_bytes(memory['peak'])} in the {peak_place(memory)}"}
    x_label = f"operators in run order ({length})"
    if bucket > 1:
        x_label += f"; each step of the line is the highest of {bucket}"
    return {
        "width": _WIDTH, "height": _HEIGHT, "plot": list(_PLOT),
        "title": f"Memory timeline of the {memory_step(memory)}",
        "x_label": x_label, "y_label": "live bytes",
        "y_max": ticks[-1], "y_ticks": [[y(tick), format_bytes(tick)] for tick in ticks],
        "edges": [x(i * bucket) for i in range(count)] + [x(length)],
        "layers": layers, "phases": phases, "peak": peak, "timeline": data,
        "live": below,  # each kept point's live bytes, summed here: in the page's doubles a sum past 2**53 rounds
    }


def _mix_metrics(result: Result) -> list[str]:
    """The metrics whose operators share a total: additive ones the model has some of."""
    by_op = result.root.by_operator
    return [metric for metric in result.metrics
            if metric not in NOT_ADDITIVE and sum(v for v in by_op.get(metric, {}).values() if v > 0) > 0]


def _bars(values: Mapping[str, float], top: int) -> list[dict[str, Any]]:
    """The costliest ``top`` operators first, then the rest as one ``other`` bar (``others``: how many it holds);
    only operators with some of the metric."""
    ops = sorted(((op, value) for op, value in values.items() if value > 0), key=lambda item: (-item[1], item[0]))
    total = sum(value for _, value in ops)
    shown, rest = (ops, []) if len(ops) <= top + 1 else (ops[:top], ops[top:])
    bars = [{"operator": op, "value": value, "share": value / total, "others": 0} for op, value in shown]
    if rest:
        value = sum(v for _, v in rest)
        bars.append({"operator": f"other ({len(rest)} operators)", "value": value, "share": value / total,
                     "others": len(rest)})
    return bars


def operator_mix_chart(result: Result, top: int = _MIX_TOP) -> dict[str, Any]:
    """The model's cost by operator, per metric, as horizontal bars in the pixels of an SVG viewBox.

    ``metrics``: those the chart can show (every additive metric the model has some of: ``flops``, their phases,
    ``activation_bytes``, ``saved_bytes``, a device's ``bytes`` and ``time``, ...). ``bars[metric]``: the ``top``
    costliest operators, then one ``other`` bar for the rest (not when a single one is left: it is shown by name);
    each with its ``value``, its ``share`` of the model's total, and its row's ``y`` and bar ``width``, the
    longest bar spanning the plot from ``plot[0]`` to ``plot[2]``. ``height`` fits the metric with the most bars.
    """
    left, top_pad, right = _MIX_PLOT
    metrics = _mix_metrics(result)
    charts = {}
    for metric in metrics:
        bars = _bars(result.root.by_operator[metric], top)
        longest = max(bar["value"] for bar in bars)
        for row, bar in enumerate(bars):
            bar.update(y=top_pad + row * _MIX_ROW, width=round(bar["value"] / longest * (right - left), 2))
        charts[metric] = bars
    rows = max((len(bars) for bars in charts.values()), default=0)
    return {"width": _MIX_WIDTH, "height": top_pad * 2 + rows * _MIX_ROW, "plot": [left, top_pad, right],
            "bar": _MIX_BAR, "metrics": metrics, "bars": charts}


_TIMELINE_SECTION = """<section id="memory-timeline">
<h2 id="memory-title"></h2>
<svg id="memory-chart" role="img" aria-label="memory timeline of the run"></svg>
<p id="memory-legend" class="note"></p>
</section>
"""

_MIX_SECTION = """<section id="operator-mix">
<h2>Operator mix</h2>
<div class="controls"><label>by <select id="mix-metric"></select></label></div>
<svg id="mix-chart" role="img" aria-label="the operators' shares of the model's cost"></svg>
<p class="note">The model's total by operator, the costliest first (the rest as one grey bar), with each one's
share; hover a bar for its exact value.</p>
</section>
"""


def sections(data: Mapping[str, Any]) -> str:
    """The page's sections for the charts the page's data (``html_data``) has."""
    return (_TIMELINE_SECTION if "memory_timeline" in data else "") + (_MIX_SECTION if "operator_mix" in data else "")


STYLE = """
#memory-chart, #mix-chart { width: 100%; max-width: 960px; display: block; font-size: 11px; }
#memory-chart .frame { fill: none; stroke: #888; } #memory-chart .grid { stroke: #e4e4e4; }
#memory-chart .phase { fill: #f7f7f7; stroke: #ddd; } #memory-chart .phase.backward { fill: #eef3f8; }
#memory-chart .phase.recompute { fill: #f8f0e6; } #memory-chart .phase.optimizer { fill: #eef6ec; }
#memory-chart .layer { stroke: none; }
#memory-chart .peak-line { stroke: #000; stroke-dasharray: 4 3; } #memory-chart .peak-dot { fill: #000; }
#memory-chart .cursor { stroke: #333; pointer-events: none; }
#memory-chart text, #mix-chart text { fill: #333; }
.k-parameter { fill: #4e79a7; background: #4e79a7; } .k-buffer { fill: #a0cbe8; background: #a0cbe8; }
.k-input { fill: #b07aa1; background: #b07aa1; } .k-optimizer_state { fill: #59a14f; background: #59a14f; }
.k-gradient { fill: #f28e2b; background: #f28e2b; } .k-activation { fill: #e15759; background: #e15759; }
.k-temporary { fill: #edc948; background: #edc948; } .k-other { fill: #bab0ac; background: #bab0ac; }
.k-optimizer_temporary { fill: #8cd17d; background: #8cd17d; }
.k-unsharded { fill: #76b7b2; background: #76b7b2; } .k-communication { fill: #9c755f; background: #9c755f; }
#memory-peak { paint-order: stroke; stroke: #fff; stroke-width: 3px; stroke-linejoin: round; }
.legend-item { white-space: nowrap; }
.swatch { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 10px; }
#mix-chart rect { fill: #3b7dd8; } #mix-chart rect.other { fill: #aaa; } #mix-chart rect:hover { fill: #1f4f94; }
"""

SCRIPT = r"""
// memory timeline and operator mix: the geometry comes computed (html_memory), the script only draws it ---------
function drawer(svg) {
  return (tag, attrs, text) => {
    const e = svgEl(tag, attrs);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
    return e;
  };
}
function viewX(svg, e, width) {  // the mouse's x in the viewBox's pixels
  const box = svg.getBoundingClientRect();
  return (e.clientX - box.left) * width / box.width;
}
(function memoryTimeline() {
  const T = D.memory_timeline;
  if (!T) return;
  const L = T.timeline, svg = document.getElementById("memory-chart"), add = drawer(svg);
  const [left, top, right, bottom] = T.plot;
  document.getElementById("memory-title").textContent = T.title;
  svg.setAttribute("viewBox", `0 0 ${T.width} ${T.height}`);
  for (const p of T.phases) {
    add("rect", {class: "phase " + p.phase, x: p.x0, y: top, width: p.x1 - p.x0, height: bottom - top});
    if (p.label) add("text", {x: (p.x0 + p.x1) / 2, y: top - 8, "text-anchor": "middle"}, p.phase);
  }
  for (const [y, text] of T.y_ticks) {
    add("line", {class: "grid", x1: left, x2: right, y1: y, y2: y});
    add("text", {x: left - 6, y: y + 4, "text-anchor": "end"}, text);
  }
  const edges = T.edges;
  let below = edges.slice(1).map(() => bottom);
  for (const layer of T.layers) {
    const pts = [];
    layer.top.forEach((y, i) => pts.push(edges[i] + "," + y, edges[i + 1] + "," + y));
    for (let i = below.length - 1; i >= 0; i--) pts.push(edges[i + 1] + "," + below[i], edges[i] + "," + below[i]);
    add("polygon", {class: "layer k-" + layer.kind, points: pts.join(" "), "data-kind": layer.kind});
    below = layer.top;
  }
  add("rect", {class: "frame", x: left, y: top, width: right - left, height: bottom - top});
  add("text", {x: (left + right) / 2, y: bottom + 30, "text-anchor": "middle"}, T.x_label);
  add("text", {"text-anchor": "middle", transform: `translate(16 ${(top + bottom) / 2}) rotate(-90)`}, T.y_label);
  const P = T.peak;
  if (P) {
    add("line", {class: "peak-line", x1: left, x2: right, y1: P.y, y2: P.y});
    add("circle", {class: "peak-dot", cx: P.x, cy: P.y, r: 4});
    const east = P.x < (left + right) / 2;  // the label reads away from the nearer edge, under the dashed line
    add("text", {id: "memory-peak", x: P.x + (east ? 8 : -8), y: P.y + 16, "text-anchor": east ? "start" : "end"},
        shown(P.label));
  }
  const cursor = add("line", {class: "cursor", x1: 0, x2: 0, y1: top, y2: bottom, visibility: "hidden"});

  const legend = document.getElementById("memory-legend");
  for (const layer of T.layers) {
    const item = el("span", {class: "legend-item", "data-kind": layer.kind});
    item.append(el("span", {class: "swatch k-" + layer.kind}),
                layer.label + (layer.at_peak === null ? "" : " " + bytes(layer.at_peak)));
    legend.append(item);
  }
  legend.append(el("br"), "Live bytes during each operator, stacked by kind (at the peak: the numbers above); " +
                "activation: what autograd saved for the backward pass, temporary: every other tensor the " +
                "operators made. Hover for the operator, its module and what was live.");

  function pointAt(vx) {  // the kept point whose edges hold vx
    let lo = 0, hi = edges.length - 2;
    while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (edges[mid] <= vx) lo = mid; else hi = mid - 1; }
    return lo;
  }
  function phaseOf(position) {
    let phase = L.phases[0][0];
    for (const [name, start] of L.phases) if (start <= position) phase = name;
    return phase;
  }
  svg.addEventListener("mousemove", e => {
    const vx = viewX(svg, e, T.width);
    if (vx < left || vx > right) { tip.hidden = true; cursor.setAttribute("visibility", "hidden"); return; }
    const i = pointAt(vx), position = L.position[i], module = L.modules[L.module[i]];
    const total = T.live[i];
    const lines = ["operator " + (position + 1) + " of " + L.length + " (" + phaseOf(position) + ")",
                   (module === "" ? MODEL : shown(module)) + "  at " + shown(L.operators[L.operator[i]]),
                   "live: " + exact(total) + " bytes = " + bytes(total)];
    for (const k of L.kinds) if (L.bytes[k][i]) lines.push("  " + k.replace("_", " ") + " " + bytes(L.bytes[k][i]));
    if (L.bucket > 1) {
      const first = i * L.bucket + 1, last = Math.min((i + 1) * L.bucket, L.length);
      lines.push("the highest of operators " + first + "–" + last);
    }
    const x = (position + 0.5) / L.length * (right - left) + left;
    cursor.setAttribute("x1", x); cursor.setAttribute("x2", x); cursor.setAttribute("visibility", "visible");
    showTip(e, lines.join("\n"));
  });
  svg.addEventListener("mouseleave", () => { tip.hidden = true; cursor.setAttribute("visibility", "hidden"); });
})();
(function operatorMix() {
  const M = D.operator_mix;
  if (!M || !M.metrics.length) return;
  const svg = document.getElementById("mix-chart"), sel = document.getElementById("mix-metric");
  const [left, , right] = M.plot;
  M.metrics.forEach(k => sel.append(el("option", {value: k}, k)));
  sel.value = M.metrics.includes("flops") ? "flops" : M.metrics[0];
  svg.setAttribute("viewBox", `0 0 ${M.width} ${M.height}`);
  function drawMix() {
    svg.replaceChildren();
    const add = drawer(svg), metric = sel.value;
    M.bars[metric].forEach((bar, i) => {
      const middle = bar.y + M.bar / 2 + 4;
      const operator = shown(bar.operator), name = operator.length > 34 ? operator.slice(0, 33) + "…" : operator;
      add("text", {x: left - 6, y: middle, "text-anchor": "end"}, name);
      add("rect", {x: left, y: bar.y, width: Math.max(bar.width, 1), height: M.bar, "data-bar": i,
                   class: bar.others ? "other" : "op"});
      add("text", {x: left + bar.width + 6, y: middle}, short(metric, bar.value) + " (" + percent(bar.share) + ")");
    });
  }
  svg.addEventListener("mousemove", e => {
    const r = e.target.closest("rect[data-bar]");
    if (!r) { tip.hidden = true; return; }
    const metric = sel.value, bar = M.bars[metric][Number(r.dataset.bar)];
    showTip(e, shown(bar.operator) + "\n" + metric + ": " + full(metric, bar.value) + "  (" + pct(bar.share, 1) +
            " of the model's)");
  });
  svg.addEventListener("mouseleave", () => { tip.hidden = true; });
  sel.addEventListener("change", drawMix);
  drawMix();
})();
"""
