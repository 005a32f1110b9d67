"""Matrix products and convolutions in every convention, forward and backward (handles/products.py).

Oracles, none of which calls the formula under test:

* hand arithmetic on small shapes, written out as explicit products;
* ``torch.utils.flop_counter.FlopCounterMode`` on the real forward and backward pass: 2 flops per
  multiply-add and no bias, so its total / 2 is our ``macs`` total (its grouped-convolution weight
  gradient is ``groups`` times too high, so there it is the oracle for ``groups == 1`` only);
* properties: a layer's backward pass is exactly 2x its forward multiply-adds when input and weight need
  gradients and 1x when only the weight does; ``flops`` is 2x ``macs`` plus the documented terms.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from model_helpers import Fn, conv_modules
from modelmeter import FlopCountAnalysis, TensorMeta
from modelmeter.engine.metadata import describe, flat_outputs, place_arguments
from modelmeter.handles import fvcore, products

PROPERTY = settings(max_examples=25, deadline=None)
CONVENTIONS = ("fvcore", "macs", "flops")


def measure(model: nn.Module, inputs: Any, convention: str = "macs", backward: bool = False) -> FlopCountAnalysis:
    """An analysis whose product operators use ``products.handles(convention)``."""
    analysis = FlopCountAnalysis(model, inputs, backward=backward)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    return analysis.set_op_handle(**products.handles(convention))


def torch_macs(model: nn.Module, inputs: tuple[torch.Tensor, ...], backward: bool = False) -> int:
    """Multiply-adds by FlopCounterMode (flops / 2) of the forward, and the backward of ``sum(output)``."""
    with FlopCounterMode(display=False) as counter:
        out = model(*inputs)
        if backward:
            out.sum().backward()
    total = counter.get_total_flops()
    assert total % 2 == 0
    return total // 2


def call_handle(op: str, fn: Any, *args: Any, convention: str = "macs", **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` for real and apply ``op``'s handle to the call's metadata."""
    out = fn(*args, **kwargs)
    handle = products.handles(convention)[op]
    assert callable(handle)
    return handle(place_arguments(fn._schema, args, kwargs), flat_outputs(out))


# --- linear ---------------------------------------------------------------------------------------
# Linear(10, 20) on 4 rows: 4 * 10 * 20 = 800 multiply-adds; bias: 4 * 20 = 80 adds.
@pytest.mark.parametrize(("convention", "bias", "forward", "backward_both", "backward_weight"), [
    pytest.param("macs", True, 800, 1600, 800, id="macs"),
    pytest.param("fvcore", True, 800, 1600, 800, id="fvcore"),
    pytest.param("flops", True, 2 * 800 + 80, 2 * 1600, 2 * 800, id="flops"),
    pytest.param("flops", False, 2 * 800, 2 * 1600, 2 * 800, id="flops-no-bias"),
])
def test_linear_by_hand(convention: str, bias: bool, forward: int, backward_both: int, backward_weight: int) -> None:
    layer = nn.Linear(10, 20, bias=bias)
    both = measure(layer, torch.randn(4, 10, requires_grad=True), convention, backward=True)
    assert both.by_phase() == {"forward": forward, "backward": backward_both}
    # backward: grad_input (4, 20) @ (20, 10) and grad_weight (20, 4) @ (4, 10), both plain mm
    assert both.by_phase_and_operator()["backward"] == Counter({"mm": backward_both})
    weight_only = measure(layer, torch.randn(4, 10), convention, backward=True)
    assert weight_only.by_phase() == {"forward": forward, "backward": backward_weight}


# --- bilinear ------------------------------------------------------------------------------------
# Bilinear(4, 5, 3) on rows (2, 6): 12 rows x 3 outputs x 4 x 5 = 720 multiply-adds (a linear layer over the outer
# product x1 (x) x2); flops: 2 x 720, the outer product's 12 x 4 x 5 = 240 multiplies and 12 x 3 = 36 bias adds.
# Backward: each gradient (x1's, x2's, the weight's) is a _trilinear of the same 720 terms, the bias's a sum.
@pytest.mark.parametrize(("convention", "forward", "per_gradient"), [
    pytest.param("macs", 720, 720, id="macs"),
    pytest.param("fvcore", 720, 720, id="fvcore"),
    pytest.param("flops", 2 * 720 + 240 + 36, 2 * 720, id="flops"),
])
def test_bilinear_by_hand(convention: str, forward: int, per_gradient: int) -> None:
    layer = nn.Bilinear(4, 5, 3)
    x1, x2 = torch.randn(2, 6, 4, requires_grad=True), torch.randn(2, 6, 5, requires_grad=True)
    analysis = measure(layer, (x1, x2), convention, backward=True)
    assert analysis.by_phase_and_operator()["forward"] == Counter({"bilinear": forward})
    assert analysis.by_phase_and_operator()["backward"]["_trilinear"] == 3 * per_gradient
    assert analysis.unsupported_ops() == Counter()


