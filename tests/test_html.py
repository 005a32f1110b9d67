"""The HTML report: the embedded data and deltas by hand, escaping, and the page in a real headless Chromium."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import modelmeter
from modelmeter.reports.columns import shapes_cell
from modelmeter.reports.html import html_data, module_deltas, render_html, roofline_chart, write_html
from modelmeter.reports.result import ModuleRow, Result

try:
    from playwright.sync_api import Browser, Page, sync_playwright
    HAVE_PLAYWRIGHT = True
except ImportError:  # the browser tests skip
    HAVE_PLAYWRIGHT = False

CHROMIUM = "/usr/bin/chromium"
# .ci/run installs Chromium and sets MODELMETER_BROWSER_TESTS=required: there a missing browser is a failure
BROWSER_REQUIRED = os.environ.get("MODELMETER_BROWSER_TESTS") == "required"
if BROWSER_REQUIRED and (not HAVE_PLAYWRIGHT or not os.path.exists(CHROMIUM)):
    raise RuntimeError("MODELMETER_BROWSER_TESTS=required, but playwright or /usr/bin/chromium is missing")
needs_browser = pytest.mark.skipif(not HAVE_PLAYWRIGHT or not os.path.exists(CHROMIUM),
                                   reason="needs the playwright package and Chromium at /usr/bin/chromium "
                                          "(apt-get install chromium)")

HOSTILE = "</script><script>window.pwned=1</script><!-- & \"'"


def _embedded(page: str) -> Any:
    match = re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)
    assert match is not None
    return json.loads(match.group(1))


def _row(name: str, type_: str, params: int, flops: int, acts: int, ops: dict[str, float] | None = None) -> ModuleRow:
    by_op = {"flops": ops or {}, "activations": {}}
    return ModuleRow(name, type_, params, {"flops": flops, "activations": acts}, by_op)


def _before() -> Result:
    """A hand-made run: the model (100 flops: a 60, b 40), with operators linear 90 + conv 10."""
    return Result("Net", [{"shape": [1, 8], "dtype": "float32"}], ["flops", "activations"], [
        _row("", "Net", 30, 100, 12, {"linear": 90, "conv": 10}), _row("a", "Linear", 20, 60, 8),
        _row("b", "Linear", 10, 40, 4)])


def _after() -> Result:
    """The same model changed: a grows to 70, b is gone, c (25) is new, the model's own work is 25; only flops."""
    return Result("Net2", [{"shape": [1, 8], "dtype": "float32"}], ["flops"], [
        ModuleRow("", "Net", 45, {"flops": 120}, {"flops": {"linear": 120}}),
        ModuleRow("a", "Linear", 20, {"flops": 70}), ModuleRow("c", "Conv", 25, {"flops": 25})])


# the page's data -------------------------------------------------------------------------------
def test_data_is_embedded_compactly() -> None:
    result = _before()
    data = _embedded(render_html(result))
    assert data == html_data(result)
    assert data["modules"] == [["", "Net", True, 30, 100, 12], ["a", "Linear", True, 20, 60, 8],
                               ["b", "Linear", True, 10, 40, 4]]
    assert data["operators"] == [["linear", [90, 0], None], ["conv", [10, 0], None]]
    assert data["inputs"] == ["1x8 float32"]
    assert data["version"] == modelmeter.__version__ and data["torch"] == torch.__version__
    assert data["compare"] is None


def test_compare_deltas_by_hand() -> None:
    after, before = _after(), _before()
    assert module_deltas(after, before) == {
        "": {"params": 15, "flops": 20}, "a": {"params": 0, "flops": 10},
        "c": {"params": 25, "flops": 25}, "b": {"params": -10, "flops": -40}}
    # before measured activations, after did not: no difference can be given
    assert module_deltas(before, after) == {
        "": {"params": -15, "flops": -20, "activations": None}, "a": {"params": 0, "flops": -10, "activations": None},
        "b": {"params": 10, "flops": 40, "activations": None}, "c": {"params": -25, "flops": -25, "activations": None}}
    data = _embedded(render_html(after, compare=before))
    assert [row[0] for row in data["modules"]] == ["", "a", "c", "b"]
    assert data["modules"][3] == ["b", "Linear", True, 0, 0]
    assert data["compare"]["status"] == ["", "", "+", "-"]
    assert data["compare"]["deltas"] == [[15, 20], [0, 10], [25, 25], [-10, -40]]
    assert data["operators"] == [["linear", [120], [30]], ["conv", [0], [-10]]]


def test_text_is_escaped() -> None:
    result = _before()
    result.model = HOSTILE
    result.modules[1].name = HOSTILE
    result.assumptions = [HOSTILE]
    result.unsupported = {HOSTILE: 2}
    page = render_html(result)
    assert page.count("</script>") == 2 and page.count("<script") == 2 and "<!-- &" not in page
    assert "<title>modelmeter: &lt;/script&gt;" in page
    data = _embedded(page)
    assert data["model"] == data["modules"][1][0] == data["assumptions"][0] == data["unsupported"][0][0] == HOSTILE


