"""The allocator oracle of memory_oracle.py against allocations counted by hand.

Every expected event list below is written out from the shapes (float32 = 4 bytes) and from what the
kernels are known to allocate, so the oracle is proven exact before modelmeter's predictions are
compared with it. The optimizer cases pin the transient-memory formulas modelmeter's simulation uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from memory_oracle import (
    _replay,
    default_loss,
    inference,
    measure_peak,
    resident_bytes,
    training_step,
    warm_up,
)

F32 = 4
WRAPPED_SCALAR = 8 + 4  # a Python number operand: a float64 0-d tensor, then its float32 copy inside the op


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The unmeasured forward and backward passes too: two OpenMP threads on tiny shapes are slow and jittery."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_two_buffers_one_freed() -> None:
    def fn() -> torch.Tensor:
        a = torch.empty(1000)
        b = torch.empty(1000)
        del a
        return b

    m = measure_peak(fn)
    assert m.events == (4000, 4000, -4000)
    assert (m.peak_delta, m.end_delta, m.allocs, m.frees, m.foreign_frees) == (8000, 4000, 2, 1, 0)


def test_nothing_allocates_nothing() -> None:
    m = measure_peak(lambda: None)
    assert (m.events, m.peak_delta, m.end_delta) == ((), 0, 0)


def test_matmul_chain_frees_its_intermediate() -> None:
    x, w1, w2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 4)
    m = measure_peak(lambda: (x @ w1) @ w2)
    assert m.events == (8 * 32 * F32, 8 * 4 * F32, -8 * 32 * F32)
    assert (m.peak_delta, m.end_delta) == (8 * 36 * F32, 8 * 4 * F32)


def test_views_allocate_nothing() -> None:
    x = torch.randn(8, 16)
    m = measure_peak(lambda: (x.t(), x[2:], x.view(-1), x.expand(3, 8, 16), x.unsqueeze(0), x.reshape(16, 8)))
    assert m.events == ()


def test_in_place_ops_with_tensor_operands_allocate_nothing() -> None:
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    assert measure_peak(lambda: x.add_(y).mul_(y).relu_()).events == ()


def test_python_scalar_operand_is_a_hidden_wrapped_tensor() -> None:
    x = torch.randn(8, 16)
    m = measure_peak(lambda: x.mul_(2.0))
    assert m.events == (8, 4, -4, -8)
    assert m.peak_delta == WRAPPED_SCALAR


def test_linear_backward_is_seen() -> None:
    """Linear(4, 3) on a (2, 4) input that needs no grad, loss = output.sum(), then backward."""
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    m = measure_peak(lambda: lin(x).sum().backward())
    out, loss, grad_w, grad_b = 2 * 3 * F32, F32, 3 * 4 * F32, 3 * F32
    assert m.events == (
        out,  # addmm
        loss,  # sum
        -out,  # the output is not saved by SumBackward: freed once sum returns
        loss,  # backward's seed gradient, ones_like(loss)
        grad_w,  # mm(grad.t(), x): the weight's grad, kept by AccumulateGrad
        out,  # mm copies the stride-0 expanded output grad to a contiguous temporary...
        -out,  # ...and frees it
        grad_b,  # grad.sum(0): the bias's grad
        -loss,  # the seed gradient
        -loss,  # the loss itself
    )
    assert m.end_delta == lin.weight.nbytes + lin.bias.nbytes
    assert m.peak_delta == loss + loss + grad_w + out


def test_one_intra_op_thread_while_measuring() -> None:
    torch.set_num_threads(2)
    seen: list[int] = []
    measure_peak(lambda: seen.append(torch.get_num_threads()))
    assert seen == [1]
    assert torch.get_num_threads() == 2


def test_frees_of_earlier_storages_are_foreign() -> None:
    holder: list[torch.Tensor] = []
    first = measure_peak(lambda: holder.append(torch.empty(100)))
    second = measure_peak(holder.clear)
    assert (first.events, first.foreign_frees) == ((400,), 0)
    assert (second.events, second.foreign_frees) == ((), 1)


def _event(size: int, total: int, ptr: int, time: int) -> SimpleNamespace:
    fields = SimpleNamespace(alloc_size=size, total_allocated=total, ptr=ptr)
    return SimpleNamespace(extra_fields=fields, start_time_ns=time)


def test_replay_orders_by_time_and_checks_the_running_total() -> None:
    consistent = [_event(-8, 100, 1, 3), _event(8, 108, 1, 2), _event(4, 100, 2, 1)]
    assert _replay(consistent).events == (4, 8, -8)
    with pytest.raises(RuntimeError, match="out of order"):
        _replay([_event(4, 100, 2, 1), _event(8, 112, 1, 2)])


def test_inference_output_is_alive_at_the_end() -> None:
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    assert measure_peak(inference(lin, (x,))).events == (2 * 3 * F32,)


def test_resident_bytes_counts_each_storage_once() -> None:
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    params, inputs = (12 + 3) * F32, 8 * F32
    assert resident_bytes(lin, (x, x[1:], {"again": x})) == params + inputs
    lin(x).sum().backward()
    assert resident_bytes(lin, (x,)) == 2 * params + inputs


def test_default_loss_sums_floating_outputs_only() -> None:
    y, z = torch.randn(2, 3), torch.randn(4)
    loss = default_loss({"y": y, "n": torch.ones(2, dtype=torch.long), "z": (z,)})
    torch.testing.assert_close(loss, y.sum() + z.sum())


def test_sgd_training_step_hand_count() -> None:
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    optimizer = torch.optim.SGD(lin.parameters(), lr=0.1)
    warm_up(lin, (x,), optimizer)
    out, loss, grad_w, grad_b = 2 * 3 * F32, F32, 3 * 4 * F32, 3 * F32
    m = measure_peak(training_step(lin, (x,), optimizer))
    assert m.events == (out, loss, loss, grad_w, out, -out, grad_b, -loss, -grad_w, -grad_b, -out, -loss)
    assert (m.peak_delta, m.end_delta, m.foreign_frees) == (out + 2 * loss + grad_w + out, 0, 0)
    assert resident_bytes(lin, (x,), optimizer) == (12 + 3 + 8) * F32


def test_adam_training_step_hand_count() -> None:
    """Steady Adam (foreach=False): at its peak the grads, output and loss are alive, plus sqrt(exp_avg_sq)
    and its quotient for the weight, plus a wrapped scalar."""
    lin, x = nn.Linear(4, 3), torch.randn(2, 4)
    optimizer = torch.optim.Adam(lin.parameters(), foreach=False)
    warm_up(lin, (x,), optimizer)
    steps = [state["step"] for state in optimizer.state.values()]
    assert [(s.dtype, s.dim()) for s in steps] == [(torch.float32, 0)] * 2
    params, inputs = (12 + 3) * F32, 8 * F32
    assert resident_bytes(lin, (x,), optimizer) == 3 * params + 2 * F32 + inputs
    m = measure_peak(training_step(lin, (x,), optimizer))
    alive = 2 * 3 * F32 + F32 + params
    assert (m.peak_delta, m.end_delta) == (alive + 2 * 12 * F32 + WRAPPED_SCALAR, 0)


# --- optimizer step transient memory: formulas over the parameter sizes p_i (bytes, in order) ---
def _mlp() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(nn.Linear(10, 50), nn.ReLU(), nn.Linear(50, 7), nn.ReLU(), nn.Linear(7, 3)), torch.randn(4, 10)


def _cnn() -> tuple[nn.Module, torch.Tensor]:
    layers = [nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3, bias=False), nn.Flatten()]
    return nn.Sequential(*layers, nn.Linear(16 * 4 * 4, 5)), torch.randn(2, 3, 8, 8)


def _loop_adam(p: list[int]) -> int:
    """Per parameter, sqrt(exp_avg_sq) and the quotient by the bias correction, while the previous
    parameter's denominator is still bound to the loop variable."""
    return max(prev + 2 * cur for prev, cur in pairwise([0, *p])) + WRAPPED_SCALAR


