"""Element-wise operators: one flop per floating-point output element, with a few exceptions.

The rule (``flops`` convention only; element-wise work is free under ``fvcore`` and ``macs``): every
element-wise operator — arithmetic, comparisons of floating-point values, transcendental functions and
activations, forward or backward — costs **one flop per output element**, whatever its inner
implementation (the DeepSpeed profiler's rule for activations). Integer and boolean results are free.
The exceptions are operators that are several arithmetic steps by definition (``addcmul``: a product
and a sum) and the operators :mod:`.classify` keeps free everywhere else (``relu``, dropout).
"""

from __future__ import annotations

from typing import Any

from .base import Handle, numel
from .binding import bind_all, by_name
from .common import Table, by_convention, first_tensor, float_numel, is_floating


def elementwise_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """The default: one flop per floating-point element of the first output."""
    return float_numel(first_tensor(outputs))


def per_output_element(cost: int) -> Handle:
    """``cost`` flops per floating-point element of the first output."""

    def flops(inputs: list[Any], outputs: list[Any]) -> int:
        return cost * float_numel(first_tensor(outputs))

    flops.__doc__ = f"{cost} flops per floating-point output element."
    return flops


def comparison_flops(inputs: list[Any], outputs: list[Any]) -> int:
    """A comparison of floating-point values is one flop per (boolean) output element; of integers, free."""
    tensors = [v for v in inputs if getattr(v, "shape", None) is not None]
    scalars = [v for v in inputs if isinstance(v, float)]
    if not any(is_floating(t) for t in tensors) and not scalars:
        return 0
    out = first_tensor(outputs)
    return 0 if out is None else numel(out)


@by_name
def dropout_flops(train: Any = True, *, outputs: list[Any]) -> int:
    """``native_dropout(input, p, train)``: scale the kept mask by ``1/(1-p)`` and multiply, 2 per element
    (as its decomposition, ``bernoulli_``, ``div_``, ``mul``, counts); 0 when not training."""
    return 0 if train is False else 2 * float_numel(first_tensor(outputs))


_COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")

FLOPS: dict[str, Handle | None] = bind_all({
    # free in classify.FREE_OPS for fvcore and macs, but arithmetic: max(x, 0), x > t ? x : v
    **{f"aten::{op}": elementwise_flops for op in ("relu", "relu_", "threshold", "threshold_")},
    "aten::native_dropout": dropout_flops,
    "aten::native_dropout_backward": per_output_element(2),  # grad · mask · scale
    # several arithmetic steps by definition
    **{f"aten::{op}": per_output_element(2) for op in ("addcmul", "addcmul_", "addcdiv", "addcdiv_")},
    **{f"aten::{op}": per_output_element(3) for op in ("lerp", "lerp_")},  # a + w · (b - a)
    # comparisons give boolean results (free as integer-only) but compare floating-point values
    **{f"aten::{op}": comparison_flops for op in _COMPARISONS + tuple(f"{c}_" for c in _COMPARISONS)},
})


def handles(convention: str) -> Table:
    """The element-wise exceptions under ``convention``; the default rule is :func:`elementwise_flops`."""
    return by_convention(convention, FLOPS)
