"""Numbers at scale: counts past 2**53 and 2**64, bytes past 2**53, sums that must be exact, and the values no
result can hold.

Oracles: hand arithmetic on the shapes (a linear layer of fvcore's convention does ``batch * in * out``
multiply-adds), the exact integer sums of the parts, and what the result's own reader (``Result.from_json``) takes.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import test_html
from modelmeter import (
    Analysis,
    FlopCountAnalysis,
    analyze,
    build_result,
    flop_count_str,
    flop_count_table,
    render,
    save_trace,
)
from modelmeter.errors import InvalidValueError
from modelmeter.guard.budget import check_budget
from modelmeter.guard.diff import Difference
from modelmeter.reports import Result, write_html
from modelmeter.reports.columns import format_bound, format_metric, format_whole_percent
from modelmeter.reports.html_memory import memory_timeline_chart
from modelmeter.reports.ranks import plan_notes
from modelmeter.reports.render import roofline_note
from modelmeter.reports.result import ModuleRow
from test_html import Opened, needs_browser
from test_html_memory import _hover_at

browser = test_html.browser  # the headless Chromium of the HTML report's tests

WIDTH = 2**16  # a square linear layer's width: 2**32 parameters, 2**32 multiply-adds per row
ROWS = 2**36  # the input's rows: 2**52 elements, 2**54 bytes in float32


def _stack(layers: int = 3) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


@pytest.fixture(scope="module")
def stack() -> Analysis:
    return analyze(_stack(), torch.empty(ROWS, WIDTH, device="meta"), memory=True, quiet=True, device="h100")


# --- exact counts past 2**64, bytes past 2**53 ----------------------------------------------------------------
def test_a_stack_past_two_to_the_64_counts_exactly(stack: Analysis) -> None:
    per_layer = ROWS * WIDTH * WIDTH  # 2**68 multiply-adds
    assert stack.flops.by_module() == {"": 3 * per_layer, "0": per_layer, "1": per_layer, "2": per_layer}
    assert all(type(v) is int for v in stack.flops.by_module().values())
    # the peak: the parameters, the input and the two outputs live while layer 1 runs (each 2**54 bytes)
    assert stack.memory.peak() == 3 * WIDTH * WIDTH * 4 + 3 * ROWS * WIDTH * 4 > 2**55
    result = stack.result()
    row = next(csv.DictReader(io.StringIO(render(result, "csv"))))
    assert int(row["flops"]) == 3 * per_layer and int(row["peak_memory"]) == stack.memory.peak()
    data = json.loads(result.to_json())
    assert data["modules"][0]["metrics"]["flops"] == 3 * per_layer
    assert Result.from_json(result.to_json()).total("peak_memory") == stack.memory.peak()


def test_a_large_intensity_prints_as_the_page_prints_it(stack: Analysis) -> None:
    # 16383.99 FLOPs per byte printed as "1.64e+04" in the table and the tree, "16400" on the page
    result = stack.result()
    assert 16383 < result.total("intensity") < 16384
    assert "flops/byte: 16400," in render(result, "tree")
    assert [format_metric("intensity", v) for v in (9.5432, 2352.3, 0.111, 1e-5)] == ["9.54", "2350", "0.111", "1e-05"]


# --- a cost no result can hold is refused where it is made ---------------------------------------------------
class _PaddedConv(nn.Module):
    """A convolution whose padding makes 2**41 output positions of a 2**61-element kernel: 2**102 multiply-adds,
    past the 1e30 a result holds (and its reader takes)."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, w, padding=2**40)


def test_a_count_past_what_a_result_holds_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    # it was made, rendered and saved, and only `load_trace` / `modelmeter report` refused the file
    channels, kernel = 2**30, 2**31
    x = torch.empty(1, channels, 1, device="meta", dtype=torch.bfloat16)
    w = torch.empty(1, channels, kernel, device="meta", dtype=torch.bfloat16)
    a = analyze(_PaddedConv(), (x, w), quiet=True)
    positions = 1 + 2 * 2**40 - (kernel - 1)
    assert a.flops.total() == positions * channels * kernel > 10**30  # the analysis itself stays exact
    refused = r"cannot be reported or saved: .*flops.* not a number from 0 to 1e\+30"
    with pytest.raises(InvalidValueError, match=refused):
        a.result()
    path = tmp_path / "conv.mmtrace"
    with pytest.raises(InvalidValueError, match="cannot be reported or saved"):
        save_trace(a, path)
    assert not path.exists()


