"""What the zoo holds, as plain data: each model's name, builder, default input and description. Imports no
torch, so that ``modelmeter list`` answers without it; :mod:`.registry` builds :data:`~.registry.ZOO` from it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CatalogEntry:
    """A zoo model described: ``builder`` is ``"module:function"`` of this package, ``input_dtype`` the name of a
    torch dtype; ``meta_default``: built on the meta device when no device is given."""

    name: str
    builder: str
    input_shape: tuple[int, ...]
    description: str
    input_dtype: str = "float32"
    meta_default: bool = False


_IMAGE = (1, 3, 224, 224)

CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry("resnet18", "resnet:resnet18", _IMAGE, "ResNet-18, torchvision layout"),
    CatalogEntry("resnet34", "resnet:resnet34", _IMAGE, "ResNet-34, torchvision layout"),
    CatalogEntry("resnet50", "resnet:resnet50", _IMAGE, "ResNet-50 v1.5, torchvision layout"),
    CatalogEntry("resnet101", "resnet:resnet101", _IMAGE, "ResNet-101 v1.5, torchvision layout"),
    CatalogEntry("resnet152", "resnet:resnet152", _IMAGE, "ResNet-152 v1.5, torchvision layout"),
    CatalogEntry("vit_b_16", "vit:vit_b_16", _IMAGE, "ViT-B/16, torchvision layout"),
    CatalogEntry("vit_b_32", "vit:vit_b_32", _IMAGE, "ViT-B/32, torchvision layout"),
    CatalogEntry("vit_l_16", "vit:vit_l_16", _IMAGE, "ViT-L/16, torchvision layout"),
    CatalogEntry("mobilenet_v2", "mobilenet:mobilenet_v2", _IMAGE, "MobileNetV2, torchvision layout"),
    CatalogEntry("gpt2", "gpt:gpt2", (1, 1024), "GPT-2 small causal LM (124M), token ids in", "int64",
                 meta_default=True),
    CatalogEntry("gpt2_tiny", "gpt:gpt2_tiny", (1, 64), "2-layer 64-dim GPT-2 for tests, token ids in", "int64"),
    CatalogEntry("bert_base", "bert:bert_base", (1, 128),
                 "BERT-base encoder (110M), Hugging Face layout, token ids in", "int64", meta_default=True),
    CatalogEntry("bert_tiny", "bert:bert_tiny", (1, 64), "2-layer 64-dim BERT for tests, token ids in", "int64"),
    CatalogEntry("llama2_7b", "llama:llama2_7b", (1, 128), "Llama-2 7B causal LM, Hugging Face layout, token ids in",
                 "int64", meta_default=True),
    CatalogEntry("llama2_70b", "llama:llama2_70b", (1, 128),
                 "Llama-2 70B causal LM (grouped-query attention), Hugging Face layout, token ids in", "int64",
                 meta_default=True),
    CatalogEntry("llama2_tiny", "llama:llama2_tiny", (1, 64),
                 "2-layer 64-dim Llama with grouped-query attention for tests, token ids in", "int64"),
)
