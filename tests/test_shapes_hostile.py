"""Counts on degenerate and unusual shapes: broadcast operands, zero-size dimensions, counts past 2**53.

Oracles: hand arithmetic, the shapes torch's own kernels produce (a broadcast result), torch's
``FlopCounterMode`` where its convention is known (2 flops per multiply-add), and brute force over small shapes.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from model_helpers import Fn
from modelmeter import ActivationCountAnalysis, FlopCountAnalysis
from modelmeter.errors import ModelRunError


def analysis(model: nn.Module, inputs: Any, convention: str = "fvcore", **options: Any) -> FlopCountAnalysis:
    flops = FlopCountAnalysis(model, inputs, convention=convention, **options)
    return flops.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


# --- linalg.vecdot: the contracted dimension is the broadcast operands' ------------------------------------
def _vecdot_on(dim: int) -> Fn:
    return Fn(lambda a, b: torch.linalg.vecdot(a, b, dim=dim))


@pytest.mark.parametrize(("x", "y", "dim"), [
    ((2, 3), (3,), 0),          # y's only dimension is the broadcast's dimension 1: it was read as dimension 0
    ((2, 3), (4, 1, 3), 1),     # dim 1 of the (4, 2, 3) broadcast is x's 0 and y's 1
    ((4, 1, 3), (2, 3), -2),    # a negative dimension, y broadcast along it
    ((3, 1), (3, 5), -1),       # x broadcast along the contracted dimension
])
def test_vecdot_contracts_the_broadcast_dimension(x: tuple[int, ...], y: tuple[int, ...], dim: int) -> None:
    # vecdot over (2, 3) and (3,) along 0: 3 outputs, each a dot product of length 2 (6 multiply-adds); it was 9
    inputs = (torch.randn(x), torch.randn(y))
    shape = torch.broadcast_shapes(x, y)
    expected = shape.numel()  # one multiply-add per element of the broadcast operands
    assert analysis(_vecdot_on(dim), inputs, "macs").by_operator() == {"linalg_vecdot": expected}
    assert torch.linalg.vecdot(*inputs, dim=dim).numel() * shape[dim] == expected


# --- attention whose query is broadcast over the key's batch or heads --------------------------------------
def _sdpa(**options: Any) -> Fn:
    return Fn(lambda q, k, v, *mask: F.scaled_dot_product_attention(q, k, v, *mask, **options))


@pytest.mark.parametrize(("q", "k"), [
    ((1, 3, 5, 8), (2, 3, 7, 8)),   # one query batch for two key batches
    ((2, 1, 5, 8), (2, 3, 7, 8)),   # one query head for three key heads
    ((3, 5, 8), (2, 3, 7, 8)),      # a query without a batch dimension
])
@pytest.mark.parametrize("execution", ["auto", "real"])
def test_attention_counts_the_heads_torch_computes(q: tuple[int, ...], k: tuple[int, ...], execution: str) -> None:
    # torch broadcasts q, k and v: the output (and the work) has the broadcast heads; the query's alone were counted
    v = (*k[:-1], 4)
    inputs = (torch.randn(q), torch.randn(k), torch.randn(v))
    out = F.scaled_dot_product_attention(*inputs)
    heads = out.shape[:-2].numel()
    pairs = heads * q[-2] * k[-2]
    flops = analysis(_sdpa(), inputs, "macs", execution=execution)
    assert flops.by_operator() == {"scaled_dot_product_attention": pairs * (8 + 4)}
    assert out.shape[-2:] == (q[-2], 4)


def test_attention_mask_is_counted_over_the_broadcast_heads() -> None:
    # a (5, 7) mask for a (1, 3)-batch query over (2, 3) keys is applied to all 6 heads
    q, k, v = torch.randn(1, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    mask = torch.rand(5, 7) > 0.5
    passed = int(mask.sum())
    flops = analysis(_sdpa(), (q, k, v, mask), "macs", execution="real")
    assert flops.by_operator() == {"scaled_dot_product_attention": 6 * passed * (8 + 4)}


def test_broadcast_attention_backward_counts_the_broadcast_heads() -> None:
    # fused backward: q·k recomputed, dV, dP, dQ, dK: (3·E + 2·Ev) per pair, over the 6 heads torch computes
    q = torch.randn(1, 3, 5, 8, requires_grad=True)
    k, v = torch.randn(2, 3, 7, 8, requires_grad=True), torch.randn(2, 3, 7, 4, requires_grad=True)
    flops = analysis(_sdpa(), (q, k, v), "macs", backward=True)
    pairs = 6 * 5 * 7
    assert flops.by_operator() == {"scaled_dot_product_attention": pairs * 12,
                                   "scaled_dot_product_attention_backward": pairs * (3 * 8 + 2 * 4)}


def test_broadcast_attention_activations_are_its_output_and_scores() -> None:
    q, k, v = torch.randn(1, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    acts = ActivationCountAnalysis(_sdpa(), (q, k, v)).uncalled_modules_warnings(False)
    assert acts.by_operator() == {"scaled_dot_product_attention": 6 * 5 * (7 + 4)}


def _mask_cases() -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool]]:
    """Query, key and mask shapes (and enable_gqa) that plain torch runs or refuses, broadcasting every way."""
    cases = []
    for q, k, gqa in [((2, 5, 8), (2, 7, 8), False), ((4, 5, 8), (2, 7, 8), True), ((1, 2, 5, 8), (2, 2, 7, 8), False),
                      ((2, 4, 5, 8), (2, 2, 7, 8), True), ((2, 2, 5, 8), (1, 2, 7, 8), False)]:
        for mask in [(5, 7), (1, 7), (2, 5, 7), (3, 5, 7), (1, 2, 5, 7), (2, 1, 5, 7), (2, 2, 5, 7), (1, 1, 1, 5, 7)]:
            cases.append((q, k, mask, gqa))
    return cases


@pytest.mark.parametrize(("q", "k", "mask", "gqa"), _mask_cases())
@pytest.mark.parametrize("kind", [torch.float32, torch.bool])
def test_a_mask_is_refused_where_the_cpu_refuses_it(q: tuple[int, ...], k: tuple[int, ...], mask: tuple[int, ...],
                                                    gqa: bool, kind: torch.dtype) -> None:
    # the CPU adds the mask to the scores in place: a mask of more batches than q, k and v was counted (the math
    # path under a recording adds it out of place, and broadcasts), in every execution; oracle: plain torch
    inputs = (torch.randn(q), torch.randn(k), torch.randn(k), torch.ones(mask, dtype=kind))
    model = _sdpa(enable_gqa=gqa)
    try:
        model(*inputs)
    except RuntimeError:
        runs = False
    else:
        runs = True
    for execution in ("auto", "fake"):
        if runs:
            assert analysis(model, inputs, execution=execution).total() > 0
        else:
            with pytest.raises(ModelRunError, match="broadcast"):
                analysis(model, inputs, execution=execution).total()


# --- counts past 2**53 are exact integers --------------------------------------------------------------------
def test_counts_past_two_to_the_53_are_exact_ints() -> None:
    m, k, n = 2**20 + 1, 2**21 + 3, 2**22 + 5
    a, b = torch.empty(m, k, device="meta"), torch.empty(k, n, device="meta")
    total = analysis(Fn(torch.mm), (a, b), "flops").total()
    assert type(total) is int and total == 2 * m * k * n and total > 2**64


# --- max and average pooling read what brute force over the windows reads -----------------------------------
def _read_by_windows(size: int, out: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """Input positions the windows of one dimension read, counted one by one."""
    return sum(1 for o in range(out) for j in range(kernel) if 0 <= o * stride - padding + j * dilation < size)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10), st.integers(1, 10), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2),
       st.integers(1, 3), st.booleans())
def test_pooling_reads_what_its_windows_cover(h: int, w: int, kernel: int, stride: int, padding: int,
                                              dilation: int, ceil_mode: bool) -> None:
    span = (kernel - 1) * dilation + 1
    if 2 * padding > kernel or span > min(h, w) + 2 * padding:
        return  # torch rejects these
    x = torch.randn(2, 3, h, w)
    out = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode=ceil_mode)
    rows = _read_by_windows(h, out.shape[-2], kernel, stride, padding, dilation)
    columns = _read_by_windows(w, out.shape[-1], kernel, stride, padding, dilation)
    pool = Fn(lambda t: F.max_pool2d(t, kernel, stride, padding, dilation, ceil_mode=ceil_mode))
    assert analysis(pool, (x,), "flops").total() == 6 * rows * columns
    if dilation == 1:
        average = Fn(lambda t: F.avg_pool2d(t, kernel, stride, padding, ceil_mode=ceil_mode))
        assert analysis(average, (x,), "flops").total() == 6 * rows * columns + out.numel()


# --- an empty input the CPU kernel refuses is refused by a fake run too ---------------------------------------
EMPTY_INPUTS: dict[str, tuple[Any, tuple[int, ...]]] = {
    "max pooling of no channels": (lambda x: F.max_pool2d(x, 2), (2, 0, 4, 4)),  # a direct meta kernel took it
    "adaptive average pooling of no rows": (lambda x: F.adaptive_avg_pool2d(x, 2), (2, 3, 0, 4)),
    "adaptive average pooling of no positions": (lambda x: F.adaptive_avg_pool1d(x, 2), (2, 3, 0)),
    "adaptive average pooling 3-d": (lambda x: F.adaptive_avg_pool3d(x, 2), (2, 3, 0, 4, 4)),
    "area interpolation of no rows": (lambda x: F.interpolate(x, size=(3, 3), mode="area"), (2, 3, 0, 4)),
    "bilinear interpolation of no rows": (lambda x: F.interpolate(x, size=(3, 3), mode="bilinear"), (2, 3, 0, 4)),
    "bilinear interpolation of no channels": (lambda x: F.interpolate(x, scale_factor=2.0, mode="bilinear"),
                                              (2, 0, 2, 4)),
    "bicubic interpolation of no rows": (lambda x: F.interpolate(x, size=(3, 3), mode="bicubic"), (2, 3, 0, 4)),
    "linear interpolation of no positions": (lambda x: F.interpolate(x, size=3, mode="linear"), (2, 3, 0)),
    "trilinear interpolation of no depth": (lambda x: F.interpolate(x, size=(3, 3, 3), mode="trilinear"),
                                            (2, 3, 0, 2, 2)),
    "grid sampling of no rows": (lambda x: F.grid_sample(x, torch.zeros(2, 3, 3, 2, device=x.device),
                                                         align_corners=False), (2, 3, 0, 4)),
    "transposed convolution of no rows": (lambda x: F.conv_transpose2d(x, torch.ones(3, 4, 2, 2, device=x.device)),
                                          (2, 3, 0, 4)),
    "transposed convolution of no input channels": (
        lambda x: F.conv_transpose2d(x, torch.ones(0, 4, 2, 2, device=x.device)), (2, 0, 3, 4)),
    "max along an empty dimension": (lambda x: x.max(1).values, (3, 0)),
    "min along an empty dimension": (lambda x: x.min(dim=0).values, (0, 3)),
    "max of nothing": (lambda x: x.max(), (0, 3)),
    "min of nothing": (lambda x: x.min(), (3, 0)),
}


@pytest.mark.parametrize("name", list(EMPTY_INPUTS))
@pytest.mark.parametrize("execution", ["auto", "fake"])
def test_an_empty_input_the_cpu_refuses_is_not_counted(name: str, execution: str) -> None:
    # a fake run counted these (bilinear interpolation of a (2, 3, 0, 4) input: 432 flops) where a real run fails
    function, shape = EMPTY_INPUTS[name]
    with pytest.raises((RuntimeError, IndexError)):  # the oracle: the CPU refuses it
        function(torch.randn(shape))
    with pytest.raises(ModelRunError):
        analysis(Fn(function), (torch.randn(shape),), "flops", execution=execution).total()


@pytest.mark.parametrize(("function", "shape"), [
    (lambda x: F.max_pool2d(x, 2), (0, 3, 4, 4)),                          # an empty batch
    (lambda x: F.adaptive_avg_pool2d(x, 2), (2, 0, 3, 4)),                 # no channels: adaptive pooling takes it
    (lambda x: F.interpolate(x, size=(3, 3), mode="bilinear"), (0, 3, 2, 4)),
    (lambda x: F.grid_sample(x, torch.zeros(2, 3, 3, 2, device=x.device), align_corners=False), (2, 0, 3, 4)),
    (lambda x: F.conv_transpose2d(x, torch.ones(3, 4, 2, 2, device=x.device)), (0, 3, 3, 4)),
    (lambda x: x.max(0).values, (3, 0)),                                    # the empty dimension is kept
])
def test_an_empty_input_the_cpu_takes_counts_nothing(function: Any, shape: tuple[int, ...]) -> None:
    function(torch.randn(shape))  # the CPU takes it
    for execution in ("auto", "real"):
        total = analysis(Fn(function), (torch.randn(shape),), "flops", execution=execution).total()
        assert type(total) is int and total == 0


# --- products, forward and backward, against torch's FlopCounterMode (2 flops per multiply-add) --------------
def _torch_flops(function: Any, inputs: tuple[torch.Tensor, ...], backward: bool) -> int:
    with FlopCounterMode(display=False) as counter:
        out = function(*inputs)
        if backward:
            out.sum().backward()
    return counter.get_total_flops()


def _fresh(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3), max_size=2), st.lists(st.integers(1, 3), max_size=2), st.integers(0, 4),
       st.integers(0, 4), st.integers(0, 4), st.booleans(), st.booleans())
def test_matmul_of_any_shapes_is_torchs_count(batch_a: list[int], batch_b: list[int], m: int, k: int, n: int,
                                              transposed: bool, backward: bool) -> None:
    # broadcast batches (a size 1 against any), empty dimensions, a transposed (non-contiguous) operand
    rank = max(len(batch_a), len(batch_b))
    padded_a = [1] * (rank - len(batch_a)) + batch_a
    batch_b = [b if b == 1 or a in (1, b) else 1 for a, b in zip(padded_a, [1] * (rank - len(batch_b)) + batch_b,
                                                                  strict=True)][rank - len(batch_b):]
    a = torch.randn(*batch_a, k, m).transpose(-1, -2) if transposed else torch.randn(*batch_a, m, k)
    b = torch.randn(*batch_b, k, n)
    inputs = (a.requires_grad_(backward), b.requires_grad_(backward))
    macs = analysis(Fn(torch.matmul), _fresh(*inputs), "macs", backward=backward).total()
    assert type(macs) is int and 2 * macs == _torch_flops(torch.matmul, _fresh(*inputs), backward)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 2),
       st.integers(0, 1), st.integers(1, 2), st.booleans(), st.integers(1, 3), st.booleans())
def test_convolution_of_any_geometry_is_torchs_count(batch: int, cin: int, cout: int, kernel: int, stride: int,
                                                     padding: int, dilation: int, transposed: bool, dims: int,
                                                     backward: bool) -> None:
    # groups stay 1: FlopCounterMode counts a grouped weight gradient `groups` times over
    name = f"conv_transpose{dims}d" if transposed else f"conv{dims}d"
    shape = (cin, cout) if transposed else (cout, cin)
    x = torch.randn(batch, cin, *[6] * dims, requires_grad=backward)
    w = torch.randn(*shape, *[kernel] * dims, requires_grad=backward)

    def convolve(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return getattr(F, name)(x, w, stride=stride, padding=padding, dilation=dilation)

    try:
        convolve(x, w)
    except RuntimeError:
        return  # a geometry torch refuses (an output padding, a window past the input)
    macs = analysis(Fn(convolve), _fresh(x, w), "macs", backward=backward).total()
    assert type(macs) is int and 2 * macs == _torch_flops(convolve, _fresh(x, w), backward)


def _adaptive_taps(size_in: int, size_out: int) -> int:
    """Elements in the adaptive windows of one dimension, from torch's bounds in exact rational arithmetic."""
    return sum(math.ceil(Fraction((i + 1) * size_in, size_out)) - math.floor(Fraction(i * size_in, size_out))
               for i in range(size_out))


@pytest.mark.parametrize("dims", [1, 2])
def test_adaptive_pooling_past_two_to_the_53_is_exact(dims: int) -> None:
    # a float quotient of the windows' bounds lost their exact count: 42 elements short here
    rows, outputs = 2**50 + 3, 1000
    x = torch.empty(1, 1, rows, *[1] * (dims - 1), device="meta")
    size = outputs if dims == 1 else (outputs, 1)
    pool = Fn(lambda t: F.adaptive_avg_pool1d(t, size) if dims == 1 else F.adaptive_avg_pool2d(t, size))
    total = analysis(pool, (x,), "flops").total()
    # an add per element entering a window, a divide per output element
    assert type(total) is int and total == _adaptive_taps(rows, outputs) + outputs
