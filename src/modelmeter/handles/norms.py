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
from .common import Table, by_convention, float_numel


def _has(inputs: list[Any], index: int) -> bool:
    return len(inputs) > index and get_shape(inputs[index]) is not None


def _mask(inputs: list[Any], index: int, size: int = 3) -> list[bool]:
    value = inputs[index] if len(inputs) > index else None
    return [bool(v) for v in value] if isinstance(value, (list, tuple)) else [True] * size


def _training(inputs: list[Any]) -> bool:
    """The ``training`` flag of a batch-norm call (position 5, or 3 for ``_native_batch_norm_legit.no_stats``)."""
    for index in (5, 3):
        if len(inputs) > index and isinstance(inputs[index], bool):
            return inputs[index]
    return True


def _channels(x: Any) -> int:
    shape = shape_of(x)
    return shape[1] if len(shape) > 1 else 1


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


def batch_norm_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """``native_batch_norm``/``_native_batch_norm_legit``/``_batch_norm_with_update``/``cudnn_batch_norm``
    (training: statistics per channel) and the eval forms (running statistics)."""
    return _batch_norm(inputs, _training(inputs))


def batch_norm_eval_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """``_native_batch_norm_legit_no_training``/``_batch_norm_no_update``: running statistics."""
    return _batch_norm(inputs, False)


def _batch_norm(inputs: list[Any], training: bool) -> int:
    n, c = float_numel(inputs[0]), _channels(inputs[0])
    weight, bias = _has(inputs, 1), _has(inputs, 2)
    if training:
        return _stats_flops(n, c, weight, bias)
    return 2 * n + 2 * c + n * weight + n * bias


def batch_norm_backward_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """``native_batch_norm_backward``/``batch_norm_backward(grad_out, input, weight, ..., train, eps, mask)``."""
    n, c = float_numel(inputs[1]), _channels(inputs[1])
    weight, mask = _has(inputs, 2), _mask(inputs, 9)
    training = inputs[7] if len(inputs) > 7 and isinstance(inputs[7], bool) else True
    if training:
        return _stats_backward_flops(n, c, weight, mask)
    grad_input, grad_weight, grad_bias = mask
    return (grad_input * (n + 2 * c + c * weight) + 4 * n * (grad_weight and weight) + n * grad_bias)


def cudnn_batch_norm_backward_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """``cudnn_batch_norm_backward(input, grad_output, weight, ...)``: training statistics, every gradient."""
    n = float_numel(inputs[0])
    return _stats_backward_flops(n, _channels(inputs[0]), True, [True, True, True])


def layer_norm_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """``native_layer_norm(input, normalized_shape, weight, bias, eps)``: one group per row."""
    n = float_numel(inputs[0])
    rows = n // max(prod(inputs[1]), 1)
    return _stats_flops(n, rows, _has(inputs, 2), _has(inputs, 3))


def layer_norm_backward_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """``native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask)``."""
    n = float_numel(inputs[1])
    rows = n // max(prod(inputs[2]), 1)
    mask = _mask(inputs, 7)
    mask[2] = mask[2] and _has(inputs, 6)
    return _stats_backward_flops(n, rows, _has(inputs, 5), mask)


def group_norm_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """``native_group_norm(input, weight, bias, N, C, HxW, group, eps)``: ``N · group`` groups."""
    return _stats_flops(float_numel(inputs[0]), inputs[3] * inputs[6], _has(inputs, 1), _has(inputs, 2))


def group_norm_backward_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """``native_group_norm_backward(grad_out, input, mean, rstd, weight, N, C, HxW, group, mask)``."""
    return _stats_backward_flops(float_numel(inputs[1]), inputs[5] * inputs[8], _has(inputs, 4), _mask(inputs, 9))


def rms_norm_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """``_fused_rms_norm(input, normalized_shape, weight, eps)``: ``3n + 3·rows``, ``+ n`` with a weight."""
    n = float_numel(inputs[0])
    rows = n // max(prod(inputs[1]), 1)
    return 3 * n + 3 * rows + n * _has(inputs, 2)


def rms_norm_backward_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """``_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, mask)``."""
    n = float_numel(inputs[1])
    rows = n // max(prod(inputs[2]), 1)
    grad_input, grad_weight = _mask(inputs, 5, 2)
    weight = _has(inputs, 4)
    total = n if grad_input or grad_weight else 0
    if grad_input:
        total += 5 * n + rows + n * weight
    return total + 2 * n * (grad_weight and weight)


# --- fvcore's estimates, per element of the normalised tensor ------------------------------------
def fvcore_norm_counter(input_index: int, weight_index: int, training: bool | None = True) -> Handle:
    """fvcore's estimate: 5 per element with an affine weight, 4 without; eval batch norm 2 and 1.

    ``training=None`` reads the flag of the call (batch norms).
    """

    def fvcore_norm(inputs: list[Any], outputs: list[Any]) -> int:
        train = _training(inputs) if training is None else training
        return _fvcore_estimate(float_numel(inputs[input_index]), _has(inputs, weight_index), train)

    return fvcore_norm


def _fvcore_estimate(n: int, affine: bool, training: bool) -> int:
    return n * ((5 if affine else 4) if training else (2 if affine else 1))


def fvcore_batch_norm_backward(inputs: list[Any], outputs: list[Any]) -> int:
    """fvcore's batch-norm estimate for its backward operator (training flag at position 7)."""
    train = inputs[7] if len(inputs) > 7 and isinstance(inputs[7], bool) else True
    return _fvcore_estimate(float_numel(inputs[1]), _has(inputs, 2), train)


_TRAINING_BN = ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                "_batch_norm_with_update", "_batch_norm_with_update_functional", "cudnn_batch_norm",
                "miopen_batch_norm")
_EVAL_BN = ("_native_batch_norm_legit_no_training", "_batch_norm_no_update")

FLOPS: dict[str, Handle | None] = {
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
}

FVCORE: dict[str, Handle] = {
    **{f"aten::{op}": fvcore_norm_counter(0, 1, None) for op in _TRAINING_BN},
    **{f"aten::{op}": fvcore_norm_counter(0, 1, False) for op in _EVAL_BN},
    **{f"aten::{op}": fvcore_batch_norm_backward for op in ("native_batch_norm_backward", "batch_norm_backward")},
    **{f"aten::{op}": fvcore_norm_counter(0, 2) for op in ("cudnn_batch_norm_backward",
                                                           "miopen_batch_norm_backward")},
    "aten::native_layer_norm": fvcore_norm_counter(0, 2),
    "aten::native_layer_norm_backward": fvcore_norm_counter(1, 5),
    "aten::native_group_norm": fvcore_norm_counter(0, 1),
    "aten::native_group_norm_backward": fvcore_norm_counter(1, 4),
}


def handles(convention: str) -> Table:
    """Normalisation operators under ``convention``."""
    return by_convention(convention, FLOPS, fvcore=FVCORE)
