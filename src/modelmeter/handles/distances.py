"""Pairwise distances (``torch.cdist``), forward and backward.

``torch.cdist(x1, x2, p)`` with ``x1`` of shape ``(..., P, M)`` and ``x2`` of shape ``(..., R, M)`` gives the
``(..., P, R)`` distances of every pair of rows; ``B`` below is the product of the result's batch dimensions (the
operands' broadcast), so ``B·P·R`` pairs of ``M`` features each. torch runs one of two kernels:

- ``_cdist_forward``, directly: per pair and feature the difference, its power (the square for ``p = 2``, the
  absolute value for ``p`` 1 and ∞, the non-zero test for 0, ``|d|^p`` otherwise: an absolute value and a power)
  and the accumulation (a max for ∞); then per pair the root (``sqrt`` for 2, ``pow(1/p)`` for other ``p`` that
  are not 0, 1 or ∞). ``flops``: ``3·B·P·R·M`` (``4·B·P·R·M`` for other ``p``) plus ``B·P·R`` for a root.
- ``_euclidean_dist`` (``p = 2`` with ``compute_mode="use_mm_for_euclid_dist"``, or by default when ``P`` or ``R``
  exceeds 25): ``‖a‖² - 2a·b + ‖b‖²`` as one product of operands widened by two columns,
  ``cat([-2·x1, ‖x1‖², 1]) @ cat([x2, 1, ‖x2‖²])ᵀ``, then ``clamp_min(0).sqrt()``. ``flops``: the product
  ``2·B·P·R·(M + 2)``, the squares and sums of both operands' rows ``2·B·(P + R)·M``, the ``-2`` scale ``B·P·M``,
  the clamp and root ``2·B·P·R``: what running those operators counts.
- ``_cdist_backward(grad, x1, x2, p, cdist)`` (the gradient of ``x1``; autograd asks for ``x2``'s with the operands
  swapped): per pair and feature the difference, the ``p``-specific factor (the sign for 1 and ∞, a divide by
  the distance for 2, powers otherwise: counted 1), its product with the gradient and the accumulation:
  ``4·B·P·R·M``; ``p = 0`` has a zero gradient, which torch returns without computing (0).

``fvcore`` and ``macs`` count multiply-adds only: for ``p = 2`` a squared difference accumulated (``(a - b)²``,
forward), the gradient's weighted sum of the differences (backward) and the product of ``_euclidean_dist`` —
``B·P·R·M``, ``B·P·R·M`` and ``B·P·R·(M + 2)``; other ``p`` have no multiply-add (0, known).

Rows of no features (``M = 0``): ``_cdist_forward`` returns zeros without computing (0 under every convention,
also where the size would take the product path); ``_euclidean_dist`` called directly still multiplies its two
added columns.
"""

from __future__ import annotations

import math
from typing import Any

from .base import Handle, prod, shape_of
from .binding import bind_all, by_name
from .common import Table, by_convention

_MM_THRESHOLD = 25  # rows above which the default compute mode takes the matrix-product path (torch's cdist)


def _pairs(result: Any) -> tuple[int, int]:
    """(pairs ``B·P·R``, their batch ``B``) of a ``(..., P, R)`` distance matrix."""
    shape = shape_of(result)
    return prod(shape), prod(shape[:-2])


def _takes_mm(p: float, compute_mode: Any, rows: int, columns: int) -> bool:
    """Whether ``_cdist_forward`` runs the matrix-product path (torch's ``cdist_impl``): ``p = 2`` with mode 1
    (``use_mm_for_euclid_dist``), or with the default mode (None or 0) when either operand has over 25 rows."""
    default_mode = compute_mode is None or compute_mode == 0
    return p == 2 and (compute_mode == 1 or (default_mode and max(rows, columns) > _MM_THRESHOLD))


