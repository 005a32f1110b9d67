"""Bytes a kernel moves: what it reads plus what it writes (docs/handles.md, "Bytes (memory traffic)").

The generic rule (:func:`kernel_bytes`, applied by :func:`kernel_rule` to every kernel without an entry): each tensor
argument is read once and each output written once, at its dtype, a broadcast (stride-0) dimension once
(:func:`tensor_bytes`). In-place operators read and write their target under it as they are (the target is an
argument and the result); ``.out`` forms do not read the tensors they write into, and in-place operators that
return nothing (``_foreach_add_``) write their first argument. :func:`traffic_table` holds the families whose bytes
differ: metadata operators (free), operators that overwrite their first argument without reading it (fills,
random fills, ``copy_``, ``*_like`` factories), gathers and in-place scatters (the selected elements only, at most
the whole tensor), fused attention (no score matrix; a boolean mask converted first), the native multi-head
attention fast path (its projections' intermediates), and collectives with FSDP2's copies (:mod:`.collectives`).
"""

from __future__ import annotations

from collections import Counter
from functools import cache
from typing import Any

from ..engine.shapes import broadcast_shape
from ..engine.trace import TensorMeta
from .attention import Attention, attention_sizes, check_attention_kernel, flex_attention_pairs
from .base import Handle, backward_key, prod, shape_of
from .binding import bind_all, by_name, out_arguments, out_arguments_vary
from .collectives import traffic as collective_traffic
from .sizes import all_bytes, elements, itemsize, tensor_bytes

# The log-sum-exp a fused attention kernel saves for its backward pass: one float32 per query row and head.
LSE_ITEMSIZE = 4


def kernel_bytes(inputs: list[Any], outputs: list[Any]) -> int:
    """The generic rule: every tensor input read once, every output written once."""
    return all_bytes(inputs) + all_bytes(outputs)


@cache
def kernel_rule(op: str) -> Handle:
    """The generic rule for kernel ``op`` (``"aten::add"``), the fallback of the bytes metric: :func:`kernel_bytes`,
    except that the tensors a call of an ``.out`` form writes into are not read, and that an in-place operator
    that returns nothing (``_foreach_mul_``) writes its first argument."""
    return _KernelRule(op, "")


class _KernelRule:
    """:func:`kernel_rule` of one operator, for calls ``overload`` placed ("": told by what they placed)."""

    __doc__ = kernel_rule.__doc__

    def __init__(self, op: str, overload: str) -> None:
        self.op, self.overload = op, overload
        self.in_place = op.endswith("_") and not op.endswith("__")
        # the out arguments, by the number of arguments a call placed; None where that number does not tell (where
        # the call placed tensors does: out_arguments_vary)
        self.out_forms: dict[int, tuple[int, ...] | None] = {}
        self.at: dict[str, _KernelRule] = {}

    def at_overload(self, overload: str) -> _KernelRule:
        """This rule for the calls ``overload`` placed (binding.at_overload)."""
        found = self.at.get(overload)
        if found is None:
            found = self.at[overload] = _KernelRule(self.op, overload)
        return found

    def __call__(self, inputs: list[Any], outputs: list[Any]) -> int:
        given, op = len(inputs), self.op
        if given not in self.out_forms:
            varies = out_arguments_vary(op, given) and not self.overload
            self.out_forms[given] = None if varies else out_arguments(op, inputs, self.overload)
        written = self.out_forms[given]
        if written is None:
            written = out_arguments(op, inputs)
        if written:
            read = all_bytes([value for i, value in enumerate(inputs) if i not in written])
            return read + all_bytes(outputs)
        total = kernel_bytes(inputs, outputs)
        if self.in_place and inputs and not any(isinstance(value, TensorMeta) for value in outputs):
            total += all_bytes(inputs[:1])
        return total


# --- families -----------------------------------------------------------------------------------
def overwrites_first(inputs: list[Any], outputs: list[Any]) -> int:
    """The first argument is overwritten (or only its shape is used), never read; the other tensor arguments are
    read and the result written: fills, random fills, ``copy_`` (its source read), ``*_like`` and ``new_*``
    factories."""
    return all_bytes(inputs[1:]) + all_bytes(outputs)


