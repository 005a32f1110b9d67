"""What the CPU kernels refuse and PyTorch's meta kernels let through.

A fake run (meta stand-ins for a CPU model, a model built on meta, FakeTensors) runs meta kernels, which check less
than the CPU kernels they stand for: a float64 input meets a float32 weight in ``mm``, ``addmm`` or ``convolution``,
a transposed convolution gets the wrong number of channels, a norm mixes dtypes, an integer tensor goes through
``gelu`` or ``softmax``, ... The real run refuses each of these, so a fake run that counted them would count a model
that cannot run. Each check below raises where the CPU kernel would, before the meta kernel runs; the failing
module's call is then explained by :mod:`.expectations` as for a real run. Real tensors are left to their kernels.

The table was found by running wrong calls on the CPU and on meta tensors side by side; ``WRONG_CALLS`` in
tests/test_wrong_inputs.py keeps them, each refused by the CPU and by a fake run. Only what the CPU kernel refuses
whatever the values is checked, but for an embedding index past its table where the index's values are known and
keyed (engine/values.py): made by the model itself (an ``arange`` of positions), or the caller's token ids. Most
checks hold on every device (operands of one dtype, shapes, integer indices); the CPU's own rules (a norm's mixes of
dtypes, integer inputs to ``histc`` and resampling) apply only to tensors that stand for CPU ones — not to a model
built on meta, which may be meant for any device and whose code may take another device's path, nor to FakeTensors
on ``cuda`` (a model written for GPUs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._torch_compat import FakeTensor
from ..errors import UnsupportedError
from .attention_masks import score_batch
from .metadata import recorded_device
from .values import caller_bounds, made_bounds

Check = Callable[[tuple[Any, ...], dict[str, Any]], None]
_aten = torch.ops.aten
_REDUCED = (torch.float16, torch.bfloat16)  # a CPU norm takes these with float32 parameters
_CLASS_INDICES = (torch.int64, torch.uint8)


def kernel_check(func: Any) -> Check | None:
    """The check to run before ``func`` (an aten operator overload), or None when its meta kernel checks as much
    as the CPU kernel does."""
    return _checks().get(func)


def _without_values(tensor: Any) -> bool:
    """A meta tensor or a FakeTensor (on any device): real tensors are checked by their own kernels."""
    return isinstance(tensor, torch.Tensor) and (tensor.is_meta or isinstance(tensor, FakeTensor))


def _stands_for_cpu(tensor: Any) -> bool:
    """A tensor without values that stands for a CPU tensor: a CPU model's meta stand-in, a FakeTensor on the CPU.
    (A model built on meta may be meant for any device, and its code may take another device's path: transformers
    feed ``histc`` integers on any device but the CPU.)"""
    if tensor.is_meta:
        return recorded_device() == "cpu"
    return isinstance(tensor, FakeTensor) and tensor.device.type == "cpu"


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _named_tensors(args: tuple[Any, ...], kwargs: dict[str, Any],
                   slots: tuple[tuple[int, str], ...]) -> list[tuple[str, torch.Tensor]]:
    """The tensors at ``slots`` (position, schema name) that were given."""
    found = []
    for index, name in slots:
        value = _argument(args, kwargs, index, name)
        if isinstance(value, torch.Tensor):
            found.append((name, value))
    return found


def _dtype_list(tensors: list[tuple[str, torch.Tensor]]) -> str:
    return ", ".join(f"{name} {_dtype_name(t.dtype)}" for name, t in tensors)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _same_dtype(op: str, *slots: tuple[int, str]) -> Check:
    """The tensors at ``slots`` must share one dtype (matrix products, index updates, grid sampling, ...). The
    common case — one dtype — is decided first, cheaply: some of these run once per layer."""
    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        dtype = None
        for index, name in slots:
            value = args[index] if len(args) > index else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                if dtype is None:
                    dtype, lead = value.dtype, value
                elif value.dtype != dtype and _without_values(lead):
                    raise RuntimeError(f"{op} expects tensors of one dtype, got "
                                       f"{_dtype_list(_named_tensors(args, kwargs, slots))}")

    return check


def _floating_only(op: str, *also: torch.dtype, cpu_only: bool = False) -> Check:
    """The kernel is written for floating-point (and complex) tensors only, and the dtypes ``also``; ``cpu_only``:
    the CPU's is (another device's takes integers too)."""
    takes = "floating-point ones" + "".join(f" or {_dtype_name(d)}" for d in also)
    where = " on the CPU" if cpu_only else ""

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x: Any = args[0] if args else None
        if not _without_values(x) or x.is_floating_point() or x.is_complex() or x.dtype in also:
            return
        if not cpu_only or _stands_for_cpu(x):
            raise RuntimeError(f"{op} is not implemented for {_dtype_name(x.dtype)} tensors{where} (it takes "
                               f"{takes})")

    return check


def _norm(op: str, shape_of: Callable[[tuple[Any, ...], dict[str, Any]], tuple[int, ...]] | None,
          *parameters: tuple[int, str]) -> Check:
    """A norm's input is floating-point; its parameters (weight, bias, running statistics) have the shape
    ``shape_of(args, kwargs)`` (where given: the direct meta kernels of batch and layer norm skip the meta kernel's
    own check of it) and, on the CPU, the input's dtype, or all float32 beside a float16 or bfloat16 input."""
    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x = _argument(args, kwargs, 0, "input")
        if not _without_values(x):
            return
        if not x.is_floating_point():
            raise RuntimeError(f"{op} is not implemented for {_dtype_name(x.dtype)} tensors (it takes floating-point "
                               "ones)")
        expected = shape_of(args, kwargs) if shape_of is not None else None
        one_dtype = True
        for index, name in parameters:
            tensor = args[index] if len(args) > index else kwargs.get(name)
            if not isinstance(tensor, torch.Tensor):
                continue
            if expected is not None and tensor.shape != expected:
                raise RuntimeError(f"{op} of an input of shape {list(x.shape)} expects a {name} of shape "
                                   f"{list(expected)}, got {list(tensor.shape)}")
            one_dtype = one_dtype and tensor.dtype == x.dtype
        if one_dtype:
            return
        given = _named_tensors(args, kwargs, parameters)
        mixed = x.dtype in _REDUCED and {t.dtype for _, t in given} == {torch.float32}
        if not mixed and _stands_for_cpu(x):
            raise RuntimeError(f"{op} expects its parameters in the input's dtype (or float32 for a float16 or "
                               f"bfloat16 input), got input {_dtype_name(x.dtype)}, {_dtype_list(given)}")

    return check


