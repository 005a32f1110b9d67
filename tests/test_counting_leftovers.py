"""Counting leftovers: ``addr``, ``cdist``, antialiased resizing, the work dtype under autocast.

Oracles, none of which calls the formula under test:

* hand arithmetic on small shapes, written out;
* composition: ``_euclidean_dist``'s count equals that of its decomposition run as separate operators (checked
  numerically equal to ``torch.cdist`` first); a 2-D antialiased resize equals (numerically) its width pass
  followed by its height pass, and counts as the two together;
* the operator's own weights: the taps of a one-dimensional antialiased resize are bounded by the non-zero entries
  of its Jacobian and by the support torch allocates;
* the dtype autocast computes in, as torch reports it on the real output.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from model_helpers import Fn
from modelmeter import FlopCountAnalysis

PROPERTY = settings(max_examples=20, deadline=None)


def analysis(fn: Callable[..., Any] | nn.Module, *inputs: torch.Tensor, convention: str = "flops",
             backward: bool = False) -> FlopCountAnalysis:
    module = fn if isinstance(fn, nn.Module) else Fn(fn)
    args = inputs[0] if len(inputs) == 1 else tuple(inputs)
    result = FlopCountAnalysis(module, args, convention=convention, backward=backward)
    return result.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


def forward(fn: Callable[..., Any], *inputs: torch.Tensor, convention: str = "flops") -> int:
    """The forward count of ``fn``; nothing may be unsupported."""
    result = analysis(fn, *inputs, convention=convention)
    assert result.unsupported_ops() == Counter()
    return int(result.total())


def phases(fn: Callable[..., Any], *inputs: torch.Tensor, convention: str = "flops") -> dict[str, int]:
    """``{"forward": n, "backward": n}`` of ``fn``'s output summed, with a backward pass; nothing unsupported."""
    result = analysis(lambda *a: fn(*a).sum(), *inputs, convention=convention, backward=True)
    assert result.unsupported_ops() == Counter()
    counted = result.by_phase()
    return {"forward": counted["forward"], "backward": counted["backward"]}


def grad(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


# --- addr: beta·self + alpha·(vec1 ⊗ vec2) ------------------------------------------------------------------------
@pytest.mark.parametrize(("beta", "alpha", "extra"), [(1, 1, 1), (0, 1, 0), (2, 1, 2), (1, 3, 2), (2, 3, 3)])
def test_addr_by_hand(beta: float, alpha: float, extra: int) -> None:
    c, a, b = torch.randn(3, 4), torch.randn(3), torch.randn(4)

    def fn(c_: torch.Tensor, a_: torch.Tensor, b_: torch.Tensor) -> torch.Tensor:
        return torch.addr(c_, a_, b_, beta=beta, alpha=alpha)

    # 12 output elements, each one product a_i·b_j: one multiply-add; flops: 2 per multiply-add, then the add
    # (beta != 0), beta's multiply (beta not 0 or 1) and alpha's multiply (alpha != 1), one per output element
    assert forward(fn, c, a, b, convention="fvcore") == 12
    assert forward(fn, c, a, b, convention="macs") == 12
    assert forward(fn, c, a, b) == 2 * 12 + extra * 12


def test_addr_backward_by_hand() -> None:
    # the gradients of vec1 (grad @ vec2: 3·4) and vec2 (gradᵀ @ vec1: 4·3) are matrix-vector products
    counted = phases(torch.addr, grad(3, 4), grad(3), grad(4), convention="macs")
    assert counted == {"forward": 12, "backward": 24}


# --- cdist ----------------------------------------------------------------------------------------------------------
# x1 (2, 5, 3), x2 (2, 6, 3): B·P·R = 2·5·6 = 60 pairs of M = 3 features
@pytest.mark.parametrize(("p", "flops", "macs"), [
    (2.0, 3 * 60 * 3 + 60, 60 * 3),  # difference, square, sum per feature; a sqrt per pair
    (1.0, 3 * 60 * 3, 0),  # difference, |d|, sum
    (math.inf, 3 * 60 * 3, 0),  # difference, |d|, max
    (0.0, 3 * 60 * 3, 0),  # difference, d != 0, sum
    (3.0, 4 * 60 * 3 + 60, 0),  # difference, |d|, ^p, sum; a root per pair
])
def test_cdist_by_hand(p: float, flops: int, macs: int) -> None:
    x1, x2 = torch.randn(2, 5, 3), torch.randn(2, 6, 3)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cdist(a, b, p=p)

    assert forward(fn, x1, x2) == flops
    assert forward(fn, x1, x2, convention="fvcore") == macs
    assert forward(fn, x1, x2, convention="macs") == macs


def test_cdist_broadcasts_its_batch() -> None:
    # x1 (3, 1, 2, 4) against x2 (5, 3, 4): batch (3, 5), 2·3 pairs of 4 features each
    pairs = 3 * 5 * 2 * 3
    assert forward(torch.cdist, torch.randn(3, 1, 2, 4), torch.randn(5, 3, 4)) == 3 * pairs * 4 + pairs


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0])
@pytest.mark.parametrize(("rows", "columns"), [(3, 4), (30, 26)])  # 30 rows: the default mode's product path
def test_cdist_of_rows_with_no_features_counts_nothing(p: float, rows: int, columns: int) -> None:
    # torch returns zeros without computing; the sqrt per pair (and on the product path the two added columns)
    # were counted: 4680 FLOPs for (30, 0) against (26, 0)
    x1, x2 = torch.randn(rows, 0), torch.randn(columns, 0)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cdist(a, b, p=p)

    assert torch.equal(fn(x1, x2), torch.zeros(rows, columns))
    for convention in ("flops", "fvcore", "macs"):
        assert forward(fn, x1, x2, convention=convention) == 0


