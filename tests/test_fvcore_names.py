"""fvcore's operator names as handle keys, ignore keys and reported names, and custom autograd Functions.

Oracle: fvcore itself (jit tracing). A handle that works on both fvcore's ``torch._C.Value`` and our
``TensorMeta`` is set under the same name on both analyses; the totals must agree — which they do only if
the handle ran for exactly the calls fvcore gives that name, with arguments of the same shapes.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelmeter import ActivationCountAnalysis, FlopCountAnalysis, ModelRunError

fvcore_nn = pytest.importorskip("fvcore.nn")

# fvcore's default handles (fvcore/nn/flop_count.py) and what activation_count.py adds.
FVCORE_NAMES = [
    "aten::_convolution", "aten::linear", "aten::matmul", "aten::einsum", "aten::upsample_nearest2d",
    "aten::upsample_bilinear2d", "aten::batch_norm", "aten::group_norm", "aten::layer_norm", "aten::instance_norm",
    "aten::adaptive_avg_pool2d", "aten::grid_sampler", "aten::addmm", "aten::bmm", "aten::mm",
]
# torch.jit's bookkeeping nodes (shape reads, int conversions) and its trivial slices: no recorded counterpart.
JIT_ONLY = {"aten::size", "aten::Int", "aten::ScalarImplicit", "aten::slice"}


def numel(value: Any) -> int:
    """Elements of a tensor argument, from fvcore's ``torch._C.Value`` or from our metadata; 0 for others."""
    if hasattr(value, "isCompleteTensor"):
        return math.prod(value.type().sizes()) if value.isCompleteTensor() else 0
    return math.prod(value.shape) if hasattr(value, "shape") else 0


def sized(inputs: list[Any], outputs: list[Any]) -> int:
    """A call-by-call fingerprint: 1000 per call plus the elements of its first input and output."""
    return 1000 + numel(inputs[0]) + numel(outputs[0])


def calls(inputs: list[Any], outputs: list[Any]) -> int:
    return 1


def fvcore_flops(model: nn.Module, inputs: Any, **handles: Any) -> Any:
    analysis = fvcore_nn.FlopCountAnalysis(model, inputs).unsupported_ops_warnings(False)
    analysis.uncalled_modules_warnings(False).set_op_handle(**handles)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analysis.total()
    return analysis


def ours(model: nn.Module, inputs: Any, **kwargs: Any) -> FlopCountAnalysis:
    return FlopCountAnalysis(model, inputs, **kwargs).unsupported_ops_warnings(False).uncalled_modules_warnings(False)


class AllLayers(nn.Module):
    """Every operator fvcore has a handle for, convolutions of every kind among them (but a string padding,
    which fvcore does not count: ``aten::_convolution_mode``)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv1d(3, 4, 3), nn.Conv2d(3, 4, 3, stride=2), nn.Conv3d(3, 4, 1)
        self.ct = nn.ConvTranspose2d(3, 4, 2, stride=2, groups=1)
        self.bn, self.gn, self.ln = nn.BatchNorm2d(3), nn.GroupNorm(1, 3), nn.LayerNorm(8)
        self.inn, self.lin, self.pool = nn.InstanceNorm2d(3, affine=True), nn.Linear(8, 5), nn.AdaptiveAvgPool2d(2)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        grid = torch.zeros(2, 4, 4, 2)
        return [self.c1(x[:, :, 0]), self.c2(x), self.c3(x[:, :, None]), self.ct(x), self.bn(x),
                self.gn(x), self.ln(x), self.inn(x), self.lin(x), self.pool(x), F.interpolate(x, scale_factor=2),
                F.interpolate(x, scale_factor=2, mode="bilinear"), x @ x.transpose(-1, -2),
                torch.mm(x[0, 0], x[0, 1]), torch.bmm(x[0], x[1]), torch.addmm(x[0, 0], x[0, 1], x[0, 2]),
                torch.einsum("bij,bjk->bik", x[0], x[1]), F.grid_sample(x, grid, align_corners=False)]


class Block(nn.Module):
    """A residual block with in-place ReLUs (``F.relu`` runs ``relu_``), flatten, cat and views."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True)
        self.fc = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn(self.conv(x)) + x)
        y = torch.cat([y, y], 1).permute(0, 1, 3, 2).contiguous()
        y = F.max_pool2d(y, 2).flatten(1).view(2, -1, 32).transpose(0, 1).reshape(-1, 32)
        return self.fc(y).unsqueeze(0).squeeze(0).chunk(2, 0)[0]


