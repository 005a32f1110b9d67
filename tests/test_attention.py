"""Attention over its attended pairs, every kernel, forward and backward, every convention (handles/attention.py).

Oracles, none of which calls the formula under test:

* the mask itself: attended pairs counted by building the boolean mask with torch and summing it;
* torch's own definition of ``is_causal`` (its output equals the output with a ``tril`` mask);
* ``torch.utils.flop_counter.FlopCounterMode`` on the flash, memory-efficient and cuDNN kernels called on
  meta tensors (dense, 2 flops per multiply-add; its backward recomputes ``q·k`` like the kernels do);
* ``FlopCounterMode`` on the math kernel's own operators (``bmm``, forward and autograd's backward), for
  ``attention_kernel="math"``;
* hand arithmetic for the ``flops`` convention's documented per-pair costs and for the fused fast paths.
"""

from __future__ import annotations

import dataclasses
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
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model_helpers import FusedEncoderLayer, FusedSelfAttention
from modelmeter import FlopCountAnalysis, TensorMeta, analyze
from modelmeter.engine.metadata import describe, flat_outputs, place_arguments
from modelmeter.handles import attention, fvcore, products
from modelmeter.handles.attention import band_pairs, causal_pairs
from modelmeter.handles.base import backward_key

PROPERTY = settings(max_examples=40, deadline=None)
A = torch.ops.aten
FWD, BWD = "scaled_dot_product_attention", "scaled_dot_product_attention_backward"


def mask_pairs(lq: int, s: int, lower: int | None, upper: int | None) -> int:
    """Pairs a boolean mask built with torch lets through: ``lower <= j - i <= upper``."""
    diff = torch.arange(s)[None, :] - torch.arange(lq)[:, None]
    keep = torch.ones(lq, s, dtype=torch.bool)
    if lower is not None:
        keep &= diff >= lower
    if upper is not None:
        keep &= diff <= upper
    return int(keep.sum())


class Sdpa(nn.Module):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        extra = {} if mask is None else {"attn_mask": mask}
        return F.scaled_dot_product_attention(q, k, v, **extra, **self.kwargs)


def measure(model: nn.Module, inputs: Any, convention: str = "macs", *, backward: bool = False,
            dense: bool = False, execution: Any = "auto", kernel: str = "fused") -> FlopCountAnalysis:
    """An analysis whose attention and product operators use this module's tables."""
    analysis = FlopCountAnalysis(model, inputs, backward=backward, execution=execution)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    return analysis.set_op_handle(**products.handles(convention), **attention.handles(convention, dense, kernel))


def qkv(b: int, h: int, lq: int, s: int, e: int, ev: int, kv_heads: int | None = None, grad: bool = False,
        device: str = "cpu") -> tuple[torch.Tensor, ...]:
    hk = h if kv_heads is None else kv_heads
    return (torch.randn(b, h, lq, e, device=device, requires_grad=grad),
            torch.randn(b, hk, s, e, device=device, requires_grad=grad),
            torch.randn(b, hk, s, ev, device=device, requires_grad=grad))


def apply(op: str, fn: Any, args: tuple[Any, ...], convention: str = "macs", dense: bool = False,
          kernel: str = "fused", **kwargs: Any) -> Counter[str]:
    """Call ``fn`` and apply ``op``'s handle to the call's metadata."""
    handle = attention.handles(convention, dense, kernel)[op]
    assert callable(handle)
    out = fn(*args, **kwargs)
    return handle(place_arguments(fn._schema, args, kwargs), flat_outputs(out))  # type: ignore[return-value]


