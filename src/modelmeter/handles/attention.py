"""Attention at its true cost: only the (query, key) pairs a mask lets through, under every convention.

Every scaled-dot-product kernel does two products per attended pair forward (``q·k`` over ``E``, ``p·v``
over ``Ev``). Backward, a fused kernel (flash, memory-efficient, cuDNN: the default, ``attention_kernel="fused"``)
does five: it recomputes ``q·k``, then ``dV = Pᵀ·dO``, ``dP = dO·Vᵀ``, ``dQ = dS·K``, ``dK = dSᵀ·Q`` (2.5x the
forward's products when ``E = Ev``); the math kernel (``attention_kernel="math"``) keeps the score matrix and does
the four gradient products only (2x), over every pair, as it computes the full score matrix whatever the mask.
Attended pairs: every pair (dense), the causal triangle (``is_causal``: top-left aligned as torch defines it;
flash kernels align bottom-right), a sliding window, or the count a mask's values gave (``TensorMeta.attended``;
unknown values count dense). ``dense_attention=True`` counts every pair. Heads are the query's (grouped-query
attention). Formulas: docs/attention.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from ..engine.attention_masks import score_batch
from ..errors import InvalidValueError
from .base import CountInside, Handle, backward_key, get_shape, prod, shape_of
from .binding import Formula, bind_all, by_name
from .catalog import ATTENTION_KERNELS

# ``flops`` convention, per attended pair, besides the products: forward scale, row max, subtract, exp,
# row sum, normalise (6); backward dS = P·(dP - D) with its scale (3), and a fused kernel's recomputation of P
# (scale, subtract log-sum-exp, exp: 3 more). An additive (float) mask adds 1 per pair where the scores are
# computed (forward, and a fused kernel's recomputation). Backward also forms D = rowsum(dO·O): 2 per output
# element.
FORWARD_PAIR_FLOPS = 6
BACKWARD_PAIR_FLOPS = 3
RECOMPUTE_PAIR_FLOPS = 3
BACKWARD_OUTPUT_FLOPS = 2
# fused encoder layer (``flops``), as the unfused layer counts: an affine layer norm costs 7 per element and 4
# per row (:mod:`.norms`), the MLP activation and each residual add 1 per element (:mod:`.elementwise`)
LAYER_NORM_ELEMENT_FLOPS, LAYER_NORM_ROW_FLOPS = 7, 4
ACTIVATION_FLOPS = 1


def band_pairs(lq: int, s: int, lower: int | None, upper: int | None) -> int:
    """Pairs ``(i, j)`` with ``i < lq``, ``j < s`` and ``lower <= j - i <= upper`` (None: no bound), in closed form
    (a sequence of a billion tokens is counted at once)."""
    below_upper = lq * s if upper is None else _pairs_up_to(lq, s, upper)
    below_lower = 0 if lower is None else _pairs_up_to(lq, s, lower - 1)
    return max(0, below_upper - below_lower)


def _pairs_up_to(lq: int, s: int, t: int) -> int:
    """Pairs with ``j - i <= t``: query ``i`` sees ``clamp(i + t + 1, 0, s)`` keys, summed over ``i < lq``."""
    return _clamped_sum(t + 1 + lq, s) - _clamped_sum(t + 1, s)


def _clamped_sum(n: int, s: int) -> int:
    """``sum(clamp(x, 0, s) for x in range(n))``, 0 for ``n <= 0``."""
    if n <= 0:
        return 0
    if n <= s:
        return n * (n - 1) // 2
    return s * (s - 1) // 2 + (n - s) * s


def causal_pairs(lq: int, s: int, bottom_right: bool = False) -> int:
    """Pairs of a causal mask: query ``i`` sees keys ``j <= i`` (top-left) or ``j <= i + s - lq`` (bottom-right)."""
    return band_pairs(lq, s, None, s - lq if bottom_right else 0)


@dataclass(frozen=True)
class Attention:
    """One attention call: ``heads`` (batch x query heads) of ``lq`` queries over ``s`` keys, ``pairs`` attended."""

    heads: int
    lq: int
    s: int
    e: int
    ev: int
    pairs: int
    additive_mask: bool = False


@dataclass(frozen=True)
class _Call:
    """What one attention operator says about its attention: q/k/v shapes, layout, causality, window, mask.

    ``heads_first``: ``(..., H, L, E)`` (sdpa) or ``(B, L, H, E)`` / varlen ``(T, H, E)`` (flash and
    memory-efficient kernels; ``sequences`` packed sequences are taken as equal in length).
    """

    q: list[int]
    k: list[int]
    v: list[int]
    heads_first: bool
    sequences: int = 1
    causal: bool = False
    bottom_right: bool = False
    window: tuple[int | None, int | None] | None = None
    mask: Any = None


def _attention(call: _Call, dense: bool = False) -> Attention:
    """Sizes and attended pairs of ``call`` (every pair when ``dense``)."""
    q, k, v = call.q, call.k, call.v
    if call.heads_first:
        heads, lq, s = prod(score_batch(q, k, v)), q[-2], k[-2]
    elif len(q) == 3:  # varlen: total tokens x heads x dim
        heads, lq, s = call.sequences * q[1], q[0] // call.sequences, k[0] // call.sequences
    else:
        heads, lq, s = q[0] * q[2], q[1], k[1]
    per_head = lq * s
    attended = getattr(call.mask, "attended", None)
    if dense:
        pairs = heads * per_head
    elif attended is not None:
        pairs = attended
    elif call.window is not None:
        offset = s - lq
        left, right = call.window
        pairs = heads * band_pairs(lq, s, None if left is None else offset - left,
                                   0 if call.causal else (None if right is None else offset + right))
    elif call.causal:
        pairs = heads * causal_pairs(lq, s, call.bottom_right)
    else:
        pairs = heads * per_head
    mask_dtype = getattr(call.mask, "dtype", "bool")
    return Attention(heads, lq, s, q[-1], v[-1], pairs, call.mask is not None and mask_dtype != "bool")


def _window(left: Any, right: Any) -> tuple[int | None, int | None] | None:
    """Flash's ``window_size_left/right`` (``-1`` or None: unbounded), or None when there is no window."""
    bounds = tuple(None if w is None or w < 0 else int(w) for w in (left, right))
    return None if bounds == (None, None) else (bounds[0], bounds[1])