def gather_bytes(inputs: list[Any], outputs: list[Any]) -> int:
    """A gather (the source first): the index and the elements it selects (the result's size, at the source's
    dtype) read, the result written; not the whole source."""
    source, result = inputs[0], outputs[0]
    return all_bytes(inputs[1:]) + _selected(source, elements(result)) + all_bytes(outputs)


def _selected(tensor: Any, count: int) -> int:
    """Bytes of ``count`` elements selected from ``tensor``: at most the whole tensor, as an index that repeats
    an element (a small table gathered into a large result) moves it once."""
    return min(count, elements(tensor)) * itemsize(tensor.dtype)


@by_name
def embedding_bag_bytes(weight: Any, indices: Any, offsets: Any, per_sample_weights: Any = None, *,
                        outputs: list[Any]) -> int:
    """``embedding_bag``: one row of the table read per index, the indices, offsets and weights read, the bags
    (and the bookkeeping outputs) written."""
    rows = _selected(weight, prod(shape_of(indices)) * prod(shape_of(weight)[1:]))
    return rows + all_bytes([indices, offsets, per_sample_weights]) + all_bytes(outputs)


def _update(target: Any, selected: int, read: list[Any]) -> int:
    """An in-place update of ``selected`` elements of ``target``: those read and written, ``read`` read."""
    return 2 * _selected(target, selected) + all_bytes(read)


@by_name
def scatter_bytes(self: Any, index: Any, src: Any = None) -> int:
    """In-place ``scatter_``/``scatter_add_``/``scatter_reduce_``: the elements the index selects (one per index
    element, at most the whole target) read and written, the index and as many source elements read."""
    selected = prod(shape_of(index))
    source = _selected(src, selected) if isinstance(src, TensorMeta) else 0
    return _update(self, selected, [index]) + source


@by_name
def index_update_bytes(self: Any, index: Any, source: Any) -> int:
    """In-place ``index_add_``/``index_copy_``/``index_reduce_``: the slices the index selects (the source's size)
    read and written, the index and the source read."""
    return _update(self, elements(source), [index, source])


@by_name
def index_fill_bytes(self: Any, dim: int, index: Any, value: Any) -> int:
    """In-place ``index_fill_``: the slices the index selects read and written, the index (and a tensor value)
    read."""
    shape = shape_of(self)
    rest = prod(shape) // max(shape[dim], 1) if shape else 1
    return _update(self, prod(shape_of(index)) * rest, [index, value])


@by_name
def index_put_bytes(self: Any, indices: Any, values: Any) -> int:
    """In-place ``index_put_`` (``x[i] = v``): the elements the indices select read and written, the indices and
    the values read. A boolean mask selects every element it covers (how many are true is not known without
    values)."""
    return _update(self, _indexed(shape_of(self), indices), [indices, values])


def _indexed(shape: list[int], indices: list[Any]) -> int:
    """Elements of a tensor of ``shape`` that advanced indexing by ``indices`` (None: a whole dimension) selects."""
    index_shapes: list[list[int]] = []
    masks: list[int] = []
    rest, dim = 1, 0
    for index in indices:
        if index is None:
            rest *= shape[dim]
            dim += 1
        elif index.dtype in ("bool", "uint8"):  # a mask over as many dimensions as it has
            masks.append(index.numel())
            dim += index.dim()
        else:
            index_shapes.append(list(index.shape))
            dim += 1
    return _index_elements(index_shapes, masks) * rest * prod(shape[dim:])


def _index_elements(shapes: list[list[int]], masks: list[int]) -> int:
    """Elements of the broadcast of advanced indices: the integer indices' ``shapes`` broadcast as torch does; a
    boolean mask's true elements (at most its ``masks`` size: how many are true is unknown without values) are one
    last dimension, which the bound sets only where the integer indices leave it 1 (else theirs is the size)."""
    broadcast = list(broadcast_shape(*shapes, *([1] for _ in masks)))
    if masks and broadcast[-1] == 1:
        broadcast[-1] = max(masks)
    return prod(broadcast)


# --- attention ----------------------------------------------------------------------------------
@by_name(attn_mask=("attn_bias", "bias"))
def _attention_operands(query: Any, key: Any, value: Any, attn_mask: Any = None,
                        is_causal: Any = False) -> tuple[Any, Any, Any, Any, bool]:
    return query, key, value, attn_mask, bool(is_causal)


