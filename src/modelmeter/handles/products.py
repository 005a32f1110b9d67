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

from ..engine.shapes import broadcast_shape
from ..errors import InvalidValueError
from .base import CountInside, Handle, get_shape, numel, prod, shape_of
from .binding import Formula, by_name

# (inputs, outputs) -> (multiply-adds, extra element-wise flops counted only by ``flops``): a formula bound to its op
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
@by_name
def convolution_cost(input: Any, weight: Any, bias: Any, transposed: bool = False, *, result: Any) -> tuple[int, int]:
    """``convolution``/``_convolution``; bias: 1 add per output element."""
    w = shape_of(weight)
    x, out = _batched(shape_of(input), w), _batched(shape_of(result), w)
    return conv_macs(x, w, out, bool(transposed)), _output_terms(result, get_shape(bias) is not None)


@by_name
def convolution_backward_cost(grad_output: Any, input: Any, weight: Any, transposed: bool,
                              output_mask: list[bool]) -> tuple[int, int]:
    """``convolution_backward``: the input gradient (a transposed convolution of ``grad_output``) and the weight
    gradient (a convolution of the input with ``grad_output``) each cost the forward's multiply-adds; the bias
    gradient is a sum over ``grad_output``: one add per element of it.
    """
    w = shape_of(weight)
    grad_out, x = _batched(shape_of(grad_output), w), _batched(shape_of(input), w)
    grad_input, grad_weight, grad_bias = (bool(m) for m in output_mask)
    forward = conv_macs(x, w, grad_out, bool(transposed))
    return forward * (grad_input + grad_weight), prod(grad_out) * grad_bias


@by_name
def linear_cost(input: Any, bias: Any, *, result: Any) -> tuple[int, int]:
    """``linear(input, weight, bias)``: rows of ``input`` x in_features x out_features; bias: 1 add per output."""
    return numel(result) * shape_of(input)[-1], _output_terms(result, get_shape(bias) is not None)


@by_name(self="qa")
def matmul_cost(self: Any, *, result: Any) -> tuple[int, int]:
    """``matmul``/``mm``/``bmm``/``mv``/``dot`` (and ``quantized::matmul(qa, qb, ...)``): every output element is a dot
    product over ``self.shape[-1]``.

    Broadcasting on either side and 1-D operands included.
    """
    return numel(result) * shape_of(self)[-1], 0


@by_name
def vecdot_cost(x: Any, y: Any, dim: int = -1, *, result: Any) -> tuple[int, int]:
    """``linalg_vecdot(x, y, dim)``: a dot product along ``dim`` (of the broadcast operands) per output element."""
    return numel(result) * broadcast_shape(shape_of(x), shape_of(y))[dim], 0


@by_name
def bilinear_cost(input1: Any, input2: Any, bias: Any, *, result: Any) -> tuple[int, int]:
    """``bilinear(input1, input2, weight, bias)`` (``nn.Bilinear``): ``x1ᵀ·A_o·x2 + b_o`` per output feature, counted
    in one order of it — a linear layer over the outer product ``x1 ⊗ x2``: ``in1·in2`` multiply-adds per output
    element, plus the outer product's multiplies (one per row and pair) and the bias adds."""
    in1, in2 = shape_of(input1)[-1], shape_of(input2)[-1]
    rows = prod(shape_of(result)[:-1])
    return numel(result) * in1 * in2, rows * in1 * in2 + _output_terms(result, get_shape(bias) is not None)


@by_name
def trilinear_cost(i1: Any, i2: Any, i3: Any, expand1: list[int], expand2: list[int], expand3: list[int], *,
                   result: Any) -> tuple[int, int]:
    """``_trilinear`` (what ``bilinear`` runs, and its backward's gradients): the sum over ``sumdim`` of the product
    of three operands, each unsqueezed at its ``expand`` dimensions: one multiply-add per term of the sum, the
    elements of the three operands' broadcast shape (the product of two of them counted as shared along the third's
    own dimensions, as in ``bilinear``'s outer product)."""
    shapes = [_unsqueezed(shape_of(x), expand) for x, expand in ((i1, expand1), (i2, expand2), (i3, expand3))]
    return prod(broadcast_shape(*shapes)), 0


