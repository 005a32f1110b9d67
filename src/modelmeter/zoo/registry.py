"""The zoo's models as :class:`ZooEntry` objects (builders, torch dtypes), built from :mod:`.catalog`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any, get_type_hints

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import InvalidNameError, InvalidTypeError, InvalidValueError
from .catalog import CATALOG

__all__ = ["ZOO", "ZooEntry", "available_models", "get_model", "input_shape"]


@dataclass(frozen=True)
class ZooEntry:
    """A zoo model: its builder, the default input's shape (batch 1) and dtype, and a one-line description.

    `meta_default`: `get_model` builds it on the meta device when no `device` is given.
    """

    name: str
    builder: Callable[..., nn.Module]
    input_shape: tuple[int, ...]
    description: str
    input_dtype: torch.dtype = torch.float32
    meta_default: bool = False

    @property
    def default_device(self) -> torch.device | None:
        """Where `get_model(name)` builds it: meta, or None for torch's current default device."""
        return torch.device("meta") if self.meta_default else None


def _builder(path: str) -> Callable[..., nn.Module]:
    """``"resnet:resnet18"`` -> the function ``resnet18`` of this package's module ``resnet``."""
    module, _, function = path.partition(":")
    return getattr(import_module(f"{__package__}.{module}"), function)


ZOO: dict[str, ZooEntry] = {
    e.name: ZooEntry(e.name, _builder(e.builder), e.input_shape, e.description, getattr(torch, e.input_dtype),
                     e.meta_default)
    for e in CATALOG
}


def _entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise InvalidNameError(f"unknown model {name!r}; available: {', '.join(available_models())}") from None


def available_models() -> list[str]:
    """Names accepted by `get_model`, sorted."""
    return sorted(ZOO)


def get_model(name: str, *, device: str | torch.device | None = None, **kwargs: object) -> nn.Module:
    """Build zoo model `name` with random weights; `kwargs` go to its builder (e.g. `num_classes`).

    `device="meta"` creates every parameter and buffer on the meta device, allocating no storage, which
    is enough for shape-level analysis of even the largest models. `device=None` means the entry's
    `default_device`: meta for the full-size language models (`meta_default=True`), torch's current
    default device for the others.
    """
    entry = _entry(name)
    _check_arguments(name, entry.builder, kwargs)
    device = entry.default_device if device is None else device
    if device is None:
        return entry.builder(**kwargs)
    if torch.device(device).type != "meta":
        with torch.device(device):
            return entry.builder(**kwargs)
    with torch.device(device), _NoInitialisationOnMeta():
        return entry.builder(**kwargs)


def _check_arguments(name: str, builder: Callable[..., nn.Module], kwargs: dict[str, object]) -> None:
    """Raise InvalidTypeError / InvalidValueError naming a builder's argument that no model has: a size (``int``)
    that is not a whole number >= 1, a ``float`` that is not a finite number, a dropout outside [0, 1), a width
    multiplier not above 0. Unchecked, a builder clamps some (``width_mult=-1`` built the narrowest model) and
    builds others that no input can run (``vocab_size=0``), and the analysis counted them."""
    hints = get_type_hints(builder)
    for key, value in kwargs.items():
        kind = hints.get(key)
        if kind not in (int, float):
            continue  # an argument the builder does not take: its own TypeError names it
        if not isinstance(value, (int, float)) or isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise InvalidTypeError(f"{name}: {key} is {'a whole number' if kind is int else 'a number'}, "
                                   f"got {value!r}")
        if not _in_range(key, kind, value):
            raise InvalidValueError(f"{name}: {key}={value!r} is out of range ({_RANGES.get(key, 'at least 1')})")


_RANGES = {"dropout": "0 <= dropout < 1", "width_mult": "above 0"}  # sizes (the other ints): at least 1


def _in_range(key: str, kind: type, value: float) -> bool:
    if not math.isfinite(value):
        return False
    if key == "dropout":
        return 0 <= value < 1
    if key == "width_mult":
        return value > 0
    return kind is not int or value >= 1


class _NoInitialisationOnMeta(TorchFunctionMode):
    """Random initialisation of meta tensors is skipped: they hold no values to fill. PyTorch's meta kernels of the
    random in-place operators (``normal_``, ``uniform_``) are Python references whose first call imports
    ``torch._dynamo`` and sympy (about a second, on every command that builds a language model of the zoo); so is
    the meta decomposition of ``arange`` under a default device, which a buffer of positions runs: made on the CPU
    (a few thousand elements) and moved to meta."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            filled = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(filled, torch.Tensor) and filled.is_meta:
                return filled  # what every initialiser returns: the tensor it fills
        elif func is torch.arange and torch.device(kwargs.get("device") or "meta").type == "meta":
            return func(*args, **{**kwargs, "device": "cpu"}).to("meta")
        return func(*args, **kwargs)


# torch.nn.init's in-place initialisers, and the tensor methods that fill a tensor with random numbers.
_INITIALISERS = frozenset({
    *(getattr(nn.init, name) for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")),
    *(getattr(torch.Tensor, name) for name in ("normal_", "uniform_", "random_", "exponential_", "geometric_",
                                                 "log_normal_", "cauchy_", "bernoulli_")),
})


def input_shape(name: str, batch: int = 1, resolution: int | None = None) -> tuple[int, ...]:
    """Shape of `name`'s input for `batch` samples.

    `resolution` replaces the default image side (square images) or, for token models, the sequence
    length. ViTs fix their resolution at build time: pass the same value as `image_size` to `get_model`.
    """
    shape = _entry(name).input_shape
    if resolution is None:
        return (batch, *shape[1:])
    if len(shape) == 4:
        return (batch, shape[1], resolution, resolution)
    return (batch, resolution)
