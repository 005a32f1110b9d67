"""The caller's grad mode (inference mode, no_grad, enable_grad, set_grad_enabled) never changes a number: the run
sets its own mode. Under ``torch.inference_mode`` composite operators (conv2d, linear, batch_norm) reached the
recorder undecomposed, and every convolution was dropped."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter import ActivationCountAnalysis, FlopCountAnalysis, MemoryAnalysis, analyze
from modelmeter.zoo import ZOO, get_model, input_shape

# The caller's modes: each must give the numbers of the plain call.
CALLER_MODES: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "enable_grad": torch.enable_grad,
    "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False),
}

# Every zoo model small enough to run for real in a test (the full-size ones are the same layers, larger).
SMALL_ZOO = ["resnet18", "mobilenet_v2", "gpt2_tiny", "bert_tiny", "llama2_tiny"]


def _model_and_input(name: str, device: str | None) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = get_model(name, device=device).eval()
    shape = input_shape(name, resolution=64 if len(ZOO[name].input_shape) == 4 else 16)
    if ZOO[name].input_dtype == torch.long:
        return model, torch.randint(0, 100, shape)
    return model, torch.randn(shape)


def _numbers(model: nn.Module, x: torch.Tensor, execution: str, backward: bool) -> dict[str, Any]:
    """Every metric of one analysis: FLOPs by module and operator (and phase), activations, memory."""
    a = analyze(model, x, execution=execution, backward=backward, memory=True, quiet=True)
    assert a.memory is not None
    return {"flops": a.flops.by_module_and_operator(), "phases": a.flops.by_phase(),
            "unsupported": a.flops.unsupported_ops(), "activations": a.activations.by_module_and_operator(),
            "memory": a.memory.by_module_and_operator(), "peak": a.memory.peak(),
            "saved": a.memory.saved_for_backward()}


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
@pytest.mark.parametrize(("name", "device"), [(n, None) for n in SMALL_ZOO] + [("resnet18", "meta"),
                                                                              ("gpt2_tiny", "meta")])
def test_every_grad_mode_of_the_caller_gives_the_plain_numbers(name: str, device: str | None, execution: str,
                                                               backward: bool) -> None:
    if device == "meta" and execution == "real":
        pytest.skip("a meta model has no values for real kernels")
    model, x = _model_and_input(name, device)
    plain = _numbers(model, x, execution, backward)
    assert sum(plain["phases"].values()) > 0 and not plain["unsupported"]
    assert (plain["phases"]["backward"] > 0) is backward
    for mode, enter in CALLER_MODES.items():
        with enter():
            assert _numbers(model, x, execution, backward) == plain, mode
    with torch.inference_mode():  # an input made under inference mode is an inference tensor
        inference_x = x.clone()
    assert _numbers(model, inference_x, execution, backward) == plain


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_resnet18_under_inference_mode_counts_every_convolution(execution: str) -> None:
    model, x = get_model("resnet18").eval(), torch.randn(1, 3, 224, 224)
    with torch.inference_mode():
        flops = FlopCountAnalysis(model, x, execution=execution)
        assert flops.total() == 1_819_065_856  # fvcore's count
        assert flops.by_operator()["conv"] == 1_813_561_344
        assert not flops.unsupported_ops()


@pytest.mark.parametrize("enter", list(CALLER_MODES.values()), ids=list(CALLER_MODES))
def test_each_analysis_class_is_independent_of_the_callers_mode(enter: Callable[[], Any]) -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 10))
    x = torch.randn(2, 3, 8, 8)
    conv = 2 * 8 * 36 * 27  # batch, output channels, positions, kernel products
    linear = 2 * 8 * 36 * 10

    def numbers() -> tuple[Any, ...]:
        flops = FlopCountAnalysis(model, x)
        training = FlopCountAnalysis(model, x, backward=True)
        activations = ActivationCountAnalysis(model, x)
        memory = MemoryAnalysis(model, x, training=True, optimizer="adamw")
        return (flops.by_operator(), training.by_phase(), activations.total(), memory.peak(),
                memory.saved_for_backward())

    plain = numbers()
    assert plain[0]["conv"] == conv and plain[0]["linear"] == linear
    # conv: the weight's gradient only (the input needs none); linear: the weight's and the input's; batch norm
    assert plain[1]["backward"] == conv + 2 * linear + plain[0]["batch_norm"]
    with enter():
        assert numbers() == plain
        assert torch.is_grad_enabled() == (enter is torch.enable_grad)  # the caller's mode is back afterwards


def test_a_model_built_under_inference_mode_gives_the_plain_numbers() -> None:
    torch.manual_seed(0)
    plain_model, x = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)), torch.randn(1, 3, 8, 8)
    with torch.inference_mode():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))  # parameters and buffers: inference tensors
        inference_x = x.clone()
        for execution in ("auto", "fake", "real"):
            got = analyze(model, inference_x, execution=execution, memory=True, quiet=True)
            want = analyze(plain_model, x, execution=execution, memory=True, quiet=True)
            assert got.flops.by_module_and_operator() == want.flops.by_module_and_operator() != {}
            assert got.activations.total() == want.activations.total()
            assert got.memory is not None and want.memory is not None
            assert got.memory.peak() == want.memory.peak()