def _sequences(cumulative: Any) -> int:
    """Packed sequences of a varlen call, from its cumulative lengths (``n + 1`` entries)."""
    shape = get_shape(cumulative)
    return 1 if shape is None else max(shape[0] - 1, 1)


# --- how each operator describes its attention ----------------------------------------------------
def _qkv(query: Any, key: Any, value: Any) -> tuple[list[int], list[int], list[int]]:
    return shape_of(query), shape_of(key), shape_of(value)


def _sdpa_like(bottom_right: bool) -> Formula[_Call]:
    """Operators with ``(..., H, L, E)`` q/k/v, ``is_causal`` and a mask (``attn_mask`` or ``attn_bias``, or none);
    ``bottom_right``: flash kernels, whose causal mask is aligned bottom-right."""

    @by_name(attn_mask="attn_bias")
    def sdpa_like(query: Any, key: Any, value: Any, is_causal: Any = False, attn_mask: Any = None) -> _Call:
        return _Call(*_qkv(query, key, value), heads_first=True, causal=bool(is_causal), bottom_right=bottom_right,
                     mask=attn_mask)

    sdpa_like.__doc__ = _sdpa_like.__doc__
    return sdpa_like


_SDPA, _SDPA_FLASH = _sdpa_like(False), _sdpa_like(True)


@by_name
def _flash(query: Any, key: Any, value: Any, cum_seq_q: Any, is_causal: Any, window_size_left: Any = None,
           window_size_right: Any = None) -> _Call:
    """``_flash_attention_forward/backward``: ``(B, L, H, E)`` or varlen, bottom-right causal, a sliding window."""
    return _Call(*_qkv(query, key, value), heads_first=False, sequences=_sequences(cum_seq_q),
                 causal=bool(is_causal), bottom_right=True, window=_window(window_size_left, window_size_right))


@by_name
def _efficient(query: Any, key: Any, value: Any, bias: Any, cu_seqlens_q: Any, custom_mask_type: Any) -> _Call:
    """``_efficient_attention_forward/backward``: ``(B, L, H, E)``; mask type 1 causal top-left, 2 bottom-right."""
    return _Call(*_qkv(query, key, value), heads_first=False, sequences=_sequences(cu_seqlens_q),
                 causal=custom_mask_type in (1, 2), bottom_right=custom_mask_type == 2, mask=bias)


