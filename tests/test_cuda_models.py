"""A model written for GPUs (``.cuda()``, ``.to("cuda")``, ``device="cuda"`` inside ``forward``) analyses on a
machine without one: FakeTensors stand on ``cuda`` with no GPU, so its parameters, buffers and inputs run as
FakeTensors on ``cuda:0`` and the result says where it was counted. A training step (a backward pass) runs as on
the CPU, torch's autograd engine needing a GPU for CUDA tensors, and is recorded on ``cuda:0``.

Oracle: the same model written device-agnostically, analysed on the CPU, and its real run under torch's own
``FlopCounterMode``: the counts are the same, only the device differs. The model is left exactly as found
(tests/test_model_unchanged.py's walk) and torch's CUDA state is as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from modelmeter import FlopCountAnalysis, InputMismatchError, ModelRunError, analyze
from modelmeter.cli import main
from test_model_unchanged import differences, reachable

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="what happens where CUDA cannot run")


class Net(nn.Module):
    """Positions made in ``forward`` and a projection; ``style`` says how it puts tensors on CUDA (``"cpu"``: it
    does not, the oracle)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "cuda()":
            x = x.cuda()
        elif self.style == "to":
            x = x.to("cuda")
        elif self.style == "index":  # a bare index is a CUDA device
            x = x.to(0)
        device: torch.device | str | int = "cuda"  # "device=": it expects its inputs on CUDA already
        if self.style == "cpu":
            device = x.device
        elif self.style == "index":
            device = 0
        positions = torch.arange(x.shape[1], device=device, dtype=x.dtype)
        return self.norm(self.proj(x + positions[:, None]) * self.scale)


STYLES = ["cuda()", "to", "device=", "index"]


def _counts(model: nn.Module, x: torch.Tensor, **options: object) -> tuple[dict[str, int], object]:
    analysis = analyze(model, x, **options)  # type: ignore[arg-type]
    result = analysis.result()
    return {row.name: row.metrics["flops"] for row in result.modules}, analysis


@NO_CUDA
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("on_meta", [False, True])
def test_a_model_written_for_gpus_is_counted_on_cuda_without_one(style: str, on_meta: bool) -> None:
    device = "meta" if on_meta else "cpu"
    model, x = Net(style).to(device), torch.randn(2, 6, 8, device=device)
    before = reachable(model)
    counts, analysis = _counts(model, x)
    reference = Net("cpu")
    expected, _ = _counts(reference, torch.randn(2, 6, 8))
    with FlopCounterMode(display=False) as real:  # torch's own count of the real run (multiply-adds x 2)
        reference(torch.randn(2, 6, 8))
    assert counts == expected and counts["proj"] == real.get_total_flops() // 2 == 2 * 6 * 8 * 8
    result = analysis.result()  # type: ignore[attr-defined]
    assert result.device == "cuda:0" and result.execution == "fake"
    assert any("counted as FakeTensors on cuda:0 (no GPU was used)" in a for a in result.assumptions)
    devices = {t.device for e in analysis.trace.events for t in e.inputs if hasattr(t, "device")}  # type: ignore
    assert devices == {"cuda:0"}
    assert differences(before, reachable(model)) == []
    assert not torch.cuda.is_available() and not torch.cuda.is_initialized()


def _step(model: nn.Module, x: torch.Tensor, **options: object) -> tuple[dict[str, object], object]:
    """A training step's result as plain data (every metric, the memory, the roofline's bytes), less what says
    where it ran; and its analysis."""
    analysis = analyze(model, x, backward=True, memory=True, optimizer="adamw", device="h100",  # type: ignore
                       **options)
    data = analysis.result().to_dict()
    for key in ("device", "assumptions"):
        data.pop(key)
    return data, analysis