def torch_flops(fn: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# --- attended pairs ---------------------------------------------------------------------------------
bound = st.one_of(st.none(), st.integers(-12, 12))


@PROPERTY
@given(st.integers(1, 12), st.integers(1, 12), bound, bound)
def test_band_pairs_match_the_mask(lq: int, s: int, lower: int | None, upper: int | None) -> None:
    assert band_pairs(lq, s, lower, upper) == mask_pairs(lq, s, lower, upper)


@PROPERTY
@given(st.integers(1, 40), st.integers(1, 40))
def test_causal_pairs_closed_forms(lq: int, s: int) -> None:
    top_left = lq * (lq + 1) // 2 if lq <= s else s * (s + 1) // 2 + (lq - s) * s
    assert causal_pairs(lq, s) == top_left == int(torch.ones(lq, s).tril().sum())
    assert causal_pairs(lq, s, bottom_right=True) == int(torch.ones(lq, s).tril(s - lq).sum())
    assert causal_pairs(lq, lq) == causal_pairs(lq, lq, bottom_right=True) == lq * (lq + 1) // 2


@pytest.mark.parametrize(("lq", "s"), [(5, 3), (3, 5), (4, 4)])
def test_is_causal_is_top_left_as_torch_defines_it(lq: int, s: int) -> None:
    """The premise of ``causal_pairs``: torch's ``is_causal`` equals a ``tril`` mask, on the math and CPU kernels."""
    q, k, v = qkv(1, 2, lq, s, 8, 8)
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(lq, s, dtype=torch.bool).tril())
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), masked, equal_nan=True)
    cpu = A._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
    torch.testing.assert_close(cpu, masked, equal_nan=True)


# --- scaled_dot_product_attention, forward ------------------------------------------------------------
# B=2, H=4, L=6, S=7, E=8, Ev=5; causal: 1 + 2 + ... + 6 = 21 pairs per head of the 42
@pytest.mark.parametrize(("kwargs", "kv_heads", "pairs"), [
    pytest.param({}, None, 2 * 4 * 42, id="dense"),
    pytest.param({"is_causal": True}, None, 2 * 4 * 21, id="causal"),
    pytest.param({"enable_gqa": True}, 2, 2 * 4 * 42, id="gqa"),
    pytest.param({"enable_gqa": True, "is_causal": True}, 2, 2 * 4 * 21, id="gqa-causal"),
])
def test_sdpa_forward_by_hand(kwargs: dict[str, Any], kv_heads: int | None, pairs: int) -> None:
    inputs = qkv(2, 4, 6, 7, 8, 5, kv_heads)
    model = Sdpa(**kwargs)
    assert measure(model, inputs).by_operator() == Counter({FWD: pairs * (8 + 5)})
    assert measure(model, inputs, "fvcore").by_operator() == Counter({FWD: pairs * (8 + 5)})
    assert measure(model, inputs, "flops").total() == 2 * pairs * (8 + 5) + 6 * pairs
    assert measure(model, inputs, dense=True).total() == 2 * 4 * 42 * (8 + 5)


@pytest.mark.parametrize("length", [1, 2, 7, 16])
def test_causal_self_attention_counts_half_the_square(length: int) -> None:
    inputs = qkv(1, 3, length, length, 4, 4)
    assert measure(Sdpa(is_causal=True), inputs).total() == 3 * length * (length + 1) // 2 * (4 + 4)


def window_mask(lq: int, s: int, window: int) -> torch.Tensor:
    """Causal sliding window: query i sees keys i - window + 1 .. i."""
    i, j = torch.arange(lq)[:, None], torch.arange(s)[None, :]
    return (j <= i) & (j > i - window)


