"""The direct meta kernels give exactly the metadata PyTorch's own meta kernels give."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from model_helpers import small_resnet
from modelmeter import ModelRunError, analyze
from modelmeter.engine.meta_kernels import IN_PLACE, fast_meta_kernel
from modelmeter.engine.metadata import meta_stands_for
from modelmeter.zoo.registry import get_model

BATCH_NORM = torch.ops.aten.native_batch_norm.default


def _layouts(shape: tuple[int, ...]) -> list[torch.memory_format]:
    return [torch.contiguous_format, *({4: [torch.channels_last], 5: [torch.channels_last_3d]}.get(len(shape), []))]


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 4, 5), (2, 3, 2, 4, 5), (1, 1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_batch_norm_matches_the_meta_kernel(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    channels = shape[1]
    for layout, training, affine, tracked in itertools.product(_layouts(shape), (False, True), (False, True),
                                                               (False, True)):
        x = torch.empty(shape, dtype=dtype, device="meta").contiguous(memory_format=layout)
        weight = torch.empty(channels, dtype=dtype, device="meta") if affine else None
        bias = torch.empty(channels, dtype=dtype, device="meta") if affine else None
        stats = [torch.empty(channels, dtype=dtype, device="meta") for _ in range(2)] if tracked else [None, None]
        if (not training and not tracked) or (training and x.numel() == channels):
            continue  # eval needs running statistics; F.batch_norm refuses to train on one value per channel
        args = (x, weight, bias, *stats, training, 0.1, 1e-5)
        fast = fast_meta_kernel(BATCH_NORM, args)
        assert fast is not None
        expected, got = BATCH_NORM(*args), fast(*args)
        for e, g in zip(expected, got, strict=True):
            assert (e.shape, e.stride(), e.dtype, e.device) == (g.shape, g.stride(), g.dtype, g.device), \
                (shape, dtype, layout, training, affine, tracked)


@pytest.mark.parametrize(("dtype", "parameters"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_batch_norm_standing_for_cpu_matches_the_cpu_kernel(dtype: torch.dtype, parameters: torch.dtype) -> None:
    # a half input with float32 statistics and weights runs the CPU's mixed-type kernel: float32 statistics
    for training, layout, affine in itertools.product((False, True), (torch.contiguous_format, torch.channels_last),
                                                      (False, True)):
        x = torch.randn(2, 3, 4, 5, dtype=dtype).contiguous(memory_format=layout)
        stats = [torch.zeros(3, dtype=parameters), torch.ones(3, dtype=parameters)]
        weights = [torch.ones(3, dtype=parameters), torch.zeros(3, dtype=parameters)] if affine else [None, None]
        expected = BATCH_NORM(x, *weights, *stats, training, 0.1, 1e-5)
        args = (x.to("meta"), *(None if w is None else w.to("meta") for w in weights),
                *(s.to("meta") for s in stats), training, 0.1, 1e-5)
        fast = fast_meta_kernel(BATCH_NORM, args)
        assert fast is not None
        with meta_stands_for("cpu"):
            got = fast(*args)
        for e, g in zip(expected, got, strict=True):
            assert (e.shape, e.stride(), e.dtype) == (g.shape, g.stride(), g.dtype), (training, layout, affine)


def test_batch_norm_keeps_the_slow_path_where_not_verified() -> None:
    strided = torch.empty(2, 6, 4, 4, device="meta")[:, ::2]  # not dense
    assert fast_meta_kernel(BATCH_NORM, (strided, None, None, None, None, True, 0.1, 1e-5)) is None
    fake_cpu = torch.empty(2, 3, 4, 4)  # a real tensor: its own kernel
    assert fast_meta_kernel(BATCH_NORM, (fake_cpu, None, None, None, None, True, 0.1, 1e-5)) is None
    assert fast_meta_kernel(torch.ops.aten.cumsum.default, (torch.empty(2, device="meta"), 0)) is None


_aten = torch.ops.aten
# element-wise operators with a direct kernel, and the scalars they are called with
UNARY: list[tuple[Any, tuple[object, ...]]] = [
    *((op, ()) for op in (_aten.relu.default, _aten.silu.default, _aten.sigmoid.default, _aten.tanh.default,
                          _aten.neg.default, _aten.exp.default, _aten.log.default, _aten.sqrt.default,
                          _aten.rsqrt.default, _aten.reciprocal.default, _aten.abs.default, _aten.sin.default,
                          _aten.cos.default, _aten.erf.default, _aten.hardswish.default, _aten.hardsigmoid.default,
                          _aten.mish.default)),
    (_aten.hardtanh.default, (-2.0, 2.0)), (_aten.leaky_relu.default, (0.1,)), (_aten.elu.default, (1.0,)),
    (_aten.softplus.default, (1, 20)), (_aten.pow.Tensor_Scalar, (2,)), (_aten.pow.Tensor_Scalar, (0.5,)),
    (_aten.clamp.default, (-1.0, 1.0)),
]


def _cases() -> list[tuple[str, object, tuple[object, ...], dict[str, object]]]:
    """(name, operator, CPU arguments, keyword arguments) for every direct kernel but batch norm."""
    aten = torch.ops.aten
    cases: list[tuple[str, object, tuple[object, ...], dict[str, object]]] = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(2, 5, 8, dtype=dtype)
        for label, t in (("contiguous", x), ("transposed", x.transpose(0, 1)),
                         ("channels_last", torch.randn(2, 3, 4, 5, dtype=dtype).to(memory_format=torch.channels_last)),
                         ("size-1 dims", torch.randn(1, 3, 1, 5, dtype=dtype))):
            cases += [(f"{op.__name__} {label} {dtype}", op, (t, *scalars), {}) for op, scalars in UNARY]
            cases += [(f"{op.__name__} by {number!r} {label} {dtype}", op, (t, number), {})
                      for op in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)
                      for number in (2, 0.5)]
            cases += [(f"div {label} {dtype}", aten.div.Tensor, (t, t.clone()), {}),
                      (f"gelu {label} {dtype}", aten.gelu.default, (t,), {}),
                      (f"gelu tanh {label} {dtype}", aten.gelu.default, (t,), {"approximate": "tanh"}),
                      (f"add {label} {dtype}", aten.add.Tensor, (t, t.clone()), {"alpha": 2}),
                      (f"sub {label} {dtype}", aten.sub.Tensor, (t, t.clone()), {}),
                      (f"mul {label} {dtype}", aten.mul.Tensor, (t, t.clone()), {})]
            if label != "channels_last":  # roll keeps a channels-last layout: left to torch's kernel
                cases += [(f"roll {label} {dtype}", aten.roll.default, (t, [1, 2], [0, 1]), {}),
                          (f"roll flat {label} {dtype}", aten.roll.default, (t, [3]), {})]
        cases += _lstm_cases(dtype)
        for dims, keepdim in (([-1, -2], True), ([1], False), ([0, 2], False), ([], False), ([-1], True)):
            cases.append((f"mean {dims} keepdim={keepdim} {dtype}", aten.mean.dim, (x, dims, keepdim), {}))
        image = torch.randn(2, 3, 4, 5, dtype=dtype)
        cases += [(f"mean image {dtype}", aten.mean.dim, (image, [-1, -2], True), {}),
                  (f"mean to float64 {dtype}", aten.mean.dim, (x, [1]), {"dtype": torch.float64})]
        w, b = torch.randn(8, dtype=dtype), torch.randn(8, dtype=dtype)
        if dtype != torch.float32:  # float32 weights: the CPU's mixed-type kernel, float32 statistics
            cases.append((f"layer_norm float32 weights {dtype}", aten.native_layer_norm.default,
                          (x, [8], w.float(), b.float(), 1e-5), {}))
        for label, t in (("contiguous", x), ("transposed", x.transpose(0, 1))):
            cases += [(f"layer_norm {label} {dtype}", aten.native_layer_norm.default, (t, [8], w, b, 1e-5), {}),
                      (f"layer_norm 2d {label} {dtype}", aten.native_layer_norm.default, (t, list(t.shape[1:]), None,
                                                                                          None, 1e-5), {})]
        cases += _convolution_cases(dtype)
        cases += _training_cases(dtype)
        m1, m2 = torch.randn(6, 4, dtype=dtype), torch.randn(4, 3, dtype=dtype)
        for label, bias in (("vector", torch.randn(3, dtype=dtype)), ("matrix", torch.randn(6, 3, dtype=dtype)),
                            ("row", torch.randn(1, 3, dtype=dtype))):
            cases += [(f"addmm {label} {dtype}", aten.addmm.default, (bias, m1, m2), {}),
                      (f"addmm {label} m2.T {dtype}", aten.addmm.default, (bias, m1, m2.t().contiguous().t()), {}),
                      (f"addmm {label} m1.T {dtype}", aten.addmm.default, (bias, m1.t().contiguous().t(), m2),
                       {"beta": 0.5})]
    return cases


def _convolution_cases(dtype: torch.dtype) -> list[tuple[str, object, tuple[object, ...], dict[str, object]]]:
    """Convolutions of 1 to 3 spatial dimensions: strides, padding, dilation, groups, a bias or none, size-1
    dimensions."""
    conv = torch.ops.aten.convolution.default
    cases: list[tuple[str, object, tuple[object, ...], dict[str, object]]] = []
    for spatial, (stride, padding, dilation), groups, bias, batch in itertools.product(
            ((9,), (7, 6), (5, 4, 6), (1, 1)), ((1, 0, 1), (2, 1, 1), (3, 2, 2)), (1, 2), (False, True), (1, 2)):
        n = len(spatial)
        x = torch.randn(batch, 4, *spatial, dtype=dtype)
        weight = torch.randn(6, 4 // groups, *([3] * n if min(spatial) >= 3 else [1] * n), dtype=dtype)
        geometry = ([stride] * n, [padding] * n, [dilation] * n)
        cases.append((f"convolution {spatial} s{stride} p{padding} d{dilation} g{groups} bias={bias} n={batch} {dtype}",
                      conv, (x, weight, torch.randn(6, dtype=dtype) if bias else None, *geometry, False, [0] * n,
                             groups), {}))
    return cases


Case = tuple[str, object, tuple[object, ...], dict[str, object]]


def _training_cases(dtype: torch.dtype) -> list[Case]:
    """The operators of a training step: the loss's seed gradient and dropout's mask (``ones_like``, ``empty_like``),
    gradients scaled by a number, products, sums, and the backward kernels of activations, normalisations,
    convolutions and pooling; on every layout the direct kernels accept, those a CPU run refuses left out."""
    cases = [*_new_and_scaled_cases(dtype), *_product_and_sum_cases(dtype), *_pointwise_backward_cases(dtype),
             *_broadcast_cases(dtype), *_softmax_cases(dtype), *_zeros_around_cases(dtype),
             *_embedding_and_cat_cases(dtype),
             *_normalisation_backward_cases(dtype), *_convolution_backward_cases(dtype), *_pooling_cases(dtype)]
    return [case for case in cases if _runs_on_the_cpu(case)]


def _runs_on_the_cpu(case: Case) -> bool:
    """False where the CPU has no kernel for the dtype (``... not implemented for 'Half'``)."""
    _, op, args, kwargs = case
    try:
        op(*args, **kwargs)  # type: ignore[operator]
    except RuntimeError as exc:
        if "not implemented for" in str(exc):
            return False
        raise
    return True


def _dense_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dense layouts: contiguous, transposed, channels-last, size-1 dimensions, no dimension."""
    return {"contiguous": torch.randn(2, 5, 8, dtype=dtype),
            "transposed": torch.randn(5, 2, 8, dtype=dtype).transpose(0, 1),
            "channels_last": torch.randn(2, 3, 4, 5, dtype=dtype).to(memory_format=torch.channels_last),
            "size-1 dims": torch.randn(1, 3, 1, 5, dtype=dtype),
            "no dimension": torch.randn((), dtype=dtype)}


