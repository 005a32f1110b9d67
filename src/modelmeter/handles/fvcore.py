"""Formulas of the fvcore convention: one fused multiply-add counts as one flop.

Each formula reads the arguments of one recorded call by their schema names (:mod:`.binding`; tensors as
metadata with ``.shape``) and returns a count. ``FLOP_HANDLES`` and ``ACTIVATION_HANDLES`` at the bottom
map operator names to them, one line per operator family, bound into fvcore's ``handle(inputs, outputs)``;
products and attention (forward and backward) come from :mod:`.products` and :mod:`.attention`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from . import attention, products
from .attention import encoder_layer_activation, native_mha_activation, sdpa_activation
from .base import CountInside, Handle, get_shape, numel
from .binding import Formula, bind_all, by_name


# --- normalisation, resampling, pooling --------------------------------------------------------
@by_name
def norm_flop(input: Any, weight: Any) -> int:
    """``group_norm``, ``layer_norm``, ``instance_norm``: 5 flops per element with an affine weight, 4 without
    (fvcore's estimate)."""
    return numel(input) * (5 if get_shape(weight) is not None else 4)


@by_name
def batchnorm_flop(input: Any, weight: Any, training: Any) -> int:
    """``batch_norm``: training as a norm (5 per element, 4 without affine); eval 2 (1 without affine)."""
    affine = get_shape(weight) is not None
    if training:
        return numel(input) * (5 if affine else 4)
    return numel(input) * (2 if affine else 1)


def elementwise_flop_counter(input_scale: float = 1, output_scale: float = 0) -> Formula[float]:
    """``input_scale`` flops per input element plus ``output_scale`` per output element."""

    @by_name(self="input")
    def elementwise_flop(self: Any, *, result: Any) -> float:
        total: float = 0
        if input_scale:
            total += input_scale * numel(self)
        if output_scale:
            total += output_scale * numel(result)
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


# --- fvcore's operator names ---------------------------------------------------------------------
# torch.jit records a custom autograd Function as ``prim::PythonOp`` and fvcore keys it by its class name.
PYTHON_OP = "prim::PythonOp"
# The user-level convolutions, which torch.jit records (and fvcore names) as the ``aten::_convolution`` they run
# (``aten::_convolution_mode`` for ``conv{1,2,3}d`` with a string padding); the recorder sees ``aten::convolution``.
CONVOLUTION_CALLS = frozenset(f"aten::{name}" for name in (
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"))
# ``_convolution``'s arguments after ``convolution``'s: benchmark, deterministic, cudnn_enabled, allow_tf32.
_CONVOLUTION_FLAGS = (False, False, True, True)


@by_name
def _padding(padding: Any = None) -> Any:
    """The ``padding`` of a user-level convolution call (a string: ``conv2d(..., padding="same")``)."""
    return padding


def fvcore_alias(event: Any, parent: Any) -> tuple[str, list[Any]] | None:
    """fvcore's name for a recorded ``aten::convolution`` (run by the user-level call ``parent``, or None), with
    the arguments fvcore's handle gets: ``aten::_convolution``'s thirteen, or — for a string padding —
    ``aten::_convolution_mode``'s, the user-level call's own. None for any other operator: its name is fvcore's."""
    if event.op != "aten::convolution" or event.level != "dispatch":
        return None
    from_call = parent is not None and parent.op in CONVOLUTION_CALLS
    if from_call and isinstance(_padding.bind(parent.op)(parent.inputs, parent.outputs), str):
        return "aten::_convolution_mode", parent.inputs
    return "aten::_convolution", [*event.inputs, *_CONVOLUTION_FLAGS[max(0, len(event.inputs) - 9):]]


_conv_ops = ("aten::convolution", "aten::_convolution")
_products = ("linear", "addmm", "baddbmm", "matmul", "mm", "bmm", "_grouped_mm", "einsum")

FLOP_HANDLES: dict[str, Handle | CountInside | None] = bind_all({
    **products.handles("fvcore"),
    **attention.handles("fvcore"),
    "aten::batch_norm": batchnorm_flop,
    **{f"aten::{op}": norm_flop for op in ("group_norm", "layer_norm", "instance_norm")},
    **{f"aten::upsample_nearest{d}d": elementwise_flop_counter(0, 1) for d in (1, 2, 3)},
    **{f"aten::_upsample_nearest_exact{d}d": elementwise_flop_counter(0, 1) for d in (1, 2, 3)},
    "aten::upsample_bilinear2d": elementwise_flop_counter(0, 4),
    **{f"aten::adaptive_avg_pool{d}d": elementwise_flop_counter(1, 0) for d in (1, 2, 3)},
    "aten::grid_sampler": elementwise_flop_counter(0, 4),
})

ACTIVATION_HANDLES: dict[str, Handle | CountInside] = bind_all({
    **{op: _keyed("conv", generic_activation) for op in _conv_ops},
    **{f"aten::{op}": generic_activation for op in _products},
    "aten::scaled_dot_product_attention": sdpa_activation,
    "aten::_native_multi_head_attention": native_mha_activation,
    "aten::_transformer_encoder_layer_fwd": encoder_layer_activation,
})
