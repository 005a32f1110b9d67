"""Embeddings, recurrent layers (the fused CPU LSTM) and losses, forward and backward.

``flops`` convention:

- ``embedding``: a gather, 0. Its backward (``embedding_dense_backward``) accumulates every
  output-gradient row into the weight gradient: one add per output-gradient element (plus a divide per
  element with ``scale_grad_by_freq``). ``embedding_bag``: one add per gathered element (sum, mean), a
  compare (max); a multiply more per element with ``per_sample_weights``; mean divides per output element.
- ``mkldnn_rnn_layer`` (``nn.LSTM`` on CPU: one fused operator per layer and direction, the products
  inside): per time step and batch row, with gate width ``G·H = 4H``: the products ``x·W_ihᵀ`` and
  ``h·W_hhᵀ`` (``4H·(I + H)`` multiply-adds, 2 flops each), their sum ``4H``, the two biases ``2·4H``, the
  cell ``9H`` (three sigmoids, two tanh, three products, one sum) — the same as the cell's decomposition
  (``nn.LSTMCell``) counts. Backward: the four products ``2·4H·(I + H)`` multiply-adds, the cell's
  gradients ``13H`` and the bias gradients ``2·4H``. Other recurrent layers on CPU (``nn.GRU``, ``nn.RNN``,
  cells) run as ``addmm`` and element-wise operators and are counted as those.
- losses, for ``n`` elements of the prediction (``reduction``: ``none`` 0, ``sum`` ``n`` adds, ``mean``
  ``n`` adds and a divide): ``mse_loss`` subtract and square ``2n``; ``smooth_l1_loss``/``huber_loss``
  subtract, abs, compare and the quadratic branch's square and scale ``5n``; ``binary_cross_entropy``
  ``-(y·log x + (1-y)·log(1-x))`` ``8n``; ``binary_cross_entropy_with_logits`` ``(1-y)·x + log(1 + exp(-x))``
  ``7n``; a ``weight`` ``n`` more; ``nll_loss`` a negate per target (``t`` targets) plus the reduction
  (``mean`` with a weight also sums the weights). Backward: ``mse`` ``2·(x - y)·g`` ``3n``; smooth L1 /
  Huber ``5n``; ``binary_cross_entropy`` ``g·(x - y) / max(x·(1 - x), eps)`` ``6n``; ``nll_loss`` ``t``;
  each plus a divide per element for ``mean`` and a multiply for a weight. ``l1_loss``, ``kl_div``,
  ``cross_entropy`` (``log_softmax`` + ``nll_loss``) and the backward of ``binary_cross_entropy_with_logits``
  run as other operators and are counted as those.

``fvcore`` and ``macs``: all free, except the LSTM's multiply-adds (forward ``4H·(I + H)`` per step and
row, backward twice that), which both conventions count as they count any matrix product.
"""

from __future__ import annotations

from typing import Any

from .base import Handle, get_shape, numel, shape_of
from .binding import Formula, bind_all, by_name
from .common import Table, by_convention, float_numel, is_floating

_MEAN, _SUM = 1, 2


# --- embeddings ---------------------------------------------------------------------------------
@by_name(grad_output="grad")
def embedding_backward_flops(grad_output: Any, scale_grad_by_freq: Any = False) -> int:
    """``embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq)``."""
    return float_numel(grad_output) * (1 + bool(scale_grad_by_freq))


def _bag(weight: Any, indices: Any, mode: Any, per_sample_weights: Any) -> int:
    gathered = numel(indices) * shape_of(weight)[-1] if is_floating(weight) else 0
    return gathered * (1 + (get_shape(per_sample_weights) is not None and mode != 2))


@by_name
def embedding_bag_flops(weight: Any, indices: Any, mode: Any = 0, per_sample_weights: Any = None, *,
                        result: Any) -> int:
    """``_embedding_bag(weight, indices, offsets, scale, mode, sparse, per_sample_weights, ...)``."""
    return _bag(weight, indices, mode, per_sample_weights) + (float_numel(result) if mode == _MEAN else 0)