def _expanded(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Contiguous tensors expanded: a mean's gradient, a bias's, a scalar loss's."""
    return {"expanded mean gradient": torch.randn(2, 6, 1, 1, dtype=dtype).expand(2, 6, 3, 4),
            "expanded row": torch.randn(1, 8, dtype=dtype).expand(5, 8),
            "expanded scalar": torch.randn((), dtype=dtype).expand(2, 3),
            "expanded middle": torch.randn(3, 1, 4, dtype=dtype).expand(3, 5, 4),
            "expanded size-1": torch.randn(2, 1, 1, dtype=dtype).expand(2, 1, 6)}


def _new_and_scaled_cases(dtype: torch.dtype) -> list[Case]:
    aten = torch.ops.aten
    cases: list[Case] = []
    keep = {"memory_format": torch.preserve_format, "pin_memory": False}  # as autograd asks for its seed
    tensors = {**_dense_tensors(dtype), "integers": torch.arange(12).view(3, 4).t()}
    for label, t in tensors.items():
        for op in (aten.ones_like.default, aten.empty_like.default, aten.clone.default):
            cases += [(f"{op.__name__} {label} {dtype}", op, (t,), {}),
                      (f"{op.__name__} preserving {label} {dtype}", op, (t,),
                       {"memory_format": torch.preserve_format} if op is aten.clone.default else keep),
                      (f"{op.__name__} contiguous of {label} {dtype}", op, (t,),
                       {"memory_format": torch.contiguous_format}),
                      *([(f"{op.__name__} as float64 {label} {dtype}", op, (t,), {"dtype": torch.float64})]
                        if op is not aten.clone.default else [])]
    for label, t in {**_dense_tensors(dtype), **_expanded(dtype)}.items():
        cases += [(f"{op.__name__} by {number!r} {label} {dtype}", op, (t, number), {})
                  for op in (aten.mul.Scalar, aten.div.Scalar) for number in (4, 0.5)]
    return cases


def _product_and_sum_cases(dtype: torch.dtype) -> list[Case]:
    aten = torch.ops.aten
    cases: list[Case] = []
    left = {"contiguous": torch.randn(6, 4, dtype=dtype), "transposed": torch.randn(4, 6, dtype=dtype).t(),
            "expanded": torch.randn(1, 1, dtype=dtype).expand(6, 4)}
    right = {"contiguous": torch.randn(4, 3, dtype=dtype), "transposed": torch.randn(3, 4, dtype=dtype).t()}
    cases += [(f"mm {a} {b} {dtype}", aten.mm.default, (left[a], right[b]), {}) for a in left for b in right]
    batched_left = {"contiguous": torch.randn(3, 6, 4, dtype=dtype),
                    "transposed": torch.randn(3, 4, 6, dtype=dtype).transpose(1, 2),
                    "batch inside": torch.randn(6, 3, 4, dtype=dtype).transpose(0, 1)}
    batched_right = {"contiguous": torch.randn(3, 4, 5, dtype=dtype),
                     "transposed": torch.randn(3, 5, 4, dtype=dtype).transpose(1, 2)}
    cases += [(f"bmm {a} {b} {dtype}", aten.bmm.default, (batched_left[a], batched_right[b]), {})
              for a in batched_left for b in batched_right]
    for label, t in {**_dense_tensors(dtype), **_expanded(dtype)}.items():
        if t.dim() == 0:
            continue
        for dims, keepdim in (([0], True), ([0], False), ([-1], False), ([0, 1], True), ([], False), (None, True)):
            cases.append((f"sum {dims} keepdim={keepdim} {label} {dtype}", aten.sum.dim_IntList, (t, dims, keepdim),
                          {}))
        cases.append((f"sum to float64 {label} {dtype}", aten.sum.dim_IntList, (t, [0]), {"dtype": torch.float64}))
    return cases


def _broadcast_cases(dtype: torch.dtype) -> list[Case]:
    """Element-wise operators whose first operand decides the output's layout: a dense tensor without size-1
    dimensions, and a second of its shape in another layout or broadcast to it (a bias, a column, a scalar)."""
    aten = torch.ops.aten
    cases: list[Case] = []
    firsts = {"contiguous": torch.randn(2, 5, 8, dtype=dtype),
              "transposed": torch.randn(5, 2, 8, dtype=dtype).transpose(0, 1),
              "permuted": torch.randn(8, 2, 5, dtype=dtype).permute(1, 2, 0),
              "channels_last": torch.randn(2, 3, 4, 5, dtype=dtype).to(memory_format=torch.channels_last)}
    for (label, a), op in itertools.product(firsts.items(), (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor,
                                                             aten.div.Tensor)):
        seconds = {"contiguous": torch.randn(a.shape, dtype=dtype), "its layout": torch.randn_like(a),
                   "transposed": torch.randn(tuple(reversed(a.shape)), dtype=dtype).permute(
                       *reversed(range(a.dim()))),
                   "a bias": torch.randn(a.shape[-1], dtype=dtype),
                   "a column": torch.randn(*a.shape[:-1], 1, dtype=dtype),
                   "a middle row": torch.randn(a.shape[-2], 1, dtype=dtype),
                   "expanded": torch.randn(a.shape[-1], dtype=dtype).expand(a.shape),
                   "a scalar tensor": torch.randn((), dtype=dtype)}
        cases += [(f"{op.__name__} {label} and {second} {dtype}", op, (a, b), {}) for second, b in seconds.items()]
    cases.append((f"add with alpha, a bias {dtype}", aten.add.Tensor,
                  (firsts["transposed"], torch.randn(8, dtype=dtype)), {"alpha": 2}))
    # contiguous both, the first with size-1 dimensions and the second broadcast to it (a mask added to scores)
    pairs = (((1, 6, 6), (6, 6)), ((1, 6, 6), (1, 6)), ((4, 1, 3), (1, 3)), ((2, 1, 8), (8,)), ((1, 1, 5), (1, 1, 5)),
             ((3, 4), (3, 1)), ((1, 3, 1, 4), (3, 1, 1)), ((1, 2, 6, 6), (1, 1, 6, 6)), ((4, 1), ()),
             ((1, 16, 1), (8,)), ((6, 1), (1, 5)), ((3, 1, 4), (2, 1)), ((5,), (2, 3, 5)), ((1, 1), (4, 3)),
             ((1, 3), (4, 3)))
    for shape in ((1, 7, 8), (3, 4), (5,)):  # a sum's gradient (one value expanded) and a contiguous tensor
        summed, x = torch.randn((), dtype=dtype).expand(shape), torch.randn(shape, dtype=dtype)
        cases += [(f"{op.__name__} of a sum's gradient {shape} {label} {dtype}", op, pair, {})
                  for op in (aten.add.Tensor, aten.mul.Tensor, aten.div.Tensor)
                  for label, pair in (("first", (summed, x)), ("second", (x, summed)))]
    for a_shape, b_shape in pairs:
        for op in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor):
            cases.append((f"{op.__name__} {a_shape} and {b_shape} {dtype}", op,
                          (torch.randn(a_shape, dtype=dtype), torch.randn(b_shape, dtype=dtype)), {}))
    # views that are not dense, their strides ordering them: half of a rotated query, a third of a fused projection
    views = {"half of a query": torch.randn(1, 6, 3, 8, dtype=dtype).transpose(1, 2)[..., 4:],
             "a third": torch.randn(2, 5, 12, dtype=dtype)[..., 4:8],
             "a third, batch of one": torch.randn(1, 5, 3 * 8, dtype=dtype)[..., :8].view(1, 5, 2, 4).transpose(1, 2),
             "every other column": torch.randn(4, 6, dtype=dtype)[:, ::2],
             "heads before positions": torch.randn(1, 6, 3, 4, dtype=dtype).transpose(1, 2)}  # dense
    for label, view in views.items():
        cases += [(f"{op.__name__} of {label} {dtype}", op, (view,), {})
                  for op in (aten.neg.default, aten.gelu.default, aten.exp.default)]
        cases.append((f"sum of {label} {dtype}", aten.sum.default, (view,), {}))
    cases += [(f"{op.__name__} of heads before positions by 0.5 {dtype}", op, (views["heads before positions"], 0.5),
               {}) for op in (aten.mul.Scalar, aten.div.Scalar, aten.mul.Tensor)]
    matrix = torch.randn(3, 4, dtype=dtype)
    cases += [(f"sum {dtype}", aten.sum.default, (matrix,), {}),
              (f"sum to float64 {dtype}", aten.sum.default, (matrix,), {"dtype": torch.float64})]
    # a first operand with size-1 dimensions whose strides order it (a query viewed with its heads before its
    # positions) and a table broadcast to it
    query = torch.randn(1, 6, 3, 4, dtype=dtype).transpose(1, 2)
    for b in (torch.randn(1, 1, 6, 4, dtype=dtype), torch.randn(6, 4, dtype=dtype), torch.randn(3, 1, 4, dtype=dtype)):
        cases += [(f"{op.__name__} of a query and {tuple(b.shape)} {dtype}", op, (query, b), {})
                  for op in (aten.add.Tensor, aten.mul.Tensor)]
    for label, x in (("contiguous", torch.randn(2, 5, 8, dtype=dtype)),
                     ("size-1 dims", torch.randn(1, 8, dtype=dtype))):
        cases += [(f"pow of {base!r} by {label} {dtype}", aten.pow.Scalar, (base, x), {}) for base in (10000.0, 2)]
    return cases