def test_placeholders_in_names_stay_text() -> None:
    """The page is filled in one pass: a model named like the template's slots gets no script or data there."""
    result = _roofline_result()
    result.model = "{{SCRIPT}}{{DATA}}{{ROOFLINE}}{{STYLE}}"
    page = render_html(result, compare=_before())
    assert "<title>modelmeter: {{SCRIPT}}{{DATA}}{{ROOFLINE}}{{STYLE}} vs Net</title>" in page
    assert page.count("<script") == 2 and page.count('<section id="roofline">') == 1 and page.count("<style>") == 1
    assert _embedded(page)["model"] == result.model


def test_write_html(tmp_path: Path) -> None:
    path = tmp_path / "report.html"
    write_html(_before(), path, compare=_after())
    assert path.read_text(encoding="utf-8") == render_html(_before(), compare=_after())
    assert os.listdir(tmp_path) == ["report.html"]


# in the browser --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resnet() -> Result:
    import torchvision

    model = torchvision.models.resnet18(weights=None)
    return modelmeter.analyze(model, torch.randn(1, 3, 64, 64), backward=True, quiet=True).result()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--no-first-run"])
        yield browser
        browser.close()


class Opened:
    """A report opened offline; every request, console message and page error it caused is kept."""

    def __init__(self, browser: Browser, path: Path) -> None:
        self.url = path.as_uri()
        self.context = browser.new_context(viewport={"width": 1200, "height": 800})
        self.context.set_offline(True)
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.context.route("**/*", self._route)
        self.page: Page = self.context.new_page()
        self.page.set_default_timeout(5000)
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("console", lambda msg: self.errors.append(msg.text) if msg.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("dialog", lambda dialog: self.errors.append(f"dialog {dialog.message}"))
        self.page.goto(self.url)

    def _route(self, route: Any) -> None:
        if route.request.url == self.url:
            route.continue_()
        else:
            route.abort()

    def width(self, name: str) -> float:
        box = self.page.locator(f'#chart rect[data-module="{name}"]').bounding_box()
        assert box is not None
        return float(box["width"])

    def rects(self) -> list[str]:
        return [str(n) for n in self.page.locator("#chart rect").evaluate_all("rs => rs.map(r => r.dataset.module)")]


@pytest.fixture
def opened(browser: Browser, resnet: Result, tmp_path: Path) -> Iterator[Opened]:
    path = tmp_path / "report.html"
    write_html(resnet, path)
    report = Opened(browser, path)
    yield report
    assert report.errors == []
    assert report.requests == [report.url]
    report.context.close()


def _drawn(result: Result, metric: str, depth: int, under: str = "") -> list[str]:
    """The modules the chart should draw: ``under`` and its descendants up to ``depth`` levels below with a value."""
    top = result.row(under).depth
    inside = [row for row in result.modules if row.name == under or row.name.startswith(f"{under}.") or not under]
    value = (lambda row: row.params) if metric == "params" else (lambda row: row.metrics[metric])
    return [row.name for row in inside if row.name == under or (row.depth - top <= depth and value(row) > 0)]


@needs_browser
def test_page_loads_offline_without_errors(opened: Opened, resnet: Result, tmp_path: Path) -> None:
    assert opened.page.locator("#header h1").inner_text() == resnet.model
    header = opened.page.locator("#header").inner_text()
    assert "1x3x64x64 float32" in header and f"modelmeter {modelmeter.__version__}" in header
    assert f"torch {torch.__version__}" in header and "fvcore" in header
    shot = tmp_path / "report.png"
    opened.page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


@needs_browser
def test_one_rect_per_module_up_to_the_depth(opened: Opened, resnet: Result) -> None:
    assert sorted(opened.rects()) == sorted(_drawn(resnet, "flops", 3))
    assert len(opened.rects()) == 52
    for depth in ("1", "4"):
        opened.page.select_option("#depth", depth)
        assert sorted(opened.rects()) == sorted(_drawn(resnet, "flops", int(depth)))
    opened.page.select_option("#metric", "params")
    assert sorted(opened.rects()) == sorted(_drawn(resnet, "params", 4))


@needs_browser
def test_hover_shows_exact_value_and_share(opened: Opened, resnet: Result) -> None:
    for name in ("layer3", "layer1.0.conv1"):
        opened.page.hover(f'#chart rect[data-module="{name}"]')
        text = opened.page.locator("#tooltip").inner_text()
        value = resnet.row(name).metrics["flops"]
        assert f"flops: {value:,}" in text and f"({100 * resnet.share(name, 'flops'):.2f}% of total)" in text
        assert f"({resnet.row(name).type})" in text


@needs_browser
def test_click_zooms_in_and_out(opened: Opened, resnet: Result) -> None:
    chart = opened.width("")
    opened.page.click('#chart rect[data-module="layer2"]')
    assert opened.width("layer2") == pytest.approx(chart)
    assert sorted(opened.rects()) == sorted(_drawn(resnet, "flops", 3, under="layer2"))
    opened.page.click('#chart rect[data-module="layer2.1"]')
    assert opened.width("layer2.1") == pytest.approx(chart)
    opened.page.click('#chart rect[data-module="layer2.1"]')  # the top bar: one level out
    assert opened.width("layer2") == pytest.approx(chart)
    opened.page.locator("#breadcrumb button").first.click()
    assert sorted(opened.rects()) == sorted(_drawn(resnet, "flops", 3))


@needs_browser
def test_metric_switch_sizes_by_that_metric(opened: Opened, resnet: Result) -> None:
    chart = opened.width("")
    assert opened.width("layer4") / chart == pytest.approx(resnet.share("layer4", "flops"), abs=1e-3)
    opened.page.select_option("#metric", "params")
    params = resnet.row("layer4").params / resnet.root.params
    assert opened.width("layer4") / chart == pytest.approx(params, abs=1e-3)
    assert abs(params - resnet.share("layer4", "flops")) > 0.3  # the switch did change the width
    opened.page.select_option("#metric", "backward_flops")
    assert opened.width("layer4") / chart == pytest.approx(resnet.share("layer4", "backward_flops"), abs=1e-3)


def _column(opened: Opened, table: str, index: int) -> list[str]:
    return [str(t) for t in opened.page.locator(f"#{table} tbody tr").evaluate_all(
        f"rows => rows.map(r => r.cells[{index}].title || r.cells[{index}].textContent)")]


@needs_browser
def test_tables_sort(opened: Opened, resnet: Result) -> None:
    assert _column(opened, "modules", 1)[:2] == ["ResNet", "Conv2d"]  # model order first
    assert len(_column(opened, "modules", 0)) == len(resnet.modules)
    flops = 3  # module, type, params, flops
    opened.page.click(f"#modules th >> nth={flops}")
    values = [int(v.replace(",", "")) for v in _column(opened, "modules", flops)]
    assert values == sorted((row.metrics["flops"] for row in resnet.modules), reverse=True)
    opened.page.click(f"#modules th >> nth={flops}")
    assert [int(v.replace(",", "")) for v in _column(opened, "modules", flops)] == sorted(values)
    opened.page.click("#modules th >> nth=0")
    rows = opened.page.locator("#modules tbody tr")
    names = [str(n) for n in rows.evaluate_all("rs => rs.map(r => r.dataset.module)")]
    assert names == sorted(row.name for row in resnet.modules)
    by_op = resnet.root.by_operator
    ops = {op for metric in resnet.metrics for op in by_op[metric]}
    opened.page.click("#operators th >> nth=1")
    opened.page.click("#operators th >> nth=1")  # costliest first already; now ascending
    assert [int(v.replace(",", "")) for v in _column(opened, "operators", 1)] == sorted(
        by_op["flops"].get(op, 0) for op in ops)


@needs_browser
def test_output_shapes_column(opened: Opened, resnet: Result) -> None:
    last = 3 + len(resnet.metrics)  # module, type, params, the metrics, then the output shapes
    assert opened.page.locator(f"#modules th >> nth={last}").inner_text().startswith("output shapes")
    shapes = _column(opened, "modules", last)
    assert shapes == [shapes_cell(row) for row in resnet.modules]
    assert shapes[:2] == ["1x1000", "1x64x32x32"]  # the model, conv1: by hand, 64 channels at stride 2


def test_output_shapes_data() -> None:
    assert "shapes" not in html_data(_before())  # a result without output shapes: the page as it was
    result = _before()
    result.modules[1].output_shapes = {"2x5": 1, "1x5": 2}
    assert html_data(result)["shapes"] == ["-", "2x5; 1x5 (2 calls)", "-"]


@needs_browser
def test_compare_page(browser: Browser, tmp_path: Path) -> None:
    path = tmp_path / "compare.html"
    write_html(_after(), path, compare=_before())
    report = Opened(browser, path)
    page = report.page
    assert sorted(report.rects()) == ["", "a", "c"]  # b has nothing to draw in this run
    page.hover('#chart rect[data-module="a"]')
    text = page.locator("#tooltip").inner_text()
    assert report.width("a") / report.width("") == pytest.approx(70 / 120, abs=1e-3)  # 25 of the model's own
    assert "flops: 70  (58.33% of total)" in text and "difference: +10  (16.67% of Net's)" in text
    page.hover('#chart rect[data-module="c"]')
    assert "difference: +25  (new: not in Net)" in page.locator("#tooltip").inner_text()
    red = page.locator('#chart rect[data-module="a"]').get_attribute("fill")
    assert red is not None and red.startswith("hsl(0,")
    cells = "r => [...r.cells].map((c, i) => i ? c.title || c.textContent : c.textContent)"
    rows = {str(r[0]): r[1:] for r in page.locator("#modules tbody tr").evaluate_all(
        f"rs => rs.map(r => [r.dataset.module, ...({cells})(r)])")}
    assert rows["b"] == ["bonly in Net", "Linear", "0", "-10", "0", "-40"]
    assert rows["c"][0] == "cnew" and rows["c"][2] == "25" and rows["c"][5] == "+25"
    assert report.errors == [] and report.requests == [report.url]
    report.context.close()


@needs_browser
def test_hostile_names_stay_text(browser: Browser, tmp_path: Path) -> None:
    result = _before()
    result.model = result.modules[1].name = HOSTILE
    result.assumptions = [HOSTILE]
    path = tmp_path / "hostile.html"
    write_html(result, path)
    report = Opened(browser, path)
    assert report.page.locator("#header h1").inner_text() == HOSTILE
    assert report.page.locator("#assumptions li").inner_text() == HOSTILE
    assert report.page.evaluate("window.pwned") is None and report.page.locator("script").count() == 2
    assert report.errors == [] and report.requests == [report.url]
    report.context.close()


# memory: bytes in binary units, a peak that does not add up -----------------------------------
def _memory_result() -> Result:
    """A hand-made training step: activation bytes by operator (a 2KiB + b 1KiB = the model's 3KiB) and each
    module's peak, which does not add up (a 5MiB and b 4MiB under a model peak of 5MiB)."""
    def row(name: str, type_: str, params: int, flops: int, acts: int, peak: int,
            ops: dict[str, dict[str, float]]) -> ModuleRow:
        return ModuleRow(name, type_, params, {"flops": flops, "activation_bytes": acts, "peak_memory": peak}, ops)

    memory = {"peak": 5 * 2**20, "phase": "backward", "module": "a", "operator": "linear backward",
              "by_kind": {"parameter": 120, "activation": 3072}, "training": True, "optimizer": None,
              "saved_bytes": 2048}
    return Result("Net", [{"shape": [1, 8], "dtype": "float32"}], ["flops", "activation_bytes", "peak_memory"], [
        row("", "Net", 30, 100, 3072, 5 * 2**20, {"flops": {"linear": 100},
                                                  "activation_bytes": {"linear": 2048, "relu": 1024}}),
        row("a", "Linear", 20, 60, 2048, 5 * 2**20, {"flops": {"linear": 60}, "activation_bytes": {"linear": 2048}}),
        row("b", "Linear", 10, 40, 1024, 4 * 2**20, {"flops": {"linear": 40}, "activation_bytes": {"relu": 1024}})],
        memory=memory)


def test_memory_data_by_hand() -> None:
    data = _embedded(render_html(_memory_result()))
    assert data["byte_metrics"] == ["activation_bytes", "peak_memory"]
    assert data["chart_metrics"] == ["params", "flops", "activation_bytes"]  # no peak_memory: children would not fit
    assert data["operator_metrics"] == ["flops", "activation_bytes"]  # a peak has no operators
    assert data["operators"] == [["linear", [100, 2048], None], ["relu", [0, 1024], None]]
    assert data["memory"] == "Peak memory (training step): 5MiB during the backward of a at linear backward " \
                             "(parameter 120B, activation 3KiB)"
    assert data["modules"][2] == ["b", "Linear", True, 10, 40, 1024, 4 * 2**20]
    before = _memory_result()
    before.root.by_operator["activation_bytes"] = {"linear": 1024}
    after = _embedded(render_html(_memory_result(), compare=before))
    assert after["operators"] == [["linear", [100, 2048], [0, 1024]], ["relu", [0, 1024], [0, 1024]]]
    assert _embedded(render_html(_before()))["memory"] is None


@needs_browser
def test_memory_page_in_binary_units(browser: Browser, tmp_path: Path) -> None:
    from modelmeter.reports.render import format_bytes

    path = tmp_path / "memory.html"
    write_html(_memory_result(), path)
    report = Opened(browser, path)
    page = report.page
    options = [str(v) for v in page.locator("#metric option").evaluate_all("os => os.map(o => o.value)")]
    assert options == ["params", "flops", "activation_bytes"]
    assert "Peak memory (training step): 5MiB during the backward of a" in page.locator("#header").inner_text()
    page.select_option("#metric", "activation_bytes")
    assert report.width("a") / report.width("") == pytest.approx(2048 / 3072, abs=1e-3)
    page.hover('#chart rect[data-module="a"]')
    assert "activation_bytes: 2,048 bytes = 2KiB  (66.67% of total)" in page.locator("#tooltip").inner_text()
    peak = page.locator('#modules tbody tr[data-module="b"] td').nth(5)
    assert (peak.inner_text(), peak.get_attribute("title")) == ("4MiB", "4,194,304 bytes")
    assert len(page.locator("#operators thead th").all()) == 3  # operator, flops, activation_bytes
    values = [0, 1, 1023, 1024, 1536, 10_000, 225_699_420, 3 * 2**30 + 2**29, 7 * 2**40, -1536]
    assert page.evaluate(f"{values}.map(bytes)") == [format_bytes(v) for v in values]
    assert report.errors == [] and report.requests == [report.url]
    report.context.close()


# the roofline: chart geometry, summary, icicle sized by time or bytes ----------------------------
BANDWIDTH, PEAK, VECTOR_PEAK = 1e12, 1e14, 1e13  # a made-up device: ridges at 100 and 10 FLOPs/byte


def _op(name: str, flops: float, moved: float, matrix: bool) -> dict[str, Any]:
    """An operator of the summary, its time and bound by the roofline computed here from the device's numbers."""
    compute, memory = flops / (PEAK if matrix else VECTOR_PEAK), moved / BANDWIDTH
    return {"operator": name, "dtype": "bfloat16", "flops": flops, "bytes": moved, "time": max(compute, memory),
            "compute_bound": compute >= memory, "intensity": flops / moved if moved else None}


# mm: intensity 1000, compute-bound at the matrix peak; softmax: 5, memory-bound (the vector roof is higher
# there); add: 1/12, memory-bound; copy_ (no FLOPs) and a formula without bytes cannot be placed on a log scale.
OPERATORS = [_op("mm", 1e12, 1e9, True), _op("softmax", 5e8, 1e8, False), _op("add", 1e6, 1.2e7, False),
             _op("copy_", 0, 4096, False), _op("custom", 100, 0, False)]


def _roofline_summary() -> dict[str, Any]:
    total = sum(op["time"] for op in OPERATORS)
    flops = sum(op["flops"] for op in OPERATORS)
    compute = sum(op["time"] for op in OPERATORS if op["compute_bound"])
    return {"device": {"name": "test", "label": "Test GPU 80GB", "memory": 80 * 2**30, "bandwidth": BANDWIDTH,
                       "peak": PEAK, "vector_peak": VECTOR_PEAK, "ridge": PEAK / BANDWIDTH},
            "dtype": "bfloat16", "settings": {"efficiency": 1.0, "launch_overhead": 0.0, "tf32": False},
            "time": {"forward": total / 3, "backward": 2 * total / 3, "total": total},
            "flops": flops, "model_flops": flops, "bytes": sum(op["bytes"] for op in OPERATORS),
            "compute_bound_share": compute / total, "predicted_mfu": flops / (total * PEAK),
            "measured_time": 0.02, "mfu": flops / (0.02 * PEAK), "hfu": flops / (0.02 * PEAK),
            "items": {"count": 8, "unit": "images"}, "throughput": 8 / total, "operators": OPERATORS}


def _roofline_row(name: str, type_: str, params: int, ops: list[dict[str, Any]]) -> ModuleRow:
    """A module whose work is ``ops``: flops, bytes, time and the two ratios, also by operator."""
    by_op: dict[str, dict[str, float]] = {"flops": {}, "bytes": {}, "time": {}}
    for op in ops:
        for metric in by_op:
            by_op[metric][op["operator"]] = op[metric]
    flops, moved, time = (sum(by_op[metric].values()) for metric in ("flops", "bytes", "time"))
    bound = sum(op["time"] for op in ops if op["compute_bound"])
    metrics = {"flops": flops, "bytes": moved, "time": time, "intensity": flops / moved, "compute_bound": bound / time}
    return ModuleRow(name, type_, params, metrics, by_op)


def _roofline_result() -> Result:
    """A hand-made run on the made-up device: attn does softmax and add, mlp the mm, the model itself the rest."""
    rows = [_roofline_row("", "Net", 30, OPERATORS), _roofline_row("attn", "Attention", 10, OPERATORS[1:3]),
            _roofline_row("mlp", "Linear", 20, OPERATORS[:1])]
    return Result("Net", [{"shape": [8, 3, 4, 4], "dtype": "bfloat16"}],
                  ["flops", "bytes", "time", "intensity", "compute_bound"], rows, roofline=_roofline_summary())


def _on_roof(point: tuple[float, float], roof: list[list[float]]) -> bool:
    """Whether a pixel lies on the polyline ``roof`` (to a hundredth of a pixel, the chart's rounding)."""
    x, y = point
    for (x0, y0), (x1, y1) in itertools.pairwise(roof):
        if x0 - 0.01 <= x <= x1 + 0.01 and x1 > x0:
            return abs(y0 + (x - x0) / (x1 - x0) * (y1 - y0) - y) < 0.02
    return False


def test_roofline_geometry_by_hand() -> None:
    chart = roofline_chart(_roofline_summary())
    left, top, right, bottom = chart["plot"]
    # decades from the lowest to the highest value, evenly spaced over the whole plot box
    assert [label for _, label in chart["x_ticks"]] == ["0.01", "0.1", "1", "10", "100", "1K"]  # 1/12 .. 1000
    assert [label for _, label in chart["y_ticks"]] == ["10G", "100G", "1T", "10T", "100T"]  # 83.3G .. 100T
    xs, ys = [x for x, _ in chart["x_ticks"]], [y for y, _ in chart["y_ticks"]]
    pad = xs[0] - left
    assert 18 < pad == right - xs[-1] == bottom - ys[0] == ys[-1] - top  # room for the largest point
    decade_x, decade_y = (xs[-1] - xs[0]) / 5, (ys[-1] - ys[0]) / 4
    assert all(b - a == pytest.approx(decade_x, abs=0.01) for a, b in itertools.pairwise(xs))
    assert all(b - a == pytest.approx(decade_y, abs=0.01) for a, b in itertools.pairwise(ys))

    def at(value: float, lowest: int, first: float, decade: float) -> float:  # a log scale from its ticks
        return first + (math.log10(value) - lowest) * decade

    points = {p["operator"]: p for p in chart["points"]}
    assert list(points) == ["mm", "softmax", "add"]  # the longest first (drawn under the shorter ones)
    assert chart["omitted"] == 2  # copy_ (no FLOPs) and custom (no bytes)
    for op in OPERATORS[:3]:
        p = points[op["operator"]]
        assert p["intensity"] == op["flops"] / op["bytes"] and p["rate"] == op["flops"] / op["time"]
        assert p["x"] == pytest.approx(at(op["flops"] / op["bytes"], -2, xs[0], decade_x), abs=0.01)
        assert p["y"] == pytest.approx(at(op["flops"] / op["time"], 10, ys[0], decade_y), abs=0.01)
        assert p["compute_bound"] is op["compute_bound"] and p["time"] == op["time"]
        assert left <= p["x"] - p["r"] < p["x"] + p["r"] <= right and top <= p["y"] - p["r"] < p["y"] + p["r"] <= bottom
    assert points["mm"]["x"] == xs[5] and points["mm"]["y"] == ys[4]  # 1000 FLOPs/byte at 100 TFLOP/s
    # radii: area proportional to time
    assert points["mm"]["r"] == 18
    for name in ("softmax", "add"):
        assert ((points[name]["r"] - 3) / 15) ** 2 == pytest.approx(points[name]["time"] / points["mm"]["time"],
                                                                    abs=1e-3)
    # the roofs: the ridge is peak / bandwidth, the slope has slope 1 in decades, the pure roofline's points lie on it
    matrix, vector = chart["roofs"]
    assert (matrix["name"], matrix["ridge"], vector["name"], vector["ridge"]) == ("matrix", 100, "vector", 10)
    assert chart["ridge"] == {"intensity": 100, "x": xs[4], "y": ys[4]}
    # 1 TB/s x 0.01 FLOPs/byte = 10 GFLOP/s: both slopes start at the bottom-left corner
    assert matrix["points"] == [[xs[0], ys[0]], [xs[4], ys[4]], [xs[5], ys[4]]]
    assert vector["points"] == [[xs[0], ys[0]], [xs[3], ys[3]], [xs[5], ys[3]]]
    assert _on_roof((points["mm"]["x"], points["mm"]["y"]), matrix["points"])
    assert _on_roof((points["softmax"]["x"], points["softmax"]["y"]), matrix["points"])
    assert _on_roof((points["add"]["x"], points["add"]["y"]), vector["points"])
    assert chart["title"] == "Roofline on Test GPU 80GB (bfloat16)"
    assert "operators" not in chart["summary"] and chart["summary"]["throughput"] == 8 / sum(
        op["time"] for op in OPERATORS)


def test_roofline_slope_enters_at_the_bottom_edge() -> None:
    """A roof whose slope would start below the plot starts where it crosses the bottom edge."""
    summary = _roofline_summary()
    summary["operators"] = [_op("mm", 1e12, 1e9, True)]  # intensity 1000 only: x from 1 (vector ridge 10) to 1000
    chart = roofline_chart(summary)
    assert [label for _, label in chart["x_ticks"]] == ["10", "100", "1K"]
    assert [label for _, label in chart["y_ticks"]] == ["10T", "100T"]
    corner = [chart["x_ticks"][0][0], chart["y_ticks"][0][0]]
    matrix, vector = chart["roofs"]
    # bandwidth x 10 FLOPs/byte = 10 TFLOP/s: the matrix slope starts at the scales' bottom-left corner
    assert matrix["points"][0] == corner
    assert vector["points"][0] == vector["points"][1] == corner  # the vector ridge is that very corner


def test_roofline_ticks_over_many_decades() -> None:
    """At most 8 ticks, one at each end: over 10 or 9 decades every second one (9 become 10)."""
    summary = _roofline_summary()
    summary["operators"] = [_op("mm", 1e12, 1e9, True), _op("tiny", 1e3, 1e10, False)]  # 1e-7 FLOPs/byte
    chart = roofline_chart(summary)
    assert [label for _, label in chart["x_ticks"]] == ["1e-7", "1e-5", "0.001", "0.1", "10", "1K"]
    assert [label for _, label in chart["y_ticks"]] == ["100K", "10M", "1G", "100G", "10T", "1P"]  # 100K..100T
    (x0, _), (x1, _) = chart["x_ticks"][:2]
    mm, tiny = chart["points"]
    assert tiny["intensity"] == 1e-7 and tiny["x"] == x0
    assert mm["x"] == pytest.approx(x0 + 5 * (x1 - x0))  # 10 decades above, two a tick


def test_roofline_with_nothing_to_place() -> None:
    summary = _roofline_summary()
    summary["operators"] = OPERATORS[3:]
    del summary["device"]["vector_peak"]
    chart = roofline_chart(summary)
    assert chart["points"] == [] and chart["omitted"] == 2
    assert [roof["name"] for roof in chart["roofs"]] == ["matrix"]  # no vector peak: no dashed roof
    assert [label for _, label in chart["x_ticks"]] == ["100", "1K"]


def test_roofline_data_in_page() -> None:
    result = _roofline_result()
    page = render_html(result)
    data = _embedded(page)
    assert data == html_data(result)
    assert data["roofline"] == roofline_chart(result.roofline)
    assert data["units"] == {"time": "time", "intensity": "intensity", "compute_bound": "share"}
    assert data["byte_metrics"] == ["bytes"]
    assert data["chart_metrics"] == ["params", "flops", "bytes", "time"]  # the ratios do not add up
    assert data["operator_metrics"] == ["flops", "bytes", "time", "intensity", "compute_bound"]
    assert page.count('<svg id="roofline-chart"') == 1
    assert Result.from_json(result.to_json()) == result  # the summary is plain data


def test_no_roofline_no_chart() -> None:
    page = render_html(_before())
    data = _embedded(page)
    assert "roofline" not in data and "units" not in data
    assert 'id="roofline' not in page
    assert "</section>\n<section><h2>Modules</h2>" in page  # the body as it was
    assert _before().roofline == {}


def _opened_roofline(browser: Browser, tmp_path: Path) -> tuple[Result, Opened, Page]:
    """The report of :func:`_roofline_result`, opened in the browser."""
    result = _roofline_result()
    path = tmp_path / "roofline.html"
    write_html(result, path)
    report = Opened(browser, path)
    return result, report, report.page


@needs_browser
def test_roofline_page(browser: Browser, tmp_path: Path) -> None:
    result, report, page = _opened_roofline(browser, tmp_path)
    chart = roofline_chart(result.roofline)
    assert page.locator("#roofline-title").inner_text() == "Roofline on Test GPU 80GB (bfloat16)"
    circles = page.locator("#roofline-chart circle").evaluate_all(
        "cs => cs.map(c => [c.cx.baseVal.value, c.cy.baseVal.value, c.r.baseVal.value, c.getAttribute('class')])")
    assert circles == [[pytest.approx(p["x"]), pytest.approx(p["y"]), pytest.approx(p["r"]),
                        "compute" if p["compute_bound"] else "memory"] for p in chart["points"]]
    assert page.locator("#roofline-chart polyline.roof.matrix").count() == 1
    assert page.locator("#roofline-chart polyline.roof.vector").count() == 1
    assert "ridge 100 FLOPs/byte" in str(page.locator("#roofline-chart").text_content())
    assert page.locator("#roofline-omitted").inner_text().startswith("2 operators with no FLOPs or no bytes")
    # the points sit where the data says, in the drawn page too: mm's centre on the 1K tick line
    box = page.locator("#roofline-chart").bounding_box()
    mm = page.locator("#roofline-chart circle").first.bounding_box()
    assert box is not None and mm is not None
    scale = box["width"] / chart["width"]
    assert mm["x"] + mm["width"] / 2 - box["x"] == pytest.approx(chart["x_ticks"][-1][0] * scale, abs=0.5)
    page.hover("#roofline-chart circle >> nth=0")
    text = page.locator("#tooltip").inner_text()
    assert text.splitlines() == ["mm  (bfloat16, compute-bound)", "FLOPs: 1,000,000,000,000 = 1T",
                                 "bytes: 1,000,000,000 = 954MiB", "time: 10ms", "intensity: 1000 FLOPs/byte",
                                 "attained: 100TFLOP/s"]
    summary = dict(zip(page.locator("#roofline-summary dt").all_inner_texts(),
                       page.locator("#roofline-summary dd").all_inner_texts(), strict=True))
    total = sum(op["time"] for op in OPERATORS)  # 10ms + 100µs + 12µs + 4.1ns + 1ps
    assert summary["predicted time"] == "10.1ms (forward 3.37ms, backward 6.74ms)"
    assert summary["throughput"] == f"{8 / total / 1000:.3f}K images/s (8 images a run)" == \
        "0.791K images/s (8 images a run)"
    assert summary["predicted MFU"] == "98.9%" and summary["measured"] == "20ms: MFU 50%, HFU 50%"
    assert summary["compute-bound"] == f"{100 * 0.01 / total:.1f}% of the time" == "98.9% of the time"
    assert summary["device"] == ("Test GPU 80GB: 100TFLOP/s bfloat16 matrix, 10TFLOP/s vector, 1TB/s, "
                                 "ridge 100 FLOPs/byte")
    assert report.errors == [] and report.requests == [report.url]
    report.context.close()


@needs_browser
def test_icicle_sized_by_time_or_bytes(browser: Browser, tmp_path: Path) -> None:
    result, report, page = _opened_roofline(browser, tmp_path)
    options = [str(v) for v in page.locator("#metric option").evaluate_all("os => os.map(o => o.value)")]
    assert options == ["params", "flops", "bytes", "time"] and page.locator("#metric").input_value() == "flops"
    for metric in ("time", "bytes"):
        page.select_option("#metric", metric)
        assert report.width("attn") / report.width("") == pytest.approx(result.share("attn", metric), abs=1e-3)
    assert abs(result.share("attn", "bytes") - result.share("attn", "time")) > 0.05  # the switch mattered
    page.select_option("#metric", "time")
    page.hover('#chart rect[data-module="mlp"]')
    assert "time: 0.01 s = 10ms  (98.89% of total)" in page.locator("#tooltip").inner_text()
    cells = page.locator('#modules tbody tr[data-module="attn"] td').all_inner_texts()
    assert cells[3:] == ["0.501G", "107MiB", "112µs", "4.47", "0%"]  # flops, bytes, time, intensity, compute share
    values = [0, 4.096e-9, 1.2e-5, 0.0001, 0.01, 0.9994, 1.5, 1234.0]
    assert page.evaluate(f"{values}.map(seconds)") == ["0s", "4.1ns", "12µs", "100µs", "10ms", "999ms", "1.5s",
                                                       "1230s"]
    assert report.errors == [] and report.requests == [report.url]
    report.context.close()


@needs_browser
def test_roofline_summary_settings(browser: Browser, tmp_path: Path) -> None:
    """The settings that change the prediction are named; no measured time, no vector peak, no matrix dtype."""
    result = _roofline_result()
    summary = result.roofline
    summary["settings"] = {"efficiency": 0.8, "launch_overhead": 5e-6, "tf32": True}
    summary.update(measured_time=None, mfu=None, hfu=None, dtype=None)
    del summary["device"]["vector_peak"]
    summary["time"] = {"forward": 0.0123, "total": 0.0123}
    result.model = result.roofline["device"]["label"] = HOSTILE
    summary["operators"][0]["operator"] = HOSTILE
    path = tmp_path / "settings.html"
    write_html(result, path)
    report = Opened(browser, path)
    page = report.page
    rows = dict(zip(page.locator("#roofline-summary dt").all_inner_texts(),
                    page.locator("#roofline-summary dd").all_inner_texts(), strict=True))
    assert "measured" not in rows and rows["predicted time"] == "12.3ms (forward 12.3ms)"
    assert rows["efficiency"] == "80%" and rows["launch overhead"] == "5µs a kernel" and "tf32" in rows
    assert rows["device"] == HOSTILE + ": 100TFLOP/s matrix, 1TB/s, ridge 100 FLOPs/byte"
    assert page.locator("#roofline-title").inner_text() == "Roofline on " + HOSTILE
    assert page.locator("#roofline-chart polyline").count() == 1  # the matrix roof only
    page.hover("#roofline-chart circle >> nth=0")
    assert page.locator("#tooltip").inner_text().startswith(HOSTILE + "  (bfloat16, compute-bound)")
    assert page.evaluate("window.pwned") is None and page.locator("script").count() == 2
    assert report.errors == [] and report.requests == [report.url]
    report.context.close()
