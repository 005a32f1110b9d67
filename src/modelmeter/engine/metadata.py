"""Turn call arguments into plain metadata, and place keyword arguments by an operator's schema."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

from .._torch_compat import disable_current_modes, local_tensor, schema_of
from ..errors import InvalidTypeError
from .collectives import group_of_script_object
from .trace import TensorMeta

_PLAIN = (int, float, bool, str, type(None), complex)


_meta_device = "meta"  # the device meta tensors are recorded as: a CPU model runs on meta stand-ins


@contextmanager
def meta_stands_for(device: str) -> Iterator[None]:
    """Record meta tensors as tensors of ``device`` (the device of the model they stand in for)."""
    global _meta_device
    before, _meta_device = _meta_device, device
    try:
        yield
    finally:
        _meta_device = before


def recorded_device() -> str:
    """The device meta tensors stand for in the current run (``"meta"`` for a model built on meta)."""
    return _meta_device


def device_name(tensor: torch.Tensor) -> str:
    """The device a recorded tensor is on, as the trace names it."""
    return _meta_device if tensor.is_meta else str(tensor.device)


def storage_device_name(storage: torch.UntypedStorage) -> str:
    """The device of a storage met without a tensor, as :func:`device_name` names a tensor's (a FakeTensor's
    storage is on the meta device: it is named as meta tensors are)."""
    return _meta_device if storage.device.type == "meta" else str(storage.device)


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def tensor_meta(tensor: torch.Tensor) -> TensorMeta:
    """A tensor's :class:`TensorMeta`; equal descriptions are one (immutable) object, made once.

    It runs for every argument of every operator: a dense tensor is found by its shape, strides, dtype and device as
    torch hands them out (a few attribute reads and one look-up); other layouts (what a sparse tensor stores is not
    in its shape), and a key that cannot be hashed, are described from their parts."""
    if tensor.layout != torch.strided:
        return _described(tensor)
    try:
        key = (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, _meta_device)
        found = _DENSE.get(key)
    except (RuntimeError, TypeError):  # no shape (a nested tensor of strided layout), sizes that are not numbers
        return _described(tensor)
    if found is None:
        if len(_DENSE) > _METAS_LIMIT:
            _DENSE.clear()
        found = _DENSE[key] = _described(tensor)
    return found


def _described(tensor: torch.Tensor) -> TensorMeta:
    """:func:`tensor_meta` from the tensor's parts: its shape, dtype, device (what meta tensors stand for), and its
    footprint (what a sparse tensor stores, what a broadcast one addresses)."""
    try:
        shape = tuple(tensor.shape)
    except RuntimeError:
        if tensor.is_nested:  # the strided layout has no shape to describe
            raise NestedLayoutError(NESTED_STRIDED) from None
        raise
    key: tuple[Any, ...] = (shape, tensor.dtype, _meta_device if tensor.is_meta else tensor.device)
    if tensor.layout in _SPARSE_LAYOUTS:
        key += (_stored(tensor),)
    elif 0 in _strides(tensor):  # a broadcast dimension, maybe (it runs for every tensor: the common case is short)
        key += (_footprint(shape, tensor.stride()),)
    found = _METAS.get(key)
    if found is None:
        if len(_METAS) > _METAS_LIMIT:
            _METAS.clear()
        plain = tuple(int(s) for s in shape)  # plain ints, also where torch hands out SymInts
        footprint = key[3] if len(key) > 3 else None
        found = _METAS[key] = TensorMeta(plain, dtype_name(tensor.dtype), str(key[2]), footprint=footprint)
    return found


def _strides(tensor: torch.Tensor) -> tuple[int, ...]:
    try:
        return tensor.stride()
    except RuntimeError:  # a layout without strides
        return ()


def _footprint(shape: tuple[Any, ...], strides: tuple[Any, ...]) -> int | None:
    """Distinct elements a tensor of ``shape`` and ``strides`` addresses, when a stride of 0 (a broadcast
    dimension) makes them fewer than its elements; None otherwise."""
    numel = distinct = 1
    for size, stride in zip(shape, strides, strict=True):
        numel *= int(size)
        if stride != 0:
            distinct *= int(size)
    return distinct if distinct < numel else None


# Sparse layouts, and the parts (values, indices) each stores.
_SPARSE_LAYOUTS: dict[torch.layout, tuple[str, ...]] = {
    torch.sparse_coo: ("_values", "_indices"),
    torch.sparse_csr: ("values", "crow_indices", "col_indices"),
    torch.sparse_bsr: ("values", "crow_indices", "col_indices"),
    torch.sparse_csc: ("values", "ccol_indices", "row_indices"),
    torch.sparse_bsc: ("values", "ccol_indices", "row_indices"),
}


def is_sparse(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has a sparse layout (COO, CSR, CSC, BSR, BSC)."""
    return tensor.layout in _SPARSE_LAYOUTS


def sparse_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """What a sparse tensor stores, its values and indices, as tensors of their own; ``[]`` for another layout."""
    return [getattr(tensor, part)() for part in _SPARSE_LAYOUTS.get(tensor.layout, ())]