@pytest.mark.parametrize(("make_mask", "pairs_per_head", "additive"), [
    pytest.param(lambda: torch.ones(6, 7, dtype=torch.bool).tril(), 21, False, id="bool-causal"),
    pytest.param(lambda: window_mask(6, 7, 3), 1 + 2 + 3 + 3 + 3 + 3, False, id="bool-sliding-window"),
    pytest.param(lambda: torch.zeros(6, 7).masked_fill(~window_mask(6, 7, 2), float("-inf")), 1 + 2 * 5, True,
                 id="additive-window"),
    pytest.param(lambda: torch.zeros(6, 7).masked_fill(~torch.ones(6, 7, dtype=torch.bool).tril(),
                                                       torch.finfo(torch.float32).min), 21, True, id="additive-min"),
    pytest.param(lambda: torch.randn(6, 7), 42, True, id="additive-bias"),
])
def test_masks_with_values_count_their_pairs(make_mask: Callable[[], torch.Tensor], pairs_per_head: int,
                                             additive: bool) -> None:
    inputs = (*qkv(2, 4, 6, 7, 8, 8), make_mask())
    pairs = 2 * 4 * pairs_per_head
    assert measure(Sdpa(), inputs, execution="real").total() == pairs * 16
    assert measure(Sdpa(), inputs, "fvcore", execution="real").total() == pairs * 16
    assert measure(Sdpa(), inputs, "flops", execution="real").total() == 2 * pairs * 16 + (6 + additive) * pairs
    assert measure(Sdpa(), inputs, execution="real", dense=True).total() == 2 * 4 * 42 * 16
    # a fake run keeps the values of small inputs: the same count
    assert measure(Sdpa(), inputs).total() == pairs * 16
    # on the meta device a mask has no values: dense
    assert measure(Sdpa(), tuple(t.to("meta") for t in inputs)).total() == 2 * 4 * 42 * 16


def test_per_batch_padding_mask() -> None:
    """A (B, 1, 1, S) key-padding mask broadcast over heads and queries: every query of batch b sees its keys."""
    mask = torch.tensor([[True] * 7, [True] * 3 + [False] * 4]).view(2, 1, 1, 7)
    inputs = (*qkv(2, 4, 6, 7, 8, 8), mask)
    assert measure(Sdpa(), inputs, execution="real").total() == 4 * 6 * (7 + 3) * 16


# --- backward --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "kv_heads", "pairs"), [
    pytest.param({}, None, 2 * 4 * 42, id="dense"),
    pytest.param({"is_causal": True}, None, 2 * 4 * 21, id="causal"),
    pytest.param({"enable_gqa": True, "is_causal": True}, 2, 2 * 4 * 21, id="gqa-causal"),
])
def test_sdpa_backward_by_hand(kwargs: dict[str, Any], kv_heads: int | None, pairs: int) -> None:
    """CPU runs the flash kernel and its backward: 5 products per pair (q·k recomputed) over E=Ev=8."""
    inputs = qkv(2, 4, 6, 7, 8, 8, kv_heads, grad=True)
    analysis = measure(Sdpa(**kwargs), inputs, backward=True)
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in {e.op for e in analysis.trace.events}
    phases = analysis.by_phase_and_operator()
    assert phases["forward"] == Counter({FWD: pairs * 16})
    assert phases["backward"] == Counter({BWD: pairs * (3 * 8 + 2 * 8)})
    flops = measure(Sdpa(**kwargs), inputs, "flops", backward=True).by_phase()
    # forward: products + 6 per pair; backward: products + 6 per pair + 2 per output element (2*4*6*8)
    assert flops == {"forward": 2 * pairs * 16 + 6 * pairs, "backward": 2 * pairs * 40 + 6 * pairs + 2 * 384}


