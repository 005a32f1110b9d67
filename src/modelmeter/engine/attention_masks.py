"""Read how many (query, key) pairs an attention mask lets through, while its values exist.

The count is the one value-dependent fact a formula needs: masked attention (causal, sliding window,
padding) does work only for the attended pairs. It is stored on the mask's :class:`TensorMeta` as
``attended``; a mask without values (a FakeTensor, a meta tensor) is left unknown.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._torch_compat import FakeTensor, disable_current_modes
from .trace import TensorMeta
from .values import note_held_values_read

# user-level attention operators -> position of the mask in their schema
MASK_ARGUMENT = {"aten::scaled_dot_product_attention": ("attn_mask", 3)}
# flex_attention(q, k, v, score_mod, block_mask_tuple, ...): the block mask as BlockMask.as_tuple()
FLEX_ATTENTION = "aten::flex_attention"
_BLOCK_COUNTS = (2, 4)  # kv_num_blocks, full_kv_num_blocks in that tuple
ATTENTION_CALLS = frozenset({*MASK_ARGUMENT, FLEX_ATTENTION})


Values = Callable[[Any], "torch.Tensor | None"]


def summarize_mask(op: str, inputs: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                   values: Values | None = None) -> bool:
    """Set ``attended`` on the mask argument of an attention call in ``inputs`` (placed in schema order).

    ``values`` gives the values of a fake tensor when the run knows them (see :mod:`.values`). Returns False
    when the call has a mask whose values are unknown (it will be counted dense).
    """
    if op == FLEX_ATTENTION:
        return _summarize_block_mask(inputs, args, values)
    where = MASK_ARGUMENT.get(op)
    if where is None or len(inputs) <= where[1] or not isinstance(inputs[where[1]], TensorMeta):
        return True
    name, index = where
    mask = args[index] if len(args) > index else kwargs.get(name)
    query, key = inputs[0], inputs[1]
    if not isinstance(mask, torch.Tensor) or not isinstance(query, TensorMeta) or not isinstance(key, TensorMeta):
        return True
    mask = _with_values(mask, values)
    if mask is None:
        return False
    value = inputs[2] if isinstance(inputs[2], TensorMeta) else key
    scores = (*score_batch(query.shape, key.shape, value.shape), query.shape[-2], key.shape[-2])
    full = torch.broadcast_shapes(tuple(mask.shape), scores)
    with disable_current_modes(), torch.no_grad():
        if mask.dtype == torch.bool:
            passed = int(torch.count_nonzero(mask))
        else:
            passed = int(torch.count_nonzero(mask > torch.finfo(mask.dtype).min / 2))
    attended = passed * (math.prod(full) // max(mask.numel(), 1))
    inputs[index] = dataclasses.replace(inputs[index], attended=attended)
    return True


def score_batch(query: Sequence[int], key: Sequence[int], value: Sequence[int]) -> tuple[int, ...]:
    """The batch and head sizes of the scores of ``(..., L, E)`` query, key and value: torch broadcasts their leading
    dimensions (a query of batch 1 meets every key batch), except that grouped-query attention keeps the query's
    heads, more than the key's."""
    leads = [list(shape[:-2]) for shape in (query, key, value)]
    rank = max(map(len, leads))
    columns = zip(*([1] * (rank - len(lead)) + lead for lead in leads), strict=True)
    return tuple(next((size for size in column if size != 1), 1) for column in columns)


def _with_values(tensor: torch.Tensor, values: Values | None) -> torch.Tensor | None:
    """``tensor`` itself when it holds values, else its known values, else None."""
    if not isinstance(tensor, FakeTensor) and not tensor.is_meta:
        if values is not None:  # a fake run (a real one gives no values): the mask is one it was handed as it is
            note_held_values_read([tensor])
        return tensor
    return values(tensor) if values is not None else None


def _summarize_block_mask(inputs: list[Any], args: tuple[Any, ...], values: Values | None) -> bool:
    """``attended`` of a flex_attention block mask: how many (partial and full) blocks it lists."""
    blocks = args[4] if len(args) > 4 else None
    described = inputs[4] if len(inputs) > 4 else None
    if not isinstance(blocks, (tuple, list)) or not isinstance(described, list):
        return True
    if getattr(blocks[-1], "__name__", None) == "noop_mask":  # no mask given: every block, dense is exact
        return True
    for index in _BLOCK_COUNTS:
        count = blocks[index] if index < len(blocks) else None
        if not isinstance(count, torch.Tensor) or not isinstance(described[index], TensorMeta):
            continue
        count = _with_values(count, values)
        if count is None:
            return False
        with disable_current_modes(), torch.no_grad():
            described[index] = dataclasses.replace(described[index], attended=int(count.sum()))
    return True