_FORWARD_KEY, _BACKWARD_KEY = "scaled_dot_product_attention", "scaled_dot_product_attention_backward"
# Times the math kernel moves its score matrix (heads x L x S at the compute dtype): forward, S = QKᵀ written,
# read and written by the softmax, read by P·V (and read and written by the mask, when there is one); backward,
# dP = dO·Vᵀ written, P read for dV, P and dP read and dS written by the softmax's backward, dS read for dQ and dK.
MATH_FORWARD_SCORE_PASSES, MATH_MASK_SCORE_PASSES, MATH_BACKWARD_SCORE_PASSES = 4, 2, 7


def attention_bytes(a: Attention, qkv: int, mask: int, masked: bool, dtype: str, *, backward: bool,
                    kernel: str) -> int:
    """Bytes of one attention call of sizes ``a`` (``qkv``: bytes of Q, K and V; ``mask``: of the mask tensor).

    Fused, forward: Q, K, V and the mask read, the output and the log-sum-exp written; backward: Q, K, V, the
    output, its gradient, the log-sum-exp and the mask read, dQ, dK, dV written. Math: the same tensors, without the
    log-sum-exp, plus the score matrix's passes (:data:`MATH_FORWARD_SCORE_PASSES` ...), the mask read forward only.
    """
    out = a.heads * a.lq * a.ev * itemsize(dtype)
    if kernel == "fused":
        lse = a.heads * a.lq * LSE_ITEMSIZE
        if backward:
            return 2 * qkv + 2 * out + lse + mask
        return qkv + mask + out + lse
    scores = a.heads * a.lq * a.s * itemsize(dtype)
    if backward:
        return 2 * qkv + 2 * out + MATH_BACKWARD_SCORE_PASSES * scores
    return qkv + mask + out + (MATH_FORWARD_SCORE_PASSES + MATH_MASK_SCORE_PASSES * masked) * scores


def mask_traffic(mask: Any, dtype: str) -> tuple[int, int]:
    """Bytes of the attention mask the kernel reads, and of the mask's conversion before the forward kernel: a
    boolean mask is first made an additive one at the query's dtype (``dtype``) by ``where(mask, 0, -inf)`` — the
    boolean mask and two scalars (made, then read) read, every element of the additive mask written, a broadcast
    one too — and the kernels read that."""
    if not isinstance(mask, TensorMeta):
        return 0, 0
    if mask.dtype != "bool":
        return tensor_bytes(mask), 0
    converted = mask.numel() * itemsize(dtype)
    return converted, tensor_bytes(mask) + 4 * itemsize(dtype) + converted