# --- costs -------------------------------------------------------------------------------------
def forward_macs(a: Attention) -> int:
    """``q·k`` and ``p·v`` over every attended pair."""
    return a.pairs * (a.e + a.ev)


def backward_macs(a: Attention, recompute: bool = True) -> int:
    """``dV``, ``dP`` (over ``Ev``) and ``dQ``, ``dK`` (over ``E``) per attended pair, after ``q·k`` recomputed
    (``recompute``: a fused kernel, which does not keep the score matrix)."""
    return a.pairs * ((3 if recompute else 2) * a.e + 2 * a.ev)


def forward_flops(a: Attention) -> int:
    return 2 * forward_macs(a) + a.pairs * (FORWARD_PAIR_FLOPS + a.additive_mask)


def backward_flops(a: Attention, recompute: bool = True) -> int:
    per_pair = BACKWARD_PAIR_FLOPS + (RECOMPUTE_PAIR_FLOPS + a.additive_mask if recompute else 0)
    return 2 * backward_macs(a, recompute) + a.pairs * per_pair + BACKWARD_OUTPUT_FLOPS * a.heads * a.lq * a.ev


_FORWARD_KEY, _BACKWARD_KEY = "scaled_dot_product_attention", "scaled_dot_product_attention_backward"

# operator -> (how to read it, backward?)
KERNELS: dict[str, tuple[Formula[_Call], bool]] = {
    "aten::scaled_dot_product_attention": (_SDPA, False),
    **{f"aten::{op}": (_SDPA, False)
       for op in ("_scaled_dot_product_attention_math", "_scaled_dot_product_attention_math_for_mps")},
    "aten::_scaled_dot_product_flash_attention": (_SDPA_FLASH, False),
    "aten::_scaled_dot_product_flash_attention_backward": (_SDPA_FLASH, True),
    "aten::_scaled_dot_product_flash_attention_for_cpu": (_SDPA, False),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": (_SDPA, True),
    "aten::_scaled_dot_product_efficient_attention": (_SDPA, False),
    "aten::_scaled_dot_product_efficient_attention_backward": (_SDPA, True),
    "aten::_scaled_dot_product_cudnn_attention": (_SDPA, False),
    "aten::_scaled_dot_product_cudnn_attention_backward": (_SDPA, True),
    "aten::_scaled_dot_product_fused_attention_overrideable": (_SDPA, False),
    "aten::_scaled_dot_product_fused_attention_overrideable_backward": (_SDPA, True),
    "aten::_flash_attention_forward": (_flash, False),
    "aten::_flash_attention_backward": (_flash, True),
    "aten::_efficient_attention_forward": (_efficient, False),
    "aten::_efficient_attention_backward": (_efficient, True),
}


def attention_sizes(op: str) -> Callable[[list[Any], list[Any]], Attention]:
    """How to read the sizes of the attention that ``op`` computes (a key of :data:`KERNELS`, or the ``backward:``
    key of one, read from its forward call), every pair counted: what the bytes metric needs of it."""
    parse = KERNELS[op.removeprefix("backward:")][0].bind(op)

    def sizes(inputs: list[Any], outputs: list[Any]) -> Attention:
        return _attention(parse(inputs, outputs), dense=True)

    return sizes


