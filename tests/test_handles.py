"""Every formula of the fvcore convention against an independent oracle.

Three oracles, none of which calls the formula under test:

* hand arithmetic on small shapes, written out as explicit products;
* ``torch.utils.flop_counter.FlopCounterMode``, which counts the products torch actually runs with
  2 flops per multiply-add (so ours x 2 equals its total wherever both count);
* fvcore itself (jit tracing), wherever fvcore counts correctly, plus the numbers of the reference
  document's "Empirical op coverage" table.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import modelmeter
from model_helpers import Fn, FusedEncoderLayer, FusedSelfAttention, conv_modules
from modelmeter import ActivationCountAnalysis, Args, FlopCountAnalysis, get_shape

PROPERTY = settings(max_examples=30, deadline=None)


# --- helpers --------------------------------------------------------------------------------------
def randn(*shapes: tuple[int, ...]) -> Any:
    """One tensor for one shape, a tuple of tensors for several."""
    tensors = tuple(torch.randn(*s) for s in shapes)
    return tensors[0] if len(tensors) == 1 else tensors


def flops(model: nn.Module, inputs: Any) -> FlopCountAnalysis:
    return FlopCountAnalysis(model, inputs).unsupported_ops_warnings(False).uncalled_modules_warnings(False)


def acts(model: nn.Module, inputs: Any) -> ActivationCountAnalysis:
    return ActivationCountAnalysis(model, inputs).unsupported_ops_warnings(False).uncalled_modules_warnings(False)


def torch_macs(model: nn.Module, inputs: Any) -> int:
    """Multiply-adds by torch's FlopCounterMode (its flops / 2), attention on the math kernel."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(*args)
    total = counter.get_total_flops()
    assert total % 2 == 0
    return total // 2


@pytest.fixture(scope="module")
def fvcore_nn() -> Any:
    return pytest.importorskip("fvcore.nn")


def fvcore_analysis(cls: Any, model: nn.Module, inputs: Any) -> Any:
    """An fvcore analysis with its trace done and every warning silenced."""
    analysis = cls(model, inputs).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analysis.total()
    return analysis


def dispatched_ops(fn: Callable[[], Any]) -> set[str]:
    """The aten operators plain torch runs for ``fn()`` (no modelmeter involved)."""

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops.add(func.name().split(".")[0])
            return func(*args, **(kwargs or {}))

    with Record() as record:
        fn()
    return record.ops


# --- convolution --------------------------------------------------------------------------------
# fvcore's convention: N * prod(weight.shape) * prod(out spatial); transposed: prod(*input* spatial).
CONV_CASES = [
    pytest.param(lambda: nn.Conv1d(3, 4, 3), (2, 3, 9), 2 * (4 * 3 * 3) * 7, id="conv1d"),
    pytest.param(lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, 8, 8), 2 * (4 * 3 * 3 * 3) * (8 * 8), id="conv2d"),
    pytest.param(lambda: nn.Conv2d(3, 6, 3, groups=3), (2, 3, 8, 8), 2 * (6 * 1 * 3 * 3) * (6 * 6), id="groups"),
    pytest.param(lambda: nn.Conv2d(4, 4, 3, groups=4, padding=1), (1, 4, 5, 5), 1 * (4 * 1 * 3 * 3) * (5 * 5),
                 id="depthwise"),
    # out = floor((8 + 2*2 - 2*(3-1) - 1) / 2) + 1 = 4
    pytest.param(lambda: nn.Conv2d(3, 6, 3, stride=2, padding=2, dilation=2, groups=3), (2, 3, 8, 8),
                 2 * (6 * 1 * 3 * 3) * (4 * 4), id="dilation-stride-padding-groups"),
    # H: (7 - 3) // 2 + 1 = 3; W: (6 + 2 - 2) + 1 = 7
    pytest.param(lambda: nn.Conv2d(2, 5, (3, 2), stride=(2, 1), padding=(0, 1)), (1, 2, 7, 6),
                 1 * (5 * 2 * 3 * 2) * (3 * 7), id="anisotropic"),
    pytest.param(lambda: nn.Conv2d(2, 3, 3, padding="same", dilation=2), (1, 2, 6, 6), 1 * (3 * 2 * 3 * 3) * (6 * 6),
                 id="padding-same"),
    # out: D 4, H (5 - 2) // 2 + 1 = 2, W 6 - 3 + 1 = 4
    pytest.param(lambda: nn.Conv3d(2, 4, (1, 2, 3), stride=(1, 2, 1)), (2, 2, 4, 5, 6),
                 2 * (4 * 2 * 1 * 2 * 3) * (4 * 2 * 4), id="conv3d"),
    # transposed: weight (Cin, Cout/groups, k...), input spatial
    pytest.param(lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), (2, 3, 9), 2 * (3 * 4 * 3) * 9, id="transposed1d"),
    pytest.param(lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), (2, 3, 8, 8), 2 * (3 * 4 * 3 * 3) * (8 * 8),
                 id="transposed2d"),
    pytest.param(lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1), (2, 4, 5, 5),
                 2 * (4 * 3 * 3 * 3) * (5 * 5), id="transposed2d-groups"),
    pytest.param(lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (1, 2, 3, 3, 3), 1 * (2 * 3 * 2 * 2 * 2) * (3 * 3 * 3),
                 id="transposed3d"),
    # unbatched input counts as a batch of one
    pytest.param(lambda: nn.Conv2d(3, 4, 3), (3, 8, 8), 1 * (4 * 3 * 3 * 3) * (6 * 6), id="unbatched"),
    pytest.param(lambda: nn.Conv1d(3, 4, 3, bias=False), (3, 9), 1 * (4 * 3 * 3) * 7, id="unbatched1d"),
    pytest.param(lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), (3, 8, 8), 1 * (3 * 4 * 3 * 3) * (8 * 8),
                 id="unbatched-transposed"),
]


@pytest.mark.parametrize(("make", "shape", "expected"), CONV_CASES)
def test_conv_by_hand(make: Callable[[], nn.Module], shape: tuple[int, ...], expected: int) -> None:
    model = make()
    analysis = flops(model, torch.randn(shape))
    assert analysis.total() == expected
    assert analysis.by_operator() == Counter({"conv": expected})
    assert analysis.unsupported_ops() == Counter()
    # activations: the elements of the convolution's output
    assert acts(model, torch.randn(shape)).by_operator() == Counter({"conv": model(torch.randn(shape)).numel()})


