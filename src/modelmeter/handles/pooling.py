"""Pooling and resampling of every dimension: max/avg/adaptive/fractional pooling, upsampling in every
mode (antialiased too) and ``grid_sample``, forward and backward.

``flops`` convention (``K`` elements per pooling window, ``T`` interpolation taps per output element),
with the accumulator rule of :mod:`.reductions` and of the matrix products (a dot product of length
``K`` is ``K`` multiply-adds, ``2K`` flops): every element entering a window costs one flop.

- max pooling: a comparison per input element a window reads (``K`` per output element, less where a window is
  clipped by padding or ``ceil_mode``: torch's kernels read only the input); adaptive windows counted exactly;
- average pooling: those adds and a divide per output element; adaptive windows exactly;
- interpolation: ``T`` multiply-adds, ``2T`` per output element, with ``T = 2^d`` for (bi/tri)linear and
  ``4^d`` for bicubic; nearest-neighbour modes copy (0); the per-index weights, shared by every channel, are not
  counted. Antialiased filters: the exact number of taps of their support (torch multiplies by every weight of
  it), which grows with the downscale factor, counted as torch's CPU kernel runs them — separably, the width
  resized first (each input row), then the height (each output column), a dimension of unchanged size skipped;
- backward, as scatters of the output gradient (one add per element accumulated): max pooling ``1`` per
  output-gradient element, average pooling as its forward (a divide, and the adds of its clipped windows), nearest
  ``1``, interpolation ``2T`` (``T`` multiplies, ``T`` adds; antialiased: every 2-D tap, as torch's CPU kernel
  scatters them); ``grid_sample``: ``2T`` for the input
  gradient and ``2T`` for the grid gradient per output-gradient element.

``fvcore``: fvcore's estimates where fvcore has one — adaptive average pooling 1 per input element,
nearest upsampling 1 and bilinear upsampling and ``grid_sample`` 4 per output element — with the same
estimate per element for their backward operators; everything else here (max and average pooling,
the other upsampling modes) is free, as in fvcore. ``macs``: all free.
"""

from __future__ import annotations

import math
from typing import Any

from .base import Handle, prod, shape_of
from .binding import Formula, bind_all, by_name
from .common import Table, by_convention, float_numel, spatial, window