class _Relu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


@pytest.mark.parametrize(("count", "shown"), [(10**40, "an integer of about 41 digits"),
                                              (10**400, "an integer of about 401 digits"), (1e300, r"1e\+300")],
                         ids=["10**40", "10**400", "1e300"])
def test_a_handles_absurd_count_is_a_clear_error_in_full(count: float, shown: str) -> None:
    # 10**400 was an OverflowError from deep inside; 10**40 was named by its first 40 digits (read as 10**39)
    model = _Relu()
    flops = FlopCountAnalysis(model, torch.zeros(1, 4)).set_op_handle("aten::relu", lambda i, o: count)
    with pytest.raises(InvalidValueError, match=f"cannot be reported or saved: .* is {shown}, not"):
        build_result(model, {"flops": flops})


def test_a_measured_time_no_result_holds_is_refused() -> None:
    # accepted, and the result's own JSON was refused by Result.from_json
    with pytest.raises(InvalidValueError, match=r"measured_time is 1e-40, not 0 or a number from 1e-30"):
        analyze(_Relu(), torch.zeros(1, 4), device="h100", measured_time=1e-40, quiet=True).result()


class _View(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1)


class _Idle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("model", [_View, _Idle, _Relu])
@pytest.mark.parametrize("backward", [False, True])
def test_every_result_made_reads_back(model: type[nn.Module], backward: bool) -> None:
    """Zero FLOPs, zero bytes, zero parameters: what a result holds is what its reader takes."""
    x = torch.zeros(1, 4, requires_grad=backward)
    for options in ({}, {"device": "h100"}, {"device": "h100", "measured_time": 1e-12}):
        result = analyze(model(), x, memory=True, backward=backward, quiet=True, **options).result()
        back = Result.from_json(result.to_json())
        assert back.to_json() == result.to_json()
        for fmt in ("table", "markdown", "csv", "tree"):
            text = render(result, fmt).lower()
            assert "nan" not in text.replace("inference", "") and "inf " not in text


# --- a share is 0.0% or 100.0% only when it is exactly that ---------------------------------------------------
TOTAL = 2**64 + 1  # a part of 1 is 5e-18 of it; a part of TOTAL - 1 rounds to 1 in floats


def _shares_result() -> Result:
    values = {"": TOTAL, "big": TOTAL - 1, "tiny": 1, "none": 0}
    rows = [ModuleRow(name, "M", 0, {"flops": value}, {"flops": {"linear": value} if value else {}})
            for name, value in values.items()]
    return Result("M", [], ["flops"], rows)


def test_a_share_that_is_not_zero_or_whole_never_prints_as_one() -> None:
    # "tiny" showed 0.0% beside its value 0.000P, "big" 100.0% though it is not the whole model
    lines = render(_shares_result(), "table").splitlines()
    shares = {line.split()[0]: line.split()[-1] for line in lines[2:]}
    assert shares == {"model": "100.0%", "big": ">99.9%", "tiny": "<0.1%", "none": "0.0%"}
    markdown = render(_shares_result(), "markdown")
    assert "|  \\>99.9% |" in markdown and "|   \\<0.1% |" in markdown and "|     0.0% |" in markdown


def test_a_bound_is_whole_only_when_it_is() -> None:
    # 99.6% of the time compute-bound printed as "compute 100%"
    assert [format_bound(s) for s in (1.0, 0.996, 0.0, 0.004, 0.9)] == [
        "compute 100%", "compute >99%", "memory 100%", "memory >99%", "compute 90%"]