def test_conv_activation_by_hand() -> None:
    assert acts(nn.Conv2d(3, 4, 3, padding=1), torch.randn(2, 3, 8, 8)).total() == 2 * 4 * 8 * 8
    # (8 - 1) * 2 + 3 = 17
    assert acts(nn.ConvTranspose2d(3, 4, 3, stride=2), torch.randn(2, 3, 8, 8)).total() == 2 * 4 * 17 * 17


def test_functional_conv() -> None:
    model = Fn(lambda x, w: F.conv2d(x, w, stride=2, groups=2))
    # x (1, 4, 7, 7), w (6, 2, 3, 3): out (1, 6, 3, 3)
    assert flops(model, randn((1, 4, 7, 7), (6, 2, 3, 3))).by_operator() == Counter({"conv": 1 * (6 * 2 * 3 * 3) * 9})


@PROPERTY
@given(conv_modules())
def test_conv_matches_flop_counter_mode(case: tuple[nn.Module, tuple[int, ...]]) -> None:
    module, shape = case
    x = torch.randn(shape)
    assert flops(module, x).total() == torch_macs(module, x)
    assert acts(module, x).total() == module(x).numel()


# --- linear and matrix products -----------------------------------------------------------------
@pytest.mark.parametrize(("shape", "bias", "expected"), [
    pytest.param((10,), True, 10 * 20, id="1d"),
    pytest.param((4, 10), True, 4 * 10 * 20, id="2d"),
    pytest.param((4, 5, 10), True, 4 * 5 * 10 * 20, id="3d"),
    pytest.param((4, 5, 10), False, 4 * 5 * 10 * 20, id="3d-no-bias"),
    pytest.param((2, 1, 3, 10), False, 2 * 1 * 3 * 10 * 20, id="4d-no-bias"),
])
def test_linear_by_hand(shape: tuple[int, ...], bias: bool, expected: int) -> None:
    model = nn.Linear(10, 20, bias=bias)
    analysis = flops(model, torch.randn(shape))
    assert analysis.by_operator() == Counter({"linear": expected})
    assert analysis.unsupported_ops() == Counter()
    assert acts(model, torch.randn(shape)).by_operator() == Counter({"linear": expected // 10})


def test_functional_linear() -> None:
    model = Fn(F.linear)
    assert flops(model, randn((3, 7), (5, 7))).by_operator() == Counter({"linear": 3 * 7 * 5})
    assert flops(model, randn((3, 7), (5, 7), (5,))).by_operator() == Counter({"linear": 3 * 7 * 5})


@st.composite
def linear_cases(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...]]:
    lead = draw(st.lists(st.integers(1, 3), max_size=3))
    cin, cout = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    return nn.Linear(cin, cout, bias=draw(st.booleans())), (*lead, cin)


@PROPERTY
@given(linear_cases())
def test_linear_matches_flop_counter_mode(case: tuple[nn.Module, tuple[int, ...]]) -> None:
    module, shape = case
    x = torch.randn(shape)
    assert flops(module, x).total() == torch_macs(module, x)
    assert acts(module, x).total() == module(x).numel()


MATMUL_CASES = [
    pytest.param((4,), (4,), 4, id="1d@1d"),
    pytest.param((4,), (4, 5), 4 * 5, id="1d@2d"),
    pytest.param((3, 4), (4,), 3 * 4, id="2d@1d"),
    pytest.param((4,), (2, 4, 5), 2 * 4 * 5, id="1d@3d"),
    pytest.param((2, 3, 4), (4,), 2 * 3 * 4, id="3d@1d"),
    pytest.param((3, 4), (4, 5), 3 * 4 * 5, id="2d@2d"),
    pytest.param((2, 3, 4), (4, 5), 2 * 3 * 4 * 5, id="batched@2d"),
    pytest.param((2, 3, 4, 5), (2, 3, 5, 6), 2 * 3 * 4 * 5 * 6, id="batched@batched"),
    # broadcasting on the right side: 2 products of (4, 5) @ (5, 6). fvcore counts 120.
    pytest.param((4, 5), (2, 5, 6), 2 * 4 * 5 * 6, id="2d@batched"),
    # both sides broadcast to a (2, 5) batch
    pytest.param((2, 1, 3, 4), (5, 4, 6), 2 * 5 * 3 * 4 * 6, id="broadcast-both"),
]


@pytest.mark.parametrize(("a", "b", "expected"), MATMUL_CASES)
def test_matmul_by_hand(a: tuple[int, ...], b: tuple[int, ...], expected: int) -> None:
    x, w = torch.randn(a), torch.randn(b)
    out = torch.matmul(x, w).numel()
    for fn in (torch.matmul, lambda p, q: p @ q, torch.Tensor.matmul):
        analysis = flops(Fn(fn), (x, w))
        assert analysis.by_operator() == Counter({"matmul": expected})
        assert analysis.unsupported_ops() == Counter()
        assert acts(Fn(fn), (x, w)).by_operator() == Counter({"matmul": out})


@st.composite
def matmul_operands(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    batch = draw(st.lists(st.integers(1, 3), max_size=2))

    def batch_dims() -> list[int]:
        dims = batch[len(batch) - draw(st.integers(0, len(batch))):]
        return [1 if draw(st.booleans()) else d for d in dims]

    a = (k,) if draw(st.booleans()) else (*batch_dims(), m, k)
    b = (k,) if draw(st.booleans()) else (*batch_dims(), k, n)
    return a, b


@PROPERTY
@given(matmul_operands())
def test_matmul_matches_flop_counter_mode(shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    a, b = torch.randn(shapes[0]), torch.randn(shapes[1])
    # torch defines a 1-D operand as a matrix with a dimension of 1 added (then removed): count that
    # product, which torch runs as mm/bmm (FlopCounterMode does not count dot and mv).
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    model = Fn(torch.matmul)
    assert flops(model, (a, b)).total() == torch_macs(model, (a2, b2))
    assert acts(model, (a, b)).total() == torch.matmul(a, b).numel()


@pytest.mark.parametrize(("fn", "shapes", "key", "expected"), [
    pytest.param(torch.mm, [(3, 4), (4, 5)], "mm", 3 * 4 * 5, id="mm"),
    pytest.param(torch.bmm, [(2, 3, 4), (2, 4, 5)], "bmm", 2 * 3 * 4 * 5, id="bmm"),
    pytest.param(torch.addmm, [(4, 20), (4, 10), (10, 20)], "addmm", 4 * 10 * 20, id="addmm"),
    pytest.param(torch.addmm, [(20,), (4, 10), (10, 20)], "addmm", 4 * 10 * 20, id="addmm-broadcast-bias"),
    pytest.param(torch.baddbmm, [(2, 3, 5), (2, 3, 4), (2, 4, 5)], "baddbmm", 2 * 3 * 4 * 5, id="baddbmm"),
])
def test_matrix_products_by_hand(fn: Callable[..., torch.Tensor], shapes: list[tuple[int, ...]], key: str,
                                 expected: int) -> None:
    inputs = randn(*shapes)
    assert flops(Fn(fn), inputs).by_operator() == Counter({key: expected})
    assert flops(Fn(fn), inputs).unsupported_ops() == Counter()
    assert acts(Fn(fn), inputs).by_operator() == Counter({key: fn(*inputs).numel()})
    assert flops(Fn(fn), inputs).total() == torch_macs(Fn(fn), inputs)


@PROPERTY
@given(st.integers(1, 3), st.integers(1, 5), st.integers(1, 5), st.integers(1, 5), st.sampled_from(range(4)))
def test_matrix_products_match_flop_counter_mode(b: int, m: int, k: int, n: int, which: int) -> None:
    fn, shapes = [
        (torch.mm, [(m, k), (k, n)]),
        (torch.bmm, [(b, m, k), (b, k, n)]),
        (lambda c, x, y: torch.addmm(c, x, y, beta=0.5, alpha=2), [(n,), (m, k), (k, n)]),
        (torch.baddbmm, [(b, m, n), (b, m, k), (b, k, n)]),
    ][which]
    inputs = randn(*shapes)
    assert flops(Fn(fn), inputs).total() == torch_macs(Fn(fn), inputs)


def grouped_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """``torch._grouped_mm`` written as one ``mm`` per group (float32)."""
    a, b = a.float(), b.float()
    ends = [] if offs is None else offs.tolist()
    starts = [0, *ends[:-1]]
    if a.dim() == 3 and b.dim() == 3:
        return torch.stack([x @ w for x, w in zip(a, b, strict=True)])
    if a.dim() == 2 and b.dim() == 3:  # rows of a split into groups
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends, strict=True))])
    if a.dim() == 2:  # both 2-D: the contracted dimension split into groups
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends, strict=True)])
    return torch.cat([a[g] @ b[:, s:e] for g, (s, e) in enumerate(zip(starts, ends, strict=True))], dim=1)


