"""The counting conventions (fvcore, macs, flops) and every non-product operator family under each.

Oracles, none of which calls the formula under test:

* hand arithmetic on small shapes, written out as explicit sums;
* composition: an operator's ``flops`` count equals the count of its textbook decomposition run as
  separate element-wise operators and reductions (``softmax = exp, sum, divide``), and for backward
  operators the decomposition is checked numerically against autograd first, so it is the gradient;
* the operator's own weights: the taps of linear resampling and adaptive pooling are the non-zero
  entries of its Jacobian;
* published totals (ResNet-50: fvcore 4,111,512,576, torchvision's 4,089,184,256 multiply-adds).
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from model_helpers import Fn
from modelmeter import FlopCountAnalysis
from modelmeter.engine.trace import TensorMeta
from modelmeter.handles import attention, elementwise, layers, norms, pooling, products, reductions
from modelmeter.handles.classify import is_elementwise, is_free
from modelmeter.handles.conventions import CONVENTIONS, get_convention, register_handle, unregister_handle
from modelmeter.handles.fvcore import FLOP_HANDLES
from opaque_ops import scale_op

PROPERTY = settings(max_examples=25, deadline=None)
FAMILIES = (elementwise, reductions, norms, pooling, layers)


def analysis(model: nn.Module | Callable[..., Any], *inputs: torch.Tensor, convention: str = "flops",
             backward: bool = False) -> FlopCountAnalysis:
    module = model if isinstance(model, nn.Module) else Fn(model)
    args = inputs[0] if len(inputs) == 1 else tuple(inputs)
    result = FlopCountAnalysis(module, args, convention=convention, backward=backward)
    return result.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


def counts(model: nn.Module | Callable[..., Any], *inputs: torch.Tensor, convention: str = "flops"
           ) -> dict[str, int]:
    """``{"forward": n, "backward": n}`` of one run with a backward pass; nothing may be unsupported."""
    result = analysis(model, *inputs, convention=convention, backward=True)
    assert result.unsupported_ops() == Counter()
    phases = result.by_phase()
    return {"forward": phases["forward"], "backward": phases["backward"]}


def forward_flops(fn: Callable[..., Any], *inputs: torch.Tensor) -> int:
    """The ``flops`` count of running ``fn`` forward only (the composition oracle)."""
    result = analysis(fn, *inputs)
    assert result.unsupported_ops() == Counter()
    return result.total()


def _summed(module: nn.Module) -> Fn:
    """The module with its (first) output summed, a fresh module per backward run: a backward analysis
    leaves fake gradients on the parameters, and a second run would count accumulating into them."""

    def run(*args: torch.Tensor) -> torch.Tensor:
        out = module(*args)
        return (out[0] if isinstance(out, tuple) else out).sum()

    return Fn(run)


def grad(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


# --- the conventions --------------------------------------------------------------------------------
def test_unknown_convention_is_refused() -> None:
    with pytest.raises(ValueError, match="fvcore, macs, flops"):
        get_convention("gmacs")
    with pytest.raises(ValueError, match="convention must be one of"):
        register_handle("mylib::op", None, convention="gflops")


def test_every_family_operator_has_an_entry_in_every_convention() -> None:
    for family in FAMILIES:
        names = set(family.handles("flops"))
        for convention in CONVENTIONS:
            table = get_convention(convention).handles
            assert names <= set(table), (family.__name__, convention)


def test_family_tables_name_only_operators_of_the_family() -> None:
    # by_convention keeps the flops table's operators: an fvcore or macs formula for another would be lost
    for family in FAMILIES:
        for extra in ("FVCORE", "MACS"):
            assert set(getattr(family, extra, {})) <= set(family.FLOPS), (family.__name__, extra)


def test_families_do_not_override_products_or_attention() -> None:
    ours = set().union(*(family.handles("flops") for family in FAMILIES))
    theirs = set(products.handles("flops")) | set(attention.handles("flops"))
    assert ours.isdisjoint(theirs)


def test_fvcore_keeps_fvcore_formulas() -> None:
    table = get_convention("fvcore").handles
    for op, handle in FLOP_HANDLES.items():
        assert op in table
        if op not in products.handles("fvcore") and op not in attention.handles("fvcore"):
            assert table[op] is handle, op


def test_macs_counts_no_element_work() -> None:
    table = get_convention("macs").handles
    for family in (elementwise, reductions, norms, pooling):
        assert all(table[op] is None for op in family.handles("macs")), family.__name__
    assert get_convention("macs").elementwise is None
    assert get_convention("fvcore").elementwise is None
    assert get_convention("flops").elementwise is elementwise.elementwise_flops


@pytest.fixture(scope="module")
def resnet50() -> nn.Module:
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet50().eval()


def test_resnet50_published_totals(resnet50: nn.Module) -> None:
    x = torch.randn(1, 3, 224, 224)
    fvcore = analysis(resnet50, x, convention="fvcore")
    assert fvcore.total() == 4_111_512_576
    assert fvcore.unsupported_ops() == Counter()
    macs = analysis(resnet50, x, convention="macs")
    assert macs.total() == 4_089_184_256  # torchvision's "4.09 GFLOPS"
    assert macs.unsupported_ops() == Counter()
    flops = analysis(resnet50, x)
    assert flops.unsupported_ops() == Counter()
    # products twice, the fc bias once; BN eval (x - mean) · rsqrt(var + eps) · w + b: 4 per element + 2 per channel
    bn = sum(4 * o.numel() + 2 * o.shape[1] for o in _bn_outputs(resnet50, x))
    assert flops.by_operator()["native_batch_norm"] == bn
    assert flops.by_operator()["conv"] == 2 * macs.by_operator()["conv"]


def _bn_outputs(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    outputs: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, o: outputs.append(o)) for m in model.modules()
             if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return outputs


# --- element-wise -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("fn", "per_element"), [
    pytest.param(lambda x: x + 1, 1, id="add"),
    pytest.param(lambda x: F.gelu(x), 1, id="gelu"),
    pytest.param(lambda x: torch.sigmoid(x).exp(), 2, id="sigmoid-exp"),
    pytest.param(lambda x: F.relu(x), 1, id="relu"),
    pytest.param(lambda x: F.hardswish(x), 1, id="hardswish-untagged"),
    pytest.param(lambda x: torch.addcmul(x, x, x), 2, id="addcmul"),
    pytest.param(lambda x: torch.lerp(x, x, 0.5), 3, id="lerp"),
    pytest.param(lambda x: (x > 0).float(), 1, id="compare-floats"),
])
def test_elementwise_by_hand(fn: Callable[[torch.Tensor], torch.Tensor], per_element: int) -> None:
    x = torch.randn(2, 3, 4)
    assert analysis(fn, x).total() == per_element * 24
    for convention in ("fvcore", "macs"):
        free = analysis(fn, x, convention=convention)
        assert free.total() == 0
        assert free.unsupported_ops() == Counter()


def test_elementwise_backward_by_hand() -> None:
    # forward gelu (24) and a sum (24); backward: gelu_backward 24 (the sum's backward only expands)
    assert counts(lambda x: F.gelu(x).sum(), grad(2, 3, 4)) == {"forward": 48, "backward": 24}
    # hardswish_backward is not tagged pointwise: element-wise all the same
    assert counts(lambda x: F.hardswish(x).sum(), grad(2, 3, 4)) == {"forward": 48, "backward": 24}
    assert counts(lambda x: F.gelu(x).sum(), grad(2, 3, 4), convention="fvcore") == {"forward": 0, "backward": 0}


def test_integer_work_is_free() -> None:
    assert analysis(lambda i: (i + 1) * 2 > 3, torch.arange(12)).total() == 0


def test_integer_work_is_free_between_floating_point_work_of_the_same_operator() -> None:
    # the operator's kind is decided once per count, whether its result is integer once per call
    def model(x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x + 1, i + 1, x + 2, i + 2

    assert analysis(model, torch.randn(3, 4), torch.arange(5)).by_operator() == Counter({"add": 2 * 12})


def test_dropout_counts_as_its_decomposition() -> None:
    x = torch.randn(4, 5)
    torch.manual_seed(0)
    # the CPU decomposition: bernoulli_ (free), div_ (20), mul (20)
    assert analysis(lambda t: F.dropout(t, 0.5, training=True), x).total() == 2 * 20
    assert analysis(lambda t: F.dropout(t, 0.5, training=False), x).total() == 0
    handle = elementwise.FLOPS["aten::native_dropout"]
    assert handle is not None
    meta = [_meta((4, 5))]
    assert handle([meta[0], 0.5, True], meta) == 40
    assert handle([meta[0], 0.5, False], meta) == 0


@PROPERTY
@given(shape=st.lists(st.integers(1, 5), min_size=0, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]))
def test_elementwise_rule_property(shape: list[int], dtype: torch.dtype) -> None:
    x = torch.ones(shape, dtype=dtype)
    n = x.numel()
    expected = 2 * n if dtype.is_floating_point else 0
    assert analysis(lambda t: t * 2 + 1, x).total() == expected


# --- reductions, cumulative, softmax ------------------------------------------------------------------
@pytest.mark.parametrize(("fn", "expected"), [
    pytest.param(lambda x: x.sum(1), 6, id="sum"),
    pytest.param(lambda x: x.mean(1), 6 + 2, id="mean"),
    pytest.param(lambda x: x.amax(1), 6, id="amax"),
    pytest.param(lambda x: x.max(1).values, 6, id="max-dim"),
    pytest.param(lambda x: torch.maximum(x, x), 6, id="maximum"),
    pytest.param(lambda x: x.var(1), 4 * 6 + 2 * 2, id="var"),
    pytest.param(lambda x: x.std(1), 4 * 6 + 3 * 2, id="std"),
    pytest.param(lambda x: x.norm(dim=1), 2 * 6 + 2, id="norm2"),
    pytest.param(lambda x: torch.linalg.vector_norm(x, 1, dim=1), 2 * 6, id="norm1"),
    pytest.param(lambda x: torch.linalg.vector_norm(x, 3, dim=1), 3 * 6 + 2, id="norm3"),
    pytest.param(lambda x: x.logsumexp(1), 4 * 6 + 2 * 2, id="logsumexp"),
    pytest.param(lambda x: x.cumsum(1), 6, id="cumsum"),
    pytest.param(lambda x: x.cumprod(1), 6, id="cumprod"),
    pytest.param(lambda x: x.logcumsumexp(1), 3 * 6, id="logcumsumexp"),
    pytest.param(lambda x: x.cummax(1).values, 6, id="cummax"),
    pytest.param(lambda x: F.softmax(x, -1), 5 * 6, id="softmax"),
    pytest.param(lambda x: F.log_softmax(x, -1), 5 * 6 + 2, id="log_softmax"),
    pytest.param(lambda x: x.sort(1).values + 0, 6, id="sort-free"),
    pytest.param(lambda x: x.topk(2, 1).values + 0, 4, id="topk-free"),
])
def test_reductions_by_hand(fn: Callable[[torch.Tensor], torch.Tensor], expected: int) -> None:
    x = torch.randn(2, 3)
    assert analysis(fn, x).total() == expected
    for convention in ("fvcore", "macs"):
        assert analysis(fn, x, convention=convention).total() == 0
        assert analysis(fn, x, convention=convention).unsupported_ops() == Counter()


def _softmax(x: torch.Tensor) -> torch.Tensor:
    e = torch.exp(x - x.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    z = x - x.amax(-1, keepdim=True)
    return z - torch.log(torch.exp(z).sum(-1, keepdim=True))


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    m = x.amax(-1, keepdim=True)
    return (m + torch.log(torch.exp(x - m).sum(-1, keepdim=True))).squeeze(-1)


def _var(x: torch.Tensor) -> torch.Tensor:
    return ((x - x.mean(-1, keepdim=True)) ** 2).sum(-1) / (x.shape[-1] - 1)


@PROPERTY
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
def test_softmax_and_reductions_equal_their_decomposition(shape: list[int], dtype: torch.dtype) -> None:
    exact = torch.randn(shape)
    torch.testing.assert_close(_softmax(exact), F.softmax(exact, -1))
    torch.testing.assert_close(_log_softmax(exact), F.log_softmax(exact, -1))
    torch.testing.assert_close(_logsumexp(exact), exact.logsumexp(-1))
    x = exact.to(dtype)
    assert forward_flops(lambda t: F.softmax(t, -1), x) == forward_flops(_softmax, x)
    assert forward_flops(lambda t: F.log_softmax(t, -1), x) == forward_flops(_log_softmax, x)
    assert forward_flops(lambda t: t.var(-1), x) == forward_flops(_var, x)
    assert forward_flops(lambda t: t.std(-1), x) == forward_flops(lambda t: _var(t).sqrt(), x)
    assert forward_flops(lambda t: t.norm(dim=-1), x) == forward_flops(lambda t: (t * t).sum(-1).sqrt(), x)
    assert forward_flops(lambda t: t.logsumexp(-1), x) == forward_flops(_logsumexp, x)
    assert forward_flops(lambda t: t.mean(-1), x) == forward_flops(lambda t: t.sum(-1) / shape[-1], x)


def test_softmax_backward_equals_its_gradient_formula() -> None:
    x, g = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5)
    y = F.softmax(x, -1)
    (expected,) = torch.autograd.grad(y, x, g)

    def softmax_grad(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return y * (g - (g * y).sum(-1, keepdim=True))

    torch.testing.assert_close(softmax_grad(y.detach(), g), expected)
    run = counts(lambda t: (F.softmax(t, -1) * g).sum(), x)
    multiply_and_sum = 15 + 15  # the forward's * g and .sum(); their backward: one multiply
    assert run["forward"] == 5 * 15 + multiply_and_sum
    assert run["backward"] - 15 == forward_flops(softmax_grad, y.detach(), g) == 4 * 15

    def log_softmax_grad(y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return g - torch.exp(y) * g.sum(-1, keepdim=True)

    y = F.log_softmax(x, -1)
    (expected,) = torch.autograd.grad(y, x, g)
    torch.testing.assert_close(log_softmax_grad(y.detach(), g), expected)
    run = counts(lambda t: (F.log_softmax(t, -1) * g).sum(), x)
    assert run["backward"] - 15 == forward_flops(log_softmax_grad, y.detach(), g) == 4 * 15


def test_accumulating_scatters() -> None:
    x, src = torch.zeros(5, 3), torch.randn(4, 3)
    index = torch.tensor([0, 1, 1, 4])
    assert analysis(lambda t, s: t.index_add(0, index, s), x, src).total() == 12
    assert analysis(lambda t, s: t.scatter_add(0, index[:, None].expand(4, 3), s), x, src).total() == 12
    assert analysis(lambda t, s: t.index_put((index,), s, accumulate=True), x, src).total() == 12
    assert analysis(lambda t, s: t.index_put((index,), s), x, src).total() == 0
    assert analysis(lambda t, s: t.index_add(0, index, s), x, src, convention="fvcore").total() == 0


# --- norms ----------------------------------------------------------------------------------------------
def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    d = x - mean
    rstd = torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5)
    return d * rstd * w + b


def _layer_norm_grad(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor,
                     g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The three gradients of a layer norm over the last dimension, from the saved statistics."""
    rows = tuple(range(x.dim() - 1))
    xh = (x - mean) * rstd
    dxh = g * w
    a = dxh.mean(-1, keepdim=True)
    b = (dxh * xh).mean(-1, keepdim=True)
    return (dxh - a - xh * b) * rstd, (g * xh).sum(rows), g.sum(rows)


