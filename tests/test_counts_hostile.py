"""Counts on cases the other tests never saw: integer products, unknown operators reported once per call.

Oracles: hand arithmetic on small shapes, and the number of calls the model makes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from model_helpers import Fn
from modelmeter import FlopCountAnalysis


def analysis(model: nn.Module, inputs: Any, convention: str = "fvcore", **options: Any) -> FlopCountAnalysis:
    flops = FlopCountAnalysis(model, inputs, convention=convention, **options)
    return flops.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


@pytest.mark.parametrize("execution", ["auto", "real"])
@pytest.mark.parametrize(("convention", "per_mac"), [("fvcore", 1), ("macs", 1), ("flops", 2)])
def test_int8_products_are_counted(execution: str, convention: str, per_mac: int) -> None:
    # torch._int_mm's result is int32: an integer result must not make a product free (it was a silent zero)
    a = torch.randint(-4, 4, (32, 24), dtype=torch.int8)
    b = torch.randint(-4, 4, (24, 16), dtype=torch.int8)
    flops = analysis(Fn(torch._int_mm), (a, b), convention, execution=execution)
    assert flops.by_operator() == {"_int_mm": per_mac * 32 * 24 * 16}
    assert not flops.unsupported_ops()


@pytest.mark.parametrize(("convention", "expected"), [("macs", 4 * 32 * 16), ("flops", 2 * 4 * 32 * 16 + 4 * 16)])
def test_int8_weight_product_counts_its_scale(convention: str, expected: int) -> None:
    # (4, 32) activations times an int8 weight (16, 32) with one scale per output channel
    x, w = torch.randn(4, 32), torch.randint(-4, 4, (16, 32), dtype=torch.int8)
    flops = analysis(Fn(torch._weight_int8pack_mm), (x, w, torch.rand(16)), convention)
    assert flops.by_operator() == {"_weight_int8pack_mm": expected}


@pytest.mark.parametrize("backward", [False, True])
def test_an_unknown_call_is_reported_once_per_call(backward: bool) -> None:
    # torch.linalg.inv runs linalg_inv_ex and _linalg_check_errors: three calls are three reports, not six
    def inverses(x: torch.Tensor) -> torch.Tensor:
        return sum((torch.linalg.inv(x + i * torch.eye(4)) for i in range(3)), torch.zeros(4, 4))

    x = torch.randn(4, 4) + 8 * torch.eye(4)
    unsupported = analysis(Fn(inverses), (x.requires_grad_(backward),), backward=backward).unsupported_ops()
    assert unsupported["aten::linalg_inv"] == 3
    assert "aten::_linalg_check_errors" not in unsupported


def test_calls_reported_once_inside_modules() -> None:
    # each module's report is the calls made under it
    class Solve(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.linalg.solve(a, b)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = Solve(), Solve()

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.second(a, self.first(a, b))

    a = torch.randn(3, 3) + 6 * torch.eye(3)
    flops = analysis(Twice(), (a, torch.randn(3, 2)))
    assert flops.unsupported_ops() == {"aten::linalg_solve": 2}
    assert flops.unsupported_ops("first") == {"aten::linalg_solve": 1}


# --- overloads of one operator with as many arguments: addmm.out and addmm.dtype both take six ---------------
def _addmm_out(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.addmm(c, a, b, beta=2, alpha=3, out=torch.empty(3, 5))


def _baddbmm_out(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.baddbmm(c, a, b, beta=2, alpha=3, out=torch.empty(2, 3, 5))


@pytest.mark.parametrize("convention", ["fvcore", "macs", "flops"])
@pytest.mark.parametrize(("fn", "shapes", "macs"), [
    (_addmm_out, [(5,), (3, 4), (4, 5)], 3 * 4 * 5),
    (_baddbmm_out, [(5,), (2, 3, 4), (2, 4, 5)], 2 * 3 * 4 * 5),
])
def test_an_out_form_is_read_as_itself(convention: str, fn: Any, shapes: list[tuple[int, ...]], macs: int) -> None:
    # the out= call places six arguments, as many as the out_dtype overload has: it was read as that one (beta
    # taken for out_dtype, alpha for beta, the out tensor for alpha) and failed deep inside a formula
    flops = analysis(Fn(fn), tuple(torch.randn(s) for s in shapes), convention)
    outputs = macs // shapes[1][-1]
    # flops: the products, the add, beta's and alpha's multiplies (beta = 2, alpha = 3)
    expected = 2 * macs + 3 * outputs if convention == "flops" else macs
    assert flops.total() == expected


def test_an_out_form_does_not_read_what_it_writes_into() -> None:
    from modelmeter.metrics.traffic import count_bytes

    c, a, b = torch.randn(5), torch.randn(3, 4), torch.randn(4, 5)
    trace = FlopCountAnalysis(Fn(_addmm_out), (c, a, b), execution="real").trace
    # read: c, a, b; written: the (3, 5) result; 4 bytes each
    assert count_bytes(trace).counts[""]["addmm"] == 4 * (5 + 12 + 20 + 15)


@pytest.mark.parametrize(("x", "y", "dim"), [((3, 4), (3, 4), -1), ((2, 1, 4), (3, 4), -1), ((5, 3), (5, 1), 0)])
def test_vecdot_is_a_product(x: tuple[int, ...], y: tuple[int, ...], dim: int) -> None:
    # torch.linalg.vecdot runs as mul and sum, free under fvcore and macs: it counted 0 with nothing reported
    def vecdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vecdot(a, b, dim=dim)

    def decomposed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum(dim)

    inputs = (torch.randn(x), torch.randn(y))
    pairs = torch.broadcast_shapes(x, y).numel()  # one multiply-add per element of the broadcast operands
    assert analysis(Fn(vecdot), inputs, "macs").by_operator() == {"linalg_vecdot": pairs}
    # flops: what the multiply and the sum it runs count as separate operators
    assert analysis(Fn(vecdot), inputs, "flops").total() == analysis(Fn(decomposed), inputs, "flops").total()


# --- an LSTM's backward pass: the fused kernel computes every gradient, the decomposition what autograd needs ----
@pytest.mark.parametrize(("input_grad", "state_grad"), [(False, False), (True, True)])
def test_lstm_backward_real_and_fake_by_hand(input_grad: bool, state_grad: bool) -> None:
    steps, batch, i, h = 5, 3, 4, 6
    torch.manual_seed(0)
    lstm = nn.LSTM(i, h)
    x = torch.randn(steps, batch, i, requires_grad=input_grad)
    inputs: tuple[Any, ...] = (x,)
    if state_grad:
        inputs = (x, (torch.randn(1, batch, h, requires_grad=True), torch.randn(1, batch, h, requires_grad=True)))
    rows = steps * batch
    forward = rows * 4 * h * (i + h)
    skipped = (0 if input_grad else rows * 4 * h * i) + (0 if state_grad else batch * 4 * h * h)
    for execution, backward in (("real", 2 * forward), ("fake", 2 * forward - skipped)):
        phases = analysis(lstm, inputs, "macs", backward=True, execution=execution).by_phase()
        assert phases == {"forward": forward, "backward": backward}, execution


def test_every_overload_is_told_apart_where_its_tensors_tell() -> None:
    # the class of the out= defect: for every operator of every convention's table, a call placed by any overload is
    # read by an overload with its tensors in the same places (overloads alike there, `max.other` and
    # `max.unary_out`, cannot be told apart by the arguments: the first that is not an out form is taken)
    from modelmeter.handles.binding import _overload_for, _overloads
    from modelmeter.handles.conventions import get_convention

    ops = {op for name in ("fvcore", "macs", "flops") for op in get_convention(name).handles}
    checked = 0
    for op in sorted(ops):
        overloads = _overloads(op, None) or ()
        for overload in overloads:
            inputs = [torch.empty(0) if argument.tensor else 1 for argument in overload.arguments]
            chosen = _overload_for(overloads, inputs)
            assert [a.tensor for a in chosen.arguments] == [a.tensor for a in overload.arguments], (op, overload.name)
            checked += 1
    assert checked > 500


def test_static_quantized_model_by_hand() -> None:
    # quantized conv and linear counted, and the DeQuantStub's dequantize is element-wise, not unsupported
    import torch.ao.quantization as quantization

    class Quantized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant, self.dequant = quantization.QuantStub(), quantization.DeQuantStub()
            self.conv, self.linear = nn.Conv2d(2, 3, 3), nn.Linear(3 * 4 * 4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.dequant(self.linear(self.conv(self.quant(x)).flatten(1)))

    model = Quantized().eval()
    model.qconfig = quantization.get_default_qconfig("fbgemm")
    prepared = quantization.prepare(model)
    prepared(torch.randn(2, 2, 6, 6))
    x = torch.randn(2, 2, 6, 6)
    flops = analysis(quantization.convert(prepared), (x,), "macs")
    assert flops.by_operator() == {"conv": 2 * 3 * 2 * 9 * 16, "linear": 2 * 48 * 5}
    assert not flops.unsupported_ops()


# --- pooling windows clipped by padding and ceil_mode: torch's kernels read only the input -------------------
@st.composite
def pool_cases(draw: st.DrawFn) -> tuple[int, int, int, int, bool, int]:
    kernel, dilation = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    size = draw(st.integers((kernel - 1) * dilation + 1, 12))
    return size, kernel, draw(st.integers(1, 3)), draw(st.integers(0, kernel // 2)), draw(st.booleans()), dilation


def _ones_read(x: torch.Tensor, out: torch.Tensor, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """Input elements the windows read, by torch: the windows of a ones tensor zero-padded far enough on the right
    for ``out``'s size (a ceil_mode overhang), summed."""
    needed = [(o - 1) * stride + (kernel - 1) * dilation + 1 for o in out.shape[-2:]]
    extra = [max(0, n - (s + 2 * padding)) for n, s in zip(needed, x.shape[-2:], strict=True)]
    padded = F.pad(torch.ones_like(x), (padding, padding + extra[1], padding, padding + extra[0]))
    columns = F.unfold(padded, kernel, dilation=dilation, stride=stride)
    assert columns.shape[-1] == out.shape[-2] * out.shape[-1]
    return int(columns.sum())


