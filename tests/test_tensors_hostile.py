"""Exotic tensors as inputs, parameters and intermediates: a correct count, or a clear error naming what cannot be
counted — never a crash, a silent zero or a bare stack from inside torch; the model and inputs left unchanged.

Oracles: hand arithmetic (a product's multiply-adds), ``torch.utils.flop_counter.FlopCounterMode`` on the real
tensors, and the real model's outputs and state before and after.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from modelmeter import FlopCountAnalysis

pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")

with warnings.catch_warnings():  # torch.ao.quantization warns that it moves to torchao
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch.ao.nn.quantized as nnq
    from torch.ao.quantization import quantize_dynamic


def _dynamic(dtype: torch.dtype) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return quantize_dynamic(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), {nn.Linear},
                                dtype=dtype)


def _macs(model: nn.Module, inputs: object, **options: object) -> int:
    return FlopCountAnalysis(model, inputs, convention="macs", **options).total()


# --- quantized modules --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_dynamic_quantized_linears_by_hand(dtype: torch.dtype, execution: str) -> None:
    """A float16 packed weight was unpacked (to describe it) under the fake run's modes: its kernel copies values into
    a FakeTensor without storage, a segmentation fault of the whole process. Its operators were unsupported (0)."""
    model = _dynamic(dtype)
    analysis = FlopCountAnalysis(model, torch.randn(3, 8), convention="macs", execution=execution)
    assert analysis.total() == 3 * 8 * 16 + 3 * 16 * 4
    assert not analysis.unsupported_ops()
    assert {e.op for e in analysis.trace.events} <= {"aten::to", "aten::relu", *QUANTIZED_LINEARS}


QUANTIZED_LINEARS = ("quantized::linear_dynamic", "quantized::linear_dynamic_fp16")


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_a_dynamic_quantized_layer_called_twice_runs_on_fake_tensors(dtype: torch.dtype) -> None:
    """torch's cache of fake results keys a call by its packed weight and compares keys with ``==``, which packed
    weights do not implement: a layer's second call (in one run or the next analysis) failed under FakeTensors."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = _dynamic(dtype)[0]  # 8 -> 16

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) + self.body(x)

    model = Twice()
    for _ in range(2):
        assert _macs(model, torch.randn(3, 8), execution="fake") == 2 * 3 * 8 * 16


def _quint8(*shape: int) -> torch.Tensor:
    return torch.quantize_per_tensor(torch.randn(*shape), 0.1, 64, torch.quint8)


# (name, the module, its input, multiply-adds by hand: out channels x in channels/groups x kernel x positions — output
# positions for a convolution, input positions for a transposed one)
QUANTIZED_CONVOLUTIONS = [
    ("conv1d", lambda: nnq.Conv1d(3, 4, 3), (1, 3, 10), 4 * 3 * 3 * 8),
    ("conv2d grouped", lambda: nnq.Conv2d(4, 4, 3, groups=2), (1, 4, 6, 6), 4 * 2 * 9 * 16),
    ("conv3d", lambda: nnq.Conv3d(3, 4, 3), (1, 3, 5, 5, 5), 4 * 3 * 27 * 27),
    ("conv_transpose1d", lambda: nnq.ConvTranspose1d(3, 4, 3), (1, 3, 10), 3 * 4 * 3 * 10),
    ("conv_transpose2d", lambda: nnq.ConvTranspose2d(3, 4, 3, stride=2), (2, 3, 5, 5), 2 * 3 * 4 * 9 * 25),
    ("conv_transpose3d", lambda: nnq.ConvTranspose3d(3, 4, 3), (1, 3, 4, 4, 4), 3 * 4 * 27 * 64),
]


@pytest.mark.parametrize(("name", "make", "shape", "expected"), QUANTIZED_CONVOLUTIONS,
                         ids=[c[0] for c in QUANTIZED_CONVOLUTIONS])
def test_quantized_convolutions_by_hand(name: str, make: object, shape: tuple[int, ...], expected: int) -> None:
    """A 1-D convolution's packed weight has a unit height its input lacks (it was counted 4x for a kernel of 3 over
    8 positions); the transposed ones made quantized outputs without a handle, taken as integer arithmetic: 0."""
    analysis = FlopCountAnalysis(make(), _quint8(*shape), convention="macs")  # type: ignore[operator]
    assert analysis.by_operator() == {"conv": expected}
    assert not analysis.unsupported_ops()


def test_an_unknown_operator_making_quantized_values_is_reported_not_free() -> None:
    """Quantized results stand for real numbers: an operator without a handle that makes them is unsupported, not
    integer arithmetic counted as nothing."""

    norm = nnq.BatchNorm2d(3)  # quantized::batch_norm2d has no handle
    analysis = FlopCountAnalysis(norm, _quint8(1, 3, 4, 4), convention="macs")
    assert analysis.unsupported_ops() == {"quantized::batch_norm2d": 1}


def test_quantized_element_wise_operators_are_element_wise() -> None:
    """``FloatFunctional``'s quantized adds and products, and quantizing an input, count as element-wise: one flop
    per output element in ``flops`` (a quantized result is integer arithmetic there: 0), never unsupported."""
    a, b = _quint8(2, 5), _quint8(2, 5)

    class Adds(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            c = torch.ops.quantized.add_relu(torch.ops.quantized.add(a, b, 0.2, 64), b, 0.2, 64)
            d = torch.ops.quantized.mul(c, a, 0.2, 64)
            return torch.quantize_per_tensor(d.dequantize(), 0.1, 0, torch.qint8)

    analysis = FlopCountAnalysis(Adds(), (a, b), convention="flops")
    assert not analysis.unsupported_ops()
    assert analysis.by_operator() == {"dequantize": 10}


def test_a_quantized_matmul_by_hand() -> None:
    class Product(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.ops.quantized.matmul(a, b, 0.5, 64)

    assert _macs(Product(), (_quint8(2, 3, 5), _quint8(2, 5, 7))) == 2 * 3 * 7 * 5


@pytest.mark.parametrize("execution", ["auto", "real"])
def test_a_quantized_input_runs_real_kernels(execution: str) -> None:
    """FakeTensors cannot stand for a quantized tensor: ``auto`` raised torch's UnsupportedFakeTensorException from
    deep inside the fake-tensor conversion; it runs real kernels and says so."""
    analysis = FlopCountAnalysis(nnq.Linear(8, 4), _quint8(3, 8), convention="macs", execution=execution)
    assert analysis.total() == 3 * 8 * 4
    said = [a for a in analysis.assumptions() if "quantized tensors (inputs[0])" in a]
    assert len(said) == (execution == "auto")


def test_quantized_tensors_refuse_a_fake_run_naming_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"quantized tensors \(inputs\['x'\]\) need real kernels.*execution='auto'"):
        FlopCountAnalysis(nnq.Linear(8, 4), {"x": _quint8(3, 8)}, execution="fake").total()

    class Codebook(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("codes", torch.quantize_per_tensor(torch.randn(4, 8), 0.1, 0, torch.qint8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.codes.dequantize().t()

    with pytest.raises(ValueError, match=r"quantized tensors \('codes', held by the model\) need real kernels"):
        FlopCountAnalysis(Codebook(), torch.randn(3, 8), execution="fake").total()
    model = Codebook()
    before = model.codes.clone()
    assert _macs(model, torch.randn(3, 8)) == 3 * 8 * 4
    assert torch.equal(model.codes.dequantize(), before.dequantize())