def test_layer_norm_by_hand() -> None:
    n, rows = 2 * 3 * 4, 2 * 3
    x = torch.randn(2, 3, 4)
    assert analysis(nn.LayerNorm(4), x).total() == 5 * n + 4 * rows + 2 * n == 192
    assert analysis(nn.LayerNorm(4, elementwise_affine=False), x).total() == 5 * n + 4 * rows
    both = counts(_summed(nn.LayerNorm(4)), x.clone().requires_grad_())
    assert both == {"forward": 192 + n, "backward": 13 * n + 2 * rows}
    # frozen input: no input gradient, only x̂ (2n), the weight's (2n) and the bias's (n)
    assert counts(_summed(nn.LayerNorm(4)), x)["backward"] == 5 * n
    assert counts(nn.LayerNorm(4), x, convention="fvcore") == {"forward": 5 * n, "backward": 5 * n}
    assert counts(nn.LayerNorm(4), x, convention="macs") == {"forward": 0, "backward": 0}


@PROPERTY
@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=4))
def test_layer_norm_equals_its_decomposition(shape: list[int]) -> None:
    x, w, b = torch.randn(shape), torch.randn(shape[-1]), torch.randn(shape[-1])
    torch.testing.assert_close(_layer_norm(x, w, b), F.layer_norm(x, shape[-1:], w, b), rtol=1e-4, atol=1e-4)
    assert forward_flops(lambda t: F.layer_norm(t, shape[-1:], w, b), x) == forward_flops(
        lambda t: _layer_norm(t, w, b), x)

    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    g = torch.randn(shape)
    expected = torch.autograd.grad(F.layer_norm(xg, shape[-1:], wg, bg), (xg, wg, bg), g)
    mean = x.mean(-1, keepdim=True)
    rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    for got, want in zip(_layer_norm_grad(x, mean, rstd, w, g), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    oracle = forward_flops(_layer_norm_grad, x, mean, rstd, w, g)
    ln = nn.LayerNorm(shape[-1])
    run = counts(lambda t: (ln(t) * g).sum(), xg)
    assert run["backward"] - g.numel() == oracle  # minus the backward of "* g"


def _batch_norm_train(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dims = [0, *range(2, x.dim())]
    mean = x.mean(dims, keepdim=True)
    d = x - mean
    rstd = torch.rsqrt((d * d).mean(dims, keepdim=True) + 1e-5)
    return d * rstd * w.view(-1, *[1] * (x.dim() - 2)) + b.view(-1, *[1] * (x.dim() - 2))


def _batch_norm_eval(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, w: torch.Tensor,
                     b: torch.Tensor) -> torch.Tensor:
    view = (-1, *[1] * (x.dim() - 2))
    return (x - mean.view(view)) * torch.rsqrt(var + 1e-5).view(view) * w.view(view) + b.view(view)


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (4, 3), (2, 3, 2, 3, 2)], ids=["2d", "1d", "3d"])
def test_batch_norm_equals_its_decomposition(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    c = shape[1]
    bn = nn.BatchNorm1d(c) if len(shape) == 2 else (nn.BatchNorm2d(c) if len(shape) == 4 else nn.BatchNorm3d(c))
    nn.init.normal_(bn.weight)
    nn.init.normal_(bn.bias)
    train = forward_flops(bn.train(), x)
    assert train == forward_flops(lambda t: _batch_norm_train(t, bn.weight.detach(), bn.bias.detach()), x)
    assert train == 7 * x.numel() + 4 * c
    assert bn.running_mean is not None and bn.running_var is not None
    parts = (bn.running_mean, bn.running_var, bn.weight.detach(), bn.bias.detach())
    torch.testing.assert_close(bn.eval()(x), _batch_norm_eval(x, *parts))
    assert forward_flops(bn.eval(), x) == forward_flops(lambda t: _batch_norm_eval(t, *parts), x)
    assert forward_flops(bn.eval(), x) == 4 * x.numel() + 2 * c
    fvcore = counts(copy.deepcopy(bn).train(), x.clone().requires_grad_(), convention="fvcore")
    assert fvcore == {"forward": 5 * x.numel(), "backward": 5 * x.numel()}
    eval_fvcore = counts(copy.deepcopy(bn).eval(), x.clone().requires_grad_(), convention="fvcore")
    assert eval_fvcore == {"forward": 2 * x.numel(), "backward": 2 * x.numel()}


def _batch_norm_grad(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor,
                     g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The three gradients of a training batch norm (statistics per channel) from the saved statistics."""
    dims = (0, 2, 3)
    xh = (x - mean) * rstd
    dxh = g * w
    a = dxh.mean(dims, keepdim=True)
    b = (dxh * xh).mean(dims, keepdim=True)
    return (dxh - a - xh * b) * rstd, (g * xh).sum(dims), g.sum(dims)


def test_batch_norm_backward_equals_its_gradient_formula() -> None:
    x, w, b, g = torch.randn(2, 3, 4, 4), torch.randn(3), torch.randn(3), torch.randn(2, 3, 4, 4)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    expected = torch.autograd.grad(F.batch_norm(xg, None, None, wg, bg, training=True), (xg, wg, bg), g)
    mean = x.mean((0, 2, 3), keepdim=True)
    rstd = torch.rsqrt(x.var((0, 2, 3), unbiased=False, keepdim=True) + 1e-5)
    w4 = w.view(1, 3, 1, 1)
    for got, want in zip(_batch_norm_grad(x, mean, rstd, w4, g), expected, strict=True):
        torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-3, atol=1e-3)
    oracle = forward_flops(_batch_norm_grad, x, mean, rstd, w4, g)
    bn = nn.BatchNorm2d(3)
    assert counts(Fn(lambda t: (bn(t) * g).sum()), x.clone().requires_grad_())["backward"] - g.numel() == oracle


def test_batch_norm_backward_by_hand() -> None:
    n, c = 2 * 3 * 4 * 4, 3
    assert counts(_summed(nn.BatchNorm2d(c)), grad(2, 3, 4, 4))["backward"] == 13 * n + 2 * c
    # eval: dx = g · (w · rstd): rstd 2C, w · rstd C, n multiplies; weight grad 4n; bias grad n
    assert counts(_summed(nn.BatchNorm2d(c).eval()), grad(2, 3, 4, 4))["backward"] == (n + 3 * c) + 4 * n + n


def test_group_and_instance_norm_by_hand() -> None:
    x = torch.randn(2, 6, 5)
    n = x.numel()
    assert forward_flops(nn.GroupNorm(3, 6), x) == 5 * n + 4 * (2 * 3) + 2 * n
    assert counts(_summed(nn.GroupNorm(3, 6)), x.clone().requires_grad_())["backward"] == 13 * n + 2 * (2 * 3)
    assert counts(nn.GroupNorm(3, 6), x, convention="fvcore") == {"forward": 5 * n, "backward": 5 * n}
    # instance norm runs as a batch norm over N·C channels
    assert forward_flops(nn.InstanceNorm1d(6, affine=True), x) == 5 * n + 4 * (2 * 6) + 2 * n
    assert counts(nn.InstanceNorm1d(6, affine=True), x, convention="fvcore")["forward"] == 5 * n


def test_rms_norm_fused_equals_decomposed() -> None:
    x, w = torch.randn(3, 4, 8), torch.randn(8)
    n, rows = x.numel(), 12
    decomposed = forward_flops(lambda t: F.rms_norm(t, (8,), w, 1e-6), x)  # runs as pow, mean, add, rsqrt, mul
    fused = forward_flops(lambda t: torch.ops.aten._fused_rms_norm(t, [8], w, 1e-6)[0], x)
    assert fused == decomposed == 4 * n + 3 * rows


def _rms_norm_grad(x: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xh = x * rstd
    dxh = g * w
    return (dxh - xh * (dxh * xh).mean(-1, keepdim=True)) * rstd, (g * xh).sum((0, 1))


def test_fused_rms_norm_backward_equals_its_gradient_formula() -> None:
    # on CPU autograd runs the fused op's backward as element-wise operators; CUDA runs the fused backward
    x, w, g = torch.randn(3, 4, 8), torch.randn(8), torch.randn(3, 4, 8)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = torch.autograd.grad(F.rms_norm(xg, (8,), wg, 1e-6), (xg, wg), g)
    rstd = torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    for got, want in zip(_rms_norm_grad(x, rstd, w, g), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    handle = norms.FLOPS["aten::_fused_rms_norm_backward"]
    assert handle is not None
    metas = [_meta((3, 4, 8)), _meta((3, 4, 8)), [8], _meta((3, 4, 1)), _meta((8,)), [True, True]]
    assert handle(metas, []) == forward_flops(_rms_norm_grad, x, rstd, w, g) == 9 * 96 + 12


# --- pooling and resampling -------------------------------------------------------------------------------
@pytest.mark.parametrize(("fn", "shape", "fwd", "bwd", "fvcore"), [
    pytest.param(lambda x: F.max_pool1d(x, 2), (1, 2, 8), 8 * 2, 8, 0, id="max1d"),
    pytest.param(lambda x: F.max_pool2d(x, 2), (1, 1, 4, 4), 4 * 4, 4, 0, id="max2d"),
    # padding is not read: the windows of each dimension read 2, 3, 3, 2 elements
    pytest.param(lambda x: F.max_pool2d(x, 3, 1, 1), (1, 1, 4, 4), 10 * 10, 16, 0, id="max2d-padded"),
    pytest.param(lambda x: F.max_pool3d(x, 2), (1, 1, 4, 4, 4), 8 * 8, 8, 0, id="max3d"),
    pytest.param(lambda x: F.avg_pool1d(x, 2), (1, 2, 8), 8 * 3, 8 * 3, 0, id="avg1d"),
    pytest.param(lambda x: F.avg_pool2d(x, 2), (1, 1, 4, 4), 4 * 5, 4 * 5, 0, id="avg2d"),
    pytest.param(lambda x: F.avg_pool3d(x, 2), (1, 1, 4, 4, 4), 8 * 9, 8 * 9, 0, id="avg3d"),
    # 5 -> 2 per dimension: windows [0, 3) and [2, 5), 6 elements per dimension
    pytest.param(lambda x: F.adaptive_avg_pool2d(x, 2), (1, 1, 5, 5), 36 + 4, 36 + 4, 25, id="adaptive-avg2d"),
    pytest.param(lambda x: F.adaptive_avg_pool1d(x, 2), (1, 1, 5), 6 + 2, 6 + 2, 5, id="adaptive-avg1d"),
    pytest.param(lambda x: F.adaptive_avg_pool3d(x, 2), (1, 1, 5, 5, 5), 216 + 8, 216 + 8, 125, id="adaptive-avg3d"),
    pytest.param(lambda x: F.adaptive_max_pool2d(x, 2), (1, 1, 5, 5), 36, 4, 0, id="adaptive-max2d"),
    pytest.param(lambda x: F.adaptive_max_pool3d(x, 2), (1, 1, 5, 5, 5), 216, 8, 0, id="adaptive-max3d"),
    pytest.param(lambda x: F.fractional_max_pool2d(x, 2, output_size=3), (1, 1, 6, 6), 9 * 4, 9, 0, id="fractional"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=2), (1, 1, 2, 2), 0, 16, 16, id="nearest2d"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=2), (1, 1, 2), 0, 4, 4, id="nearest1d"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=2, mode="nearest-exact"), (1, 1, 2, 2, 2), 0, 64, 64,
                 id="nearest-exact3d"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=2, mode="linear"), (1, 1, 3), 6 * 4, 6 * 4, 0, id="linear"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (1, 1, 2, 2), 16 * 8, 16 * 8, 64,
                 id="bilinear"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"), (1, 1, 2, 2), 16 * 32, 16 * 32, 0,
                 id="bicubic"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"), (1, 1, 2, 2, 2), 64 * 16, 64 * 16, 0,
                 id="trilinear"),
    pytest.param(lambda x: F.interpolate(x, size=2, mode="area"), (1, 1, 5, 5), 36 + 4, 36 + 4, 25, id="area"),
    # 8 -> 4, scale 2, support 2: taps per output 3, 4, 4, 3 per dimension (14); forward, separably: the width
    # on 8 rows, then the height on 4 columns (8 · 14 + 4 · 14 = 168); backward: every 2-D tap, 14 · 14 = 196
    pytest.param(lambda x: F.interpolate(x, size=4, mode="bilinear", antialias=True), (1, 1, 8, 8),
                 2 * 168, 2 * 196, 0, id="bilinear-aa"),
])
def test_pooling_and_resampling_by_hand(fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...],
                                        fwd: int, bwd: int, fvcore: int) -> None:
    x = torch.randn(shape, requires_grad=True)
    assert counts(fn, x) == {"forward": fwd, "backward": bwd}
    assert counts(fn, x, convention="fvcore") == {"forward": fvcore, "backward": fvcore}
    assert counts(fn, x, convention="macs") == {"forward": 0, "backward": 0}


@PROPERTY
@given(batch=st.integers(1, 2), channels=st.integers(1, 3), height=st.integers(1, 4), width=st.integers(1, 4),
       kernel=st.integers(1, 3))
def test_pooling_equals_its_decomposition(batch: int, channels: int, height: int, width: int, kernel: int) -> None:
    # non-overlapping windows are a reshape: max pooling an amax, average pooling a mean over each window
    x = torch.randn(batch, channels, height * kernel, width * kernel)

    def windows(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, channels, height, kernel, width, kernel)

    torch.testing.assert_close(F.avg_pool2d(x, kernel), windows(x).mean((3, 5)))
    assert forward_flops(lambda t: F.max_pool2d(t, kernel), x) == forward_flops(lambda t: windows(t).amax((3, 5)), x)
    assert forward_flops(lambda t: F.avg_pool2d(t, kernel), x) == forward_flops(lambda t: windows(t).mean((3, 5)), x)
    assert forward_flops(lambda t: F.adaptive_avg_pool2d(t, (height, width)), x) == forward_flops(
        lambda t: windows(t).mean((3, 5)), x)


def _nonzero_weights(fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...]) -> int:
    """Non-zero entries of a linear operator's matrix (its taps), from its Jacobian."""
    jacobian = torch.autograd.functional.jacobian(fn, torch.zeros(shape, dtype=torch.float64))
    return int((jacobian != 0).sum())


@PROPERTY
@given(size_in=st.lists(st.integers(1, 9), min_size=2, max_size=2),
       size_out=st.lists(st.integers(1, 9), min_size=2, max_size=2))
def test_adaptive_windows_are_the_operator_taps(size_in: list[int], size_out: list[int]) -> None:
    shape = (1, 1, *size_in)
    size = (size_out[0], size_out[1])
    taps = _nonzero_weights(lambda t: F.adaptive_avg_pool2d(t, size), shape)
    out = size_out[0] * size_out[1]
    assert forward_flops(lambda t: F.adaptive_avg_pool2d(t, size), torch.randn(shape)) == taps + out
    assert forward_flops(lambda t: F.adaptive_max_pool2d(t, size), torch.randn(shape)) == taps
    if size_out == [1, 1]:  # torch runs a mean
        assert forward_flops(lambda t: t.mean((-2, -1), keepdim=True), torch.randn(shape)) == taps + out


@PROPERTY
@given(size_in=st.integers(2, 16), size_out=st.integers(1, 16), mode=st.sampled_from(["bilinear", "bicubic"]))
def test_antialias_taps_are_the_filter_taps(size_in: int, size_out: int, mode: str) -> None:
    shape = (1, 1, size_in, size_in)

    def resize(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, size=(size_out, size_out), mode=mode, antialias=True)

    # the kernel multiplies by every weight in the filter's support, some of which can be exactly 0 (at
    # scale 1 the cubic kernel is 0 at every other integer offset): the non-zero weights are a lower bound,
    # the support's size torch allocates per output (ceil(support) · 2 + 1) an upper bound. The forward resizes
    # one dimension at a time: the width of every input row, then the height of every output column, each with
    # a one-dimensional filter (whose taps a row's resize shows); a kept size is not resized. The backward
    # scatters every output gradient to each 2-D tap.
    def rows(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, size=(1, size_out), mode=mode, antialias=True)

    taps_2d, taps_1d = _nonzero_weights(resize, shape), _nonzero_weights(rows, (1, 1, 1, size_in))
    counted = counts(resize, grad(*shape))
    interp = 2 if mode == "bilinear" else 4
    support = interp / 2 * max(size_in / size_out, 1.0)
    widest = math.ceil(support) * 2 + 1
    passes = 0 if size_in == size_out else size_in + size_out
    assert 2 * passes * taps_1d <= counted["forward"] <= 2 * passes * widest * size_out
    assert 2 * taps_2d <= counted["backward"] <= 2 * widest ** 2 * size_out ** 2


@pytest.mark.parametrize(("mode", "taps"), [("bilinear", 4), ("bicubic", 16), ("nearest", 0)])
def test_grid_sample_by_hand(mode: str, taps: int) -> None:
    x, grid_ = grad(1, 2, 4, 4), (torch.rand(1, 3, 3, 2) * 2 - 1).requires_grad_()
    out = 2 * 3 * 3

    def sample(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return F.grid_sample(t, g, mode=mode, align_corners=False)

    # backward: 2T per output-gradient element for the input's gradient and 2T for the grid's (nearest: 1, 0)
    backward = 2 * 2 * taps * out if taps else out
    assert counts(sample, x, grid_) == {"forward": 2 * taps * out, "backward": backward}
    assert counts(sample, x, grid_, convention="fvcore") == {"forward": 4 * out, "backward": 4 * out}
    assert counts(sample, x, grid_, convention="macs") == {"forward": 0, "backward": 0}


def test_antialias_uses_the_scale_factor() -> None:
    # 7 -> 3 with scale_factor 0.5: torch filters with scale 2 (not 7 / 3); bilinear weights at scale 2
    # are never exactly 0, so the Jacobian's non-zero entries are the taps: a row's resize shows one dimension's
    # (the forward's width pass on 7 rows, its height pass on 3 columns), the whole resize's the 2-D taps (backward)
    def resize(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, scale_factor=0.5, mode="bilinear", antialias=True)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, scale_factor=(1.0, 0.5), mode="bilinear", antialias=True)

    taps_2d, taps_1d = _nonzero_weights(resize, (1, 1, 7, 7)), _nonzero_weights(rows, (1, 1, 1, 7))
    assert counts(resize, grad(1, 1, 7, 7)) == {"forward": 2 * (7 + 3) * taps_1d, "backward": 2 * taps_2d}


# --- embeddings, recurrent layers, losses --------------------------------------------------------------------
def test_embedding() -> None:
    ids = torch.tensor([[1, 2, 3], [3, 4, 5]])
    # each gradient row added into the weight's gradient
    assert counts(nn.Embedding(10, 4), ids) == {"forward": 0, "backward": 2 * 3 * 4}
    assert counts(nn.Embedding(10, 4), ids, convention="fvcore") == {"forward": 0, "backward": 0}
    flat, offsets = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2])
    # 5 gathered rows summed (5 · 4), divided per output element (2 · 4); backward: add and divide per row
    assert counts(nn.EmbeddingBag(10, 4, mode="mean"), flat, offsets) == {"forward": 5 * 4 + 2 * 4, "backward": 40}
    assert counts(nn.EmbeddingBag(10, 4, mode="sum"), flat, offsets) == {"forward": 20, "backward": 20}


