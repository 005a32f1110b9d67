"""The ``bytes`` metric: memory traffic per kernel (handles/traffic.py, metrics/traffic.py::count_bytes).

Oracles, none of which calls the rules under test:

* hand counts on small shapes, one per family (documented in docs/handles.md, "Bytes (memory traffic)");
* :class:`RealBytes`, a dispatch mode of its own that, on a real run, sums per aten operator the bytes of the real
  input and output tensors, a stride-0 dimension once (read from ``Tensor.stride()``): the generic rule's
  definition, compared operator by operator where the definitions agree, and each documented difference
  (gathers, overwrites, fused attention, ``.out`` forms) checked against it on its own;
* torch's own ``dtype.itemsize`` for the element sizes.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from math import prod
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model_helpers import FusedSelfAttention
from modelmeter.engine.metadata import dtype_name, flat_outputs, place_arguments, tensor_meta
from modelmeter.engine.serialize import dumps, loads
from modelmeter.engine.spec import RunSpec
from modelmeter.engine.trace import Trace
from modelmeter.engine.tracer import record_trace
from modelmeter.handles.classify import Classifier
from modelmeter.handles.sizes import ITEMSIZE, itemsize, tensor_bytes
from modelmeter.handles.traffic import METADATA_OPS, kernel_bytes, traffic_table
from modelmeter.metrics.traffic import count_bytes

F32 = 4
SDPA, SDPA_BACKWARD = "scaled_dot_product_attention", "scaled_dot_product_attention_backward"


# --- the independent oracle ---------------------------------------------------------------------
def real_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a real tensor's memory that its elements address: a stride-0 dimension once."""
    if tensor.numel() == 0:
        return 0
    distinct = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride != 0:
            distinct *= size
    return distinct * tensor.element_size()


class RealBytes(TorchDispatchMode):
    """Per aten operator (short name), the bytes of every real tensor it took and returned."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.inside: str | None = None  # the key every operator is counted under, when set (attention_calls)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.inside is not None and _aliases(func):
            return out  # a view inside a call (detaching what autograd saves) moves nothing
        tensors = [t for t in tree_leaves((args, kwargs or {}, out)) if isinstance(t, torch.Tensor)]
        self.by_op[self.inside or func._opname] += sum(real_bytes(t) for t in tensors)
        return out


def _aliases(func: Any) -> bool:
    """Whether the schema of ``func`` says its result is a view of an argument (not written in place)."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def oracle(model: nn.Module, *args: Any, backward: bool = False) -> Counter[str]:
    """RealBytes of ``model(*args)`` (and of the backward pass of the sum of its output, the loss itself not)."""
    counter = RealBytes()
    with counter:
        out = model(*args)
    if backward:
        loss = out.sum()
        with counter:
            loss.backward()
    return counter.by_op


@contextmanager
def attention_calls(counter: RealBytes) -> Iterator[None]:
    """Inside ``F.scaled_dot_product_attention`` (patched: models and ``F.multi_head_attention_forward`` look it
    up when they call it), every operator ``counter`` sees is counted under its name: what the call ran for a mask,
    and the kernel, are the call's (the backward kernel runs outside it)."""
    original = F.scaled_dot_product_attention

    def call(*args: Any, **kwargs: Any) -> Any:
        counter.inside = SDPA
        try:
            return original(*args, **kwargs)
        finally:
            counter.inside = None

    with mock.patch.object(F, SDPA, call):
        yield


