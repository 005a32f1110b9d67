"""Operators that need no handle: free data movement, and element-wise math.

Free (silent, cost 0): views and shape changes, copies and conversions, factories, integer and boolean
results, ReLU and dropout (the ``flops`` convention's table counts the arithmetic of ReLU and dropout,
see :mod:`.elementwise`). Element-wise math (operators torch tags ``pointwise``, and the ones it leaves
untagged) is known: free under ``fvcore`` and ``macs``, one flop per output element under ``flops``
(the convention's ``elementwise`` rule). Neither is reported as unsupported.
"""

from __future__ import annotations

from functools import cache

import torch

from .._torch_compat import OpOverload, schema_of

FREE_OPS = frozenset({
    # copies, conversions, memory layout
    "clone", "copy_", "_to_copy", "to", "contiguous", "detach", "detach_", "lift_fresh", "lift_fresh_copy",
    "type_as", "_copy_from", "_copy_from_and_resize", "resize_", "set_", "alias", "_unsafe_view",
    # joining, splitting, indexing (data movement only)
    "cat", "stack", "split", "split_with_sizes", "chunk", "unbind", "index", "index_select", "gather",
    "scatter", "scatter_", "index_put", "index_put_", "_index_put_impl_", "slice_scatter", "select_scatter",
    "masked_fill", "masked_fill_", "constant_pad_nd", "pad", "roll", "flip", "repeat", "tile",
    "repeat_interleave", "tril", "triu", "tril_", "triu_", "masked_select", "take", "where",
    "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk", "_unsafe_index", "narrow_copy", "diag_embed",
    "index_fill", "index_copy", "masked_scatter", "as_strided_scatter", "complex", "detach_copy", "alias_copy",
    "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle",
    *(f"{kind}_pad{d}d" for kind in ("reflection", "replication") for d in (1, 2, 3)),
    # backward of data movement: the gradient is copied into place
    "select_backward", "slice_backward", "diagonal_backward", "unfold_backward", "masked_scatter_backward",
    *(f"{kind}_pad{d}d_backward" for kind in ("reflection", "replication") for d in (1, 2, 3)),
    # factories
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros", "zeros_like",
    "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "arange", "linspace",
    "scalar_tensor", "tensor", "fill", "fill_", "zero_", "rand", "randn", "randint", "rand_like",
    "randn_like", "uniform_", "normal_", "bernoulli", "bernoulli_", "eye", "randint_like", "randperm",
    "normal", "random_", "exponential_", "multinomial", "empty_permuted", "_efficientzerotensor", "lift",
    "copy", "resize_as_", "record_stream",
    # activations and regularisers that fvcore counts as free
    "relu", "relu_", "threshold", "dropout", "native_dropout", "feature_dropout", "alpha_dropout",
    "dropout_", "feature_alpha_dropout", "_fused_dropout",
    # scalars and metadata
    "_local_scalar_dense", "item", "size", "sym_size", "stride", "sym_stride", "numel", "sym_numel",
    "_assert_async", "_assert_scalar", "_assert_tensor_metadata", "_functional_assert_async",
    "is_nonzero", "is_same_size", "equal", "nonzero", "_has_compatible_shallow_copy_type",
    "_nested_tensor_from_mask_left_aligned", "resolve_conj", "resolve_neg", "conj", "_conj",
})


# Element-wise operators PyTorch does not tag pointwise.
UNTAGGED_ELEMENTWISE_OPS = frozenset({
    "hardswish", "hardswish_", "prelu", "_prelu_kernel", "log_sigmoid", "log_sigmoid_forward", "glu",
    "floor_divide", "floor_divide_", "rrelu_with_noise", "rrelu_with_noise_", "polar",
    # backward of element-wise activations
    "hardswish_backward", "hardsigmoid_backward", "hardtanh_backward", "leaky_relu_backward", "elu_backward",
    "mish_backward", "softplus_backward", "log_sigmoid_backward", "glu_backward", "_prelu_kernel_backward",
    "rrelu_with_noise_backward", "softshrink_backward", "hardshrink_backward",
})


# Operators that move data into or out of torch, allocate, or read metadata: no computation of their own. A custom
# autograd Function that runs nothing else computed its outputs where the recorder cannot see (numpy, an extension).
BRIDGE_OPS = frozenset({
    "detach", "detach_", "alias", "lift", "lift_fresh", "lift_fresh_copy", "_to_copy", "copy_", "_copy_from",
    "_copy_from_and_resize", "_local_scalar_dense", "item", "resize_", "set_", "size", "stride", "numel",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted", "zeros", "zeros_like",
    "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full", "scalar_tensor", "tensor",
})


def _short(op: str) -> str:
    return op.split("::", 1)[-1]


@cache
def _overload(op: str) -> OpOverload | None:
    namespace, _, name = op.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), name, None) if name else None
    if packet is None:
        return None
    overloads = packet.overloads()
    if not overloads:
        return None
    return getattr(packet, "default" if "default" in overloads else overloads[0])


@cache
def is_view(op: str) -> bool:
    """True when the operator's first output aliases an input (a view: no data moves), in-place forms
    of views (``transpose_``, ``as_strided_``) included."""
    if op.endswith("_") and not op.endswith("__") and is_view(op[:-1]):
        return True
    overload = _overload(op)
    if overload is None:
        return False
    returns = schema_of(overload).returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


@cache
def is_elementwise(op: str) -> bool:
    """True for operators of which torch tags an overload ``pointwise`` (add, mul, gelu, ...) and the
    element-wise operators it leaves untagged; never for free operators (copies, ``where``, ``relu``)."""
    if is_free(op):
        return False
    if _short(op) in UNTAGGED_ELEMENTWISE_OPS:
        return True
    if op.endswith("_") and not op.endswith("__"):
        return is_elementwise(op[:-1]) or _tagged_pointwise(op)
    return _tagged_pointwise(op)


def _tagged_pointwise(op: str) -> bool:
    namespace, _, name = op.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), name, None) if name else None
    if packet is None:
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


@cache
def is_free(op: str) -> bool:
    """True for operators that cost nothing and are never reported."""
    short = _short(op)
    return short in FREE_OPS or short.rstrip("_") in FREE_OPS or is_view(op)