def _euclidean(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``‖a‖² - 2a·b + ‖b‖²`` as one product of widened operands, as torch's matrix-product path computes it."""
    n1, n2 = x1.pow(2).sum(-1, keepdim=True), x2.pow(2).sum(-1, keepdim=True)
    wide1 = torch.cat([x1.mul(-2), n1, torch.ones_like(n1)], -1)
    wide2 = torch.cat([x2, torch.ones_like(n2), n2], -1)
    return wide1.matmul(wide2.mT).clamp_min(0).sqrt()


@pytest.mark.parametrize(("rows", "mode"), [(5, "use_mm_for_euclid_dist"), (26, "use_mm_for_euclid_dist_if_necessary")])
def test_cdist_matrix_product_path(rows: int, mode: str) -> None:
    x1, x2 = torch.randn(2, rows, 3), torch.randn(2, 4, 3)

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cdist(a, b, compute_mode=mode)

    torch.testing.assert_close(_euclidean(x1, x2), torch.cdist(x1, x2), rtol=1e-4, atol=1e-4)
    pairs = 2 * rows * 4
    # the product over M + 2 = 5, squares and sums of both operands' rows, the -2 scale, clamp and sqrt
    by_hand = 2 * pairs * 5 + 2 * (2 * rows + 2 * 4) * 3 + 2 * rows * 3 + 2 * pairs
    assert forward(fn, x1, x2) == by_hand == forward(_euclidean, x1, x2)
    assert forward(fn, x1, x2, convention="macs") == pairs * 5


def test_cdist_backward_by_hand() -> None:
    # one _cdist_backward per operand: 4 per pair and feature each (difference, divide by the distance, product with
    # the gradient, accumulation); 1·2·4 pairs of 3 features; the forward's sum adds 8
    assert phases(torch.cdist, grad(1, 2, 3), grad(1, 4, 3)) == {"forward": 3 * 24 + 8 + 8, "backward": 2 * 4 * 24}
    assert phases(torch.cdist, grad(1, 2, 3), grad(1, 4, 3), convention="macs") == {"forward": 24, "backward": 48}


# --- antialiased resizing: separable, the support growing with the downscale factor ----------------------------
# 8 -> 4 per dimension, scale 2, bilinear support 2: an output's taps are 3, 4, 4, 3 (14 in all). A kept size (8 -> 8,
# scale 1, support 1): the window [i, i + 2) clipped to the input, 2 taps (one of weight 0) and 1 for the last: 15.
# The backward scatters to every 2-D tap.
@pytest.mark.parametrize(("size", "fwd", "bwd"), [
    ((4, 4), 2 * (8 * 14 + 4 * 14), 2 * 14 * 14),  # width pass on 8 rows, height pass on 4 columns
    ((8, 4), 2 * 8 * 14, 2 * 15 * 14),  # the height is kept: the width pass alone
    ((4, 8), 2 * 8 * 14, 2 * 14 * 15),  # the width is kept: the height pass alone, on 8 columns
])
def test_antialias_by_hand(size: tuple[int, int], fwd: int, bwd: int) -> None:
    def resize(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, size=size, mode="bilinear", antialias=True)

    counted = phases(resize, grad(1, 1, 8, 8))
    out = size[0] * size[1]
    assert counted == {"forward": fwd + out, "backward": bwd}  # (+ the sum of the output)


def test_antialias_of_an_unchanged_size_is_a_copy() -> None:
    def resize(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, size=(8, 8), mode="bicubic", antialias=True)

    assert forward(resize, torch.randn(1, 1, 8, 8)) == 0


def _taps_1d(size_in: int, size_out: int, mode: str) -> int:
    """Non-zero weights of resizing a row of ``size_in`` to ``size_out`` (the Jacobian's non-zero entries)."""

    def resize(t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, size=(1, size_out), mode=mode, antialias=True)

    jacobian = torch.autograd.functional.jacobian(resize, torch.zeros(1, 1, 1, size_in, dtype=torch.float64))
    return int((jacobian != 0).sum())


@PROPERTY
@given(size_in=st.lists(st.integers(2, 12), min_size=2, max_size=2),
       size_out=st.lists(st.integers(1, 12), min_size=2, max_size=2),
       mode=st.sampled_from(["bilinear", "bicubic"]))
def test_antialias_is_its_two_passes(size_in: list[int], size_out: list[int], mode: str) -> None:
    (h_in, w_in), (h_out, w_out) = size_in, size_out
    x = torch.randn(1, 2, h_in, w_in, dtype=torch.float64)

    def resize(height: int, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: F.interpolate(t, size=(height, width), mode=mode, antialias=True)

    # the 2-D resize is the width pass, then the height pass (numerically), and counts as the two
    torch.testing.assert_close(resize(h_out, w_out)(x), resize(h_out, w_out)(resize(h_in, w_out)(x)))
    width = forward(resize(h_in, w_out), x)
    height = forward(resize(h_out, w_out), torch.randn(1, 2, h_in, w_out, dtype=torch.float64))
    assert forward(resize(h_out, w_out), x) == width + height
    # each pass multiplies by every weight of the filter's support: at least the non-zero ones (some can be exactly
    # 0), at most the support torch allocates per output (ceil(support)·2 + 1)
    interp = 2 if mode == "bilinear" else 4
    for rows, n_in, n_out, counted in ((2 * h_in, w_in, w_out, width), (2 * w_out, h_in, h_out, height)):
        if n_in == n_out:
            assert counted == 0
            continue
        widest = math.ceil(interp / 2 * max(n_in / n_out, 1.0)) * 2 + 1
        assert 2 * rows * _taps_1d(n_in, n_out, mode) <= counted <= 2 * rows * widest * n_out


# --- the work dtype under autocast --------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [
    nn.Linear(4, 3),
    Fn(lambda x: torch.mm(x, torch.ones(4, 3))),
    Fn(lambda x: x @ torch.ones(4, 3)),
    Fn(lambda x: torch.einsum("ij,jk->ik", x, torch.ones(4, 3))),
], ids=["linear", "mm", "matmul", "einsum"])
def test_by_dtype_is_what_autocast_computes_in(fn: nn.Module) -> None:
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fn(x).dtype == torch.bfloat16  # torch's own account of the computation
        result = analysis(fn, x, convention="macs")
        assert result.by_dtype() == Counter({"bfloat16": 2 * 4 * 3})
    assert analysis(fn, x, convention="macs").by_dtype() == Counter({"float32": 2 * 4 * 3})


def test_by_dtype_of_what_autocast_runs_in_float32() -> None:
    # CPU autocast runs cdist in float32, whatever its inputs: bfloat16 operands count as float32 work
    x1, x2 = torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(4, 3, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.cdist(x1, x2).dtype == torch.float32
        assert set(analysis(torch.cdist, x1, x2).by_dtype()) == {"float32"}