@pytest.mark.parametrize(("a", "b", "offs", "expected"), [
    # 24 rows of (24, 16) each meet one group's (16, 8)
    pytest.param((24, 16), (3, 8, 16), [8, 16, 24], 24 * 16 * 8, id="2d-3d"),
    pytest.param((3, 8, 16), (3, 8, 16), None, 3 * 8 * 16 * 8, id="3d-3d"),
    # (8, 48) @ (48, 8) with the 48 split into 3 groups of 16: 3 products (8, 16) @ (16, 8)
    pytest.param((8, 48), (8, 48), [16, 32, 48], 3 * 8 * 16 * 8, id="2d-2d"),
    # group g: (8, 16) @ (16, 8 columns of 24)
    pytest.param((3, 8, 16), (24, 16), [8, 16, 24], 3 * 8 * 16 * 8, id="3d-2d"),
    pytest.param((24, 16), (3, 8, 16), [8, 8, 24], 24 * 16 * 8, id="empty-group"),
])
def test_grouped_mm_by_hand(a: tuple[int, ...], b: tuple[int, ...], offs: list[int] | None, expected: int) -> None:
    # bf16 with 16-byte aligned strides, the second operand column-major, as the kernel requires
    x = torch.randn(a, dtype=torch.bfloat16)
    w = torch.randn(b, dtype=torch.bfloat16).mT
    o = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    model = Fn(lambda x, w, o: torch._grouped_mm(x, w, offs=o))
    reference = Fn(grouped_reference)
    out = model(x, w, o)
    torch.testing.assert_close(out.float(), reference(x, w, o), atol=0.1, rtol=0.02)
    analysis = flops(model, (x, w, o))
    assert analysis.by_operator() == Counter({"_grouped_mm": expected})
    assert analysis.total() == torch_macs(reference, (x, w, o))
    assert acts(model, (x, w, o)).by_operator() == Counter({"_grouped_mm": out.numel()})


