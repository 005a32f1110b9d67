"""The backward pass: attribution to modules, phases, gradient work that depends on requires_grad,
activation checkpointing, custom losses, dtypes, and the model left as it was."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from model_helpers import Fn
from modelmeter import ActivationCountAnalysis, FlopCountAnalysis, ModelRunError, analyze, render
from test_analysis import Stateful, _assert_same_state, _state


def flops(model: nn.Module, inputs: Any, **options: Any) -> FlopCountAnalysis:
    analysis = FlopCountAnalysis(model, inputs, backward=True, **options)
    return analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


# The 2x / 1x gradient work of linear and convolution layers of every kind: properties in tests/test_products.py.
def test_frozen_weights_do_no_weight_gradient_work() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(3, 8)
    full = flops(model, x, convention="macs")
    # first layer: only its weight gradient (its input needs none); second: weight and input gradients
    assert full.by_phase("0")["backward"] == 3 * 8 * 16
    assert full.by_phase("2")["backward"] == 2 * 3 * 16 * 4
    model[2].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    frozen_head = flops(model, x, convention="macs")
    assert frozen_head.by_phase("2")["backward"] == 3 * 16 * 4  # only the gradient flowing back to layer 0
    model[0].requires_grad_(False)
    frozen = flops(model, x, convention="macs")
    assert frozen.by_phase() == {"forward": 3 * 8 * 16 + 3 * 16 * 4, "backward": 0}
    assert any("backward pass is empty" in a for a in frozen.assumptions())
    assert all(p.requires_grad is False for p in model.parameters())


# --- an independent oracle: torch's own FlopCounterMode, forward and backward ---------------------------------
class SmallCnn(nn.Module):
    def __init__(self, groups: int = 2) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, groups=groups)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.fc = nn.Linear(4 * 12 * 12, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.up(self.conv2(self.conv1(x).relu()).relu())
        y = x.flatten(1)
        return self.fc(y) + (y @ y.t()).sum()


@pytest.mark.parametrize("input_grad", [False, True])
def test_forward_and_backward_products_match_flop_counter_mode(input_grad: bool) -> None:
    # groups=1: FlopCounterMode's weight-gradient formula ignores groups (a grouped conv's weight gradient
    # comes out `groups` times too high there); grouped convolutions are checked by hand below
    model = SmallCnn(groups=1)
    x = torch.randn(2, 3, 13, 13, requires_grad=input_grad)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    ours = flops(model, x, convention="macs")
    assert 2 * ours.total() == counter.get_total_flops()
    forward_only = FlopCountAnalysis(model, x, convention="macs")
    assert ours.by_phase()["forward"] == forward_only.total()


# --- attribution ------------------------------------------------------------------------------------------
def test_backward_operators_count_toward_the_module_that_made_them() -> None:
    model = nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2)))
    analysis = flops(model, torch.randn(5, 4, requires_grad=True), convention="macs")
    assert analysis.by_phase("1.1") == {"forward": 5 * 6 * 2, "backward": 2 * 5 * 6 * 2}
    assert analysis.by_phase("1") == {"forward": 5 * 6 * 8, "backward": 2 * 5 * 6 * 8}
    assert analysis.by_phase_and_operator("0")["backward"] == Counter({"mm": 2 * 5 * 4 * 6})
    for name in ("", "0", "1", "1.0", "1.1"):
        assert analysis.total(name) == sum(analysis.by_phase(name).values())
    caller = analysis.copy().ancestor_mode("caller")
    assert caller.by_phase("1") == analysis.by_phase("1")


def test_activation_counts_are_forward_only() -> None:
    model = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with_backward = flops(model, x)
    activations = ActivationCountAnalysis(model, x, trace=with_backward.trace)
    assert activations.total() == 2 * 3
    assert activations.by_phase() == {"forward": 6, "backward": 0}


# --- activation checkpointing -----------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(16, 4)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.head(self.block(x))
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("execution", ["fake", "real"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_shows_its_recomputation(execution: str, reentrant: bool) -> None:
    x = torch.randn(8, 16, requires_grad=True)
    plain = flops(Checkpointed(None), x, convention="macs", execution=execution)
    model = Checkpointed(reentrant)
    before = _state(model)
    ckpt = flops(model, x, convention="macs", execution=execution)
    layer = 8 * 16 * 16
    assert plain.by_phase() == {"forward": 2 * layer + 8 * 16 * 4, "backward": 2 * (2 * layer + 8 * 16 * 4)}
    # the same gradient work, plus the block's forward run again (the non-re-entrant variant stops as soon as
    # the tensors backward needs exist: the output of `b` is not needed, so only `a` runs again)
    recomputed = layer if not reentrant else 2 * layer
    assert ckpt.by_phase() == {**plain.by_phase(), "recompute": recomputed}
    assert ckpt.by_phase("block.a")["recompute"] == layer
    _assert_same_state(before, _state(model))  # the re-entrant variant calls backward(): no .grad is left


# --- losses, errors, the model left as it was -------------------------------------------------------------
def test_custom_loss_is_recorded_at_the_model_level() -> None:
    model = nn.Sequential(nn.Linear(6, 3))
    x, target = torch.randn(4, 6), torch.tensor([0, 2, 1, 0])

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, target)

    analysis = flops(model, x, convention="flops", loss_fn=loss_fn)
    default = flops(model, x, convention="flops")
    # oracle: the loss alone, analysed as a model of its own on logits of the same shape
    loss_only = FlopCountAnalysis(Fn(loss_fn), torch.randn(4, 3, requires_grad=True), convention="flops",
                                  backward=True)
    extra = {phase: analysis.by_phase()[phase] - default.by_phase()[phase] for phase in ("forward", "backward")}
    assert extra["forward"] == loss_only.by_phase()["forward"] > 0  # the loss's forward, at the model's level
    assert extra["backward"] == loss_only.by_phase()["backward"] > 0  # and its backward
    assert analysis.by_phase("0")["forward"] == default.by_phase("0")["forward"]  # not inside the layer


def test_loss_fn_needs_backward_and_must_return_one_element() -> None:
    with pytest.raises(ValueError, match="backward=True"):
        FlopCountAnalysis(nn.Linear(2, 2), torch.randn(1, 2), loss_fn=lambda out: out.sum())
    with pytest.raises(ModelRunError, match="loss_fn must return a tensor with one element"):
        flops(nn.Linear(2, 2), torch.randn(3, 2), loss_fn=lambda out: out).total()
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        flops(nn.Linear(2, 2), torch.randn(3, 2), loss_fn="mse").total()  # type: ignore[arg-type]


@pytest.mark.parametrize("execution", ["fake", "real"])
def test_model_is_unchanged_after_a_backward_pass(execution: str) -> None:
    model = Stateful().train()
    model.conv.weight.requires_grad_(False)
    before = _state(model)
    analysis = flops(model, torch.randn(2, 3, 8, 8), execution=execution)
    assert analysis.by_phase()["backward"] > 0
    _assert_same_state(before, _state(model))
    assert all(p.grad is None for p in model.parameters())


def test_a_failing_loss_leaves_the_model_unchanged() -> None:
    model = Stateful().train()
    before = _state(model)

    def bad_loss(out: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no target")

    for execution in ("fake", "real"):
        with pytest.raises(ModelRunError, match="no target"):
            flops(model, torch.randn(2, 3, 8, 8), execution=execution, loss_fn=bad_loss).total()
        _assert_same_state(before, _state(model))


def test_backward_on_the_meta_device_equals_the_real_run() -> None:
    torch.manual_seed(0)
    real = SmallCnn()
    with torch.device("meta"):
        meta = SmallCnn()
    x = torch.randn(2, 3, 13, 13)
    ours = flops(meta, x.to("meta"), convention="flops")
    reference = flops(real, x, convention="flops", execution="real")
    assert ours.by_phase() == reference.by_phase()
    assert ours.by_module() == reference.by_module()


# --- dtypes, reports, cache ---------------------------------------------------------------------------------
def test_work_is_broken_down_by_dtype() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.low = nn.Linear(4, 4).to(torch.bfloat16)
            self.full = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.full(self.low(x.to(torch.bfloat16)).float())

    analysis = flops(Mixed(), torch.randn(3, 4), convention="macs")
    # bf16 layer: forward + its weight gradient (its input needs none); fp32 layer: forward + both gradients
    assert analysis.by_dtype() == Counter({"bfloat16": 2 * 3 * 4 * 4, "float32": 3 * 3 * 4 * 2})
    assert analysis.by_dtype("low") == Counter({"bfloat16": 2 * 3 * 4 * 4})
    assert sum(analysis.by_dtype().values()) == analysis.total()


def test_reports_have_a_column_per_phase() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    result = analyze(model, torch.randn(2, 4), backward=True, convention="macs", quiet=True).result()
    assert result.metrics == ["flops", "forward_flops", "backward_flops", "activations"]
    assert result.convention == "macs"
    assert result.total("flops") == result.total("forward_flops") + result.total("backward_flops")
    assert result.row("1").metrics["backward_flops"] == 2 * 2 * 8 * 2
    assert "#backward_flops" in render(result, "table")
    assert math.isclose(sum(r.metrics["forward_flops"] for r in result.modules if r.depth == 1),
                        result.total("forward_flops"))


def test_cache_keeps_forward_and_backward_runs_apart(tmp_path: Any) -> None:
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    forward = FlopCountAnalysis(model, x, cache_dir=tmp_path)
    assert forward.by_phase() == {"forward": 32, "backward": 0}
    backward = flops(model, x, cache_dir=tmp_path)
    assert backward.by_phase() == {"forward": 32, "backward": 32}
    again = flops(model, x.clone(), cache_dir=tmp_path)  # another tensor: not the run shared in-process
    assert again.by_phase() == backward.by_phase() and again.session.from_cache


@pytest.mark.parametrize("execution", ["fake", "real"])
def test_existing_gradients_and_the_callers_graph_are_left_alone(execution: str) -> None:
    model = nn.Linear(4, 4)
    model.weight.grad = torch.ones(4, 4)
    before = model.weight.grad
    upstream = torch.randn(2, 4, requires_grad=True)
    x = upstream * 2  # an input computed by the caller's own graph
    analysis = flops(model, x, convention="macs", execution=execution)
    assert analysis.by_phase() == {"forward": 32, "backward": 64}
    assert model.weight.grad is before and torch.equal(before, torch.ones(4, 4))  # not added to
    assert upstream.grad is None and model.bias.grad is None


# --- inputs keep their leaf-ness ----------------------------------------------------------------------------------
class ScalesItsInput(nn.Module):
    """Updates its input in place: allowed on a non-leaf, refused on a leaf that requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x) @ x[:, :5].t()