@by_name
def embedding_bag_backward_flops(grad: Any, indices: Any, mode: Any, per_sample_weights: Any) -> int:
    """Backward of ``embedding_bag``: one add per gathered element, a multiply more with per-sample weights,
    a divide more for ``mean``; ``max`` scatters the output gradient (one add per element)."""
    if mode == 2:
        return float_numel(grad)
    n = numel(indices) * shape_of(grad)[-1] if is_floating(grad) else 0
    return n * (1 + (get_shape(per_sample_weights) is not None) + (mode == _MEAN))


@by_name
def embedding_bag_weights_backward_flops(grad: Any, indices: Any) -> int:
    """``_embedding_bag_per_sample_weights_backward(grad, weight, indices, ...)``: a dot product per index."""
    return 2 * numel(indices) * shape_of(grad)[-1] if is_floating(grad) else 0


# --- the fused CPU LSTM -----------------------------------------------------------------------------
def _rnn_sizes(w_ih: Any, w_hh: Any, output: Any) -> tuple[int, int, int, int]:
    """(time steps x batch rows, gate width G·H, input size I, hidden size H) of one fused layer call."""
    gates, in_size = shape_of(w_ih)
    hidden = shape_of(w_hh)[-1]
    return numel(output) // hidden, gates, in_size, hidden


@by_name
def rnn_layer_macs(weight0: Any, weight1: Any, *, result: Any) -> int:
    """``mkldnn_rnn_layer(input, weight0 = W_ih, weight1 = W_hh, ...)``: ``G·H·(I + H)`` multiply-adds per time step
    and batch row."""
    steps, gates, in_size, hidden = _rnn_sizes(weight0, weight1, result)
    return steps * gates * (in_size + hidden)


@by_name
def rnn_layer_flops(weight0: Any, weight1: Any, has_biases: Any = True, *, result: Any) -> int:
    """``mkldnn_rnn_layer``: products (2 per multiply-add), their sum, the biases and the LSTM cell (``9H``)."""
    steps, gates, in_size, hidden = _rnn_sizes(weight0, weight1, result)
    biases = 2 * gates if has_biases else 0
    return steps * (2 * gates * (in_size + hidden) + gates + biases + 9 * hidden)


@by_name
def rnn_layer_backward_macs(weight1: Any, weight2: Any, output: Any) -> int:
    """``mkldnn_rnn_layer_backward(input, weight1 = W_ih, weight2 = W_hh, ..., output, ...)``: input, hidden-state
    and both weight gradients, ``2·G·H·(I + H)``."""
    steps, gates, in_size, hidden = _rnn_sizes(weight1, weight2, output)
    return 2 * steps * gates * (in_size + hidden)


@by_name
def rnn_layer_backward_flops(weight1: Any, weight2: Any, output: Any, has_biases: Any = True) -> int:
    """``mkldnn_rnn_layer_backward``: the gradient products, the cell's gradients (``13H``), the biases'."""
    steps, gates, in_size, hidden = _rnn_sizes(weight1, weight2, output)
    biases = 2 * gates if has_biases else 0
    return steps * (4 * gates * (in_size + hidden) + 13 * hidden + biases)


# --- losses ---------------------------------------------------------------------------------------
def _reduce(n: int, reduction: Any) -> int:
    """Adds of a ``sum`` or ``mean`` reduction over ``n`` elements, and the divide of ``mean``."""
    return 0 if reduction not in (_MEAN, _SUM) else n + (reduction == _MEAN)