def _kernel_handle(op: str, backward: bool, real_flops: bool, dense: bool, kernel: str) -> Handle:
    """The cost of an attention operator as ``kernel`` computes it: a fused kernel over the attended pairs,
    recomputing ``q·k`` backward; the math kernel over every pair, keeping the scores for the backward pass."""
    fused = kernel == "fused"
    dense = dense or not fused
    formula = KERNELS[op.removeprefix("backward:")][0]
    parse = formula.bind(op)

    def handle(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
        a = _attention(parse(inputs, outputs), dense)
        if not backward:
            value = forward_flops(a) if real_flops else forward_macs(a)
        elif real_flops:
            value = backward_flops(a, recompute=fused)
        else:
            value = backward_macs(a, recompute=fused)
        return Counter({_BACKWARD_KEY if backward else _FORWARD_KEY: value})

    pairs = "the attended pairs" if fused and not dense else "every pair"
    handle.__doc__ = f"{'Backward' if backward else 'Forward'} attention ({kernel} kernel) over {pairs}. " \
        f"{formula.__doc__}"
    return handle


# --- flex_attention ------------------------------------------------------------------------------
@by_name(arguments=("query", "key", "value", "score_mod", "block_mask"))
def flex_attention_pairs(query: Any, key: Any, value: Any, block_mask: Any = None) -> tuple[Attention, int | None]:
    """``flex_attention(query, key, value, score_mod, block_mask, ...)``: every pair, and the pairs of the block
    mask's blocks when their counts are known (else None).

    The block mask arrives as ``BlockMask.as_tuple()``: ``(q_len, kv_len, kv_num_blocks, kv_indices,
    full_kv_num_blocks, ..., Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod)``; a fused kernel computes
    ``Q_BLOCK x KV_BLOCK`` pairs per listed block (partial and full), so the pairs are the blocks' sum
    (read from ``attended`` of ``kv_num_blocks``/``full_kv_num_blocks``) times the block area, times the
    heads a mask broadcast over one batch or head stands for.
    """
    a = _attention(_Call(*_qkv(query, key, value), heads_first=True), dense=True)
    blocks = block_mask if isinstance(block_mask, list) and len(block_mask) > 6 else None
    if blocks is None:
        return a, None
    counts = [getattr(blocks[i], "attended", None) for i in (2, 4)]
    if counts[0] is None or (blocks[4] is not None and counts[1] is None):
        return a, None
    area = blocks[-3] * blocks[-2]
    broadcast = a.heads // prod(shape_of(blocks[2])[:-1])
    return a, min(a.pairs, (counts[0] + (counts[1] or 0)) * area * broadcast)


def _flex_handle(real_flops: bool, dense: bool) -> Handle:
    parse = flex_attention_pairs.bind("aten::flex_attention")

    def handle(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
        a, pairs = parse(inputs, outputs)
        if pairs is not None and not dense:
            a = replace(a, pairs=pairs)
        return Counter({"flex_attention": forward_flops(a) if real_flops else forward_macs(a)})

    handle.__doc__ = f"Forward flex attention. {flex_attention_pairs.__doc__}"
    return handle


# --- fused fast paths of nn.MultiheadAttention and nn.TransformerEncoderLayer -------------------
def _mha_parts(query: list[int], key: list[int], embed_dim: int, num_heads: int) -> dict[str, int]:
    """Sizes of the fused multi-head attention fast path (batch-first inputs)."""
    lead = prod(query[:-2]) if len(query) > 2 else 1
    return {"batch": lead, "L": query[-2], "S": key[-2], "E": embed_dim, "H": num_heads}


@cache
def native_mha_counter(real_flops: bool) -> Formula[Counter[str]]:
    """``_native_multi_head_attention``: q/k/v and output projections plus the (dense) attention products."""

    @by_name
    def native_mha_cost(query: Any, key: Any, embed_dim: int, num_head: int, qkv_bias: Any,
                        proj_bias: Any) -> Counter[str]:
        p = _mha_parts(shape_of(query), shape_of(key), embed_dim, num_head)
        b, lq, s, e, h = p["batch"], p["L"], p["S"], p["E"], p["H"]
        linear = b * (lq * e * e + 2 * s * e * e) + b * lq * e * e
        a = Attention(b * h, lq, s, e // h, e // h, b * h * lq * s)
        if not real_flops:
            return Counter({"linear": linear, _FORWARD_KEY: forward_macs(a)})
        in_bias, out_bias = get_shape(qkv_bias) is not None, get_shape(proj_bias) is not None
        biases = b * (lq * e + 2 * s * e) * in_bias + b * lq * e * out_bias
        return Counter({"linear": 2 * linear + biases, _FORWARD_KEY: forward_flops(a)})

    native_mha_cost.__doc__ = native_mha_counter.__doc__
    return native_mha_cost


@cache
def encoder_layer_counter(real_flops: bool, fvcore_norms: bool) -> Formula[Counter[str]]:
    """``_transformer_encoder_layer_fwd``: self-attention block, two layer norms and the MLP.

    fvcore/macs: layer norms at fvcore's 5 per element (fvcore, ``fvcore_norms``) or 0 (macs); flops: every bias,
    norm, activation and residual add at the per-element costs above.
    """

    @by_name
    def encoder_layer_cost(src: Any, num_heads: int, ffn_weight_1: Any) -> Counter[str]:
        shape = shape_of(src)
        tokens, e, h, f = prod(shape[:-1]), shape[-1], num_heads, shape_of(ffn_weight_1)[0]
        seq = shape[-2] if len(shape) > 1 else 1
        linear = tokens * (4 * e * e + 2 * e * f)
        a = Attention(tokens // seq * h, seq, seq, e // h, e // h, tokens * h * seq)
        if not real_flops:
            counts = Counter({"linear": linear, _FORWARD_KEY: forward_macs(a)})
            if fvcore_norms:
                counts["layer_norm"] = 2 * 5 * tokens * e
            return counts
        biases = tokens * (3 * e + e + f + e)
        return Counter({"linear": 2 * linear + biases, _FORWARD_KEY: forward_flops(a),
                        "layer_norm": 2 * (LAYER_NORM_ELEMENT_FLOPS * tokens * e + LAYER_NORM_ROW_FLOPS * tokens),
                        "elementwise": ACTIVATION_FLOPS * tokens * f + 2 * tokens * e})

    encoder_layer_cost.__doc__ = encoder_layer_counter.__doc__
    return encoder_layer_cost


# --- activations (fvcore's ActivationCountAnalysis): what the unfused products would output ----------
@by_name
def sdpa_activation(query: Any, key: Any, value: Any) -> Counter[str]:
    """The score matrix (L·S) and the result (L·Ev) per head, dense."""
    q, k, v = _qkv(query, key, value)
    return Counter({_FORWARD_KEY: prod(score_batch(q, k, v)) * q[-2] * (k[-2] + v[-1])})


@by_name
def native_mha_activation(query: Any, key: Any, embed_dim: int, num_head: int) -> Counter[str]:
    p = _mha_parts(shape_of(query), shape_of(key), embed_dim, num_head)
    b, lq, s, e, h = p["batch"], p["L"], p["S"], p["E"], p["H"]
    return Counter({"linear": b * (lq * e + 2 * s * e) + b * lq * e, _FORWARD_KEY: b * h * lq * s + b * lq * e})


@by_name
def encoder_layer_activation(src: Any, num_heads: int, ffn_weight_1: Any) -> Counter[str]:
    shape = shape_of(src)
    tokens, e, h, f = prod(shape[:-1]), shape[-1], num_heads, shape_of(ffn_weight_1)[0]
    seq = shape[-2] if len(shape) > 1 else 1
    return Counter({"linear": tokens * (5 * e + f), _FORWARD_KEY: tokens * h * seq + tokens * e})


# --- the table ---------------------------------------------------------------------------------
def handles(convention: str, dense_attention: bool = False,
            attention_kernel: str = "fused") -> dict[str, Handle | CountInside | None]:
    """The attention operators' table under ``convention``; ``dense_attention`` counts every pair;
    ``attention_kernel`` (``"fused"`` or ``"math"``) is the kernel whose cost every scaled-dot-product operator
    is counted at."""
    if convention not in ("fvcore", "macs", "flops"):
        raise InvalidValueError(f"unknown convention {convention!r}")
    check_attention_kernel(attention_kernel)
    real = convention == "flops"
    table: dict[str, Handle | CountInside | None] = {
        op: _kernel_handle(op, backward, real, dense_attention, attention_kernel)
        for op, (_, backward) in KERNELS.items()}
    # The backward pass of a user-level call is counted from the call, as the chosen kernel does it, whichever
    # kernel (or math-path products) autograd runs: the same pairs as its forward, the mask's count included,
    # and the same number on every device.
    sdpa = "aten::scaled_dot_product_attention"
    table[backward_key(sdpa)] = _kernel_handle(backward_key(sdpa), True, real, dense_attention, attention_kernel)
    table["aten::flex_attention"] = _flex_handle(real, dense_attention)
    table.update(bind_all({
        "aten::_native_multi_head_attention": native_mha_counter(real),
        "aten::_transformer_encoder_layer_fwd": encoder_layer_counter(real, convention == "fvcore")}))
    return table


def check_attention_kernel(kernel: Any) -> None:
    if kernel not in ATTENTION_KERNELS:
        kernels = ", ".join(map(repr, ATTENTION_KERNELS))
        raise InvalidValueError(f"attention_kernel must be one of {kernels}, got {kernel!r}")