def _unsqueezed(shape: list[int], dims: list[int]) -> list[int]:
    """``shape`` with a size 1 inserted at each of ``dims`` (in increasing order), as ``unsqueeze`` would."""
    shape = list(shape)
    for dim in sorted(dims):
        shape.insert(dim, 1)
    return shape


@by_name(mat1=("batch1", "mat"))
def addmm_cost(mat1: Any, beta: Any, alpha: Any, *, result: Any) -> tuple[int, int]:
    """``addmm``/``baddbmm``/``addmv``: ``beta·self + alpha·(mat1 @ mat2)``.

    Extra flops per output element: the add (``beta != 0``), ``beta``'s multiply (``beta`` not 0 or 1)
    and ``alpha``'s multiply (``alpha != 1``).
    """
    return numel(result) * shape_of(mat1)[-1], _scaled_terms(result, beta, alpha)


@by_name
def addbmm_cost(batch1: Any, beta: Any, alpha: Any, *, result: Any) -> tuple[int, int]:
    """``addbmm(self, batch1, batch2, *, beta, alpha)``: the batch of products summed into one matrix."""
    a = shape_of(batch1)
    return numel(result) * a[0] * a[-1], _scaled_terms(result, beta, alpha)


@by_name
def addr_cost(beta: Any, alpha: Any, *, result: Any) -> tuple[int, int]:
    """``addr(self, vec1, vec2, *, beta, alpha)``: ``beta·self + alpha·(vec1 ⊗ vec2)``. The outer product is a
    product whose contracted dimension has size 1 (``addmm`` of an ``(M, 1)`` and a ``(1, N)`` matrix): one
    multiply-add per output element, and ``addmm``'s extra terms."""
    return numel(result), _scaled_terms(result, beta, alpha)


def _scaled_terms(result: Any, beta: Any, alpha: Any) -> int:
    """The extra flops of ``beta·self + alpha·product`` per output element: the add (``beta != 0``), ``beta``'s
    multiply (``beta`` not 0 or 1) and ``alpha``'s multiply (``alpha != 1``)."""
    beta, alpha = _scalar(beta), _scalar(alpha)
    return _output_terms(result, beta != 0, beta not in (0, 1), alpha != 1)


def _grouped_macs(a: list[int], b: list[int], out: Any) -> int:
    """Each row of ``a`` meets one group's matrix. With two 2-D operands the groups split the contracted
    dimension: ``M·N·K`` in all; otherwise every output element is a dot product over ``a[-1]``."""
    return a[0] * a[1] * b[1] if len(a) == 2 and len(b) == 2 else numel(out) * a[-1]


@by_name
def grouped_mm_cost(self: Any, mat2: Any, bias: Any, *, result: Any) -> tuple[int, int]:
    """``_grouped_mm(self, mat2, offs, bias)`` (mixture-of-experts); bias: 1 add per output."""
    macs = _grouped_macs(shape_of(self), shape_of(mat2), result)
    return macs, _output_terms(result, get_shape(bias) is not None)


@by_name
def scaled_mm_cost(self: Any, bias: Any, *, result: Any) -> tuple[int, int]:
    """``_scaled_mm(self, mat2, scale_a, scale_b, bias, ...)`` (fp8): ``M·N·K``; dequantising scale and bias 1 each."""
    macs = numel(result) * shape_of(self)[-1]
    return macs, _output_terms(result, True, get_shape(bias) is not None)


@by_name
def scaled_grouped_mm_cost(self: Any, mat2: Any, bias: Any, *, result: Any) -> tuple[int, int]:
    """``_scaled_grouped_mm(self, mat2, scale_a, scale_b, offs, bias, ...)``: grouped product, scale and bias."""
    macs = _grouped_macs(shape_of(self), shape_of(mat2), result)
    return macs, _output_terms(result, True, get_shape(bias) is not None)


@by_name(self="inp")
def dequantized_mm_cost(self: Any, *, result: Any) -> tuple[int, int]:
    """Products of a weight stored as 8- or 4-bit integers (``_weight_int8pack_mm``, ``_weight_int4pack_mm``,
    ``_dyn_quant_matmul_4bit``): ``M·N·K``; the dequantising scale 1 per output element, as ``_scaled_mm``'s."""
    return numel(result) * shape_of(self)[-1], numel(result)