@given(n=st.integers(0, 3), a=st.integers(1, 4), b=st.integers(1, 4), c=st.integers(1, 4))
@settings(max_examples=25, deadline=None)
def test_trilinear_counts_the_terms_of_its_sum(n: int, a: int, b: int, c: int) -> None:
    # torch._trilinear as bilinear calls it: (n, a) x (c, a, b) x (n, b) -> (n, c); brute force: the terms of the
    # sum are the elements of the operands' broadcast (n, c, a, b), counted by expanding them
    i1, w, i2 = torch.randn(n, a), torch.randn(c, a, b), torch.randn(n, b)
    out = torch._trilinear(i1, w, i2, [1, 3], [0], [1, 2], [2, 3])
    terms = torch.broadcast_shapes((n, 1, a, 1), (1, c, a, b), (n, 1, 1, b)).numel()
    assert torch.allclose(out, torch.einsum("na,cab,nb->nc", i1, w, i2), atol=1e-5)
    assert call_handle("aten::_trilinear", torch.ops.aten._trilinear.default, i1, w, i2, [1, 3], [0], [1, 2],
                       [2, 3]) == terms


def test_frozen_linear_has_no_backward_product() -> None:
    layer = nn.Linear(10, 20).requires_grad_(False)
    analysis = measure(nn.Sequential(layer, nn.Linear(20, 3)), torch.randn(4, 10), backward=True)
    # only the trainable second layer's weight gradient: 3 * 4 * 20
    assert analysis.by_phase() == {"forward": 4 * 10 * 20 + 4 * 20 * 3, "backward": 3 * 4 * 20}


# --- matrix products --------------------------------------------------------------------------------
@pytest.mark.parametrize(("fn", "shapes", "key", "macs", "extra"), [
    pytest.param(torch.mm, [(3, 4), (4, 5)], "mm", 3 * 4 * 5, 0, id="mm"),
    pytest.param(torch.bmm, [(2, 3, 4), (2, 4, 5)], "bmm", 2 * 3 * 4 * 5, 0, id="bmm"),
    pytest.param(torch.matmul, [(2, 1, 3, 4), (5, 4, 6)], "matmul", 2 * 5 * 3 * 4 * 6, 0, id="matmul-broadcast"),
    pytest.param(torch.mv, [(3, 4), (4,)], "mv", 3 * 4, 0, id="mv"),
    pytest.param(torch.dot, [(7,), (7,)], "dot", 7, 0, id="dot"),
    # beta = alpha = 1: the bias add, 1 per output element
    pytest.param(torch.addmm, [(5,), (3, 4), (4, 5)], "addmm", 3 * 4 * 5, 3 * 5, id="addmm"),
    # beta 0.5: add and multiply; alpha 2: multiply
    pytest.param(lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2), [(3, 5), (3, 4), (4, 5)], "addmm",
                 3 * 4 * 5, 3 * (3 * 5), id="addmm-beta-alpha"),
    # beta 0: no add; alpha 0.125 (attention's scale): 1 multiply per output element
    pytest.param(lambda c, a, b: torch.baddbmm(c, a, b, beta=0, alpha=0.125), [(2, 3, 5), (2, 3, 4), (2, 4, 5)],
                 "baddbmm", 2 * 3 * 4 * 5, 2 * 3 * 5, id="baddbmm-scale"),
    pytest.param(torch.addbmm, [(3, 5), (2, 3, 4), (2, 4, 5)], "addbmm", 2 * 3 * 4 * 5, 3 * 5, id="addbmm"),
    pytest.param(torch.addmv, [(3,), (3, 4), (4,)], "addmv", 3 * 4, 3, id="addmv"),
])
def test_matrix_products_by_hand(fn: Callable[..., torch.Tensor], shapes: list[tuple[int, ...]], key: str,
                                 macs: int, extra: int) -> None:
    inputs = tuple(torch.randn(s) for s in shapes)
    for convention, expected in (("fvcore", macs), ("macs", macs), ("flops", 2 * macs + extra)):
        assert measure(Fn(fn), inputs, convention).by_operator() == Counter({key: expected})


