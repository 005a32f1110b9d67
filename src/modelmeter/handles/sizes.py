"""Bytes of tensors as a trace describes them: element sizes by dtype name, broadcast dimensions counted once."""

from __future__ import annotations

from typing import Any

from ..engine.trace import TensorMeta
from ..errors import InvalidValueError

# Bytes per element of every dtype torch has (``torch.dtype.itemsize``, as recorded by name in a trace; checked
# against torch in the tests). Sub-byte types (``int4``, ``uint1`` ... ``uint7``, ``bits``) take a byte each, as
# torch stores them; ``float4_e2m1fn_x2`` and ``quint4x2`` pack two values in one byte.
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1,
    "complex128": 16, "complex64": 8, "complex32": 4, "bcomplex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    **{f"int{bits}": 1 for bits in range(1, 8)}, **{f"uint{bits}": 1 for bits in range(1, 8)},
    "qint32": 4, "qint8": 1, "quint8": 1, "quint4x2": 1, "quint2x4": 1,
    "bits16": 2, "bits8": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (``"float32"``); a :class:`ValueError` naming a dtype it does not know."""
    try:
        return ITEMSIZE[dtype]
    except KeyError:
        raise InvalidValueError(f"the bytes metric does not know the element size of dtype {dtype!r}") from None


def elements(meta: TensorMeta) -> int:
    """Distinct elements of a tensor in memory: a broadcast (stride-0) dimension counts once."""
    return meta.numel() if meta.footprint is None else meta.footprint


def tensor_bytes(meta: TensorMeta) -> int:
    """Bytes of one tensor argument at its dtype, a broadcast dimension read once."""
    return elements(meta) * itemsize(meta.dtype)


def all_bytes(values: list[Any]) -> int:
    """Bytes of every tensor in ``values`` (lists of tensors, as ``cat`` and ``_foreach_*`` take, walked)."""
    total = 0
    for value in values:
        if isinstance(value, TensorMeta):
            total += tensor_bytes(value)
        elif isinstance(value, list):
            total += all_bytes(value)
    return total