def test_the_roofline_line_says_the_compute_bound_share_as_the_bound_column_does() -> None:
    # the roofline line printed "100% of it compute-bound" for 0.9996 and "0%" for 0.0004
    summary = {"device": {"label": "D"}, "time": {"total": 1.0}, "dtype": "float32", "throughput": None,
               "predicted_mfu": None, "measured_time": None}
    shares = {0.9996: ">99%", 0.0004: "<1%", 1.0: "100%", 0.0: "0%", 0.25: "25%"}
    for share, shown in shares.items():
        assert f"; {shown} of it compute-bound" in roofline_note({**summary, "compute_bound_share": share})
    assert [format_whole_percent(share) for share in shares] == list(shares.values())


def test_a_pipeline_bubble_too_small_or_large_for_its_decimal_is_not_zero_or_whole() -> None:
    plan = {"plan": "pp=2", "world_size": 2, "mesh": {"pp": 2}, "ranks": [],
            "pipeline": {"stages": 2, "micro_batches": 4096, "schedule": "1F1B"}}
    for fraction, shown in ((0.0004, "<0.1%"), (0.99996, ">99.9%"), (0.2727, "27.3%")):
        plan["pipeline"]["bubble_fraction"] = fraction
        assert plan_notes(plan)[-1].endswith(f"the bubble is {shown} of the step")


def test_a_predicted_mfu_too_small_for_its_decimal_is_not_zero() -> None:
    result = analyze(_Relu(), torch.zeros(1, 4), device="h100", measured_time=1.0, quiet=True).result()
    assert 0 < result.roofline["mfu"] < 0.0005 and "MFU <0.1%, HFU <0.1%" in render(result, "table")


def test_a_diff_of_a_tiny_change_is_not_shown_as_none() -> None:
    # modelmeter diff printed +0.0% for a change of one FLOP
    assert Difference("", "flops", TOTAL, TOTAL + 1).row()[-1] == "+5.4e-18%"
    # and the model's row was "model", as is a Hugging Face causal LM's body (two rows "model", two values)
    assert [Difference(name, "flops", 1, 2).row()[0] for name in ("", "model")] == ["(model)", "model"]
    assert Difference("", "flops", TOTAL, TOTAL - 2**60).row()[-1] == "-6.2%"


@needs_browser
def test_the_page_shows_no_share_of_zero_or_whole_that_is_not(browser: Any, tmp_path: Path) -> None:
    path = tmp_path / "shares.html"
    write_html(_shares_result(), path)
    report = Opened(browser, path)
    whole = 2**50  # (a JavaScript number: TOTAL - 1 and TOTAL are one double on the page)
    cases = [[1, whole], [-1, whole], [whole - 1, whole], [0, whole], [1, 0], [whole, whole], [1, 4]]
    assert report.page.evaluate("cases => cases.map(([x, t]) => pct(x, t))", cases) == [
        "<0.01%", ">-0.01%", ">99.99%", "0.00%", "0.00%", "100.00%", "25.00%"]
    # the roofline's shares (compute-bound, MFU): three significant figures
    assert report.page.evaluate("xs => xs.map(percent)", [0.9996, 1, 0.5, 1e-9, 1.2, None]) == [
        ">99.9%", "100%", "50%", "1e-7%", "120%", "–"]
    assert report.errors == []
    report.context.close()


# --- fvcore's printers and the tree: a count too small for the last decimal is not 0 --------------------------
def test_a_count_too_small_for_its_decimals_is_not_printed_as_zero() -> None:
    # a handle's 0.0004 FLOPs printed as 0, which is how an exact zero prints
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    flops = FlopCountAnalysis(model, torch.zeros(1, 4)).set_op_handle("aten::relu", lambda i, o: 0.0004)
    assert flops.by_module()["0"] == 16
    assert "|  <0.001  |" in flop_count_table(flops)  # (the ReLU's own row: it has no parameters)
    assert "#flops: <0.01)" in flop_count_str(flops)  # two decimals, as fvcore's flop_count_str
    assert "#flops: <0.001)" in render(build_result(model, {"flops": flops}), "tree")
    exact = FlopCountAnalysis(model, torch.zeros(1, 4)).set_op_handle("aten::relu", lambda i, o: 0.0)
    assert "(1): ReLU()" in flop_count_str(exact)  # an exact zero: no line at all