def test_backward_is_counted_from_the_call_whichever_kernel_runs() -> None:
    """E != Ev decomposes into bmm on CPU: 4 dense gradient products, nothing recomputed. The call's own formula
    counts it as a fused kernel does (q·k recomputed, then the 4 products) over the attended pairs, so a causal
    mask reduces the backward as it reduces the forward, on any device and whichever kernel runs."""
    inputs = qkv(2, 4, 6, 7, 8, 5, grad=True)
    analysis = measure(Sdpa(), inputs, backward=True)
    assert "aten::bmm" in {e.op for e in analysis.trace.events if e.phase == "backward"}  # the math path ran
    pairs = 2 * 4 * 6 * 7
    assert analysis.by_phase_and_operator()["backward"] == Counter({BWD: pairs * (3 * 8 + 2 * 5)})
    causal = measure(Sdpa(is_causal=True), inputs, backward=True)
    attended = 2 * 4 * sum(min(i + 1, 7) for i in range(6))
    assert causal.by_phase() == {"forward": attended * (8 + 5), "backward": attended * (3 * 8 + 2 * 5)}
    # without the call's formula the operators that ran are counted one by one: FlopCounterMode's count
    op_by_op = measure(Sdpa(), inputs, backward=True).set_op_handle(backward_key("aten::" + FWD), None)
    with FlopCounterMode(display=False) as counter:
        Sdpa()(*inputs).sum().backward()
    assert op_by_op.total() * 2 == counter.get_total_flops()
    assert op_by_op.by_phase_and_operator()["backward"] == Counter({"bmm": 2 * pairs * (8 + 5)})


# --- every kernel on meta tensors, against FlopCounterMode (dense) ------------------------------------
def kernel_calls(b: int, h: int, lq: int, s: int, e: int, causal: bool) -> list[tuple[str, Any, tuple[Any, ...]]]:
    q, k, v = qkv(b, h, lq, s, e, e, device="meta")
    out, lse = torch.empty(b, h, lq, e, device="meta"), torch.empty(b, h, lq, device="meta")
    seed, offset = torch.empty(2, dtype=torch.int64, device="meta"), torch.empty(0, dtype=torch.int64, device="meta")
    t = [x.transpose(1, 2) for x in (q, k, v, out)]
    return [
        ("aten::_scaled_dot_product_flash_attention", A._scaled_dot_product_flash_attention.default,
         (q, k, v, 0.0, causal)),
        ("aten::_scaled_dot_product_efficient_attention", A._scaled_dot_product_efficient_attention.default,
         (q, k, v, None, True, 0.0, causal)),
        ("aten::_scaled_dot_product_cudnn_attention", A._scaled_dot_product_cudnn_attention.default,
         (q, k, v, None, True, 0.0, causal)),
        ("aten::_flash_attention_forward", A._flash_attention_forward.default,
         (t[0], t[1], t[2], None, None, lq, s, 0.0, causal, False)),
        ("aten::_scaled_dot_product_flash_attention_backward", A._scaled_dot_product_flash_attention_backward.default,
         (out, q, k, v, out, lse, None, None, lq, s, 0.0, causal, seed, offset)),
        ("aten::_scaled_dot_product_efficient_attention_backward",
         A._scaled_dot_product_efficient_attention_backward.default,
         (out, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal)),
    ]


@pytest.mark.parametrize("index", range(6))
def test_kernels_match_flop_counter_mode_dense(index: int) -> None:
    b, h, lq, s, e = 2, 3, 5, 7, 8
    op, fn, args = kernel_calls(b, h, lq, s, e, False)[index]
    ours = apply(op, fn, args)
    assert 2 * sum(ours.values()) == torch_flops(lambda: fn(*args))
    pairs = b * h * lq * s
    assert ours == (Counter({BWD: pairs * 5 * e}) if op.endswith("backward") else Counter({FWD: pairs * 2 * e}))
    # causal: FlopCounterMode counts dense; ours the triangle (flash aligns it bottom-right)
    op, fn, args = kernel_calls(b, h, lq, lq, e, True)[index]
    per_pair = 5 * e if op.endswith("backward") else 2 * e
    assert sum(apply(op, fn, args).values()) == b * h * lq * (lq + 1) // 2 * per_pair
    assert sum(apply(op, fn, args, dense=True).values()) == b * h * lq * lq * per_pair


