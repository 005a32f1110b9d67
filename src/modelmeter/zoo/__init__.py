"""Built-in model zoo: reference architectures in plain PyTorch, randomly initialised, never downloaded.

The vision models mirror torchvision's module layout, parameter names and shapes exactly, so their
analysis numbers equal torchvision's models and published figures; `gpt2` is GPT-2 small.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from modelmeter.zoo import gpt, resnet, vit

__all__ = ["ZOO", "ZooEntry", "available_models", "get_model", "input_shape"]


@dataclass(frozen=True)
class ZooEntry:
    """A zoo model: its builder, the default input's shape (batch 1) and dtype, and a one-line description."""

    name: str
    builder: Callable[..., nn.Module]
    input_shape: tuple[int, ...]
    description: str
    input_dtype: torch.dtype = torch.float32


_IMAGE = (1, 3, 224, 224)

ZOO: dict[str, ZooEntry] = {
    e.name: e
    for e in (
        ZooEntry("resnet18", resnet.resnet18, _IMAGE, "ResNet-18, torchvision layout"),
        ZooEntry("resnet34", resnet.resnet34, _IMAGE, "ResNet-34, torchvision layout"),
        ZooEntry("resnet50", resnet.resnet50, _IMAGE, "ResNet-50 v1.5, torchvision layout"),
        ZooEntry("resnet101", resnet.resnet101, _IMAGE, "ResNet-101 v1.5, torchvision layout"),
        ZooEntry("resnet152", resnet.resnet152, _IMAGE, "ResNet-152 v1.5, torchvision layout"),
        ZooEntry("vit_b_16", vit.vit_b_16, _IMAGE, "ViT-B/16, torchvision layout"),
        ZooEntry("vit_b_32", vit.vit_b_32, _IMAGE, "ViT-B/32, torchvision layout"),
        ZooEntry("vit_l_16", vit.vit_l_16, _IMAGE, "ViT-L/16, torchvision layout"),
        ZooEntry("gpt2", gpt.gpt2, (1, 1024), "GPT-2 small causal LM (124M), token ids in", torch.long),
        ZooEntry("gpt2_tiny", gpt.gpt2_tiny, (1, 64), "2-layer 64-dim GPT-2 for tests, token ids in", torch.long),
    )
}


def _entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; available: {', '.join(available_models())}") from None


def available_models() -> list[str]:
    """Names accepted by `get_model`, sorted."""
    return sorted(ZOO)


def get_model(name: str, *, device: str | torch.device | None = None, **kwargs: object) -> nn.Module:
    """Build zoo model `name` with random weights; `kwargs` go to its builder (e.g. `num_classes`).

    `device="meta"` creates every parameter and buffer on the meta device, allocating no storage, which
    is enough for shape-level analysis of even the largest models.
    """
    entry = _entry(name)
    if device is None:
        return entry.builder(**kwargs)
    with torch.device(device):
        return entry.builder(**kwargs)


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