def _softmax_cases(dtype: torch.dtype) -> list[Case]:
    """Softmax, log-softmax and safe softmax over each dimension, and their backward."""
    aten = torch.ops.aten
    cases: list[Case] = []
    for x, dim in ((torch.randn(2, 4, 5, 5, dtype=dtype), -1), (torch.randn(2, 4, 5, 5, dtype=dtype), 1),
                   (torch.randn(6, 3, dtype=dtype), 0), (torch.randn(7, dtype=dtype), -1),
                   (torch.randn((), dtype=dtype), 0)):
        shape = tuple(x.shape)
        for op, backward in ((aten._softmax.default, aten._softmax_backward_data.default),
                             (aten._log_softmax.default, aten._log_softmax_backward_data.default)):
            out = op(x, dim, False)
            cases += [(f"{op.__name__} {shape} over {dim} {dtype}", op, (x, dim, False), {}),
                      (f"{backward.__name__} {shape} over {dim} {dtype}", backward,
                       (torch.randn_like(out), out, dim, dtype), {})]
        cases += [(f"_safe_softmax {shape} over {dim} {dtype}", aten._safe_softmax.default, (x, dim), {}),
                  (f"_safe_softmax {shape} over {dim} to float64 {dtype}", aten._safe_softmax.default, (x, dim),
                   {"dtype": torch.float64})]
    return cases


