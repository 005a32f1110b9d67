"""Memory prediction, a fourth round: cases found by probing, each against the real CPU allocator or by hand.

Oracle: tests/memory_oracle.py (torch.profiler's allocation events, replayed byte for byte) and hand arithmetic on
tiny models (float32 = 4 bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pytest
import torch
from torch import nn

from memory_oracle import inference, measure_peak, resident_bytes, training_step, warm_up
from modelmeter import MemoryAnalysis, analyze
from modelmeter.metrics.memory import operand_copies
from test_memory_oracle import _one_thread  # noqa: F401 (autouse: one intra-op thread, as the oracle measures)

F32 = 4


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


# --- CPU element-wise kernels: Python numbers and operands of another dtype ------------------------------------
class Apply(nn.Module):
    """``fn`` over the inputs: the operator's own memory, on top of the inputs it reads."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.fn(*inputs)


_X = torch.randn(8, 16)
OPERANDS = {"f32": _X, "bf16": _X.bfloat16(), "f16": _X.half(), "f64": _X.double(), "i64": _X.long(), "i32": _X.int(),
            "bool": _X > 0, "row_bf16": torch.randn(16).bfloat16(), "scalar_f32": torch.tensor(2.0),
            "scalar_f64": torch.tensor(2.0, dtype=torch.float64), "c64": _X.to(torch.complex64)}
