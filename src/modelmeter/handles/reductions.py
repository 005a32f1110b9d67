"""Reductions, cumulative operators, softmax and accumulating scatters (``flops`` convention).

Counting rule, shared with :mod:`.elementwise` so that an operator costs what its textbook
decomposition costs when run as separate operators: **every input element entering a reduction costs
one flop** (accumulate or compare), every element-wise step costs one flop per element it produces.
``n`` is the input's element count, ``rows`` the output's (the number of reductions).

- ``sum``, ``prod``, ``amax``/``max``, ``argmax``, ...: ``n`` (``aminmax``: ``2n``);
  ``mean``: ``n + rows`` (the divides);
- ``var``: mean, subtract, square, sum, divide: ``4n + 2·rows``; ``std``: ``+ rows`` square roots;
- vector norms: ``ord=2``: square, sum, square root ``2n + rows``; ``ord=1``, ``inf``, ``0``: ``2n``;
  other ``ord``: abs, power, sum, root: ``3n + rows``;
- ``softmax``, as every torch kernel computes it, ``e = exp(x - max(x))``, ``e / sum(e)``: max, subtract,
  exp, sum, divide: ``5n`` (Chinchilla counts 3 per logit, leaving out the max-shift; counting it keeps a
  softmax written out and the attention kernels' per-pair cost — scale and these 5 — the same);
  ``log_softmax``, ``(x - max) - log(sum(exp(x - max)))``: ``5n + rows``; ``logsumexp``,
  ``max + log(sum(exp(x - max)))``: ``4n + 2·rows``; backward: ``softmax`` ``y · (g - sum(g · y))`` and
  ``log_softmax`` ``g - exp(y) · sum(g)``: ``4n`` each;
- cumulative ``cumsum``/``cumprod``/``cummax``: ``n``; ``logcumsumexp``: exp, cumsum, log: ``3n``;
- accumulating scatters (``index_add``, ``scatter_add``, ``index_put(accumulate=True)``): one add per
  source element; ``col2im`` (``nn.Fold``, and the backward of ``nn.Unfold``'s ``im2col``, a free gather): one add
  per block element that lands inside the output (not in its padding).

Sorting and selection (``sort``, ``topk``, ``median``, ...) and counting (``histc``, ``bincount``) are
free in every convention: their comparison counts depend on the algorithm. All of these cost 0 under
``fvcore`` and ``macs``.
"""

from __future__ import annotations

import math
from typing import Any

from .base import Handle, get_shape, numel, prod, shape_of
from .binding import Formula, bind_all, by_name
from .common import Table, by_convention, first_tensor, float_numel, is_floating


def _rows(outputs: list[Any]) -> int:
    out = first_tensor(outputs)
    return 0 if out is None else numel(out)


def reduction_counter(per_input: int = 1, per_output: int = 0) -> Formula[int]:
    """``per_input`` flops per floating-point input element plus ``per_output`` per output element."""

    @by_name(self="grad_output")  # the softmax backward operators reduce their output gradient
    def reduction_flops(self: Any, *, outputs: list[Any]) -> int:
        n = float_numel(self)
        return per_input * n + per_output * _rows(outputs) if n else 0

    reduction_flops.__doc__ = f"{per_input}·n + {per_output}·rows flops (n input, rows output elements)."
    return reduction_flops


@by_name
def max_flops(self: Any, other: Any = None, *, outputs: list[Any]) -> int:
    """``max``/``min``: a reduction (``n`` comparisons), or with a tensor ``other`` one per output element."""
    if get_shape(other) is not None:
        return float_numel(first_tensor(outputs))
    return float_numel(self)


@by_name(ord="p")
def vector_norm_flops(self: Any, ord: Any = 2, *, outputs: list[Any]) -> int:
    """``linalg_vector_norm(self, ord)``/``norm(self, p)``: 2-norm ``2n + rows``; 1, inf, 0: ``2n``; other orders
    ``3n + rows``."""
    n = float_numel(self)
    order = ord if isinstance(ord, (int, float)) else 2
    if not n:
        return 0
    if order == 2:
        return 2 * n + _rows(outputs)
    if order in (1, 0) or math.isinf(order):
        return 2 * n
    return 3 * n + _rows(outputs)