def test_products_dispatched_directly() -> None:
    """The aten operators themselves, as the backward pass calls them."""
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    assert call_handle("aten::mm", torch.ops.aten.mm.default, a, b) == 3 * 4 * 5
    assert call_handle("aten::addmm", torch.ops.aten.addmm.default, torch.randn(5), a, b, convention="flops") == \
        2 * 3 * 4 * 5 + 3 * 5
    x, y = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    assert call_handle("aten::bmm", torch.ops.aten.bmm.default, x, y, convention="flops") == 2 * (2 * 3 * 4 * 5)


@st.composite
def product_cases(draw: st.DrawFn) -> tuple[Callable[..., torch.Tensor], list[tuple[int, ...]]]:
    b, m, k, n = (draw(st.integers(1, 4)) for _ in range(4))
    return draw(st.sampled_from([
        (torch.mm, [(m, k), (k, n)]),
        (torch.bmm, [(b, m, k), (b, k, n)]),
        (torch.matmul, [(b, m, k), (k, n)]),
        (torch.matmul, [(m, k), (b, k, n)]),
        (lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2), [(n,), (m, k), (k, n)]),
        (torch.baddbmm, [(b, m, n), (b, m, k), (b, k, n)]),
        (lambda x, y: torch.einsum("bik,bkj->bij", x, y), [(b, m, k), (b, k, n)]),
        (lambda x, y: F.linear(x, y), [(b, m, k), (n, k)]),
    ]))


@PROPERTY
@given(product_cases(), st.booleans())
def test_products_forward_and_backward_match_flop_counter_mode(
        case: tuple[Callable[..., torch.Tensor], list[tuple[int, ...]]], grad_first: bool) -> None:
    fn, shapes = case
    inputs = tuple(torch.randn(s, requires_grad=grad_first or i > 0) for i, s in enumerate(shapes))
    analysis = measure(Fn(fn), inputs, backward=True)
    assert analysis.total() == torch_macs(Fn(fn), inputs, backward=True)
    flops = measure(Fn(fn), inputs, "flops", backward=True)
    assert flops.by_phase()["backward"] == 2 * analysis.by_phase()["backward"]  # mm/bmm: no extra terms


def test_einsum_backward_is_counted() -> None:
    x, y = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 4, 5, requires_grad=True)
    model = Fn(lambda a, b: torch.einsum("bij,bjk->bik", a, b))
    analysis = measure(model, (x, y), backward=True)
    # forward 120; backward dA = dC B^T and dB = A^T dC, 120 each
    assert analysis.by_phase() == {"forward": 120, "backward": 240}
    assert analysis.by_phase_and_operator()["forward"] == Counter({"einsum": 120})


# --- grouped and fp8 products -------------------------------------------------------------------
def test_grouped_mm_flops_with_bias() -> None:
    a, b = torch.randn(24, 16, dtype=torch.bfloat16), torch.randn(3, 8, 16, dtype=torch.bfloat16).mT
    offs = torch.tensor([8, 16, 24], dtype=torch.int32)
    model = Fn(lambda x, w, o: torch._grouped_mm(x, w, offs=o))
    assert measure(model, (a, b, offs), "flops").total() == 2 * (24 * 16 * 8)
    meta = [describe(a), describe(b), describe(offs), TensorMeta((3, 8), "bfloat16", "cpu")]
    handle = products.handles("flops")["aten::_grouped_mm"]
    assert callable(handle)
    assert handle(meta, [TensorMeta((24, 8), "bfloat16", "cpu")]) == 2 * (24 * 16 * 8) + 24 * 8


@pytest.mark.parametrize("bias", [False, True])
def test_scaled_mm_fp8(bias: bool) -> None:
    a = torch.randn(4, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn)
    extra = {"bias": torch.randn(16, dtype=torch.bfloat16)} if bias else {}
    model = Fn(lambda x, y: torch._scaled_mm(x, y.t(), torch.tensor(1.0), torch.tensor(1.0),
                                            out_dtype=torch.bfloat16, **extra))
    macs = 4 * 32 * 16
    assert measure(model, (a, b)).by_operator() == Counter({"_scaled_mm": macs})
    # the dequantising scale, and the bias add when there is one: 1 per output element each
    assert measure(model, (a, b), "flops").total() == 2 * macs + (1 + bias) * 4 * 16
    assert torch_macs(model, (a, b)) == macs


