"""Built-in model zoo: reference architectures in plain PyTorch, randomly initialised, never downloaded.

The vision models (ResNet, ViT, MobileNetV2) mirror torchvision's module layout, parameter names and
shapes exactly, so their analysis numbers equal torchvision's models and published figures; `bert_base`
and the Llama-2 models mirror Hugging Face's `BertModel` and `LlamaForCausalLM` the same way; `gpt2` is
GPT-2 small.

Default device: the full-size language models (`gpt2`, `bert_base`, `llama2_7b`, `llama2_70b`; entries
with `meta_default=True`) are built on the **meta device** unless `get_model` is given a `device`: their
weights take from hundreds of megabytes to hundreds of gigabytes, and an analysis needs shapes, not
values. The vision models and the `*_tiny` test models are built with real (random) weights on torch's
current default device, so they can run and be compared with their references; pass `device="meta"` to
build them without storage too, or `device="cpu"` to give a language model real weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from modelmeter.zoo import bert, gpt, llama, mobilenet, resnet, vit

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
        ZooEntry("mobilenet_v2", mobilenet.mobilenet_v2, _IMAGE, "MobileNetV2, torchvision layout"),
        ZooEntry("gpt2", gpt.gpt2, (1, 1024), "GPT-2 small causal LM (124M), token ids in", torch.long,
                 meta_default=True),
        ZooEntry("gpt2_tiny", gpt.gpt2_tiny, (1, 64), "2-layer 64-dim GPT-2 for tests, token ids in", torch.long),
        ZooEntry("bert_base", bert.bert_base, (1, 128), "BERT-base encoder (110M), Hugging Face layout, token ids in",
                 torch.long, meta_default=True),
        ZooEntry("bert_tiny", bert.bert_tiny, (1, 64), "2-layer 64-dim BERT for tests, token ids in", torch.long),
        ZooEntry("llama2_7b", llama.llama2_7b, (1, 128), "Llama-2 7B causal LM, Hugging Face layout, token ids in",
                 torch.long, meta_default=True),
        ZooEntry("llama2_70b", llama.llama2_70b, (1, 128),
                 "Llama-2 70B causal LM (grouped-query attention), Hugging Face layout, token ids in", torch.long,
                 meta_default=True),
        ZooEntry("llama2_tiny", llama.llama2_tiny, (1, 64),
                 "2-layer 64-dim Llama with grouped-query attention for tests, token ids in", torch.long),
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
    is enough for shape-level analysis of even the largest models. `device=None` means the entry's
    `default_device`: meta for the full-size language models (`meta_default=True`), torch's current
    default device for the others.
    """
    entry = _entry(name)
    device = entry.default_device if device is None else device
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