def _lstm_by_cells(lstm: nn.LSTM, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    cell = nn.LSTMCell(lstm.input_size, lstm.hidden_size)
    cell.load_state_dict({"weight_ih": lstm.weight_ih_l0, "weight_hh": lstm.weight_hh_l0,
                          "bias_ih": lstm.bias_ih_l0, "bias_hh": lstm.bias_hh_l0})
    outputs = []
    for step in x:
        h, c = cell(step, (h, c))
        outputs.append(h)
    return torch.stack(outputs)


def test_fused_lstm_equals_its_cells() -> None:
    steps, batch, in_size, hidden = 5, 2, 3, 4
    lstm = nn.LSTM(in_size, hidden)
    x, h, c = torch.randn(steps, batch, in_size), torch.zeros(1, batch, hidden), torch.zeros(1, batch, hidden)
    torch.testing.assert_close(lstm(x, (h, c))[0], _lstm_by_cells(lstm, x, h[0], c[0]))
    macs = steps * batch * 4 * hidden * (in_size + hidden)
    for convention, expected in (("macs", macs), ("fvcore", macs), ("flops", 2 * macs + steps * batch * 21 * hidden)):
        fused = analysis(lambda t: lstm(t)[0], x, convention=convention)
        cells = analysis(lambda t: _lstm_by_cells(lstm, t, h[0], c[0]), x, convention=convention)
        assert fused.unsupported_ops() == cells.unsupported_ops() == Counter()
        assert fused.total() == cells.total() == expected, convention
    run = counts(_summed(copy.deepcopy(lstm)), x.clone().requires_grad_(), convention="macs")
    assert run == {"forward": macs, "backward": 2 * macs}
    flops = counts(_summed(copy.deepcopy(lstm)), x.clone().requires_grad_())
    assert flops["backward"] == 2 * 2 * macs + steps * batch * (13 * hidden + 2 * 4 * hidden)


def test_gru_and_rnn_have_no_unsupported_operators() -> None:
    for layer in (nn.GRU(3, 4, num_layers=2, bidirectional=True), nn.RNN(3, 4), nn.LSTM(3, 4, num_layers=2,
                                                                                         bidirectional=True)):
        for convention in CONVENTIONS:
            run = counts(lambda t, m=layer: m(t)[0].sum(), grad(5, 2, 3), convention=convention)
            assert run["forward"] > 0 and run["backward"] > 0


@pytest.mark.parametrize(("fn", "fwd", "bwd"), [
    # log_softmax 5·6 + 2; nll: 2 negates + 2 adds + a divide; backward: nll 2 · (1 + divide), log_softmax 4 · 6
    pytest.param(lambda x, y: F.cross_entropy(x, torch.tensor([0, 2])), 30 + 2 + 5, 4 + 24, id="cross-entropy"),
    pytest.param(lambda x, y: F.mse_loss(x, y), 2 * 6 + 6 + 1, 4 * 6, id="mse"),
    pytest.param(lambda x, y: F.mse_loss(x, y, reduction="sum"), 2 * 6 + 6, 3 * 6, id="mse-sum"),
    pytest.param(lambda x, y: F.mse_loss(x, y, reduction="none").sum(), 2 * 6 + 6, 3 * 6, id="mse-none"),
    # backward as element-wise operators: (sigmoid(x) - y) · g
    pytest.param(lambda x, y: F.binary_cross_entropy_with_logits(x, y, reduction="sum"), 7 * 6 + 6,
                 3 * 6, id="bce-logits-sum"),
    pytest.param(lambda x, y: F.smooth_l1_loss(x, y), 5 * 6 + 7, 6 * 6, id="smooth-l1"),
    pytest.param(lambda x, y: F.huber_loss(x, y), 5 * 6 + 7, 6 * 6, id="huber"),
    pytest.param(lambda x, y: F.binary_cross_entropy(torch.sigmoid(x), torch.sigmoid(y)), 6 + 8 * 6 + 7 + 6,
                 7 * 6 + 6, id="bce"),
])
def test_losses_by_hand(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], fwd: int, bwd: int) -> None:
    x, y = grad(2, 3), torch.randn(2, 3)
    assert counts(fn, x, y) == {"forward": fwd, "backward": bwd}
    assert counts(fn, x, y, convention="macs") == {"forward": 0, "backward": 0}


