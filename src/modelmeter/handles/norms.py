"""Normalisation layers, forward and backward: batch, layer, group, instance and RMS norm.

``flops`` convention, by the textbook formulas counted with the rules of :mod:`.reductions` (a
reduction costs one flop per input element, an element-wise step one per element it produces); ``n``
input elements, ``g`` normalised groups (rows of a layer norm, channels of a batch norm, ``N·groups``
of a group norm, ``N·C`` of an instance norm, which runs as a batch norm):

- with batch statistics: mean ``n + g``, subtract ``n``, square ``n``, mean ``n + g``, add eps and
  reciprocal square root ``2g``, scale ``n``: **``5n + 4g``**, plus ``n`` for a weight and ``n`` for a bias;
- batch norm with running statistics (eval): ``(x - mean) · rsqrt(var + eps)``: **``2n + 2C``** + affine;
  updating the running statistics (``C``-sized) is not counted;
- RMS norm ``x · rsqrt(mean(x²) + eps)``: **``3n + 3g``**, plus ``n`` for a weight;
- backward, for the outputs ``output_mask`` asks for: re-normalise ``x̂`` ``2n`` (RMS: ``n``); input
  gradient ``dx = rstd · (dx̂ - mean(dx̂) - x̂ · mean(dx̂ · x̂))`` with ``dx̂ = g · w``: **``7n + 2g``** plus ``n``
  with a weight (RMS: ``rstd · (dx̂ - x̂ · mean(dx̂ · x̂))``: ``5n + g`` + ``n``); weight gradient
  ``sum(g · x̂)``: ``2n``; bias gradient ``sum(g)``: ``n``. Eval batch norm: ``dx = g · w · rstd``: ``n + 3C``.

``fvcore``: fvcore's estimates, forward as in :mod:`.fvcore` (5 per element with an affine weight, 4
without; eval batch norm 2 and 1), the same per-element estimate for each backward operator; RMS norm
is free (fvcore has no handle for it). ``macs``: all free.
"""

from __future__ import annotations

from typing import Any

from .base import Handle, get_shape, prod, shape_of
from .binding import bind_all, by_name
from .common import Table, by_convention, float_numel


def _given(value: Any) -> bool:
    """True for a tensor argument that was passed (an optional weight or bias)."""
    return get_shape(value) is not None


def _mask(value: Any, size: int = 3) -> list[bool]:
    """An ``output_mask`` argument; every gradient when the call did not say."""
    return [bool(v) for v in value] if isinstance(value, (list, tuple)) else [True] * size


def _flag(value: Any) -> bool:
    """A ``training`` flag; a call without one (``_batch_norm_with_update``) uses batch statistics."""
    return value if isinstance(value, bool) else True


def _channels(x: Any) -> int:
    shape = shape_of(x)
    return shape[1] if len(shape) > 1 else 1


def _rows(x: Any, normalized_shape: Any) -> int:
    """Rows of a layer (or RMS) norm: one per group of ``normalized_shape`` elements."""
    return float_numel(x) // max(prod(normalized_shape), 1)


def _stats_flops(n: int, groups: int, weight: bool, bias: bool) -> int:
    """Normalise with statistics computed over ``n / groups`` elements per group, then the affine terms."""
    return 5 * n + 4 * groups + n * weight + n * bias


def _stats_backward_flops(n: int, groups: int, weight: bool, mask: list[bool]) -> int:
    """Backward of a normalisation with batch statistics, for the gradients ``mask`` asks for."""
    grad_input, grad_weight, grad_bias = mask
    total = 2 * n if grad_input or grad_weight else 0
    if grad_input:
        total += 7 * n + 2 * groups + n * weight
    return total + 2 * n * (grad_weight and weight) + n * grad_bias


