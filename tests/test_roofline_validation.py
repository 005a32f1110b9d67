"""benchmarks/roofline_validation.py: kernel time goes to the modules that launched it, the tables add up, and the
calibrated device carries what was measured.

The times themselves are never asserted (they depend on the machine); only how they are attributed and combined.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from modelmeter.reports.result import ModuleRow, Result

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "roofline_validation.py"


def load() -> ModuleType:
    """The script as a module (it is a benchmark, not part of the package)."""
    spec = importlib.util.spec_from_file_location("roofline_validation", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


rv = load()


def test_a_kernel_counts_for_every_module_running_when_it_was_launched() -> None:
    spans = [rv.Span("", 0, 100), rv.Span("a", 10, 40), rv.Span("a.x", 10, 20), rv.Span("b", 50, 90),
             rv.Span("b", 95, 99), rv.Span("idle", 41, 49)]
    kernels = [rv.Kernel(10, 5), rv.Kernel(15, 1), rv.Kernel(30, 2), rv.Kernel(55, 4), rv.Kernel(96, 3),
               rv.Kernel(100, 7), rv.Kernel(101, 100)]  # at a span's ends it is inside; at 101 outside all
    found = rv.attribute(spans, reversed(kernels))
    expected = {"": 22e-6, "a": 8e-6, "a.x": 6e-6, "b": 7e-6, "idle": 0.0}  # microseconds in, seconds out
    assert found.keys() == expected.keys()
    for name, seconds in expected.items():
        assert found[name] == pytest.approx(seconds, abs=1e-15), name


def event(name: str, start: float, end: float, *, thread: int = 1, kernels: tuple[float, ...] = (),
          parent: Any = None) -> SimpleNamespace:
    """A stand-in for the profiler's FunctionEvent: what host_timeline reads of it."""
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                           kernels=[SimpleNamespace(duration=d) for d in kernels], cpu_parent=parent)


def test_cuda_kernels_are_placed_at_the_operator_that_launched_them() -> None:
    root = event(rv.RANGE, 0, 50)
    conv = event(rv.RANGE + "conv", 1, 20, parent=root)
    op = event("aten::conv2d", 2, 19, parent=conv)  # no kernels of its own: its child launched them
    inner = event("aten::cudnn_convolution", 3, 18, kernels=(30.0, 12.0), parent=op)
    launch = event("cudaLaunchKernel", 4, 5, parent=inner)  # the runtime call: its kernel is on `inner`
    add = event("aten::add", 30, 31, kernels=(2.0,), parent=root)
    elsewhere = event("aten::mul", 32, 33, thread=2, kernels=(99.0,))  # a thread no module ran on
    spans, kernels = rv.host_timeline([root, conv, op, inner, launch, add, elsewhere], cuda=True)
    assert spans == [rv.Span("", 0, 50), rv.Span("conv", 1, 20)]
    assert kernels == [rv.Kernel(3, 42.0), rv.Kernel(30, 2.0)]
    assert rv.attribute(spans, kernels) == pytest.approx({"": 44e-6, "conv": 42e-6})


def test_cpu_kernels_are_the_outermost_operators() -> None:
    root = event(rv.RANGE, 0, 50)
    fc = event(rv.RANGE + "fc", 1, 20, parent=root)
    linear = event("aten::linear", 2, 19, parent=fc)
    addmm = event("aten::addmm", 3, 18, parent=linear)
    cat = event("aten::cat", 25, 28, parent=root)
    spans, kernels = rv.host_timeline([root, fc, linear, addmm, cat], cuda=False)
    assert kernels == [rv.Kernel(2, 17), rv.Kernel(25, 3)]
    assert rv.attribute(spans, kernels) == pytest.approx({"": 20e-6, "fc": 17e-6})