# --- convolution --------------------------------------------------------------------------------
# Conv2d(3, 4, 3) on (2, 3, 8, 8): out (2, 4, 6, 6); 2 * (4 * 3 * 3 * 3) * 36 = 7776 multiply-adds.
CONV_MACS = 2 * (4 * 3 * 3 * 3) * 36
CONV_OUT = 2 * 4 * 6 * 6


@pytest.mark.parametrize(("input_grad", "weight_grad", "bias", "backward_macs", "bias_adds"), [
    pytest.param(True, True, True, 2 * CONV_MACS, CONV_OUT, id="all"),
    pytest.param(False, True, True, CONV_MACS, CONV_OUT, id="weight-and-bias"),
    pytest.param(False, True, False, CONV_MACS, 0, id="weight-only"),
    pytest.param(True, False, False, CONV_MACS, 0, id="input-only-frozen-weight"),
])
def test_conv_backward_by_hand(input_grad: bool, weight_grad: bool, bias: bool, backward_macs: int,
                               bias_adds: int) -> None:
    conv = nn.Conv2d(3, 4, 3, bias=bias).requires_grad_(weight_grad)
    x = torch.randn(2, 3, 8, 8, requires_grad=input_grad)
    model = nn.Sequential(conv, nn.Flatten(), nn.Linear(4 * 36, 1, bias=False)) if not weight_grad else conv
    macs = measure(model, x, backward=True).by_phase_and_operator()
    assert macs["forward"]["conv"] == CONV_MACS
    assert macs["backward"]["convolution_backward"] == backward_macs
    flops = measure(model, x, "flops", backward=True).by_phase_and_operator()
    assert flops["forward"]["conv"] == 2 * CONV_MACS + bias * CONV_OUT
    assert flops["backward"]["convolution_backward"] == 2 * backward_macs + bias_adds


def test_convolution_backward_output_mask_directly() -> None:
    """Every output_mask of ``aten::convolution_backward``: input and weight gradients cost a forward each."""
    x, w, grad = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(2, 4, 6, 6)
    for mask in ([True, True, True], [True, False, False], [False, True, False], [False, False, True]):
        args = (grad, x, w, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, mask)
        fn = torch.ops.aten.convolution_backward.default
        macs = (mask[0] + mask[1]) * CONV_MACS
        assert call_handle("aten::convolution_backward", fn, *args) == macs
        assert call_handle("aten::convolution_backward", fn, *args, convention="flops") == \
            2 * macs + mask[2] * CONV_OUT


def test_grouped_conv_backward_by_hand() -> None:
    """Conv2d(3, 6, 3, groups=3): the weight gradient is per group, like the forward (torch counts it x3)."""
    conv = nn.Conv2d(3, 6, 3, groups=3, bias=False)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    forward = 2 * (6 * 1 * 3 * 3) * 36
    assert measure(conv, x, backward=True).by_phase() == {"forward": forward, "backward": 2 * forward}
    # FlopCounterMode: grad_input 3888 + grad_weight 3 * 3888
    assert torch_macs(conv, (x,), backward=True) == forward + forward + 3 * forward


@pytest.mark.parametrize(("make", "shape", "forward"), [
    # transposed: prod(weight) multiply-adds per *input* position, not per output position
    pytest.param(lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), (2, 3, 8, 8), 2 * (3 * 4 * 3 * 3) * 64, id="t2d"),
    pytest.param(lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, groups=2, output_padding=1), (2, 4, 5),
                 2 * (4 * 3 * 3) * 5, id="t1d-groups"),
])
def test_transposed_conv_forward_and_backward_by_hand(make: Callable[[], nn.Module], shape: tuple[int, ...],
                                                      forward: int) -> None:
    module = make()
    x = torch.randn(shape, requires_grad=True)
    out = module(x).numel()
    macs = measure(module, x, backward=True)
    assert macs.by_phase() == {"forward": forward, "backward": 2 * forward}
    flops = measure(module, x, "flops", backward=True)
    assert flops.by_phase() == {"forward": 2 * forward + out, "backward": 4 * forward + out}