# --- einsum: the batched products torch runs ------------------------------------------------------
EINSUM_CASES = [
    pytest.param("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)], 2 * 3 * 4 * 5, id="bmm"),
    pytest.param("nc,nchw->hw", [(3, 4), (3, 4, 2, 3)], 3 * 4 * 2 * 3, id="nc,nchw"),
    pytest.param("bhld,bhsd->bhls", [(2, 3, 4, 5), (2, 3, 6, 5)], 2 * 3 * 4 * 5 * 6, id="attention-scores"),
    pytest.param("ij,ij->", [(2, 3), (2, 3)], 2 * 3, id="full-contraction"),
    # three operands, contracted left to right: (2,3)@(3,4), then (2,4)@(4,5)
    pytest.param("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)], 2 * 3 * 4 + 2 * 4 * 5, id="three-operands"),
    # k appears only in the second operand: torch sums it out first, the product is i*j
    pytest.param("ij,jk->i", [(2, 3), (3, 4)], 2 * 3, id="summed-out-index"),
    # no summed index: torch multiplies element-wise, which costs 0 in this convention
    pytest.param("ij,ij->ij", [(2, 3), (2, 3)], 0, id="hadamard"),
    pytest.param("i,j->ij", [(2,), (3,)], 0, id="outer"),
]


@pytest.mark.parametrize(("equation", "shapes", "expected"), EINSUM_CASES)
def test_einsum_by_hand(equation: str, shapes: list[tuple[int, ...]], expected: int) -> None:
    model = Fn(lambda *ops: torch.einsum(equation, *ops))
    inputs = randn(*shapes)
    analysis = flops(model, inputs)
    assert analysis.total() == expected
    assert analysis.by_operator() == Counter({"einsum": expected})
    assert expected == torch_macs(model, inputs)
    assert acts(model, inputs).by_operator() == Counter({"einsum": model(*inputs).numel()})


@pytest.mark.parametrize(("equation", "shapes"), [("ij,jk->i", [(2, 3), (3, 4)]), ("bij->bj", [(2, 3, 4)])])
def test_einsum_with_reduction_is_not_unsupported(equation: str, shapes: list[tuple[int, ...]]) -> None:
    model = Fn(lambda *ops: torch.einsum(equation, *ops))
    assert flops(model, randn(*shapes)).unsupported_ops() == Counter()


# --- normalisation -------------------------------------------------------------------------------
NUMEL = 2 * 3 * 8 * 8  # of the (2, 3, 8, 8) input below


@pytest.mark.parametrize(("make", "key", "per_element"), [
    pytest.param(lambda: nn.BatchNorm2d(3).eval(), "batch_norm", 2, id="bn-eval"),
    pytest.param(lambda: nn.BatchNorm2d(3, affine=False).eval(), "batch_norm", 1, id="bn-eval-no-affine"),
    pytest.param(lambda: nn.BatchNorm2d(3).train(), "batch_norm", 5, id="bn-train"),
    pytest.param(lambda: nn.BatchNorm2d(3, affine=False).train(), "batch_norm", 4, id="bn-train-no-affine"),
    pytest.param(lambda: nn.BatchNorm2d(3, track_running_stats=False).eval(), "batch_norm", 5,
                 id="bn-batch-stats-in-eval"),
    pytest.param(lambda: nn.GroupNorm(1, 3), "group_norm", 5, id="gn"),
    pytest.param(lambda: nn.GroupNorm(3, 3, affine=False), "group_norm", 4, id="gn-no-affine"),
    pytest.param(lambda: nn.LayerNorm(8), "layer_norm", 5, id="ln"),
    pytest.param(lambda: nn.LayerNorm([8, 8], elementwise_affine=False), "layer_norm", 4, id="ln-no-affine"),
    pytest.param(lambda: nn.InstanceNorm2d(3, affine=True), "instance_norm", 5, id="in"),
    pytest.param(lambda: nn.InstanceNorm2d(3), "instance_norm", 4, id="in-no-affine"),
])
def test_norms_by_hand(make: Callable[[], nn.Module], key: str, per_element: int) -> None:
    analysis = flops(make(), torch.randn(2, 3, 8, 8))
    assert analysis.by_operator() == Counter({key: per_element * NUMEL})
    assert analysis.unsupported_ops() == Counter()
    assert acts(make(), torch.randn(2, 3, 8, 8)).total() == 0


def test_norms_other_ranks() -> None:
    assert flops(nn.BatchNorm1d(3).eval(), torch.randn(4, 3)).total() == 2 * (4 * 3)
    assert flops(nn.BatchNorm3d(2).train(), torch.randn(2, 2, 3, 3, 3)).total() == 5 * (2 * 2 * 3 * 3 * 3)
    assert flops(nn.InstanceNorm1d(3), torch.randn(2, 3, 5)).total() == 4 * (2 * 3 * 5)
    assert flops(nn.LayerNorm(6), torch.randn(6)).total() == 5 * 6
    functional = Fn(lambda x: F.batch_norm(x, None, None, training=True))
    assert flops(functional, torch.randn(4, 3)).by_operator() == Counter({"batch_norm": 4 * (4 * 3)})


# --- resampling and pooling ----------------------------------------------------------------------
@pytest.mark.parametrize(("fn", "shape", "key", "expected"), [
    pytest.param(lambda x: F.interpolate(x, scale_factor=2), (2, 3, 8, 8), "upsample_nearest2d",
                 1 * (2 * 3 * 16 * 16), id="nearest2d"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=2), (2, 3, 8), "upsample_nearest1d", 1 * (2 * 3 * 16),
                 id="nearest1d"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=2), (1, 2, 2, 3, 4), "upsample_nearest3d",
                 1 * (1 * 2 * 4 * 6 * 8), id="nearest3d"),
    pytest.param(lambda x: F.interpolate(x, size=(5, 7), mode="nearest-exact"), (2, 3, 4, 4),
                 "_upsample_nearest_exact2d", 1 * (2 * 3 * 5 * 7), id="nearest-exact2d"),
    pytest.param(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (2, 3, 8, 8), "upsample_bilinear2d",
                 4 * (2 * 3 * 16 * 16), id="bilinear"),
    pytest.param(lambda x: F.interpolate(x, size=(5, 7), mode="bilinear", align_corners=True), (2, 3, 8, 8),
                 "upsample_bilinear2d", 4 * (2 * 3 * 5 * 7), id="bilinear-align-corners"),
    pytest.param(nn.AdaptiveAvgPool1d(2), (2, 3, 8), "adaptive_avg_pool1d", 1 * (2 * 3 * 8), id="aap1d"),
    pytest.param(nn.AdaptiveAvgPool2d(1), (2, 3, 8, 8), "adaptive_avg_pool2d", 1 * (2 * 3 * 8 * 8), id="aap2d"),
    pytest.param(nn.AdaptiveAvgPool2d((2, 3)), (2, 3, 8, 8), "adaptive_avg_pool2d", 1 * (2 * 3 * 8 * 8),
                 id="aap2d-2x3"),
    pytest.param(nn.AdaptiveAvgPool3d(1), (1, 2, 4, 4, 4), "adaptive_avg_pool3d", 1 * (1 * 2 * 4 * 4 * 4),
                 id="aap3d"),
])
def test_resampling_by_hand(fn: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...], key: str,
                            expected: int) -> None:
    model = fn if isinstance(fn, nn.Module) else Fn(fn)
    analysis = flops(model, torch.randn(shape))
    assert analysis.by_operator() == Counter({key: expected})
    assert analysis.unsupported_ops() == Counter()


def test_grid_sample_by_hand() -> None:
    model = Fn(lambda x, grid: F.grid_sample(x, grid, align_corners=False))
    # input (2, 3, 8, 8), grid (2, 4, 5, 2): output (2, 3, 4, 5), 4 per output element
    analysis = flops(model, (torch.randn(2, 3, 8, 8), torch.rand(2, 4, 5, 2) * 2 - 1))
    assert analysis.by_operator() == Counter({"grid_sampler": 4 * (2 * 3 * 4 * 5)})


# --- attention -----------------------------------------------------------------------------------
def sdpa(**kwargs: Any) -> Fn:
    return Fn(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs))


