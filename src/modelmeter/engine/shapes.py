"""Shape arithmetic on plain sizes, shared by the meta kernels (engine) and the counting handles (handles)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidValueError


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    """The shape ``shapes`` broadcast to, as ``torch.broadcast_shapes`` gives it: aligned at their last dimension,
    a size 1 stretching to the other sizes of its dimension (a 0 too); :class:`InvalidValueError` when two sizes of
    one dimension differ and neither is 1, where torch raises. (Written here: torch's checks the sizes with
    ``torch._check``, whose first call imports sympy, and wants a tensor's sizes, not a trace's lists.)"""
    rank = max(map(len, shapes), default=0)
    result = [1] * rank
    for shape in shapes:
        for dim, size in enumerate(shape, rank - len(shape)):
            if size == 1 or size == result[dim]:
                continue
            if result[dim] != 1:
                raise InvalidValueError(f"the shapes {', '.join(str(tuple(s)) for s in shapes)} do not broadcast: "
                                        f"sizes {result[dim]} and {size} at dimension {dim - rank}")
            result[dim] = size
    return tuple(result)
