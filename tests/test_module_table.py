"""The trace's module table is what torch's own walk of the model gives.

The recorder describes a plain parameter once per distinct (name, shape, dtype) and hands the same immutable
description to every module holding such a parameter (engine/naming.py): the oracle here is ``named_modules()`` (each
module once, under its first path) and each parameter tensor itself, read directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter.engine.naming import ModuleNames
from modelmeter.engine.spec import RunSpec
from modelmeter.engine.tracer import record_trace


class Tied(nn.Module):
    """A shared submodule, a tied weight, a parameter registered as None, and layers of one shape in two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.again = self.body[0]
        self.low = nn.Linear(8, 8).to(torch.float16)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight
        self.register_parameter("absent", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.again(self.body(self.embed(x)))
        return self.head(h + self.low(h.half()).float())


def _stack() -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.LayerNorm(4)) for _ in range(20)))


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def _resnet() -> nn.Module:
    return pytest.importorskip("torchvision").models.resnet18()


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any]]] = {
    "tied": (Tied, lambda: torch.randint(0, 20, (2, 3))),
    "stack": (_stack, lambda: torch.randn(2, 4)),
    "gpt2": (_gpt2, lambda: torch.randint(0, 50, (1, 6))),
    "resnet18": (_resnet, lambda: torch.randn(2, 3, 32, 32)),
}


def expected_table(model: nn.Module) -> list[tuple[Any, ...]]:
    """Every module as torch walks it, with its own parameters not met before: name, shape, dtype and bytes."""
    seen: set[int] = set()
    rows = []
    for name, module in model.named_modules():
        params = []
        for key, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                params.append((key, tuple(param.shape), str(param.dtype).removeprefix("torch."),
                               param.numel() * param.element_size(), None))
        rows.append((name, type(module).__name__, module.extra_repr(), params))
    return rows


def table(modules: list[Any]) -> list[tuple[Any, ...]]:
    return [(m.name, m.type, m.extra_repr, [(p.name, p.shape, p.dtype, p.nbytes, p.global_shape)
                                            for p in m.parameters]) for m in modules]


@pytest.mark.parametrize("name", MODELS)
def test_module_table_is_torchs_walk(name: str) -> None:
    make, inputs = MODELS[name]
    torch.manual_seed(0)
    model = make()
    expected = expected_table(model)
    assert table(ModuleNames(model).infos()) == expected
    assert table(record_trace(RunSpec(model, (inputs(),))).modules) == expected  # after a run, as before it


def test_equal_parameters_share_one_description() -> None:
    infos = ModuleNames(_stack()).infos()
    weights = [m.parameters[0] for m in infos if m.type == "Linear"]
    assert len(weights) == 20 and all(w is weights[0] for w in weights)
    tied = {m.name: m.parameters for m in ModuleNames(Tied()).infos()}
    assert tied["low"][0] is not tied["body.0"][0] and tied["low"][0].dtype == "float16"
    assert tied["head"] == ()  # its weight is the embedding's, counted there