def test_a_peak_before_any_operator_says_so() -> None:
    # "during the forward of the model at  (parameter 12B, input 16B)": a model that runs no operator
    result = analyze(_Idle(), torch.zeros(1, 4), memory=True, quiet=True).result()
    assert result.memory["operator"] == "" and result.memory["peak"] == 3 * 4 + 4 * 4
    assert ("Peak memory (inference): 28B during the forward of the model, before its first operator "
            "(parameter 12B, input 16B)") in render(result, "table")


# --- the memory timeline's live bytes past 2**53 ---------------------------------------------------------------
PARAMS = 2**55 + 4  # a double holds 2**55 (ties to even): the page reads this as 2**55


def _huge_step() -> Result:
    """Three operators' live bytes past 2**53, 3 * 2**54 + 4, 2**56 + 4 (the peak) and 2**55 + 4; a module's peak
    of 3 * 2**54 + 2 is the integer the page knew for the double the first total's page sum gave."""
    timeline = {"length": 3, "bucket": 1, "position": [0, 1, 2], "kinds": ["parameter", "activation"],
                "bytes": {"parameter": [PARAMS] * 3, "activation": [2**54, 2**55, 0]},
                "module": [0, 0, 0], "modules": ["a"], "operator": [0, 0, 0], "operators": ["mm"],
                "phases": [["forward", 0]], "peak": 1}
    memory = {"peak": PARAMS + 2**55, "phase": "forward", "module": "a", "operator": "mm",
              "by_kind": {"parameter": PARAMS, "activation": 2**55}, "training": False, "optimizer": None,
              "timeline": timeline}
    rows = [ModuleRow("", "M", 0, {"peak_memory": PARAMS + 2**55}, {}),
            ModuleRow("a", "L", 0, {"peak_memory": 3 * 2**54 + 2}, {})]
    return Result("M", [], ["peak_memory"], rows, memory=memory)


@needs_browser
def test_the_timeline_never_shows_a_rounded_sum_as_exact(browser: Any, tmp_path: Path) -> None:
    # the page summed each point's kinds in doubles: 3 * 2**54 + 4 became the double of the module's peak, whose
    # digits it then showed as exact ("54,043,195,528,445,954 bytes")
    result = _huge_step()
    chart = memory_timeline_chart(result.memory)
    assert chart["live"] == [3 * 2**54 + 4, 2**56 + 4, 2**55 + 4]
    path = tmp_path / "huge.html"
    write_html(result, path)
    report = Opened(browser, path)
    edges = chart["edges"]
    for point, live in enumerate(chart["live"]):
        text = _hover_at(report, "#memory-chart", (edges[point] + edges[point + 1]) / 2, 200, chart["width"])
        line = text.splitlines()[2]
        assert line.startswith((f"live: {live:,} bytes", "live: ≈")), (point, line)
    assert report.errors == []
    report.context.close()


# --- a budget given as a float is the number it spells -------------------------------------------------------
def test_a_count_exactly_at_a_float_budget_is_within_it() -> None:
    # {"flops": 1e23} is 99,999,999,999,999,991,611,392 as a float: 10**23 FLOPs were "over the budget by 0 (+0.0%)"
    result = Result("M", [], ["flops", "time"], [ModuleRow("", "M", 0, {"flops": 10**23, "time": 0.005}, {})])
    assert check_budget(result, {"flops": 1e23, "time": 0.005}) == []
    over = check_budget(result, {"flops": 9.99e22, "time": 0.004})
    assert [(o.metric, o.limit) for o in over] == [("flops", 999 * 10**20), ("time", 0.004)]
    assert str(over[0]).endswith("by 100000P (+0.1%)") and "(99,900,000,000,000,000,000,000)" in str(over[0])
    assert check_budget(result, {"flops": 1e23 - 2**24}) != []  # the float below 1e23 spells a smaller number
