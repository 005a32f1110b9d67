"""The time on a device as the user reaches it: ``analyze(device=...)``, ``--device`` and its options, the columns a
Result gains, saved traces and ``report --device``, budgets in seconds, baselines and sweeps.

What the roofline computes is proven in test_roofline.py; here, that every way in gives the same numbers, that the
options are checked, and that nothing changes without a device.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter import Result, analyze, load_trace, save_trace
from modelmeter.cli import main
from modelmeter.cli.sweep import _turn
from modelmeter.devices import Device, get_device
from modelmeter.guard import check_budget, entry_from_result, parse_budget
from modelmeter.reports.format import format_time, parse_duration
from modelmeter.reports.render import format_bound, render
from modelmeter.session import result_from_trace

ROOFLINE_COLUMNS = ["bytes", "time", "intensity", "compute_bound"]


def small() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)), torch.randn(4, 16)


def run(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0) -> tuple[str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert status == code, f"exit {status}, stderr: {err}"
    return out, err


# --- units ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (2.0, "2s"), (0.5, "500ms"), (1.234e-3, "1.23ms"), (4.5e-8, "45ns"), (7.77e-6, "7.77µs"),
    (999.9e-6, "1ms"), (1234.4, "1234s"), (1e-12, "0.001ns"),
])
def test_format_time(seconds: float, text: str) -> None:
    assert format_time(seconds) == text


@pytest.mark.parametrize(("text", "seconds"), [
    ("5ms", 5e-3), ("120us", 120e-6), ("120µs", 120e-6), ("0.25s", 0.25), ("2", 2.0), ("3ns", 3e-9),
    (" 1e-3 s ", 1e-3), ("1.5MS", 1.5e-3),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize("text", ["-1ms", "inf", "nan", "5 min", "", "ms", "1e999"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="duration|range"):
        parse_duration(text)


def test_format_bound() -> None:
    assert format_bound(0.9) == "compute 90%"
    assert format_bound(0.5) == "compute 50%"
    assert format_bound(0.25) == "memory 75%"
    assert format_bound(0.0) == "memory 100%"


# --- the library --------------------------------------------------------------------------------------------
def test_without_a_device_nothing_changes() -> None:
    model, x = small()
    result = analyze(model, x).result()
    assert result.metrics == ["flops", "activations"]
    assert result.roofline == {}
    assert analyze(model, x).roofline is None


def test_a_device_adds_the_columns_and_the_summary() -> None:
    model, x = small()
    analysis = analyze(model, x, device="h100")
    result = analysis.result()
    assert result.metrics == ["flops", "activations", *ROOFLINE_COLUMNS]
    predicted = analysis.roofline
    assert predicted is not None
    root = result.root
    assert root.metrics["bytes"] == sum(predicted.bytes.counts[""].values())
    assert root.metrics["time"] == pytest.approx(sum(predicted.time.counts[""].values()))
    assert root.metrics["intensity"] == pytest.approx(
        sum(predicted.flops.counts[""].values()) / sum(predicted.bytes.counts[""].values()))
    assert 0 <= root.metrics["compute_bound"] <= 1
    assert result.roofline["device"]["name"] == "h100"
    for row in result.modules[1:]:  # each module's ratio is its own, not a sum of its children's
        assert row.metrics["bytes"] == sum(row.by_operator["bytes"].values())
    assert Result.from_json(result.to_json()) == result


def test_after_a_backward_pass_bytes_and_time_have_phase_columns() -> None:
    model, x = small()
    result = analyze(model, x, device="h100", backward=True).result()
    for metric in ("bytes", "time"):
        assert f"forward_{metric}" in result.metrics and f"backward_{metric}" in result.metrics
        assert result.total(metric) == pytest.approx(result.total(f"forward_{metric}")
                                                     + result.total(f"backward_{metric}"))


def test_the_result_from_the_trace_alone_equals_the_analysis() -> None:
    model, x = small()
    analysis = analyze(model, x, device="h100", backward=True, efficiency=0.5, launch_overhead=2e-6, tf32=True,
                       measured_time=1e-3, memory=True, optimizer="adamw")
    result = analysis.result()
    assert result_from_trace(analysis.trace, name="Sequential", **analysis.settings) == result
    # a training step with an optimizer: its step is a phase of the time, of the model as a whole
    assert {"optimizer_time", "optimizer_bytes"} <= set(result.metrics)
    assert result.total("time") == pytest.approx(sum(result.total(f"{phase}_time")
                                                     for phase in ("forward", "backward", "optimizer")))
    assert all(not row.metrics.get("optimizer_time") for row in result.modules[1:])
    assert any(line.startswith("Predicted time on ") and "optimizer " in line
               for line in render(result, "table").splitlines())


def test_efficiency_and_launch_overhead_only_add_time() -> None:
    model, x = small()
    pure = analyze(model, x, device="h100").result()
    slower = analyze(model, x, device="h100", efficiency=0.5).result()
    assert slower.total("bytes") == pure.total("bytes")
    assert slower.total("time") == pytest.approx(2 * pure.total("time"))
    launched = analyze(model, x, device="h100", launch_overhead=1e-6).result()
    assert launched.total("time") > pure.total("time") + 2e-6  # at least the three kernels' launches


@pytest.mark.parametrize(("options", "message"), [
    ({"device": "h900"}, "unknown device 'h900'"),
    ({"device": 3}, "device must be a device name"),
    ({"device": "h100", "efficiency": 0}, "efficiency must be a number in"),
    ({"device": "h100", "efficiency": 1.5}, "efficiency must be a number in"),
    ({"device": "h100", "efficiency": math.nan}, "efficiency must be a number in"),
    ({"device": "h100", "launch_overhead": -1e-6}, "launch_overhead must be a finite number of seconds"),
    ({"device": "h100", "measured_time": 0}, "measured_time must be a finite number of seconds"),
    ({"device": "h100", "measured_time": math.inf}, "measured_time must be a finite number of seconds"),
    ({"device": "h100", "tf32": "yes"}, "tf32 must be True or False"),
    ({"efficiency": 0.5}, "pass device="),
    ({"measured_time": 0.1}, "pass device="),
])
def test_bad_options_are_named(options: dict[str, Any], message: str) -> None:
    model, x = small()
    with pytest.raises((ValueError, TypeError), match=message):
        analyze(model, x, **options)


def test_a_saved_trace_keeps_the_device_a_users_too(tmp_path: Path) -> None:
    model, x = small()
    mine = dataclasses.replace(get_device("h100"), name="my-gpu", label="My GPU", bandwidth=1e12)
    analysis = analyze(model, x, device=mine)
    path = tmp_path / "run.mmtrace"
    save_trace(analysis, path, name="Sequential")
    assert load_trace(path) == analysis.result()
    recounted = load_trace(path, device="h100")
    assert recounted.roofline["device"]["name"] == "h100"
    assert recounted.total("time") < analysis.result().total("time")  # 3.35 TB/s against 1 TB/s


# --- budgets, baselines ---------------------------------------------------------------------------------------
def test_budgets_read_time_in_seconds_and_refuse_ratios() -> None:
    assert parse_budget("time=5ms,bytes=2MiB") == {"time": 0.005, "bytes": 2 * 2**20}
    with pytest.raises(ValueError, match="ratio"):
        parse_budget("intensity=10")
    with pytest.raises(ValueError, match="the budget of time"):
        parse_budget("time=5 minutes")
    model, x = small()
    result = analyze(model, x, device="h100").result()
    over = check_budget(result, {"time": result.total("time") / 2})
    assert [o.metric for o in over] == ["time"]
    assert " s) is over the budget of " in str(over[0])
    assert check_budget(result, {"time": result.total("time") * 2}) == []
    with pytest.raises(ValueError, match="--device"):
        check_budget(analyze(model, x).result(), {"time": 1.0})


def test_a_baseline_keeps_costs_not_ratios() -> None:
    model, x = small()
    entry = entry_from_result(analyze(model, x, device="h100").result())
    assert set(entry.modules[""]) == {"params", "flops", "activations", "bytes", "time"}


# --- the command ----------------------------------------------------------------------------------------------
def test_the_command_adds_the_columns(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run(capsys, "resnet18", "--device", "h100", "--no-cache", "--depth", "1", "--wide")  # full headers
    header = out.splitlines()[1]
    for column in ("#bytes", "#time", "flops/byte", "bound"):
        assert column in header
    assert "Predicted time on " in out
    data = json.loads(run(capsys, "resnet18", "--device", "H100", "--no-cache", "--format", "json")[0])
    assert data["metrics"][-4:] == ROOFLINE_COLUMNS
    assert all("time" in row["metrics"] and "bytes" in row["metrics"] for row in data["modules"])
    assert data["roofline"]["device"]["name"] == "h100"


def test_the_command_passes_its_time_options_on(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(run(capsys, "resnet18", "--device", "h100", "--efficiency", "70%", "--launch-overhead",
                          "3us", "--measured-time", "2ms", "--no-cache", "--format", "json")[0])
    assert data["roofline"]["settings"] == {"efficiency": 0.7, "launch_overhead": 3e-6, "tf32": False}
    assert data["roofline"]["measured_time"] == 0.002
    assert data["modules"][0]["metrics"]["time"] > 20 * 3e-6  # ResNet-18 runs more than 20 kernels


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "h900"], "unknown device 'h900'"),
    (["--tf32"], "--tf32 describes the time on a device: add --device"),
    (["--efficiency", "0.5", "--measured-time", "3ms"], "--measured-time and --efficiency describe"),
    (["--budget", "time=1ms"], "--budget time=... describes the time on a device"),
    (["--device", "h100", "--efficiency", "0"], "a fraction of the peak is in (0, 1]"),
    (["--device", "h100", "--measured-time", "soon"], "not a duration"),
])
def test_command_mistakes_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    _, err = run(capsys, "resnet18", *argv, code=2)
    assert message in err
    assert "Traceback" not in err


def test_report_recounts_a_saved_trace_on_a_device(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = str(tmp_path / "r18.mmtrace")
    run(capsys, "resnet18", "--no-cache", "--save-trace", path)
    report = json.loads(run(capsys, "report", path, "--device", "h100", "--format", "json")[0])
    analysed = json.loads(run(capsys, "resnet18", "--no-cache", "--device", "h100", "--format", "json")[0])
    assert report == analysed
    _, err = run(capsys, "report", path, "--tf32", code=2)
    assert "saved without a device" in err


def test_a_sweep_says_where_the_model_turns_compute_bound() -> None:
    assert _turn("batch", [1, 8, 64], [0.1, 0.6, 0.9]) == "turns compute-bound between batch 1 and 8"
    assert _turn("batch", [1, 8], [0.9, 0.8]) == "compute-bound at every batch swept"
    assert _turn("batch", [1, 8], [0.1, 0.2]) == "memory-bound at every batch swept"
    assert _turn("batch", [1, 8, 64], [0.6, 0.1, 0.7]) == "compute-bound at batch 1, 64"


def test_a_sweep_has_the_time_columns(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run(capsys, "resnet18", "--device", "h100", "--sweep", "batch=1,2", "--jobs", "1", "--no-cache")
    assert "images/s" in out and "bound" in out and "flops/byte" in out
    assert "bound at every batch swept" in out or "turns compute-bound" in out


def test_text_reports_keep_the_phase_columns_of_time_for_json_and_csv() -> None:
    model, x = small()
    result = analyze(model, x, device="h100", backward=True).result()
    table = render(result, "table")
    assert "#forward_time" not in table and "#time" in table and "#forward_flops" in table
    csv_header = render(result, "csv").splitlines()[0].split(",")
    assert "forward_time" in csv_header and "backward_bytes" in csv_header
    assert "intensity_share" not in csv_header and "time_share" in csv_header


def test_a_device_object_of_the_users() -> None:
    model, x = small()
    mine = Device("toy", "Toy accelerator", 10**9, 1e9, {"bf16": 1e12}, {"fp32": 1e10})
    result = analyze(model, x, device=mine).result()
    assert result.roofline["device"]["label"] == "Toy accelerator"
    assert result.total("time") >= result.total("bytes") / 1e9 * (1 - 1e-12)  # all memory-bound at 1 GB/s
    assert result.total("time") == pytest.approx(result.total("bytes") / 1e9)