@pytest.mark.parametrize(("shapes", "kwargs", "expected_flops", "expected_acts"), [
    # B=2, H=4, L=6, S=7, E=8, Ev=5: B*H*L*S*(E+Ev); activations B*H*L*(S+Ev)
    pytest.param([(2, 4, 6, 8), (2, 4, 7, 8), (2, 4, 7, 5)], {}, 2 * 4 * 6 * 7 * (8 + 5), 2 * 4 * 6 * (7 + 5),
                 id="mha"),
    # causal: query i sees keys 0..i, 1 + 2 + ... + 6 = 21 pairs per head (activations stay dense)
    pytest.param([(2, 4, 6, 8), (2, 4, 7, 8), (2, 4, 7, 5)], {"is_causal": True}, 2 * 4 * 21 * (8 + 5),
                 2 * 4 * 6 * (7 + 5), id="causal"),
    # grouped-query: 2 key/value heads shared by 4 query heads; counted with the query's 4 heads
    pytest.param([(2, 4, 6, 8), (2, 2, 7, 8), (2, 2, 7, 5)], {"enable_gqa": True}, 2 * 4 * 6 * 7 * (8 + 5),
                 2 * 4 * 6 * (7 + 5), id="gqa"),
    pytest.param([(3, 6, 8), (3, 7, 8), (3, 7, 8)], {}, 3 * 6 * 7 * (8 + 8), 3 * 6 * (7 + 8), id="3d"),
])
def test_sdpa_by_hand(shapes: list[tuple[int, ...]], kwargs: dict[str, Any], expected_flops: int,
                      expected_acts: int) -> None:
    model, inputs = sdpa(**kwargs), randn(*shapes)
    assert flops(model, inputs).by_operator() == Counter({"scaled_dot_product_attention": expected_flops})
    assert flops(model, inputs).unsupported_ops() == Counter()
    assert acts(model, inputs).by_operator() == Counter({"scaled_dot_product_attention": expected_acts})
    if not kwargs.get("is_causal"):  # FlopCounterMode counts causal attention dense
        assert torch_macs(model, inputs) == expected_flops


@PROPERTY
@given(st.integers(1, 2), st.integers(1, 2), st.integers(1, 3), st.integers(1, 5), st.integers(1, 5),
       st.integers(1, 6), st.integers(1, 6))
def test_sdpa_matches_flop_counter_mode(b: int, kv_heads: int, group: int, lq: int, s: int, e: int, ev: int) -> None:
    h = kv_heads * group
    q, k, v = torch.randn(b, h, lq, e), torch.randn(b, kv_heads, s, e), torch.randn(b, kv_heads, s, ev)
    model = sdpa(enable_gqa=group > 1)
    assert flops(model, (q, k, v)).total() == torch_macs(model, (q, k, v))
    # activations: what the unfused products output, the scores (L x S) and the result (L x Ev) per head
    scores = q @ k.repeat_interleave(group, dim=1).mT
    assert acts(model, (q, k, v)).total() == scores.numel() + model(q, k, v).numel()


class SelfAttention(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention, need_weights: bool = True) -> None:
        super().__init__()
        self.mha = mha
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x, need_weights=self.need_weights)[0]


MHA_LINEAR = 2 * 16 * 32 * 96 + 2 * 16 * 32 * 32
MHA_PRODUCTS = 2 * (2 * 4 * 16 * 16 * 8)


def test_multihead_attention_slow_path_by_hand() -> None:
    model = SelfAttention(nn.MultiheadAttention(32, 4, batch_first=True))
    analysis = flops(model, torch.randn(2, 16, 32))
    assert analysis.by_operator() == Counter({"linear": MHA_LINEAR, "bmm": MHA_PRODUCTS})
    assert analysis.total() == 163840  # reference doc, 3.3
    # activations: q/k/v projections (96) and output (32) per token; scores 16 x 16 and results 16 x 8 per head
    activations = acts(model, torch.randn(2, 16, 32)).by_operator()
    assert activations == Counter({"linear": 2 * 16 * 96 + 2 * 16 * 32, "bmm": 2 * 4 * 16 * 16 + 2 * 4 * 16 * 8})
    assert analysis.total() == torch_macs(model, torch.randn(2, 16, 32))


def test_fast_paths_are_taken_by_plain_torch() -> None:
    """The premise of the fast-path tests below: eval + no_grad runs the fused operators."""
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    x = torch.randn(2, 16, 32)
    with torch.no_grad():
        assert "aten::_native_multi_head_attention" in dispatched_ops(lambda: mha(x, x, x))
        assert "aten::_transformer_encoder_layer_fwd" in dispatched_ops(lambda: layer(x))


def test_multihead_attention_fast_path_equals_slow_path() -> None:
    model = SelfAttention(nn.MultiheadAttention(32, 4, batch_first=True)).eval()
    x = torch.randn(2, 16, 32)
    slow_flops, slow_acts = flops(model, x).total(), acts(model, x).total()
    with torch.no_grad():
        fast_flops, fast_acts = flops(model, x).total(), acts(model, x).total()
    assert fast_flops == slow_flops == MHA_LINEAR + MHA_PRODUCTS
    assert fast_acts == slow_acts


@pytest.mark.parametrize("need_weights", [True, False])
def test_fused_multihead_attention_operator(need_weights: bool) -> None:
    """``aten::_native_multi_head_attention`` called directly counts what the unfused path runs."""
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 16, 32)
    fused = flops(FusedSelfAttention(mha), x)
    slow = SelfAttention(mha, need_weights)
    assert fused.total() == flops(slow, x).total() == torch_macs(slow, x) == MHA_LINEAR + MHA_PRODUCTS
    assert fused.by_operator() == Counter({"linear": MHA_LINEAR, "scaled_dot_product_attention": MHA_PRODUCTS})
    assert acts(FusedSelfAttention(mha), x).total() == acts(slow, x).total()
    with torch.no_grad():
        assert flops(FusedSelfAttention(mha), x).total() == fused.total()


def test_transformer_encoder_layer_fast_path_equals_slow_path() -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    x = torch.randn(2, 16, 32)
    slow = flops(layer, x)
    slow_acts = acts(layer, x).total()
    with torch.no_grad():
        fast_flops, fast_acts = flops(layer, x).total(), acts(layer, x).total()
    tokens = 2 * 16
    expected = Counter({
        "linear": tokens * (32 * 96 + 32 * 32) + tokens * (32 * 64 + 64 * 32),  # attention + MLP
        "scaled_dot_product_attention": 2 * (2 * 4 * 16 * 16 * 8),
        "layer_norm": 2 * 5 * (tokens * 32),
    })
    assert slow.by_operator() == expected
    assert fast_flops == slow.total() == sum(expected.values())
    assert fast_acts == slow_acts