# --- the math kernel's cost (attention_kernel="math") -------------------------------------------------
def math_path_flops(inputs: tuple[torch.Tensor, ...], **kwargs: Any) -> tuple[int, int]:
    """FlopCounterMode's count of the math kernel's own operators (its ``bmm``), forward and backward."""
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward:
            out = F.scaled_dot_product_attention(*inputs, **kwargs)
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
    assert set(backward.get_flop_counts()["Global"]) == {A.bmm}  # the four gradient products, nothing fused
    return forward.get_total_flops(), backward.get_total_flops()


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}], ids=["dense", "causal"])
@pytest.mark.parametrize("execution", ["auto", "real"])
def test_math_kernel_counts_what_the_math_kernel_computes(kwargs: dict[str, Any], execution: str) -> None:
    """The math kernel builds the whole score matrix (a causal mask is applied to it) and keeps it for the
    backward pass: 2 products per pair forward, 4 backward, every pair — 3x the forward in all."""
    b, h, lq, s, e, ev = 2, 3, 5, 7, 8, 6
    inputs = qkv(b, h, lq, s, e, ev, grad=True)
    forward, backward = math_path_flops(inputs, **kwargs)
    pairs = b * h * lq * s
    assert (forward, backward) == (2 * pairs * (e + ev), 2 * 2 * pairs * (e + ev))  # by hand
    ours = FlopCountAnalysis(Sdpa(**kwargs), inputs, convention="macs", backward=True, execution=execution,
                             attention_kernel="math")
    assert ours.by_phase_and_operator() == {"forward": Counter({FWD: pairs * (e + ev)}),
                                            "backward": Counter({BWD: 2 * pairs * (e + ev)}), "recompute": Counter()}
    assert 2 * ours.total() == forward + backward == 3 * forward
    flops = FlopCountAnalysis(Sdpa(**kwargs), inputs, convention="flops", backward=True, attention_kernel="math")
    # forward: products + 6 per pair; backward: products + dS (3 per pair) + D (2 per output element), no recompute
    assert flops.by_phase() == {"forward": 2 * pairs * (e + ev) + 6 * pairs,
                                "backward": 4 * pairs * (e + ev) + 3 * pairs + 2 * b * h * lq * ev}


@pytest.mark.parametrize("index", [4, 5])
def test_backward_kernel_operators_at_the_math_kernels_cost(index: int) -> None:
    """A fused kernel's backward operator counted as the math kernel would do its work: the four gradient
    products (FlopCounterMode of the math path), where the fused kernel's own cost adds the recomputed q·k."""
    b, h, lq, s, e = 2, 3, 5, 7, 8
    for causal in (False, True):
        op, fn, args = kernel_calls(b, h, lq, s if not causal else lq, e, causal)[index]
        pairs = b * h * lq * (s if not causal else lq)
        _, math_backward = math_path_flops(qkv(b, h, lq, s if not causal else lq, e, e, grad=True),
                                           is_causal=causal)
        assert 2 * sum(apply(op, fn, args, kernel="math").values()) == math_backward == 2 * pairs * 4 * e
    op, fn, args = kernel_calls(b, h, lq, s, e, False)[index]
    assert sum(apply(op, fn, args).values()) == b * h * lq * s * 5 * e == torch_flops(lambda: fn(*args)) // 2


def test_the_fused_backward_is_two_and_a_half_forwards() -> None:
    """The default, documented once in docs/attention.md: a fused kernel's backward recomputes q·k, then the four
    gradient products — 5 products to the forward's 2, FlopCounterMode's count of the flash backward operator."""
    b, h, lq, s, e = 2, 3, 5, 7, 8
    inputs = qkv(b, h, lq, s, e, e, grad=True)
    ours = FlopCountAnalysis(Sdpa(), inputs, convention="macs", backward=True)
    assert ours.by_phase() == {"forward": b * h * lq * s * 2 * e, "backward": b * h * lq * s * 5 * e}
    _, _, flash_backward = kernel_calls(b, h, lq, s, e, False)[4]
    _, _, flash_forward = kernel_calls(b, h, lq, s, e, False)[0]
    assert torch_flops(lambda: A._scaled_dot_product_flash_attention_backward.default(*flash_backward)) * 2 == \
        torch_flops(lambda: A._scaled_dot_product_flash_attention.default(*flash_forward)) * 5