class NoOps(nn.Module):
    """Bitwise operators (``aten::__and__`` & co.) and calls that run no operator: dropout in eval mode,
    ``contiguous`` of a contiguous tensor, conversions to the tensor's own dtype (``x.float()`` is ``aten::to``)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mask = (x > 0) & (x < 1) | (x > 2) ^ (x < -1)
        y = F.dropout(x, 0.5, training=False).contiguous().to(torch.float32).type_as(x)
        return y * mask, x.float(), x.detach()


NO_OPS_NAMES = {"aten::gt", "aten::lt", "aten::to", "aten::__and__", "aten::__xor__", "aten::__or__",
                "aten::dropout", "aten::contiguous", "aten::type_as", "aten::mul", "aten::detach"}


def all_layers() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return AllLayers().eval(), torch.randn(2, 3, 8, 8)


@pytest.mark.parametrize("name", FVCORE_NAMES)
def test_fvcore_name_as_handle_key(name: str) -> None:
    model, x = all_layers()
    theirs = fvcore_flops(model, x, **{name: sized})
    mine = ours(model, x).set_op_handle(name, sized)
    assert mine.total() == theirs.total()
    assert mine.by_operator() == Counter({k: v for k, v in theirs.by_operator().items()})


@pytest.mark.parametrize("name", FVCORE_NAMES)
def test_fvcore_name_as_ignore_key(name: str) -> None:
    """fvcore keeps counting an op with a default handle set to None (its bug); a handle returning 0 is the
    oracle for ignoring it."""
    model, x = all_layers()
    theirs = fvcore_flops(model, x, **{name: lambda inputs, outputs: 0})
    mine = ours(model, x).set_op_handle(name, None)
    assert mine.total() == theirs.total()
    assert +mine.by_operator() == +theirs.by_operator()


def test_convolution_handle_gets_fvcore_arguments() -> None:
    """``aten::_convolution``'s handle sees fvcore's thirteen arguments (``transposed`` at 6); a string padding
    is ``aten::_convolution_mode``, with the user-level call's arguments (the padding string at 4)."""
    model, x = nn.ModuleList([AllLayers(), nn.Conv2d(3, 4, 3, padding="same")]), torch.randn(2, 3, 8, 8)
    model.forward = lambda x: [*model[0](x), model[1](x)]  # type: ignore[method-assign]
    seen: list[tuple[int, Any]] = []
    mode: list[Any] = []

    def conv(inputs: list[Any], outputs: list[Any]) -> int:
        seen.append((len(inputs), inputs[6]))
        return 1

    def conv_mode(inputs: list[Any], outputs: list[Any]) -> int:
        mode.append(inputs[4])
        return 1

    mine = ours(model, x).set_op_handle("aten::_convolution", conv, "aten::_convolution_mode", conv_mode)
    assert mine.by_operator()["_convolution"] == 4 and mine.by_operator()["_convolution_mode"] == 1
    assert sorted(seen, key=str) == [(13, False)] * 3 + [(13, True)] and mode == ["same"]
    theirs = fvcore_flops(model, x, **{"aten::_convolution": calls, "aten::_convolution_mode": calls})
    assert theirs.by_operator()["_convolution"] == 4 and theirs.by_operator()["_convolution_mode"] == 1


def test_our_convolution_names_still_work() -> None:
    """The recorded names keep working: ``aten::conv2d`` (the user-level call) and ``aten::convolution``."""
    model, x = all_layers()
    assert ours(model, x).set_op_handle("aten::conv2d", calls).by_operator()["conv2d"] == 1
    assert ours(model, x).set_op_handle("aten::convolution", calls).by_operator()["convolution"] == 4