@by_name(x="X")
def quantized_linear_cost(x: Any, *, result: Any) -> tuple[int, int]:
    """``quantized::linear(X, W_prepack, ...)``, its fused activations and its dynamic forms (int8 and float16
    weights): in_features from ``X`` (the weight is packed).

    Requantisation and bias cost 2 per output element.
    """
    return numel(result) * shape_of(x)[-1], 2 * numel(result)


def _quantized_conv(transposed: bool) -> Formula[tuple[int, int]]:
    """The formula of the quantized convolutions, or of the transposed ones."""

    @by_name(weight="packed_weight")
    def cost(qx: Any, weight: Any, *, result: Any) -> tuple[int, int]:
        """``quantized::conv{1,2,3}d(qx, weight, ...)``, ``conv2d_add``, the fused ReLUs and ``conv_transpose{1,2,3}d``
        (counted per input position): needs the packed weight described as a tensor.

        A 1-D convolution's weight is packed as a 2-D one's, with a kernel height of 1 (its input and output have no
        such dimension). Requantisation and bias cost 2 per output element.
        """
        x, w = shape_of(qx), list(shape_of(weight))
        if len(w) == len(x) + 1 and w[2] == 1:  # a 1-D convolution's (its input always has a batch dimension)
            del w[2]
        return conv_macs(_batched(x, w), w, _batched(shape_of(result), w), transposed), 2 * numel(result)

    return cost


quantized_conv_cost = _quantized_conv(transposed=False)
quantized_conv_transpose_cost = _quantized_conv(transposed=True)


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


# operator -> (its cost formula, the key of its count: None for the operator's short name)
COSTS: dict[str, tuple[Formula[tuple[int, int]], str | None]] = {
    **{op: (convolution_cost, "conv") for op in ("aten::convolution", "aten::_convolution")},
    "aten::convolution_backward": (convolution_backward_cost, None),
    "aten::linear": (linear_cost, None),
    **{f"aten::{op}": (matmul_cost, None) for op in ("matmul", "mm", "bmm", "mv", "dot", "vdot", "_int_mm")},
    **{f"aten::{op}": (addmm_cost, None) for op in ("addmm", "baddbmm", "addmv")},
    "aten::linalg_vecdot": (vecdot_cost, None),
    "aten::bilinear": (bilinear_cost, None),
    "aten::_trilinear": (trilinear_cost, None),
    "aten::addbmm": (addbmm_cost, None),
    "aten::addr": (addr_cost, None),
    "aten::_grouped_mm": (grouped_mm_cost, None),
    "aten::_scaled_mm": (scaled_mm_cost, None),
    "aten::_scaled_grouped_mm": (scaled_grouped_mm_cost, None),
    **{f"aten::{op}": (dequantized_mm_cost, None) for op in (
        "_weight_int8pack_mm", "_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu", "_dyn_quant_matmul_4bit")},
    **{f"quantized::{op}": (quantized_linear_cost, None) for op in (
        "linear", "linear_relu", "linear_leaky_relu", "linear_tanh", "linear_dynamic", "linear_relu_dynamic",
        "linear_dynamic_fp16", "linear_relu_dynamic_fp16", "linear_with_input_q_dq_qweight_dq_output_fp32",
        "linear_with_input_q_dq_qweight_dq_relu_output_fp32")},
    **{f"quantized::conv{d}d{relu}": (quantized_conv_cost, "conv") for d in (1, 2, 3) for relu in ("", "_relu")},
    **{f"quantized::conv2d_add{relu}": (quantized_conv_cost, "conv") for relu in ("", "_relu")},
    **{f"quantized::conv_transpose{d}d": (quantized_conv_transpose_cost, "conv") for d in (1, 2, 3)},
    "quantized::matmul": (matmul_cost, None),
}


def handles(convention: str, dense_attention: bool = False) -> dict[str, Handle | CountInside | None]:
    """The product operators' table under ``convention`` (``dense_attention`` does not apply to products)."""
    wrap = _real_flops if convention == "flops" else _multiply_adds
    if convention not in ("fvcore", "macs", "flops"):
        raise InvalidValueError(f"unknown convention {convention!r}")
    table: dict[str, Handle | CountInside | None] = {
        op: wrap(cost.bind(op), key) for op, (cost, key) in COSTS.items()}
    table["aten::einsum"] = CountInside("einsum")
    return table