def test_attention_kernel_is_checked_and_reaches_every_entry_point() -> None:
    inputs = qkv(1, 2, 4, 4, 8, 8, grad=True)
    with pytest.raises(ValueError, match="attention_kernel must be one of 'fused', 'math', got 'flash'"):
        FlopCountAnalysis(Sdpa(), inputs, attention_kernel="flash")
    causal = Sdpa(is_causal=True)
    math_total = analyze(causal, inputs, backward=True, attention_kernel="math", quiet=True).flops.total()
    assert math_total == 3 * 2 * 4 * 4 * 16  # every pair: forward 16 per pair, backward 32
    assert analyze(causal, inputs, backward=True, quiet=True).flops.total() == 2 * 10 * (16 + 40)  # 10 pairs


# L=5, S=7: top-left rows see 1..5 keys (15); bottom-right rows see 3..7 keys (25)
@pytest.mark.parametrize(("custom_mask_type", "pairs_per_head"), [(0, 5 * 7), (1, 15), (2, 25)])
def test_efficient_attention_forward_mask_types(custom_mask_type: int, pairs_per_head: int) -> None:
    """``(B, L, H, E)`` layout; mask type 1 is causal from the top left, 2 from the bottom right."""
    q, k, v = (x.transpose(1, 2) for x in qkv(2, 3, 5, 7, 8, 4, device="meta"))
    assert mask_pairs(5, 7, None, 0) == 15 and mask_pairs(5, 7, None, 2) == 25
    args = (q, k, v, None, None, None, 5, 7, 0.0, custom_mask_type, True)
    assert apply("aten::_efficient_attention_forward", A._efficient_attention_forward.default, args) == \
        Counter({FWD: 2 * 3 * pairs_per_head * (8 + 4)})


def test_flash_attention_sliding_window() -> None:
    """``window_size_left=2`` with ``is_causal`` (which bounds the right side): itself and 2 keys before it."""
    q, k, v = (x.transpose(1, 2) for x in qkv(1, 2, 6, 6, 8, 8, device="meta"))
    args = (q, k, v, None, None, 6, 6, 0.0, True, False)
    got = apply("aten::_flash_attention_forward", A._flash_attention_forward.default, args, window_size_left=2,
                window_size_right=-1)
    assert got == Counter({FWD: 2 * mask_pairs(6, 6, -2, 0) * 16}) == Counter({FWD: 2 * (1 + 2 + 3 * 4) * 16})
    # no causal flag: the window reaches 1 key to the right too
    args = (q, k, v, None, None, 6, 6, 0.0, False, False)
    got = apply("aten::_flash_attention_forward", A._flash_attention_forward.default, args, window_size_left=2,
                window_size_right=1)
    assert got == Counter({FWD: 2 * mask_pairs(6, 6, -2, 1) * 16})


def test_cpu_flash_kernel_and_backward_directly() -> None:
    q, k, v = qkv(1, 2, 4, 4, 8, 8, device="meta")
    out, lse = torch.empty(1, 2, 4, 8, device="meta"), torch.empty(1, 2, 4, device="meta")
    forward = A._scaled_dot_product_flash_attention_for_cpu.default
    assert apply("aten::_scaled_dot_product_flash_attention_for_cpu", forward, (q, k, v, 0.0, True)) == \
        Counter({FWD: 2 * 10 * 16})
    assert apply("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                 A._scaled_dot_product_flash_attention_for_cpu_backward.default,
                 (out, q, k, v, out, lse, 0.0, True)) == Counter({BWD: 2 * 10 * 40})