@pytest.mark.parametrize("make", [lambda leaf: leaf.clone(), lambda leaf: leaf * 1], ids=["clone", "times_one"])
@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_a_non_leaf_input_updated_in_place_is_counted_as_the_real_step(
        execution: str, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    model = ScalesItsInput()
    leaf = torch.randn(3, 6, requires_grad=True)
    x = make(leaf)
    before = x.detach().clone()
    with FlopCounterMode(display=False) as counter:  # the real step, on a copy of the input as it was
        model(make(leaf)).sum().backward()
    model.zero_grad(set_to_none=True)
    leaf.grad = None
    ours = flops(model, x, convention="macs", execution=execution)
    # forward: the linear layer (3x6 by 6x5) and the product (3x5 by 5x3); backward: both gradients of each,
    # the weight's too (the input's gradient is needed: x requires grad)
    linear, product = 3 * 6 * 5, 3 * 5 * 3
    assert ours.by_phase() == {"forward": linear + product, "backward": 2 * (linear + product)}
    assert 2 * ours.total() == counter.get_total_flops()
    assert ours.by_phase() == flops(model, x, convention="macs", execution="real").by_phase()
    assert torch.equal(x, before) and not x.is_leaf and leaf.grad is None  # the caller's tensors as they were


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_a_leaf_input_that_requires_grad_stays_a_leaf(execution: str) -> None:
    x = torch.randn(3, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):  # what the real step does
        ScalesItsInput()(x)
    with pytest.raises(ModelRunError, match="ScalesItsInput.forward.*leaf Variable that requires grad"):
        flops(ScalesItsInput(), x, execution=execution).total()
    assert x.grad is None and x.is_leaf
    # without a backward pass the model runs without autograd, as under torch.no_grad(): the update is allowed
    with torch.no_grad():
        ScalesItsInput()(x.clone())
    assert FlopCountAnalysis(ScalesItsInput(), x, execution=execution).total() > 0


def test_a_non_leaf_input_keeps_its_leaf_ness_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = ScalesItsInput()
        leaf = torch.randn(3, 6, requires_grad=True)
    ours = flops(model, leaf * 1, convention="macs")
    assert ours.by_phase() == {"forward": 3 * 6 * 5 + 3 * 5 * 3, "backward": 2 * (3 * 6 * 5 + 3 * 5 * 3)}