def _stored(tensor: torch.Tensor) -> int:
    """A sparse tensor's footprint: what it stores (its values and indices), in elements of its dtype rounded up,
    not the dense shape it describes. A meta copy (a fake run) stores nothing."""
    stored = sum(part.numel() * part.element_size() for part in sparse_parts(tensor))
    return -(-stored // tensor.element_size())


_METAS: dict[tuple[Any, ...], TensorMeta] = {}
_DENSE: dict[tuple[Any, ...], TensorMeta] = {}  # tensor_meta's look-up by (shape, strides, dtype, device, meta's)

NESTED_STRIDED = ("a nested tensor of strided layout (torch.nested.nested_tensor's default) cannot be counted: "
                  "its operators run per sequence inside PyTorch, unseen; use layout=torch.jagged")


class NestedLayoutError(InvalidTypeError):
    """An operator ran on a nested tensor of strided layout."""
_METAS_LIMIT = 1 << 16


def describe(value: Any) -> Any:
    """Metadata of one argument: tensors become :class:`TensorMeta` (a DTensor its shard on this rank: what the
    rank computes on), containers are walked."""
    if isinstance(value, torch.Tensor):
        return tensor_meta(value if type(value) is torch.Tensor else local_tensor(value))
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.hint if hasattr(value.node, "hint") else str(value)
    if isinstance(value, torch.device):
        return _meta_device if value.type == "meta" else str(value)
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, torch.ScriptObject):
        group = group_of_script_object(value)
        if group is not None:  # a collective's process group
            return group
        unpack = getattr(value, "unpack", None)
        if unpack is not None:  # packed quantized weights: described by their weight
            return describe(_unpacked_weight(unpack))
    return f"<{type(value).__name__}>"


def _unpacked_weight(unpack: Any) -> torch.Tensor:
    """The weight of packed quantized parameters, unpacked outside the run's modes: the unpacking kernels are not
    the model's operators, and some copy values into the tensor they make (``linear_dynamic_fp16``'s), which under a
    fake mode is a FakeTensor without storage — a segmentation fault."""
    with disable_current_modes():
        return unpack()[0]


def flat_outputs(value: Any) -> list[Any]:
    """The outputs of a call as a flat list, tensors first-class (tuples and lists are flattened)."""
    if isinstance(value, (list, tuple)):
        out: list[Any] = []
        for v in value:
            out.extend(flat_outputs(v))
        return out
    return [describe(value)]


def place_arguments(schema: torch.FunctionSchema, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """``args`` and ``kwargs`` as one positional list in schema order, defaults filled in."""
    placed = [describe(a) for a in args]
    for name, default in _trailing(schema, len(args)):
        placed.append(describe(kwargs[name]) if name in kwargs else default)
    return placed


_TRAILING: dict[tuple[int, int], tuple[torch.FunctionSchema, tuple[tuple[str, Any], ...]]] = {}


def _trailing(schema: torch.FunctionSchema, given: int) -> tuple[tuple[str, Any], ...]:
    """(name, described default or None) of a schema's arguments after the first ``given``: worked out once
    per schema and count (the entry keeps its schema, so an ``id`` is never taken for another's)."""
    key = (id(schema), given)
    found = _TRAILING.get(key)
    if found is None or found[0] is not schema:
        found = _TRAILING[key] = (schema, tuple(
            (a.name, describe(a.default_value) if a.has_default_value() else None)
            for a in schema.arguments[given:]))
    return found[1]


@cache
def _overloads(name: str) -> tuple[torch.FunctionSchema, ...]:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return ()
    try:
        return tuple(schema_of(getattr(packet, o)) for o in packet.overloads())
    except (AttributeError, RuntimeError):
        return ()


def _binds(schema: torch.FunctionSchema, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        return False
    names = {a.name for a in schema.arguments}
    if any(k not in names for k in kwargs):
        return False
    given = set(kwargs) | {a.name for a in positional[: len(args)]}
    return all(a.name in given or a.has_default_value() or _optional(a) for a in schema.arguments)


def _optional(argument: Any) -> bool:
    return "Optional" in str(argument.type) or str(argument.type).endswith("?")


def bind_by_name(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any], str]:
    """Place the arguments of a user-level call of ``op`` (``"aten::linear"``) by the schema of that aten operator.

    Returns the positional list, whatever keyword arguments no schema could place (for calls
    with no aten counterpart, such as ``F.interpolate``) and the name of the overload that placed them ("": none).
    """
    key = (op, len(args), tuple(kwargs))
    schema = _BOUND.get(key, _UNKNOWN)
    if schema is _UNKNOWN:  # which overload binds depends on the count of arguments and the keywords only
        schema = _BOUND[key] = next((c for c in _overloads(op.removeprefix("aten::")) if _binds(c, args, kwargs)),
                                    None)
    if schema is not None:
        return place_arguments(schema, args, kwargs), {}, schema.overload_name or "default"
    return [describe(a) for a in args], {k: describe(v) for k, v in kwargs.items()}, ""


_UNKNOWN: Any = object()
_BOUND: dict[tuple[str, int, tuple[str, ...]], torch.FunctionSchema | None] = {}
