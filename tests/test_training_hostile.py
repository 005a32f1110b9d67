"""Training steps as a demanding user writes them: losses over one element of the output, targets captured by the
loss, frozen and tied parameters, activation checkpointing, inputs that require grad.

Oracles: the real CPU allocator (tests/memory_oracle.py, a steady step after a warm-up step), torch's own
FlopCounterMode on the same step run for real, and hand arithmetic on the optimizer's state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from memory_oracle import measure_peak, resident_bytes, training_step, warm_up
from modelmeter import MemoryAnalysis


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _measured_sgd_step(model: nn.Module, inputs: tuple[Any, ...], resident: tuple[Any, ...],
                       loss_fn: Callable[[Any], torch.Tensor] | None = None) -> int:
    """The allocator's peak of a steady SGD step: the bytes alive before it (``resident``: the inputs and any
    tensor the step reads from outside, as a loss's target) plus the largest rise during it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up(model, inputs, optimizer, loss_fn)
    return resident_bytes(model, resident, optimizer) + measure_peak(
        training_step(model, inputs, optimizer, loss_fn)).peak_delta


# --- tensors from outside the run, saved for the backward pass ------------------------------------------------
_SCALE = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


class _ScaledByAGlobal(nn.Module):
    """Multiplies by a module-level tensor (no parameter, no buffer, no input): ``mul`` saves it for the backward
    pass, which reaches it last, so it is saved through the widest layer's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 512), nn.Linear(512, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(self.a(x) * _SCALE)))


@pytest.mark.parametrize("execution", ["fake", "real"])
def test_a_tensor_from_outside_the_run_saved_for_backward_is_no_copy(execution: str) -> None:
    """The fake run detached what autograd saves under the fake mode: a real tensor from outside the run (a global,
    a loss's target) became a fake copy, a second storage its size that no real step allocates (8 KiB over here)."""
    torch.manual_seed(0)
    model, x = _ScaledByAGlobal(), torch.randn(32, 64)
    mem = MemoryAnalysis(model, x, training=True, optimizer="sgd", execution=execution)  # type: ignore[arg-type]
    assert mem.trace.execution == execution
    assert mem.peak() == _measured_sgd_step(model, (x,), (x, _SCALE))


def test_a_target_captured_by_the_loss_is_counted_once_in_both_runs() -> None:
    """``loss_fn=lambda out: cross_entropy(out, labels)``, the usual way: the labels are there before the step (once),
    and the fake run's timeline is the real run's, point by point."""
    torch.manual_seed(0)
    model, x, labels = nn.Linear(16, 10), torch.randn(8, 16), torch.randint(0, 10, (8,))

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, labels)

    fake, real = (MemoryAnalysis(model, x, training=True, optimizer="adam", loss_fn=loss_fn, execution=execution)
                  for execution in ("fake", "real"))
    assert fake.trace.execution == "fake"
    assert [p.live for p in fake.timeline()] == [p.live for p in real.timeline()]
    assert [s.nbytes for s in fake.trace.storages if s.dtype == "int64"] == [labels.nbytes]