def grouped_oracle(model: nn.Module, *args: Any, backward: bool = False, **kwargs: Any) -> Counter[str]:
    """:func:`oracle`, what attention calls ran forward counted under ``scaled_dot_product_attention``, the backward
    pass that of the default loss (the sum of the floating-point outputs that require grad), ``kwargs`` passed."""
    counter = RealBytes()
    with attention_calls(counter), counter:
        out = model(*args, **kwargs)
    if backward:
        parts = [t.sum() for t in tree_leaves(out)
                 if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
        loss = sum(parts[1:], parts[0])
        with counter:
            loss.backward()
    return counter.by_op


# --- helpers ------------------------------------------------------------------------------------
def trace_of(model: nn.Module, *args: Any, backward: bool = False, execution: str = "fake") -> Trace:
    return record_trace(RunSpec(model, args, execution=execution, backward=backward))  # type: ignore[arg-type]


def bytes_of(model: nn.Module, *args: Any, kernel: str = "fused", **options: Any) -> dict[str, int]:
    """Bytes per operator key of the whole model (all phases)."""
    return dict(count_bytes(trace_of(model, *args, **options), attention_kernel=kernel).counts.get("", {}))


class Fn(nn.Module):
    """A module running ``fn`` on its inputs."""

    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


# --- element sizes and footprints ---------------------------------------------------------------
def test_item_sizes_are_torchs_for_every_dtype() -> None:
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert {dtype_name(d): d.itemsize for d in dtypes} == ITEMSIZE
    with pytest.raises(ValueError, match="float99"):
        itemsize("float99")


def test_footprint_counts_a_broadcast_dimension_once() -> None:
    assert tensor_meta(r(5).expand(4, 5)).footprint == 5
    assert tensor_meta(r(4, 1, 5).expand(4, 3, 5)).footprint == 20
    assert tensor_meta(torch.tensor(2.0).expand(3, 4)).footprint == 1
    assert tensor_meta(r(4, 5)).footprint is None
    assert tensor_meta(r(4, 5).t()).footprint is None  # strided, but every element distinct
    assert tensor_meta(r(5).as_strided((1, 5), (0, 1))).footprint is None  # a stride 0 over one element
    assert tensor_meta(r(0, 5).expand(0, 5)).footprint is None
    # equal shapes, one broadcast: two descriptions (the cache of descriptions keys the footprint)
    assert tensor_meta(r(5).expand(4, 5)) != tensor_meta(r(4, 5))
    assert tensor_bytes(tensor_meta(r(5).expand(4, 5))) == 5 * F32
    assert tensor_bytes(tensor_meta(r(4, 5).half())) == 20 * 2


def test_footprint_survives_serialisation() -> None:
    trace = trace_of(Fn(lambda x, b: x * b.expand(4, 5)), r(4, 5), r(5))
    again = loads(dumps(trace))
    footprints = [m.footprint for e in again.events for m in e.inputs if hasattr(m, "footprint")]
    assert 5 in footprints
    assert count_bytes(again).counts == count_bytes(trace).counts


def test_a_trace_of_the_previous_format_is_refused_with_a_clear_error() -> None:
    from modelmeter.engine.serialize import trace_from_dict, trace_to_dict

    data = trace_to_dict(trace_of(Fn(torch.relu), r(2)))
    data["version"] = 2
    with pytest.raises(ValueError, match="trace format version 2.*older modelmeter"):
        trace_from_dict(data)


def test_a_saved_trace_of_the_previous_format_is_a_clear_saved_trace_error(tmp_path: Path) -> None:
    from modelmeter import SavedTraceError, analyze, load_trace, save_trace

    path = tmp_path / "old.mmtrace"
    save_trace(analyze(nn.Linear(3, 2), r(1, 3)), path)
    data = json.loads(gzip.decompress(path.read_bytes()))
    data["trace"]["version"] = 2  # what a modelmeter before TensorMeta.footprint wrote
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    with pytest.raises(SavedTraceError, match="old.mmtrace.*trace format version 2.*older modelmeter"):
        load_trace(path)


# --- hand counts, one per family ----------------------------------------------------------------
def test_linear_is_its_addmm() -> None:
    # addmm: bias 4, input 2x8, weight 8x4 (a view of 4x8) read; output 2x4 written
    assert bytes_of(nn.Linear(8, 4), r(2, 8)) == {"addmm": (4 + 16 + 32 + 8) * F32}


def test_convolution() -> None:
    # input 1x3x8x8, weight 4x3x3x3, bias 4 read; output 1x4x6x6 written
    assert bytes_of(nn.Conv2d(3, 4, 3), r(1, 3, 8, 8)) == {"convolution": (192 + 108 + 4 + 144) * F32}


def test_bmm_and_elementwise() -> None:
    assert bytes_of(Fn(torch.bmm), r(2, 3, 4), r(2, 4, 5)) == {"bmm": (24 + 40 + 30) * F32}
    assert bytes_of(Fn(torch.mul), r(4, 5), r(4, 5)) == {"mul": 60 * F32}
    assert bytes_of(Fn(F.gelu), r(4, 5).half()) == {"gelu": 40 * 2}


def test_in_place_reads_and_writes_its_target() -> None:
    def add_in_place(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.clone().add_(y)

    assert bytes_of(Fn(add_in_place), r(4, 5), r(4, 5)) == {"clone": 40 * F32, "add_": 60 * F32}


def test_broadcasts_read_once() -> None:
    # expanded (stride 0): the 5 elements of b, not 20; expand itself is a view
    assert bytes_of(Fn(lambda x, b: x * b.expand(4, 5)), r(4, 5), r(5)) == {"mul": (20 + 5 + 20) * F32}
    # a plain broadcasting add: b is 5 elements as it is
    assert bytes_of(Fn(torch.add), r(4, 5), r(5)) == {"add": (20 + 5 + 20) * F32}
    # a scalar expanded to a shape, then copied: one element read
    assert bytes_of(Fn(lambda s: s.expand(3, 4).contiguous()), torch.tensor(2.0)) == {"clone": (1 + 12) * F32}


def test_reductions_softmax_layer_norm_cat() -> None:
    assert bytes_of(Fn(lambda x: x.sum(1)), r(4, 5)) == {"sum": (20 + 4) * F32}
    assert bytes_of(Fn(lambda x: x.softmax(-1)), r(4, 5)) == {"_softmax": 40 * F32}
    # input, weight and bias read; output, mean and rstd (one per row) written
    assert bytes_of(nn.LayerNorm(5), r(4, 5)) == {"native_layer_norm": (20 + 5 + 5 + 20 + 4 + 4) * F32}
    assert bytes_of(Fn(lambda a, b: torch.cat([a, b])), r(2, 3), r(4, 3)) == {"cat": (6 + 12 + 18) * F32}


def test_views_and_allocations_are_free() -> None:
    def shapes(x: torch.Tensor) -> torch.Tensor:
        return x.view(5, 4).t().transpose(0, 1).unsqueeze(0)[0, :2]

    assert bytes_of(Fn(shapes), r(4, 5)) == {}
    assert bytes_of(Fn(torch.empty_like), r(4, 5)) == {}


def test_overwriting_operators_do_not_read_their_target() -> None:
    def copy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y.clone().copy_(x)

    assert bytes_of(Fn(copy), r(4, 5), r(4, 5)) == {"clone": 40 * F32, "copy_": 40 * F32}
    for fill in (lambda y: y.fill_(3.0), lambda y: y.zero_(), lambda y: y.uniform_(), lambda y: y.bernoulli_(0.5),
                 torch.zeros_like, torch.ones_like, lambda y: torch.full_like(y, 2.0), lambda y: y.new_zeros(4, 5)):
        counts = bytes_of(Fn(fill), r(4, 5))
        assert sum(counts.values()) == 20 * F32, counts


def test_gathers_read_the_index_and_what_they_select() -> None:
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    # embedding: 6 int64 indices; 6 rows of 8 selected; 6x8 written — not the 100x8 table
    assert bytes_of(nn.Embedding(100, 8), idx) == {"embedding": 6 * 8 + 2 * 48 * F32}
    index = torch.tensor([0, 3, 7])
    selected = 2 * 15 * F32 + 3 * 8
    assert bytes_of(Fn(lambda x, i: x.index_select(0, i)), r(10, 5), index) == {"index_select": selected}
    assert bytes_of(Fn(lambda x, i: x[i]), r(10, 5), index) == {"index": selected}
    assert bytes_of(Fn(lambda x, i: torch.gather(x, 0, i)), r(10, 5), idx[:, :2].contiguous()) == \
        {"gather": 4 * 8 + 2 * 4 * F32}
    # a slice by Python indexing is a view
    assert bytes_of(Fn(lambda x: x[2:5]), r(10, 5)) == {}


def test_in_place_scatters_touch_the_selected_part() -> None:
    index = torch.tensor([0, 3, 7])

    def put(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[i] = v
        return y

    # 3 rows of 5 read and written, 3 int64 indices and the 3x5 values read
    counts = bytes_of(Fn(put), r(10, 5), index, r(3, 5))
    assert counts["index_put_"] == 2 * 15 * F32 + 3 * 8 + 15 * F32
    # a boolean mask: every element it covers (its true count is unknown without values)
    mask = torch.zeros(10, dtype=torch.bool)
    assert bytes_of(Fn(put), r(10, 5), mask, torch.tensor(1.0))["index_put_"] == 2 * 50 * F32 + 10 + F32

    def scatter(x: torch.Tensor, i: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x.clone().scatter_add_(0, i, s)

    i2 = torch.tensor([[1, 2, 3, 4, 5], [0, 0, 0, 0, 0]])
    assert bytes_of(Fn(scatter), r(10, 5), i2, r(2, 5))["scatter_add_"] == 2 * 10 * F32 + 10 * 8 + 10 * F32

    def index_add(x: torch.Tensor, i: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x.clone().index_add_(0, i, s)

    assert bytes_of(Fn(index_add), r(10, 5), index, r(3, 5))["index_add_"] == 2 * 15 * F32 + 3 * 8 + 15 * F32


def put_at(x: torch.Tensor, *index_and_values: torch.Tensor) -> torch.Tensor:
    """``x[indices] = values``: an ``index_put_`` of a copy of ``x``."""
    *indices, values = index_and_values
    y = x.clone()
    y[tuple(indices)] = values
    return y


@pytest.mark.parametrize("index", [torch.tensor([], dtype=torch.long), torch.zeros(0, 3, dtype=torch.long)])
def test_an_empty_index_puts_nothing(index: torch.Tensor) -> None:
    """An empty integer index selects no element: its size 0 broadcast as a 1 counted a whole row (40, 120 bytes)."""
    values = torch.randn(*index.shape, 5)
    assert bytes_of(Fn(put_at), r(10, 5), index, values)["index_put_"] == 0


def test_a_mask_beside_an_integer_index_selects_as_many_as_the_index() -> None:
    """A mask over the rows beside an index of 3 columns selects 3 elements (torch pairs the mask's true rows with
    the columns, one each): the mask's 10 elements were taken as the bound of that dimension."""
    x, mask, columns = r(10, 5), torch.zeros(10, dtype=torch.bool), torch.tensor([0, 2, 4])
    mask[[1, 5, 7]] = True
    selected = x[mask, columns].numel()
    assert bytes_of(Fn(put_at), x, mask, columns, torch.tensor(1.0))["index_put_"] == \
        2 * selected * F32 + 10 + 3 * 8 + F32



def test_out_forms_do_not_read_what_they_write_into() -> None:
    def add_out(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        return torch.add(x, y, out=out)

    assert bytes_of(Fn(add_out), r(4, 5), r(4, 5), execution="real") == {"add": 60 * F32}


def test_foreach_in_place_writes_its_list() -> None:
    def foreach(x: torch.Tensor) -> torch.Tensor:
        tensors = [x.clone(), x.clone()]
        torch._foreach_mul_(tensors, 2.0)
        return tensors[0]

    assert bytes_of(Fn(foreach), r(4, 5), execution="real")["_foreach_mul_"] == 2 * 40 * F32


# --- attention ----------------------------------------------------------------------------------
class Sdpa(nn.Module):
    """Attention, its output squared: the gradient of its output is a full tensor (the sum's would be a broadcast
    scalar, which the real backward kernel reads once, as its stride-0 dimensions say)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out * out


def qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return r(1, 2, 4, 8).requires_grad_(), r(1, 2, 6, 8).requires_grad_(), r(1, 2, 6, 8).requires_grad_()


QKV_BYTES, OUT_BYTES, LSE_BYTES, SCORE_BYTES = (64 + 96 + 96) * F32, 64 * F32, 2 * 4 * F32, 2 * 4 * 6 * F32
MASK_BYTES = 4 * 6 * F32


def test_fused_attention_forward_and_backward() -> None:
    counts = bytes_of(Sdpa(), *qkv(), backward=True)
    assert counts[SDPA] == QKV_BYTES + OUT_BYTES + LSE_BYTES
    assert counts[SDPA_BACKWARD] == 2 * QKV_BYTES + 2 * OUT_BYTES + LSE_BYTES
    masked = bytes_of(Sdpa(), *qkv(), r(4, 6), backward=True)
    assert masked[SDPA] == counts[SDPA] + MASK_BYTES
    assert masked[SDPA_BACKWARD] == counts[SDPA_BACKWARD] + MASK_BYTES


def test_math_kernel_option_moves_the_scores() -> None:
    counts = bytes_of(Sdpa(), *qkv(), backward=True, kernel="math")
    assert counts[SDPA] == QKV_BYTES + OUT_BYTES + 4 * SCORE_BYTES
    assert counts[SDPA_BACKWARD] == 2 * QKV_BYTES + 2 * OUT_BYTES + 7 * SCORE_BYTES
    masked = bytes_of(Sdpa(), *qkv(), r(4, 6), kernel="math")
    assert masked[SDPA] == QKV_BYTES + OUT_BYTES + MASK_BYTES + 6 * SCORE_BYTES
    with pytest.raises(ValueError, match="attention_kernel"):
        traffic_table("flash")


def test_fused_attention_agrees_with_the_real_fused_kernel() -> None:
    """On the CPU's fused kernel, the real tensors it reads and writes are what the fused rule counts."""
    q, k, v = qkv()
    mask = r(4, 6)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        real = oracle(Sdpa(), q, k, v, mask, backward=True)
    ours = bytes_of(Sdpa(), q, k, v, mask, backward=True)
    assert ours[SDPA] == real["_scaled_dot_product_flash_attention_for_cpu"]
    assert ours[SDPA_BACKWARD] == real["_scaled_dot_product_flash_attention_for_cpu_backward"]


def test_fused_attention_moves_less_than_the_math_kernels_it_replaces() -> None:
    """The documented difference: the math path's operators (real run) move the L×S scores; fused does not."""
    q, k, v = qkv()
    with sdpa_kernel(SDPBackend.MATH):
        real = oracle(Sdpa(), q, k, v)
    free = Classifier()
    math_ops = sum(n for op, n in real.items() if not free.is_view(f"aten::{op}"))
    fused, math = bytes_of(Sdpa(), q, k, v)[SDPA], bytes_of(Sdpa(), q, k, v, kernel="math")[SDPA]
    assert fused < math <= math_ops
    assert math - fused == 4 * SCORE_BYTES - LSE_BYTES


def described(op: Any, *args: Any) -> tuple[list[Any], list[Any]]:
    """``op(*args)`` run for real, its arguments and results as the recorder describes them."""
    return place_arguments(op._schema, args, {}), flat_outputs(op(*args))


def test_attention_kernels_recorded_without_the_call() -> None:
    """A kernel called on its own: fused, what it really reads and writes (its log-sum-exp among its outputs); math,
    the math kernel's traffic for the same sizes."""
    q, k, v = (t.detach() for t in qkv())
    name = "aten::_scaled_dot_product_flash_attention_for_cpu"
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    forward = described(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v)
    backward = described(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                         torch.ones_like(out), q, k, v, out, lse, 0.0, False)
    fused, math = traffic_table(), traffic_table("math")
    assert fused[name](*forward) == Counter({SDPA: QKV_BYTES + OUT_BYTES + LSE_BYTES})
    assert fused[f"{name}_backward"](*backward) == Counter({SDPA_BACKWARD: 2 * QKV_BYTES + 2 * OUT_BYTES + LSE_BYTES})
    assert math[name](*forward) == Counter({SDPA: QKV_BYTES + OUT_BYTES + 4 * SCORE_BYTES})
    assert math[f"{name}_backward"](*backward) == \
        Counter({SDPA_BACKWARD: 2 * QKV_BYTES + 2 * OUT_BYTES + 7 * SCORE_BYTES})


def test_flex_attention_is_counted_as_a_fused_kernel() -> None:
    q, kv = tensor_meta(r(1, 2, 256, 32)), tensor_meta(r(1, 2, 512, 32))
    blocks = tensor_meta(torch.ones(1, 2, 2, dtype=torch.int32))
    indices = tensor_meta(torch.ones(1, 2, 2, 4, dtype=torch.int32))
    block_mask = [256, 512, blocks, indices, None, None, blocks, indices, None, None, 128, 128, "<function>"]
    handle = traffic_table()["aten::flex_attention"]
    read = (256 + 2 * 512) * 2 * 32 * F32 + 2 * (4 + 16) * 4  # Q, K, V; the block mask's tensors
    written = 2 * 256 * 32 * F32 + 2 * 256 * F32  # the output; the log-sum-exp
    assert handle([q, kv, kv, "<function>", block_mask, None], []) == Counter({"flex_attention": read + written})


def test_native_multi_head_attention_counts_its_projections() -> None:
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = r(1, 3, 8)
    with torch.no_grad():
        counts = bytes_of(FusedSelfAttention(mha), x)
    weights = (24 * 8 + 24 + 8 * 8 + 8) * F32
    # x read as query, key and value; the weights read; the output written (the weights output is empty)
    outer = 3 * 24 * F32 + weights + 24 * F32
    inner = 2 * (3 * 24 + 24) * F32 + 3 * 2 * F32  # projected q, k, v and the attention's output; the lse
    assert counts == {"_native_multi_head_attention": outer + inner}


# --- the generic rule against the oracle on random shapes ----------------------------------------
SHAPES = st.lists(st.integers(1, 5), min_size=1, max_size=3)


@settings(max_examples=25, deadline=None)
@given(shape=SHAPES, broadcast=st.integers(0, 2), expand=st.booleans())
def test_generic_rule_matches_the_oracle_on_random_shapes(shape: list[int], broadcast: int, expand: bool) -> None:
    """add (broadcasting), mul of an expanded tensor, a reduction, mm and cat: count_bytes of the fake trace equals
    the real tensors' bytes."""
    x = r(*shape)
    b = r(*shape[broadcast % len(shape):])
    m = r(shape[-1], 3)

    def ops(x: torch.Tensor, b: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        y = x + b
        z = x * (b.expand_as(x) if expand else b)
        s = z.sum(-1, keepdim=True)
        p = y.reshape(-1, shape[-1]) @ m
        return torch.cat([p, p]).sum() + s.sum()

    model = Fn(ops)
    real = oracle(model, x, b, m)
    ours = bytes_of(model, x, b, m)
    for op, count in ours.items():
        assert count == real[op], op


# --- real models against the oracle --------------------------------------------------------------
def assert_agrees(model: nn.Module, *args: Any, renamed: dict[str, str] | None = None) -> None:
    """Every operator the generic rule counts agrees with the oracle, forward and backward; ``renamed``: our key ->
    the oracle's operator it is compared with (fused attention, counted at the sdpa call, is its kernel)."""
    renamed = renamed or {}
    torch.manual_seed(0)
    ours = count_bytes(trace_of(model, *args, backward=True)).counts[""]
    real = oracle(model, *args, backward=True)
    table = {op.split("::")[-1] for op in traffic_table()} - set(renamed)
    free = Classifier()
    compared = 0
    for op, count in ours.items():
        if op not in table:
            assert count == real[renamed.get(op, op)], op
            compared += count
    for op in set(real) - set(ours) - set(renamed.values()):
        assert free.is_view(f"aten::{op}") or op in table, op  # nothing the oracle saw is missed
    assert compared > 0.9 * sum(ours.values())


@pytest.mark.slow
def test_resnet18_agrees_with_the_oracle() -> None:
    torchvision = pytest.importorskip("torchvision")
    assert_agrees(torchvision.models.resnet18(weights=None), r(1, 3, 64, 64))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_tiny", "llama2_tiny"])
def test_zoo_language_models_agree_with_the_oracle(name: str) -> None:
    from modelmeter.zoo.registry import ZOO

    fused = {SDPA: "_scaled_dot_product_flash_attention_for_cpu",
             SDPA_BACKWARD: "_scaled_dot_product_flash_attention_for_cpu_backward"}
    assert_agrees(ZOO[name].builder(), torch.randint(0, 100, (1, 16)), renamed=fused)


class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.norm = nn.Linear(16, 48), nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out * out  # a full gradient for the attention's output (see Sdpa)


def test_a_masked_attention_model_agrees_with_the_oracle() -> None:
    """Outside the attention call, every kernel agrees; the call is counted as its fused kernel is, mask included."""
    x, mask = r(2, 5, 16), r(5, 5)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        real = oracle(MaskedAttention(), x, mask, backward=True)
    ours = count_bytes(trace_of(MaskedAttention(), x, mask, backward=True)).counts[""]
    assert ours[SDPA] == real["_scaled_dot_product_flash_attention_for_cpu"]
    assert ours[SDPA_BACKWARD] == real["_scaled_dot_product_flash_attention_for_cpu_backward"]
    for op in ("addmm", "native_layer_norm", "native_layer_norm_backward", "mm", "sum", "clone"):
        assert ours[op] == real[op], op


def test_documented_differences_against_the_oracle() -> None:
    """Each difference on its own: gathers and overwrites count less than every argument's bytes, by exactly the
    part they do not touch; in-place operators and broadcasts agree with the oracle."""
    idx = torch.tensor([1, 2, 3])
    cases: list[tuple[Any, tuple[torch.Tensor, ...], str, int]] = [
        (nn.Embedding(100, 8), (idx,), "embedding", 100 * 8 * F32 - 3 * 8 * F32),  # the table: 3 rows of it
        (Fn(lambda x: x.index_select(0, idx)), (r(10, 5),), "index_select", 50 * F32 - 15 * F32),
        (Fn(lambda x: x.clone().fill_(1.0)), (r(4, 5),), "fill_", 20 * F32),  # the target is not read
        (Fn(lambda x: x.clone().copy_(x)), (r(4, 5),), "copy_", 20 * F32),
        (Fn(torch.zeros_like), (r(4, 5),), "zeros_like", 20 * F32),
        (Fn(lambda x: x.clone().add_(x)), (r(4, 5),), "add_", 0),  # in place: read and written, as the oracle
        (Fn(lambda x, b: x * b.expand(4, 5)), (r(4, 5), r(5)), "mul", 0),  # stride 0 read once, as the oracle
    ]
    for model, args, op, less in cases:
        real = oracle(model, *args)
        ours = bytes_of(model, *args)
        assert real[op] - ours[op] == less, op


def test_generic_rule_walks_lists() -> None:
    a, b = tensor_meta(r(2, 3)), tensor_meta(r(3))
    assert kernel_bytes([[a, b], None, 1], [a]) == (6 + 3 + 6) * F32


# --- selections never more than the tensor they select from --------------------------------------
def test_a_gather_larger_than_its_source_reads_the_source_once() -> None:
    """A small table gathered into a large result (relative position biases, a router's tokens): the source is read
    once, not once per selected element — never more than the oracle's every tensor once."""
    table, index = r(3, 4), torch.tensor([0, 1, 2, 1, 0, 2, 2, 1])
    expected = {"index": 8 * 8 + 12 * F32 + 32 * F32}  # the index; the 12-element table; the 8x4 result
    assert bytes_of(Fn(lambda t, i: t[i]), table, index) == expected
    assert expected["index"] == oracle(Fn(lambda t, i: t[i]), table, index)["index"]
    ids = torch.randint(0, 3, (2, 10))
    # embedding_bag, 20 indices: of a 3x4 table, the table once (12 elements); of a 100x4 one, 20 rows (80)
    small, large = bytes_of(nn.EmbeddingBag(3, 4), ids), bytes_of(nn.EmbeddingBag(100, 4), ids)
    assert large["embedding_bag"] - small["embedding_bag"] == (80 - 12) * F32


def test_an_in_place_scatter_of_many_elements_into_few_touches_each_once() -> None:
    """``scatter_add_`` of 40 elements into a 4-element histogram: the target read and written once (4, not 40),
    the index and the 40 source elements read."""
    def histogram(x: torch.Tensor, i: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x.clone().scatter_add_(0, i, s)

    index = torch.randint(0, 4, (40,))
    assert bytes_of(Fn(histogram), r(4), index, r(40))["scatter_add_"] == 2 * 4 * F32 + 40 * 8 + 40 * F32

    def put(x: torch.Tensor, i: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y.index_put_((i,), v, accumulate=True)
        return y

    assert bytes_of(Fn(put), r(4), index, r(40))["index_put_"] == 2 * 4 * F32 + 40 * 8 + 40 * F32


# --- a boolean attention mask is converted before the kernel -------------------------------------
class BoolMaskSdpa(Sdpa):
    """:class:`Sdpa` of the boolean mask ``mask`` expanded to ``shape`` (a broadcast made inside the model)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = shape

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        assert mask is not None
        return super().forward(q, k, v, mask.expand(self.shape))


# the mask, the shape it is expanded to, its distinct booleans
BOOL_MASKS = {"plain": ((4, 6), (4, 6), 24), "broadcast": ((1, 1, 1, 6), (1, 2, 4, 6), 6)}


@pytest.mark.parametrize("kind", list(BOOL_MASKS))
def test_a_boolean_mask_is_converted_then_read_by_the_kernel(kind: str) -> None:
    """The forward reads the boolean mask and two scalars and writes the additive float mask (every element, a
    broadcast one too); the kernels read that. Equal to the real flash kernel plus the conversion's operators."""
    shape, expanded, booleans = BOOL_MASKS[kind]
    mask = torch.rand(*shape) > 0.3
    q, k, v = qkv()
    converted = prod(expanded) * F32
    model = BoolMaskSdpa(expanded)
    counts = bytes_of(model, q, k, v, mask, backward=True)
    assert counts[SDPA] == QKV_BYTES + OUT_BYTES + LSE_BYTES + converted + booleans + 4 * F32 + converted
    assert counts[SDPA_BACKWARD] == 2 * QKV_BYTES + 2 * OUT_BYTES + LSE_BYTES + converted
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        real = grouped_oracle(model, q, k, v, mask, backward=True)
    assert counts[SDPA] == real[SDPA]
    assert counts[SDPA_BACKWARD] == real["_scaled_dot_product_flash_attention_for_cpu_backward"]


# --- a broad set of real architectures against the oracle ----------------------------------------
class Indexing(nn.Module):
    """Scatters, index updates, cumulative sums, sorts, selections, masks and a small table gathered large."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.table = nn.Linear(8, 8), nn.Parameter(torch.randn(3, 8))

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # 6 x 8
        z = y.clone()
        z[index] = y[:4]  # index_put_
        z = z.index_put((index,), y[:4], accumulate=True).scatter_add(0, index[:, None].expand(4, 8), y[:4])
        z = z.scatter(1, torch.zeros(6, 2, dtype=torch.long), 1.0) + y.cumsum(-1)
        top, picked = z.topk(3, -1)
        ordered, _ = z.sort(-1)
        w = torch.where(z > 0, z, ordered).masked_fill(z < -1, 0.0) + self.table[index[:, None].expand(4, 6) % 3].sum()
        return w.index_add(0, index, top.gather(1, picked.argsort(-1)).repeat(1, 3)[:4, :8] * 0 + y[:4]).sum(0)


def _vision(name: str) -> tuple[nn.Module, Any]:
    from families import TORCHVISION

    return TORCHVISION[name]()


def _narrow(name: str) -> tuple[nn.Module, Any]:
    """MobileNetV3-Small, EfficientNet-B0 and a RegNetY's layers (squeeze-excitation, hard-swish, stochastic
    depth, grouped convolutions), narrowed to keep the real runs short, on 32x32 images."""
    import torchvision
    from torchvision.models.efficientnet import EfficientNet, _efficientnet_conf
    from torchvision.models.regnet import BlockParams, RegNet

    if name == "mobilenet_v3_small":
        model: nn.Module = torchvision.models.mobilenet_v3_small(weights=None, width_mult=0.5, num_classes=10)
    elif name == "efficientnet_b0":
        blocks, _ = _efficientnet_conf("efficientnet_b0", width_mult=0.25, depth_mult=0.25)
        model = EfficientNet(blocks, 0.2, num_classes=10)
    else:
        params = BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
        model = RegNet(params, num_classes=10)
    return model, (r(2, 3, 32, 32),)


def _language(name: str) -> tuple[nn.Module, Any]:
    """A tiny transformers model in eval mode (no dropout: the CPU's fused attention kernel runs, as counted)."""
    from families import TRANSFORMERS

    model, inputs = TRANSFORMERS[name]()
    return model.eval(), inputs


def _t5() -> tuple[nn.Module, Any]:
    """T5, its relative position biases frozen: a bias that requires grad sends the real run to the math kernel."""
    model, inputs = _language("t5")
    for module in model.modules():
        if getattr(module, "has_relative_attention_bias", False):
            module.relative_attention_bias.requires_grad_(False)
    return model, inputs


def _torch(name: str) -> tuple[nn.Module, Any]:
    from families import TORCH

    return TORCH[name]()


BROAD: dict[str, Any] = {
    **{name: lambda name=name: _narrow(name) for name in ("mobilenet_v3_small", "efficientnet_b0", "regnet_y")},
    **{name: lambda name=name: _vision(name) for name in ("convnext", "swin")},
    **{name: lambda name=name: _language(name) for name in ("bert", "gpt2", "llama", "mistral", "mixtral")},
    "t5": _t5,
    **{name: lambda name=name: _torch(name) for name in ("recurrent", "embeddings", "upsampling")},
    "indexing": lambda: (Indexing(), (r(6, 8), torch.tensor([5, 0, 3, 1]))),
}
# Our operator key -> the oracle's: the fused backward kernel (forward: the call, grouped); an embedding bag,
# counted at the call, whose kernel is ``_embedding_bag``.
RENAMED = {SDPA_BACKWARD: "_scaled_dot_product_flash_attention_for_cpu_backward", "embedding_bag": "_embedding_bag"}


def assert_agrees_broadly(model: nn.Module, inputs: Any) -> None:
    """Forward and backward of the default loss, real kernels: every operator of the generic rule, and fused
    attention (the call and everything it ran for its mask), equal to the oracle; every other table entry (a
    documented difference: gathers, bags, scatters, overwrites, metadata) at most the oracle's every tensor once;
    no operator the oracle saw missing."""
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    torch.manual_seed(0)
    ours = count_bytes(record_trace(RunSpec.of(model, inputs, execution="real", backward=True))).counts[""]
    torch.manual_seed(0)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        real = grouped_oracle(model, *args, backward=True, **kwargs)
    table = {op.split("::")[-1] for op in traffic_table()}
    for op, count in ours.items():
        theirs = real[RENAMED.get(op, op)]
        if op in table and op not in (SDPA, SDPA_BACKWARD):
            assert count <= theirs, op
        else:
            assert count == theirs, op
    free = Classifier()
    for op in set(real) - set(ours) - set(RENAMED.values()):
        assert free.is_view(f"aten::{op}") or op in table, op


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BROAD))
def test_broad_architectures_agree_with_the_oracle(name: str) -> None:
    from modelmeter import analyze

    model, inputs = BROAD[name]()
    assert_agrees_broadly(model, inputs)
    # the default (fake) run and a whole analysis on a device count every operator without an error
    result = analyze(model, inputs, device="h100", backward=True).result()
    assert result.root.metrics["bytes"] > 0 and result.root.metrics["time"] > 0


def test_the_encoder_fast_path_is_counted_as_the_slow_path_the_run_records() -> None:
    """``nn.TransformerEncoder`` in eval mode under ``no_grad`` runs one fused operator per layer for real, which
    shows only its arguments and results; the recorder's modes turn the fast path off, so the trace holds the slow
    path's kernels (what the fused operator moves inside, its projections and feed-forward intermediates), each
    counted as the oracle counts them on the slow path: the documented difference, more than the fused operator's
    arguments and results."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = r(2, 5, 16)
    with torch.no_grad():
        ours = bytes_of(encoder, x)
        fast = oracle(encoder, x)
    assert set(fast) == {"_transformer_encoder_layer_fwd"}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        slow = grouped_oracle(encoder, x)  # grad enabled: the slow path runs for real
    free = Classifier()
    assert ours == {op: n for op, n in slow.items() if not free.is_view(f"aten::{op}") and op not in METADATA_OPS}
    assert sum(ours.values()) > fast["_transformer_encoder_layer_fwd"]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_tensor_is_counted_as_what_it_stores() -> None:
    """A sparse operand's footprint: its values and indices (in elements of its dtype), not its dense shape."""
    eye = torch.eye(100)
    coo, csr = eye.to_sparse(), eye.to_sparse_csr()
    assert tensor_meta(coo).footprint == (100 * F32 + 2 * 100 * 8) // F32  # 100 values, 2 x 100 int64 indices
    assert tensor_meta(csr).footprint == (100 * F32 + 101 * 8 + 100 * 8) // F32  # values, row pointers, columns
    fewer = torch.diag(torch.arange(100.0) % 2).to_sparse()  # the same shape and strides, 50 values stored
    assert tensor_meta(fewer).footprint == (50 * F32 + 2 * 50 * 8) // F32
    x = r(100, 5)
    counts = bytes_of(Fn(lambda s, x: torch.sparse.mm(s, x)), coo, x, execution="real")  # a meta copy stores none
    assert counts["_sparse_addmm"] == 3 * 500 * F32 + (100 * F32 + 2 * 100 * 8)  # zeros, x, out; the sparse matrix