def test_varlen_sequences_are_taken_as_equal() -> None:
    """Packed sequences (``cum_seq_q`` of 3 entries: 2 sequences of 6 tokens) count per sequence."""
    q, k, v = (torch.empty(12, 2, 8, device="meta") for _ in range(3))
    cum = torch.empty(3, dtype=torch.int32, device="meta")
    args = (q, k, v, cum, cum, 6, 6, 0.0, True, False)
    assert apply("aten::_flash_attention_forward", A._flash_attention_forward.default, args) == \
        Counter({FWD: 2 * 2 * 21 * 16})


# --- flex_attention ------------------------------------------------------------------------------
def flex_inputs(block_counts: tuple[int, int] | None, mask_heads: int = 2) -> list[Any]:
    """The metadata of ``flex_attention(q, k, v, score_mod, block_mask.as_tuple(), ...)``: 2 heads of 256 tokens."""
    q = TensorMeta((1, 2, 256, 16), "float32", "cpu")
    kv_blocks, full_blocks = (TensorMeta((1, mask_heads, 2), "int32", "cpu") for _ in range(2))
    if block_counts is not None:
        kv_blocks = dataclasses.replace(kv_blocks, attended=block_counts[0])
        full_blocks = dataclasses.replace(full_blocks, attended=block_counts[1])
    indices = TensorMeta((1, 2, 2, 2), "int32", "cpu")
    blocks = [256, 256, kv_blocks, indices, full_blocks, indices, *[indices] * 8, 128, 128, "<function>"]
    return [q, q, q, "<function>", blocks]


def test_flex_attention_counts_the_block_mask() -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    block_mask = create_block_mask(lambda b, h, i, j: i >= j, 1, 2, 256, 256, device="cpu")
    partial, full = int(block_mask.kv_num_blocks.sum()), int(block_mask.full_kv_num_blocks.sum())
    assert (partial, full) == (4, 2)  # per head: two diagonal blocks computed with the mask, one full block
    described = describe(block_mask.as_tuple())
    assert len(described) == len(flex_inputs(None)[4]) and described[-3:-1] == [128, 128]
    assert described[2].shape == block_mask.kv_num_blocks.shape
    handle = attention.handles("macs")["aten::flex_attention"]
    assert callable(handle)
    assert handle(flex_inputs((partial, full)), []) == Counter({"flex_attention": 6 * 128 * 128 * 32})
    # block counts unknown, or dense asked for: every pair
    assert handle(flex_inputs(None), []) == Counter({"flex_attention": 2 * 256 * 256 * 32})
    dense = attention.handles("macs", dense_attention=True)["aten::flex_attention"]
    assert callable(dense) and dense(flex_inputs((partial, full)), []) == handle(flex_inputs(None), [])
    # a mask made for one head (H=None) stands for both heads
    assert handle(flex_inputs((2, 1), mask_heads=1), []) == Counter({"flex_attention": 6 * 128 * 128 * 32})


# --- fused fast paths ------------------------------------------------------------------------------
def test_fused_multihead_attention_in_every_convention() -> None:
    # (2, 16, 32), 4 heads of 8: projections 2*16*32*(96 + 32); attention 2 * (2*4*16*16*8)
    model, x = FusedSelfAttention(nn.MultiheadAttention(32, 4, batch_first=True).eval()), torch.randn(2, 16, 32)
    linear, products_, pairs = 2 * 16 * 32 * 128, 2 * (2 * 4 * 16 * 16 * 8), 2 * 4 * 16 * 16
    expected = Counter({"linear": linear, FWD: products_})
    assert measure(model, x).by_operator() == measure(model, x, "fvcore").by_operator() == expected
    assert measure(model, x, "flops").by_operator() == Counter({"linear": 2 * linear + 2 * 16 * 128,
                                                               FWD: 2 * products_ + 6 * pairs})