ELEMENTWISE: dict[str, tuple[str, Callable[..., Any]]] = {
    "x * 0.5": ("f32", lambda x: x * 0.5),
    "x * 2": ("f32", lambda x: x * 2),
    "x + True": ("f32", lambda x: x + True),
    "x * 1j": ("f32", lambda x: x * 1j),
    "bf16 * 0.5": ("bf16", lambda x: x * 0.5),
    "f64 * 0.5": ("f64", lambda x: x * 0.5),
    "i64 * 3": ("i64", lambda x: x * 3),
    "i64 * 0.5": ("i64", lambda x: x * 0.5),
    "i32 * 3": ("i32", lambda x: x * 3),
    "f32 + bf16": ("f32 bf16", lambda a, b: a + b),
    "f16 + bf16": ("f16 bf16", lambda a, b: a + b),
    "f32 * bool": ("f32 bool", lambda a, b: a * b),
    "f32 + row": ("f32 row_bf16", lambda a, b: a + b),
    "f32 + 0-d f64": ("f32 scalar_f64", lambda a, b: a + b),
    "bf16 + 0-d f32": ("bf16 scalar_f32", lambda a, b: a + b),
    "add_ bf16": ("f32 bf16", lambda a, b: a.clone().add_(b)),
    "bf16 add_ f32": ("bf16 f32", lambda a, b: a.clone().add_(b)),
    "x > 0": ("f32", lambda x: x > 0),
    "f32 == bf16": ("f32 bf16", lambda a, b: a == b),
    "1 - x": ("f32", lambda x: 1 - x),
    "sub alpha": ("f32", lambda x: torch.sub(x, 1, alpha=2)),
    "where": ("bool f32 bf16", torch.where),
    "maximum": ("f32 bf16", torch.maximum),
    "x ** 2": ("f32", lambda x: x**2),
    "x ** bf16": ("f32 bf16", lambda a, b: a**b),
    "2 ** x": ("f32", lambda x: 2**x),
    "x % 2": ("f32", lambda x: x % 2),
    "x // 2": ("f32", lambda x: x // 2),
    "atan2": ("f32 bf16", torch.atan2),
    "mul_ 2": ("f32", lambda x: x.clone().mul_(2)),
    "clamp": ("f32", lambda x: x.clamp(min=0.5)),
    "masked_fill": ("f32 bool", lambda a, b: a.masked_fill(b, 1.0)),
    "lerp": ("f32", lambda x: torch.lerp(x, x, 0.5)),
    "bool ^ True": ("bool", lambda x: x ^ True),
    "i64 / 2": ("i64", lambda x: x / 2),
    "i64 / i64": ("i64", lambda x: x / x),
    "div floor": ("i64", lambda x: x.div(2, rounding_mode="floor")),
    "i32 | i64": ("i32 i64", lambda a, b: a | b),
    "c64 + f32": ("c64 f32", lambda a, b: a + b),
    "mean": ("f32", lambda x: x.mean()),
    "mean(0)": ("f64", lambda x: x.mean(0)),
    "bf16 mean": ("bf16", lambda x: x.mean(-1, keepdim=True)),
    "f16 mean": ("f16", lambda x: x.mean()),
    "c64 mean": ("c64", lambda x: x.mean(0)),
    "mean in f64": ("f32", lambda x: x.mean(0, dtype=torch.float64)),
    "bf16 mean in bf16": ("bf16", lambda x: x.mean(0, dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("on_meta", [False, True], ids=["cpu", "meta"])
@pytest.mark.parametrize("case", list(ELEMENTWISE))
def test_the_temporaries_of_element_wise_kernels_against_the_allocator(case: str, on_meta: bool) -> None:
    """A Python number operand is a 0-d float64 (int64, bool, complex128) tensor inside the operator, copied to the
    operation's dtype when that differs (``x * 0.5`` on float32: 8 + 4 bytes); an operand of another dtype is copied
    to it whole; ``mean`` divides its sum by the count, and sums half precision in float32. None of it is a tensor
    of the run; meta inputs stand for the CPU's."""
    names, fn = ELEMENTWISE[case]
    inputs = tuple(OPERANDS[name] for name in names.split())
    given = tuple(t.to("meta") for t in inputs) if on_meta else inputs
    predicted = MemoryAnalysis(Apply(fn), given).peak()
    measured = resident_bytes(Apply(fn), inputs) + measure_peak(inference(Apply(fn), inputs)).peak_delta
    assert predicted == measured


def test_a_python_number_by_hand() -> None:
    """``y = x * 0.5`` of 32 float32 values: x, y, and the number as a float64 0-d tensor and its float32 copy."""
    mem = MemoryAnalysis(Apply(lambda x: x * 0.5), torch.randn(32))
    assert mem.peak() == 32 * F32 + 32 * F32 + 8 + 4
    assert mem.peak_info().by_kind == {"input": 32 * F32, "activation": 32 * F32 + 8 + 4}


# --- autocast the model enters itself -------------------------------------------------------------------------
class Autocast(nn.Module):
    """Two Linears under a ``torch.autocast("cpu")`` block of the model's own forward."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.a, self.b, self.dtype = nn.Linear(16, 64), nn.Linear(64, 16), dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=self.dtype):
            return self.b(torch.relu(self.a(x))).float()


@pytest.mark.parametrize("training,optimizer", [(False, None), (True, "sgd"), (True, "adamw")])
def test_autocast_inside_the_forward_against_the_allocator(training: bool, optimizer: str | None) -> None:
    """A CPU model runs on meta stand-ins, which CPU autocast does not cast: one that enters autocast itself runs on
    FakeTensors instead, which it casts, so the products are float16 as in the real run. (bfloat16 products take
    oneDNN scratch memory on the CPU, a documented limit: float16 here.)"""
    predicted, measured = _predicted_and_measured(lambda: Autocast(torch.float16), (torch.randn(8, 16),), training,
                                                  optimizer)
    assert predicted == measured


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_inside_the_forward_records_the_real_runs_operators(dtype: torch.dtype) -> None:
    def operators(execution: Literal["auto", "real"]) -> list[tuple[str, list[str]]]:
        torch.manual_seed(0)
        trace = MemoryAnalysis(Autocast(dtype), torch.randn(8, 16), execution=execution).trace
        return [(ev.op, [out.dtype for out in ev.outputs]) for ev in trace.events if ev.level == "dispatch"]

    fake = operators("auto")
    assert fake == operators("real")
    assert ("aten::addmm", [str(dtype).removeprefix("torch.")]) in fake


def test_a_sparse_operand_of_a_matrix_product_is_not_copied_dense() -> None:
    """The broadcast-operand copy took any tensor with a footprint for a broadcast one, and a sparse operand has
    one too (what it stores): ``torch.mm`` of a 512 x 512 sparse identity was charged a 1 MiB dense copy (a
    100k x 100k adjacency matrix: 40 GB)."""

    class SparseProduct(nn.Module):
        def forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return torch.mm(a, x)

    a, x = torch.eye(512).to_sparse(), torch.randn(512, 16)
    trace = analyze(SparseProduct(), (a, x), cache=False, quiet=True, execution="real").trace
    product = next(e for e in trace.events if e.op == "aten::mm" and e.level == "dispatch")
    assert product.inputs[0].footprint is not None  # the sparse operand's: what it stores
    assert operand_copies(trace) == {}