Formula = Callable[[list[int]], int]
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], Formula]] = {
    "sgd": (torch.optim.SGD, {"foreach": False}, lambda p: 0),
    "sgd-foreach": (torch.optim.SGD, {"foreach": True}, lambda p: 0),
    "sgd-fused": (torch.optim.SGD, {"fused": True}, lambda p: 0),
    "momentum": (torch.optim.SGD, {"momentum": 0.9, "foreach": False}, lambda p: WRAPPED_SCALAR),
    "momentum-foreach": (torch.optim.SGD, {"momentum": 0.9, "foreach": True}, lambda p: WRAPPED_SCALAR),
    "momentum-fused": (torch.optim.SGD, {"momentum": 0.9, "fused": True}, lambda p: 0),
    "adam": (torch.optim.Adam, {"foreach": False}, _loop_adam),
    "adam-foreach": (torch.optim.Adam, {"foreach": True}, lambda p: sum(p) + WRAPPED_SCALAR),
    "adam-fused": (torch.optim.Adam, {"fused": True}, lambda p: WRAPPED_SCALAR),
    "adamw": (torch.optim.AdamW, {"foreach": False}, _loop_adam),
    "adamw-foreach": (torch.optim.AdamW, {"foreach": True}, lambda p: sum(p) + WRAPPED_SCALAR),
    "adamw-fused": (torch.optim.AdamW, {"fused": True}, lambda p: WRAPPED_SCALAR),
}


def _state_bytes(optimizer_class: type[torch.optim.Optimizer], kwargs: dict[str, Any], p: list[int]) -> int:
    """Momentum buffers: 1 x params; Adam(W): exp_avg and exp_avg_sq, 2 x params, plus a float32 step each."""
    if optimizer_class is torch.optim.SGD:
        return sum(p) if kwargs.get("momentum") else 0
    return 2 * sum(p) + F32 * len(p)


@pytest.mark.parametrize("build", [_mlp, _cnn], ids=["mlp", "cnn"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_step_transient(name: str, build: Callable[[], tuple[nn.Module, torch.Tensor]]) -> None:
    optimizer_class, kwargs, transient = OPTIMIZERS[name]
    model, x = build()
    optimizer = optimizer_class(model.parameters(), **kwargs)
    p = [param.nbytes for param in model.parameters()]
    model(x).sum().backward()
    first = measure_peak(optimizer.step)
    model(x).sum().backward()
    steady = measure_peak(optimizer.step)
    state = _state_bytes(optimizer_class, kwargs, p)
    first_transient = 0 if optimizer_class is torch.optim.SGD else transient(p)  # the first momentum step clones
    assert (first.peak_delta, first.end_delta) == (state + first_transient, state)
    assert (steady.peak_delta, steady.end_delta, steady.foreign_frees) == (transient(p), 0, 0)
