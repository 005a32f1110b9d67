"""Matrix products and convolutions, forward and backward, under every counting convention.

Every formula starts from the multiply-adds the product performs. ``fvcore`` and ``macs`` count one
per multiply-add and nothing else; ``flops`` counts two per multiply-add plus one per output element
for each bias add, ``beta``/``alpha`` term or dequantising scale. Backward passes reach the dispatcher as
the same ``mm``/``bmm`` products (linear, matmul, einsum) or as ``convolution_backward``, so the same
formulas count them. Formulas and examples: docs/attention.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from .base import CountInside, Handle, get_shape, numel, prod, shape_of

# (inputs, outputs) -> (multiply-adds, extra element-wise flops counted only by ``flops``)
Cost = Callable[[list[Any], list[Any]], tuple[int, int]]


# --- multiply-adds ---------------------------------------------------------------------------
def conv_macs(x: list[int], w: list[int], out: list[int], transposed: bool) -> int:
    """Multiply-adds of a convolution of any dimension (groups are in the weight's shape).

    A plain convolution does ``prod(weight)`` multiply-adds per output position, a transposed one per
    *input* position (``weight`` is then ``(C_in, C_out/groups, k...)``).
    """
    return x[0] * prod(w) * prod((x if transposed else out)[2:])


def _batched(shape: list[int], weight: list[int]) -> list[int]:
    """An unbatched convolution operand as a batch of one."""
    return [1, *shape] if len(shape) == len(weight) - 1 else shape


def _scalar(value: Any, default: float = 1) -> float:
    return default if value is None or isinstance(value, str) else float(value)


def _output_terms(out: Any, *present: bool) -> int:
    """One flop per output element for every term that is present (bias add, scale, beta, alpha)."""
    return numel(out) * sum(present)


# --- costs of each operator family: (multiply-adds, extra flops) ------------------------------
def convolution_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``convolution(input, weight, bias, stride, padding, dilation, transposed, ...)``; bias: 1 add per output."""
    w = shape_of(inputs[1])
    x, out = _batched(shape_of(inputs[0]), w), _batched(shape_of(outputs[0]), w)
    transposed = bool(inputs[6]) if len(inputs) > 6 else False
    return conv_macs(x, w, out, transposed), _output_terms(outputs[0], get_shape(inputs[2]) is not None)


def convolution_backward_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``convolution_backward(grad_output, input, weight, bias_sizes, ..., transposed, ..., output_mask)``.

    The input gradient (a transposed convolution of ``grad_output``) and the weight gradient (a
    convolution of the input with ``grad_output``) each cost the forward's multiply-adds; the bias
    gradient is a sum over ``grad_output``: one add per element of it.
    """
    w = shape_of(inputs[2])
    grad_out, x = _batched(shape_of(inputs[0]), w), _batched(shape_of(inputs[1]), w)
    grad_input, grad_weight, grad_bias = (bool(m) for m in inputs[10])
    forward = conv_macs(x, w, grad_out, bool(inputs[7]))
    return forward * (grad_input + grad_weight), prod(grad_out) * grad_bias


def linear_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``linear(x, W, b)``: rows of ``x`` x in_features x out_features; bias: 1 add per output."""
    return numel(outputs[0]) * shape_of(inputs[0])[-1], _output_terms(outputs[0], get_shape(inputs[2]) is not None)


def matmul_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``matmul``/``mm``/``bmm``/``mv``/``dot``: every output element is a dot product over ``A.shape[-1]``.

    Broadcasting on either side and 1-D operands included.
    """
    return numel(outputs[0]) * shape_of(inputs[0])[-1], 0


def addmm_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``addmm``/``baddbmm``/``addmv(self, A, B, *, beta, alpha)``: ``beta·self + alpha·(A @ B)``.

    Extra flops per output element: the add (``beta != 0``), ``beta``'s multiply (``beta`` not 0 or 1)
    and ``alpha``'s multiply (``alpha != 1``).
    """
    beta, alpha = _scalar(inputs[3]), _scalar(inputs[4])
    macs = numel(outputs[0]) * shape_of(inputs[1])[-1]
    return macs, _output_terms(outputs[0], beta != 0, beta not in (0, 1), alpha != 1)


def addbmm_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``addbmm(self, A, B, *, beta, alpha)``: the batch of products summed into one matrix."""
    beta, alpha = _scalar(inputs[3]), _scalar(inputs[4])
    a = shape_of(inputs[1])
    macs = numel(outputs[0]) * a[0] * a[-1]
    return macs, _output_terms(outputs[0], beta != 0, beta not in (0, 1), alpha != 1)


def grouped_mm_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``_grouped_mm(A, B, offs, bias)`` (mixture-of-experts): each row of ``A`` meets one group's matrix.

    With two 2-D operands the groups split the contracted dimension: ``M·N·K`` in all; otherwise every
    output element is a dot product over ``A.shape[-1]``. Bias: 1 add per output.
    """
    a, b = shape_of(inputs[0]), shape_of(inputs[1])
    macs = a[0] * a[1] * b[1] if len(a) == 2 and len(b) == 2 else numel(outputs[0]) * a[-1]
    return macs, _output_terms(outputs[0], get_shape(inputs[3]) is not None)


def scaled_mm_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``_scaled_mm(A, B, scale_a, scale_b, bias, ...)`` (fp8): ``M·N·K``; dequantising scale and bias 1 each."""
    macs = numel(outputs[0]) * shape_of(inputs[0])[-1]
    return macs, _output_terms(outputs[0], True, get_shape(inputs[4]) is not None)


def scaled_grouped_mm_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``_scaled_grouped_mm(A, B, scale_a, scale_b, offs, bias, ...)``: grouped product, scale and bias."""
    macs, _ = grouped_mm_cost([inputs[0], inputs[1], inputs[4], None], outputs)
    return macs, _output_terms(outputs[0], True, get_shape(inputs[5]) is not None)


def quantized_linear_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``quantized::linear(X, packed_W, ...)`` and ``linear_dynamic``: in_features from ``X`` (the weight is packed).

    Requantisation and bias cost 2 per output element.
    """
    return numel(outputs[0]) * shape_of(inputs[0])[-1], 2 * numel(outputs[0])


def quantized_conv_cost(inputs: list[Any], outputs: list[Any]) -> tuple[int, int]:
    """``quantized::conv{1,2,3}d(X, packed_W, ...)``: needs the packed weight described as a tensor.

    Requantisation and bias cost 2 per output element.
    """
    w = shape_of(inputs[1])
    return conv_macs(_batched(shape_of(inputs[0]), w), w, _batched(shape_of(outputs[0]), w), False), \
        2 * numel(outputs[0])


# --- conventions ----------------------------------------------------------------------------
def _multiply_adds(cost: Cost, key: str | None) -> Handle:
    def handle(inputs: list[Any], outputs: list[Any]) -> Any:
        macs, _ = cost(inputs, outputs)
        return macs if key is None else Counter({key: macs})

    handle.__doc__ = f"Multiply-adds only. {cost.__doc__}"
    return handle


def _real_flops(cost: Cost, key: str | None) -> Handle:
    def handle(inputs: list[Any], outputs: list[Any]) -> Any:
        macs, extra = cost(inputs, outputs)
        return 2 * macs + extra if key is None else Counter({key: 2 * macs + extra})

    handle.__doc__ = f"2 flops per multiply-add plus extra terms. {cost.__doc__}"
    return handle


_COSTS: dict[str, tuple[Cost, str | None]] = {
    **{op: (convolution_cost, "conv") for op in ("aten::convolution", "aten::_convolution")},
    "aten::convolution_backward": (convolution_backward_cost, None),
    "aten::linear": (linear_cost, None),
    **{f"aten::{op}": (matmul_cost, None) for op in ("matmul", "mm", "bmm", "mv", "dot", "vdot")},
    **{f"aten::{op}": (addmm_cost, None) for op in ("addmm", "baddbmm", "addmv")},
    "aten::addbmm": (addbmm_cost, None),
    "aten::_grouped_mm": (grouped_mm_cost, None),
    "aten::_scaled_mm": (scaled_mm_cost, None),
    "aten::_scaled_grouped_mm": (scaled_grouped_mm_cost, None),
    **{f"quantized::{op}": (quantized_linear_cost, None) for op in ("linear", "linear_relu", "linear_dynamic")},
    **{f"quantized::conv{d}d{relu}": (quantized_conv_cost, "conv") for d in (1, 2, 3) for relu in ("", "_relu")},
}


def handles(convention: str, dense_attention: bool = False) -> dict[str, Handle | CountInside | None]:
    """The product operators' table under ``convention`` (``dense_attention`` does not apply to products)."""
    wrap = _real_flops if convention == "flops" else _multiply_adds
    if convention not in ("fvcore", "macs", "flops"):
        raise ValueError(f"unknown convention {convention!r}")
    table: dict[str, Handle | CountInside | None] = {op: wrap(cost, key) for op, (cost, key) in _COSTS.items()}
    table["aten::einsum"] = CountInside("einsum")
    return table