def _embedding_and_cat_cases(dtype: torch.dtype) -> list[Case]:
    """Embedding look-ups (indices of several shapes, layouts and integer dtypes, a padding index) and
    concatenations (a class token before patches, halves of a rotation, along every dimension, of several
    layouts)."""
    aten = torch.ops.aten
    table = torch.randn(10, 6, dtype=dtype)
    indices = {"row": torch.randint(0, 10, (1, 7)), "matrix": torch.randint(0, 10, (3, 4)),
               "transposed": torch.randint(0, 10, (4, 3)).t(), "vector": torch.randint(0, 10, (5,)),
               "int32": torch.randint(0, 10, (2, 3), dtype=torch.int32), "none": torch.randint(0, 10, ())}
    cases: list[Case] = [(f"embedding {label} {dtype}", aten.embedding.default, (table, i), {})
                         for label, i in indices.items()]
    cases.append((f"embedding with a padding index {dtype}", aten.embedding.default, (table, indices["matrix"], 0),
                  {}))
    patches = torch.randn(1, 8, 6, dtype=dtype).transpose(1, 2)  # (1, 6, 8) of strides (48, 1, 6)
    token = torch.randn(1, 1, 8, dtype=dtype)
    groups = {"class token and patches": ([token, patches], 1),
              "halves": ([torch.randn(2, 5, 4, dtype=dtype), torch.randn(2, 5, 4, dtype=dtype)], -1),
              "transposed pieces": ([torch.randn(5, 2, dtype=dtype).t(), torch.randn(2, 3, dtype=dtype)], 1),
              "rows": ([torch.randn(2, 3, dtype=dtype), torch.randn(4, 3, dtype=dtype).t().contiguous().t()], 0),
              "four dimensions": ([torch.randn(1, 4, 6, 8, dtype=dtype)] * 3, 2),
              "vectors": ([torch.randn(3, dtype=dtype), torch.randn(4, dtype=dtype)], 0),
              "one piece": ([torch.randn(3, 2, dtype=dtype).t()], 1)}
    # four and five dimensions in other layouts: the halves of a rotated query (heads before positions), a
    # channels-last piece beside a contiguous one, a permuted one, size-1 dimensions
    query = torch.randn(1, 6, 3, 8, dtype=dtype).transpose(1, 2)
    last = torch.randn(2, 3, 4, 5, dtype=dtype).to(memory_format=torch.channels_last)
    volume = torch.randn(2, 3, 2, 4, 5, dtype=dtype)
    image = torch.randn(1, 4, 6, 8, dtype=dtype)
    groups |= {"pieces of other layouts": ([image, image.transpose(2, 3).contiguous().transpose(2, 3)], 1),
               "rotated halves": ([-query[..., 4:], query[..., :4]], -1),
               "a query's halves": ([query[..., 4:], query[..., :4]], -1),
               "channels-last and contiguous": ([last, last.contiguous()], 1),
               "contiguous and channels-last": ([last.contiguous(), last], 0),
               "permuted": ([torch.randn(4, 5, 2, 3, dtype=dtype).permute(2, 3, 0, 1)] * 2, 3),
               "batch of one, one channel": ([torch.randn(1, 1, 4, 5, dtype=dtype).transpose(2, 3)] * 2, 1),
               "volumes": ([volume, volume.transpose(2, 4).contiguous().transpose(2, 4)], 0),
               "a volume channels-last and not": ([volume.to(memory_format=torch.channels_last_3d), volume], 1)}
    cases += [(f"cat {label} {dtype}", aten.cat.default, (pieces, dim), {}) for label, (pieces, dim) in groups.items()]
    # stack: q, k and v's gradients (heads before positions), along every dimension, channels-last pieces
    stacks = {"gradients of q, k, v": [torch.randn(1, 5, 3, 4, dtype=dtype).transpose(1, 2)] * 3,
              "matrices": [torch.randn(2, 3, dtype=dtype), torch.randn(3, 2, dtype=dtype).t()],
              "vectors": [torch.randn(4, dtype=dtype)] * 2,
              "volumes": [torch.randn(2, 3, 4, 5, dtype=dtype)] * 2,
              "permuted": [torch.randn(4, 5, 2, 3, dtype=dtype).permute(2, 3, 0, 1)] * 2,
              "transposed": [torch.randn(3, 4, 2, dtype=dtype).transpose(0, 2)] * 3,
              "views of a third": [torch.randn(2, 5, 12, dtype=dtype)[..., 4:8]] * 2}
    cases += [(f"stack {label} along {dim} {dtype}", aten.stack.default, (pieces, dim), {})
              for label, pieces in stacks.items() for dim in range(-pieces[0].dim() - 1, pieces[0].dim() + 1)]
    cases.append((f"cat, dim left out {dtype}", aten.cat.default, ([token, token],), {}))
    return cases


def _zeros_around_cases(dtype: torch.dtype) -> list[Case]:
    """The gradients of selections and slices (q, k and v chunked off one projection), of gradients in several
    layouts."""
    aten = torch.ops.aten
    cases: list[Case] = []
    sizes = [3, 5, 4, 6]
    for dim in range(4):
        shape = [n for i, n in enumerate(sizes) if i != dim]
        for label, grad in (("contiguous", torch.randn(shape, dtype=dtype)),
                            ("transposed", torch.randn(list(reversed(shape)), dtype=dtype).permute(2, 1, 0))):
            cases.append((f"select_backward dim {dim} {label} {dtype}", aten.select_backward.default,
                          (grad, sizes, dim, 1), {}))
        for start, end, step in ((0, 2, 1), (1, 3, 2), (0, sizes[dim], 1)):
            sliced = [len(range(start, end, step)) if i == dim else n for i, n in enumerate(sizes)]
            cases.append((f"slice_backward dim {dim} {start}:{end}:{step} {dtype}", aten.slice_backward.default,
                          (torch.randn(sliced, dtype=dtype), sizes, dim, start, end, step), {}))
    return cases


def _pointwise_backward_cases(dtype: torch.dtype) -> list[Case]:
    aten = torch.ops.aten
    cases: list[Case] = []
    for label, t in _dense_tensors(dtype).items():
        grad = torch.randn_like(t)  # t's layout
        cases += [(f"threshold_backward {label} {dtype}", aten.threshold_backward.default, (grad, t, 0), {}),
                  (f"gelu_backward {label} {dtype}", aten.gelu_backward.default, (grad, t), {}),
                  (f"gelu_backward tanh {label} {dtype}", aten.gelu_backward.default, (grad, t),
                   {"approximate": "tanh"}),
                  (f"hardtanh_backward {label} {dtype}", aten.hardtanh_backward.default, (grad, t, 0.0, 6.0), {}),
                  *((f"{op.__name__} {label} {dtype}", op, (grad, t), {}) for op in (
                      aten.tanh_backward.default, aten.sigmoid_backward.default, aten.silu_backward.default))]
    gates = _gates(dtype)  # contiguous both, strides of their own in size-1 dimensions
    cases.append((f"threshold_backward of gates {dtype}", aten.threshold_backward.default,
                  (torch.randn(1, 8, dtype=dtype), gates[0], 0.0), {}))
    for shape in ((1, 8), (3, 4), (2, 1, 5)):  # the gradient of a sum: one value expanded
        x, grad = torch.randn(shape, dtype=dtype), torch.randn((), dtype=dtype).expand(shape)
        cases += [(f"{op.__name__} of a sum's gradient {shape} {dtype}", op, (grad, x), {})
                  for op in (aten.tanh_backward.default, aten.sigmoid_backward.default, aten.gelu_backward.default)]
    return cases