@PROPERTY
@given(conv_modules(), st.booleans())
def test_conv_backward_is_two_or_one_forward(case: tuple[nn.Module, tuple[int, ...]], input_grad: bool) -> None:
    module, shape = case
    groups = module.groups
    x = torch.randn(shape, requires_grad=input_grad)
    phases = measure(module, x, backward=True).by_phase()
    assert phases["backward"] == (2 if input_grad else 1) * phases["forward"]
    if groups == 1:
        assert phases["forward"] + phases["backward"] == torch_macs(module, (x,), backward=True)
    else:
        assert phases["forward"] == torch_macs(module, (x,))
    out = module(x)
    bias = module.bias is not None
    flops = measure(module, x, "flops", backward=True).by_phase()
    assert flops == {"forward": 2 * phases["forward"] + bias * out.numel(),
                     "backward": 2 * phases["backward"] + bias * out.numel()}


@PROPERTY
@given(st.lists(st.integers(1, 3), max_size=2), st.integers(1, 6), st.integers(1, 6), st.booleans(), st.booleans())
def test_linear_backward_is_two_or_one_forward(lead: list[int], cin: int, cout: int, bias: bool,
                                               input_grad: bool) -> None:
    layer = nn.Linear(cin, cout, bias=bias)
    x = torch.randn(*lead, cin, requires_grad=input_grad)
    phases = measure(layer, x, backward=True).by_phase()
    assert phases["forward"] == x.numel() * cout
    assert phases["backward"] == (2 if input_grad else 1) * phases["forward"]
    if lead:  # FlopCounterMode does not count the mv/dot of a 1-D input
        assert sum(phases.values()) == torch_macs(layer, (x,), backward=True)


# --- quantized (CPU) ---------------------------------------------------------------------------
def test_quantized_dynamic_linear() -> None:
    model = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(8, 4)), {nn.Linear}, dtype=torch.qint8)
    assert measure(model, torch.randn(2, 8)).by_operator() == Counter({"linear_dynamic": 2 * 8 * 4})
    # requantisation and bias: 2 per output element
    assert measure(model, torch.randn(2, 8), "flops").total() == 2 * (2 * 8 * 4) + 2 * (2 * 4)


def test_quantized_conv_with_described_weight() -> None:
    """``quantized::conv2d`` counts like a convolution once its packed weight is described as a tensor."""
    handle = products.handles("macs")["quantized::conv2d"]
    assert callable(handle)
    x, w = TensorMeta((1, 4, 8, 8), "quint8", "cpu"), TensorMeta((6, 2, 3, 3), "qint8", "cpu")  # groups 2
    out = TensorMeta((1, 6, 6, 6), "quint8", "cpu")
    assert handle([x, w, 0.1, 0], [out]) == Counter({"conv": 1 * (6 * 2 * 3 * 3) * 36})


# --- the fvcore table uses the same formulas ---------------------------------------------------------
def test_fvcore_table_products_are_multiply_adds() -> None:
    x, w = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)
    args = (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    meta = place_arguments(torch.ops.aten.convolution.default._schema, args, {})
    out = flat_outputs(torch.ops.aten.convolution.default(*args))
    for convention in CONVENTIONS:
        handle = products.handles(convention)["aten::convolution"]
        assert callable(handle)
        assert handle(meta, out) == Counter({"conv": CONV_MACS * (2 if convention == "flops" else 1)})
    fv = fvcore.FLOP_HANDLES["aten::convolution"]
    assert callable(fv) and fv(meta, out) == Counter({"conv": CONV_MACS})


def test_unknown_convention_is_rejected() -> None:
    with pytest.raises(ValueError, match="convention"):
        products.handles("gmacs")


def test_macs_convention_forward_and_backward_match_flop_counter_mode() -> None:
    """End to end through ``FlopCountAnalysis(convention="macs", backward=True)``: a small CNN, products only."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.ConvTranspose2d(8, 4, 2, 2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    analysis = FlopCountAnalysis(model, x, convention="macs", backward=True).unsupported_ops_warnings(False)
    assert analysis.unsupported_ops() == Counter()
    assert analysis.total() == torch_macs(model, (x,), backward=True)
    assert analysis.by_phase()["backward"] == 2 * analysis.by_phase()["forward"]