def _direct_flops(p: float, pairs: int, features: int) -> int:
    """The direct kernel's: 3 per pair and feature (4 for ``p`` other than 0, 1, 2, ∞) and a root per pair for
    ``p`` other than 0, 1, ∞."""
    per_feature = 3 if p in (0, 1, 2, math.inf) else 4
    root = 0 if p in (0, 1, math.inf) else pairs
    return per_feature * pairs * features + root


def _euclidean_macs(pairs: int, features: int) -> int:
    """The matrix-product path's multiply-adds: the product of operands widened by two columns."""
    return pairs * (features + 2)


def _euclidean_flops(x1: Any, result: Any) -> int:
    """The matrix-product path's: the widened product (2 per multiply-add), the rows' squares and sums and the
    ``-2`` scale ``B·(3P + 2R)·M``, the clamp and the root (2 per pair)."""
    shape = shape_of(result)
    pairs, batch = prod(shape), prod(shape[:-2])
    rows, columns = shape[-2:]
    features = shape_of(x1)[-1]
    return 2 * _euclidean_macs(pairs, features) + batch * (3 * rows + 2 * columns) * features + 2 * pairs


@by_name
def cdist_flops(x1: Any, p: float, compute_mode: Any = None, *, result: Any) -> int:
    """``_cdist_forward(x1, x2, p, compute_mode)``: the direct kernel's, or ``_euclidean_dist``'s where it takes
    the matrix-product path; 0 for rows of no features (torch returns zeros without computing)."""
    if shape_of(x1)[-1] == 0:
        return 0
    rows, columns = shape_of(result)[-2:]
    if _takes_mm(float(p), compute_mode, rows, columns):
        return _euclidean_flops(x1, result)
    return _direct_flops(float(p), _pairs(result)[0], shape_of(x1)[-1])


@by_name
def euclidean_dist_flops(x1: Any, *, result: Any) -> int:
    """``_euclidean_dist(x1, x2)``: the widened product, the row norms, the scale, the clamp and the root."""
    return _euclidean_flops(x1, result)


@by_name
def cdist_backward_flops(grad_output: Any, x1: Any, p: float) -> int:
    """``_cdist_backward(grad_output, x1, x2, p, cdist)``: 4 per pair and feature (0 for ``p = 0``)."""
    return 0 if float(p) == 0 else 4 * prod(shape_of(grad_output)) * shape_of(x1)[-1]


@by_name
def cdist_macs(x1: Any, p: float, compute_mode: Any = None, *, result: Any) -> int:
    """``_cdist_forward`` for ``p = 2``: one multiply-add per pair and feature (``M + 2`` on the product path); 0
    for rows of no features (torch returns zeros without computing)."""
    features = shape_of(x1)[-1]
    if float(p) != 2 or features == 0:
        return 0
    pairs = _pairs(result)[0]
    rows, columns = shape_of(result)[-2:]
    if _takes_mm(2.0, compute_mode, rows, columns):
        return _euclidean_macs(pairs, features)
    return pairs * features


@by_name
def euclidean_dist_macs(x1: Any, *, result: Any) -> int:
    """``_euclidean_dist``: the product of the operands widened by two columns."""
    return _euclidean_macs(_pairs(result)[0], shape_of(x1)[-1])


@by_name
def cdist_backward_macs(grad_output: Any, x1: Any, p: float) -> int:
    """``_cdist_backward`` for ``p = 2``: one multiply-add per pair and feature."""
    return prod(shape_of(grad_output)) * shape_of(x1)[-1] if float(p) == 2 else 0


FLOPS: dict[str, Handle | None] = bind_all({
    "aten::_cdist_forward": cdist_flops,
    "aten::_euclidean_dist": euclidean_dist_flops,
    "aten::_cdist_backward": cdist_backward_flops,
})

MACS: dict[str, Handle] = bind_all({
    "aten::_cdist_forward": cdist_macs,
    "aten::_euclidean_dist": euclidean_dist_macs,
    "aten::_cdist_backward": cdist_backward_macs,
})


def handles(convention: str) -> Table:
    """``cdist``'s kernels under ``convention``."""
    return by_convention(convention, FLOPS, fvcore=MACS, macs=MACS)