def _normalisation_backward_cases(dtype: torch.dtype) -> list[Case]:
    """Batch norm (training and eval, affine or not, contiguous or channels-last) and layer norm (any layout of input
    and gradient, expanded gradients among them) backward, every output mask autograd asks for."""
    aten = torch.ops.aten
    cases: list[Case] = []
    for shape, training, affine, last in itertools.product(((4, 3), (2, 3, 5), (2, 3, 4, 5), (2, 3, 2, 4, 5)),
                                                           (True, False), (True, False), (False, True)):
        if last and len(shape) < 4:
            continue
        x = torch.randn(shape, dtype=dtype)
        if last:
            x = x.contiguous(memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
        weight = torch.randn(3, dtype=dtype) if affine else None
        stats = [torch.zeros(3, dtype=dtype), torch.ones(3, dtype=dtype)]
        _, mean, invstd = aten.native_batch_norm.default(x, weight, None, *stats, training, 0.1, 1e-5)
        masks = {(True, affine, affine), (False, affine, affine), (True, False, False), (False, False, affine)}
        for mask in sorted(masks):
            cases.append((f"batch_norm_backward {shape} training={training} affine={affine} channels_last={last} "
                          f"{mask} {dtype}", aten.native_batch_norm_backward.default,
                          (torch.randn_like(x), x, weight, *stats, mean, invstd, training, 1e-5, list(mask)), {}))
    x = torch.randn(2, 5, 8, dtype=dtype)
    for normalized, affine in itertools.product(([8], [5, 8], [2, 5, 8]), (True, False)):
        weight = torch.randn(normalized, dtype=dtype) if affine else None
        _, mean, rstd = aten.native_layer_norm.default(x, normalized, weight, weight, 1e-5)
        grads = {"contiguous": torch.randn(2, 5, 8, dtype=dtype),
                 "expanded": torch.randn((), dtype=dtype).expand(2, 5, 8),
                 "expanded rows": torch.randn(2, 1, 8, dtype=dtype).expand(2, 5, 8)}
        masks = {(True, affine, affine), (True, False, False), (False, affine, False), (True, False, affine)}
        for (grad_label, grad), mask in itertools.product(grads.items(), sorted(masks)):
            cases.append((f"layer_norm_backward over {normalized} affine={affine} gradient {grad_label} {mask} "
                          f"{dtype}", aten.native_layer_norm_backward.default,
                          (grad, x, normalized, mean, rstd, weight, weight, list(mask)), {}))
    return cases


def _convolution_backward_cases(dtype: torch.dtype) -> list[Case]:
    """The backward of the convolutions of :func:`_convolution_cases`, with and without each gradient."""
    aten = torch.ops.aten
    cases: list[Case] = []
    for name, _, args, _ in _convolution_cases(dtype):
        x, weight, bias, *geometry = args
        out = aten.convolution.default(*args)
        channels = weight.shape[0]  # type: ignore[union-attr]
        for mask in ([True, True, bias is not None], [False, True, bias is not None], [True, False, False]):
            cases.append((f"{name} backward {mask}", aten.convolution_backward.default,
                          (torch.randn_like(out), x, weight, [channels if bias is not None else 0], *geometry, mask),
                          {}))
    return cases


def _pooling_cases(dtype: torch.dtype) -> list[Case]:
    """``max_pool2d_with_indices`` and its backward: 3-D and 4-D inputs, strides, padding, dilation, ceil mode,
    the arguments left to their defaults."""
    aten = torch.ops.aten
    cases: list[Case] = []
    for shape, (kernel, stride, padding, dilation), ceil in itertools.product(
            ((2, 4, 9, 9), (4, 7, 8), (1, 3, 10, 7), (1, 2, 3, 3)),
            ((3, 2, 1, 1), (2, 2, 0, 1), (3, 3, 1, 2), (3, 1, 0, 1), (2, 3, 1, 1)), (False, True)):
        x = torch.randn(shape, dtype=dtype)
        full = (x, [kernel] * 2, [stride] * 2, [padding] * 2, [dilation] * 2, ceil)
        variants = {"": full, " stride left out": (x, [kernel] * 2, [], [padding] * 2, [dilation] * 2, ceil)}
        if not ceil and dilation == 1:
            variants[" defaults"] = (x, [kernel] * 2, [stride] * 2, [padding] * 2)
        label = f"max_pool2d {shape} k{kernel} s{stride} p{padding} d{dilation} ceil={ceil} {dtype}"
        cases += [(label + suffix, aten.max_pool2d_with_indices.default, args, {})
                  for suffix, args in variants.items()]
        out, indices = aten.max_pool2d_with_indices.default(*full)
        cases.append((label + " backward", aten.max_pool2d_with_indices_backward.default,
                      (torch.randn_like(out), *full, indices), {}))
    return cases


def _gates(dtype: torch.dtype) -> list[torch.Tensor]:
    """What an LSTM cell computes on: gates chunked off one product (size-1 dimensions with strides of their own)."""
    return [*torch.randn(1, 32, dtype=dtype).unsafe_chunk(4, 1), *torch.randn(2, 1, 12, dtype=dtype).unsafe_chunk(3, 2)]


def _lstm_cases(dtype: torch.dtype) -> list[tuple[str, object, tuple[object, ...], dict[str, object]]]:
    """In-place operators on every layout, and binary operators on two contiguous tensors of different strides."""
    aten = torch.ops.aten
    cases: list[tuple[str, object, tuple[object, ...], dict[str, object]]] = []
    layouts = {"contiguous": lambda: torch.randn(2, 5, 8, dtype=dtype),
               "transposed": lambda: torch.randn(2, 5, 8, dtype=dtype).transpose(0, 1),
               "channels_last": lambda: torch.randn(2, 3, 4, 5, dtype=dtype).to(memory_format=torch.channels_last),
               "gate": lambda: _gates(dtype)[1]}
    scalars = {aten.hardtanh_.default: (-1.0, 1.0), aten.leaky_relu_.default: (0.1,),
               aten.clamp_.default: (-1.0, 1.0), aten.mul_.Scalar: (2,), aten.div_.Scalar: (0.9,)}
    for label, make in layouts.items():
        for op in IN_PLACE:
            if op.__name__ in ("add_.Tensor", "sub_.Tensor", "mul_.Tensor", "div_.Tensor"):
                target = make()
                cases += [(f"{op.__name__} {label} {dtype}", op, (target, torch.randn_like(target)), {}),
                          (f"{op.__name__} by 2 {label} {dtype}", op, (make(), 2), {})]
            else:
                cases.append((f"{op.__name__} {label} {dtype}", op, (make(), *scalars.get(op, ())), {}))
    gates = _gates(dtype)
    for a, b in ((gates[0], gates[1]), (gates[1], torch.randn(1, 8, dtype=dtype)),
                 (torch.randn(1, 8, dtype=dtype), gates[2]),
                 (torch.randn(8, 1, dtype=dtype).t(), torch.randn(8, 1, dtype=dtype).t())):
        cases += [(f"{op.__name__} of gates {tuple(a.stride())} {tuple(b.stride())} {dtype}", op, (a, b), {})
                  for op in (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)]
    return cases


def _metadata(result: object) -> list[tuple[object, ...] | None]:
    outputs = result if isinstance(result, (tuple, list)) else (result,)
    return [None if t is None else (tuple(t.shape), t.stride(), t.dtype) for t in outputs]


def _to_meta(value: object) -> object:
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):  # cat's tensors
        return [_to_meta(v) for v in value]
    if not isinstance(value, torch.Tensor):
        return value
    # the same strides, also of a view that is not dense (``.to("meta")`` would make that one contiguous)
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


CASES = _cases()


@pytest.mark.parametrize("name,op,args,kwargs", CASES, ids=[c[0] for c in CASES])
def test_direct_kernels_match_torch_on_meta_and_on_the_cpu(name: str, op: object, args: tuple[object, ...],
                                                          kwargs: dict[str, object]) -> None:
    meta_args = tuple(_to_meta(a) for a in args)
    fast = fast_meta_kernel(op, meta_args)
    assert fast is not None, name
    assert _metadata(fast(*meta_args, **kwargs)) == _metadata(op(*meta_args, **kwargs))  # type: ignore[operator]
    with meta_stands_for("cpu"):
        assert _metadata(fast(*meta_args, **kwargs)) == _metadata(op(*args, **kwargs))  # type: ignore[operator]
    if op in IN_PLACE:  # the tensor updated, itself
        assert fast(*meta_args, **kwargs) is meta_args[0]


