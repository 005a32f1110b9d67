"""Formulas of the fvcore convention: one fused multiply-add counts as one flop.

Each function takes ``(inputs, outputs)`` of one recorded call (arguments in the aten schema's
order, tensors as metadata with ``.shape``) and returns a count. ``FLOP_HANDLES`` and
``ACTIVATION_HANDLES`` at the bottom map operator names to them, one line per operator family.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .base import CountInside, Handle, get_shape, numel, prod, shape_of


# --- matrix products: output elements x contracted size --------------------------------------
def matmul_flop(inputs: list[Any], outputs: list[Any]) -> int:
    """``matmul``/``mm``/``bmm``: every output element is a dot product over ``A.shape[-1]``.

    Covers broadcasting on either side and 1-D operands, where fvcore fails or under-counts.
    """
    return numel(outputs[0]) * shape_of(inputs[0])[-1]


def addmm_flop(inputs: list[Any], outputs: list[Any]) -> int:
    """``addmm(bias, A, B)`` / ``baddbmm(bias, A, B)``: the product only; the bias add is free."""
    return numel(outputs[0]) * shape_of(inputs[1])[-1]


def grouped_mm_flop(inputs: list[Any], outputs: list[Any]) -> int:
    """``_grouped_mm(A, B, offs)`` (mixture-of-experts): each row of ``A`` meets one group's matrix.

    With two 2-D operands the groups split the contracted dimension: ``M·N·K`` in all; otherwise
    every output element is a dot product over ``A.shape[-1]``.
    """
    a, b = shape_of(inputs[0]), shape_of(inputs[1])
    if len(a) == 2 and len(b) == 2:
        return a[0] * a[1] * b[1]
    return numel(outputs[0]) * a[-1]


def linear_flop(inputs: list[Any], outputs: list[Any]) -> int:
    """``linear(x, W, b)``: rows of ``x`` x in_features x out_features; the bias add is free."""
    return numel(outputs[0]) * shape_of(inputs[1])[-1]


def conv_flop_count(x_shape: list[int], w_shape: list[int], out_shape: list[int], transposed: bool = False) -> int:
    """Multiply-adds of a convolution of any dimension, groups included in the weight's shape.

    A plain convolution does ``prod(weight)`` multiply-adds per output position; a transposed one
    does them per *input* position.
    """
    spatial = (x_shape if transposed else out_shape)[2:]
    return x_shape[0] * prod(w_shape) * prod(spatial)


def conv_flop(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
    """``convolution(input, weight, bias, stride, padding, dilation, transposed, ...)``, keyed ``conv``."""
    x, w = shape_of(inputs[0]), shape_of(inputs[1])
    if len(x) == len(w) - 1:  # unbatched input
        x = [1, *x]
    out = shape_of(outputs[0])
    if len(out) == len(w) - 1:
        out = [1, *out]
    transposed = bool(inputs[6]) if len(inputs) > 6 else False
    return Counter({"conv": conv_flop_count(x, w, out, transposed)})


# --- attention: its two matrix products, whichever kernel runs -------------------------------
def _attention_sizes(q: list[int], k: list[int], v: list[int]) -> tuple[int, int, int, int, int]:
    """(batch x heads, L, S, E, Ev) of ``softmax(q k^T) v``; heads are the query's (GQA-safe)."""
    return prod(q[:-2]), q[-2], k[-2], q[-1], v[-1]


