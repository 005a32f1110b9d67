"""What an operator expected of its input, read from the arguments of the call that failed.

A model given the wrong input fails deep inside torch (``Invalid channel dimensions``, ``a and b must have same
reduction dim``). The operators that take a module's parameters say what fits them: a convolution's weight fixes
the input's channels and rank, a linear layer's weight its last dimension, an embedding takes integer ids, a norm's
weight or ``normalized_shape`` fixes its channels or last dimensions, a product's or a norm's weight the input's
dtype, a classification loss wants class indices of int64. Each rule reads the recorded call
(:class:`OpEvent` inputs in schema order, tensors as :class:`TensorMeta`) and returns "expected ..., got ..."
when the input does not fit, None when it does (the failure is then something else, reported as it is).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from .trace import OpEvent, TensorMeta

_SPATIAL = {1: "L", 2: "H, W", 3: "D, H, W"}
_INTEGER_IDS = ("int64", "int32")
_REDUCED = ("float16", "bfloat16")
_TOKEN_IDS = "integer token ids of shape (batch, seq)"


def mismatch(event: OpEvent) -> str | None:
    """Why ``event``'s input does not fit the parameters it was called with, or None."""
    rule = _RULES.get(event.op)
    if rule is None or not all(isinstance(_argument(event.inputs, i, None), TensorMeta) for i in rule.tensors):
        return None
    return rule.check(event.inputs)


def token_ids_mismatch(events: Sequence[OpEvent]) -> tuple[int, str] | None:
    """The model's first embedding lookup, and what it expected, when its ids have more dimensions than
    ``(batch, seq)``: it succeeds on any shape, and the model fails later (an image given to a language model
    fails in its attention). None when the first lookup took ids of at most two dimensions, or there is none."""
    for index, event in enumerate(events):
        if event.op == "aten::embedding" and event.level == "function":
            ids = event.inputs[1] if len(event.inputs) > 1 else None
            if isinstance(ids, TensorMeta) and ids.dim() > 2:
                return index, f"expected {_TOKEN_IDS}, got {ids.dtype} of shape {_shape(ids)}"
            return None
    return None


def _shape(tensor: TensorMeta) -> str:
    return "x".join(map(str, tensor.shape)) if tensor.shape else "() (a scalar)"


def _argument(inputs: list[Any], index: int, default: Any) -> Any:
    return inputs[index] if len(inputs) > index and inputs[index] is not None else default


def _dtype(x: TensorMeta, weight: TensorMeta) -> str | None:
    """An input in another dtype than the floating-point weight it meets (a product takes one dtype)."""
    if weight.is_floating_point and x.dtype != weight.dtype:
        return f"expected {weight.dtype} inputs (the dtype of its weight), got {x.dtype}"
    return None


def _norm_dtype(x: TensorMeta, parameters: list[TensorMeta]) -> str | None:
    """A norm's input is floating-point, in its parameters' dtype; beside float32 parameters, float16 and bfloat16
    inputs fit too (the CPU's mixed-precision norms)."""
    if not x.is_floating_point:
        return f"expected floating-point inputs, got {x.dtype}"
    dtypes = {p.dtype for p in parameters}
    if len(dtypes) != 1 or x.dtype in dtypes or (dtypes == {"float32"} and x.dtype in _REDUCED):
        return None
    dtype = dtypes.pop()
    reduced = ", or float16 or bfloat16" if dtype == "float32" else ""
    return f"expected {dtype} inputs (the dtype of its parameters{reduced}), got {x.dtype}"


def _tensors_at(inputs: list[Any], *slots: int) -> list[TensorMeta]:
    return [inputs[i] for i in slots if isinstance(_argument(inputs, i, None), TensorMeta)]


def _convolution(transposed: bool, groups_at: int) -> Callable[[list[Any]], str | None]:
    def rule(inputs: list[Any]) -> str | None:
        x, weight = inputs[0], inputs[1]
        spatial = weight.dim() - 2
        if x.dim() not in (spatial + 1, spatial + 2):
            layout = f"(batch, channels, {_SPATIAL.get(spatial, '...')})"
            return (f"expected a {spatial + 2}-d input {layout} or a {spatial + 1}-d one without the batch, "
                    f"got shape {_shape(x)}")
        groups = _argument(inputs, groups_at, 1)
        channels = weight.shape[0] if transposed else weight.shape[1] * groups
        got = x.shape[x.dim() - spatial - 1]
        if got != channels:
            return f"expected {channels} input channels, got {got} (an input of shape {_shape(x)})"
        return _dtype(x, weight)

    return rule