def test_direct_kernels_decline_what_they_do_not_know() -> None:
    aten = torch.ops.aten
    a, row = torch.empty(4, 3, device="meta"), torch.empty(1, 3, device="meta")
    # the first operand broadcast, the second not contiguous (both contiguous: _broadcast_cases)
    assert fast_meta_kernel(aten.add.Tensor, (row, a.t().contiguous().t())) is None
    # a first operand with a size-1 dimension: its strides tie there, and the second's decide (unless both have
    # the strides of contiguous tensors: _broadcast_cases); or a stride of a size-1 dimension out of order
    odd_batch = torch.empty_strided((1, 4, 3), (5, 3, 1), device="meta")
    assert fast_meta_kernel(aten.add.Tensor, (odd_batch, torch.empty(4, 3, device="meta").t().contiguous().t())) \
        is None
    assert fast_meta_kernel(aten.add.Tensor, (torch.empty(4, 1, 3, device="meta"),
                                              torch.empty(3, 1, device="meta").t())) is None
    larger = torch.empty(4, 2, 3, device="meta").transpose(0, 1)  # not contiguous (contiguous: _broadcast_cases)
    assert fast_meta_kernel(aten.add.Tensor, (a, larger)) is None  # a larger second
    longs = torch.empty(4, 3, dtype=torch.long, device="meta")
    cat = aten.cat.default
    assert fast_meta_kernel(cat, ([longs, longs], 0)) is None  # integers: left to torch
    assert fast_meta_kernel(cat, ([a, torch.empty(0, device="meta")], 0)) is None  # a legacy empty tensor
    assert fast_meta_kernel(cat, ([a, a.double()], 0)) is None  # two dtypes: promoted
    assert fast_meta_kernel(cat, ([a, torch.empty(4, 2, device="meta")], 0)) is None  # sizes that differ
    image = torch.empty(1, 4, 6, 8, device="meta")
    last = image.contiguous(memory_format=torch.channels_last)
    assert fast_meta_kernel(cat, ([last, last], 1)) is None  # channels-last all: a channels-last output
    assert fast_meta_kernel(cat, ([last.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)] * 2, 1)) is None
    assert fast_meta_kernel(aten.embedding.default, (a, a)) is None  # float indices
    assert fast_meta_kernel(aten.add.Tensor, (longs, longs[:1])) is None  # integers broadcast: left to torch
    assert fast_meta_kernel(aten.mul.Tensor, (a, a.to(torch.bfloat16))) is None  # type promotion
    overlapping = torch.empty(6, device="meta").as_strided((2, 3), (1, 1))  # strides that tie (a view that is not
    assert fast_meta_kernel(aten.gelu.default, (overlapping,)) is None  # dense but ordered: _broadcast_cases)
    integers = torch.empty(4, 3, dtype=torch.long, device="meta")
    assert fast_meta_kernel(aten.relu.default, (integers,)) is None  # only floating point is verified
    assert fast_meta_kernel(aten.div.Tensor, (integers, integers)) is None  # a true division makes floats
    assert fast_meta_kernel(aten.pow.Tensor_Scalar, (a, 2j)) is None  # a complex scalar makes complex numbers
    assert fast_meta_kernel(aten.mul.Tensor, (a, 2j)) is None
    assert fast_meta_kernel(aten.sub.Tensor, (a, True)) is None  # torch refuses to subtract a bool
    # a number to the power of a tensor not contiguous: the CPU kernel's output is contiguous, the meta kernel's not
    assert fast_meta_kernel(aten.pow.Scalar, (2.0, a.t())) is None
    assert fast_meta_kernel(aten.pow.Scalar, (2.0, integers)) is None  # integers: promoted
    # broadcast, the second operand not contiguous, or the first smaller than the second
    assert fast_meta_kernel(aten.add.Tensor, (torch.empty(1, 3, 4, device="meta"), a.t().contiguous().t())) is None
    assert fast_meta_kernel(aten.add.Tensor, (torch.empty(3, device="meta"), torch.empty(2, device="meta"))) is None
    # a size-1 dimension with a stride of its own: torch's kernels disagree on the output's stride there (two such
    # tensors, contiguous both, make a contiguous output: checked in _lstm_cases)
    # two gates chunked off one product, each with a size-1 dimension whose stride ties with another's
    gate = torch.empty_strided((2, 1, 4), (12, 12, 1), device="meta")
    assert fast_meta_kernel(aten.mul.Tensor, (gate, gate)) is None
    for odd in (torch.empty(8, 1, device="meta").t(), torch.empty_strided((1, 8), (7, 1), device="meta")):
        assert fast_meta_kernel(aten.relu.default, (odd,)) is None
        assert fast_meta_kernel(aten.mul.Tensor, (odd, 0.5)) is None
    assert fast_meta_kernel(aten.div.Tensor, (integers, 2)) is None  # integers divided make floats
    assert fast_meta_kernel(aten.add.Tensor, (integers, 0.5)) is None  # an integer tensor and a float: promoted
    assert fast_meta_kernel(aten.addmm.default, (a, a, a)) is None  # shapes that do not multiply
    assert fast_meta_kernel(aten.mean.dim, (a.t(), [0])) is None  # not contiguous: left to torch
    assert fast_meta_kernel(aten.mean.dim, (a, [2])) is None  # no such dimension: torch's error
    mean = fast_meta_kernel(aten.mean.dim, (a, [1]))
    assert mean is not None
    with pytest.raises(RuntimeError) as refused:  # an integer dtype asked of a mean: refused as torch refuses it
        aten.mean.dim(torch.ones(2, 3), [1], dtype=torch.int64)
    with pytest.raises(RuntimeError, match=re.escape(str(refused.value).split(" Got:")[0])):
        mean(a, [1], dtype=torch.int64)
    image, weight = torch.empty(1, 4, 8, 8, device="meta"), torch.empty(6, 4, 3, 3, device="meta")
    geometry = ([1, 1], [1, 1], [1, 1])
    conv = aten.convolution.default
    assert fast_meta_kernel(conv, (image, weight, None, *geometry, False, [0, 0], 1)) is not None
    last = image.contiguous(memory_format=torch.channels_last)
    assert fast_meta_kernel(conv, (last, weight, None, *geometry, False, [0, 0], 1)) is None  # the kernels' choice
    assert fast_meta_kernel(conv, (image, weight, None, *geometry, True, [0, 0], 1)) is None  # transposed
    assert fast_meta_kernel(conv, (image, weight.half(), None, *geometry, False, [0, 0], 1)) is None  # two dtypes
    assert fast_meta_kernel(conv, (image, weight, None, [0, 0], [1, 1], [1, 1], False, [0, 0], 1)) is None
    assert fast_meta_kernel(conv, (image[:, :, :1, :1], weight, None, [1, 1], [0, 0], [1, 1], False, [0, 0],
                                   1)) is None  # an empty output: torch's error
    assert fast_meta_kernel(aten.native_layer_norm.default, (a, [4], None, None, 1e-5)) is None
    channels_last = torch.empty(2, 3, 4, 5, device="meta").to(memory_format=torch.channels_last)
    assert fast_meta_kernel(aten.roll.default, (channels_last, [1])) is None
    # in place: an integer tensor (a float result cannot be written to it), a tensor written twice (expanded),
    # an operand to broadcast or of another dtype, a scalar that is not a real number
    assert fast_meta_kernel(aten.sigmoid_.default, (integers,)) is None
    assert fast_meta_kernel(aten.tanh_.default, (torch.empty(3, device="meta").expand(4, 3),)) is None
    assert fast_meta_kernel(aten.add_.Tensor, (a, row)) is None
    assert fast_meta_kernel(aten.mul_.Tensor, (a, a.to(torch.float64))) is None
    assert fast_meta_kernel(aten.mul_.Tensor, (a, 2j)) is None
    assert fast_meta_kernel(aten.clamp_.default, (a, None, 1.0)) is None
    # two operands of one shape, one of them neither contiguous nor of the other's layout, the first with a size-1
    # dimension (its layout does not decide the output's alone)
    first = torch.empty(3, 1, 4, device="meta").permute(2, 1, 0)
    assert fast_meta_kernel(aten.mul.Tensor, (first, torch.empty(4, 1, 3, device="meta"))) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_flash_attention_matches_its_meta_kernel(dtype: torch.dtype) -> None:
    """On the meta device and standing for the CPU alike: the recording has always taken the meta kernel's layout
    (the CPU kernel's attention is position-major whatever the query's layout; the bytes are the same)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    contiguous = torch.empty(2, 3, 5, 4, dtype=dtype, device="meta")
    heads_inside = torch.empty(2, 5, 3, 4, dtype=dtype, device="meta").transpose(1, 2)
    keys = torch.empty(2, 3, 7, 4, dtype=dtype, device="meta")
    for q, k, extra in ((contiguous, contiguous, {}), (heads_inside, heads_inside, {"is_causal": True}),
                        (contiguous, keys, {"scale": 0.5}), (heads_inside, keys, {})):
        fast = fast_meta_kernel(flash, (q, k, k, 0.0))
        assert fast is not None
        expected = _metadata(flash(q, k, k, 0.0, **extra))
        assert _metadata(fast(q, k, k, 0.0, **extra)) == expected
        with meta_stands_for("cpu"):
            assert _metadata(fast(q, k, k, 0.0, **extra)) == expected
    third = torch.empty(1, 7, 3 * 12, dtype=dtype, device="meta")[..., 12:24].view(1, 7, 3, 4).transpose(1, 2)
    for q in (third, third[:, :, :5]):  # views that are not dense: one third of a fused projection
        fast = fast_meta_kernel(flash, (q, q, q, 0.0, True))
        assert fast is not None
        assert _metadata(fast(q, q, q, 0.0, True)) == _metadata(flash(q, q, q, 0.0, True))
    tied = torch.empty(2, 3, 5, 4, dtype=dtype, device="meta").as_strided((2, 3, 5, 4), (60, 4, 4, 1))
    assert fast_meta_kernel(flash, (tied, tied, tied, 0.0)) is None  # two equal strides, not dense


_ARANGES = {1: torch.ops.aten.arange.default, 2: torch.ops.aten.arange.start, 3: torch.ops.aten.arange.start_step}


def _arange_metadata(args: tuple[int, ...], dtype: torch.dtype | None) -> None:
    """The direct ``arange`` on meta gives torch's meta kernel's and the CPU kernel's metadata."""
    op = _ARANGES[len(args)]
    fast = fast_meta_kernel(op, args)
    assert fast is not None, args
    got = _metadata(fast(*args, dtype=dtype, device=torch.device("meta")))
    assert got == _metadata(op(*args, dtype=dtype, device="meta")) == _metadata(op(*args, dtype=dtype)), (args, dtype)