@pytest.mark.parametrize(("activation", "norm_first"), [("relu", False), ("gelu", True)])
def test_fused_encoder_layer_operator(activation: str, norm_first: bool) -> None:
    """``aten::_transformer_encoder_layer_fwd`` called directly counts what the unfused layer runs."""
    layer = nn.TransformerEncoderLayer(32, 4, 48, activation=activation, norm_first=norm_first,
                                       batch_first=True).eval()
    src = torch.randn(3, 5, 32)
    fused, slow = flops(FusedEncoderLayer(layer), src), flops(layer, src)
    assert fused.by_operator() == slow.by_operator()
    assert fused.total() - slow.by_operator()["layer_norm"] == torch_macs(layer, src)
    assert acts(FusedEncoderLayer(layer), src).by_operator() == acts(layer, src).by_operator()


# --- free, element-wise and unsupported operators -------------------------------------------------
@pytest.mark.parametrize("fn", [
    pytest.param(lambda x: (x + 1) * 2 - x / 3, id="arithmetic"),
    pytest.param(lambda x: F.gelu(x) + torch.sigmoid(x) + torch.tanh(x).exp(), id="gelu-sigmoid-tanh-exp"),
    pytest.param(lambda x: F.silu(x) * x.pow(2) + x.sqrt().clamp(0, 1), id="silu-pow-clamp"),
    pytest.param(lambda x: x.add_(1).mul_(2), id="in-place"),
    # element-wise, though torch does not tag them pointwise
    pytest.param(lambda x: F.hardswish(x) + F.logsigmoid(x) + F.prelu(x, torch.ones(1)) + F.glu(x, -1).repeat(1, 1, 2),
                 id="untagged"),
])
def test_elementwise_costs_nothing_and_is_not_unsupported(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    analysis = flops(Fn(fn), torch.rand(2, 3, 4))
    assert analysis.total() == 0
    assert analysis.unsupported_ops() == Counter()
    assert acts(Fn(fn), torch.rand(2, 3, 4)).unsupported_ops() == Counter()


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.fc(x)) * torch.sigmoid(x)


def test_residual_add_is_free() -> None:
    analysis = flops(Residual(), torch.randn(4, 8))
    assert analysis.by_operator() == Counter({"linear": 4 * 8 * 8})
    assert analysis.unsupported_ops() == Counter()


@pytest.mark.parametrize("fn", [
    pytest.param(lambda x: F.relu(x) + F.relu(x, inplace=True), id="relu"),
    pytest.param(lambda x: F.dropout(x, 0.5, training=True) + F.dropout(x, 0.5, training=False), id="dropout"),
    pytest.param(lambda x: x.reshape(2, -1).permute(1, 0).contiguous().view(-1), id="reshape-permute-view"),
    pytest.param(lambda x: torch.cat([x, x.transpose(1, 2)], 1).flatten(1).chunk(2)[0].unsqueeze(0).squeeze(0),
                 id="cat-transpose-chunk"),
])
def test_free_operators_are_silent(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    analysis = flops(Fn(fn), torch.randn(2, 4, 4))
    assert analysis.total() == 0
    assert analysis.unsupported_ops() == Counter()


def test_unhandled_operators_are_reported_under_the_user_level_name() -> None:
    # torch.fft.rfft dispatches aten::_fft_r2c, torch.linalg.det aten::_linalg_det: no handle for either
    model = Fn(lambda x: torch.fft.rfft(torch.fft.rfft(x).abs()).abs().sum() + torch.linalg.det(x[0, 0]))
    analysis = flops(model, torch.randn(2, 3, 8, 8))
    assert analysis.total() == 0
    assert analysis.unsupported_ops() == Counter({"aten::fft_rfft": 2, "aten::linalg_det": 1})
    transformed = nn.Sequential(nn.Conv2d(3, 3, 1), Fn(torch.fft.rfft))
    analysis = flops(transformed, torch.randn(1, 3, 4, 4))
    assert analysis.by_operator() == Counter({"conv": 1 * (3 * 3) * (4 * 4)})
    assert analysis.unsupported_ops() == Counter({"aten::fft_rfft": 1})
    assert analysis.unsupported_ops("1") == Counter({"aten::fft_rfft": 1})
    assert analysis.unsupported_ops("0") == Counter()


# --- custom handles -------------------------------------------------------------------------------
def pool_flop(inputs: list[Any], outputs: list[Any]) -> int:
    """An fvcore-style handle: one comparison per input element."""
    shape = get_shape(inputs[0])
    assert shape is not None
    return int(np.prod(shape))


def test_custom_handle_is_used() -> None:
    model = Fn(lambda x: F.max_pool2d(x, 2))
    analysis = flops(model, torch.randn(2, 3, 8, 8)).set_op_handle("aten::max_pool2d", pool_flop)
    assert analysis.by_operator() == Counter({"max_pool2d": 2 * 3 * 8 * 8})
    assert analysis.unsupported_ops() == Counter()


def test_custom_handle_counter_keys() -> None:
    def handle(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
        out = get_shape(outputs[0])
        assert out is not None
        return Counter({"pool_in": pool_flop(inputs, outputs), "pool_out": int(np.prod(out))})

    analysis = flops(Fn(lambda x: F.max_pool2d(x, 2)), torch.randn(2, 3, 8, 8))
    analysis.set_op_handle("aten::max_pool2d", handle)
    assert analysis.by_operator() == Counter({"pool_in": 2 * 3 * 8 * 8, "pool_out": 2 * 3 * 4 * 4})


def test_custom_handle_overrides_a_default() -> None:
    analysis = flops(nn.Linear(10, 20), torch.randn(4, 10))
    analysis.set_op_handle(**{"aten::linear": lambda inputs, outputs: 2 * 4 * 10 * 20})
    assert analysis.by_operator() == Counter({"linear": 2 * 4 * 10 * 20})


def test_none_handle_silences_an_operator() -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3).eval(), Fn(torch.fft.rfft))
    analysis = flops(model, torch.randn(1, 3, 4, 4))
    assert analysis.unsupported_ops() == Counter({"aten::fft_rfft": 1})
    analysis.set_op_handle("aten::fft_rfft", None, "aten::batch_norm", None)
    assert analysis.unsupported_ops() == Counter()
    assert analysis.by_operator() == Counter({"conv": 1 * (3 * 3) * (4 * 4)})


@pytest.mark.parametrize("bad", [np.int32(3), np.float32(1.5), "3", Counter({"pool": np.int32(3)})],
                         ids=["int32", "float32", "str", "counter-of-int32"])
def test_handle_returning_a_non_number_names_the_operator(bad: Any) -> None:
    analysis = flops(Fn(lambda x: F.max_pool2d(x, 2)), torch.randn(1, 1, 4, 4))
    analysis.set_op_handle("aten::max_pool2d", lambda inputs, outputs: bad)
    with pytest.raises(ValueError, match="aten::max_pool2d"):
        analysis.total()