@NO_CUDA
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("on_meta", [False, True])
def test_a_training_step_of_a_gpu_model_is_counted_without_one(style: str, on_meta: bool) -> None:
    """torch's autograd engine starts the CUDA device of a graph on CUDA tensors, fake or not (``hasPrimaryContext``
    fails on a machine without one): the step runs as on the CPU and is recorded on ``cuda:0``. Oracles: the same
    model written for the CPU (every metric, forward and backward: FLOPs, activations, memory, bytes), and torch's
    FlopCounterMode of that model's real step."""
    device = "meta" if on_meta else "cpu"
    model, x = Net(style).to(device), torch.randn(2, 6, 8, device=device)
    before = reachable(model)
    counted, analysis = _step(model, x)
    expected, _ = _step(Net("cpu").to(device), torch.randn(2, 6, 8, device=device))
    assert counted == expected
    reference = Net("cpu")
    with FlopCounterMode(display=False) as real:  # torch's own count of a real step on the CPU
        reference(torch.randn(2, 6, 8)).sum().backward()
    proj = next(row for row in analysis.result().modules if row.name == "proj")  # type: ignore[attr-defined]
    # the forward product and the weight's gradient (the input needs none)
    assert proj.metrics["flops"] == real.get_total_flops() // 2 == 2 * (2 * 6 * 8 * 8)
    result = analysis.result()  # type: ignore[attr-defined]
    assert result.device == "cuda:0" and result.execution == "fake"
    assert any("counted on cuda:0 (no GPU was used; its step ran as on the CPU" in a for a in result.assumptions)
    trace = analysis.trace  # type: ignore[attr-defined]
    assert {e.phase for e in trace.events} == {"forward", "backward"}
    assert {t.device for e in trace.events for t in e.inputs if hasattr(t, "device")} == {"cuda:0"}
    assert {s.device for s in trace.storages} == {"cuda:0"}
    assert differences(before, reachable(model)) == []
    assert not torch.cuda.is_available() and not torch.cuda.is_initialized()


@NO_CUDA
def test_a_training_step_records_the_models_own_calls() -> None:
    """The call the model made is recorded as made (``aten::to`` to ``cuda``); ``is_cuda`` answers as on the CPU."""
    model = Net("to")
    _, analysis = _step(model, torch.randn(2, 6, 8))
    calls = [e for e in analysis.trace.events if e.op == "aten::to" and e.level == "function"]  # type: ignore
    assert len(calls) == 1 and "cuda" in calls[0].inputs


@NO_CUDA
def test_real_kernels_still_say_that_cuda_cannot_run() -> None:
    model = Net("device=")
    before = reachable(model)
    with pytest.raises(ModelRunError, match=r"it puts tensors on CUDA, which this machine cannot run"):
        FlopCountAnalysis(model, torch.randn(2, 6, 8), execution="real").total()
    assert differences(before, reachable(model)) == []


def test_a_cpu_model_is_counted_on_the_cpu() -> None:
    _, analysis = _counts(Net("cpu"), torch.randn(2, 6, 8))
    assert analysis.result().device == "cpu"  # type: ignore[attr-defined]
    _, analysis = _counts(Net("cpu").to("meta"), torch.randn(2, 6, 8, device="meta"))
    assert analysis.result().device == "meta"  # type: ignore[attr-defined]


MODEL_FILE = '''
import torch
from torch import nn


class Gpu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x.cuda()) + torch.ones(4, device="cuda")


def build():
    return Gpu()
'''


@NO_CUDA
def test_the_command_says_where_it_counted(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "gpu.py"
    path.write_text(MODEL_FILE)
    assert main([f"{path}:build", "--input", "2x4", "--wide"]) == 0  # the header on one line, however long
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith(f"{path}:build on input 2x4 float32 (fake run on cuda:0, forward, fvcore convention")
    assert main([f"{path}:build", "--input", "2x4", "--format", "json", "--no-cache"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "cuda:0" and data["modules"][0]["metrics"]["flops"] == 2 * 4 * 4
    assert main([f"{path}:build", "--input", "2x4", "--backward", "--format", "json", "--no-cache"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "cuda:0" and data["modules"][0]["metrics"]["backward_flops"] == 2 * 4 * 4  # dW


@NO_CUDA
@pytest.mark.parametrize("backward", [False, True])
def test_a_wrong_input_of_a_gpu_model_says_what_it_expected(backward: bool) -> None:
    """A float64 input into its float32 projection: a GPU's kernel refuses it as the CPU's does, so the fake run on
    cuda:0 (or the step run as on the CPU) refuses it too, where the real CPU model fails."""
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # the oracle: the same model on the CPU, real kernels
        Net("cpu")(x)
    with pytest.raises(InputMismatchError, match=r"module 'proj' \(Linear\) at operator aten::linear: expected "
                                                 r"float32 inputs \(the dtype of its weight\), got float64"):
        analyze(Net("cuda()"), x, backward=backward)
