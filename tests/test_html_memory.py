"""The HTML report's memory pictures: the timeline's and the operator mix's geometry by hand, the data from a real
memory analysis, and the page in a real headless Chromium (following tests/test_html.py)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter import MemoryAnalysis, Result, analyze
from modelmeter.metrics.memory import MemoryModel
from modelmeter.metrics.memory_timeline import memory_timeline
from modelmeter.reports import html_memory
from modelmeter.reports.format import format_bytes
from modelmeter.reports.html import html_data, render_html, write_html
from modelmeter.reports.html_memory import memory_timeline_chart, operator_mix_chart
from modelmeter.reports.result import ModuleRow
from test_html import HOSTILE, Opened, _before, _embedded, _memory_result, browser, needs_browser

__all__ = ["browser"]  # the fixture, shared with tests/test_html.py

LEFT, TOP, RIGHT, BOTTOM = 80.0, 30.0, 744.0, 326.0  # the timeline's plot box


def _hand_memory() -> dict[str, Any]:
    """A training step of 6 operators kept as 3 points of 2 (the highest of each pair): live 150, 300, 250."""
    timeline = {"length": 6, "bucket": 2, "position": [1, 2, 5],
                "kinds": ["parameter", "activation", "optimizer_temporary"],
                "bytes": {"parameter": [100, 100, 100], "activation": [50, 200, 0],
                          "optimizer_temporary": [0, 0, 150]},
                "module": [0, 1, 2], "modules": ["fc1", "fc2", ""], "operator": [0, 1, 2],
                "operators": ["mm", "mm backward", "sgd.step"],
                "phases": [["forward", 0], ["backward", 2], ["optimizer", 5]], "peak": 2}
    return {"peak": 300, "phase": "backward", "module": "fc2", "operator": "mm backward",
            "by_kind": {"parameter": 100, "activation": 200}, "training": True,
            "optimizer": {"name": "sgd", "state_dtype": None, "foreach": False}, "saved_bytes": 50,
            "timeline": timeline}


def _x(position: float, length: int) -> float:
    return LEFT + position / length * (RIGHT - LEFT)


def _y(value: float, highest: float) -> float:
    return BOTTOM - value / highest * (BOTTOM - TOP)


# the timeline's geometry -----------------------------------------------------------------------
def test_timeline_geometry_by_hand() -> None:
    chart = memory_timeline_chart(_hand_memory())
    assert (chart["width"], chart["height"], chart["plot"]) == (760, 370, [LEFT, TOP, RIGHT, BOTTOM])
    assert chart["title"] == "Memory timeline of the training step with sgd"
    # 300 bytes: steps of 50 bytes (1, 2, 5, 10 or 20 would make more than 8), the last tick the peak
    assert [label for _, label in chart["y_ticks"]] == ["0B", "50B", "100B", "150B", "200B", "250B", "300B"]
    assert [y for y, _ in chart["y_ticks"]] == [pytest.approx(_y(50 * i, 300), abs=0.01) for i in range(7)]
    # each kept point covers its bucket of 2 operators: edges at operators 0, 2, 4 and the end, 6
    assert chart["edges"] == [pytest.approx(_x(p, 6), abs=0.01) for p in (0, 2, 4, 6)]
    layers = {layer["kind"]: layer for layer in chart["layers"]}
    assert list(layers) == ["parameter", "activation", "optimizer_temporary"]  # stacked bottom first
    tops = {"parameter": [100, 100, 100], "activation": [150, 300, 100], "optimizer_temporary": [150, 300, 250]}
    for kind, cumulative in tops.items():
        assert layers[kind]["top"] == [pytest.approx(_y(v, 300), abs=0.01) for v in cumulative]
    assert {kind: layer["at_peak"] for kind, layer in layers.items()} == {
        "parameter": 100, "activation": 200, "optimizer_temporary": 0}
    assert layers["optimizer_temporary"]["label"] == "optimizer temporary"
    peak = chart["peak"]
    assert peak["x"] == pytest.approx(_x(2.5, 6), abs=0.01) and peak["y"] == TOP  # the middle of operator 2
    assert (peak["point"], peak["position"], peak["bytes"]) == (1, 2, 300)
    assert peak["label"] == "peak 300B in the backward of fc2 at mm backward"
    assert [(p["phase"], p["label"]) for p in chart["phases"]] == [
        ("forward", True), ("backward", True), ("optimizer", True)]
    assert [(p["x0"], p["x1"]) for p in chart["phases"]] == [
        (pytest.approx(_x(a, 6), abs=0.01), pytest.approx(_x(b, 6), abs=0.01)) for a, b in ((0, 2), (2, 5), (5, 6))]
    assert chart["x_label"] == "operators in run order (6); each step of the line is the highest of 2"
    assert chart["timeline"] == _hand_memory()["timeline"]


@pytest.mark.parametrize(("peak", "labels"), [
    (0, ["0B", "1B"]),
    (8, [f"{i}B" for i in range(9)]),
    (1023, ["0B", "200B", "400B", "600B", "800B", "1000B", "1.17KiB"]),
    (197 * 2**20, ["0B", "50MiB", "100MiB", "150MiB", "200MiB"]),
    (int(1.1 * 2**30), ["0B", "256MiB", "512MiB", "768MiB", "1GiB", "1.25GiB"]),
    (int(5.5 * 2**40), ["0B", "1TiB", "2TiB", "3TiB", "4TiB", "5TiB", "6TiB"]),
])
def test_byte_axis_steps(peak: int, labels: list[str]) -> None:
    """Round steps in binary units, at most 8 intervals, from 0 to the first tick at or above the peak."""
    memory = _hand_memory()
    memory["peak"] = peak
    assert [label for _, label in memory_timeline_chart(memory)["y_ticks"]] == labels


def test_narrow_phases_are_not_named() -> None:
    memory = _hand_memory()
    timeline = memory["timeline"]
    timeline["length"] = 60  # the optimizer's step is 1 of 60 operators: 11 pixels, too narrow for its name
    timeline["phases"] = [["forward", 0], ["backward", 20], ["optimizer", 59]]
    assert [p["label"] for p in memory_timeline_chart(memory)["phases"]] == [True, True, False]


def _training_step(max_points: int | None = None) -> tuple[MemoryAnalysis, Result]:
    """A small training step with Adam, and its Result (the timeline cut to ``max_points``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    analysis = analyze(model, torch.randn(32, 16), backward=True, memory=True, optimizer="adam", quiet=True)
    assert analysis.memory is not None
    result = analysis.result()
    if max_points is not None:
        result.memory["timeline"] = memory_timeline(MemoryModel(analysis.trace), analysis.memory.optimizer,
                                                    max_points)
    return analysis.memory, result


@pytest.mark.parametrize("max_points", [None, 7])
def test_timeline_chart_of_a_real_step(max_points: int | None) -> None:
    """The stack's top is the live total of MemoryAnalysis.timeline() at every kept point; the peak its highest."""
    mem, result = _training_step(max_points)
    chart = memory_timeline_chart(result.memory)
    timeline, data = mem.timeline(), result.memory["timeline"]
    assert chart["y_ticks"][-1] == [TOP, format_bytes(chart["y_max"])] and chart["y_max"] >= mem.peak()
    assert chart["peak"]["y"] <= TOP + (BOTTOM - TOP) / 4  # a round step close enough for the peak to fill the plot
    top, scale = chart["layers"][-1]["top"], chart["y_max"]
    for i, position in enumerate(data["position"]):
        assert top[i] == pytest.approx(_y(timeline[position].live, scale), abs=0.01)
    assert chart["peak"]["y"] == pytest.approx(_y(mem.peak(), scale), abs=0.01)
    assert top[chart["peak"]["point"]] == chart["peak"]["y"] == min(top)
    assert len(chart["edges"]) == len(data["position"]) + 1 and chart["edges"][-1] == RIGHT


# the operator mix ------------------------------------------------------------------------------
def _mix_result(flops: dict[str, float], **more: dict[str, float]) -> Result:
    metrics = {"flops": sum(flops.values()), **{k: sum(v.values()) for k, v in more.items()}, "peak_memory": 9}
    by_op = {"flops": flops, **more}
    return Result("Net", [], list(metrics), [ModuleRow("", "Net", 0, metrics, by_op)], memory={"peak": 9})


def test_operator_mix_by_hand() -> None:
    flops = {f"op{n:02d}": float(n) for n in range(1, 14)}  # 13 operators costing 1 .. 13, 91 in all
    chart = operator_mix_chart(_mix_result(flops, activation_bytes={"relu": 3, "linear": 1, "view": 0}))
    assert chart["metrics"] == ["flops", "activation_bytes"]  # peak_memory does not add up over operators
    bars = chart["bars"]["flops"]
    assert [bar["operator"] for bar in bars] == [f"op{n:02d}" for n in range(13, 3, -1)] + ["other (3 operators)"]
    assert [bar["value"] for bar in bars] == [13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 6]
    assert [bar["share"] for bar in bars] == [pytest.approx(v / 91) for v in (13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 6)]
    assert [bar["others"] for bar in bars] == [0] * 10 + [3]
    left, top, right = chart["plot"]
    assert [bar["width"] for bar in bars] == [pytest.approx(v / 13 * (right - left), abs=0.01)
                                              for v in (13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 6)]
    assert [bar["y"] for bar in bars] == [top + 24 * row for row in range(11)]
    assert chart["height"] == 2 * top + 11 * 24
    # an operator with none of the metric gets no bar
    assert [(bar["operator"], bar["width"]) for bar in chart["bars"]["activation_bytes"]] == [
        ("relu", right - left), ("linear", pytest.approx((right - left) / 3, abs=0.01))]


def test_operator_mix_names_a_single_leftover() -> None:
    """Eleven operators: the eleventh is shown by name, not as an "other" of one; a metric the model has none of is
    not offered."""
    flops = {f"op{n:02d}": float(n) for n in range(1, 12)}
    chart = operator_mix_chart(_mix_result(flops, saved_bytes={"relu": 0}))
    assert chart["metrics"] == ["flops"]
    assert [bar["operator"] for bar in chart["bars"]["flops"]][-1] == "op01"
    assert not any(bar["others"] for bar in chart["bars"]["flops"])
    assert operator_mix_chart(_mix_result(flops), top=3)["bars"]["flops"][-1]["operator"] == "other (8 operators)"


def test_other_bar_longer_than_the_costliest() -> None:
    """Many small operators: "other" is the longest bar and sets the scale."""
    flops = {"big": 10.0, **{f"small{n:02d}": 2.0 for n in range(20)}}
    bars = operator_mix_chart(_mix_result(flops), top=2)["bars"]["flops"]
    assert [(bar["operator"], bar["value"]) for bar in bars] == [
        ("big", 10), ("small00", 2), ("other (19 operators)", 38)]
    assert bars[2]["width"] == 410 and bars[0]["width"] == pytest.approx(410 * 10 / 38, abs=0.01)


# the page's data and parts ---------------------------------------------------------------------
def test_memory_page_data() -> None:
    _, result = _training_step()
    page = render_html(result)
    data = _embedded(page)
    assert data == html_data(result)
    assert data["memory_timeline"] == memory_timeline_chart(result.memory)
    assert data["operator_mix"] == operator_mix_chart(result)
    assert data["operator_mix"]["metrics"][:3] == ["flops", "forward_flops", "backward_flops"]
    assert page.count('<section id="memory-timeline">') == page.count('<section id="operator-mix">') == 1
    assert page.count("<script") == 2 and html_memory.SCRIPT in page and html_memory.STYLE in page
    assert Result.from_json(result.to_json()) == result


def test_pages_without_the_memory_analysis_are_unchanged() -> None:
    page = render_html(_before())
    assert "memory_timeline" not in _embedded(page) and "operator_mix" not in _embedded(page)
    assert 'id="memory-timeline"' not in page and 'id="operator-mix"' not in page
    assert html_memory.SCRIPT not in page and html_memory.STYLE not in page
    assert "</section>\n<section><h2>Modules</h2>" in page  # the body as it was


def test_a_memory_result_without_a_timeline() -> None:
    """A result saved before the timeline existed: the operator mix, but no timeline section."""
    result = _memory_result()
    assert "timeline" not in result.memory
    page = render_html(result)
    data = _embedded(page)
    assert "memory_timeline" not in data and data["operator_mix"]["metrics"] == ["flops", "activation_bytes"]
    assert 'id="memory-timeline"' not in page and page.count('<section id="operator-mix">') == 1


# in the browser --------------------------------------------------------------------------------
@pytest.fixture
def training_page(browser: Any, tmp_path: Path) -> Iterator[tuple[MemoryAnalysis, Result, Opened]]:
    mem, result = _training_step()
    path = tmp_path / "memory.html"
    write_html(result, path)
    report = Opened(browser, path)
    yield mem, result, report
    assert report.errors == []
    assert report.requests == [report.url]
    report.context.close()


def _hover_at(report: Opened, selector: str, x: float, y: float, width: float) -> str:
    """Hover the viewBox pixel (x, y) of the SVG ``selector`` and return the tooltip's text."""
    box = report.page.locator(selector).bounding_box()
    assert box is not None
    scale = box["width"] / width
    report.page.mouse.move(box["x"] + x * scale, box["y"] + y * scale)
    return report.page.locator("#tooltip").inner_text()


@needs_browser
def test_timeline_page(training_page: tuple[MemoryAnalysis, Result, Opened]) -> None:
    mem, result, report = training_page
    page = report.page
    chart = memory_timeline_chart(result.memory)
    assert page.locator("#memory-title").inner_text() == "Memory timeline of the training step with adam"
    kinds = page.locator("#memory-chart polygon.layer").evaluate_all("ps => ps.map(p => p.dataset.kind)")
    assert kinds == result.memory["timeline"]["kinds"]
    # the top layer's outline is a step line through the data's edges and tops
    outline = page.locator("#memory-chart polygon.layer").last.get_attribute("points")
    assert outline is not None
    pairs = [tuple(map(float, p.split(","))) for p in outline.split()]
    top = chart["layers"][-1]["top"]
    assert pairs[:2 * len(top)] == [pytest.approx(pt, abs=0.01) for i, y in enumerate(top)
                                    for pt in ((chart["edges"][i], y), (chart["edges"][i + 1], y))]
    dot = page.locator("#memory-chart circle.peak-dot")
    assert float(str(dot.get_attribute("cx"))) == pytest.approx(chart["peak"]["x"])
    assert float(str(dot.get_attribute("cy"))) == pytest.approx(chart["peak"]["y"])
    top_info = mem.peak_info()
    assert page.locator("#memory-peak").text_content() == (
        f"peak {format_bytes(top_info.bytes)} in the {top_info.at.phase} of {top_info.at.module or 'the model'} "
        f"at {top_info.at.operator}")
    # hovering the peak's operator names it, its module, and what was live, exactly
    text = _hover_at(report, "#memory-chart", chart["peak"]["x"], 200, chart["width"])
    timeline = mem.timeline()
    position = timeline.index(top_info.at)
    lines = text.splitlines()
    assert lines[0] == f"operator {position + 1} of {len(timeline)} ({top_info.at.phase})"
    assert lines[1] == f"{top_info.at.module or 'Sequential'}  at {top_info.at.operator}"
    assert lines[2] == f"live: {top_info.bytes:,} bytes = {format_bytes(top_info.bytes)}"
    point = chart["peak"]["point"]
    data = result.memory["timeline"]
    assert lines[3:] == [f"  {kind.replace('_', ' ')} {format_bytes(data['bytes'][kind][point])}"
                         for kind in data["kinds"] if data["bytes"][kind][point]]
    assert "  optimizer state " + format_bytes(top_info.by_kind["optimizer_state"]) in lines
    assert page.locator("#memory-chart line.cursor").get_attribute("visibility") == "visible"
    # the first operator, on the far left
    first = _hover_at(report, "#memory-chart", LEFT + 2, 200, chart["width"]).splitlines()
    assert first[0] == f"operator 1 of {len(timeline)} (forward)" and first[2].startswith(f"live: {timeline[0].live:,}")
    legend = page.locator("#memory-legend").inner_text()
    for layer in chart["layers"]:
        assert f"{layer['label']} {format_bytes(layer['at_peak'])}" in legend


@needs_browser
def test_timeline_page_downsampled(browser: Any, tmp_path: Path) -> None:
    mem, result = _training_step(max_points=7)
    data = result.memory["timeline"]
    path = tmp_path / "downsampled.html"
    write_html(result, path)
    report = Opened(browser, path)
    chart = memory_timeline_chart(result.memory)
    assert len(chart["edges"]) == 8
    edges = chart["edges"]
    text = _hover_at(report, "#memory-chart", (edges[2] + edges[3]) / 2, 200, chart["width"])
    bucket, position = data["bucket"], data["position"][2]
    assert text.splitlines()[0].startswith(f"operator {position + 1} of {data['length']}")
    assert text.splitlines()[-1] == f"the highest of operators {2 * bucket + 1}–{3 * bucket}"
    assert f"live: {mem.timeline()[position].live:,} bytes" in text
    assert report.errors == [] and report.requests == [report.url]
    report.context.close()


@needs_browser
def test_operator_mix_page(training_page: tuple[MemoryAnalysis, Result, Opened]) -> None:
    _, result, report = training_page
    page = report.page
    chart = operator_mix_chart(result)
    options = page.locator("#mix-metric option").evaluate_all("os => os.map(o => o.value)")
    assert options == chart["metrics"] and page.locator("#mix-metric").input_value() == "flops"

    def bars() -> list[list[Any]]:
        return [[str(a), float(b)] for a, b in page.locator("#mix-chart rect").evaluate_all(
            "rs => rs.map(r => [r.previousSibling.textContent, r.width.baseVal.value])")]

    by_op = result.root.by_operator
    drawn = bars()
    assert [name for name, _ in drawn] == sorted((op for op, v in by_op["flops"].items() if v > 0),
                                                 key=lambda op: (-by_op["flops"][op], op))
    longest = drawn[0][1]
    for name, width in drawn:
        assert width / longest == pytest.approx(by_op["flops"][name] / by_op["flops"][drawn[0][0]], abs=1e-3)
    page.select_option("#mix-metric", "activation_bytes")
    drawn = bars()
    assert {name for name, _ in drawn} == {op for op, v in by_op["activation_bytes"].items() if v > 0}
    page.hover("#mix-chart rect >> nth=0")
    name = drawn[0][0]
    value = by_op["activation_bytes"][name]
    share = 100 * value / result.total("activation_bytes")
    assert page.locator("#tooltip").inner_text().splitlines() == [
        name, f"activation_bytes: {value:,} bytes  ({share:.2f}% of the model's)"]
    label = page.locator("#mix-chart text >> nth=1").text_content()
    assert label == f"{format_bytes(value)} ({float(f'{share:.3g}'):g}%)"


@needs_browser
def test_memory_page_hostile_names(browser: Any, tmp_path: Path) -> None:
    _, result = _training_step()
    result = copy.deepcopy(result)
    timeline = result.memory["timeline"]
    timeline["modules"] = [HOSTILE] * len(timeline["modules"])
    result.memory["module"] = HOSTILE
    result.root.by_operator["flops"] = {HOSTILE: 5.0}
    path = tmp_path / "hostile.html"
    write_html(result, path)
    report = Opened(browser, path)
    assert HOSTILE in str(report.page.locator("#memory-peak").text_content())
    assert report.page.locator("#mix-chart text").first.text_content() == HOSTILE[:33] + "…"
    assert report.page.evaluate("window.pwned") is None and report.page.locator("script").count() == 2
    assert report.errors == [] and report.requests == [report.url]
    report.context.close()
