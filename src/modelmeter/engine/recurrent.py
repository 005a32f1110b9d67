"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` on meta tensors: their decomposition recorded without running it.

On a device without a fused recurrent kernel (meta: every fake and meta run), ``torch.lstm``/``gru``/``rnn_tanh``/
``rnn_relu`` run as PyTorch's C++ decomposition (aten/src/ATen/native/RNN.cpp): per layer, direction and time step,
the cell's products and element-wise operators, some fifteen of them per step for an LSTM, each passing through the
recorder's dispatch mode in Python. Their metadata follow from the call's sizes alone, so this module writes the
events and storages that decomposition would record, in its order, with the lifetimes its C++ scopes give
(a storage freed where the decomposition frees it), and makes only the call's outputs as tensors. Every metric,
being a function of the trace, counts what it counted before; ``tests/test_recurrent.py`` compares the traces,
event by event and storage by storage, with the decomposition's. For a GRU or simple RNN standing for a CPU model,
the decomposition written is the CPU's branch (:func:`_cpu_branch`, which ``decomposed()`` runs): each layer's
input multiplied by its weight once, before the steps; the meta branch multiplies each step's input apart
(``tests/test_leftovers.py`` compares both with the real CPU run).

The fast path is taken for the forward pass without autograd (no tensor of the call requires a gradient, or grad
mode is off) on plain meta tensors, contiguous, of one floating dtype, with the sizes the layer expects; anything
else runs the decomposition as before: a PackedSequence input, an LSTM with ``proj_size``, dropout between layers
in training, a backward pass, non-contiguous arguments, a tensor whose storage the run has not seen (the
decomposition's first view of it notes one), FakeTensors (a fallback run on the CPU takes another branch of the
decomposition).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from .._torch_compat import pop_mode_temporarily
from .fast_paths import FastPath
from .metadata import device_name, dtype_name, recorded_device
from .trace import OpEvent, Storage, TensorMeta

# the recurrent calls (nn.LSTM, nn.GRU and nn.RNN call them through ``torch._VF``: the same functions), and
# their gates per step (the rows of a weight are gates x hidden size)
_GATES = {torch.lstm: 4, torch.gru: 3, torch.rnn_tanh: 1, torch.rnn_relu: 1}
RECURRENT_CALLS = frozenset(_GATES)
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_PATH = FastPath()


def decomposed() -> contextlib.AbstractContextManager[None]:
    """Run recurrent layers as their decomposition (what this module stands for: the tests' oracle; a GRU or RNN
    standing for a CPU model as the CPU's branch, :func:`_cpu_branch`)."""
    return _PATH.off()


class Target:
    """Where the events go: the trace's events, the storage records, the enclosing call and its context;
    ``register`` notes a real output tensor's storage, born at an event; ``known`` tells a tensor whose storage
    the run has seen."""

    def __init__(self, events: list[OpEvent], records: list[Storage], parent: int, scope: int, phase: Any,
                 origin: int, register: Callable[[torch.Tensor, int], None],
                 known: Callable[[torch.Tensor], bool]) -> None:
        self.events, self.records = events, records
        self.parent, self.scope, self.phase, self.origin = parent, scope, phase, origin
        self.register, self.known = register, known