def _channels(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """Batch norm's parameters: one value per channel (dimension 1)."""
    x = _argument(args, kwargs, 0, "input")
    return (x.shape[1] if x.dim() > 1 else 0,)


def _normalized_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    return tuple(_argument(args, kwargs, 1, "normalized_shape"))


def _attention_mask(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The CPU's fused attention, as a meta run calls it (:func:`.meta_kernels.fused_on_meta`, a boolean mask made
    additive already): an additive mask in float32 or the query's dtype that broadcasts to (batch, heads, L, S)."""
    query, key = _argument(args, kwargs, 0, "query"), _argument(args, kwargs, 1, "key")
    mask = kwargs.get("attn_mask")
    if not (_without_values(query) and isinstance(mask, torch.Tensor)):
        return
    if mask.dtype not in (torch.float32, query.dtype):
        raise RuntimeError(f"scaled_dot_product_attention expects a mask of bool, float32 or the query's dtype "
                           f"({_dtype_name(query.dtype)}), got {_dtype_name(mask.dtype)}")
    _mask_fits_scores(query, key, key, mask)


def attention_call_check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A user's ``scaled_dot_product_attention`` on the CPU or on stand-ins for CPU tensors, whichever kernel runs it:
    the CPU adds the mask to the scores in place, so a mask that would enlarge them (more batches than the query,
    key and value have) is refused — where the math path under a recording (fake tensors, or real ones under its
    modes) adds it out of place and broadcasts. (Other devices' kernels have rules of their own.)"""
    names = ("query", "key", "value", "attn_mask")
    query, key, value, mask = (_argument(args, kwargs, i, name) for i, name in enumerate(names))
    tensors = (query, key, value)
    if not (isinstance(mask, torch.Tensor) and all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in tensors)):
        return
    on_the_cpu = _stands_for_cpu(query) if _without_values(query) else query.device.type == "cpu"
    if on_the_cpu:
        _mask_fits_scores(query, key, value, mask)


def _mask_fits_scores(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> None:
    scores = [*score_batch(query.shape, key.shape, value.shape), query.shape[-2], key.shape[-2]]
    scores = [1] * (4 - len(scores)) + scores  # inputs of three dimensions run as a batch of one
    if mask.dim() > len(scores) or any(m not in (1, n) for m, n in zip(reversed(mask.shape), reversed(scores),
                                                                        strict=False)):
        raise RuntimeError(f"scaled_dot_product_attention expects a mask that broadcasts to the scores' shape "
                           f"{scores}, got {list(mask.shape)}")


def _convolution(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``aten::convolution``: what the CPU checks and the meta kernel does not — the weight's and bias's dtypes,
    the bias's size, groups dividing the output channels, a transposed convolution's input channels and output
    padding."""
    x = _argument(args, kwargs, 0, "input")
    weight = _argument(args, kwargs, 1, "weight")
    bias = _argument(args, kwargs, 2, "bias")
    if not (_without_values(x) and isinstance(weight, torch.Tensor)):
        return
    _CONVOLUTION_DTYPES(args, kwargs)
    transposed = bool(_argument(args, kwargs, 6, "transposed"))
    groups = int(_argument(args, kwargs, 8, "groups") or 1)
    shape = weight.shape
    if shape and shape[0] % groups:
        raise RuntimeError(f"convolution with groups={groups} expects a weight whose first dimension is divisible "
                           f"by {groups}, got weight of shape {list(shape)}")
    outputs = shape[1] * groups if transposed else shape[0]
    if isinstance(bias, torch.Tensor) and bias.shape != (outputs,):
        raise RuntimeError(f"convolution with a weight of shape {list(weight.shape)} expects a bias of {outputs} "
                           f"elements, got shape {list(bias.shape)}")
    if transposed:
        _transposed(x, weight, args, kwargs)


_CONVOLUTION_DTYPES = _same_dtype("convolution", (0, "input"), (1, "weight"), (2, "bias"))


def _transposed(x: torch.Tensor, weight: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    if weight.shape[0] == 0:
        raise RuntimeError(f"transposed convolution needs a weight of at least one input channel, got shape "
                           f"{list(weight.shape)}")
    if x.dim() < 2 or x.shape[1] != weight.shape[0]:
        raise RuntimeError(f"transposed convolution with a weight of shape {list(weight.shape)} expects an input "
                           f"of {weight.shape[0]} channels, got shape {list(x.shape)}")
    if x.numel() == 0 and x.shape[0] and x.shape[1]:
        raise RuntimeError(f"transposed convolution takes an empty input only of an empty batch or no channels, got "
                           f"shape {list(x.shape)}")
    strides = list(_argument(args, kwargs, 3, "stride"))
    dilations = list(_argument(args, kwargs, 5, "dilation"))
    paddings = list(_argument(args, kwargs, 7, "output_padding"))
    for padding, stride, dilation in zip(paddings, strides, dilations, strict=False):
        if padding >= stride and padding >= dilation:
            raise RuntimeError(f"transposed convolution expects an output padding smaller than its stride or "
                               f"dilation, got output_padding={paddings}, stride={strides}, dilation={dilations}")


def _class_indices(op: str) -> Check:
    """A negative log-likelihood's target: class indices, int64 (or uint8)."""
    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        target = _argument(args, kwargs, 1, "target")
        if _without_values(target) and target.dtype not in _CLASS_INDICES:
            raise RuntimeError(f"{op} expects a target of class indices as int64 (or uint8), got "
                               f"{_dtype_name(target.dtype)}")

    return check


def _index(op: str) -> Check:
    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        index = _argument(args, kwargs, 2, "index")
        if _without_values(index) and index.dtype not in (torch.int64, torch.int32):
            raise RuntimeError(f"{op} expects an index of int64 or int32, got {_dtype_name(index.dtype)}")

    return check


def _indices_in_table(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``embedding`` of an index past its table — a position beyond a learned position table (``arange`` of a
    sequence longer than ``max_position_embeddings``), a token id past the vocabulary — which the CPU kernel refuses
    and a meta kernel cannot see. Only values that follow from what the caches key are read: the model's own made
    from shapes and constants (:func:`~.values.made_bounds`: an ``arange`` of a length), and the caller's ids as
    given, or viewed, reshaped or copied (:func:`~.values.caller_bounds`: the caches key their least and greatest
    values, :func:`~.values.index_bounds`). Ids the model computes from the caller's otherwise are not checked."""
    weight, indices = _argument(args, kwargs, 0, "weight"), _argument(args, kwargs, 1, "indices")
    bounds = made_bounds(indices) or caller_bounds(indices)
    if bounds is None or not _without_values(weight):
        return
    if bounds[0] < 0 or bounds[1] >= weight.shape[0]:  # torch's words, then what was out of range
        raise IndexError(f"index out of range in self (indices from {bounds[0]} to {bounds[1]}, into a table of "
                         f"{weight.shape[0]} rows)")


def _non_empty(op: str, dims: int, channels: bool) -> Check:
    """``op``'s CPU kernel refuses an input with an empty dimension but the batch: its last ``dims`` (spatial) ones,
    and the channels before them when ``channels`` (PyTorch's meta kernels let these through)."""
    checked = dims + channels

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x: Any = args[0] if args else None
        if _without_values(x) and 0 in x.shape[-checked:]:
            raise RuntimeError(f"{op} expects an input with elements in every dimension but the batch, got shape "
                               f"{list(x.shape)}")

    return check


def _quantizes(op: str) -> Check:
    """A quantization of FakeTensors: their fake kernels make the output in the input's float dtype where the CPU's
    make a quantized one (qint8: a byte an element), and FakeTensors cannot be quantized. Refused as an operator
    without a fake kernel is, so that execution 'auto' runs the real kernels; meta tensors are quantized directly
    (engine/meta_kernels.py)."""
    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if any(isinstance(t, FakeTensor) for t in _tensor_arguments(args, kwargs)):
            raise UnsupportedError(f"{op} makes a quantized tensor, which FakeTensors cannot stand for: quantized "
                                   "tensors need real kernels (execution 'auto' or 'real', a model built on the CPU)")

    return check


def _reduced(op: str) -> Check:
    """``max``/``min`` (of a whole tensor, or along ``dim``) of nothing: the CPU refuses it (``amax``'s meta kernel
    does too; theirs do not)."""
    def reduction_check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        x, dim = args[0], _argument(args, kwargs, 1, "dim")
        if not _without_values(x):
            return
        if dim is None and x.numel() == 0:
            raise RuntimeError(f"{op}(): Expected reduction dim to be specified for input.numel() == 0.")  # torch's
        if dim is not None and x.dim() and x.shape[dim] == 0:
            raise IndexError(f"{op}(): Expected reduction dim {dim} to have non-zero size.")  # torch's words

    return reduction_check


def _tensor_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among the arguments, in lists too (``quantize_per_tensor.tensors``)."""
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else [value]
        found += [t for t in items if isinstance(t, torch.Tensor)]
    return found


_QUANTIZING = ("quantize_per_tensor", "quantize_per_channel", "quantize_per_tensor_dynamic")
_FLOATING_ONLY = ("gelu", "gelu_", "silu", "silu_", "mish", "mish_", "hardswish", "hardswish_", "hardsigmoid",
                  "hardsigmoid_", "elu", "elu_", "softplus", "log_sigmoid_forward", "glu", "_softmax", "_log_softmax")
_STATISTICS = ("var", "std", "var_mean", "std_mean")  # their ``correction`` overloads, what torch.var & co. call
# the CPU's only (CUDA's take integers): histc; resampling, every overload (uint8 images resample too, but for the
# linear interpolations of 1-d and 3-d inputs)
_RESAMPLING = ("_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "upsample_linear1d", "upsample_trilinear3d")
_RESAMPLING_UINT8 = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
                     "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_bilinear2d",
                     "upsample_bicubic2d")
_BATCH_NORM_PARAMETERS = ((1, "weight"), (2, "bias"), (3, "running_mean"), (4, "running_var"))
_TABLE: dict[Any, Check] | None = None


def _checks() -> dict[Any, Check]:
    """Operator overload -> its check; made on first use (the overloads are looked up once)."""
    global _TABLE
    if _TABLE is None:
        _TABLE = _build()
    return _TABLE


def _build() -> dict[Any, Check]:
    matrices = {
        _aten.mm.default: _same_dtype("mm", (0, "self"), (1, "mat2")),
        _aten.addmm.default: _same_dtype("addmm", (0, "self"), (1, "mat1"), (2, "mat2")),
        _aten.mv.default: _same_dtype("mv", (0, "self"), (1, "vec")),
        _aten.addmv.default: _same_dtype("addmv", (0, "self"), (1, "mat"), (2, "vec")),
        _aten._cdist_forward.default: _same_dtype("cdist", (0, "x1"), (1, "x2")),
        _aten.polar.default: _same_dtype("polar", (0, "abs"), (1, "angle")),
        _aten.complex.default: _same_dtype("complex", (0, "real"), (1, "imag")),
        _aten.grid_sampler_2d.default: _same_dtype("grid_sample", (0, "input"), (1, "grid")),
        _aten.grid_sampler_3d.default: _same_dtype("grid_sample", (0, "input"), (1, "grid")),
        _aten.binary_cross_entropy.default: _same_dtype("binary_cross_entropy", (0, "self"), (1, "target"),
                                                        (2, "weight")),
        _aten._embedding_bag.default: _same_dtype("embedding_bag", (0, "weight"), (6, "per_sample_weights")),
        _aten._embedding_bag_forward_only.default: _same_dtype("embedding_bag", (0, "weight"),
                                                               (6, "per_sample_weights")),
    }
    updates = {getattr(_aten, name).default: _same_dtype(name.rstrip("_"), (0, "self"), (3, "source"))
               for name in ("index_add", "index_add_", "index_copy", "index_copy_")}
    updates.update({getattr(_aten, name).default: _same_dtype("index_put", (0, "self"), (2, "values"))
                    for name in ("index_put", "index_put_", "_index_put_impl_")})
    norms = {
        _aten.native_batch_norm.default: _norm("batch_norm", _channels, *_BATCH_NORM_PARAMETERS),
        _aten._native_batch_norm_legit.default: _norm("batch_norm", _channels, *_BATCH_NORM_PARAMETERS),
        _aten._native_batch_norm_legit.no_stats: _norm("batch_norm", _channels, (1, "weight"), (2, "bias")),
        _aten._native_batch_norm_legit_no_training.default: _norm("batch_norm", _channels, *_BATCH_NORM_PARAMETERS),
        _aten.native_layer_norm.default: _norm("layer_norm", _normalized_shape, (2, "weight"), (3, "bias")),
        _aten.native_group_norm.default: _norm("group_norm", None, (1, "weight"), (2, "bias")),
    }
    others: dict[Any, Check] = {
        _aten.convolution.default: _convolution,
        _aten.nll_loss_forward.default: _class_indices("nll_loss"),
        _aten.nll_loss2d_forward.default: _class_indices("nll_loss2d"),
        _aten.index_select.default: _index("index_select"),
        _aten.embedding.default: _indices_in_table,
        _aten._scaled_dot_product_flash_attention_for_cpu.default: _attention_mask,
    }
    floating = {getattr(_aten, name).default: _floating_only(name.strip("_")) for name in _FLOATING_ONLY}
    floating.update({getattr(_aten, name).correction: _floating_only(name) for name in _STATISTICS})
    floating[_aten.histc.default] = _floating_only("histc", cpu_only=True)
    for names, also in ((_RESAMPLING, ()), (_RESAMPLING_UINT8, (torch.uint8,))):
        for name in names:
            packet = getattr(_aten, name)
            floating.update({getattr(packet, overload): _floating_only(name.strip("_"), *also, cpu_only=True)
                             for overload in packet.overloads()})
    quantizing = {getattr(getattr(_aten, name), overload): _quantizes(name)
                  for name in _QUANTIZING for overload in getattr(_aten, name).overloads()}
    table = {**matrices, **updates, **norms, **others, **floating, **quantizing}
    for func, check in _empty_inputs().items():
        table[func] = _both(table[func], check) if func in table else check
    return table


def _empty_inputs() -> dict[Any, Check]:
    """The checks of empty inputs: resampling and pooling of nothing, ``max``/``min`` of nothing."""
    checks: dict[Any, Check] = {}
    for name, dims in (("_adaptive_avg_pool2d", 2), ("_adaptive_avg_pool3d", 3), ("grid_sampler_2d", 2),
                       ("grid_sampler_3d", 3)):
        checks[getattr(_aten, name).default] = _non_empty(name.strip("_"), dims, channels=False)
    for name, dims in (("upsample_linear1d", 1), ("upsample_bilinear2d", 2), ("upsample_bicubic2d", 2),
                       ("upsample_trilinear3d", 3)):
        packet = getattr(_aten, name)
        checks.update({getattr(packet, overload): _non_empty(name, dims, channels=True)
                       for overload in ("default", "vec")})
    for name in ("max", "min"):
        checks.update({getattr(_aten, name).default: _reduced(name), getattr(_aten, name).dim: _reduced(name)})
    return checks


def _both(first: Check, second: Check) -> Check:
    """Two checks of one operator, in turn."""
    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first(args, kwargs)
        second(args, kwargs)

    return check