@pytest.mark.parametrize("dtype", [None, torch.int64, torch.int32, torch.float32, torch.float16, torch.bfloat16,
                                   torch.float64])
def test_arange_matches_torch_on_meta_and_on_the_cpu(dtype: torch.dtype | None) -> None:
    for args in ((5,), (0,), (1,), (2, 9), (9, 9), (-4, 3), (0, 64, 2), (0, 63, 2), (1, 2, 5), (10, 0, -3),
                 (10, -1, -1), (0, 0, 7), (-7, -2, 3)):
        _arange_metadata(args, dtype)


@settings(max_examples=200, deadline=None)
@given(st.integers(-50, 50), st.integers(-50, 50), st.integers(-9, 9).filter(bool))
def test_arange_of_random_bounds_matches_torch(start: int, end: int, step: int) -> None:
    if (end - start) * step >= 0:
        _arange_metadata((start, end, step), None)


def test_arange_keeps_torchs_kernel_where_not_verified() -> None:
    aten = torch.ops.aten
    assert fast_meta_kernel(aten.arange.default, (5.0,)) is None  # floats: counted in floating point by torch
    assert fast_meta_kernel(aten.arange.default, (True,)) is None
    assert fast_meta_kernel(aten.arange.start_step, (0, 5, 0)) is None  # torch's error
    assert fast_meta_kernel(aten.arange.start_step, (0, 5, -1)) is None  # a step away from the end: torch's error
    fast = fast_meta_kernel(aten.arange.default, (5,))
    assert fast is not None
    assert fast(5).device.type == "cpu" and fast(5).tolist() == [0, 1, 2, 3, 4]  # not on meta: torch's kernel
    assert fast(5, dtype=torch.bool, device="meta").dtype == torch.bool  # a dtype not verified: torch's kernel
    with pytest.raises(RuntimeError):  # a layout arange cannot make: refused as torch refuses it
        fast(5, device="meta", layout=torch.sparse_coo)


def test_training_kernels_decline_what_they_do_not_know() -> None:
    aten = torch.ops.aten
    a, integers = torch.empty(4, 3, device="meta"), torch.empty(4, 3, dtype=torch.long, device="meta")
    odd = torch.empty(8, 1, device="meta").t()  # a size-1 dimension with a stride of its own
    assert fast_meta_kernel(aten.ones_like.default, (odd,)) is None
    last = torch.empty(2, 3, 4, 5, device="meta").to(memory_format=torch.channels_last)
    for dim in range(5):  # the output keeps the pieces' order of dimensions: left to torch
        assert fast_meta_kernel(aten.stack.default, ([last, last], dim)) is None
    summed = torch.empty((), device="meta").expand(4, 3)  # a sum's gradient beside a tensor that is not contiguous
    assert fast_meta_kernel(aten.tanh_backward.default, (summed, a.t().contiguous().t())) is None
    assert fast_meta_kernel(aten.ones_like.default, (torch.empty(1, 3, device="meta").expand(4, 3),)) is None
    assert fast_meta_kernel(aten.mul.Scalar, (integers, 2)) is None  # integers: left to torch's promotion
    assert fast_meta_kernel(aten.div.Scalar, (a, True)) is None
    assert fast_meta_kernel(aten.mul.Scalar, (a[:, ::2], 2)) is None  # neither dense nor expanded
    transposed_expanded = torch.empty(4, 2, device="meta").t()[..., None].expand(2, 4, 3)
    assert fast_meta_kernel(aten.mul.Scalar, (transposed_expanded, 2)) is None
    assert fast_meta_kernel(aten.mm.default, (integers, integers.t())) is None
    assert fast_meta_kernel(aten.mm.default, (a, a)) is None  # shapes that do not multiply
    assert fast_meta_kernel(aten.mm.default, (a, a.t().double())) is None
    assert fast_meta_kernel(aten.bmm.default, (a.view(1, 4, 3), a.view(1, 4, 3))) is None
    assert fast_meta_kernel(aten.sum.dim_IntList, (integers, [0])) is None  # an integer sum is an int64 one
    assert fast_meta_kernel(aten.sum.dim_IntList, (a, [2])) is None  # no such dimension: torch's error
    assert fast_meta_kernel(aten.threshold_backward.default, (a, a.double(), 0)) is None
    assert fast_meta_kernel(aten.threshold_backward.default, (a, a.t().contiguous().t(), 0)) is None
    x = torch.empty(2, 3, 4, 5, device="meta")
    stats = [torch.empty(3, device="meta")] * 4
    batch_norm = aten.native_batch_norm_backward.default
    assert fast_meta_kernel(batch_norm, (x, x, None, *stats, True, 1e-5, [True] * 3)) is not None
    assert fast_meta_kernel(batch_norm, (x.transpose(2, 3), x.transpose(2, 3), None, *stats, True, 1e-5,
                                         [True] * 3)) is None  # neither contiguous nor channels-last
    assert fast_meta_kernel(batch_norm, (x, x, torch.empty(3, dtype=torch.float64, device="meta"), *stats, True,
                                         1e-5, [True] * 3)) is None  # a weight of another dtype
    layer_norm = aten.native_layer_norm_backward.default
    y, w, m = torch.empty(2, 5, 8, device="meta"), torch.empty(8, device="meta"), torch.empty(2, 5, 1, device="meta")
    assert fast_meta_kernel(layer_norm, (y, y, [8], m, m, w, w, [True] * 3)) is not None
    transposed = torch.empty(5, 2, 8, device="meta").transpose(0, 1)
    # torch's meta kernel keeps such layouts in some cases, not in others: left to it
    assert fast_meta_kernel(layer_norm, (transposed, y, [8], m, m, w, w, [True] * 3)) is None
    assert fast_meta_kernel(layer_norm, (y, transposed, [8], m, m, w, w, [True] * 3)) is None
    assert fast_meta_kernel(layer_norm, (y, y, [8], m, m, None, None, [True] * 3)) is None  # no weight to derive
    image, weight = torch.empty(1, 4, 8, 8, device="meta"), torch.empty(6, 4, 3, 3, device="meta")
    conv = aten.convolution_backward.default
    geometry = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert fast_meta_kernel(conv, (torch.empty(1, 6, 8, 8, device="meta"), image, weight, [0], *geometry,
                                   [True] * 3)) is not None
    assert fast_meta_kernel(conv, (torch.empty(1, 6, 7, 7, device="meta"), image, weight, [0], *geometry,
                                   [True] * 3)) is None  # a gradient of another shape than the output's
    last = image.contiguous(memory_format=torch.channels_last)
    assert fast_meta_kernel(conv, (torch.empty(1, 6, 8, 8, device="meta"), last, weight, [0], *geometry,
                                   [True] * 3)) is None
    pool = aten.max_pool2d_with_indices.default
    assert fast_meta_kernel(pool, (image, [3, 3])) is not None
    assert fast_meta_kernel(pool, (last, [3, 3])) is None  # channels-last: left to torch
    assert fast_meta_kernel(pool, (image, [3])) is None  # one size for both: left to torch
    assert fast_meta_kernel(pool, (image, [2, 2], [2, 2], [2, 2])) is None  # padding over half the window
    assert fast_meta_kernel(pool, (image[:, :, :2, :2], [3, 3], [1, 1], [0, 0])) is None  # an empty output