@by_name
def batch_norm_flops(input: Any, weight: Any, bias: Any, training: Any = True) -> int:
    """``native_batch_norm``/``_native_batch_norm_legit``/``_batch_norm_with_update``/``cudnn_batch_norm``
    (training: statistics per channel) and the eval forms (running statistics)."""
    return _batch_norm(input, _given(weight), _given(bias), _flag(training))


@by_name
def batch_norm_eval_flops(input: Any, weight: Any, bias: Any) -> int:
    """``_native_batch_norm_legit_no_training``/``_batch_norm_no_update``: running statistics."""
    return _batch_norm(input, _given(weight), _given(bias), False)


def _batch_norm(x: Any, weight: bool, bias: bool, training: bool) -> int:
    n, c = float_numel(x), _channels(x)
    if training:
        return _stats_flops(n, c, weight, bias)
    return 2 * n + 2 * c + n * weight + n * bias


@by_name(train="update")
def batch_norm_backward_flops(input: Any, weight: Any, train: Any, output_mask: Any) -> int:
    """``native_batch_norm_backward(grad_out, input, weight, ..., train, eps, output_mask)`` and
    ``batch_norm_backward`` (its ``update`` flag)."""
    n, c = float_numel(input), _channels(input)
    affine, mask = _given(weight), _mask(output_mask)
    if _flag(train):
        return _stats_backward_flops(n, c, affine, mask)
    grad_input, grad_weight, grad_bias = mask
    return (grad_input * (n + 2 * c + c * affine) + 4 * n * (grad_weight and affine) + n * grad_bias)


@by_name
def cudnn_batch_norm_backward_flops(input: Any) -> int:
    """``cudnn_batch_norm_backward(input, grad_output, weight, ...)``: training statistics, every gradient."""
    return _stats_backward_flops(float_numel(input), _channels(input), True, [True, True, True])


@by_name
def layer_norm_flops(input: Any, normalized_shape: Any, weight: Any, bias: Any) -> int:
    """``native_layer_norm(input, normalized_shape, weight, bias, eps)``: one group per row."""
    return _stats_flops(float_numel(input), _rows(input, normalized_shape), _given(weight), _given(bias))


@by_name
def layer_norm_backward_flops(input: Any, normalized_shape: Any, weight: Any, bias: Any, output_mask: Any) -> int:
    """``native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask)``."""
    mask = _mask(output_mask)
    mask[2] = mask[2] and _given(bias)
    return _stats_backward_flops(float_numel(input), _rows(input, normalized_shape), _given(weight), mask)


@by_name
def group_norm_flops(input: Any, weight: Any, bias: Any, N: int, group: int) -> int:
    """``native_group_norm(input, weight, bias, N, C, HxW, group, eps)``: ``N · group`` groups."""
    return _stats_flops(float_numel(input), N * group, _given(weight), _given(bias))


@by_name
def group_norm_backward_flops(input: Any, weight: Any, N: int, group: int, output_mask: Any) -> int:
    """``native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, output_mask)``."""
    return _stats_backward_flops(float_numel(input), N * group, _given(weight), _mask(output_mask))


@by_name
def rms_norm_flops(input: Any, normalized_shape: Any, weight: Any) -> int:
    """``_fused_rms_norm(input, normalized_shape, weight, eps)``: ``3n + 3·rows``, ``+ n`` with a weight."""
    n = float_numel(input)
    return 3 * n + 3 * _rows(input, normalized_shape) + n * _given(weight)


@by_name
def rms_norm_backward_flops(input: Any, normalized_shape: Any, weight: Any, output_mask: Any) -> int:
    """``_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, output_mask)``."""
    n = float_numel(input)
    grad_input, grad_weight = _mask(output_mask, 2)
    affine = _given(weight)
    total = n if grad_input or grad_weight else 0
    if grad_input:
        total += 5 * n + _rows(input, normalized_shape) + n * affine
    return total + 2 * n * (grad_weight and affine)