def test_mse_equals_its_decomposition() -> None:
    x, y, g = torch.randn(4, 5), torch.randn(4, 5), torch.tensor(0.7)
    assert forward_flops(lambda a, b: F.mse_loss(a, b), x, y) == forward_flops(lambda a, b: ((a - b) ** 2).mean(), x, y)
    xg = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(F.mse_loss(xg, y), xg, g)

    def mse_grad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return 2 * (a - b) * g / a.numel()

    torch.testing.assert_close(mse_grad(x, y), expected)
    assert counts(lambda a: F.mse_loss(a, y), xg)["backward"] == forward_flops(mse_grad, x, y)


# --- coverage: a small zoo of every family, forward and backward, in every convention ---------------------------
ZOO: list[tuple[str, Callable[[], nn.Module], tuple[int, ...]]] = [
    ("conv-bn-pool", lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                                           nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Softmax(-1)),
     (2, 3, 10, 10)),
    ("video", lambda: nn.Sequential(nn.Conv3d(3, 4, 3), nn.GroupNorm(2, 4), nn.GELU(), nn.MaxPool3d(2),
                                    nn.AdaptiveMaxPool3d(1)), (1, 3, 6, 6, 6)),
    ("mobile", lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.Hardswish(), nn.Hardsigmoid(), nn.SiLU(), nn.ReLU6(),
                                     nn.Mish(), nn.ELU(), nn.LeakyReLU(), nn.Softplus(), nn.PReLU(), nn.Dropout(0.1),
                                     nn.Upsample(scale_factor=2, mode="bilinear"), nn.Upsample(scale_factor=2),
                                     nn.InstanceNorm2d(4), nn.LayerNorm(16)), (1, 3, 4, 4)),
    ("sequence", lambda: nn.Sequential(nn.LayerNorm(6), nn.LSTM(6, 5, batch_first=True)), (2, 4, 6)),
]


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize(("name", "make", "shape"), ZOO, ids=[z[0] for z in ZOO])
def test_zoo_has_no_unsupported_operators(name: str, make: Callable[[], nn.Module], shape: tuple[int, ...],
                                          convention: str) -> None:
    model = make()

    def run(x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        return (out[0] if isinstance(out, tuple) else out).float().sum()

    result = counts(run, grad(*shape), convention=convention)
    assert result["forward"] > 0 and result["backward"] > 0


# --- register_handle ---------------------------------------------------------------------------------------
scale = scale_op("modelmeter_test")


@pytest.fixture
def registry() -> Iterator[None]:
    yield
    for convention in (None, *CONVENTIONS):
        unregister_handle("modelmeter_test::scale", convention=convention)


def _scale_flops(inputs: list[Any], outputs: list[Any]) -> int:
    return 3 * outputs[0].numel()


def test_custom_op_is_reported_then_counted_per_convention(registry: None) -> None:
    x = torch.randn(2, 5)
    model = Fn(lambda t: scale(t, 2.0))
    for convention in CONVENTIONS:
        assert analysis(model, x, convention=convention).unsupported_ops() == Counter({"modelmeter_test::scale": 1})
    register_handle("modelmeter_test::scale", _scale_flops, convention="flops")
    flops = analysis(model, x)
    assert flops.unsupported_ops() == Counter()
    assert flops.by_operator() == Counter({"scale": 30})
    assert analysis(model, x, convention="fvcore").unsupported_ops() == Counter({"modelmeter_test::scale": 1})
    register_handle("modelmeter_test::scale", None)  # known and free everywhere else
    assert analysis(model, x, convention="fvcore").unsupported_ops() == Counter()
    assert analysis(model, x, convention="fvcore").total() == 0
    assert analysis(model, x).total() == 30  # the per-convention formula wins over the one for all
    unregister_handle("modelmeter_test::scale", convention="flops")
    assert analysis(model, x).total() == 0
    unregister_handle("modelmeter_test::scale")
    assert analysis(model, x).unsupported_ops() == Counter({"modelmeter_test::scale": 1})


def test_register_handle_needs_a_namespace() -> None:
    with pytest.raises(ValueError, match="namespace::name"):
        register_handle("scale", _scale_flops)


# --- helpers for calling handles directly ---------------------------------------------------------------------
def _meta(shape: tuple[int, ...], dtype: str = "float32") -> Any:
    return TensorMeta(shape, dtype, "cpu")


def test_classification_of_family_operators() -> None:
    for op in ("aten::hardswish_backward", "aten::glu_backward", "aten::floor_divide"):
        assert is_elementwise(op), op
    for op in ("aten::select_backward", "aten::slice_backward", "aten::transpose_", "aten::as_strided_",
               "aten::unsafe_split", "aten::pixel_shuffle"):
        assert is_free(op), op
    assert not is_elementwise("aten::where") and is_free("aten::where")
