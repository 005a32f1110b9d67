"""Turn call arguments into plain metadata, and place keyword arguments by an operator's schema."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

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


def describe(value: Any) -> Any:
    """Metadata of one argument: tensors become :class:`TensorMeta`, containers are walked."""
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in value.shape), str(value.dtype).removeprefix("torch."),
                          device_name(value))
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
    unpack = getattr(value, "unpack", None) if isinstance(value, torch.ScriptObject) else None
    if unpack is not None:  # packed quantized weights: described by their weight
        return describe(unpack()[0])
    return f"<{type(value).__name__}>"


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
    for argument in schema.arguments[len(args):]:
        if argument.name in kwargs:
            placed.append(describe(kwargs[argument.name]))
        elif argument.has_default_value():
            placed.append(describe(argument.default_value))
        else:
            placed.append(None)
    return placed


@cache
def _overloads(name: str) -> tuple[torch.FunctionSchema, ...]:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return ()
    try:
        return tuple(getattr(packet, o)._schema for o in packet.overloads())
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


def bind_by_name(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Place a user-level call's arguments by the schema of the aten operator of the same name.

    Returns the positional list and whatever keyword arguments no schema could place (for calls
    with no aten counterpart, such as ``F.interpolate``).
    """
    for schema in _overloads(name):
        if _binds(schema, args, kwargs):
            return place_arguments(schema, args, kwargs), {}
    return [describe(a) for a in args], {k: describe(v) for k, v in kwargs.items()}