class Tiny(nn.Module):
    """Two products and a ReLU module called twice, around an Identity that launches nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.skip, self.fc2 = nn.Linear(128, 128), nn.ReLU(), nn.Identity(), nn.Linear(128, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.skip(self.act(self.fc1(x)))))


def no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_real_cpu_profile_agrees_with_the_profilers_own_tree() -> None:
    model, x = Tiny().eval(), torch.randn(64, 128)
    with rv.module_ranges(model), torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x)
    assert no_hooks(model)
    events = prof.events()
    found = rv.attribute(*rv.host_timeline(events, cuda=False))
    # the oracle: the profiler's tree, each module range's direct children (the operators it ran), every call
    direct: dict[str, float] = {}
    for e in events:
        if e.name.startswith(rv.RANGE):
            ops = [c for c in e.cpu_children if not c.name.startswith(rv.RANGE)]
            direct[e.name.removeprefix(rv.RANGE)] = direct.get(e.name.removeprefix(rv.RANGE), 0.0) + sum(
                c.time_range.end - c.time_range.start for c in ops) * 1e-6
    for name in ("fc1", "act", "fc2"):
        assert found[name] == pytest.approx(direct[name]) and found[name] > 0, name
    assert sum(e.name == rv.RANGE + "act" for e in events) == 2
    assert found["skip"] == 0.0 == direct["skip"]
    assert found[""] == pytest.approx(found["fc1"] + found["act"] + found["fc2"])  # the root runs no op itself


def test_measure_reports_every_module_and_leaves_the_model_as_it_was() -> None:
    model, x = Tiny().eval(), torch.randn(8, 128)
    measured = rv.measure(model, x, cuda=False, warmup=1, repeat=3)
    found = measured.modules
    assert set(found) == {name for name, _ in model.named_modules()}
    assert found["skip"] == 0.0 and all(found[name] > 0 for name in ("", "fc1", "act", "fc2"))
    assert len(measured.runs) == 3 and measured.runs == sorted(measured.runs) and found[""] == measured.runs[1]
    assert found[""] == pytest.approx(found["fc1"] + found["act"] + found["fc2"])  # one run: the modules add up
    assert no_hooks(model) and not model.training


def test_the_hooks_go_also_when_the_forward_raises() -> None:
    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("broken on purpose")

    model = Broken()
    with pytest.raises(ValueError, match="on purpose"):
        rv.measure(model, torch.randn(2, 4), cuda=False, warmup=0, repeat=1)
    assert no_hooks(model)


def test_the_calibrated_device_has_the_measured_peaks() -> None:
    calibration = rv.calibrate_cpu(size=64, stream_mib=1, repeat=1)
    assert calibration.matmul_flops > 0 and calibration.bandwidth > 0
    assert calibration.matmul_size == 64 and calibration.stream_bytes == 2**20 and rv.physical_memory() >= 2**20
    device = rv.calibrated_device(rv.Calibration(4e10, 1e10, 64, 2**20), memory=2**30)
    assert device.name == "this-cpu" and device.memory == 2**30 and device.bandwidth == 1e10
    assert device.peak("float32", matrix=True) == 4e10 == device.peak("float32", matrix=False)
    assert device.ridge("float32") == 4.0


def stub_result() -> Result:
    """A prediction by hand: the model (2 s, half compute-bound) with a block holding a conv and a ReLU, and a
    head that was never called."""
    def row(name: str, kind: str, time: float, bound: float, called: bool = True) -> ModuleRow:
        return ModuleRow(name, kind, 0, {"time": time, "compute_bound": bound}, {}, called)

    return Result("Stub", [], ["time"], [row("", "Net", 2.0, 0.5), row("block", "Block", 1.5, 2 / 3),
                                           row("block.conv", "Conv2d", 1.0, 1.0), row("block.act", "ReLU", 0.25, 0.0),
                                           row("head", "Linear", 0.0, 0.0, called=False)])


def test_rows_pair_the_prediction_with_the_measurement() -> None:
    rows = rv.compare(stub_result(), {"": 8.0, "block": 6.0, "block.conv": 3.0, "block.act": 2.0})
    assert [(r.module, r.predicted, r.measured) for r in rows] == [
        ("", 2.0, 8.0), ("block", 1.5, 6.0), ("block.conv", 1.0, 3.0), ("block.act", 0.25, 2.0), ("head", 0.0, 0.0)]
    assert [r.ratio for r in rows] == [4.0, 4.0, 3.0, 8.0, None]
    assert [r.module for r in rv.shown(rows, 1)] == ["", "block"]  # the head predicted and measured nothing
    assert [r.module for r in rv.shown(rows, 2)] == ["", "block", "block.conv", "block.act"]

    types = {r.type: r for r in rv.by_type(rows)}
    # self times: Net 2-1.5 = 0.5 (measured 8-6 = 2), Block 1.5-1-0.25 = 0.25 (6-3-2 = 1); Linear had none
    assert {kind: (r.predicted, r.measured) for kind, r in types.items()} == {
        "Net": (0.5, 2.0), "Block": (0.25, 1.0), "Conv2d": (1.0, 3.0), "ReLU": (0.25, 2.0)}
    assert rv.by_type(rows)[0].type == "Conv2d"  # the largest prediction first
    # compute-bound seconds: Net 1 - Block 1 = 0; Block 1 - conv 1 = 0; conv 1
    assert types["Conv2d"].compute_bound == 1.0 and types["Net"].compute_bound == 0.0
    assert types["Block"].compute_bound == pytest.approx(0.0, abs=1e-12)
    assert sum(r.predicted for r in types.values()) == pytest.approx(2.0)
    assert sum(r.measured for r in types.values()) == pytest.approx(8.0)


def test_rounding_left_by_the_subtraction_is_zero() -> None:
    parts = [0.1, 0.2, 0.3]
    rows = [rv.Row("", "Net", sum(parts), sum(parts), 0.0)]
    rows += [rv.Row(f"m{i}", "Leaf", p, p, 0.0) for i, p in enumerate(reversed(parts))]
    assert sum(parts) - 0.3 - 0.2 - 0.1 != 0  # the model's self time is a residue of the order of the sums
    assert [r.type for r in rv.by_type(rows)] == ["Leaf"]


def test_seconds_and_tables_read_as_documented() -> None:
    assert [rv.seconds(v) for v in (2.0, 1.5e-3, 4.25e-5, 3.2e-7, 0.0)] == ["2 s", "1.5 ms", "42.5 µs", "320 ns",
                                                                           "0 ns"]
    rows = rv.compare(stub_result(), {"": 8.0, "block": 6.0, "block.conv": 3.0, "block.act": 2.0})
    comparison = rv.Comparison("stub", 4, "(4, 3)", "this-cpu", [7.0, 8.0, 9.5], rows, rv.by_type(rows))
    text = rv.section(comparison, depth=1)
    assert "### stub, batch 4" in text and "ratio **4.00** (the median of 3 runs, 7 s to 9.5 s;" in text
    assert "| (model) (Net) | 2 s | 8 s | 4.00 | 50% |" in text
    assert "| block (Block) | 1.5 s | 6 s | 4.00 | 67% |" in text and "block.conv" not in text
    assert "| Conv2d | 1 s | 3 s | 3.00 | 100% |" in text
    head = rv.table([rows[-1]], "module").splitlines()[-1]
    assert head == "| head (Linear) | 0 ns | 0 ns | — | 0% |"


def test_options_default_by_mode_and_refuse_what_cannot_be_measured() -> None:
    cpu = rv.parse_args(["--cpu"])
    assert (cpu.batches, cpu.seq_len, cpu.dtype, cpu.models) == ([1, 8], 128, "float32", list(rv.MODELS))
    gpu = rv.parse_args(["--device-name", "h200", "--batches", "2,4", "--models", "resnet50"])
    assert (gpu.batches, gpu.seq_len, gpu.dtype, gpu.models) == ([2, 4], 2048, "bfloat16", ["resnet50"])
    for wrong in (["--cpu", "--dtype", "bfloat16"], ["--device-name", "h200", "--dtype", "nonsense"], [],
                  ["--cpu", "--models", "resnet50,resnet"], ["--cpu", "--device-name", "h200"]):
        with pytest.raises(SystemExit):
            rv.parse_args(wrong)


@pytest.mark.slow
def test_cpu_run_predicts_and_measures_resnet50(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    markdown = tmp_path / "out.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--models", "resnet50", "--batches", "1",
                           "--warmup", "0", "--repeat", "1", "--markdown", str(markdown), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    (comparison,) = report["comparisons"]
    rows = {row["module"]: row for row in comparison["modules"]}
    assert rows[""]["predicted"] > 0 and rows[""]["measured"] > 0
    convs = [row for row in comparison["modules"] if row["type"] == "Conv2d"]
    assert len(convs) == 53 and all(row["predicted"] > 0 and row["measured"] > 0 for row in convs)
    assert sum(row["predicted"] for row in comparison["types"]) == pytest.approx(rows[""]["predicted"])
    assert sum(row["measured"] for row in comparison["types"]) == pytest.approx(rows[""]["measured"])
    assert comparison["runs"] == [rows[""]["measured"]]
    calibration = report["calibration"]
    assert report["device"]["bandwidth"] == calibration["bandwidth"]
    assert report["device"]["matrix"] == {"fp32": calibration["matmul_flops"]}
    assert "### resnet50, batch 1" in markdown.read_text()
