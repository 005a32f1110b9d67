"""The HTML report and the JSON result against hostile names and extreme numbers: names from the model that try to
end the page's script, inject markup, fake a line or reverse the numbers; large comparisons; exact round trips."""

from __future__ import annotations

import copy
import html.parser
import json
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import modelmeter
import test_html
from modelmeter.guard.diff import Difference
from modelmeter.reports.format import printable
from modelmeter.reports.html import html_data, module_deltas, render_html, write_html
from modelmeter.reports.render import format_change, render
from modelmeter.reports.result import ModuleRow, Result
from test_html import Opened, needs_browser

browser = test_html.browser  # the headless Chromium of the HTML report's tests, shared by this module's tests

HOSTILE = ["</script><script>window.pwned=1</script>", "<img src=x onerror=window.pwned=1>", "a\"b'c`d",
           "line\u2028sep\u2029para", "ctl\x00\x01\x1b[31m\x7f", "rtl\u202e1.5K", "x" * 3000, "{{DATA}}{{SCRIPT}}",
           "<!--", "]]><![CDATA[", "lone\ud800surrogate", "<svg/onload=window.pwned=1>", "&amp;&lt;", "tab\tcr\r\nlf",
           "\u00a0nbsp\u200bzwsp\ufeffbom"]


class _Tags(html.parser.HTMLParser):
    """The page's structure: each start tag with its attributes' names, each end tag, in order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, ...]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, *(name for name, _ in attrs)))

    def handle_endtag(self, tag: str) -> None:
        self.tags.append((f"/{tag}",))


def _structure(page: str) -> list[tuple[str, ...]]:
    parser = _Tags()
    parser.feed(page)
    parser.close()
    return parser.tags


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).sum()


@pytest.fixture(scope="module")
def step() -> Result:
    """A training step with the memory analysis and the time on a device: every part of the page is drawn."""
    return modelmeter.analyze(_Net(), torch.randn(2, 4), backward=True, memory=True, device="h100",
                              quiet=True).result()


def _renamed(result: Result, name: str) -> Result:
    """``result`` with ``name`` in every text the model or the run gives: the model, its modules and classes, the
    operators (of the rows, the unsupported, the memory timeline, the roofline), the dtypes, the shapes, the
    assumptions, the peak's module and operator and the device's label."""
    data = copy.deepcopy(result.to_dict())
    data["model"] = name
    data["inputs"] = [{"shape": [2, 4], "dtype": name}]
    data["unsupported"] = {name: 3}
    data["assumptions"] = [name]
    data["dtypes"] = {metric: {name: total} for metric, by_dtype in data["dtypes"].items()
                      for total in [sum(by_dtype.values())]}
    for i, row in enumerate(data["modules"]):
        row["name"] = f"{name}.{i}" if i else ""
        row["type"] = name
        row["by_operator"] = {metric: {f"{name}{op}": value for op, value in ops.items()}
                              for metric, ops in row["by_operator"].items()}
        row["output_shapes"] = dict.fromkeys([name], 1)
    memory = data["memory"]
    memory.update(module=name, operator=name)
    memory["timeline"]["modules"] = [name for _ in memory["timeline"]["modules"]]
    memory["timeline"]["operators"] = [f"{name}{op}" for op in memory["timeline"]["operators"]]
    roofline = data["roofline"]
    roofline["device"]["label"] = name
    for operator in roofline["operators"]:
        operator.update(operator=f"{name}{operator['operator']}", dtype=name)
    return Result.from_dict(data)


@pytest.mark.parametrize("name", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_names_leave_the_page_as_it_was(step: Result, name: str, tmp_path: Path) -> None:
    """A name changes no tag of the page (each tag and attribute as with a plain name), travels exactly in the
    page's data, and the title shows it printable; a lone surrogate (a name from undecodable bytes) can be
    written."""
    plain, hostile = _renamed(step, "plain"), _renamed(step, name)
    page = render_html(hostile, compare=plain)
    assert _structure(page) == _structure(render_html(plain, compare=plain))
    data = test_html._embedded(page)
    assert data == json.loads(json.dumps(html_data(hostile, plain)))
    assert data["model"] == name and data["modules"][1][0] == f"{name}.1" and data["assumptions"] == [name]
    title = page[page.index("<title>") + 7:page.index("</title>")]
    assert html.unescape(title) == printable(f"modelmeter: {name} vs plain")
    write_html(hostile, tmp_path / "report.html", compare=plain)
    assert (tmp_path / "report.html").read_text(encoding="utf-8") == page


@needs_browser
def test_hostile_names_show_as_the_text_reports_print_them(browser: Any, step: Result, tmp_path: Path) -> None:
    """In the page a name is text, each character that is not printable written as its escape (a bidi override
    cannot reverse the numbers after it, a newline cannot start a line of a tooltip), and nothing runs."""
    name = "rtl\u202e1.5K\nflops: 0 <img src=x onerror=window.pwned=1>\x1b\ud800\u2028"
    path = tmp_path / "hostile.html"
    write_html(_renamed(step, name), path)
    report = Opened(browser, path)
    page = report.page
    assert page.locator("#header h1").inner_text() == printable(name)
    assert page.locator("#assumptions li").inner_text() == printable(name)
    assert page.locator("#unsupported code").inner_text() == printable(name)
    first = page.locator("#modules tbody tr").nth(1).locator("td")
    assert first.nth(0).inner_text().startswith(printable(f"{name}.1")) and first.nth(1).inner_text() == printable(name)
    assert first.last.inner_text() == printable(name)  # its output shapes (read from a file, they can be anything)
    header = page.locator("#header dd").all_inner_texts()
    assert header[0] == f"2x4 {printable(name)}"  # an input's dtype
    assert f"of {printable(name)} at {printable(name)}" in header[-1]  # the memory's peak: its module and operator
    assert printable(name) in page.locator("#roofline-summary dd").first.inner_text()  # the device's label
    assert page.locator("#operators tbody td.text").first.inner_text().startswith(printable(name))
    assert printable(name) in str(page.locator("#memory-peak").text_content())
    assert page.locator("#roofline-title").inner_text().startswith(f"Roofline on {printable(name)}")
    assert page.evaluate("window.pwned") is None and page.locator("script").count() == 2
    assert page.locator("img").count() == 0
    # the page's escapes are Python's, character for character
    chars = ["\n", "\r", "\t", "\x00", "\x1b", "\x7f", "\x85", "\xa0", "\u00ad", "\u200b", "\u2028", "\u202e",
             "\ufeff", "\ud800", "\U000e0001", "\U0010fffd", " ", "\\", "é", "中", "\U0001f600", "\u0301"]
    assert page.evaluate("chars => chars.map(shown)", chars) == [printable(c) for c in chars]
    assert report.errors == [] and report.requests == [report.url]
    report.context.close()


def _naive_deltas(result: Result, compare: Result) -> dict[str, dict[str, float | None]]:
    """The deltas by the definition, one module at a time through ``Result.row``: the oracle of the fast one."""
    def values(of: Result, name: str) -> dict[str, float]:
        try:
            row = of.row(name)
        except KeyError:
            return {}
        return {"params": row.params, **row.metrics}

    names = [row.name for row in result.modules]
    names += [row.name for row in compare.modules if row.name not in names]
    return {name: {key: values(result, name).get(key, 0) - values(compare, name).get(key, 0)
                   if key == "params" or key in compare.metrics else None for key in ["params", *result.metrics]}
            for name in names}


def _random_result(rng: random.Random, metrics: list[str], count: int) -> Result:
    names = ["", *rng.sample([f"m{i}" for i in range(2 * count)], count)]
    return Result("M", [], metrics, [ModuleRow(name, "T", rng.randrange(2**60), {
        metric: rng.choice([0, rng.randrange(2**64), rng.random() * 1e20]) for metric in metrics}) for name in names])


def test_module_deltas_equal_the_definition() -> None:
    """Built once per side (a comparison of 20k modules is not quadratic), the deltas are those of the definition:
    module order, modules only one side has, a metric only one side measured; big integers exact."""
    rng = random.Random(5)
    for _ in range(20):
        after = _random_result(rng, ["flops", "activations"], rng.randrange(1, 30))
        before = _random_result(rng, rng.choice([["flops"], ["flops", "activations"], ["time"]]),
                                rng.randrange(1, 30))
        deltas = module_deltas(after, before)
        assert deltas == _naive_deltas(after, before) and list(deltas) == list(_naive_deltas(after, before))


# numbers: the page's digits are the result's, the JSON's values exact ------------------------------------------
BIG = 2**53 + 1  # the first integer a JavaScript number cannot hold: JSON.parse reads 2**53


def _big_result() -> Result:
    """Integers beyond 2**53 (a large training step's FLOPs), a fraction too small for three decimals, a half."""
    return Result("M", [], ["flops", "activation_bytes"], [
        ModuleRow("", "M", BIG + 2, {"flops": 14092058787119105, "activation_bytes": BIG}, {
            "flops": {"linear": 14092058787119105}, "activation_bytes": {}}),
        ModuleRow("a", "L", 3, {"flops": 1e-9, "activation_bytes": 0.5}, {})])


def _small_result() -> Result:
    return Result("S", [], ["flops", "activation_bytes"], [
        ModuleRow("", "S", 0, {"flops": 1, "activation_bytes": 0}, {"flops": {"linear": 1}}),
        ModuleRow("a", "L", 3, {"flops": 2e-9, "activation_bytes": 0.25}, {})])


def test_integers_beyond_two_to_the_53_travel_with_their_digits() -> None:
    """The page's data names each integer JSON.parse would round by the double it becomes (None where two distinct
    integers become one: the page then marks its value as rounded); a page without one has no ``exact``."""
    data = html_data(_big_result(), _small_result())
    # the params and their delta (BIG + 2 - 0) are one integer; the FLOPs 14092058787119105 and their delta
    # 14092058787119104 (the other side did 1) are two that become one double
    assert float(14092058787119105) == 14092058787119104
    assert data["exact"] == {"9007199254740996": "9007199254740995", "9007199254740992": "9007199254740993",
                             "14092058787119104": None}  # 2**53 + 3 becomes 2**53 + 4 (ties to even), 2**53 + 1 2**53
    assert "exact" not in html_data(_small_result())
    result = _small_result()
    result.root.params = 2**53  # a double holds it, but it also stands for 2**53 + 1
    assert html_data(result)["exact"] == {"9007199254740992": "9007199254740992"}
    result.modules[1].params = 2**53 + 1
    assert html_data(result)["exact"] == {"9007199254740992": None}
    result.modules[1].params = -(2**53) - 1  # a negative one, as a delta is
    assert html_data(result)["exact"] == {"9007199254740992": "9007199254740992",
                                          "-9007199254740992": str(-(2**53) - 1)}


@needs_browser
def test_the_page_shows_every_digit_of_the_result(browser: Any, tmp_path: Path) -> None:
    """The exact values on hover are the result's (parsed back): integers beyond 2**53 included; a fraction as its
    shortest exact form; a value too small for three decimals is not shown as 0."""
    path = tmp_path / "big.html"
    write_html(_big_result(), path, compare=_small_result())
    report = Opened(browser, path)
    rows = report.page.locator("#modules tbody tr").evaluate_all(
        "rows => rows.map(row => Array.from(row.cells).map(cell => [cell.textContent, cell.title]))")
    model, a = rows[0][2:], rows[1][2:]  # params, delta, flops, delta, activation_bytes, delta
    assert model[0][1] == f"{BIG + 2:,}" and model[1][1] == f"+{BIG + 2:,}"
    assert model[2][1] == "≈14,092,058,787,119,104"  # two integers of the page became this double: said so
    assert model[4][1] == f"{BIG:,} bytes"
    assert a[2] == ["<0.001", "1e-9"] and a[3] == [">-0.001", "-1e-9"] and a[4][1] == "0.5 bytes"
    assert report.errors == [] and report.requests == [report.url]
    report.context.close()


@pytest.mark.parametrize("value", [0, 1, BIG, 2**64 + 1, 10**30, 0.1 + 0.2, 5e-324, 1e30, 123456.789, 2.5])
def test_json_round_trips_exactly(value: float) -> None:
    """``to_json`` and back: integers stay integers with every digit, floats keep every bit."""
    result = _big_result()
    result.root.metrics["flops"] = value
    result.root.by_operator["flops"]["linear"] = value
    back = Result.from_json(result.to_json())
    assert back == result and type(back.root.metrics["flops"]) is type(value)
    assert back.root.metrics["flops"] == value and type(back.root.params) is int and back.root.params == BIG + 2
    assert Result.from_json(result.to_json(indent=None)) == result


def test_every_key_of_the_json_is_documented() -> None:
    """docs/reports.md's schema tables name every field a result and a module row write, and no other."""
    docs = (Path(__file__).parent.parent / "docs" / "reports.md").read_text(encoding="utf-8")
    schema = docs[docs.index("## The `Result` and its JSON schema"):docs.index("## Saved traces")]
    tables = schema.split("Each module object:")
    documented = [re.findall(r"^\| `(\w+)` \|", table, re.M) for table in tables]
    result = _big_result()
    assert sorted(documented[0]) == sorted(result.to_dict())
    assert sorted(documented[1]) == sorted(result.to_dict()["modules"][0])


# the text reports' changes: every digit, the metric's own unit --------------------------------------------------
@pytest.mark.parametrize(("metric", "delta", "text"), [
    ("flops", BIG, "+9,007,199,254,740,993"), ("params", -BIG, "-9,007,199,254,740,993"),  # not rounded to a double
    ("flops", 0.5, "+0.5"), ("flops", -1e-9, "-1e-09"),  # a fraction of a count is not +0
    ("flops", -3.0, "-3"), ("flops", 0, "+0"), ("flops", 1e30, "+1,000,000,000,000,000,019,884,624,838,656"),
    ("peak_memory", 3 * 2**20, "+3MiB"), ("activation_bytes", -1024, "-1KiB"), ("saved_bytes", 2**61, "+2097152TiB"),
    ("bytes", 3 * 2**20, "+3MiB"), ("time", -2e-3, "-2ms"),
    ("intensity", 0.25, "+0.25"), ("compute_bound", -0.3, "-0.3")])  # a ratio's change is not rounded to 0
def test_a_change_prints_every_digit_in_its_metrics_unit(metric: str, delta: float, text: str) -> None:
    assert format_change(metric, delta) == text


def test_the_diff_table_prints_held_bytes_in_binary_units() -> None:
    """``modelmeter diff``'s rows: the memory analysis's bytes as every report prints them, not as counts."""
    row = Difference("a", "peak_memory", 2**30, 3 * 2**29).row()
    assert row == ["a", "peak_memory", "1GiB", "1.5GiB", "+512MiB", "+50.0%"]
    assert Difference("", "params", 0, BIG).row()[2:5] == ["0", "9.007P", "+9,007,199,254,740,993"]


# markdown: names stay text in a renderer that passes HTML through ----------------------------------------------
@pytest.mark.parametrize("name", ["<img src=x onerror=window.pwned=1>", "\\<img src=x onerror=window.pwned=1>",
                                  "a`b<script>x</script>`", "``<b>bold</b>", "a|b\\|c", "&lt;i&gt;", "x\\"])
def test_markdown_names_stay_text(name: str) -> None:
    """Rendered by a CommonMark renderer with GFM tables and raw HTML allowed (markdown-it, ``html=True``), the
    markdown report has only the table's tags and code spans, and shows each name as the text reports print it."""
    markdown_it = pytest.importorskip("markdown_it")
    result = Result(name, [], ["flops"], [ModuleRow("", name, 0, {"flops": 5}, {}), ModuleRow(name, name, 0,
                    {"flops": 5}, {})], unsupported={name: 2}, assumptions=[name])
    page = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(render(result, "markdown"))
    tags = {tag[0] for tag in _structure(page)}
    assert tags <= {"table", "/table", "thead", "/thead", "tbody", "/tbody", "tr", "/tr", "th", "/th", "td", "/td",
                    "ul", "/ul", "li", "/li", "code", "/code", "p", "/p"}
    parser = _Text()
    parser.feed(page)
    assert [cell.strip() for cell in parser.cells[-5:-3]] == [name, name]  # the module's row: its name, class
    assert parser.code == [name] and parser.items[-1] == f"Assumption: {name}"


class _Text(html.parser.HTMLParser):
    """The text of each table cell, code span and list item of a rendered page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.cells: list[str] = []
        self.code: list[str] = []
        self.items: list[str] = []
        self._into: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        into = {"td": self.cells, "code": self.code, "li": self.items}.get(tag)
        if into is not None:
            into.append("")
            self._into = into

    def handle_data(self, data: str) -> None:
        if self._into is not None:
            self._into[-1] += data
        if self._into is self.code and self.items:  # a code span's text is its list item's too
            self.items[-1] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "code":
            self._into = self.items
        elif tag in ("td", "li"):
            self._into = None


# a result read from a file: what every report prints is checked as it is read --------------------------------
@pytest.mark.parametrize(("field", "value", "message"), [
    ("inputs", [1, "a"], "inputs are not objects"), ("assumptions", [1], "assumptions are not text"),
    ("unsupported", {"op": -5}, "calls are not counts"), ("unsupported", {"op": "x"}, "calls are not counts"),
    ("unsupported", {"op": True}, "calls are not counts"), ("dtypes", {"flops": "x"}, "not an object"),
    ("dtypes", {"flops": {"float32": -1}}, "not a number from 0"), ("memory", {"x": 1}, "lacks its peak"),
    ("memory", {"peak": "big"}, "peak is a str"), ("memory", {"peak": 5, "by_kind": {"input": float("nan")}},
                                                    "not a number from 0"),
    ("memory", {"peak": 5, "module": None}, "module is a NoneType")])
def test_a_result_whose_notes_cannot_be_printed_is_refused(step: Result, field: str, value: Any,
                                                          message: str) -> None:
    """``modelmeter report`` of a hand-edited saved trace said so in one line, not in a KeyError's traceback."""
    data = step.to_dict()
    data[field] = value
    with pytest.raises(ValueError, match=message):
        Result.from_dict(data)
    assert Result.from_dict(step.to_dict()) == step


def _returns_within(seconds: float, work: Any) -> Any:
    """``work()``'s result or error, or a test failure when it has not returned after ``seconds`` (a read that
    opened a named pipe waits for a writer forever: the thread is left blocked, a daemon)."""
    import threading

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # the error is the outcome the caller checks
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked: the file was opened"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def test_a_pipe_or_a_device_is_never_opened_as_a_saved_trace_or_result(tmp_path: Path) -> None:
    """A named pipe given as a saved trace (``modelmeter report``, ``read_saved_trace``) or as ``--compare``'s result
    blocked the reader forever (the guards refused one since the fourth round): refused now from its status."""
    from modelmeter.cli import main
    from modelmeter.reports.saved import SavedTraceError, is_saved_trace, read_saved_trace

    fifo = tmp_path / "pipe.mmtrace"
    os.mkfifo(fifo)
    with pytest.raises(SavedTraceError, match="not a regular file"):
        _returns_within(20, lambda: read_saved_trace(fifo))
    assert _returns_within(20, lambda: is_saved_trace(fifo)) is False
    assert _returns_within(20, lambda: main(["report", str(fifo)])) == 2
    saved = tmp_path / "run.mmtrace"
    modelmeter.save_trace(modelmeter.analyze(nn.Linear(3, 2), torch.randn(1, 3), cache=False, quiet=True), saved)
    page = tmp_path / "page.html"
    assert _returns_within(20, lambda: main(["report", str(saved), "--html", str(page), "--compare", str(fifo)])) == 2
    assert not page.exists()
    with pytest.raises(SavedTraceError, match="not a regular file"):
        read_saved_trace("/dev/zero")
