"""What a handle is: a small pure formula from an operator call's metadata to a count."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Union

from ..errors import InvalidTypeError

# handle(inputs, outputs) -> a number (keyed by the operator's short name) or a Counter of its own keys.
Handle = Callable[[list[Any], list[Any]], Union[int, float, "Counter[str]"]]


def get_shape(value: Any) -> list[int] | None:
    """The shape of a tensor argument as a list, or None for anything that is not a tensor.

    Named as in fvcore, so handles written for fvcore port unchanged.
    """
    shape = getattr(value, "shape", None)
    return None if shape is None else list(shape)


def prod(values: Iterable[int]) -> int:
    return math.prod(values)


def shape_of(value: Any) -> list[int]:
    """The shape of an argument that must be a tensor."""
    shape = get_shape(value)
    if shape is None:
        raise InvalidTypeError(f"expected a tensor argument, got {type(value).__name__}")
    return shape


def numel(value: Any) -> int:
    return prod(shape_of(value))


@dataclass(frozen=True)
class CountInside:
    """A table entry that counts the operators a call ran, under the call's own key.

    ``torch.einsum`` runs as a sequence of batched matrix products; counting those gives the exact
    cost of whatever contraction order torch chose, reported as ``einsum``.
    """

    key: str


def backward_key(op: str) -> str:
    """The table key of a formula for the whole backward pass of a user-level call ``op``.

    When a table has one, every backward operator run by an autograd node that the call made is covered by it
    (counted once, from the forward call's metadata) instead of being counted operator by operator: attention's
    masked pairs, say, are known from the forward call, not from the dense products a math kernel runs.
    """
    return f"backward:{op}"