def emulate(target_of: Callable[[], Target], func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The outputs of the recurrent call ``func(*args, **kwargs)``, its decomposition's events written to the target
    ``target_of()`` gives; None when the call is not one this module stands for (run it)."""
    if kwargs or len(args) != 9:
        return None
    if not _PATH.enabled:
        return _cpu_branch(func, args)
    target = target_of()
    layout = _layout(func, args, target.known)
    if layout is None:
        return _cpu_branch(func, args)
    run = _Run(target, args[0])
    with pop_mode_temporarily():  # the real outputs are made unseen: the events say how they were made
        return run.call(func, layout, args)


class _Layout:
    """The call's checked structure: ``params[layer][direction]`` is (w_ih, w_hh, b_ih, b_hh), biases None
    without."""

    def __init__(self, layers: int, directions: int, params: list[list[tuple[Any, ...]]], batch_first: bool) -> None:
        self.layers, self.directions, self.params, self.batch_first = layers, directions, params, batch_first


def _layout(func: Any, args: tuple[Any, ...], known: Callable[[torch.Tensor], bool]) -> _Layout | None:
    """The call's structure when the fast path stands for it (see the module's docstring), else None."""
    gates = _GATES.get(func)
    x, hx, flat, has_biases, layers, dropout, train, bidirectional, batch_first = args
    if gates is None or not isinstance(flat, (list, tuple)) or type(layers) is not int or layers < 1:
        return None
    states = list(hx) if gates == 4 and isinstance(hx, (list, tuple)) else [hx]
    if len(states) != (2 if gates == 4 else 1) or (dropout != 0 and train and layers > 1):
        return None
    tensors = [x, *states, *flat]
    if not all(_plain(t) for t in tensors) or len({t.dtype for t in tensors}) != 1 or x.dtype not in _FLOATS:
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None  # the backward pass needs the decomposition's autograd graph
    if not all(known(t) for t in tensors):
        return None  # a storage the run has not seen yet: the decomposition's first view of it would note it
    directions = 2 if bidirectional else 1
    per = 4 if has_biases else 2
    if x.dim() != 3 or len(flat) != layers * directions * per or states[0].dim() != 3:
        return None  # an LSTM with proj_size has a fifth weight per layer; unbatched inputs are made 3-D before
    steps, batch, size = (x.shape[1], x.shape[0], x.shape[2]) if batch_first else tuple(x.shape)
    hidden = states[0].shape[2]
    if min(steps, batch, size, hidden) < 1 or any(tuple(s.shape) != (layers * directions, batch, hidden)
                                                  for s in states):
        return None
    params = [[tuple(flat[(layer * directions + direction) * per:][:per]) for direction in range(directions)]
              for layer in range(layers)]
    for layer, row in enumerate(params):
        width = size if layer == 0 else hidden * directions
        if not all(_fits(group, gates * hidden, width, hidden) for group in row):
            return None
    if not has_biases:
        params = [[(*group, None, None) for group in row] for row in params]
    return _Layout(layers, directions, params, bool(batch_first))


def _fits(group: tuple[Any, ...], rows: int, width: int, hidden: int) -> bool:
    """The weights (and biases) of one layer and direction have the sizes the cell multiplies by."""
    want = [(rows, width), (rows, hidden), (rows,), (rows,)][:len(group)]
    return [tuple(t.shape) for t in group] == want


def _plain(value: Any) -> bool:
    """A plain meta tensor (or parameter), contiguous, as the decomposition's meta kernels see it."""
    return (type(value) in (torch.Tensor, torch.nn.Parameter) and value.is_meta and value.is_contiguous()
            and value.layout == torch.strided)


class _Block:
    """A storage the decomposition allocates: freed (its record's ``died`` set) when the last value on it goes,
    as the C++ tensor's storage would be."""

    __slots__ = ("events", "record")

    def __init__(self, record: Storage, events: list[OpEvent]) -> None:
        self.record, self.events = record, events

    def __del__(self) -> None:
        self.record.died = len(self.events)


class _Value:
    """A tensor of the decomposition: its description and what keeps its storage (a block, a real output tensor,
    or None for the call's own arguments, which outlive it)."""

    __slots__ = ("meta", "owner")

    def __init__(self, meta: TensorMeta, owner: Any) -> None:
        self.meta, self.owner = meta, owner


