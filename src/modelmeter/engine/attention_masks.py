"""Read how many (query, key) pairs an attention mask lets through, while its values exist.

The count is the one value-dependent fact a formula needs: masked attention (causal, sliding window,
padding) does work only for the attended pairs. It is stored on the mask's :class:`TensorMeta` as
``attended``; a mask without values (a FakeTensor, a meta tensor) is left unknown.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from .trace import TensorMeta

# user-level attention operators -> position of the mask in their schema
MASK_ARGUMENT = {"aten::scaled_dot_product_attention": ("attn_mask", 3)}


def summarize_mask(op: str, inputs: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Set ``attended`` on the mask argument of an attention call in ``inputs`` (placed in schema order).

    Returns False when the call has a mask whose values are unknown (it will be counted dense).
    """
    where = MASK_ARGUMENT.get(op)
    if where is None or len(inputs) <= where[1] or not isinstance(inputs[where[1]], TensorMeta):
        return True
    name, index = where
    mask = args[index] if len(args) > index else kwargs.get(name)
    query, key = inputs[0], inputs[1]
    if not isinstance(mask, torch.Tensor) or not isinstance(query, TensorMeta) or not isinstance(key, TensorMeta):
        return True
    if isinstance(mask, FakeTensor) or mask.is_meta:
        return False
    full = torch.broadcast_shapes(tuple(mask.shape), (*query.shape[:-1], key.shape[-2]))
    with _disable_current_modes(), torch.no_grad():
        if mask.dtype == torch.bool:
            passed = int(torch.count_nonzero(mask))
        else:
            passed = int(torch.count_nonzero(mask > torch.finfo(mask.dtype).min / 2))
    attended = passed * (math.prod(full) // max(mask.numel(), 1))
    inputs[index] = dataclasses.replace(inputs[index], attended=attended)
    return True
