"""Shared pieces of the per-family tables: metadata helpers and the convention switch.

Every family module (element-wise, reductions, norms, pooling, layers) exports
``handles(convention)``, built with :func:`by_convention` so that each of its operators has an entry
— a handle or ``None`` (known, costs 0) — in every convention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .base import CountInside, Handle, get_shape, prod, shape_of

Table = dict[str, "Handle | CountInside | None"]


def by_convention(convention: str, flops: Mapping[str, Handle | None], *, fvcore: Mapping[str, Handle] | None = None,
                  macs: Mapping[str, Handle] | None = None) -> Table:
    """One family's table under ``convention``: ``flops`` has every operator of the family; under
    ``fvcore`` and ``macs`` an operator costs 0 (``None``) unless the corresponding mapping has it."""
    if convention == "flops":
        return dict(flops)
    chosen = {"fvcore": fvcore, "macs": macs}[convention] or {}
    return {op: chosen.get(op) for op in flops}


def is_floating(value: Any) -> bool:
    """True for tensor metadata of a floating-point (or complex) dtype; metadata without a dtype counts."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return get_shape(value) is not None
    return str(dtype).removeprefix("torch.").startswith(("float", "bfloat", "complex"))


def first_tensor(values: list[Any]) -> Any:
    """The first tensor among ``values`` (lists walked), or None."""
    for value in values:
        if isinstance(value, (list, tuple)):
            found = first_tensor(list(value))
            if found is not None:
                return found
        elif get_shape(value) is not None:
            return value
    return None


def float_numel(value: Any) -> int:
    """Elements of a floating-point tensor; 0 for integer and boolean tensors and for non-tensors."""
    return prod(shape_of(value)) if value is not None and is_floating(value) else 0


def spatial(kernel: Any, dims: int) -> list[int]:
    """An int-or-list size argument (``kernel_size=2`` or ``[2]`` or ``[2, 3]``) expanded to ``dims`` values."""
    values = [int(kernel)] if isinstance(kernel, (int, float)) else [int(k) for k in kernel]
    return values * dims if len(values) == 1 else values


def window(kernel: Any, dims: int) -> int:
    """Elements in one pooling window of a ``dims``-dimensional kernel."""
    return prod(spatial(kernel, dims))

