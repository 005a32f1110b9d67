"""Training steps as a hostile user writes them: custom autograd Functions of every style, tensor hooks and
gradients taken inside ``forward``, ``torch.func`` transforms, failing losses.

Oracles: torch's own ``FlopCounterMode`` on the same step run for real (its product operators, its convention:
twice the ``macs``), or torch's flop formulas applied to every aten operator a real step runs (where
``FlopCounterMode``'s module tracker cannot follow the model), and the model's tensors and hook tables compared
before and after.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from modelmeter import FlopCountAnalysis, ModelRunError

EXECUTIONS = ["fake", "real"]


def phases(model: nn.Module, x: torch.Tensor, backward: bool = True, **options: Any) -> dict[str, int]:
    """FLOPs by phase in FlopCounterMode's convention (2 per multiply-add of a product)."""
    analysis = FlopCountAnalysis(model, x, backward=backward, convention="macs", **options)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    return {phase: 2 * count for phase, count in analysis.by_phase().items()}


def flop_counter_mode(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Forward and backward FLOPs of a real step of a copy of ``model`` under torch's FlopCounterMode."""
    model = copy.deepcopy(model)
    with FlopCounterMode(display=False) as forward:
        loss = model(x.clone()).sum()
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    return {"forward": forward.get_total_flops(), "backward": backward.get_total_flops()}


class _TorchFormulas(TorchDispatchMode):
    """torch's own flop formulas (``flop_registry``) summed over every aten operator that runs, with no module
    tracker (whose hooks FlopCounterMode cannot run under ``torch.autograd.grad`` inside a forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            shapes = tree_map(lambda t: t.shape if isinstance(t, torch.Tensor) else t, (args, kwargs, out))
            self.total += formula(*shapes[0], **shapes[1], out_val=shapes[2])
        return out


def torch_formulas(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    model = copy.deepcopy(model)
    with _TorchFormulas() as forward:
        loss = model(x.clone()).sum()
    with _TorchFormulas() as backward:
        loss.backward()
    return {"forward": forward.total, "backward": backward.total}


def hook_tables(model: nn.Module) -> list[tuple[int, int]]:
    """How many tensor hooks each parameter holds (``register_hook``, ``register_post_accumulate_grad_hook``)."""
    return [(len(p._backward_hooks or {}), len(p._post_accumulate_grad_hooks or {})) for p in model.parameters()]


# --- custom autograd Functions ------------------------------------------------------------------------------
class OldStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class NewStyle(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(*inputs)

    backward = staticmethod(OldStyle.backward)


class OnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        ctx.save_for_backward(x, w)
        return x @ w, 3  # a non-tensor output too

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class CallsOtherFunctions(OldStyle):
    """OldStyle's forward; its backward applies OldStyle (a Function applied inside a backward pass)."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return OldStyle.apply(grad, w.t()), OldStyle.apply(x.t(), grad)


class InPlace(torch.autograd.Function):
    """Doubles its input in place (``mark_dirty``) and saves its output."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)
        x.mul_(2)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


class WithFunction(nn.Module):
    def __init__(self, function: Any) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.randn(8, 8))
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = InPlace.apply(self.lin(x) * 1)
        out = self.function.apply(h, self.w)
        return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("function", [OldStyle, NewStyle, OnceDifferentiable, CallsOtherFunctions])
@pytest.mark.parametrize("execution", EXECUTIONS)
def test_custom_functions_count_as_flop_counter_mode(function: Any, execution: str) -> None:
    model, x = WithFunction(function), torch.randn(4, 8)
    assert phases(model, x, execution=execution) == flop_counter_mode(model, x)
    assert all(p.grad is None for p in model.parameters())


# --- hooks and gradients inside forward ---------------------------------------------------------------------
class HooksOnItsParameters(nn.Module):
    """Registers tensor hooks on its own parameters at every call (as some pruning and logging code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.a.weight.register_hook(lambda grad: grad * 2)
        self.a.bias.register_post_accumulate_grad_hook(lambda param: None)
        h = self.a(x)
        if h.requires_grad:  # (not under no_grad, as a forward-only analysis runs)
            h.register_hook(lambda grad: grad @ self.b.weight)  # a hook's own work is backward work
        return self.b(h)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("execution", EXECUTIONS)
def test_tensor_hooks_registered_inside_forward_are_not_left_on_the_parameters(execution: str,
                                                                                backward: bool) -> None:
    model, x = HooksOnItsParameters(), torch.randn(4, 8)
    kept = model.b.weight.register_hook(lambda grad: grad)  # the user's own hook stays
    model.a.weight.register_hook(lambda grad: grad).remove()  # an empty table: the run's hook lands in it
    before = hook_tables(model)
    counted = phases(model, x, backward=backward, execution=execution)
    assert hook_tables(model) == before
    if backward:
        assert counted == flop_counter_mode(model, x)
    fired: list[str] = []
    model.a.weight.register_hook(lambda grad: fired.append("user"))
    model.a.weight.sum().backward()
    assert fired == ["user"]  # no hook of the analysed run fires on the user's next step
    kept.remove()


class HooksOnItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.register_hook(lambda grad: grad)
        return self.a(x)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("execution", EXECUTIONS)
def test_tensor_hooks_registered_on_an_input_are_not_left_on_it(execution: str, backward: bool) -> None:
    x, on_meta = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, device="meta", requires_grad=True)
    phases(HooksOnItsInput(), x, backward=backward, execution=execution)
    phases(HooksOnItsInput(), on_meta, backward=backward, execution="fake")  # a meta input is passed as it is
    assert x._backward_hooks is None and on_meta._backward_hooks is None
    assert x.grad is None


class GradientPenalty(nn.Module):
    """A WGAN-GP style step: the gradient of the output with respect to the input, taken inside ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()
        y = self.b(self.a(x).tanh())
        (grad,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y.sum() + (grad**2).sum()


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_a_gradient_penalty_counts_its_double_backward(execution: str) -> None:
    model, x = GradientPenalty(), torch.randn(4, 8)
    assert phases(model, x, execution=execution) == torch_formulas(model, x)


def test_a_forward_only_analysis_of_a_model_that_takes_gradients_says_why_it_fails() -> None:
    with pytest.raises(ModelRunError, match=r"torch\.no_grad\(\).*backward=True"):
        phases(GradientPenalty(), torch.randn(4, 8), backward=False)


# --- torch.func inside forward ------------------------------------------------------------------------------
class Vmapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_row = torch.func.vmap(self.a)(x)
        return per_row + torch.func.vmap(torch.mv, in_dims=(None, 0))(self.a.weight, x)


class FuncGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.grad(lambda t: self.a(t).tanh().sum())(x)


class FunctionalCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.a, dict(self.a.named_parameters()), (x,))


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("execution", EXECUTIONS)
def test_vmap_inside_forward_counts_every_row(execution: str, backward: bool) -> None:
    model, x = Vmapped(), torch.randn(4, 8)
    expected = flop_counter_mode(model, x)
    assert expected["forward"] == 2 * 2 * 4 * 8 * 8  # two products of a 4x8 batch with an 8x8 weight
    counted = phases(model, x, backward=backward, execution=execution)
    assert counted["forward"] == expected["forward"]
    if backward:
        assert counted == expected


class VmappedAttention(nn.Module):
    """Causal attention written for one sequence, mapped over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def one(t: torch.Tensor) -> torch.Tensor:
            q = self.q(t).view(t.shape[0], 2, 8).transpose(0, 1)
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

        return torch.func.vmap(one)(x)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch's: no batching rule, a loop over rows
@pytest.mark.parametrize("execution", EXECUTIONS)
def test_attention_under_vmap_counts_every_sequence(execution: str) -> None:
    # by hand: 3 sequences of 10 tokens, 2 heads of 8; causal: 55 (query, key) pairs per head, 2 products each
    attention, linear = 3 * 2 * 55 * 8 * 2, 3 * 10 * 16 * 16
    counted = FlopCountAnalysis(VmappedAttention(), torch.randn(3, 10, 16), backward=True, execution=execution,
                                convention="macs")
    assert counted.by_operator() == Counter({"mm": 2 * linear, "scaled_dot_product_attention": attention,
                                              "scaled_dot_product_attention_backward": 5 * attention // 2})


class DualNumbers(nn.Module):
    """Forward-mode AD by hand: the tangent of a layer's output, computed next to it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with forward_ad.dual_level():
            primal, tangent = forward_ad.unpack_dual(self.a(forward_ad.make_dual(x, torch.ones_like(x))))
        return primal + tangent


class Jvp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        primal, tangent = torch.func.jvp(lambda t: self.a(t).tanh(), (x,), (torch.ones_like(x),))
        return primal + tangent


@pytest.mark.parametrize("model", [FuncGrad(), FunctionalCall(), DualNumbers(), Jvp()],
                         ids=["grad", "functional_call", "forward_ad", "jvp"])
@pytest.mark.parametrize("execution", EXECUTIONS)
def test_torch_func_inside_forward_counts_as_torch(model: nn.Module, execution: str) -> None:
    x = torch.randn(4, 8)
    assert phases(model, x, execution=execution) == torch_formulas(model, x)
    assert phases(model, x, backward=False, execution=execution)["forward"] == torch_formulas(model, x)["forward"]
    assert all(p.grad is None for p in model.parameters())


class FuncGradCheckpointed(nn.Module):
    """torch.func.grad inside a non-re-entrant checkpoint, whose own saved-tensor hooks torch.func refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = torch.func.grad(lambda t: self.a(t).tanh().sum())
        return torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False)


def test_torch_func_fails_where_the_real_step_fails_and_torch_is_put_back() -> None:
    model, x = FuncGradCheckpointed(), torch.randn(4, 8)
    disable = torch.autograd.graph.disable_saved_tensors_hooks
    with pytest.raises(RuntimeError, match="saved tensor hooks") as real:
        model(x).sum().backward()
    with pytest.raises(ModelRunError, match="saved tensor hooks") as ours:
        phases(model, x)
    assert str(real.value) in str(ours.value)
    assert torch.autograd.graph.disable_saved_tensors_hooks is disable
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # no hook of the run left on the stack
    phases(FuncGrad(), x)
    assert torch.autograd.graph.disable_saved_tensors_hooks is disable
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


# --- losses -------------------------------------------------------------------------------------------------
def _raises(_: Any) -> torch.Tensor:
    raise KeyError("target")


@pytest.mark.parametrize(("loss_fn", "message"), [
    (lambda out: out, r"loss_fn must return a tensor with one element, got \(3, 2\)"),
    (_raises, "KeyError: 'target'"),
    (lambda out: out.sum() @ torch.ones(2), "at operator aten::matmul"),
])
def test_a_failing_loss_fn_is_named_not_the_models_forward(loss_fn: Callable[[Any], Any], message: str) -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(ModelRunError, match=message) as raised:
        FlopCountAnalysis(model, torch.randn(3, 4), backward=True, loss_fn=loss_fn).total()
    assert str(raised.value).startswith("the loss_fn failed")
    assert "Sequential.forward" not in str(raised.value)
    assert raised.value.module is None