def _transposed_convolution(inputs: list[Any]) -> str | None:
    """``aten::convolution``: transposed or not by its argument."""
    return _convolution(bool(_argument(inputs, 6, False)), 8)(inputs)


def _linear(inputs: list[Any]) -> str | None:
    x, weight = inputs[0], inputs[1]
    features = weight.shape[-1] if weight.dim() else 1
    got = x.shape[-1] if x.dim() else 1
    if got != features:
        return (f"expected last dimension {features} (the in_features of its {_shape(weight)} weight), got {got} "
                f"(an input of shape {_shape(x)})")
    return _dtype(x, weight)


def _embedding(inputs: list[Any]) -> str | None:
    ids = inputs[1]
    if ids.dtype not in _INTEGER_IDS:
        return f"expected {_TOKEN_IDS}, got {ids.dtype} of shape {_shape(ids)}"
    return None


def _layer_norm(inputs: list[Any]) -> str | None:
    x, normalized = inputs[0], tuple(_argument(inputs, 1, ()))
    if x.dim() < len(normalized) or tuple(x.shape[x.dim() - len(normalized):]) != normalized:
        last = "x".join(map(str, normalized))
        return f"expected an input whose last dimensions are {last}, got shape {_shape(x)}"
    return _norm_dtype(x, _tensors_at(inputs, 2, 3))


def _channels(weight_at: int, *others: int) -> Callable[[list[Any]], str | None]:
    """A norm over dimension 1 (batch, group, instance norm): the channels its weight or running statistics
    have, and their dtype."""
    def rule(inputs: list[Any]) -> str | None:
        x = inputs[0]
        sized = _tensors_at(inputs, weight_at, *others)
        if sized and (x.dim() < 2 or x.shape[1] != sized[0].shape[0]):
            return f"expected {sized[0].shape[0]} channels in dimension 1, got an input of shape {_shape(x)}"
        return _norm_dtype(x, sized)

    return rule


def _class_indices(inputs: list[Any]) -> str | None:
    """A classification loss's target: int64 class indices (uint8 too), or probabilities of the input's shape."""
    x, target = inputs[0], inputs[1]
    if target.is_floating_point or target.dtype in ("int64", "uint8"):
        return None
    return (f"expected a target of int64 class indices (or of class probabilities shaped as the {_shape(x)} "
            f"input), got {target.dtype} of shape {_shape(target)}")


class _Rule(NamedTuple):
    """How an operator's input is checked: ``check`` reads its arguments, which holds tensors at ``tensors`` (the
    input and the weight; a norm's input alone, its weight being optional)."""

    check: Callable[[list[Any]], str | None]
    tensors: tuple[int, ...] = (0, 1)


_INPUT = (0,)  # a norm's slots read as tensors
_RULES: dict[str, _Rule] = {
    **{f"aten::conv{n}d": _Rule(_convolution(False, 6)) for n in (1, 2, 3)},
    **{f"aten::conv_transpose{n}d": _Rule(_convolution(True, 6)) for n in (1, 2, 3)},
    "aten::convolution": _Rule(_transposed_convolution),
    "aten::_convolution": _Rule(_transposed_convolution),
    "aten::linear": _Rule(_linear),
    "aten::embedding": _Rule(_embedding),
    "aten::layer_norm": _Rule(_layer_norm, _INPUT),
    "aten::batch_norm": _Rule(_channels(1, 2, 3, 4), _INPUT),
    "aten::instance_norm": _Rule(_channels(1, 2, 3, 4), _INPUT),
    "aten::group_norm": _Rule(_channels(2, 3), _INPUT),
    "aten::cross_entropy": _Rule(_class_indices),
    "aten::nll_loss": _Rule(_class_indices),
}
