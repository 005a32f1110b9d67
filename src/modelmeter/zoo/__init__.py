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
build them without storage too, or `device="cpu"` to give a language model real weights. On meta, no
initialiser runs (there are no values to fill; PyTorch's meta kernels of `normal_` and `uniform_` would import
`torch._dynamo` and sympy, over a second): the model is the one `torch.device("meta")` builds, tensor by tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .catalog import CATALOG, CatalogEntry

if TYPE_CHECKING:
    from .registry import ZOO, ZooEntry, available_models, get_model, input_shape

__all__ = ["CATALOG", "ZOO", "CatalogEntry", "ZooEntry", "available_models", "get_model", "input_shape"]


def __getattr__(name: str) -> Any:
    """The names that need torch (the models themselves), imported on first use: the catalog does not."""
    if name in __all__:
        from . import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