def _covered(size_in: int, kernel: int, dilation: int, start: int) -> int:
    """Input positions ``start + j·dilation`` (``0 <= j < kernel``) inside ``[0, size_in)``."""
    first = max(0, -(start // dilation))
    last = min(kernel - 1, (size_in - 1 - start) // dilation)
    return max(0, last - first + 1)


def _dimension_taps(size_in: int, size_out: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """Sum over the windows of one dimension of the input positions each reads: torch's pooling kernels clip every
    window to the input, so padding and a ``ceil_mode`` window's overhang are not read. Windows wholly inside read
    ``kernel``; only those at the two edges are counted one by one."""
    left = min(size_out, -(-padding // stride))  # windows starting before the input
    right = max(left, min(size_out, (size_in - 1 + padding - (kernel - 1) * dilation) // stride + 1))
    edges = [*range(left), *range(right, size_out)]
    return (right - left) * kernel + sum(_covered(size_in, kernel, dilation, o * stride - padding) for o in edges)


def _window_taps(x: Any, out: Any, dims: int, kernel_size: Any, stride: Any, padding: Any, dilation: Any) -> int:
    """Input elements read by all the windows of pooling ``x`` to ``out`` (batch and channels included)."""
    kernel = spatial(kernel_size, dims)
    strides = spatial(stride, dims) if stride else kernel  # (an empty stride is the kernel's)
    pads, dilations = spatial(padding, dims), spatial(dilation, dims)
    x_shape, out_shape = shape_of(x), shape_of(out)
    taps = prod(_dimension_taps(*sizes) for sizes in zip(
        x_shape[-dims:], out_shape[-dims:], kernel, strides, pads, dilations, strict=True))
    return prod(out_shape[:-dims]) * taps


def max_pool_counter(dims: int) -> Formula[int]:
    """``max_pool{d}d(self, kernel_size, stride, padding, dilation, ...)``: a comparison per input element each
    window reads."""

    @by_name
    def max_pool_flops(self: Any, kernel_size: Any, stride: Any = (), padding: Any = 0, dilation: Any = 1, *,
                       result: Any) -> int:
        return _window_taps(self, result, dims, kernel_size, stride, padding, dilation) if float_numel(result) else 0

    return max_pool_flops


def fractional_max_pool_counter(dims: int) -> Formula[int]:
    """``fractional_max_pool{d}d(self, kernel_size, ...)``: ``K`` comparisons per output element (its windows lie
    inside the input)."""

    @by_name
    def fractional_max_pool_flops(kernel_size: Any, *, result: Any) -> int:
        return float_numel(result) * window(kernel_size, dims)

    return fractional_max_pool_flops


def avg_pool_counter(dims: int) -> Formula[int]:
    """``avg_pool{d}d(self, kernel_size, stride, padding, ...)``: an add per input element each window reads and
    one divide per output element."""

    @by_name
    def avg_pool_flops(self: Any, kernel_size: Any, stride: Any = (), padding: Any = 0, *, result: Any) -> int:
        n_out = float_numel(result)
        return _window_taps(self, result, dims, kernel_size, stride, padding, 1) + n_out if n_out else 0

    return avg_pool_flops


def avg_pool_backward_counter(dims: int) -> Formula[int]:
    """``avg_pool{d}d_backward(grad_output, self, kernel_size, stride, padding, ...)``: per gradient element a divide,
    and an add per input element its window reads."""

    @by_name
    def avg_pool_backward_flops(grad_output: Any, self: Any, kernel_size: Any, stride: Any, padding: Any) -> int:
        n_out = float_numel(grad_output)
        return _window_taps(self, grad_output, dims, kernel_size, stride, padding, 1) + n_out if n_out else 0

    return avg_pool_backward_flops


@by_name
def scatter_gradient_flops(grad_output: Any) -> int:
    """Backward of a selection (max pooling, nearest upsampling): one add per output-gradient element."""
    return float_numel(grad_output)


def _window_sums(size_in: int, size_out: int) -> int:
    """Sum over the adaptive windows of one dimension of their lengths (torch's start/end rule, in integers as torch
    computes it: a float quotient loses the exact count past 2**53)."""
    return sum(-(-(i + 1) * size_in // size_out) - (i * size_in) // size_out for i in range(size_out))


def _adaptive(x: Any, out: Any, dims: int) -> tuple[int, int]:
    """(elements in all adaptive windows, output elements) of pooling ``x`` to ``out``'s last ``dims`` sizes."""
    x_shape, out_shape = shape_of(x), shape_of(out)
    lead = prod(x_shape[:-dims])
    spatial_in, spatial_out = x_shape[-dims:], out_shape[-dims:]
    taps = prod(_window_sums(i, o) for i, o in zip(spatial_in, spatial_out, strict=True))
    return lead * taps, lead * prod(spatial_out)


def adaptive_avg_pool_counter(dims: int) -> Formula[int]:
    """``adaptive_avg_pool{d}d``: each output sums its window and divides: window size + 1 per output element
    (as ``mean``, which torch runs for an output size of 1)."""

    @by_name
    def adaptive_avg_pool_flops(self: Any, *, result: Any) -> int:
        return sum(_adaptive(self, result, dims)) if float_numel(self) else 0

    return adaptive_avg_pool_flops


def adaptive_avg_pool_backward_counter(dims: int) -> Formula[int]:
    """``_adaptive_avg_pool{d}d_backward(grad_output, self)``: a divide and window-size adds per gradient element."""

    @by_name
    def adaptive_avg_pool_backward_flops(grad_output: Any, self: Any) -> int:
        taps, n_out = _adaptive(self, grad_output, dims)
        return taps + n_out if float_numel(grad_output) else 0

    return adaptive_avg_pool_backward_flops


def adaptive_max_pool_counter(dims: int) -> Formula[int]:
    """``adaptive_max_pool{d}d``: window-size comparisons per output element."""

    @by_name
    def adaptive_max_pool_flops(self: Any, *, result: Any) -> int:
        return _adaptive(self, result, dims)[0] if float_numel(self) else 0

    return adaptive_max_pool_flops


# --- interpolation --------------------------------------------------------------------------------
def interpolate_counter(taps_per_dim: int, dims: int) -> Formula[int]:
    """Upsampling with ``T = taps_per_dim^dims`` taps: ``2T`` flops per output element."""
    taps = taps_per_dim ** dims

    @by_name
    def interpolate_flops(*, result: Any) -> int:
        return float_numel(result) * 2 * taps

    return interpolate_flops


def interpolate_backward_counter(taps_per_dim: int, dims: int) -> Formula[int]:
    """Backward of upsampling with ``T`` taps: ``2T`` per output-gradient element (multiply and accumulate)."""
    taps = taps_per_dim ** dims

    @by_name
    def interpolate_backward_flops(grad_output: Any) -> int:
        return float_numel(grad_output) * 2 * taps

    return interpolate_backward_flops


def _aa_taps(size_in: int, size_out: int, interp_size: int, align_corners: bool, user_scale: Any) -> int:
    """Taps of torch's antialiased filter summed over one dimension's outputs: the support and window of
    ``_compute_indices_min_size_weights_aa``, the scale of ``area_pixel_compute_scale``."""
    if align_corners:
        scale = (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
    else:
        scale = 1 / user_scale if isinstance(user_scale, (int, float)) and user_scale > 0 else size_in / size_out
    support = interp_size / 2 * scale if scale >= 1.0 else interp_size / 2
    widest = math.ceil(support) * 2 + 1
    total = 0
    for i in range(size_out):
        center = scale * (i + 0.5)
        low = max(int(center - support + 0.5), 0)
        total += min(max(min(int(center + support + 0.5), size_in) - low, 0), widest)
    return total


def _aa_dimension_taps(small: Any, big: Any, interp_size: int, align_corners: Any, scales: list[Any]
                       ) -> tuple[list[int], list[int], list[int]]:
    """(sizes of ``small``, sizes of ``big``, the filter's taps summed over ``big``'s positions) per resized
    dimension (height, width); ``big`` is the side the filter is evaluated at (the output, the output gradient)."""
    x, out = shape_of(small)[-2:], shape_of(big)[-2:]
    taps = [_aa_taps(i, o, interp_size, bool(align_corners), s) for i, o, s in zip(x, out, scales, strict=True)]
    return x, out, taps


def _aa_separable_flops(x: Any, out: Any, interp_size: int, align_corners: Any, scales: list[Any]) -> int:
    """Forward: torch's CPU kernel resizes one dimension at a time, the width first (every input row), then the
    height (every output column); a dimension whose size does not change is not resized. ``2`` per tap."""
    (h_in, w_in), (h_out, w_out), (taps_h, taps_w) = _aa_dimension_taps(x, out, interp_size, align_corners, scales)
    macs = (h_in * taps_w if w_out != w_in else 0) + (w_out * taps_h if h_out != h_in else 0)
    return 2 * prod(shape_of(out)[:-2]) * macs


def _aa_backward_flops(grad_input: Any, grad_output: Any, interp_size: int, align_corners: Any,
                       scales: list[Any]) -> int:
    """Backward: torch's CPU kernel scatters each output-gradient element to every 2-D tap of its filter, ``2T``
    per element (``T`` its taps), the weight products shared by the channels not counted."""
    _, _, (taps_h, taps_w) = _aa_dimension_taps(grad_input, grad_output, interp_size, align_corners, scales)
    return 2 * prod(shape_of(grad_output)[:-2]) * taps_h * taps_w


def _scales(first: Any, second: Any) -> list[Any]:
    """The per-dimension scales: ``scales_h, scales_w``, or a ``.vec`` call's ``scale_factors`` list (which a
    user-level call places where ``scales_h`` is: both overloads take four positional arguments)."""
    if isinstance(first, (list, tuple)):
        return list(first) if len(first) == 2 else [None, None]
    return [first, second]


def aa_counter(interp_size: int) -> Formula[int]:
    """``_upsample_{bilinear,bicubic}2d_aa`` (``antialias=True``): the filter's exact taps, separably: ``2`` per tap
    of the width pass over the input's rows and of the height pass over the output's columns."""

    @by_name(self="input", scales_h="scale_factors")
    def aa_flops(self: Any, align_corners: Any, scales_h: Any = None, scales_w: Any = None, *, result: Any) -> int:
        return _aa_separable_flops(self, result, interp_size, align_corners, _scales(scales_h, scales_w))

    return aa_flops


def aa_backward_counter(interp_size: int) -> Formula[int]:
    """``_upsample_{bilinear,bicubic}2d_aa_backward``: ``2T`` per output-gradient element."""

    @by_name
    def aa_backward_flops(grad_output: Any, align_corners: Any, scales_h: Any = None, scales_w: Any = None, *,
                          result: Any) -> int:
        return _aa_backward_flops(result, grad_output, interp_size, align_corners, _scales(scales_h, scales_w))

    return aa_backward_flops


def _grid_taps(mode: Any, dims: int) -> int:
    return {0: 2 ** dims, 1: 1, 2: 4 ** dims}.get(mode, 2 ** dims)


def grid_sampler_counter(dims: int) -> Formula[int]:
    """``grid_sampler_{2,3}d(input, grid, interpolation_mode, ...)``: ``2T`` per output element (nearest: 0)."""

    @by_name
    def grid_sampler_flops(interpolation_mode: Any, *, result: Any) -> int:
        if interpolation_mode == 1:
            return 0
        return float_numel(result) * 2 * _grid_taps(interpolation_mode, dims)

    return grid_sampler_flops


def grid_sampler_backward_counter(dims: int) -> Formula[int]:
    """``grid_sampler_{2,3}d_backward(grad_output, input, grid, interpolation_mode, ..., output_mask)``: ``2T`` per
    output-gradient element for the input gradient and ``2T`` for the grid gradient (nearest: ``1`` and 0)."""

    @by_name
    def grid_sampler_backward_flops(grad_output: Any, interpolation_mode: Any, output_mask: Any = None) -> int:
        mask = output_mask if isinstance(output_mask, (list, tuple)) else [True, True]
        n, taps = float_numel(grad_output), _grid_taps(interpolation_mode, dims)
        if interpolation_mode == 1:
            return n * bool(mask[0])
        return n * 2 * taps * (bool(mask[0]) + bool(mask[1]))

    return grid_sampler_backward_flops


# --- fvcore's estimates -------------------------------------------------------------------------
def fvcore_per_input(scale: int) -> Formula[int]:
    """``scale`` per element of the input (``self``)."""

    @by_name
    def fvcore_input_estimate(self: Any) -> int:
        return scale * float_numel(self)

    return fvcore_input_estimate


def fvcore_per_gradient(scale: int) -> Formula[int]:
    """``scale`` per element of the output gradient (``grad_output``)."""

    @by_name
    def fvcore_gradient_estimate(grad_output: Any) -> int:
        return scale * float_numel(grad_output)

    return fvcore_gradient_estimate


def fvcore_per_output(scale: int) -> Formula[int]:
    """``scale`` per element of the output."""

    @by_name
    def fvcore_output_estimate(*, result: Any) -> int:
        return scale * float_numel(result)

    return fvcore_output_estimate


_D = (1, 2, 3)
_LINEAR = {"upsample_linear1d": 1, "upsample_bilinear2d": 2, "upsample_trilinear3d": 3}
_NEAREST = [f"upsample_nearest{d}d" for d in _D] + [f"_upsample_nearest_exact{d}d" for d in _D]

FLOPS: dict[str, Handle | None] = bind_all({
    **{f"aten::max_pool{d}d_with_indices": max_pool_counter(d) for d in _D},
    **{f"aten::max_pool{d}d": max_pool_counter(d) for d in _D},
    "aten::mkldnn_max_pool2d": max_pool_counter(2),
    "aten::mkldnn_max_pool3d": max_pool_counter(3),
    **{f"aten::max_pool{d}d_with_indices_backward": scatter_gradient_flops for d in (2, 3)},
    "aten::max_pool2d_backward": scatter_gradient_flops,
    **{f"aten::fractional_max_pool{d}d": fractional_max_pool_counter(d) for d in (2, 3)},
    **{f"aten::fractional_max_pool{d}d_backward": scatter_gradient_flops for d in (2, 3)},
    **{f"aten::avg_pool{d}d": avg_pool_counter(d) for d in _D},
    **{f"aten::avg_pool{d}d_backward": avg_pool_backward_counter(d) for d in (2, 3)},
    **{f"aten::{p}adaptive_avg_pool{d}d": adaptive_avg_pool_counter(d) for d in _D for p in ("", "_")},
    **{f"aten::{p}adaptive_avg_pool{d}d_backward": adaptive_avg_pool_backward_counter(d) for d in (2, 3)
       for p in ("", "_")},
    **{f"aten::adaptive_max_pool{d}d": adaptive_max_pool_counter(d) for d in _D},
    **{f"aten::adaptive_max_pool{d}d_backward": scatter_gradient_flops for d in (2, 3)},
    **{f"aten::{op}": None for op in ("max_unpool2d", "max_unpool3d")},
    **{f"aten::{op}": None for op in _NEAREST},
    **{f"aten::{op}_backward": scatter_gradient_flops for op in _NEAREST},
    **{f"aten::{op}": interpolate_counter(2, d) for op, d in _LINEAR.items()},
    **{f"aten::{op}_backward": interpolate_backward_counter(2, d) for op, d in _LINEAR.items()},
    "aten::upsample_bicubic2d": interpolate_counter(4, 2),
    "aten::upsample_bicubic2d_backward": interpolate_backward_counter(4, 2),
    "aten::_upsample_bilinear2d_aa": aa_counter(2),
    "aten::_upsample_bilinear2d_aa_backward": aa_backward_counter(2),
    "aten::_upsample_bicubic2d_aa": aa_counter(4),
    "aten::_upsample_bicubic2d_aa_backward": aa_backward_counter(4),
    **{f"aten::grid_sampler_{d}d": grid_sampler_counter(d) for d in (2, 3)},
    "aten::_grid_sampler_2d_cpu_fallback": grid_sampler_counter(2),
    **{f"aten::grid_sampler_{d}d_backward": grid_sampler_backward_counter(d) for d in (2, 3)},
    "aten::_grid_sampler_2d_cpu_fallback_backward": grid_sampler_backward_counter(2),
})

FVCORE: dict[str, Handle] = bind_all({
    **{f"aten::{p}adaptive_avg_pool{d}d": fvcore_per_input(1) for d in _D for p in ("", "_")},
    **{f"aten::{p}adaptive_avg_pool{d}d_backward": fvcore_per_input(1) for d in (2, 3) for p in ("", "_")},
    **{f"aten::{op}": fvcore_per_output(1) for op in _NEAREST},
    **{f"aten::{op}_backward": fvcore_per_gradient(1) for op in _NEAREST},
    "aten::upsample_bilinear2d": fvcore_per_output(4),
    "aten::upsample_bilinear2d_backward": fvcore_per_gradient(4),
    **{f"aten::grid_sampler_{d}d": fvcore_per_output(4) for d in (2, 3)},
    "aten::_grid_sampler_2d_cpu_fallback": fvcore_per_output(4),
    **{f"aten::grid_sampler_{d}d_backward": fvcore_per_gradient(4) for d in (2, 3)},
    "aten::_grid_sampler_2d_cpu_fallback_backward": fvcore_per_gradient(4),
})


def handles(convention: str) -> Table:
    """Pooling and resampling operators under ``convention``."""
    return by_convention(convention, FLOPS, fvcore=FVCORE)
