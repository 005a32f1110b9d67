"""Operators that need no handle: free data movement, and element-wise math.

Free (silent, cost 0): views and shape changes, copies and conversions, factories, integer and boolean
results, ReLU and dropout (the ``flops`` convention's table counts the arithmetic of ReLU and dropout,
see :mod:`.elementwise`). Element-wise math (operators torch tags ``pointwise``, and the ones it leaves
untagged) is known: free under ``fvcore`` and ``macs``, one flop per output element under ``flops``
(the convention's ``elementwise`` rule). Neither is reported as unsupported.

What torch's registry knows (views, ``pointwise`` tags) is read from the trace, which recorded it
(:mod:`modelmeter.engine.op_tags`); torch is asked only about an operator a trace has no record of.
"""

from __future__ import annotations

from collections.abc import Mapping

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
    "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "native_channel_shuffle", "im2col",
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
    "_assert_async", "_assert_scalar", "_linalg_check_errors", "_assert_tensor_metadata", "_functional_assert_async",
    "is_nonzero", "is_same_size", "equal", "nonzero", "_has_compatible_shallow_copy_type",
    "_nested_tensor_from_mask_left_aligned", "resolve_conj", "resolve_neg", "conj", "_conj",
})


# Element-wise operators PyTorch does not tag pointwise.
UNTAGGED_ELEMENTWISE_OPS = frozenset({
    "hardswish", "hardswish_", "prelu", "_prelu_kernel", "log_sigmoid", "log_sigmoid_forward", "glu",
    "floor_divide", "floor_divide_", "rrelu_with_noise", "rrelu_with_noise_", "polar",
    "dequantize",  # (q - zero_point) * scale, per element: a quantized model's way back to floats
    "quantize_per_tensor", "quantize_per_channel", "quantize_per_tensor_dynamic",  # and its way in
    # backward of element-wise activations
    "hardswish_backward", "hardsigmoid_backward", "hardtanh_backward", "leaky_relu_backward", "elu_backward",
    "mish_backward", "softplus_backward", "log_sigmoid_backward", "glu_backward", "_prelu_kernel_backward",
    "rrelu_with_noise_backward", "softshrink_backward", "hardshrink_backward",
})

# Element-wise operators of quantized tensors (``FloatFunctional``'s adds and products, quantized activations),
# which torch tags with nothing: by their full names, as the same short names elsewhere may be anything.
QUANTIZED_ELEMENTWISE_OPS = frozenset(f"quantized::{op}" for op in (
    *(f"{op}{relu}{out}" for op in ("add", "add_scalar", "mul", "mul_scalar") for relu in ("", "_relu")
      for out in ("", "_out")),
    "celu", "clamp", "elu", "leaky_relu", "relu6", "sigmoid"))


# Element-wise arithmetic of torch's primitives (``prims::``), which functorch's transforms reach through their
# decompositions (``torch.func.hessian``'s forward-mode pass) and torch tags with nothing: by their full names.
PRIMS_ELEMENTWISE_OPS = frozenset(f"prims::{op}" for op in (
    "abs", "acos", "acosh", "add", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil", "cos", "cosh",
    "digamma", "div", "erf", "erf_inv", "erfc", "erfcx", "exp", "exp2", "expm1", "floor", "fmax", "fmin", "fmod",
    "hypot", "lgamma", "log", "log10", "log1p", "log2", "maximum", "minimum", "mul", "ndtri", "neg", "nextafter",
    "pow", "reciprocal", "remainder", "round", "rsqrt", "sign", "sin", "sinh", "sqrt", "sub", "tan", "tanh",
    "trunc"))


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


def _in_place(op: str) -> bool:
    return op.endswith("_") and not op.endswith("__")


class Classifier:
    """Free and element-wise operators, by name and by the registry's tags for them (``tags``: operator ->
    ``("view", "pointwise")`` or part of it, as a trace records them), remembered per operator."""

    def __init__(self, tags: Mapping[str, tuple[str, ...]] | None = None) -> None:
        self._tags: Mapping[str, tuple[str, ...]] = tags or {}
        self._free: dict[str, bool] = {}
        self._elementwise: dict[str, bool] = {}

    def tags(self, op: str) -> tuple[str, ...]:
        found = self._tags.get(op)
        if found is None:  # not recorded (a trace made by hand): torch's registry answers
            from ..engine.op_tags import registry_tags

            found = registry_tags(op)
        return found

    def is_view(self, op: str) -> bool:
        """True when the operator's first output aliases an input (a view: no data moves), in-place forms
        of views (``transpose_``, ``as_strided_``) included."""
        if _in_place(op) and self.is_view(op[:-1]):
            return True
        return "view" in self.tags(op)

    def is_free(self, op: str) -> bool:
        """True for operators that cost nothing and are never reported."""
        free = self._free.get(op)
        if free is None:
            short = _short(op)
            free = self._free[op] = short in FREE_OPS or short.rstrip("_") in FREE_OPS or self.is_view(op)
        return free

    def is_elementwise(self, op: str) -> bool:
        """True for operators of which torch tags an overload ``pointwise`` (add, mul, gelu, ...) and the
        element-wise operators it leaves untagged; never for free operators (copies, ``where``, ``relu``)."""
        found = self._elementwise.get(op)
        if found is None:
            found = self._elementwise[op] = self._elementwise_uncached(op)
        return found

    def _elementwise_uncached(self, op: str) -> bool:
        if self.is_free(op):
            return False
        if _short(op) in UNTAGGED_ELEMENTWISE_OPS or op in QUANTIZED_ELEMENTWISE_OPS or op in PRIMS_ELEMENTWISE_OPS:
            return True
        pointwise = "pointwise" in self.tags(op)
        if _in_place(op):
            return self.is_elementwise(op[:-1]) or pointwise
        return pointwise


_REGISTRY = Classifier()  # torch's registry of this process, for callers without a trace


def is_view(op: str) -> bool:
    return _REGISTRY.is_view(op)


def is_elementwise(op: str) -> bool:
    return _REGISTRY.is_elementwise(op)


def is_free(op: str) -> bool:
    return _REGISTRY.is_free(op)
