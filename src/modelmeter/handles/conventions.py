"""Counting conventions: which formula every operator gets under ``fvcore``, ``macs`` or ``flops``.

A :class:`Convention` is a handle table plus the rule for element-wise operators that have no entry.
Table values: a handle (counts the call), a :class:`CountInside` (counts what the call ran), or
``None`` (known, costs 0 under this convention, never reported as unsupported).

The table of a convention is assembled from the operator families, each a module exporting
``handles(convention)``: matrix products and attention (:mod:`.products`, :mod:`.attention`), and
element-wise operators, reductions, norms, pooling and resampling, embeddings, recurrent layers and
losses (:mod:`.elementwise`, :mod:`.reductions`, :mod:`.norms`, :mod:`.pooling`, :mod:`.layers`), pairwise distances
(:mod:`.distances`), collectives and
their helpers (:mod:`.collectives`: free on the rank's device), then
the formulas registered with :func:`register_handle`. docs/handles.md lists every formula.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidTypeError, InvalidValueError, check_flag
from . import attention, collectives, distances, elementwise, layers, norms, pooling, products, reductions
from .base import CountInside, Handle
from .binding import Formula
from .catalog import CONVENTIONS, DESCRIPTIONS
from .elementwise import elementwise_flops
from .fvcore import FLOP_HANDLES

HandleTable = Mapping[str, "Handle | CountInside | None"]

# Formulas added with register_handle: operator -> {convention or None (all) -> entry}, latest last.
_REGISTERED: dict[str, dict[str | None, Handle | CountInside | None]] = {}


@dataclass(frozen=True)
class Convention:
    """One counting convention: its name, a one-line description, its table and its element-wise rule.

    ``elementwise`` is applied to element-wise operators (torch's ``pointwise`` tag) that have no entry
    in ``handles``; ``None`` means they are free.
    """

    name: str
    description: str
    handles: HandleTable
    elementwise: Handle | None = None


def get_convention(name: str = "fvcore", *, dense_attention: bool = False,
                   attention_kernel: str = "fused") -> Convention:
    """The convention called ``name``; ``dense_attention=True`` counts masked attention as if dense;
    ``attention_kernel="math"`` counts attention at the math kernel's dense cost (docs/attention.md)."""
    _check_convention(name)
    check_flag("dense_attention", dense_attention)  # a truthy "no" would count masked attention as dense
    table: dict[str, Handle | CountInside | None] = {}
    for family in (elementwise, reductions, norms, pooling, layers, distances, collectives):
        table.update(family.handles(name))
    if name == "fvcore":
        table.update(FLOP_HANDLES)
    table.update(products.handles(name, dense_attention))
    table.update(attention.handles(name, dense_attention, attention_kernel))
    for op, entries in _REGISTERED.items():
        if None in entries:
            table[op] = entries[None]
        if name in entries:
            table[op] = entries[name]
    return Convention(name, DESCRIPTIONS[name], table, elementwise_flops if name == "flops" else None)


def register_handle(op: str, handle: Handle | Formula[Any] | CountInside | None, *,
                    convention: str | None = None) -> None:
    """Give operator ``op`` (``"namespace::name"``, e.g. a ``torch.library`` custom op ``"mylib::fused"``)
    a formula in ``convention``, or in every convention when it is None.

    ``handle`` has the signature of every handle, ``handle(inputs, outputs) -> int | float | Counter``;
    ``None`` declares the operator known and free; a :func:`~.binding.by_name` formula is bound to ``op``'s schema
    here. A formula for one convention wins over one for all.
    It applies to analyses created afterwards (:func:`get_convention` reads the registry);
    :func:`unregister_handle` removes it.
    """
    if convention is not None:
        _check_convention(convention)
    if not isinstance(op, str):
        raise InvalidTypeError(f"operator names are strings, 'namespace::name' (e.g. 'mylib::fused'); got {op!r:.60}")
    if "::" not in op:
        raise InvalidValueError(f"operator names are 'namespace::name' (e.g. 'mylib::fused'); got {op!r:.60}")
    if handle is not None and not callable(handle) and not isinstance(handle, (CountInside, Formula)):
        raise InvalidTypeError(f"the handle for {op} must be callable or None, got {type(handle).__name__}")
    _REGISTERED.setdefault(op, {})[convention] = handle.bind(op) if isinstance(handle, Formula) else handle


def unregister_handle(op: str, *, convention: str | None = None) -> None:
    """Remove the formula :func:`register_handle` gave ``op`` for ``convention`` (None: the all-convention one)."""
    registered = _REGISTERED.get(op, {})
    registered.pop(convention, None)
    if not registered:
        _REGISTERED.pop(op, None)


def has_registered_handles() -> bool:
    """True while :func:`register_handle` has formulas in place: counts then depend on code a cache cannot key."""
    return bool(_REGISTERED)


def _check_convention(name: str) -> None:
    if name not in CONVENTIONS:
        raise InvalidValueError(f"convention must be one of {', '.join(CONVENTIONS)}; got {name!r}")