@settings(max_examples=12, deadline=None)
@given(pool_cases())
def test_max_pool_counts_the_elements_its_windows_read(case: tuple[int, int, int, int, bool, int]) -> None:
    size, kernel, stride, padding, ceil_mode, dilation = case
    x = torch.randn(1, 2, size, size + 1)

    def pool(t: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(t, kernel, stride, padding, dilation, ceil_mode)

    expected = _ones_read(x, pool(x), kernel, stride, padding, dilation)
    assert analysis(Fn(pool), (x,), "flops").by_operator() == {"max_pool2d": expected}


@settings(max_examples=12, deadline=None)
@given(pool_cases())
def test_avg_pool_counts_the_elements_its_windows_read(case: tuple[int, int, int, int, bool, int]) -> None:
    size, kernel, stride, padding, ceil_mode, _ = case
    x = torch.randn(1, 2, size, size + 1, requires_grad=True)

    def pool(t: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(t, kernel, stride, padding, ceil_mode)

    # torch's own count of the elements each window reads: a sum of ones, divided by 1, padding not included
    read = int(F.avg_pool2d(torch.ones_like(x), kernel, stride, padding, ceil_mode, count_include_pad=False,
                            divisor_override=1).sum())
    outputs = pool(x).numel()
    phases = analysis(Fn(pool), (x,), "flops", backward=True).by_phase_and_operator()
    assert phases["forward"] == {"avg_pool2d": read + outputs}
    assert phases["backward"] == {"avg_pool2d_backward": read + outputs}