def test_fused_encoder_layer_in_every_convention() -> None:
    layer = FusedEncoderLayer(nn.TransformerEncoderLayer(32, 4, 48, batch_first=True).eval())
    x = torch.randn(3, 5, 32)
    tokens = 15
    linear = tokens * (32 * 96 + 32 * 32 + 32 * 48 + 48 * 32)
    products_ = 2 * (3 * 4 * 5 * 5 * 8)
    with torch.no_grad():
        assert measure(layer, x).by_operator() == Counter({"linear": linear, FWD: products_})
        assert measure(layer, x, "fvcore").by_operator() == Counter(
            {"linear": linear, FWD: products_, "layer_norm": 2 * 5 * tokens * 32})
        assert measure(layer, x, "flops").by_operator() == Counter({
            "linear": 2 * linear + tokens * (96 + 32 + 48 + 32), FWD: 2 * products_ + 6 * (3 * 4 * 5 * 5),
            "layer_norm": 2 * (7 * tokens * 32 + 4 * tokens),
            "elementwise": attention.ACTIVATION_FLOPS * tokens * 48 + 2 * tokens * 32})


@pytest.mark.parametrize("convention", ["fvcore", "macs", "flops"])
@pytest.mark.parametrize(("activation", "norm_first"), [("relu", False), ("gelu", True)])
def test_fused_fast_paths_equal_the_unfused_layers(convention: str, activation: str, norm_first: bool) -> None:
    """The fused operators count what the unfused modules run, operator by operator, in every convention."""
    def total(model: nn.Module, x: torch.Tensor) -> int:
        analysis = FlopCountAnalysis(model, x, convention=convention)
        return analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False).total()

    layer = nn.TransformerEncoderLayer(32, 4, 48, activation=activation, norm_first=norm_first,
                                       batch_first=True).eval()
    x = torch.randn(3, 5, 32)
    assert total(FusedEncoderLayer(layer), x) == total(layer, x)
    mha = FusedSelfAttention(nn.MultiheadAttention(32, 4, batch_first=True).eval())
    assert total(mha, torch.randn(2, 16, 32)) == total(SelfAttention(mha.mha), torch.randn(2, 16, 32))


class SelfAttention(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.mha = mha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=False)[0]


# --- the fvcore table ----------------------------------------------------------------------------------
def test_fvcore_table_counts_attended_pairs() -> None:
    inputs = qkv(1, 2, 8, 8, 4, 4)
    handle = fvcore.FLOP_HANDLES["aten::scaled_dot_product_attention"]
    assert callable(handle)
    meta = [describe(t) for t in inputs] + [None, 0.0, True, None, False]
    assert handle(meta, []) == Counter({FWD: 2 * 36 * 8})
    dense = attention.handles("fvcore", dense_attention=True)["aten::scaled_dot_product_attention"]
    assert callable(dense) and dense(meta, []) == Counter({FWD: 2 * 64 * 8})


def test_unknown_convention_is_rejected() -> None:
    with pytest.raises(ValueError, match="convention"):
        attention.handles("gflops")


@PROPERTY
@given(st.integers(1, 2), st.integers(1, 2), st.integers(1, 3), st.integers(1, 9), st.integers(1, 9),
       st.integers(1, 8), st.booleans())
def test_sdpa_property(b: int, kv_heads: int, group: int, lq: int, s: int, e: int, causal: bool) -> None:
    """Random shapes (E = Ev: the CPU flash kernel runs): attended pairs x (E + Ev) forward, x (3E + 2Ev)
    backward, dense with the switch."""
    h = kv_heads * group
    inputs = qkv(b, h, lq, s, e, e, kv_heads, grad=True)
    model = Sdpa(is_causal=causal, enable_gqa=group > 1)
    pairs = b * h * (mask_pairs(lq, s, None, 0) if causal else lq * s)
    phases = measure(model, inputs, backward=True).by_phase()
    assert phases == {"forward": pairs * 2 * e, "backward": pairs * 5 * e}
    assert measure(model, inputs, backward=True, dense=True).total() == b * h * lq * s * 7 * e
    assert math.isclose(measure(model, inputs, "flops").total(), 2 * pairs * 2 * e + 6 * pairs)
