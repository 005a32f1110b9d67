"""Operators on meta tensors run closer to a real device, or faster, than PyTorch's meta kernels do.

**Attention.** On the meta device PyTorch has no fused attention kernel to choose, so ``F.scaled_dot_product_attention``
falls back to the math path: it materialises the (L, S) scores and, in training, saves them. Every real
device runs a fused kernel where it can (the CPU's flash kernel, FlashAttention or memory-efficient attention
on CUDA), which keeps only the output and the log-sum-exp. A meta run therefore takes the path a CPU run
takes — the same conditions, the same preparation of the mask, the CPU flash kernel's meta implementation —
so a model without weights needs the memory its CPU run needs (and FLOPs are counted from the call either way).

**Direct kernels.** Many of PyTorch's meta kernels are Python decompositions run operator by operator on
meta tensors: ``native_batch_norm`` takes over a millisecond per call (most of a ResNet's analysis),
``native_layer_norm``, ``addmm``, ``roll`` and the element-wise operators written as Python references (``relu``,
``gelu``, ``hardtanh``, ``pow``, ``exp``, ``x * 0.5``, ...) from a hundred microseconds to over a millisecond, and
``convolution`` ~60 microseconds (a tenth of a ResNet-50's recording).
Their outputs' metadata — shape, strides, dtype — follow simple rules, so for the arguments where the rule is known
(dense layouts, floating-point dtypes, no broadcasting or type promotion; a Python number beside a floating-point
tensor changes neither) the outputs are made directly: with the meta kernel's metadata, or, when the meta tensors
stand in for a CPU model's, with the CPU kernel's (normalisation statistics in the input's dtype, none for batch
norm in eval mode). An in-place element-wise operator (an LSTM cell's ``sigmoid_``, ``tanh_`` and ``add_``, hundreds of
microseconds each through the references) returns the tensor it updated. ``tests/test_meta_kernels.py`` compares
both on every case.

**Channels-last layouts.** PyTorch's meta kernels of ``convolution`` (and its backward) and of group norm make
contiguous results where the CPU's kernels keep a channels-last layout, so a ``reshape`` after them copied on the
CPU only; on meta stand-ins these take the CPU's layout — for a convolution, the one torch's backend choice for CPU
tensors of these layouts gives, as FakeTensors on the CPU work it out (``tests/test_tensors_hostile.py`` compares
them with the CPU's kernels).

**Language models** reach ``arange`` (positions), a number to the power of a tensor (rotary frequencies), the CPU's
flash attention kernel, element-wise operators on views that are not dense (half of a rotated query, a third of a
fused projection), on contiguous operands broadcast against each other (a mask added to scores) and on a sum's
gradient, and ``cat``/``stack`` of such views: with these, the zoo's language models, forward or backward, import
neither sympy nor ``torch._dynamo`` either.

**A training step** reaches more of them: the loss's seed gradient (``ones_like``), ``mm``, ``sum``, gradients
scaled by a number, broadcast element-wise operators, softmax, ``embedding``, ``cat``, dropout's mask and the
backward kernels of activations, normalisations, convolution, pooling, softmax and indexing. Besides their cost, the
first call of a Python meta kernel imports sympy (``torch._check``) and ``torch._dynamo`` (``torch._disable_dynamo``),
over a second in a new process: with these made directly, a plain model's analysis, forward or a training step,
imports neither (``tests/test_cli_package.py``); a training step on the stand-ins records the trace real CPU kernels
record (``tests/test_meta_kernels.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from .._torch_compat import FakeTensor, FakeTensorMode, conv_memory_format, fake_from_meta
from ..errors import InvalidValueError
from .metadata import recorded_device
from .shapes import broadcast_shape

_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fused_on_meta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor | None:
    """The output of the fused kernel a CPU run would choose for these meta tensors, or None when the CPU too
    would run the math path (dropout, a strided last dimension, head sizes that differ between query, key and
    value, a mask that requires a gradient — even under ``no_grad`` —, flash attention switched off: the conditions
    of torch's CPU kernel choice)."""
    tensors = (query, key, value)
    if attn_mask is not None and attn_mask.requires_grad:  # T5's learned position bias: the fused kernel has no
        return None  # mask gradient, so the CPU runs the math path
    if not (all(t.is_meta and t.dtype in _FLOATS and t.dim() in (3, 4) and t.stride(-1) == 1 for t in tensors)
            and dropout_p == 0.0 and torch.backends.cuda.flash_sdp_enabled()
            and query.dtype == key.dtype == value.dtype and query.dim() == key.dim() == value.dim()
            and query.size(-1) == key.size(-1) == value.size(-1) and query.size(0) == key.size(0) == value.size(0)
            and query.size(-2) > 0 and key.size(-2) > 0
            and (enable_gqa or query.size(-3) == key.size(-3))):
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the CPU path converts it: 0 / -inf
        attn_mask = torch.where(attn_mask, torch.scalar_tensor(0.0, dtype=query.dtype, device=query.device),
                                torch.scalar_tensor(-math.inf, dtype=query.dtype, device=query.device))
    batched = query.dim() == 4
    if not batched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    output = _FLASH(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return output if batched else output.squeeze(0)




# --- direct meta kernels ---------------------------------------------------------------------------------------
def _stats_dtype(dtype: torch.dtype, parameters: tuple[object, ...]) -> torch.dtype:
    """Normalisation statistics of a half-precision input: in the computation dtype (float32) on meta; on the CPU in
    the input's dtype, or in float32 where the ``parameters`` (weight, bias, running statistics) are float32 — the
    CPU's mixed-type kernels, which a half model with float32 norms runs (a model autocast by hand)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return dtype
    if recorded_device() != "cpu":
        return torch.float32
    if any(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in parameters):
        return torch.float32
    return dtype


def _batch_norm(input: torch.Tensor, weight: object, bias: object, running_mean: object, running_var: object,
                training: bool, *_: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # the CPU kernel keeps no statistics in eval mode; the meta kernel returns them always
    channels = input.shape[1] if training or recorded_device() != "cpu" else 0
    stats = _stats_dtype(input.dtype, (weight, bias, running_mean, running_var))
    return (_like(input), torch.empty((channels,), dtype=stats, device=input.device),
            torch.empty((channels,), dtype=stats, device=input.device))


def _layer_norm(input: torch.Tensor, normalized_shape: list[int], weight: object = None, bias: object = None,
                *_: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    axis = input.dim() - len(normalized_shape)
    stats_shape = (*input.shape[:axis], *([1] * len(normalized_shape)))
    stats = _stats_dtype(input.dtype, (weight, bias))
    return (torch.empty(input.shape, dtype=input.dtype, device=input.device),
            torch.empty(stats_shape, dtype=stats, device=input.device),
            torch.empty(stats_shape, dtype=stats, device=input.device))


def _addmm(bias: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    return torch.empty((m1.shape[0], m2.shape[1]), dtype=m1.dtype, device=m1.device)


def _mean(x: torch.Tensor, dim: list[int] | None, keepdim: bool = False, *,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """``mean.dim``: the reduced shape, contiguous. (PyTorch's meta kernel is a Python reference whose first call
    imports ``torch._dynamo``, over a second in a new process.)"""
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        raise RuntimeError(f"mean(): could not infer output dtype. Optional dtype must be either a floating point "
                           f"or complex dtype. Got: {dtype}")
    return _sum(x, dim, keepdim, dtype=dtype)


def _sum(x: torch.Tensor, dim: list[int] | None, keepdim: bool = False, *,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    """``sum.dim_IntList`` of a floating-point tensor: the reduced shape, contiguous whatever the input's layout (the
    gradient of a bias is the sum of an expanded gradient: torch's meta kernel for it is a Python reference)."""
    reduced = {d % x.dim() for d in dim} if dim else set(range(x.dim()))
    shape = [1 if i in reduced else n for i, n in enumerate(x.shape) if keepdim or i not in reduced]
    return torch.empty(shape, dtype=dtype or x.dtype, device=x.device)


def _convolution(input: torch.Tensor, weight: torch.Tensor, bias: object, stride: list[int], padding: list[int],
                 dilation: list[int], *_: object) -> torch.Tensor:
    """``convolution`` without transposition of a contiguous input: every spatial size from the usual formula,
    contiguous. (PyTorch's meta kernel is Python: ~60 us a call.)"""
    spatial = _convolved(input, weight, stride, padding, dilation)
    return torch.empty((input.shape[0], weight.shape[0], *spatial), dtype=input.dtype, device=input.device)


def _convolved(input: torch.Tensor, weight: torch.Tensor, stride: list[int], padding: list[int],
               dilation: list[int]) -> list[int]:
    """The output's spatial sizes."""
    return [(size + 2 * pad - dil * (kernel - 1) - 1) // step + 1
            for size, kernel, step, pad, dil in zip(input.shape[2:], weight.shape[2:], stride, padding, dilation,
                                                    strict=True)]


def _like(x: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    """``empty_like(x)`` of a dense ``x``: the same strides (``empty_like`` itself runs in Python on meta)."""
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)


def _contiguous_like(x: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _elementwise_like(x: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    """The output of an element-wise kernel whose first operand is ``x``: contiguous when the operands are (torch's
    kernels take that short cut whatever strides the size-1 dimensions have), else with ``x``'s strides."""
    return _contiguous_like(x) if x.is_contiguous() else _like(x)


def _scaled(x: torch.Tensor, *_: object) -> torch.Tensor:
    """``x * number`` or ``x / number``: as :func:`_elementwise_like`; contiguous too for a contiguous tensor expanded
    (the gradient of a mean, divided by the number of elements averaged)."""
    return _contiguous_like(x) if _expanded_contiguous(x) else _elementwise_like(x)


def _new_like(op: Any) -> Callable[..., torch.Tensor]:
    """``ones_like`` / ``empty_like`` / ``clone`` of a dense ``x`` (the loss's seed gradient, a dropout mask, a
    ``contiguous()`` copy): ``x``'s layout, or contiguous where asked; with another dtype, device, layout, memory
    format or pinned memory asked, torch's own kernel."""

    def kernel(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        memory_format = kwargs.get("memory_format")
        if (memory_format not in (None, torch.preserve_format, torch.contiguous_format)
                or kwargs.get("pin_memory") not in (None, False)
                or any(kwargs.get(name) is not None for name in ("dtype", "layout", "device"))):
            return op(x, **kwargs)
        return _contiguous_like(x) if memory_format == torch.contiguous_format else _like(x)

    return kernel


def _matrix_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mm`` and ``bmm``: the product's shape, contiguous whatever the operands' layouts."""
    return torch.empty((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device=a.device)


def _batch_norm_backward(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None, *args: Any
                         ) -> tuple[torch.Tensor | None, ...]:
    """Gradients of input (in its layout), weight and bias (one per channel), those ``output_mask`` asks for (the
    meta kernel makes the input's always)."""
    mask = args[-1] if recorded_device() == "cpu" else [True, *args[-1][1:]]
    return _masked((_like(input), *(torch.empty((input.shape[1],), dtype=input.dtype, device=input.device)
                                     for _ in range(2))), mask)


def _layer_norm_backward(grad: torch.Tensor, input: torch.Tensor, normalized_shape: list[int], mean: object,
                         rstd: object, weight: torch.Tensor | None, bias: torch.Tensor | None, output_mask: list[bool]
                         ) -> tuple[torch.Tensor | None, ...]:
    """Gradients of input (contiguous), weight and bias (of their shapes), those ``output_mask`` asks for."""
    return _masked((_contiguous_like(input), *(torch.empty(tuple(normalized_shape), dtype=input.dtype,
                                                           device=input.device) for _ in range(2))), output_mask)


def _convolution_backward(grad: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, bias_sizes: list[int],
                          *args: Any) -> tuple[torch.Tensor | None, ...]:
    """Gradients of a contiguous input and weight (contiguous) and of the bias, those ``output_mask`` asks for."""
    bias = torch.empty(tuple(bias_sizes), dtype=input.dtype, device=input.device)
    return _masked((_contiguous_like(input), _contiguous_like(weight), bias), args[-1])


def _like_input(grad: torch.Tensor, input: torch.Tensor, *_: object) -> torch.Tensor:
    """The gradient of a contiguous input: contiguous."""
    return _contiguous_like(input)


def _masked(gradients: tuple[torch.Tensor, ...], output_mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
    return tuple(g if wanted else None for g, wanted in zip(gradients, output_mask, strict=True))


def _max_pool2d(x: torch.Tensor, kernel_size: list[int], stride: list[int] | None = None, padding: Any = 0,
                dilation: Any = 1, ceil_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``max_pool2d_with_indices`` of a contiguous input: the pooled shape (torch's formula), contiguous values and
    int64 indices."""
    spatial = _pooled_sizes(x, kernel_size, stride or kernel_size, _pair(padding), _pair(dilation), ceil_mode)
    shape = (*x.shape[:-2], *spatial)
    return (torch.empty(shape, dtype=x.dtype, device=x.device),
            torch.empty(shape, dtype=torch.int64, device=x.device))


def _pooled_sizes(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
                  ceil_mode: bool) -> list[int]:
    """The pooled sizes of ``x``'s last two dimensions."""
    return [_pooled(x.shape[i - 2], kernel[i], stride[i], padding[i], dilation[i], ceil_mode) for i in range(2)]


def _pooled(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """One pooled size: floor (or ceil) of the window positions; with ceil, a last window that would start in the
    right padding is dropped."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _pair(value: Any) -> list[int]:
    """A pooling argument given once for both dimensions, or per dimension."""
    values = [value] if type(value) is int else list(value)
    return values * 2 if len(values) == 1 else values


def _self(x: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    """An in-place operator's result: the tensor it updated (metadata unchanged)."""
    return x


def _plain_meta(value: object) -> bool:
    """A meta tensor or parameter (no FakeTensor, no other subclass)."""
    return type(value) in (torch.Tensor, torch.nn.Parameter) and value.is_meta  # type: ignore[attr-defined]


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense: some order of the dimensions is contiguous (``empty_like`` keeps such a tensor's
    strides). Written here: torch's own test of it imports sympy on its first call."""
    if x.is_contiguous():
        return True
    if x.dim() == 1:
        return x.shape[0] < 2 or x.stride(0) == 1
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(x.shape, x.stride(), strict=True) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _expanded_contiguous(x: torch.Tensor) -> bool:
    """``x`` is a contiguous tensor expanded: stride 0 in the dimensions it was broadcast along (of more than one
    element), the contiguous strides of its unexpanded shape in the others."""
    base = [1 if stride == 0 and size > 1 else size for size, stride in zip(x.shape, x.stride(), strict=True)]
    return all((stride == 0 and size > 1) or stride == expected
               for size, stride, expected in zip(x.shape, x.stride(), _contiguous_strides(torch.Size(base)),
                                                 strict=True))


def _elementwise_dense(x: torch.Tensor) -> bool:
    """Dense, as :func:`_dense`; with a size-1 dimension only in the contiguous layout's own strides, or outermost
    with the strides ordering the dimensions (:func:`_strides_order`: a batch of one of heads viewed before positions).
    (Where a size-1 dimension has another stride, torch's element-wise kernels disagree on the output's stride there —
    meta with CPU, ``relu`` with ``mul`` — so those are left to them.)"""
    if 1 in x.shape:
        return x.stride() == _contiguous_strides(x.shape) or (_dense(x) and _strides_order(x))
    return _dense(x)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, as torch gives them (a size-0 dimension counted as 1).
    Written here: torch's helper checks the sizes with ``torch._check``, whose first call imports sympy (~1 s)."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _batch_norm_fits(args: tuple[Any, ...]) -> bool:
    x = args[0]
    return _plain_meta(x) and x.dim() > 1 and _dense(x) and all(a is None or _plain_meta(a) for a in args[1:5])


def _layer_norm_fits(args: tuple[Any, ...]) -> bool:
    x, shape = args[0], args[1]
    return (_plain_meta(x) and 0 < len(shape) <= x.dim() and tuple(x.shape[x.dim() - len(shape):]) == tuple(shape)
            and all(a is None or _plain_meta(a) for a in args[2:4]))


def _addmm_fits(args: tuple[Any, ...]) -> bool:
    bias, m1, m2 = args[:3]
    if not (_plain_meta(bias) and _plain_meta(m1) and _plain_meta(m2) and m1.dim() == m2.dim() == 2
            and m1.shape[1] == m2.shape[0] and bias.dtype == m1.dtype == m2.dtype):
        return False
    rows, columns = m1.shape[0], m2.shape[1]  # a bias that broadcasts to the product's shape
    return tuple(bias.shape) in ((columns,), (1, columns), (rows, columns), (rows, 1), (1, 1), (1,), ())


def _convolution_fits(args: tuple[Any, ...]) -> bool:
    """A contiguous floating-point input of 1 to 3 spatial dimensions (a channels-last one, on which the CPU and meta
    kernels choose the output's layout by rules of their own, is left to them) and a contiguous weight of its dtype,
    no transposition, whole numbers for the geometry, and an output of at least one element."""
    if len(args) != 9:
        return False
    x, weight, bias, stride, padding, dilation, transposed, _, groups = args
    if not (_plain_meta(x) and _plain_meta(weight) and (bias is None or _plain_meta(bias)) and transposed is False
            and type(groups) is int and groups > 0 and 3 <= x.dim() <= 5 and weight.dim() == x.dim()
            and x.is_floating_point() and x.dtype == weight.dtype and x.is_contiguous() and weight.is_contiguous()
            and x.shape[1] == weight.shape[1] * groups and weight.shape[0] % groups == 0 and x.shape[0] > 0):
        return False
    if not all(isinstance(v, (list, tuple)) and len(v) == x.dim() - 2 and all(type(i) is int for i in v)
               for v in (stride, padding, dilation)):
        return False
    if min(stride) <= 0 or min(dilation) <= 0 or min(padding) < 0:
        return False  # torch's error
    return all(size > 0 for size in _convolved(x, weight, stride, padding, dilation))


# --- the CPU's layouts of channels-last operands ---------------------------------------------------------------
# PyTorch's meta kernels of ``convolution`` (and its backward) and ``native_group_norm`` make contiguous results,
# where the CPU kernels keep a channels-last layout (a convolution: where its backend works channels-last, for an
# input or a weight of that layout; group norm: the input's). A later ``reshape`` then copies on the CPU and not on
# meta: on meta stand-ins, these results take the CPU's layout.
def _cpu_convolution_fits(args: tuple[Any, ...]) -> bool:
    """Meta stand-ins of CPU tensors, an input and a weight of 2 or 3 spatial dimensions not both contiguous."""
    x, weight = args[0], args[1]
    return (recorded_device() == "cpu" and _plain_meta(x) and _plain_meta(weight) and x.dim() in (4, 5)
            and weight.dim() == x.dim() and not (x.is_contiguous() and weight.is_contiguous()))


@cache
def _cpu_mode() -> FakeTensorMode:
    """The mode of the FakeTensors on the CPU that ask torch which layout its CPU convolution takes."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def _cpu_convolution_format(x: torch.Tensor, weight: torch.Tensor, **geometry: Any) -> torch.memory_format:
    """The layout of a CPU convolution's results for meta stand-ins ``x`` and ``weight`` (FakeTensors on the CPU,
    without storage, stand for them in torch's choice of backend); remembered per layouts and geometry, as a
    model's layers repeat them."""
    key = (*(_layout_key(t) for t in (x, weight, geometry.get("bias"))),
           *((name, tuple(v) if isinstance(v, list) else v) for name, v in geometry.items() if name != "bias"))
    found = _CPU_FORMATS.get(key)
    if found is None:
        mode, cpu = _cpu_mode(), torch.device("cpu")
        bias = geometry.get("bias")
        with mode:
            if isinstance(bias, torch.Tensor):
                geometry["bias"] = fake_from_meta(mode, bias, cpu)
            found = conv_memory_format(fake_from_meta(mode, x, cpu), fake_from_meta(mode, weight, cpu), **geometry)
        if len(_CPU_FORMATS) > 4096:  # (models of ever new shapes in one process: bounded)
            _CPU_FORMATS.clear()
        _CPU_FORMATS[key] = found
    return found


def _layout_key(t: object) -> object:
    return (tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t


_CPU_FORMATS: dict[tuple[Any, ...], torch.memory_format] = {}


def _in_format(t: torch.Tensor | None, memory_format: torch.memory_format) -> torch.Tensor | None:
    return None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=memory_format)


def _any_convolution_fits(args: tuple[Any, ...]) -> bool:
    return len(args) == 9 and (_convolution_fits(args) or _cpu_convolution_fits(args))


def _any_convolution(x: torch.Tensor, weight: torch.Tensor, bias: Any, stride: list[int], padding: list[int],
                     dilation: list[int], transposed: bool, output_padding: list[int], groups: int) -> torch.Tensor:
    """A plain convolution (:func:`_convolution`), or one with a channels-last operand in the CPU's layout."""
    if x.is_contiguous() and weight.is_contiguous():
        return _convolution(x, weight, bias, stride, padding, dilation)
    out = _aten.convolution.default(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    layout = _cpu_convolution_format(x, weight, bias=bias, stride=stride, padding=padding, dilation=dilation,
                                     transposed=transposed, output_padding=output_padding, groups=groups)
    return _in_format(out, layout)  # type: ignore[return-value]


def _any_convolution_backward_fits(args: tuple[Any, ...]) -> bool:
    return len(args) == 11 and (_convolution_backward_fits(args) or _cpu_convolution_fits(args[1:3]))


def _any_convolution_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias_sizes: list[int],
                              *args: Any) -> tuple[torch.Tensor | None, ...]:
    """:func:`_convolution_backward`, or with a channels-last operand the CPU's layout for the input's and the
    weight's gradients (the bias's is a vector)."""
    if x.is_contiguous() and weight.is_contiguous():
        return _convolution_backward(grad, x, weight, bias_sizes, *args)
    grads = _aten.convolution_backward.default(grad, x, weight, bias_sizes, *args)
    stride, padding, dilation, transposed, output_padding, groups = args[:6]
    layout = _cpu_convolution_format(x, weight, bias=None, bias_sizes=bias_sizes, stride=stride, padding=padding,
                                     dilation=dilation, transposed=transposed, output_padding=output_padding,
                                     groups=groups)
    return _in_format(grads[0], layout), _in_format(grads[1], layout), grads[2]


def _group_norm_fits(args: tuple[Any, ...]) -> bool:
    """A meta stand-in of a CPU input laid out channels-last (suggested so by its strides)."""
    return recorded_device() == "cpu" and _plain_meta(args[0]) and _channels_last_strides(args[0])


def _group_norm(x: torch.Tensor, *args: Any) -> tuple[torch.Tensor, ...]:
    """``native_group_norm``: the statistics of torch's meta kernel, the output in the input's channels-last layout
    (``empty_like(x, x.suggest_memory_format())``, as the CPU kernel makes it)."""
    out, mean, rstd = _aten.native_group_norm.default(x, *args)
    return _in_format(out, _CHANNELS_LAST[x.dim()]), mean, rstd  # type: ignore[return-value]


def _group_norm_backward_fits(args: tuple[Any, ...]) -> bool:
    """Meta stand-ins of CPU tensors, the input or the output's gradient laid out channels-last."""
    grad, x = args[0], args[1]
    return (recorded_device() == "cpu" and _plain_meta(grad) and _plain_meta(x)
            and (_channels_last_strides(x) or _channels_last_strides(grad)))


def _group_norm_backward(grad: torch.Tensor, x: torch.Tensor, *args: Any) -> tuple[torch.Tensor | None, ...]:
    """``native_group_norm_backward``: the input's gradient in the input's layout (the CPU's; the meta kernel takes
    the gradient's), the others from torch's meta kernel."""
    grads = _aten.native_group_norm_backward.default(grad, x, *args)
    layout = torch.contiguous_format
    if _channels_last_strides(x):
        layout = _CHANNELS_LAST[x.dim()]
    return _in_format(grads[0], layout), grads[1], grads[2]


def _unary_fits(args: tuple[Any, ...]) -> bool:
    return _plain_meta(args[0]) and args[0].is_floating_point() and _elementwise_dense(args[0])


def _unary_or_view_fits(args: tuple[Any, ...]) -> bool:
    """As :func:`_unary_fits`, or of a view that is not dense but whose strides order its dimensions
    (:func:`_by_strides`: half of a rotary embedding's query, ``-x[..., half:]``)."""
    x = args[0]
    return _unary_fits(args) or (_plain_meta(x) and x.is_floating_point() and _strides_order(x))


def _distinct_strides(x: torch.Tensor) -> bool:
    """No dimension of size 0, and strides all different and none 0: they order the dimensions alone."""
    strides = x.stride()
    return 0 not in x.shape and 0 not in strides and len(set(strides)) == len(strides)


def _strides_order(x: torch.Tensor) -> bool:
    """:func:`_distinct_strides`, and a dimension of size 1 has the stride of one around all the others (a batch of
    one): element-wise kernels disagree on the output's stride there otherwise."""
    if not _distinct_strides(x):
        return False
    strides, shape = x.stride(), x.shape
    extent = max((stride * size for stride, size in zip(strides, shape, strict=True) if size != 1), default=1)
    return all(stride == extent for stride, size in zip(strides, shape, strict=True) if size == 1)


def _by_strides(x: torch.Tensor) -> torch.Tensor:
    """A new tensor of ``x``'s shape whose dimensions lie in memory in the order of ``x``'s strides, contiguously:
    what element-wise kernels and ``empty_like`` make of a tensor that is not dense (:func:`_distinct_strides`)."""
    order = sorted(range(x.dim()), key=lambda d: x.stride(d), reverse=True)
    physical = torch.empty([x.shape[d] for d in order], dtype=x.dtype, device=x.device)
    return physical.permute(sorted(range(x.dim()), key=order.__getitem__))


def _unary(x: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    """An element-wise operator's output: in ``x``'s layout when ``x`` is dense, else by its strides."""
    return _like(x) if _elementwise_dense(x) else _by_strides(x)


def _with_scalars_fits(args: tuple[Any, ...]) -> bool:
    """A dense floating-point tensor and real numbers (the scalars of ``hardtanh``, ``pow``, ``leaky_relu``)."""
    return _unary_fits(args) and all(type(a) in (int, float, bool) for a in args[1:])


def _same_operands(args: tuple[Any, ...]) -> bool:
    """Two tensors of one shape and dtype (no broadcasting, no type promotion), of one dense layout or both
    contiguous (the gates an LSTM cell chunks off one product are, with strides of their own in size-1
    dimensions)."""
    a, b = args[0], args[1]
    if not (_plain_meta(a) and _plain_meta(b) and a.shape == b.shape and a.dtype == b.dtype):
        return False
    return (a.stride() == b.stride() and _elementwise_dense(a)) or (a.is_contiguous() and b.is_contiguous())


def _same_float_operands(args: tuple[Any, ...]) -> bool:
    """As :func:`_same_operands`, of a floating-point dtype (a true division of integers makes floats)."""
    return _same_operands(args) and args[0].is_floating_point()


def _leading_operand(args: tuple[Any, ...]) -> bool:
    """A first floating-point tensor whose layout decides the output's alone, and a second of its dtype, of its shape
    or broadcast to it (a bias, a rotary table). torch's element-wise kernels order the output's dimensions by the
    first operand's strides, consulting the next only where those tie: so the first has no dimension of size 0, no
    two equal strides, and the strides of a contiguous tensor whose dimensions are in that order (a size-1 dimension
    included: its stride is otherwise free, and the kernels give the output the one that order implies)."""
    a, b = args[0], args[1]
    if not (_plain_meta(a) and _plain_meta(b) and a.is_floating_point() and a.dtype == b.dtype and 0 not in a.shape
            and b.dim() <= a.dim() and _dense(a) and _strides_order(a)):
        return False
    return all(n in (1, m) for n, m in zip(reversed(b.shape), reversed(a.shape), strict=False))


def _contiguous_broadcast(args: tuple[Any, ...]) -> bool:
    """Two floating-point tensors of one dtype, each with the strides of a contiguous tensor of its shape, whose
    shapes broadcast (a mask added to scores of a batch of one, positions times frequencies): a contiguous output."""
    a, b = args[0], args[1]
    return (_plain_meta(a) and _plain_meta(b) and a.is_floating_point() and a.dtype == b.dtype
            and a.stride() == _contiguous_strides(a.shape) and b.stride() == _contiguous_strides(b.shape)
            and _broadcasts(a.shape, b.shape))


def _broadcasts(a: torch.Size, b: torch.Size) -> bool:
    """Whether shapes ``a`` and ``b`` broadcast (where they do not, torch's own kernel raises the user's error)."""
    try:
        broadcast_shape(a, b)
    except InvalidValueError:
        return False
    return True


def _broadcast(a: torch.Tensor, b: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    """The output of :func:`_contiguous_broadcast`'s operands: their broadcast shape, contiguous."""
    return torch.empty(broadcast_shape(a.shape, b.shape), dtype=a.dtype, device=a.device)


def _elementwise(a: torch.Tensor, b: Any, *_: object, **__: object) -> torch.Tensor:
    """A binary element-wise operator's output: broadcast when the operands' shapes differ; like the second when the
    first is one value expanded (:func:`_two_operands`); else like the first."""
    if isinstance(b, torch.Tensor):
        if b.shape != a.shape and _contiguous_broadcast((a, b)):
            return _broadcast(a, b)
        return _two_operands(a, b)
    return _elementwise_like(a)


def _binary_fits(args: tuple[Any, ...]) -> bool:
    """Two tensors as :func:`_same_operands`, :func:`_leading_operand`, :func:`_contiguous_broadcast` or
    :func:`_expanded_value_and_contiguous` (a gradient accumulated), or a dense floating-point tensor and a real
    number (``0.5 * x``: the number changes neither the dtype nor the layout; a bool is left to torch, which refuses
    to subtract one)."""
    if type(args[1]) in (int, float):
        return _with_scalars_fits(args)
    return (_same_operands(args) or _leading_operand(args) or _contiguous_broadcast(args)
            or _expanded_value_and_contiguous(args[0], args[1]))


def _scalar_base_fits(args: tuple[Any, ...]) -> bool:
    """``pow(number, x)`` of a contiguous floating-point ``x`` (rotary embeddings' frequencies): a real number changes
    neither its dtype nor its shape. (Of another layout, the CPU kernel's output is contiguous and the meta kernel's
    keeps ``x``'s.)"""
    x = args[1]
    return (type(args[0]) in (int, float) and _plain_meta(x) and x.is_floating_point()
            and x.stride() == _contiguous_strides(x.shape))


def _like_exponent(base: object, x: torch.Tensor) -> torch.Tensor:
    return _contiguous_like(x)


def _division_fits(args: tuple[Any, ...]) -> bool:
    """As :func:`_binary_fits`, of a floating-point first operand (a true division of integers makes floats)."""
    return _binary_fits(args) and args[0].is_floating_point()


def _in_place_fits(args: tuple[Any, ...]) -> bool:
    """An in-place update of a dense floating-point tensor (no element written twice) by real numbers, or by a tensor
    of its shape and dtype: its result is the tensor itself."""
    x = args[0]
    if not (_plain_meta(x) and x.is_floating_point() and _dense(x)):
        return False
    return all(type(a) in (int, float) or (_plain_meta(a) and a.shape == x.shape and a.dtype == x.dtype)
               for a in args[1:])


def _sum_fits(args: tuple[Any, ...]) -> bool:
    """A floating-point input of at least one dimension and any layout, reduced over valid dimensions."""
    x, dim = args[0], args[1] if len(args) > 1 else None
    return (_plain_meta(x) and x.is_floating_point() and x.dim() > 0
            and (dim is None or (isinstance(dim, (list, tuple)) and all(type(d) is int and -x.dim() <= d < x.dim()
                                                                          for d in dim))))


def _sum_all_fits(args: tuple[Any, ...]) -> bool:
    """``sum`` of every element of a floating-point tensor of any layout (the default loss)."""
    return len(args) == 1 and _plain_meta(args[0]) and args[0].is_floating_point()


def _sum_all(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty((), dtype=dtype or x.dtype, device=x.device)


def _mean_fits(args: tuple[Any, ...]) -> bool:
    """As :func:`_sum_fits`, of a contiguous input."""
    return _sum_fits(args) and args[0].is_contiguous()


def _scaled_fits(args: tuple[Any, ...]) -> bool:
    """A floating-point tensor, dense (:func:`_elementwise_dense`) or a contiguous one expanded, and a real number."""
    x = args[0]
    return (len(args) == 2 and type(args[1]) in (int, float) and _plain_meta(x) and x.is_floating_point()
            and (_elementwise_dense(x) or _expanded_contiguous(x)))


def _new_like_fits(args: tuple[Any, ...]) -> bool:
    return len(args) == 1 and _plain_meta(args[0]) and _elementwise_dense(args[0])


def _product_fits(rank: int) -> Callable[[tuple[Any, ...]], bool]:
    """``mm`` (``rank`` 2) and ``bmm`` (3): floating-point operands of one dtype whose sizes multiply."""

    def fits(args: tuple[Any, ...]) -> bool:
        a, b = args
        return (_plain_meta(a) and _plain_meta(b) and a.dim() == b.dim() == rank and a.shape[:-2] == b.shape[:-2]
                and a.shape[-1] == b.shape[-2] and a.dtype == b.dtype and a.is_floating_point())

    return fits


def _softmax_fits(args: tuple[Any, ...]) -> bool:
    """``_softmax``, ``_log_softmax`` (not converting half to float) and ``_safe_softmax`` (no other dtype asked) of
    a contiguous floating-point tensor over one of its dimensions."""
    x, dim = args[0], args[1]
    return (_plain_meta(x) and x.is_floating_point() and x.is_contiguous() and type(dim) is int
            and -max(x.dim(), 1) <= dim < max(x.dim(), 1) and all(a is None or a is False for a in args[2:]))


def _softmax_backward_fits(args: tuple[Any, ...]) -> bool:
    """The backward of :func:`_softmax_fits`' softmax: a contiguous gradient and output of one shape and dtype, the
    input's dtype theirs."""
    grad, output, dim, input_dtype = args
    return (_softmax_fits((output, dim)) and _plain_meta(grad) and grad.is_contiguous() and grad.shape == output.shape
            and grad.dtype == output.dtype == input_dtype)


def _softmax(x: torch.Tensor, dim: int, *_: object, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A softmax's output: contiguous, of the dtype asked (``_safe_softmax``) or the input's."""
    return torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)


def _embedding_fits(args: tuple[Any, ...]) -> bool:
    """A floating-point table of rows and integer indices of any shape and layout."""
    weight, indices = args[0], args[1]
    return (_plain_meta(weight) and _plain_meta(indices) and weight.is_floating_point() and weight.dim() == 2
            and indices.dtype in (torch.int64, torch.int32))


def _embedding(weight: torch.Tensor, indices: torch.Tensor, *_: object) -> torch.Tensor:
    """The rows looked up: one per index, contiguous."""
    return torch.empty((*indices.shape, weight.shape[1]), dtype=weight.dtype, device=weight.device)


def _pieces(args: tuple[Any, ...]) -> tuple[list[torch.Tensor], int, int] | None:
    """``cat``'s and ``stack``'s tensors, dimension (0 when left out) and the first tensor's rank, when they are plain
    meta tensors, at least one, the first of a floating-point dtype, and the dimension a whole number; else None."""
    tensors, dim = args[0], args[1] if len(args) > 1 else 0
    if not (isinstance(tensors, (list, tuple)) and tensors and all(_plain_meta(t) for t in tensors)
            and type(dim) is int and tensors[0].is_floating_point()):
        return None
    return list(tensors), dim, tensors[0].dim()


def _cat_fits(args: tuple[Any, ...]) -> bool:
    """Floating-point tensors of one dtype and one number of dimensions, of equal sizes but along ``dim``, of at
    most three dimensions (whose output is contiguous whatever their layouts) or not all laid out channels-last
    (:func:`_channels_last_strides`; the output is contiguous then too: the halves of a rotated query). (No legacy
    empty 1-d tensor, which ``cat`` skips.)"""
    pieces = _pieces(args)
    if pieces is None:
        return False
    tensors, dim, rank = pieces
    if not (rank > 0 and -rank <= dim < rank and (rank <= 3 or not all(map(_channels_last_strides, tensors)))):
        return False
    first, dim = tensors[0], dim % rank
    return all(t.dtype == first.dtype and t.dim() == rank
               and all(n == m for i, (n, m) in enumerate(zip(t.shape, first.shape, strict=True)) if i != dim)
               for t in tensors)


def _channels_last_strides(x: torch.Tensor) -> bool:
    """Whether torch takes ``x``'s strides for a channels-last layout (``suggest_memory_format``; c10's
    ``is_channels_last_strides_2d`` and ``_3d``): the strides grow along channels, then the spatial dimensions from
    the last, then the batch, with ties resolved to the contiguous layout. ``cat`` makes a channels-last output of
    such tensors only, a contiguous one otherwise."""
    order = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}.get(x.dim())
    sizes, strides = x.shape, x.stride()
    if order is None or strides[1] == 0:
        return False
    low = 0
    for d in order:
        if sizes[d] == 0 or strides[d] < low or (d == 0 and low == strides[1]):
            return False
        low = strides[d] * max(sizes[d], 1)
    return True


def _stack_fits(args: tuple[Any, ...]) -> bool:
    """Floating-point tensors of one shape and dtype, stacked along a valid dimension, none laid out channels-last
    (:func:`_channels_last_strides`; of such pieces the output keeps their order of dimensions)."""
    pieces = _pieces(args)
    if pieces is None:
        return False
    tensors, dim, rank = pieces
    first = tensors[0]
    if not (-rank - 1 <= dim <= rank and all(t.dtype == first.dtype and t.shape == first.shape for t in tensors)):
        return False
    return not any(map(_channels_last_strides, tensors))


def _stack(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The tensors stacked along a new dimension ``dim``: contiguous."""
    first = tensors[0]
    dim %= first.dim() + 1
    shape = [*first.shape[:dim], len(tensors), *first.shape[dim:]]
    return torch.empty(shape, dtype=first.dtype, device=first.device)


def _cat(tensors: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """The tensors one after the other along ``dim``: contiguous."""
    first = tensors[0]
    dim %= first.dim()
    shape = [sum(t.shape[dim] for t in tensors) if i == dim else n for i, n in enumerate(first.shape)]
    return torch.empty(shape, dtype=first.dtype, device=first.device)


def _zeros_around_fits(args: tuple[Any, ...]) -> bool:
    """``select_backward`` / ``slice_backward``: a floating-point gradient and the input's sizes."""
    return (_plain_meta(args[0]) and args[0].is_floating_point() and isinstance(args[1], (list, tuple))
            and all(type(n) is int and n >= 0 for n in args[1]))


def _zeros_around(grad: torch.Tensor, input_sizes: list[int], *_: object) -> torch.Tensor:
    """The gradient of a selection or a slice: zeros of the input's sizes (contiguous) around the gradient."""
    return torch.empty(tuple(input_sizes), dtype=grad.dtype, device=grad.device)


def _pointwise_backward_fits(args: tuple[Any, ...]) -> bool:
    """A gradient and a tensor as :func:`_same_float_operands` (``threshold_backward``, ``gelu_backward``, ...), or a
    gradient of one value expanded (the gradient of a sum: strides all 0) and a contiguous tensor of its shape and
    dtype; then real numbers."""
    if not all(type(a) in (int, float) for a in args[2:]):
        return False
    return _same_float_operands(args) or _expanded_value_and_contiguous(args[0], args[1])


def _expanded_value_and_contiguous(grad: Any, x: Any) -> bool:
    """``grad`` one value expanded to ``x``'s shape (strides all 0: the gradient of a sum), ``x`` a contiguous
    floating-point tensor of its dtype."""
    return (_plain_meta(grad) and _plain_meta(x) and x.is_floating_point() and grad.dtype == x.dtype
            and grad.shape == x.shape and not any(grad.stride()) and x.stride() == _contiguous_strides(x.shape))


def _two_operands(a: torch.Tensor, b: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    """The output of an element-wise operator on two tensors of one shape (a gradient and an activation, say): the
    first's layout (:func:`_elementwise_like`), or the second's, contiguous, when the first is one value expanded
    (:func:`_expanded_value_and_contiguous`): the kernels skip strides of 0, and the second decides."""
    if not any(a.stride()) and a.dim() > 0:
        return _contiguous_like(b)
    return _elementwise_like(a)


def _gradient_fits(grad: Any, x: Any) -> bool:
    """A floating-point ``x`` and a gradient of its shape and dtype, of any layout."""
    return (_plain_meta(x) and _plain_meta(grad) and x.is_floating_point() and grad.shape == x.shape
            and grad.dtype == x.dtype)


def _batch_norm_backward_fits(args: tuple[Any, ...]) -> bool:
    """An input of at least two dimensions, contiguous or channels-last (its gradient keeps the layout), an optional
    weight of its dtype and running statistics, one per channel, and the statistics the forward saved (none from the
    CPU kernel in eval mode)."""
    grad, x, weight = args[:3]
    if not (_gradient_fits(grad, x) and x.dim() > 1 and (x.is_contiguous() or _channels_last(x))
            and (weight is None or weight.dtype == x.dtype)):
        return False
    channels = (x.shape[1],)
    return (all(t is None or (_plain_meta(t) and tuple(t.shape) == channels) for t in args[2:5])
            and all(t is None or (_plain_meta(t) and tuple(t.shape) in (channels, (0,))) for t in args[5:7]))


def _channels_last(x: torch.Tensor) -> bool:
    memory_format = _CHANNELS_LAST.get(x.dim())
    return memory_format is not None and x.is_contiguous(memory_format=memory_format)


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}  # by the number of dimensions


def _layer_norm_backward_fits(args: tuple[Any, ...]) -> bool:
    """A contiguous input normalised over its last dimensions, a contiguous gradient or one expanded (of a sum); a
    weight and a bias of those dimensions and of the input's dtype where their gradients are asked for. (With other
    layouts torch's meta kernel keeps the input's or the gradient's in some cases and not in others.)"""
    grad, x, shape, _, _, weight, bias, mask = args
    if not (_gradient_fits(grad, x) and x.is_contiguous() and _expanded_contiguous(grad) and 0 < len(shape) <= x.dim()
            and tuple(x.shape[x.dim() - len(shape):]) == tuple(shape)):
        return False
    return all(t is not None and _plain_meta(t) and tuple(t.shape) == tuple(shape) and t.dtype == x.dtype
               for t, wanted in ((weight, mask[1]), (bias, mask[2])) if wanted)


def _convolution_backward_fits(args: tuple[Any, ...]) -> bool:
    """The backward of a convolution :func:`_convolution_fits` accepts: its arguments, its output's gradient."""
    grad, x, weight, bias_sizes = args[:4]
    forward = (x, weight, None, *args[4:10])
    return (_convolution_fits(forward) and _plain_meta(grad) and grad.dtype == x.dtype
            and tuple(grad.shape) == (x.shape[0], weight.shape[0], *_convolved(x, weight, *args[4:7]))
            and list(bias_sizes) in ([0], [weight.shape[0]]))


def _max_pool2d_fits(args: tuple[Any, ...]) -> bool:
    """A contiguous floating-point input of 3 or 4 dimensions, none empty but the batch, whole numbers for the
    geometry (torch's errors for impossible ones), a window at least one position and no wider than twice the
    padding."""
    x, kernel = args[0], args[1]
    geometry = [kernel, args[2] if len(args) > 2 and args[2] else kernel,
                _pair(args[3] if len(args) > 3 else 0), _pair(args[4] if len(args) > 4 else 1)]
    if not (_plain_meta(x) and x.is_floating_point() and x.dim() in (3, 4) and x.is_contiguous()
            and 0 not in x.shape[-3:] and all(isinstance(v, (list, tuple)) and len(v) == 2
                                              and all(type(i) is int for i in v) for v in geometry)):
        return False
    kernel, stride, padding, dilation = geometry
    if min(kernel) <= 0 or min(stride) <= 0 or min(dilation) <= 0 or min(padding) < 0:
        return False
    if any(2 * pad > k for pad, k in zip(padding, kernel, strict=True)):
        return False
    ceil_mode = bool(args[5]) if len(args) > 5 else False
    return min(_pooled_sizes(x, kernel, stride, padding, dilation, ceil_mode)) > 0


def _max_pool2d_backward_fits(args: tuple[Any, ...]) -> bool:
    """The backward of a pooling :func:`_max_pool2d_fits` accepts (its gradient is like the contiguous input)."""
    grad, x, indices = args[0], args[1], args[7]
    return (_max_pool2d_fits((x, *args[2:7])) and _plain_meta(grad) and grad.dtype == x.dtype
            and _plain_meta(indices) and grad.shape == indices.shape)


def _flash_fits(args: tuple[Any, ...]) -> bool:
    """The CPU flash kernel's query, key and value: 4-D, floating point, the query dense (its layout is kept)."""
    q, k, v = args[:3]
    return (all(_plain_meta(t) and t.dim() == 4 and t.dtype == q.dtype for t in (q, k, v)) and q.dtype in _FLOATS
            and (_dense(q) or _distinct_strides(q)))


def _flash(q: torch.Tensor, *_: object, **__: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Its meta kernel's outputs: the attention in the query's layout (ordered by its strides when it is a view that is
    not dense: one third of a fused projection), and the log-sum-exp per (batch, head, position), in float32 for half
    precision, laid out position-major. (The meta kernel's ``empty_like`` is a Python reference whose first call
    imports sympy: every transformer's attention.)"""
    batch, heads, positions = q.shape[:3]
    stats = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    attention = _like(q) if _dense(q) else _by_strides(q)
    return attention, torch.empty((batch, positions, heads), dtype=stats, device=q.device).transpose(1, 2)


def _arange_fits(args: tuple[Any, ...]) -> bool:
    """Whole numbers (no bool) with a step that reaches the end: the count of values is exact integer arithmetic."""
    if not all(type(a) is int for a in args):
        return False
    start, end, step = _bounds(args)
    return step != 0 and (end - start) * step >= 0


def _bounds(args: tuple[int, ...]) -> tuple[int, ...]:
    """(start, end, step) of ``arange``'s arguments: (end), (start, end) or (start, end, step)."""
    if len(args) == 1:
        return 0, args[0], 1
    if len(args) == 2:
        return args[0], args[1], 1
    return args


def _arange(op: Any) -> Callable[..., torch.Tensor]:
    """``arange`` on the meta device of whole numbers: ceil((end - start) / step) values, contiguous, int64 unless a
    dtype is asked; anywhere else, or with a layout or pinned memory asked, torch's own kernel. (Its meta kernel is a
    Python reference whose first call imports sympy and ``torch._dynamo``: positions in every language model.)"""

    def kernel(*args: int, dtype: torch.dtype | None = None, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if (device is None or torch.device(device).type != "meta" or dtype not in _ARANGE_DTYPES
                or any(value not in (None, False, torch.strided) for value in kwargs.values())):
            return op(*args, dtype=dtype, device=device, **kwargs)
        start, end, step = _bounds(args)
        return torch.empty((-((start - end) // step),), dtype=dtype or torch.int64, device=device)

    return kernel


_ARANGE_DTYPES = (None, torch.int64, torch.int32, *_FLOATS)


def _roll_fits(args: tuple[Any, ...]) -> bool:
    """A contiguous output; a 4-D or 5-D input keeps a channels-last layout (not made here)."""
    return _plain_meta(args[0]) and (args[0].dim() < 4 or args[0].is_contiguous())


def _quantized_fits(dtype_at: int) -> Callable[[tuple[Any, ...]], bool]:
    """A meta input whose quantized dtype is given positionally at ``dtype_at``."""
    def fits(args: tuple[Any, ...]) -> bool:
        return _plain_meta(args[0]) and len(args) > dtype_at

    return fits


def _quantized(dtype_at: int) -> Callable[..., torch.Tensor]:
    """``quantize_per_tensor`` & co. on meta: the output in the quantized dtype asked (one byte an element for
    qint8/quint8) — the meta kernels make it in the input's float dtype, four times the CPU's bytes, and every later
    operator would take a float tensor where the CPU gives a quantized one. Contiguous, or channels-last for a
    channels-last input, as the CPU's kernel makes it (its input's suggested memory format)."""

    def kernel(*args: Any, **_: Any) -> torch.Tensor:
        x = args[0]
        return torch.empty(x.shape, dtype=args[dtype_at], device=x.device, memory_format=_suggested_format(x))

    return kernel


def _suggested_format(x: torch.Tensor) -> torch.memory_format:
    """The memory format the CPU's kernels give a new tensor made from ``x`` (torch's ``suggest_memory_format``)."""
    if x.is_contiguous():
        return torch.contiguous_format
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format

_aten = torch.ops.aten
IN_PLACE = (_aten.sigmoid_.default, _aten.tanh_.default, _aten.relu_.default, _aten.silu_.default,
            _aten.gelu_.default, _aten.exp_.default, _aten.neg_.default, _aten.hardtanh_.default,
            _aten.leaky_relu_.default, _aten.clamp_.default, _aten.add_.Tensor, _aten.sub_.Tensor,
            _aten.mul_.Tensor, _aten.div_.Tensor, _aten.mul_.Scalar, _aten.div_.Scalar)
# operator -> (when the direct kernel applies, the direct kernel); checked against torch's kernels in
# tests/test_meta_kernels.py
_DIRECT: dict[Any, tuple[Callable[[tuple[Any, ...]], bool], Callable[..., Any]]] = {
    _aten.native_batch_norm.default: (_batch_norm_fits, _batch_norm),
    _aten.native_layer_norm.default: (_layer_norm_fits, _layer_norm),
    _aten.addmm.default: (_addmm_fits, _addmm),
    _aten.convolution.default: (_any_convolution_fits, _any_convolution),
    _aten.native_group_norm.default: (_group_norm_fits, _group_norm),
    _aten.native_group_norm_backward.default: (_group_norm_backward_fits, _group_norm_backward),
    **{op: (_unary_or_view_fits, _unary) for op in (
        _aten.gelu.default, _aten.relu.default, _aten.silu.default, _aten.sigmoid.default, _aten.tanh.default,
        _aten.neg.default, _aten.exp.default, _aten.log.default, _aten.sqrt.default, _aten.rsqrt.default,
        _aten.reciprocal.default, _aten.abs.default, _aten.sin.default, _aten.cos.default, _aten.erf.default,
        _aten.hardswish.default, _aten.hardsigmoid.default, _aten.mish.default)},
    **{op: (_with_scalars_fits, _like) for op in (
        _aten.hardtanh.default, _aten.leaky_relu.default, _aten.elu.default, _aten.softplus.default,
        _aten.pow.Tensor_Scalar, _aten.clamp.default)},
    _aten.add.Tensor: (_binary_fits, _elementwise),
    _aten.sub.Tensor: (_binary_fits, _elementwise),
    _aten.mul.Tensor: (_binary_fits, _elementwise),
    _aten.div.Tensor: (_division_fits, _elementwise),
    _aten.pow.Scalar: (_scalar_base_fits, _like_exponent),
    # in place (an LSTM cell's gates: sigmoid_, tanh_, add_)
    **{op: (_in_place_fits, _self) for op in IN_PLACE},
    _aten.roll.default: (_roll_fits, _contiguous_like),
    _aten.mean.dim: (_mean_fits, _mean),
    _aten.sum.dim_IntList: (_sum_fits, _sum),
    _aten.sum.default: (_sum_all_fits, _sum_all),
    # a training step: the loss's seed gradient, dropout's mask, the backward kernels
    **{op: (_new_like_fits, _new_like(op)) for op in (
        _aten.ones_like.default, _aten.empty_like.default, _aten.clone.default)},
    **{op: (_softmax_fits, _softmax) for op in (
        _aten._softmax.default, _aten._log_softmax.default, _aten._safe_softmax.default)},
    **{op: (_softmax_backward_fits, _contiguous_like) for op in (
        _aten._softmax_backward_data.default, _aten._log_softmax_backward_data.default)},
    **{op: (_zeros_around_fits, _zeros_around) for op in (
        _aten.select_backward.default, _aten.slice_backward.default)},
    **{op: (_scaled_fits, _scaled) for op in (_aten.mul.Scalar, _aten.div.Scalar)},
    _aten.mm.default: (_product_fits(2), _matrix_product),
    _aten.bmm.default: (_product_fits(3), _matrix_product),
    _aten.max_pool2d_with_indices.default: (_max_pool2d_fits, _max_pool2d),
    _aten.max_pool2d_with_indices_backward.default: (_max_pool2d_backward_fits, _like_input),
    **{op: (_pointwise_backward_fits, _two_operands) for op in (
        _aten.threshold_backward.default, _aten.gelu_backward.default, _aten.tanh_backward.default,
        _aten.sigmoid_backward.default, _aten.silu_backward.default, _aten.hardtanh_backward.default)},
    _aten.embedding.default: (_embedding_fits, _embedding),
    _aten.cat.default: (_cat_fits, _cat),
    _aten.stack.default: (_stack_fits, _stack),
    _FLASH: (_flash_fits, _flash),
    **{op: (_arange_fits, _arange(op)) for op in (_aten.arange.default, _aten.arange.start, _aten.arange.start_step)},
    _aten.native_batch_norm_backward.default: (_batch_norm_backward_fits, _batch_norm_backward),
    # quantization: the output in the quantized dtype (its position in each schema)
    _aten.quantize_per_tensor.default: (_quantized_fits(3), _quantized(3)),
    _aten.quantize_per_tensor.tensor_qparams: (_quantized_fits(3), _quantized(3)),
    _aten.quantize_per_channel.default: (_quantized_fits(4), _quantized(4)),
    _aten.quantize_per_tensor_dynamic.default: (_quantized_fits(1), _quantized(1)),
    _aten.native_layer_norm_backward.default: (_layer_norm_backward_fits, _layer_norm_backward),
    _aten.convolution_backward.default: (_any_convolution_backward_fits, _any_convolution_backward),
}


# --- the CPU's norm dtypes on stand-ins --------------------------------------------------------------------------
def _on_cpu_stand_in(tensor: torch.Tensor) -> bool:
    """A tensor without values standing for a CPU tensor: a FakeTensor on the CPU, or meta standing for the CPU."""
    if tensor.is_meta:
        return recorded_device() == "cpu"
    return isinstance(tensor, FakeTensor) and tensor.device.type == "cpu"


def _norm_statistics(parameters: tuple[int, ...]) -> Callable[[tuple[Any, ...], Any], Any]:
    """A forward norm's outputs ``(out, mean, rstd)`` with the statistics in :func:`_stats_dtype` (the CPU's
    kernels: float32 for a half input beside float32 weights or running statistics); ``parameters``: where the
    weights and statistics are among the arguments."""

    def fixed(args: tuple[Any, ...], result: Any) -> Any:
        out, mean, rstd = result
        stats = _stats_dtype(args[0].dtype, tuple(args[i] for i in parameters if i < len(args)))
        if mean.dtype == stats:
            return result
        return out, torch.empty_like(mean, dtype=stats), torch.empty_like(rstd, dtype=stats)

    return fixed


def _group_norm_backward_dtype(args: tuple[Any, ...], result: Any) -> Any:
    """``native_group_norm_backward``: the CPU's input gradient is in the input's dtype (the stand-ins' kernel
    makes it in the statistics' float32)."""
    grad_input, *rest = result
    if grad_input is None or grad_input.dtype == args[1].dtype:
        return result
    return (torch.empty_like(grad_input, dtype=args[1].dtype), *rest)


_CPU_DTYPES: dict[Any, Callable[[tuple[Any, ...], Any], Any]] = {
    _aten.native_batch_norm.default: _norm_statistics((1, 2, 3, 4)),
    _aten.native_layer_norm.default: _norm_statistics((2, 3)),
    _aten.native_group_norm.default: _norm_statistics((1, 2)),
    _aten.native_group_norm_backward.default: _group_norm_backward_dtype,
}


def with_cpu_dtypes(func: object, args: tuple[Any, ...], result: Any) -> Any:
    """``result`` of ``func`` on stand-ins for CPU tensors, with the dtypes the CPU's kernels give where a fake or
    meta kernel gives others (normalisations of half inputs, as autocast or a half model with float32 norms runs
    them); any other result as it is."""
    fix = _CPU_DTYPES.get(func)
    if fix is None or not args or not isinstance(args[0], torch.Tensor) or not _on_cpu_stand_in(args[0]):
        return result
    return fix(args, result)


def fast_meta_kernel(func: object, args: tuple[Any, ...]) -> Callable[..., Any] | None:
    """A direct implementation of ``func`` for these arguments when its meta kernel is slow, else None."""
    entry = direct_kernel(func)
    if entry is None or not entry[0](args):
        return None
    return entry[1]


def direct_kernel(func: object) -> tuple[Callable[[tuple[Any, ...]], bool], Callable[..., Any]] | None:
    """(test of the arguments, direct implementation) for an operator that has one, else None."""
    return _DIRECT.get(func)