def test_unsupported_names_are_fvcores() -> None:
    """With every handle cleared, the operators reported (and their counts) are fvcore's."""
    model, x = all_layers()
    theirs = fvcore_flops(model, x).clear_op_handles()
    theirs.total()
    mine = ours(model, x).clear_op_handles()
    assert mine.total() == 0
    reported = mine.unsupported_ops()
    assert reported["aten::_convolution"] == 4
    assert reported == Counter({k: n for k, n in theirs.unsupported_ops().items() if k in reported})
    assert set(FVCORE_NAMES) - {"aten::einsum"} <= set(reported)  # einsum runs as bmm here: reported so


def test_unsupported_convolution_logged_under_fvcore_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="modelmeter"):
        FlopCountAnalysis(nn.Conv1d(2, 2, 1), torch.randn(1, 2, 4)).clear_op_handles().total()
    assert "Unsupported operator aten::_convolution encountered 1 time(s)" in caplog.text


BLOCK_NAMES = {"aten::_convolution", "aten::batch_norm", "aten::add", "aten::relu_", "aten::cat", "aten::permute",
               "aten::contiguous", "aten::max_pool2d", "aten::flatten", "aten::view", "aten::transpose",
               "aten::reshape", "aten::linear", "aten::unsqueeze", "aten::squeeze", "aten::chunk"}


@pytest.mark.parametrize("model", ["block", "no_ops", "all_layers"])
def test_every_recorded_name_counts_the_calls_fvcore_records(model: str) -> None:
    """Every operator name in fvcore's trace (its defaults, ignored ops and unsupported ops) as a handle key
    counts as many calls as fvcore gives it: ``relu_`` inside ``F.relu``, but not the ``view`` inside
    ``flatten`` nor the ``bmm`` inside ``einsum``."""
    if model == "block":
        torch.manual_seed(0)
        net, x = Block().eval(), torch.randn(2, 4, 4, 4)
    elif model == "no_ops":
        net, x = NoOps(), torch.randn(3)
    else:
        net, x = all_layers()
    everything = fvcore_flops(net, x).clear_op_handles()
    everything._ignored_ops = set()
    everything._stats = None
    everything.total()
    names = set(everything.unsupported_ops()) - JIT_ONLY
    expected = {"block": BLOCK_NAMES, "no_ops": NO_OPS_NAMES}.get(model)
    assert names == expected if expected is not None else set(FVCORE_NAMES) <= names
    trace = ours(net, x).trace
    for name in sorted(names):
        mine = ours(net, x, trace=trace).set_op_handle(name, calls)
        zero = ours(net, x, trace=trace).set_op_handle(name, lambda inputs, outputs: 0)
        assert mine.total() - zero.total() == everything.unsupported_ops()[name], name