def sdpa_flop(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
    """``scaled_dot_product_attention(q, k, v, ...)``: ``q k^T`` (L·S·E) plus ``p v`` (L·S·Ev) per head.

    Dense count: every query attends to every key.
    """
    bh, lq, s, e, ev = _attention_sizes(*(shape_of(t) for t in inputs[:3]))
    return Counter({"scaled_dot_product_attention": bh * lq * s * (e + ev)})


def sdpa_activation(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
    """What the unfused products would output: the score matrix (L·S) and the result (L·Ev)."""
    bh, lq, s, _, ev = _attention_sizes(*(shape_of(t) for t in inputs[:3]))
    return Counter({"scaled_dot_product_attention": bh * lq * (s + ev)})


def _mha_parts(query: list[int], key: list[int], embed_dim: int, num_heads: int) -> dict[str, int]:
    """Sizes of the fused multi-head attention fast path (batch-first inputs)."""
    lead = prod(query[:-2]) if len(query) > 2 else 1
    lq, s = query[-2], key[-2]
    return {"batch": lead, "L": lq, "S": s, "E": embed_dim, "H": num_heads}


def native_mha_flop(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
    """``_native_multi_head_attention``: q/k/v and output projections plus the attention products."""
    p = _mha_parts(shape_of(inputs[0]), shape_of(inputs[1]), inputs[3], inputs[4])
    b, lq, s, e = p["batch"], p["L"], p["S"], p["E"]
    return Counter({"linear": b * (lq * e * e + 2 * s * e * e) + b * lq * e * e,
                    "scaled_dot_product_attention": 2 * b * lq * s * e})


def native_mha_activation(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
    p = _mha_parts(shape_of(inputs[0]), shape_of(inputs[1]), inputs[3], inputs[4])
    b, lq, s, e, h = p["batch"], p["L"], p["S"], p["E"], p["H"]
    return Counter({"linear": b * (lq * e + 2 * s * e) + b * lq * e,
                    "scaled_dot_product_attention": b * h * lq * s + b * lq * e})


def _encoder_layer(inputs: list[Any]) -> tuple[int, int, int, int]:
    src, ffn = shape_of(inputs[0]), shape_of(inputs[14])
    tokens = prod(src[:-1])
    return tokens, src[-1], inputs[2], ffn[0]


def encoder_layer_flop(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
    """``_transformer_encoder_layer_fwd``: self-attention block, two layer norms and the MLP."""
    src = shape_of(inputs[0])
    tokens, e, _, f = _encoder_layer(inputs)
    seq = src[-2] if len(src) > 1 else 1
    return Counter({"linear": tokens * (4 * e * e + 2 * e * f),
                    "scaled_dot_product_attention": 2 * tokens * seq * e,
                    "layer_norm": 2 * 5 * tokens * e})


def encoder_layer_activation(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
    src = shape_of(inputs[0])
    tokens, e, h, f = _encoder_layer(inputs)
    seq = src[-2] if len(src) > 1 else 1
    return Counter({"linear": tokens * (5 * e + f),
                    "scaled_dot_product_attention": tokens * h * seq + tokens * e})


# --- normalisation, resampling, pooling --------------------------------------------------------
def norm_flop_counter(affine_arg_index: int) -> Handle:
    """Norms: 5 flops per element with an affine transform, 4 without (fvcore's estimate)."""

    def norm_flop(inputs: list[Any], outputs: list[Any]) -> int:
        has_affine = get_shape(inputs[affine_arg_index]) is not None
        return numel(inputs[0]) * (5 if has_affine else 4)

    return norm_flop


def batchnorm_flop(inputs: list[Any], outputs: list[Any]) -> int:
    """``batch_norm(x, weight, bias, mean, var, training, ...)``: train as a norm; eval 2 (1 without affine)."""
    if inputs[5]:
        return numel(inputs[0]) * (5 if get_shape(inputs[1]) is not None else 4)
    return numel(inputs[0]) * (2 if get_shape(inputs[1]) is not None else 1)


def elementwise_flop_counter(input_scale: float = 1, output_scale: float = 0) -> Handle:
    """``input_scale`` flops per input element plus ``output_scale`` per output element."""

    def elementwise_flop(inputs: list[Any], outputs: list[Any]) -> float:
        total: float = 0
        if input_scale:
            total += input_scale * numel(inputs[0])
        if output_scale:
            total += output_scale * numel(outputs[0])
        return int(total) if float(total).is_integer() else total

    return elementwise_flop


def generic_activation(inputs: list[Any], outputs: list[Any]) -> int:
    """fvcore's activation: the number of elements of the first output."""
    return numel(outputs[0])


def _keyed(key: str, handle: Handle) -> Handle:
    def keyed(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
        value = handle(inputs, outputs)
        return Counter({key: value}) if not isinstance(value, Counter) else value

    keyed.__doc__ = f"{handle.__doc__ or ''} Reported as ``{key}``."
    return keyed


_conv_ops = ("aten::convolution", "aten::_convolution")
_products = ("linear", "addmm", "baddbmm", "matmul", "mm", "bmm", "_grouped_mm", "einsum")

FLOP_HANDLES: dict[str, Handle | CountInside] = {
    **{op: conv_flop for op in _conv_ops},
    "aten::linear": linear_flop,
    "aten::addmm": addmm_flop,
    "aten::baddbmm": addmm_flop,
    "aten::matmul": matmul_flop,
    "aten::mm": matmul_flop,
    "aten::bmm": matmul_flop,
    "aten::_grouped_mm": grouped_mm_flop,
    "aten::einsum": CountInside("einsum"),
    "aten::scaled_dot_product_attention": sdpa_flop,
    "aten::_native_multi_head_attention": native_mha_flop,
    "aten::_transformer_encoder_layer_fwd": encoder_layer_flop,
    "aten::batch_norm": batchnorm_flop,
    "aten::group_norm": norm_flop_counter(2),
    "aten::layer_norm": norm_flop_counter(2),
    "aten::instance_norm": norm_flop_counter(1),
    **{f"aten::upsample_nearest{d}d": elementwise_flop_counter(0, 1) for d in (1, 2, 3)},
    **{f"aten::_upsample_nearest_exact{d}d": elementwise_flop_counter(0, 1) for d in (1, 2, 3)},
    "aten::upsample_bilinear2d": elementwise_flop_counter(0, 4),
    **{f"aten::adaptive_avg_pool{d}d": elementwise_flop_counter(1, 0) for d in (1, 2, 3)},
    "aten::grid_sampler": elementwise_flop_counter(0, 4),
}

ACTIVATION_HANDLES: dict[str, Handle | CountInside] = {
    **{op: _keyed("conv", generic_activation) for op in _conv_ops},
    **{f"aten::{op}": generic_activation for op in _products},
    "aten::scaled_dot_product_attention": sdpa_activation,
    "aten::_native_multi_head_attention": native_mha_activation,
    "aten::_transformer_encoder_layer_fwd": encoder_layer_activation,
}