def _reduction(value: Any, prediction: Any, loss: Any) -> int:
    """The ``reduction`` argument; when a user-level call passed it as a string, read from the result: as many
    elements as the prediction is ``none``, else ``mean`` (the default)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return 0 if get_shape(loss) is not None and numel(loss) == numel(prediction) > 1 else _MEAN


def loss_counter(per_element: int) -> Formula[int]:
    """A loss of ``per_element`` flops per prediction element (a ``weight`` one more), then its reduction."""

    @by_name
    def loss_flops(self: Any, reduction: Any, weight: Any = None, *, result: Any) -> int:
        n = float_numel(self)
        return n * (per_element + (get_shape(weight) is not None)) + _reduce(n, _reduction(reduction, self, result))

    return loss_flops


def loss_backward_counter(per_element: int) -> Formula[int]:
    """A loss gradient: ``per_element`` per prediction element, a multiply more with a weight and a divide
    more for ``mean``."""

    @by_name
    def loss_backward_flops(self: Any, reduction: Any = _MEAN, weight: Any = None) -> int:
        return float_numel(self) * (per_element + (get_shape(weight) is not None) + (reduction == _MEAN))

    return loss_backward_flops


@by_name
def nll_loss_flops(self: Any, target: Any, weight: Any, reduction: Any = _MEAN) -> int:
    """``nll_loss_forward(self, target, weight, reduction, ignore_index)``: a negate per target, a multiply
    more with a weight, then the reduction (``mean`` with a weight also sums the weights)."""
    if not is_floating(self):
        return 0
    targets, weighted = numel(target), get_shape(weight) is not None
    extra = targets if weighted and reduction == _MEAN else 0
    return targets * (1 + weighted) + _reduce(targets, reduction) + extra


@by_name
def nll_loss_backward_flops(self: Any, target: Any, weight: Any, reduction: Any = _MEAN) -> int:
    """``nll_loss_backward(grad_output, self, target, weight, reduction, ...)``: per target, the negated
    output gradient, times the weight, over the total weight for ``mean``."""
    if not is_floating(self):
        return 0
    return numel(target) * (1 + (get_shape(weight) is not None) + (reduction == _MEAN))


FLOPS: dict[str, Handle | None] = bind_all({
    "aten::embedding": None,
    **{f"aten::{op}": embedding_backward_flops for op in ("embedding_dense_backward", "embedding_backward")},
    **{f"aten::{op}": embedding_bag_flops for op in ("_embedding_bag", "_embedding_bag_forward_only")},
    **{f"aten::{op}": embedding_bag_backward_flops for op in ("_embedding_bag_backward",
                                                              "_embedding_bag_dense_backward")},
    "aten::_embedding_bag_per_sample_weights_backward": embedding_bag_weights_backward_flops,
    "aten::mkldnn_rnn_layer": rnn_layer_flops,
    "aten::mkldnn_rnn_layer_backward": rnn_layer_backward_flops,
    "aten::mse_loss": loss_counter(2),
    "aten::mse_loss_backward": loss_backward_counter(3),
    **{f"aten::{op}": loss_counter(5) for op in ("smooth_l1_loss", "huber_loss")},
    **{f"aten::{op}_backward": loss_backward_counter(5) for op in ("smooth_l1_loss", "huber_loss")},
    "aten::binary_cross_entropy": loss_counter(8),
    "aten::binary_cross_entropy_backward": loss_backward_counter(6),
    "aten::binary_cross_entropy_with_logits": loss_counter(7),
    **{f"aten::{op}": nll_loss_flops for op in ("nll_loss_forward", "nll_loss2d_forward")},
    **{f"aten::{op}": nll_loss_backward_flops for op in ("nll_loss_backward", "nll_loss2d_backward")},
})

MACS: dict[str, Handle] = bind_all({
    "aten::mkldnn_rnn_layer": rnn_layer_macs,
    "aten::mkldnn_rnn_layer_backward": rnn_layer_backward_macs,
})


def handles(convention: str) -> Table:
    """Embeddings, the fused LSTM and losses under ``convention``."""
    return by_convention(convention, FLOPS, fvcore=MACS, macs=MACS)