# --- custom autograd Functions -----------------------------------------------------------------------
class Square(torch.autograd.Function):
    """x @ x (visible to the recorder), then scaled."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.mm(x, x) * k

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return torch.mm(grad, x.t()) + torch.mm(x.t(), grad), None


class ViaNumpy(torch.autograd.Function):
    """Computes in numpy: nothing the recorder can see."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.tanh(x.detach().numpy()))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class WithFunctions(nn.Module):
    def __init__(self, numpy: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.numpy = numpy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = Square.apply(self.fc(x), 3.0)
        return ViaNumpy.apply(y) if self.numpy else y


def test_function_counts_what_it_ran_by_default() -> None:
    """Hand count: the Linear (4·4·4) and the mm inside the Function (4·4·4)."""
    analysis = ours(WithFunctions(), torch.randn(4, 4))
    assert analysis.by_operator() == Counter({"linear": 64, "mm": 64})
    assert analysis.unsupported_ops() == Counter()


def test_function_handle_key_is_fvcores() -> None:
    model, x = WithFunctions(), torch.randn(4, 4)
    theirs = fvcore_flops(model, x, **{"prim::PythonOp.Square": sized})
    mine = ours(model, x).set_op_handle("prim::PythonOp.Square", sized)
    assert mine.by_operator() == theirs.by_operator() == Counter({"linear": 64, "PythonOp.Square": 1032})
    assert ours(model, x).set_op_handle("prim::PythonOp", calls).by_operator()["PythonOp.Square"] == 1


def test_opaque_function_is_reported_not_counted_as_zero() -> None:
    """Under fake tensors ``.numpy()`` cannot run: auto falls back to real kernels and reports the Function
    (as fvcore does); a fake-only run fails with a clear error."""
    model, x = WithFunctions(numpy=True), torch.randn(4, 4)
    analysis = ours(model, x)
    assert analysis.unsupported_ops() == Counter({"prim::PythonOp.ViaNumpy": 1})
    assert analysis.total() == 128
    assert any("ran real kernels" in a for a in analysis.assumptions())
    theirs = fvcore_flops(model, x)
    assert theirs.unsupported_ops()["prim::PythonOp.ViaNumpy"] == 1
    assert ours(model, x, execution="real").unsupported_ops() == analysis.unsupported_ops()
    with pytest.raises(ModelRunError, match="numpy"):
        ours(model, x, execution="fake").total()
    silenced = ours(model, x).set_op_handle("prim::PythonOp.ViaNumpy", None)
    assert silenced.unsupported_ops() == Counter() and silenced.total() == 128
    counted = ours(model, x).set_op_handle("prim::PythonOp.ViaNumpy", lambda inputs, outputs: inputs[0].numel())
    assert counted.by_operator()["PythonOp.ViaNumpy"] == 16 and counted.unsupported_ops() == Counter()


def test_function_that_only_moves_data_is_not_opaque() -> None:
    class Reverse(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return -grad

    class Net(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Reverse.apply(x)

    assert ours(Net(), torch.randn(3)).unsupported_ops() == Counter()


def test_function_apply_is_restored_exactly() -> None:
    original = torch.autograd.Function.__dict__["apply"]
    ours(WithFunctions(), torch.randn(4, 4)).total()
    assert torch.autograd.Function.__dict__["apply"] is original

    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Square.apply(x[:, :3])  # mm of a 4x3 by a 4x3: fails

    with pytest.raises(ModelRunError, match="aten::mm"):
        ours(Broken(), torch.randn(4, 4), execution="real").total()
    assert torch.autograd.Function.__dict__["apply"] is original
    assert Square.apply(torch.ones(2, 2)).sum().item() == 16  # and works as before


def test_function_backward_is_attributed_to_its_module() -> None:
    """Backward: the Linear's two products (64 each; its input needs no grad) and the Function's backward,
    two mm of 4x4 (64 each), all under ``fc``'s caller, the root; ``backward:prim::PythonOp.Square`` replaces
    the Function's backward count."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.inner = WithFunctions()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.fc(x))

    analysis = ours(Net(), torch.randn(4, 4), backward=True)
    forward = 64 + 64 + 64
    assert analysis.by_phase() == {"forward": forward, "backward": 64 + 2 * 64 + 2 * 64}
    assert analysis.by_phase("inner") == {"forward": 128, "backward": 64 * 2 + 2 * 64}
    whole = ours(Net(), torch.randn(4, 4), backward=True)
    whole.set_op_handle("backward:prim::PythonOp.Square", lambda inputs, outputs: 7)
    assert whole.by_phase("inner") == {"forward": 128, "backward": 64 * 2 + 7}


def test_dispatched_names_still_work_where_no_call_counts_them() -> None:
    """A handle for a dispatched operator applies inside a user-level call that has no handle of its own."""
    layer_norm = FlopCountAnalysis(nn.LayerNorm(8), torch.randn(2, 8), convention="flops")
    assert layer_norm.set_op_handle("aten::native_layer_norm", calls).by_operator() == Counter(native_layer_norm=1)


def test_activation_unsupported_names_are_fvcores() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.MaxPool2d(2), nn.Upsample(scale_factor=2),
                          nn.LayerNorm(6), nn.AdaptiveAvgPool2d(1)).eval()
    x = torch.randn(1, 3, 8, 8)
    theirs = fvcore_nn.ActivationCountAnalysis(model, x).unsupported_ops_warnings(False)
    theirs.total()
    mine = ActivationCountAnalysis(model, x).unsupported_ops_warnings(False)
    assert mine.total() == theirs.total()
    assert mine.unsupported_ops() == theirs.unsupported_ops() == Counter(
        {"aten::batch_norm": 1, "aten::max_pool2d": 1, "aten::upsample_nearest2d": 1, "aten::layer_norm": 1,
         "aten::adaptive_avg_pool2d": 1})