def _attention_handle(op: str, backward: bool, kernel: str) -> Handle:
    sizes, operands = attention_sizes(op), _attention_operands.bind(op)

    def handle(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
        query, key, value, mask, causal = operands(inputs, outputs)
        qkv = tensor_bytes(query) + tensor_bytes(key) + tensor_bytes(value)
        mask_bytes, conversion = mask_traffic(mask, query.dtype)
        total = attention_bytes(sizes(inputs, outputs), qkv, mask_bytes, mask is not None or causal, query.dtype,
                                backward=backward, kernel=kernel)
        if not backward:
            total += conversion
        return Counter({_BACKWARD_KEY if backward else _FORWARD_KEY: total})

    handle.__doc__ = f"{'Backward' if backward else 'Forward'} attention at the {kernel} kernel (attention_bytes)."
    return handle


def _kernel_as_recorded(key: str) -> Handle:
    """A fused attention kernel recorded as itself: what it read and wrote (its log-sum-exp among its outputs)."""

    def handle(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
        return Counter({key: kernel_bytes(inputs, outputs)})

    return handle


def _flex_bytes(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
    """``flex_attention``, a fused kernel: Q, K, V and the block mask's tensors read, the output and the
    log-sum-exp written."""
    a, _ = flex_attention_pairs.bind("aten::flex_attention")(inputs, outputs)
    read = all_bytes(inputs[:3]) + all_bytes(inputs[4:5])  # (score_mod, at 3, is a function)
    total = attention_bytes(a, read, 0, False, inputs[0].dtype, backward=False, kernel="fused")
    return Counter({"flex_attention": total})


@by_name
def native_mha_inner_bytes(query: Any, key: Any, embed_dim: int, num_head: int) -> int:
    """What the fast path of ``nn.MultiheadAttention`` moves inside: the projected Q, K and V and the attention's
    output, each written and read again, and the fused attention's log-sum-exp written."""
    tokens, key_tokens = prod(shape_of(query)[:-1]), prod(shape_of(key)[:-1])
    inner = 2 * (tokens + 2 * key_tokens + tokens) * embed_dim * itemsize(query.dtype)
    return inner + tokens * num_head * LSE_ITEMSIZE


def _native_mha(inputs: list[Any], outputs: list[Any]) -> Counter[str]:
    """``_native_multi_head_attention``: its arguments read and its results written (:func:`kernel_bytes`), and
    what it moves inside (:func:`native_mha_inner_bytes`)."""
    inner = native_mha_inner_bytes.bind("aten::_native_multi_head_attention")(inputs, outputs)
    return Counter({"_native_multi_head_attention": kernel_bytes(inputs, outputs) + inner})


# --- the table ----------------------------------------------------------------------------------
# Operators that allocate or describe and move no data (views are free without an entry).
METADATA_OPS = (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
    "_efficientzerotensor", "_unsafe_view", "resize_", "resize_as_", "set_", "record_stream", "lift", "lift_fresh",
    "size", "sym_size", "stride", "sym_stride", "numel", "sym_numel", "_has_compatible_shallow_copy_type",
    "is_same_size", "_assert_async", "_assert_scalar", "_assert_tensor_metadata", "_functional_assert_async",
)
OVERWRITING_OPS = (
    "fill", "fill_", "zero_", "copy_", "uniform_", "normal_", "bernoulli_", "random_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "new_zeros", "new_ones", "new_full",
)
GATHER_OPS = ("embedding", "index_select", "gather", "index", "_unsafe_index", "take", "take_along_dim")


def traffic_table(attention_kernel: str = "fused") -> dict[str, Any]:
    """Operators whose bytes differ from the generic rule (``None``: moves nothing); attention is counted at
    ``attention_kernel`` (``"fused"`` or ``"math"``), as the FLOP tables count it."""
    check_attention_kernel(attention_kernel)
    return dict(_table(attention_kernel))


@cache
def _table(kernel: str) -> dict[str, Any]:
    table: dict[str, Any] = {f"aten::{op}": None for op in METADATA_OPS}
    table.update({f"aten::{op}": overwrites_first for op in OVERWRITING_OPS})
    table.update({f"aten::{op}": gather_bytes for op in GATHER_OPS})
    table.update(bind_all({
        **{f"aten::{op}": embedding_bag_bytes for op in ("embedding_bag", "_embedding_bag",
                                                          "_embedding_bag_forward_only")},
        **{f"aten::{op}": scatter_bytes for op in ("scatter_", "scatter_add_", "scatter_reduce_")},
        **{f"aten::{op}": index_update_bytes for op in ("index_add_", "index_copy_", "index_reduce_")},
        "aten::index_fill_": index_fill_bytes,
        **{f"aten::{op}": index_put_bytes for op in ("index_put_", "_index_put_impl_")},
    }))
    table["aten::_native_multi_head_attention"] = _native_mha
    table.update(_attention_table(kernel))
    table.update(collective_traffic())
    return table


def _attention_table(kernel: str) -> dict[str, Handle]:
    from .attention import KERNELS

    sdpa = "aten::scaled_dot_product_attention"
    table: dict[str, Handle] = {sdpa: _attention_handle(sdpa, False, kernel),
                                backward_key(sdpa): _attention_handle(backward_key(sdpa), True, kernel),
                                "aten::flex_attention": _flex_bytes}
    for op, (_, backward) in KERNELS.items():
        if op == sdpa:
            continue
        if kernel == "fused":
            table[op] = _kernel_as_recorded(_BACKWARD_KEY if backward else _FORWARD_KEY)
        else:
            table[op] = _attention_handle(op, backward, kernel)
    return table