class _Run:
    """The decomposition of one call, event by event (the C++ functions of RNN.cpp, one method each; a local that
    holds a value holds its storage as long as the C++ local does)."""

    def __init__(self, target: Target, x: torch.Tensor) -> None:
        self.t = target
        self.events, self.records = target.events, target.records
        self.parent, self.scope, self.phase, self.origin = target.parent, target.scope, target.phase, target.origin
        self.dtype = x.dtype
        self.dtype_name, self.device = dtype_name(x.dtype), device_name(x)
        self.itemsize = x.element_size()
        self._metas: dict[tuple[int, ...], TensorMeta] = {}
        self._args: dict[int, _Value] = {}  # the call's tensors, alive while it runs: their ids are theirs
        self._transposed: dict[int, tuple[_Value, _Value]] = {}
        self.final_output = False  # the next stack or cat makes the call's output
        self.cpu = False  # RNN.cpp's CPU branch: each layer's input multiplied once, before its steps
        self.contiguous_input = True  # whether the first layer's input is contiguous (batch_first: a transpose)

    # values ------------------------------------------------------------------------------------------------
    def meta(self, shape: tuple[int, ...]) -> TensorMeta:
        found = self._metas.get(shape)
        if found is None:
            found = self._metas[shape] = TensorMeta(shape, self.dtype_name, self.device)
        return found

    def arg(self, tensor: torch.Tensor) -> _Value:
        """One of the call's own tensors (it outlives the call: no storage of the call's)."""
        found = self._args.get(id(tensor))
        if found is None:
            found = self._args[id(tensor)] = _Value(self.meta(tuple(tensor.shape)), None)
        return found

    def emit(self, op: str, inputs: list[Any], outputs: list[TensorMeta]) -> None:
        self.events.append(OpEvent(op, "dispatch", self.parent, self.scope, self.phase, inputs, outputs, {},
                                   self.origin))

    def new(self, op: str, inputs: list[Any], meta: TensorMeta, real: bool = False) -> _Value:
        """The value a kernel allocates (``real``: one of the call's outputs, made as a tensor)."""
        born = len(self.events)
        self.emit(op, inputs, [meta])
        if real:
            tensor = torch.empty(meta.shape, dtype=self.dtype, device="meta")
            self.t.register(tensor, born)
            return _Value(meta, tensor)
        record = Storage(self.itemsize * math.prod(meta.shape), self.dtype_name, self.device, "activation", born)
        self.records.append(record)
        return _Value(meta, _Block(record, self.events))

    def in_place(self, op: str, inputs: list[Any], target: _Value) -> _Value:
        self.emit(op, inputs, [target.meta])
        return target

    def view(self, op: str, inputs: list[Any], source: _Value, shape: tuple[int, ...]) -> _Value:
        meta = self.meta(shape)
        self.emit(op, inputs, [meta])
        return _Value(meta, source.owner)

    def unbind(self, x: _Value) -> list[_Value]:
        shape = x.meta.shape
        meta = self.meta(shape[1:])
        self.emit("aten::unbind", [x.meta, 0], [meta] * shape[0])
        return [_Value(meta, x.owner) for _ in range(shape[0])]

    def split(self, x: _Value, chunks: int) -> list[_Value]:
        rows, width = x.meta.shape
        meta = self.meta((rows, width // chunks))
        self.emit("aten::unsafe_split", [x.meta, width // chunks, 1], [meta] * chunks)
        return [_Value(meta, x.owner) for _ in range(chunks)]

    def stack(self, values: list[_Value]) -> _Value:
        real, self.final_output = self.final_output, False
        shape = (len(values), *values[0].meta.shape)
        return self.new("aten::stack", [[v.meta for v in values], 0], self.meta(shape), real)

    def cat(self, first: _Value, second: _Value) -> _Value:
        real, self.final_output = self.final_output, False
        a, b = first.meta.shape, second.meta.shape
        return self.new("aten::cat", [[first.meta, second.meta], 2], self.meta((*a[:2], a[2] + b[2])), real)

    def transposed_weight(self, weight: torch.Tensor) -> tuple[_Value, _Value]:
        """A weight and its ``t()`` (a view of the call's own tensor: the same value at every step)."""
        found = self._transposed.get(id(weight))
        if found is None:
            w = self.arg(weight)
            rows, columns = w.meta.shape
            found = self._transposed[id(weight)] = (w, _Value(self.meta((columns, rows)), None))
        return found

    def linear(self, x: _Value, weight: torch.Tensor, bias: torch.Tensor | None) -> _Value:
        """``at::linear`` of a 2-D input: ``addmm(bias, x, w.t())``, or ``mm(x, w.t())`` without a bias."""
        w, wt = self.transposed_weight(weight)
        self.emit("aten::t", [w.meta], [wt.meta])
        rows = w.meta.shape[0]
        meta = self.meta((x.meta.shape[0], rows))
        if bias is None:
            return self.new("aten::mm", [x.meta, wt.meta], meta)
        return self.new("aten::addmm", [self.arg(bias).meta, x.meta, wt.meta, 1, 1], meta)

    def sequence_linear(self, x: _Value, weight: torch.Tensor, bias: torch.Tensor | None, contiguous: bool
                        ) -> _Value:
        """``at::linear`` of a ``(steps, batch, size)`` input (the CPU branch's product of a whole sequence): one
        ``addmm`` on the input viewed as a matrix; without a bias (``matmul``), or of an input that is not
        contiguous (``reshape`` copies it), ``mm`` between unsafe views, the bias added after."""
        steps, batch, size = x.meta.shape
        w, wt = self.transposed_weight(weight)
        rows = w.meta.shape[0]
        if bias is not None and contiguous:
            flat = self.view("aten::view", [x.meta, [steps * batch, size]], x, (steps * batch, size))
            self.emit("aten::t", [w.meta], [wt.meta])
            product = self.new("aten::addmm", [self.arg(bias).meta, flat.meta, wt.meta, 1, 1],
                               self.meta((steps * batch, rows)))
            return self.view("aten::view", [product.meta, [steps, batch, rows]], product, (steps, batch, rows))
        self.emit("aten::t", [w.meta], [wt.meta])
        if contiguous:
            flat = self.view("aten::view", [x.meta, [steps * batch, size]], x, (steps * batch, size))
        else:
            copy = self.new("aten::clone", [x.meta, "torch.contiguous_format"], x.meta)
            flat = self.view("aten::_unsafe_view", [copy.meta, [steps * batch, size]], copy, (steps * batch, size))
            del copy
        product = self.new("aten::mm", [flat.meta, wt.meta], self.meta((steps * batch, rows)))
        product = self.view("aten::_unsafe_view", [product.meta, [steps, batch, rows]], product, (steps, batch, rows))
        del flat  # (``matmul`` returns: the copy is freed, before the bias is added)
        if bias is None:
            return product
        return self.new("aten::add", [product.meta, self.arg(bias).meta, 1], product.meta)

    def projected_steps(self, x: _Value, p: tuple[Any, ...], first: bool) -> list[_Value]:
        """The CPU branch's input of a layer and direction: the steps of the sequence multiplied by the input weight
        (which they keep alive; ``first``: the first layer, whose input may not be contiguous)."""
        return self.unbind(self.sequence_linear(x, p[0], p[2], self.contiguous_input or not first))

    def unary(self, op: str, x: _Value) -> _Value:
        return self.new(op, [x.meta], x.meta)

    def binary(self, op: str, a: _Value, b: _Value, alpha: bool = True) -> _Value:
        return self.new(op, [a.meta, b.meta, 1] if alpha else [a.meta, b.meta], a.meta)

    def binary_(self, op: str, a: _Value, b: _Value, alpha: bool = True) -> _Value:
        return self.in_place(op, [a.meta, b.meta, 1] if alpha else [a.meta, b.meta], a)

    def unary_(self, op: str, x: _Value) -> _Value:
        return self.in_place(op, [x.meta], x)

    # cells (CPU branch of RNN.cpp's cells, the one meta tensors take) --------------------------------------
    def lstm_cell(self, x: _Value, hidden: tuple[_Value, _Value], p: tuple[Any, ...]) -> tuple[_Value, _Value]:
        hx, cx = hidden
        hh = self.linear(hx, p[1], p[3])
        ih = self.linear(x, p[0], p[2])
        gates = self.binary_("aten::add_", hh, ih)
        del hh, ih  # the input product is a temporary of the statement
        i, f, g, o = self.split(gates, 4)
        i = self.unary_("aten::sigmoid_", i)
        f = self.unary_("aten::sigmoid_", f)
        g = self.unary_("aten::tanh_", g)
        o = self.unary_("aten::sigmoid_", o)
        forget = self.binary("aten::mul", f, cx, alpha=False)
        update = self.binary("aten::mul", i, g, alpha=False)
        cy = self.binary_("aten::add_", forget, update)
        del forget, update
        squashed = self.unary("aten::tanh", cy)
        hy = self.binary("aten::mul", o, squashed, alpha=False)
        del squashed
        return hy, cy

    def gru_cell(self, x: _Value, hidden: _Value, p: tuple[Any, ...]) -> _Value:
        """``GRUCell`` (on the CPU branch, ``x`` is the step's slice of the sequence's input product)."""
        igates = self.split(x if self.cpu else self.linear(x, p[0], p[2]), 3)
        hgates = self.split(self.linear(hidden, p[1], p[3]), 3)
        reset = self.unary_("aten::sigmoid_", self.binary_("aten::add_", hgates[0], igates[0]))
        update = self.unary_("aten::sigmoid_", self.binary_("aten::add_", hgates[1], igates[1]))
        scaled = self.binary_("aten::mul_", hgates[2], reset, alpha=False)
        new = self.unary_("aten::tanh_", self.binary("aten::add", igates[2], scaled))
        out = self.binary("aten::sub", hidden, new)
        out = self.binary_("aten::mul_", out, update, alpha=False)
        return self.binary_("aten::add_", out, new)

    def simple_cell(self, op: str, x: _Value, hidden: _Value, p: tuple[Any, ...]) -> _Value:
        """``SimpleCell`` (on the CPU branch, ``x`` is the step's slice of the sequence's input product)."""
        hh = self.linear(hidden, p[1], p[3])
        if self.cpu:
            return self.unary(op, self.binary_("aten::add_", hh, x))
        ih = self.linear(x, p[0], p[2])
        out = self.unary(op, self.binary_("aten::add_", hh, ih))
        del hh, ih  # both products are temporaries of the one statement: freed after the nonlinearity
        return out

    # layers ------------------------------------------------------------------------------------------------
    def steps(self, cell: Callable[..., Any], inputs: list[_Value], hidden: Any, p: tuple[Any, ...]
              ) -> tuple[list[_Value], Any]:
        """``FullLayer``'s loop: the cell at every step, each step's output kept (an LSTM's is its ``hy``)."""
        outputs = []
        for x in inputs:
            hidden = cell(x, hidden, p)
            outputs.append(hidden[0] if isinstance(hidden, tuple) else hidden)
        return outputs, hidden

    def layer(self, cell: Callable[..., Any], x: _Value, hidden: Any, p: list[tuple[Any, ...]], last: bool,
              first: bool) -> tuple[_Value, Any]:
        """``FullLayer``: the steps in order, their outputs stacked (``last``: into the call's output)."""
        inputs = self.projected_steps(x, p[0], first) if self.cpu else self.unbind(x)
        outputs, final = self.steps(cell, inputs, hidden, p[0])  # (on the CPU, its steps live until it returns)
        self.final_output = last
        return self.stack(outputs), final

    def bidirectional_layer(self, cell: Callable[..., Any], x: _Value, hidden: Any, p: list[tuple[Any, ...]],
                            last: bool, first: bool) -> tuple[_Value, Any]:
        """``FullBidirectionalLayer``: forward and reversed steps, each stacked, the two joined on the last
        dimension."""
        inputs = self.projected_steps(x, p[0], first) if self.cpu else self.unbind(x)
        forward, forward_final = self.steps(cell, inputs, hidden[0], p[0])
        forward_output = self.stack(forward)
        if self.cpu:  # (the first direction's product is freed with its steps, when they are replaced)
            inputs = self.projected_steps(x, p[1], first)
        inputs.reverse()
        backward, backward_final = self.steps(cell, inputs, hidden[1], p[1])
        backward.reverse()
        backward_output = self.stack(backward)
        self.final_output = last
        return self.cat(forward_output, backward_output), (forward_final, backward_final)

    def layers(self, cell: Callable[..., Any], x: _Value, hiddens: list[Any], layout: _Layout
               ) -> tuple[_Value, list[Any]]:
        """``apply_layer_stack``: each layer's output feeds the next; the final hidden states of every direction."""
        bidirectional = layout.directions == 2
        run_layer = self.bidirectional_layer if bidirectional else self.layer
        finals: list[Any] = []
        for index in range(layout.layers):
            hidden = (hiddens[2 * index], hiddens[2 * index + 1]) if bidirectional else hiddens[index]
            x, final = run_layer(cell, x, hidden, layout.params[index], index == layout.layers - 1, index == 0)
            finals.extend(final if bidirectional else [final])
        return x, finals

    # the calls ---------------------------------------------------------------------------------------------
    def call(self, func: Any, layout: _Layout, args: tuple[Any, ...]) -> Any:
        x = self.arg(args[0])
        self.cpu = func is not torch.lstm and recorded_device() == "cpu"  # (the CPU runs an LSTM as oneDNN's)
        self.contiguous_input = not layout.batch_first or args[0].transpose(0, 1).is_contiguous()
        if layout.batch_first:
            b, t, size = x.meta.shape
            x = self.view("aten::transpose", [x.meta, 0, 1], x, (t, b, size))
        if func is torch.lstm:
            output, h, c = self.lstm(x, args[1], layout)
            if layout.batch_first:
                output = self.transposed(output, in_place=False)
            return output, h, c
        output, h = self.one_hidden(func, x, args[1], layout)
        if layout.batch_first:
            output = self.transposed(output, in_place=True)
        return output, h

    def lstm(self, x: _Value, hx: Any, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``_lstm_impl``: the states split per layer and direction, the layers, the final states stacked."""
        h_states = self.unbind(self.arg(hx[0]))
        c_states = self.unbind(self.arg(hx[1]))
        output, finals = self.layers(self.lstm_cell, x, list(zip(h_states, c_states, strict=True)), layout)
        del h_states, c_states
        hy = [h for h, _ in finals]
        cy = [c for _, c in finals]
        del finals
        # make_tuple(outputs, stack(hy), stack(cy)): the build of torch evaluates the arguments right to left, so the
        # decomposition stacks the cell states first
        self.final_output = True
        c = self.stack(cy)
        self.final_output = True
        h = self.stack(hy)
        return output.owner, h.owner, c.owner

    def one_hidden(self, func: Any, x: _Value, hx: torch.Tensor, layout: _Layout) -> tuple[torch.Tensor, torch.Tensor]:
        """``_rnn_impl_with_concat`` of a GRU or a simple RNN."""
        states = self.unbind(self.arg(hx))
        if func is torch.gru:
            cell: Callable[..., Any] = self.gru_cell
        else:
            cell = functools.partial(self.simple_cell, "aten::tanh" if func is torch.rnn_tanh else "aten::relu")
        output, finals = self.layers(cell, x, states, layout)
        del states
        self.final_output = True
        h = self.stack(finals)
        return output.owner, h.owner

    def transposed(self, output: torch.Tensor, in_place: bool) -> torch.Tensor:
        """``batch_first``: the output's first two dimensions swapped back (an LSTM takes a view, the others
        transpose the stacked tensor in place)."""
        before = self.meta(tuple(output.shape))
        result = output.transpose_(0, 1) if in_place else output.transpose(0, 1)
        after = self.meta(tuple(result.shape))
        self.emit("aten::transpose_" if in_place else "aten::transpose", [after if in_place else before, 0, 1],
                  [after])
        return result


# --- the CPU's branch, through aten operators ----------------------------------------------------------------------
# Where the fast path does not stand for a call (a training step: autograd needs the decomposition's graph), and as
# the tests' oracle of the fast path (``decomposed()``), a GRU or simple RNN on meta tensors standing for a CPU model
# runs RNN.cpp's CPU branch, here in Python through the same aten operators. The decomposition on meta tensors takes
# the other branch, which multiplies each step's input by the weight apart, where the CPU multiplies the whole
# sequence once before the loop (``FullLayer`` and ``FullBidirectionalLayer``'s ``pre_compute_input``) and so saves
# and frees other tensors. Each temporary is dropped where the C++ scope drops it.
_A = torch.ops.aten


def _cpu_branch(func: Any, args: tuple[Any, ...]) -> Any:
    """``func(*args)`` (``gru``, ``rnn_tanh``, ``rnn_relu``) as the CPU runs it, for meta tensors standing for CPU
    tensors; None for any other call (it runs as it is)."""
    if func not in (torch.gru, torch.rnn_tanh, torch.rnn_relu) or recorded_device() != "cpu":
        return None
    x, hx, flat, has_biases, layers, dropout, train, bidirectional, batch_first = args
    if not isinstance(flat, (list, tuple)) or type(layers) is not int or layers < 1:
        return None
    tensors = [x, hx, *flat]
    if not all(isinstance(t, torch.Tensor) and t.is_meta and t.device.type in ("meta", "cpu")
               and t.layout == torch.strided for t in tensors) or x.dim() != 3:
        return None
    directions = 2 if bidirectional else 1
    per = 4 if has_biases else 2
    if len(flat) != layers * directions * per:
        return None
    groups = [(*flat[i * per:(i + 1) * per], None, None)[:4] for i in range(layers * directions)]
    cell = _gru_cell if func is torch.gru else functools.partial(
        _simple_cell, _A.tanh.default if func is torch.rnn_tanh else _A.relu.default)
    source = _A.transpose.int(x, 0, 1) if batch_first else x
    output, finals = _layer_stack(cell, source, list(_A.unbind.int(hx, 0)), groups, layers, directions,
                                  dropout if train else 0.0)
    hy = _A.stack.default(finals, 0)
    del finals  # (``_rnn_impl_with_concat`` returns: the last step's hidden state is freed before the transpose)
    if batch_first:
        _A.transpose_.default(output, 0, 1)
    return output, hy


def _layer_stack(cell: Callable[..., Any], x: torch.Tensor, hiddens: list[torch.Tensor], groups: list[Any],
                 layers: int, directions: int, dropout: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``apply_layer_stack``: each layer's output feeds the next (dropout between them); every final hidden."""
    finals: list[torch.Tensor] = []
    for layer in range(layers):
        first = layer * directions
        if directions == 2:
            x, final = _bidirectional_layer(cell, x, hiddens[first:first + 2], groups[first:first + 2])
        else:
            x, final = _full_layer(cell, x, hiddens[first], groups[first])
        finals.extend(final)
        if dropout != 0 and layer < layers - 1:
            x = _A.dropout.default(x, dropout, True)
    return x, finals


def _full_layer(cell: Callable[..., Any], x: torch.Tensor, hidden: torch.Tensor, group: Any
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``FullLayer`` on the CPU: the input multiplied once, then the cell at every step; the outputs stacked."""
    projected = _A.linear.default(x, group[0], group[2])
    outputs, final = _steps(cell, list(_A.unbind.int(projected, 0)), hidden, group)
    return _A.stack.default(outputs, 0), [final]


def _bidirectional_layer(cell: Callable[..., Any], x: torch.Tensor, hiddens: list[torch.Tensor], groups: list[Any]
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``FullBidirectionalLayer`` on the CPU: each direction's input multiplied once (the second's steps in reverse,
    its outputs put back in order), both outputs concatenated."""
    projected = _A.linear.default(x, groups[0][0], groups[0][2])
    steps = list(_A.unbind.int(projected, 0))
    forward, forward_final = _steps(cell, steps, hiddens[0], groups[0])
    forward_output = _A.stack.default(forward, 0)
    projected = _A.linear.default(x, groups[1][0], groups[1][2])
    steps = list(_A.unbind.int(projected, 0))
    steps.reverse()
    backward, backward_final = _steps(cell, steps, hiddens[1], groups[1])
    backward.reverse()
    backward_output = _A.stack.default(backward, 0)
    return _A.cat.default([forward_output, backward_output], forward_output.dim() - 1), [forward_final,
                                                                                         backward_final]


def _steps(cell: Callable[..., Any], inputs: list[torch.Tensor], hidden: torch.Tensor, group: Any
           ) -> tuple[list[torch.Tensor], torch.Tensor]:
    outputs = []
    for x in inputs:
        hidden = cell(x, hidden, group)
        outputs.append(hidden)
    return outputs, hidden


def _gru_cell(gates: torch.Tensor, hidden: torch.Tensor, group: Any) -> torch.Tensor:
    """``GRUCell`` on the CPU with the input's product given (``gates``)."""
    igates = _A.unsafe_chunk.default(gates, 3, 1)
    hgates = _A.unsafe_chunk.default(_A.linear.default(hidden, group[1], group[3]), 3, 1)
    reset = _A.sigmoid_.default(_A.add_.Tensor(hgates[0], igates[0]))
    update = _A.sigmoid_.default(_A.add_.Tensor(hgates[1], igates[1]))
    new = _A.tanh_.default(_A.add.Tensor(igates[2], _A.mul_.Tensor(hgates[2], reset)))
    return _A.add_.Tensor(_A.mul_.Tensor(_A.sub.Tensor(hidden, new), update), new)


def _simple_cell(nonlinearity: Any, gates: torch.Tensor, hidden: torch.Tensor, group: Any) -> torch.Tensor:
    """``SimpleCell`` on the CPU with the input's product given (``gates``)."""
    return nonlinearity(_A.add_.Tensor(_A.linear.default(hidden, group[1], group[3]), gates))