# --- fvcore as an oracle -------------------------------------------------------------------------
FVCORE_AGREES = [
    pytest.param(lambda: nn.Conv1d(3, 4, 3), [(2, 3, 9)], id="conv1d"),
    pytest.param(lambda: nn.Conv2d(3, 6, 3, stride=2, padding=2, dilation=2, groups=3), [(2, 3, 8, 8)],
                 id="conv2d-groups-dilation"),
    pytest.param(lambda: nn.Conv2d(3, 3, 3, groups=3), [(2, 3, 8, 8)], id="depthwise"),
    pytest.param(lambda: nn.Conv3d(2, 4, (1, 2, 3), stride=(1, 2, 1)), [(2, 2, 4, 5, 6)], id="conv3d"),
    pytest.param(lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), [(2, 3, 9)], id="transposed1d"),
    pytest.param(lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1), [(2, 4, 5, 5)],
                 id="transposed2d-groups"),
    pytest.param(lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), [(1, 2, 3, 3, 3)], id="transposed3d"),
    pytest.param(lambda: nn.Conv2d(3, 4, 3), [(3, 8, 8)], id="conv-unbatched"),
    pytest.param(lambda: nn.Linear(10, 20), [(4, 10)], id="linear"),
    pytest.param(lambda: nn.Linear(10, 20, bias=False), [(4, 5, 10)], id="linear-3d"),
    pytest.param(lambda: nn.Linear(10, 20), [(10,)], id="linear-1d"),
    pytest.param(lambda: Fn(torch.bmm), [(2, 3, 4), (2, 4, 5)], id="bmm"),
    pytest.param(lambda: Fn(torch.addmm), [(4, 20), (4, 10), (10, 20)], id="addmm"),
    pytest.param(lambda: Fn(torch.matmul), [(2, 3, 4, 5), (2, 3, 5, 6)], id="matmul-batched"),
    pytest.param(lambda: Fn(torch.matmul), [(2, 3, 4), (4, 5)], id="matmul-batched@2d"),
    pytest.param(lambda: Fn(lambda a, b: torch.einsum("bij,bjk->bik", a, b)), [(2, 3, 4), (2, 4, 5)], id="einsum"),
    pytest.param(lambda: Fn(lambda a, b: torch.einsum("nc,nchw->hw", a, b)), [(3, 4), (3, 4, 2, 3)],
                 id="einsum-nc,nchw"),
    pytest.param(lambda: nn.BatchNorm2d(3).eval(), [(2, 3, 8, 8)], id="bn-eval"),
    pytest.param(lambda: nn.BatchNorm1d(3, affine=False).eval(), [(4, 3)], id="bn1d-eval-no-affine"),
    pytest.param(lambda: nn.BatchNorm2d(3).train(), [(2, 3, 8, 8)], id="bn-train"),
    pytest.param(lambda: nn.GroupNorm(1, 3), [(2, 3, 8, 8)], id="gn"),
    pytest.param(lambda: nn.LayerNorm([8, 8], elementwise_affine=False), [(2, 3, 8, 8)], id="ln-no-affine"),
    pytest.param(lambda: nn.InstanceNorm2d(3, affine=True), [(2, 3, 8, 8)], id="in"),
    pytest.param(lambda: nn.Upsample(scale_factor=2), [(2, 3, 8, 8)], id="nearest2d"),
    pytest.param(lambda: nn.Upsample(size=(5, 7), mode="bilinear", align_corners=True), [(2, 3, 8, 8)],
                 id="bilinear"),
    pytest.param(lambda: nn.AdaptiveAvgPool2d((2, 3)), [(2, 3, 8, 8)], id="aap2d"),
    pytest.param(lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8).eval(), nn.ReLU(),
                                       nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)), [(2, 3, 8, 8)],
                 id="small-cnn"),
]


@pytest.mark.parametrize(("make", "shapes"), FVCORE_AGREES)
def test_fvcore_agrees(fvcore_nn: Any, make: Callable[[], nn.Module], shapes: list[tuple[int, ...]]) -> None:
    model, inputs = make(), tuple(torch.randn(s) for s in shapes)
    theirs = fvcore_analysis(fvcore_nn.FlopCountAnalysis, model, inputs)
    ours = flops(model, inputs)
    assert ours.total() == theirs.total()
    assert ours.by_operator() == theirs.by_operator()
    assert ours.by_module() == theirs.by_module()
    their_acts = fvcore_analysis(fvcore_nn.ActivationCountAnalysis, model, inputs)
    assert acts(model, inputs).by_operator() == their_acts.by_operator()


def test_fvcore_agrees_on_grid_sample(fvcore_nn: Any) -> None:
    model = Fn(lambda x, grid: F.grid_sample(x, grid, align_corners=False))
    inputs = (torch.randn(2, 3, 8, 8), torch.rand(2, 4, 5, 2) * 2 - 1)
    theirs = fvcore_analysis(fvcore_nn.FlopCountAnalysis, model, inputs)
    assert flops(model, inputs).by_operator() == theirs.by_operator() == Counter({"grid_sampler": 4 * 2 * 3 * 4 * 5})


@pytest.mark.parametrize(("make", "shapes", "ours_expected", "fvcore_expected"), [
    # fvcore multiplies prod(A) by B[-1]: the broadcast batch of B is lost
    pytest.param(lambda: Fn(torch.matmul), [(4, 5), (2, 5, 6)], {"matmul": 2 * 4 * 5 * 6}, {"matmul": 4 * 5 * 6},
                 id="matmul-right-broadcast"),
    # no fvcore handle for these
    pytest.param(lambda: Fn(torch.baddbmm), [(2, 3, 5), (2, 3, 4), (2, 4, 5)], {"baddbmm": 2 * 3 * 4 * 5}, {},
                 id="baddbmm"),
    pytest.param(lambda: nn.Upsample(scale_factor=2), [(2, 3, 8)], {"upsample_nearest1d": 2 * 3 * 16}, {},
                 id="nearest1d"),
    pytest.param(lambda: nn.AdaptiveAvgPool1d(2), [(2, 3, 8)], {"adaptive_avg_pool1d": 2 * 3 * 8}, {}, id="aap1d"),
    pytest.param(lambda: Fn(F.scaled_dot_product_attention), [(1, 2, 3, 4)] * 3,
                 {"scaled_dot_product_attention": 1 * 2 * 3 * 3 * (4 + 4)}, {}, id="sdpa"),
])
def test_where_fvcore_differs(fvcore_nn: Any, make: Callable[[], nn.Module], shapes: list[tuple[int, ...]],
                              ours_expected: dict[str, int], fvcore_expected: dict[str, int]) -> None:
    model, inputs = make(), tuple(torch.randn(s) for s in shapes)
    assert flops(model, inputs).by_operator() == Counter(ours_expected)
    assert fvcore_analysis(fvcore_nn.FlopCountAnalysis, model, inputs).by_operator() == Counter(fvcore_expected)