def test_the_dense_layout_test_is_torchs() -> None:
    """``_dense`` (written so as not to import sympy) answers as torch's own test on many layouts."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    from modelmeter.engine.meta_kernels import _dense

    base = torch.empty(2, 3, 4, 5, device="meta")
    tensors = [base, base[:, :, :1], torch.empty(0, 3, device="meta"), torch.empty(1, 1, 1, device="meta"),
               torch.empty(5, device="meta")[::2], torch.empty(3, device="meta").expand(4, 3),
               torch.empty(2, 1, 3, device="meta").expand(2, 4, 3), base[:, ::2], base[..., 1:],
               torch.empty_strided((2, 3), (1, 1), device="meta"), torch.empty_strided((2, 1, 3), (3, 7, 1),
                                                                                      device="meta")]
    tensors += [base.permute(*order) for order in itertools.permutations(range(4))]
    tensors += [base.permute(*order)[:, :1] for order in itertools.permutations(range(4))]
    for t in tensors:
        assert _dense(t) == bool(is_non_overlapping_and_dense_or_false(t)), (t.shape, t.stride())


def _training_models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    mlp = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 32), nn.Tanh(), nn.LayerNorm(32), nn.Dropout(0.1),
                        nn.Linear(32, 32), nn.Sigmoid(), nn.Linear(32, 32), nn.GELU("tanh"), nn.Linear(32, 4))
    cnn = nn.Sequential(nn.Conv1d(3, 6, 3, padding=1), nn.BatchNorm1d(6), nn.ReLU(), nn.Conv1d(6, 6, 3, groups=2),
                        nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(6, 2))
    return {"resnet": (small_resnet(), torch.randn(2, 3, 32, 32)),
            "resnet in eval mode": (small_resnet().eval(), torch.randn(2, 3, 32, 32)),
            "mlp": (mlp, torch.randn(4, 16)), "1-d cnn": (cnn, torch.randn(2, 3, 12)),
            "transformer encoder layer": (nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
                                          torch.randn(2, 5, 32)),
            "transformer encoder layer, norm first, gelu": (
                nn.TransformerEncoderLayer(32, 4, 64, activation="gelu", norm_first=True), torch.randn(5, 2, 32)),
            "bfloat16 mlp": (nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.bfloat16),
                             torch.randn(3, 8, dtype=torch.bfloat16)),
            **{name: (get_model(name, device="cpu"), torch.randint(0, 100, (1, 16)))
               for name in ("gpt2_tiny", "bert_tiny", "llama2_tiny")},
            "mobilenet_v2": (get_model("mobilenet_v2", device="cpu"), torch.randn(1, 3, 64, 64))}


@pytest.mark.parametrize("name", list(_training_models()))
def test_a_training_step_on_meta_stand_ins_records_what_real_kernels_record(name: str) -> None:
    """A CPU model's training step runs on meta stand-ins, through the direct kernels: its trace — every operator's
    inputs and outputs, every storage's life — is the one its run on the CPU's real kernels records."""
    model, x = _training_models()[name]
    options: dict[str, Any] = {"backward": True, "memory": True, "optimizer": "adamw", "quiet": True}
    meta, real = analyze(model, x, **options).trace, analyze(model, x, execution="real", **options).trace
    assert (meta.execution, real.execution, meta.assumptions) == ("fake", "real", [])
    assert [(e.op, e.inputs, e.outputs, e.kwargs) for e in meta.events] == \
        [(e.op, e.inputs, e.outputs, e.kwargs) for e in real.events]
    assert meta.storages == real.storages


# --- quantization: the output in the quantized dtype, as the CPU's ------------------------------------------------
def _quantize_calls(x: torch.Tensor) -> list[tuple[object, tuple[object, ...]]]:
    channels = x.shape[0]
    per_channel = (torch.ones(channels), torch.zeros(channels, dtype=torch.long), 0)
    return [(torch.ops.aten.quantize_per_tensor.default, (x, 0.1, 3, torch.quint8)),
            (torch.ops.aten.quantize_per_tensor.default, (x, 0.1, 0, torch.qint8)),
            (torch.ops.aten.quantize_per_tensor.default, (x, 0.1, 0, torch.qint32)),
            (torch.ops.aten.quantize_per_tensor.tensor_qparams, (x, torch.tensor(0.1), torch.tensor(0),
                                                                 torch.quint8)),
            (torch.ops.aten.quantize_per_channel.default, (x, *per_channel, torch.qint8)),
            (torch.ops.aten.quantize_per_tensor_dynamic.default, (x, torch.quint8, False))]


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("make", [lambda: torch.randn(2, 3, 4, 5),
                                  lambda: torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
                                  lambda: torch.randn(4, 6).t(), lambda: torch.randn(4, 6)[:, ::2]])
def test_quantization_on_meta_gives_the_cpus_dtype_and_layout(make: Any) -> None:
    """Oracle: the CPU's kernel — dtype, element size, shape and strides of each quantization's output (PyTorch's
    meta kernels give the input's float32)."""
    x = make()
    for op, args in _quantize_calls(x):
        real = op(*args)  # type: ignore[operator]
        meta = [a.to("meta") if isinstance(a, torch.Tensor) and a is x else a for a in args]
        kernel = fast_meta_kernel(op, tuple(meta))
        assert kernel is not None, op
        out = kernel(*meta)
        assert (out.dtype, out.element_size(), out.shape, out.stride()) == \
            (real.dtype, real.element_size(), real.shape, real.stride()), op


class Quantizes(nn.Module):
    """Quantizes its input (qint8), and with ``dequantize`` goes on in float through a linear layer."""

    def __init__(self, dequantize: bool) -> None:
        super().__init__()
        self.dequantize = dequantize
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.quantize_per_tensor(x, 0.1, 0, torch.qint8)
        return self.linear(q.dequantize()) if self.dequantize else q


def _dispatched(analysis: Any) -> list[tuple[str, list[object]]]:
    return [(e.op, [getattr(o, "dtype", None) for o in e.outputs]) for e in analysis.trace.events
            if e.level == "dispatch"]


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("dequantize", [False, True])
def test_a_quantizing_model_records_the_cpus_dtypes_and_memory(dequantize: bool) -> None:
    """A fake run (auto) records what the real run records: the quantized output's qint8 (one byte an element, not
    float32's four) and its memory; where later operators need the quantized tensor's values, the run falls back
    to real kernels."""
    model, x = Quantizes(dequantize).eval(), torch.randn(4, 8)
    auto = analyze(model, x, cache=False, memory=True)
    real = analyze(model, x, execution="real", cache=False, memory=True)
    assert _dispatched(auto) == _dispatched(real)
    assert ("aten::quantize_per_tensor", ["qint8"]) in _dispatched(auto)
    assert auto.memory.peak() == real.memory.peak() > 0
    assert (auto.trace.execution == "fake") is (not dequantize)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantizing_fake_tensors_is_refused_not_counted_in_float() -> None:
    model, x = Quantizes(False), torch.randn(4, 8)
    with torch.device("meta"):
        on_meta = Quantizes(True)
    with pytest.raises(ModelRunError, match="quantize_per_tensor makes a quantized tensor, which FakeTensors"):
        analyze(on_meta, torch.randn(4, 8, device="meta"), cache=False)
    assert ("aten::quantize_per_tensor", ["qint8"]) in _dispatched(analyze(model, x, execution="fake", cache=False))