@by_name
def weight_norm_flops(v: Any, g: Any) -> int:
    """``_weight_norm_interface(v, g, dim)``, ``w = v · g / ‖v‖`` (a norm per slice of ``dim``): the norm ``2n + rows``,
    ``g / ‖v‖`` ``rows``, the scale ``n``: **``3n + 2·rows``** (``rows = numel(g)``), what its CPU decomposition
    (``norm``, ``div``, ``mul``, taken when ``dim`` is neither the first nor the last) counts."""
    return 3 * float_numel(v) + 2 * float_numel(g)


@by_name
def weight_norm_backward_flops(saved_v: Any, saved_g: Any) -> int:
    """``_weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim)``, both gradients: ``a =
    sum(grad_w · v)`` ``2n``; ``grad_g = a / ‖v‖`` ``rows``; ``grad_v = (g / ‖v‖) · (grad_w - v · a / ‖v‖²)``
    ``3n + 3·rows``: **``5n + 4·rows``**."""
    return 5 * float_numel(saved_v) + 4 * float_numel(saved_g)


# --- fvcore's estimates, per element of the normalised tensor ------------------------------------
@by_name(training=("train", "update"))
def fvcore_norm(input: Any, weight: Any, training: Any = True) -> int:
    """fvcore's estimate: 5 per element with an affine weight, 4 without; with running statistics (a batch norm's
    ``training`` flag off) 2 and 1. Backward operators get their forward's estimate, per element of ``input``."""
    return _fvcore_estimate(float_numel(input), _given(weight), _flag(training))


@by_name
def fvcore_eval_batch_norm(input: Any, weight: Any) -> int:
    """fvcore's estimate of a batch norm with running statistics: 2 per element with an affine weight, 1 without."""
    return _fvcore_estimate(float_numel(input), _given(weight), False)


def _fvcore_estimate(n: int, affine: bool, training: bool) -> int:
    return n * ((5 if affine else 4) if training else (2 if affine else 1))


_TRAINING_BN = ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                "_batch_norm_with_update", "_batch_norm_with_update_functional", "cudnn_batch_norm",
                "miopen_batch_norm")
_EVAL_BN = ("_native_batch_norm_legit_no_training", "_batch_norm_no_update")

FLOPS: dict[str, Handle | None] = bind_all({
    **{f"aten::{op}": batch_norm_flops for op in _TRAINING_BN},
    **{f"aten::{op}": batch_norm_eval_flops for op in _EVAL_BN},
    **{f"aten::{op}": batch_norm_backward_flops for op in ("native_batch_norm_backward", "batch_norm_backward")},
    **{f"aten::{op}": cudnn_batch_norm_backward_flops for op in ("cudnn_batch_norm_backward",
                                                                  "miopen_batch_norm_backward")},
    "aten::native_layer_norm": layer_norm_flops,
    "aten::native_layer_norm_backward": layer_norm_backward_flops,
    "aten::native_group_norm": group_norm_flops,
    "aten::native_group_norm_backward": group_norm_backward_flops,
    "aten::_fused_rms_norm": rms_norm_flops,
    "aten::_fused_rms_norm_backward": rms_norm_backward_flops,
    "aten::_weight_norm_interface": weight_norm_flops,
    "aten::_weight_norm_interface_backward": weight_norm_backward_flops,
})

FVCORE: dict[str, Handle] = bind_all({
    **{f"aten::{op}": fvcore_norm for op in _TRAINING_BN},
    **{f"aten::{op}": fvcore_eval_batch_norm for op in _EVAL_BN},
    **{f"aten::{op}": fvcore_norm for op in ("native_batch_norm_backward", "batch_norm_backward",
                                             "cudnn_batch_norm_backward", "miopen_batch_norm_backward")},
    **{f"aten::{op}": fvcore_norm for op in ("native_layer_norm", "native_layer_norm_backward",
                                             "native_group_norm", "native_group_norm_backward")},
})


def handles(convention: str) -> Table:
    """Normalisation operators under ``convention``."""
    return by_convention(convention, FLOPS, fvcore=FVCORE)
