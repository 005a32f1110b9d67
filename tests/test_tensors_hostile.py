"""Exotic tensors as inputs, parameters and intermediates: a correct count, or a clear error naming what cannot be
counted — never a crash, a silent zero or a bare stack from inside torch; the model and inputs left unchanged.

Oracles: hand arithmetic (a product's multiply-adds), ``torch.utils.flop_counter.FlopCounterMode`` on the real
tensors, and the real model's outputs and state before and after.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn

import modelmeter
from modelmeter import FlopCountAnalysis
from modelmeter.engine.meta_kernels import fast_meta_kernel
from modelmeter.engine.metadata import meta_stands_for

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


# --- channels-last layouts on meta stand-ins ---------------------------------------------------------------------
def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)


def _convolution_cases() -> list[tuple[str, tuple[object, ...]]]:
    """(name, convolution arguments on the CPU) over dtypes, 2-D and 3-D, which operand is channels-last, plain or
    transposed and grouped: the layouts the CPU's backends give differ across all of them."""
    cases = []
    for dtype, dims, which, transposed in itertools.product(
            (torch.float32, torch.float64, torch.bfloat16), (2, 3), ("input", "weight", "both"), (False, True)):
        groups = 2 if transposed else 1
        x = torch.randn(2, 4, *(5,) * dims, dtype=dtype)
        w = torch.randn(*((4, 6 // groups) if transposed else (6, 4 // groups)), *(3,) * dims, dtype=dtype)
        x, w = (_channels_last(x) if which != "weight" else x), (_channels_last(w) if which != "input" else w)
        args = (x, w, None, [1] * dims, [0] * dims, [1] * dims, transposed, [0] * dims, groups)
        cases.append((f"{dtype}-{dims}d-{which}-{'transposed-' if transposed else ''}groups{groups}", args))
    return cases


def _meta(value: object) -> object:
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


def _strides(result: object) -> list[object]:
    return [None if t is None else (tuple(t.shape), t.stride()) for t in (result if isinstance(result, tuple)
                                                                           else (result,))]


CONVOLUTIONS = _convolution_cases()


@pytest.mark.parametrize(("name", "args"), CONVOLUTIONS, ids=[c[0] for c in CONVOLUTIONS])
def test_a_convolution_of_channels_last_stand_ins_is_laid_out_as_on_the_cpu(name: str, args: tuple[object, ...]
                                                                             ) -> None:
    """PyTorch's meta convolution makes contiguous results; the CPU's backends keep channels-last ones (for some
    dtypes, dimensions and operands): a ``reshape`` after it copied on the CPU only. Forward and backward."""
    aten = torch.ops.aten
    meta = tuple(_meta(a) for a in args)
    with meta_stands_for("cpu"):
        forward = fast_meta_kernel(aten.convolution.default, meta)
        assert forward is not None
        out = aten.convolution.default(*args)
        assert _strides(forward(*meta)) == _strides(out)
        grad = torch.randn_like(out)
        backward_args = (grad, *args[:2], [0], *args[3:], [True, True, False])
        backward = fast_meta_kernel(aten.convolution_backward.default, tuple(_meta(a) for a in backward_args))
        assert backward is not None
        assert (_strides(backward(*(_meta(a) for a in backward_args)))
                == _strides(aten.convolution_backward.default(*backward_args)))


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("model", ["conv", "conv3d", "group_norm"])
def test_channels_last_models_record_what_real_kernels_record(model: str, backward: bool) -> None:
    """Meta stand-ins run what the CPU runs, layouts included: the same operators (no copy on one side only) and
    the same memory peak."""
    if model == "conv":  # a channels-last input, a contiguous weight
        net, x = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), _channels_last(torch.randn(2, 3, 8, 8))
    elif model == "conv3d":
        net = nn.Sequential(nn.Conv3d(3, 4, 3), nn.ReLU(), nn.Flatten()).to(memory_format=torch.channels_last_3d)
        x = _channels_last(torch.randn(1, 3, 5, 6, 6))
    else:
        net, x = nn.Sequential(nn.GroupNorm(2, 8), nn.Flatten()), _channels_last(torch.randn(2, 8, 6, 6))
    runs = [modelmeter.analyze(net, x.requires_grad_(backward), execution=execution, backward=backward, memory=True,
                               quiet=True) for execution in ("fake", "real")]
    fake, real = ([(e.op, e.phase) for e in run.trace.events if e.level == "dispatch"] for run in runs)
    assert fake == real
    assert runs[0].memory.peak() == runs[1].memory.peak()  # type: ignore[union-attr]