def _softmax_rows(x: Any, dim: int) -> int:
    shape = get_shape(x) or []
    n = float_numel(x)
    if not shape:
        return n
    size = shape[dim % len(shape)]
    return n // size if size else 0


@by_name
def log_softmax_flops(self: Any, dim: int) -> int:
    """``_log_softmax``: max, subtract, exp, sum and subtract per element, a log per row: ``5n + rows``."""
    return 5 * float_numel(self) + _softmax_rows(self, dim)


@by_name(source="src")
def scatter_flops(source: Any) -> int:
    """Accumulating scatters (``index_add``, ``scatter_add``, ...): one add per element of the source."""
    return float_numel(source) if get_shape(source) is not None else 0


@by_name
def index_put_flops(values: Any, accumulate: Any) -> int:
    """``index_put(self, indices, values, accumulate)``: an add per value when accumulating, else a copy."""
    return float_numel(values) if accumulate and is_floating(values) else 0


@by_name
def col2im_flops(self: Any, output_size: Any, kernel_size: Any, dilation: Any, padding: Any, stride: Any) -> int:
    """``col2im(self, output_size, kernel_size, dilation, padding, stride)`` (``F.fold``): sums overlapping blocks
    into the output, one add per block element that lands inside it (those landing in the padding are dropped)."""
    shape = shape_of(self)
    if not float_numel(self):
        return 0
    per_plane = 1
    for size, k, d, p, st in zip(output_size, kernel_size, dilation, padding, stride, strict=True):
        per_plane *= _landing_taps(int(size), int(k), int(d), int(p), int(st))
    blocks_per_column = prod(int(k) for k in kernel_size)
    planes = prod(shape[:-2]) * (shape[-2] // blocks_per_column)
    return planes * per_plane


def _landing_taps(size: int, kernel: int, dilation: int, padding: int, stride: int) -> int:
    """Along one dimension: the (block, kernel offset) pairs whose position falls inside ``[0, size)``."""
    blocks = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    return sum(1 for b in range(blocks) for k in range(kernel) if 0 <= b * stride - padding + k * dilation < size)


_PLAIN = ("sum", "nansum", "prod", "amax", "amin", "argmax", "argmin")
_SELECTION = ("sort", "argsort", "msort", "topk", "kthvalue", "median", "nanmedian", "mode", "histc", "bincount")

FLOPS: dict[str, Handle | None] = bind_all({
    **{f"aten::{op}": reduction_counter() for op in _PLAIN},
    **{f"aten::{op}": max_flops for op in ("max", "min")},
    "aten::aminmax": reduction_counter(2),
    **{f"aten::{op}": reduction_counter(1, 1) for op in ("mean", "nanmean")},
    **{f"aten::{op}": reduction_counter(4, 2) for op in ("var", "var_mean")},
    **{f"aten::{op}": reduction_counter(4, 3) for op in ("std", "std_mean")},
    **{f"aten::{op}": vector_norm_flops for op in ("norm", "linalg_vector_norm")},
    "aten::frobenius_norm": reduction_counter(2, 1),
    "aten::logsumexp": reduction_counter(4, 2),
    **{f"aten::{op}": reduction_counter() for op in ("cumsum", "cumsum_", "cumprod", "cumprod_", "cummax",
                                                       "cummin", "_cummax_helper", "_cummin_helper")},
    **{f"aten::{op}": reduction_counter(3) for op in ("logcumsumexp", "_logcumsumexp")},
    **{f"aten::{op}": reduction_counter(5) for op in ("_softmax", "_safe_softmax")},
    "aten::_log_softmax": log_softmax_flops,
    **{f"aten::{op}": reduction_counter(4) for op in ("_softmax_backward_data", "_log_softmax_backward_data")},
    **{f"aten::{op}": scatter_flops for op in ("index_add", "index_add_", "scatter_add", "scatter_add_",
                                                    "scatter_reduce", "scatter_reduce_", "index_reduce",
                                                    "index_reduce_")},
    **{f"aten::{op}": index_put_flops for op in ("index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put")},
    **{f"aten::{op}": None for op in _SELECTION},
    "aten::col2im": col2im_flops,
})


def handles(convention: str) -> Table:
    """Reductions, cumulative operators, softmax and scatters under ``convention``."""
    return by_convention(convention, FLOPS)
