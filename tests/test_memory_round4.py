"""Memory prediction, a fourth round: cases found by probing, each against the real CPU allocator or by hand.

Oracle: tests/memory_oracle.py (torch.profiler's allocation events, replayed byte for byte) and hand arithmetic on
tiny models (float32 = 4 bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from memory_oracle import inference, measure_peak, resident_bytes, training_step, warm_up
from modelmeter import MemoryAnalysis

F32 = 4


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _measured(model: nn.Module, inputs: tuple[Any, ...], optimizer: str | None, training: bool) -> int:
    """The allocator's peak of inference, or of a steady training step with ``optimizer`` (default SGD)."""
    if not training:
        return resident_bytes(model, inputs) + measure_peak(inference(model, inputs)).peak_delta
    optimizers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.1),
        "adamw": lambda: torch.optim.AdamW(model.parameters()),
    }
    opt = optimizers[optimizer or "sgd"]()
    warm_up(model, inputs, opt)
    return resident_bytes(model, inputs, opt) + measure_peak(training_step(model, inputs, opt)).peak_delta


def _predicted_and_measured(build: Callable[[], nn.Module], inputs: tuple[Any, ...], training: bool,
                            optimizer: str | None) -> tuple[int, int]:
    torch.manual_seed(0)
    predicted = MemoryAnalysis(build(), inputs, training=training, optimizer=optimizer).peak()
    torch.manual_seed(0)
    return predicted, _measured(build(), inputs, optimizer, training)


# --- a matrix product copies an operand broadcast along a dimension ------------------------------------------
class FrozenFirst(nn.Module):
    """A frozen layer, then a trainable one: the trainable one's backward peaks at its weight's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)
        self.a.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Tied(nn.Module):
    """An embedding whose weight is the output layer's (a language model's tied head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


class BroadcastProduct(nn.Module):
    """Both operands of a product broadcast (a row and a column expanded): the kernel copies both."""

    def __init__(self) -> None:
        super().__init__()
        self.row, self.column = nn.Parameter(torch.randn(1, 16)), nn.Parameter(torch.randn(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(self.row.expand(8, 16), self.column.expand(16, 32)) + x


def _frozen_bias() -> nn.Module:
    layer = nn.Linear(16, 64)
    layer.bias.requires_grad_(False)
    return layer


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]] = {
    "frozen bias": (_frozen_bias, lambda: (torch.randn(8, 16),)),
    "frozen first layer": (FrozenFirst, lambda: (torch.randn(8, 16),)),
    "tied head": (Tied, lambda: (torch.randint(0, 50, (8, 6)),)),
    "broadcast operands": (BroadcastProduct, lambda: (torch.randn(8, 32),)),
}


@pytest.mark.parametrize("training,optimizer", [(False, None), (True, "sgd"), (True, "adamw")])
@pytest.mark.parametrize("case", list(CASES))
def test_a_product_of_a_broadcast_operand_against_the_allocator(case: str, training: bool,
                                                                optimizer: str | None) -> None:
    """mm and addmm copy an operand with a stride of 0 to a contiguous one before BLAS sees it, and free it before
    they return: the gradient of the default loss (a sum) is such an operand for every last Linear."""
    build, inputs = CASES[case]
    predicted, measured = _predicted_and_measured(build, inputs(), training, optimizer)
    assert predicted == measured


def test_the_copy_of_the_sums_gradient_by_hand() -> None:
    """Linear(16, 64) with a frozen bias on (8, 16), SGD: the peak is in the weight's gradient, ``mm(grad.t(), x)``,
    while the kernel holds its contiguous copy of the expanded gradient (the output's size)."""
    params, x, out, loss, seed, grad_w = (16 * 64 + 64) * F32, 8 * 16 * F32, 8 * 64 * F32, F32, F32, 64 * 16 * F32
    mem = MemoryAnalysis(_frozen_bias(), torch.randn(8, 16), training=True, optimizer="sgd")
    top = mem.peak_info()
    assert top.bytes == params + x + out + loss + seed + grad_w + out
    assert (top.at.phase, top.at.module, top.at.operator) == ("backward", "", "linear backward")
    assert top.by_kind["activation"] == out + seed + out  # the copy is the operator's own, an activation
