"""Bytes a kernel moves: what it reads plus what it writes (docs/handles.md, "Bytes").

SKELETON (issue 18): the bytes helper adds the families' rules; only the generic rule is here.
"""

from __future__ import annotations

from typing import Any

from ..engine.trace import TensorMeta

_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}


def tensor_bytes(meta: TensorMeta) -> int:
    """Bytes of one tensor argument at its dtype."""
    return meta.numel() * _ITEMSIZE.get(meta.dtype, 4)


def _all_bytes(values: list[Any]) -> int:
    total = 0
    for value in values:
        if isinstance(value, TensorMeta):
            total += tensor_bytes(value)
        elif isinstance(value, list):
            total += _all_bytes(value)
    return total


def kernel_bytes(inputs: list[Any], outputs: list[Any]) -> int:
    """The generic rule: every tensor input read once, every output written once."""
    return _all_bytes(inputs) + _all_bytes(outputs)


def traffic_table(attention_kernel: str = "fused") -> dict[str, Any]:
    """Operators whose bytes differ from the generic rule (``None``: moves nothing)."""
    return {}
