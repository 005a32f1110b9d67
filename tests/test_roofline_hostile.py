"""The time on a device used the hard way: models that compute or move nothing, extreme device numbers and settings,
measured times faster than the device allows, device files with control characters or without a rate, baselines
and diffs across devices, budgets on phases without a backward pass, and the JSON keys the docs promise.

Every case here failed (a traceback, an inf, a silent pass, a misleading hint) before the fix it guards.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from modelmeter import analyze
from modelmeter.cli import main
from modelmeter.cli.sweep import _rate
from modelmeter.devices import Device, DeviceError, load_devices
from modelmeter.guard.baseline import BaselineFile
from modelmeter.guard.diff import Difference
from modelmeter.reports.format import format_rate, format_time
from modelmeter.reports.render import format_change, render, roofline_note

DOCS = Path(__file__).resolve().parent.parent / "docs"

MODEL_FILE = textwrap.dedent("""
    import torch
    from torch import nn

    def mlp():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(2, 16)

    def nothing():
        return nn.Identity(), torch.randn(2, 3)

    def double():
        return nn.Linear(8, 8).double(), torch.randn(2, 8, dtype=torch.float64)
""")

# A device of one's own without an fp64 rate (allowed: a user device may leave it out).
DEVICES_FILE = {"devices": {"mygpu": {"label": "Mÿ GPU ✓ 日本", "memory": 16e9, "bandwidth": 1e12,
                                      "vector": {"fp32": 1e13}}}}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    Path("m.py").write_text(MODEL_FILE)
    Path("devices.json").write_text(json.dumps(DEVICES_FILE))
    return tmp_path


def cli(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0) -> tuple[str, str]:
    status = main([*argv, "--no-cache", "--depth", "0"] if argv[0] not in ("diff", "report") else list(argv))
    out, err = capsys.readouterr()
    assert status == code, f"exit {status}, stderr: {err}"
    return out, err


def one_line(err: str, *parts: str) -> None:
    assert err.startswith("modelmeter: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in err, err


def no_bad_number(text: str) -> None:
    assert not re.search(r"\b(nan|inf|None)\b", text, re.IGNORECASE), text


# --- a model that computes and moves nothing ---------------------------------------------------------------
def test_a_model_of_no_work_reports_a_zero_time_without_ratios() -> None:
    result = analyze(nn.Identity(), torch.randn(2, 3), device="h100", measured_time=1e-3, quiet=True).result()
    summary = result.roofline
    assert summary["time"] == {"total": 0} and summary["predicted_mfu"] is None and summary["throughput"] is None
    note = roofline_note(summary)  # raised a TypeError on predicted_mfu None
    assert "total 0s" in note and "predicted MFU" not in note and "MFU 0.0%" in note
    for fmt in ("table", "markdown", "tree", "csv"):
        no_bad_number(render(result, fmt, depth=1))


@pytest.mark.usefixtures("project")
def test_the_command_on_a_model_of_no_work(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = cli(capsys, "m.py:nothing", "--device", "h100")
    assert "Predicted time on NVIDIA H100 SXM5 80GB (float32, roofline): total 0s" in out
    no_bad_number(out)


def test_a_sweep_row_of_no_predicted_time_shows_a_dash() -> None:
    assert _rate(None) == "-" and _rate(14100.0) == "14.1K"


# --- units at the extremes -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("seconds", "text"), [
    (2.28e307, "2.28e+307s"), (1.17e-294, "1.17e-294s"), (1e-15, "1e-15s"), (999_999.0, "999999s"),
    (1e6, "1e+06s"), (1e-12, "0.001ns"), (4.5e-8, "45ns"),
])
def test_format_time_never_prints_hundreds_of_digits(seconds: float, text: str) -> None:
    assert format_time(seconds) == text


@pytest.mark.parametrize(("rate", "text"), [
    (4991.0, "4.99K"), (92_100_000.0, "92.1M"), (999_999.0, "1M"), (999.0, "999"), (0.5, "0.5"),
    (2.75e295, "2.75e+295"), (1.1e10, "11G"), (3e13, "30T"),
])
def test_format_rate(rate: float, text: str) -> None:
    assert format_rate(rate) == text


def test_signed_changes_in_the_metric_units() -> None:
    assert format_change("time", 1.47e-8) == "+14.7ns" and format_change("backward_time", -2e-3) == "-2ms"
    assert format_change("bytes", 3 * 2**20) == "+3MiB" and format_change("flops", 22_208_512) == "+22,208,512"
    row = Difference("", "forward_time", 0.0, 1.47e-8).row()  # was "+1.47e-08s", bytes as counts ("7.614M")
    assert row[2:5] == ["0s", "14.7ns", "+14.7ns"]
    assert Difference("h", "bytes", 0, 7_614_476).row()[3:5] == ["7.26MiB", "+7.26MiB"]


# --- MFU over 100% -------------------------------------------------------------------------------------------
def test_a_measured_time_faster_than_the_peak_is_reported_and_flagged() -> None:
    model, x = nn.Linear(64, 64), torch.randn(8, 64)
    fast = analyze(model, x, device="h100", measured_time=1e-15, quiet=True).result().roofline
    flops = 2 * 8 * 64 * 64 + 8 * 64  # addmm: the products and the bias
    assert fast["mfu"] == pytest.approx(flops / (1e-15 * 67e12))  # not clipped: the plain ratio, far over 1
    assert fast["mfu"] > 1 and "over 100%" in roofline_note(fast)
    slow = analyze(model, x, device="h100", measured_time=1.0, quiet=True).result().roofline
    assert slow["mfu"] < 1 and "over 100%" not in roofline_note(slow)


# --- settings and devices that overflow, or lack a rate -----------------------------------------------------
def test_an_efficiency_so_small_that_the_time_overflows_is_a_device_error() -> None:
    analysis = analyze(nn.Linear(8, 8), torch.randn(2, 8), device="h100", efficiency=1e-320, quiet=True)
    with pytest.raises(DeviceError, match="overflows"):
        analysis.result()  # was a Result of time inf and a NaN share


@pytest.mark.usefixtures("project")
@pytest.mark.parametrize(("argv", "parts"), [
    (["--device", "h100", "--efficiency", "1e-320"], ["--device h100", "overflows"]),
    (["--device", "h100", "--measured-time", "0"], ["argument --measured-time", "more than 0s"]),
    (["--device", "h100", "--launch-overhead", "2s"], ["argument --launch-overhead", "under 1s"]),
])
def test_time_options_out_of_range_are_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                     parts: list[str]) -> None:
    _, err = cli(capsys, "m.py:mlp", *argv, code=2)  # a traceback (ValueError) or inf before
    one_line(err, *parts)


@pytest.mark.usefixtures("project")
def test_report_refuses_a_zero_measured_time(capsys: pytest.CaptureFixture[str]) -> None:
    cli(capsys, "m.py:mlp", "--device", "h100", "--save-trace", "t.mmtrace")
    _, err = cli(capsys, "report", "t.mmtrace", "--measured-time", "0", code=2)
    one_line(err, "argument --measured-time")


@pytest.mark.usefixtures("project")
def test_a_device_without_the_rate_the_work_needs_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = cli(capsys, "m.py:double", "--device", "mygpu", "--devices-file", "devices.json", code=2)  # was exit 1
    one_line(err, "--device mygpu (from --devices-file devices.json)", "no fp64 rate")
    cli(capsys, "m.py:double", "--save-trace", "t.mmtrace")
    _, err = cli(capsys, "report", "t.mmtrace", "--device", "mygpu", "--devices-file", "devices.json", code=2)
    one_line(err, "--device mygpu", "no fp64 rate")


@pytest.mark.parametrize("label", ["red \x1b[31mred", "two\nlines", "tab\there", "bell\a"])
def test_a_device_label_with_a_control_character_is_refused(tmp_path: Path, label: str) -> None:
    with pytest.raises(DeviceError, match="control character"):
        Device("g", label, 16 * 10**9, 1e12, {}, {"fp32": 1e13})
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"devices": {"g": {"label": label, "memory": 1e9, "bandwidth": 1e12,
                                                  "vector": {"fp32": 1e13}}}}))
    with pytest.raises(DeviceError, match="d.json.*label"):
        load_devices(path)
    with pytest.raises(DeviceError, match="aliases"):
        Device("g", "g", 16 * 10**9, 1e12, {}, {"fp32": 1e13}, aliases=(label,))


def test_a_unicode_label_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps(DEVICES_FILE))
    assert load_devices(path)["mygpu"].label == "Mÿ GPU ✓ 日本"


# --- budgets -------------------------------------------------------------------------------------------------
@pytest.mark.usefixtures("project")
@pytest.mark.parametrize("metric", ["forward_time=1us", "backward_bytes=1K", "forward_flops=1"])
def test_a_phase_budget_without_a_backward_pass_says_so_before_the_run(capsys: pytest.CaptureFixture[str],
                                                                       metric: str) -> None:
    out, err = cli(capsys, "m.py:mlp", "--device", "h100", "--budget", metric, code=2)
    one_line(err, f"--budget {metric.split('=')[0]}=...", "add --backward")  # said "need --device" after the run
    assert out == ""


# --- baselines across devices --------------------------------------------------------------------------------
@pytest.mark.usefixtures("project")
def test_a_baseline_with_a_device_is_checked_on_that_device_only(capsys: pytest.CaptureFixture[str]) -> None:
    cli(capsys, "m.py:mlp", "--device", "h100", "--efficiency", "0.5", "--save-baseline", "b.json")
    entry = BaselineFile.load("b.json").entries["m.py:mlp"]
    assert entry.roofline == {"device": "h100", "efficiency": 0.5, "launch_overhead": 0.0, "tf32": False}
    assert entry.modules[""]["time"] > 0
    cli(capsys, "m.py:mlp", "--device", "h100", "--efficiency", "0.5", "--check-baseline", "b.json")
    for other in (["--device", "a100", "--efficiency", "0.5"], ["--device", "h100"], []):
        _, err = cli(capsys, "m.py:mlp", *other, "--check-baseline", "b.json", code=2)  # passed or "grew" before
        assert "the baseline was recorded with device 'h100 (efficiency 0.5)'" in err, err
    # every entry of the file, run again from its spec (the spec holds --device: refused before)
    out, _ = cli(capsys, "--check-baseline", "b.json", "--jobs", "1")
    assert "m.py:mlp: within its baseline" in out


@pytest.mark.usefixtures("project")
def test_a_baseline_without_a_device(capsys: pytest.CaptureFixture[str]) -> None:
    cli(capsys, "m.py:mlp", "--save-baseline", "b.json")
    assert '"roofline"' not in Path("b.json").read_text()  # files without a device are as they were
    _, err = cli(capsys, "m.py:mlp", "--device", "h100", "--check-baseline", "b.json")
    assert "within its baseline" in err


@pytest.mark.usefixtures("project")
def test_a_baseline_with_a_devices_file(capsys: pytest.CaptureFixture[str]) -> None:
    cli(capsys, "m.py:mlp", "--device", "mygpu", "--devices-file", "devices.json", "--save-baseline", "b.json")
    out, _ = cli(capsys, "--check-baseline", "b.json", "--jobs", "1")
    assert "within its baseline" in out
    data = json.loads(Path("b.json").read_text())
    data["models"]["m.py:mlp"]["spec"][-1] = "/etc/devices.json"  # a file outside the project
    Path("b.json").write_text(json.dumps(data))
    _, err = cli(capsys, "--check-baseline", "b.json", "--jobs", "1", code=2)
    one_line(err, "/etc/devices.json is an absolute path")


@pytest.mark.usefixtures("project")
def test_a_time_that_grew_is_named_in_time_units(capsys: pytest.CaptureFixture[str]) -> None:
    cli(capsys, "m.py:mlp", "--device", "h100", "--save-baseline", "b.json")
    data = json.loads(Path("b.json").read_text())
    data["models"]["m.py:mlp"]["modules"][""]["time"] /= 2
    Path("b.json").write_text(json.dumps(data))
    out, err = cli(capsys, "m.py:mlp", "--device", "h100", "--check-baseline", "b.json", code=1)
    line = next(line for line in (out + err).splitlines() if "the model: time" in line)
    assert re.search(r"\(\+\d+(\.\d+)?(ns|µs), \+100\.0%\)", line), line  # was "(+0, +100.0%)"


# --- the JSON the docs promise -------------------------------------------------------------------------------
@pytest.mark.parametrize("doc", ["reports.md", "roofline.md"])
def test_every_key_of_the_roofline_summary_is_documented(doc: str) -> None:
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=True)

    x = torch.randn(2, 8, requires_grad=True)
    summary = analyze(Checkpointed(), x, device="h100", backward=True, measured_time=1e-3,
                      quiet=True).result().roofline
    assert set(summary["time"]) == {"forward", "backward", "recompute", "total"}
    keys = {*summary, *summary["device"], *summary["settings"], *summary["items"], *summary["time"],
            *summary["operators"][0]}
    named = set(re.findall(r"`([a-z0-9_]+)`", (DOCS / doc).read_text()))
    assert keys - named == set()
    assert all(math.isfinite(v) for v in summary["time"].values())


# --- text reports: the ratios named as the table names them, the FLOPs of the intensity said -------------------
def test_the_tree_names_the_ratios_as_the_table_and_leaves_them_out_where_no_time_is() -> None:
    class Idle(nn.Module):  # a parameter, and no work: its block is shown, without time
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    model = nn.Sequential(nn.Linear(8, 8), Idle(), nn.ReLU())
    result = analyze(model, torch.randn(2, 8), device="h100", quiet=True).result()
    tree = render(result, "tree", depth=1)
    assert "#intensity" not in tree and "#compute_bound" not in tree  # ratios are no counts
    idle = next(line for line in tree.splitlines() if "(1): Idle" in line)
    assert "flops/byte: -" in idle and "bound: -" in idle  # was "#intensity: 0, #compute_bound: memory 100%"
    relu = next(line for line in tree.splitlines() if "(2): ReLU" in line)
    assert "flops/byte: 0.125" in relu and "bound: memory 100%" in relu  # 1 FLOP per 4-byte read + 4-byte write


@pytest.mark.parametrize(("convention", "noted"), [("fvcore", True), ("macs", True), ("flops", False)])
def test_the_footer_says_which_flops_the_intensity_counts(convention: str, noted: bool) -> None:
    result = analyze(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(2, 8), device="h100",
                     convention=convention, quiet=True).result()
    assert ("real FLOPs (a multiply-add is 2" in render(result, "table")) is noted


def test_a_peak_memory_over_the_device_memory_is_flagged() -> None:
    small = Device("small", "Small GPU", 1000, 1e12, {}, {"fp32": 1e13})  # 1000 bytes of memory
    model, x = nn.Linear(64, 64), torch.randn(8, 64)
    tight = analyze(model, x, device=small, memory=True, quiet=True).result()
    assert tight.memory["peak"] > 1000  # the weights alone: 64·64·4 bytes
    assert "is over the memory of Small GPU (1e-06 GB = 1000B)" in render(tight, "table")
    roomy = analyze(model, x, device="h100", memory=True, quiet=True).result()
    assert "does not fit" not in render(roomy, "table")


@pytest.mark.usefixtures("project")
def test_a_diff_of_times_on_two_devices_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    for name, device in (("h100.json", "h100"), ("a100.json", "a100"), ("h100b.json", "h100")):
        cli(capsys, "m.py:mlp", "--device", device, "--format", "json", "--output", name)
    cli(capsys, "m.py:mlp", "--format", "json", "--output", "none.json")
    out, err = cli(capsys, "diff", "h100.json", "a100.json")
    assert "the times are predicted on different devices (h100 before, a100 after)" in err
    assert re.search(r"\(model\) +time +\S+ +\S+ +\+\S+(ns|µs)", out), out  # the time's change in time units
    for same in (("h100.json", "h100b.json"), ("none.json", "h100.json")):
        assert "different devices" not in cli(capsys, "diff", *same)[1]


@pytest.mark.usefixtures("project")
def test_fit_with_a_device_is_refused_not_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = cli(capsys, "resnet18", "--fit", "1GiB", "--device", "h100", code=2)  # ran, and printed no time
    one_line(err, "--fit", "drop --device")


def test_a_saved_fsdp_trace_is_timed_by_a_process_that_never_ran_fsdp(tmp_path: Path) -> None:
    """FSDP2's copy operators (``fsdp::all_gather_copy_in`` ...) are registered when torch.distributed.fsdp is first
    imported; a trace loaded from the cache or a file into a fresh process named them before they existed, and the
    bytes formulas, which read arguments by name, raised a TypeError."""
    import subprocess
    import sys

    from modelmeter.engine.serialize import dumps

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    trace = analyze(model, torch.randn(2, 8), backward=True, parallel="fsdp=2", quiet=True).trace
    assert any(event.op.startswith("fsdp::") for event in trace.events)
    (tmp_path / "trace.bin").write_bytes(dumps(trace))
    code = ("import sys; from pathlib import Path; from modelmeter.engine.serialize import loads; "
            "from modelmeter import result_from_trace; "
            "trace = loads(Path(sys.argv[1]).read_bytes()); assert 'torch.distributed.fsdp' not in sys.modules; "
            "print(result_from_trace(trace, device='h100').roofline['bytes'])")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "trace.bin")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = analyze(model, torch.randn(2, 8), backward=True, parallel="fsdp=2", quiet=True, device="h100")
    assert int(done.stdout.split()[-1]) == expected.roofline.summary["bytes"]