# --- numbers verified with fvcore (reference doc, sections 3.2, 3.3 and 4) -------------------------
@pytest.mark.parametrize(("make", "inputs", "total", "by_operator"), [
    pytest.param(lambda: nn.Linear(10, 20), [(4, 10)], 800, {"linear": 800}, id="linear"),
    pytest.param(lambda: nn.Linear(10, 20), [(4, 5, 10)], 4000, {"linear": 4000}, id="linear-3d"),
    pytest.param(lambda: Fn(torch.addmm), [(4, 20), (4, 10), (10, 20)], 800, {"addmm": 800}, id="addmm"),
    pytest.param(lambda: nn.Conv2d(3, 4, 3, padding=1), [(2, 3, 8, 8)], 13824, {"conv": 13824}, id="conv"),
    pytest.param(lambda: nn.Conv2d(3, 6, 3, groups=3), [(2, 3, 8, 8)], 3888, {"conv": 3888}, id="conv-groups"),
    pytest.param(lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), [(2, 3, 8, 8)], 13824, {"conv": 13824},
                 id="transposed"),
    pytest.param(lambda: Fn(torch.matmul), [(3, 4), (4, 5)], 60, {"matmul": 60}, id="matmul"),
    pytest.param(lambda: Fn(torch.matmul), [(2, 3, 4, 5), (2, 3, 5, 6)], 720, {"matmul": 720}, id="matmul-4d"),
    pytest.param(lambda: Fn(torch.mm), [(3, 4), (4, 5)], 60, {"mm": 60}, id="mm"),
    pytest.param(lambda: Fn(torch.bmm), [(2, 3, 4), (2, 4, 5)], 120, {"bmm": 120}, id="bmm"),
    pytest.param(lambda: Fn(lambda a, b: torch.einsum("bij,bjk->bik", a, b)), [(2, 3, 4), (2, 4, 5)], 120,
                 {"einsum": 120}, id="einsum"),
    pytest.param(lambda: nn.BatchNorm2d(3).eval(), [(2, 3, 8, 8)], 768, {"batch_norm": 768}, id="bn-eval"),
    pytest.param(lambda: nn.BatchNorm2d(3, affine=False).eval(), [(2, 3, 8, 8)], 384, {"batch_norm": 384},
                 id="bn-eval-no-affine"),
    pytest.param(lambda: nn.BatchNorm2d(3).train(), [(2, 3, 8, 8)], 1920, {"batch_norm": 1920}, id="bn-train"),
    pytest.param(lambda: nn.GroupNorm(1, 3), [(2, 3, 8, 8)], 1920, {"group_norm": 1920}, id="gn"),
    pytest.param(lambda: nn.GroupNorm(1, 3, affine=False), [(2, 3, 8, 8)], 1536, {"group_norm": 1536},
                 id="gn-no-affine"),
    pytest.param(lambda: nn.LayerNorm(8), [(2, 3, 8, 8)], 1920, {"layer_norm": 1920}, id="ln"),
    pytest.param(lambda: nn.LayerNorm(8, elementwise_affine=False), [(2, 3, 8, 8)], 1536, {"layer_norm": 1536},
                 id="ln-no-affine"),
    pytest.param(lambda: nn.InstanceNorm2d(3, affine=True), [(2, 3, 8, 8)], 1920, {"instance_norm": 1920}, id="in"),
    pytest.param(lambda: nn.InstanceNorm2d(3), [(2, 3, 8, 8)], 1536, {"instance_norm": 1536}, id="in-no-affine"),
    pytest.param(lambda: Fn(lambda x: F.interpolate(x, scale_factor=2)), [(2, 3, 8, 8)], 1536,
                 {"upsample_nearest2d": 1536}, id="nearest"),
    pytest.param(lambda: Fn(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")), [(2, 3, 8, 8)], 6144,
                 {"upsample_bilinear2d": 6144}, id="bilinear"),
    pytest.param(lambda: nn.AdaptiveAvgPool2d(1), [(2, 3, 8, 8)], 384, {"adaptive_avg_pool2d": 384}, id="aap"),
    pytest.param(lambda: Fn(lambda x, g: F.grid_sample(x, g, align_corners=False)), [(2, 3, 8, 8), (2, 4, 4, 2)],
                 384, {"grid_sampler": 384}, id="grid-sample"),
    pytest.param(lambda: SelfAttention(nn.MultiheadAttention(32, 4, batch_first=True)), [(2, 16, 32)], 163840,
                 {"linear": 131072, "bmm": 32768}, id="multihead-attention"),
])
def test_reference_numbers(make: Callable[[], nn.Module], inputs: list[tuple[int, ...]], total: int,
                           by_operator: dict[str, int]) -> None:
    analysis = flops(make(), tuple(torch.randn(s) for s in inputs))
    assert analysis.total() == total
    assert analysis.by_operator() == Counter(by_operator)


class TestModel(nn.Module):
    """The example of fvcore's FlopCountAnalysis docstring."""

    __test__ = False

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features=1000, out_features=10)
        self.conv = nn.Conv2d(in_channels=3, out_channels=10, kernel_size=1, stride=1)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.act(self.conv(x)), 1))


def test_docstring_example() -> None:
    inputs = (torch.randn((1, 3, 10, 10)),)
    analysis = flops(TestModel(), inputs)
    assert analysis.total() == 13000
    assert analysis.total("fc") == 1000 * 10
    assert analysis.by_operator() == Counter({"linear": 1000 * 10, "conv": 1 * (10 * 3) * (10 * 10)})
    assert analysis.by_module() == Counter({"": 13000, "fc": 10000, "conv": 3000, "act": 0})
    assert analysis.unsupported_ops() == Counter()
    activations = acts(TestModel(), inputs)
    assert activations.total() == 1010
    assert activations.by_operator() == Counter({"conv": 1000, "linear": 10})
    # the same through modelmeter.Args
    assert flops(TestModel(), Args(torch.randn(1, 3, 10, 10))).total() == 13000
    assert modelmeter.flop_count(TestModel(), inputs) == ({"conv": 3e-06, "linear": 1e-05}, Counter())
