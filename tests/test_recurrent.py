"""Recurrent layers on meta tensors are recorded without running their decomposition (engine/recurrent.py).

The oracle is the decomposition itself, recorded operator by operator as before (``recurrent.decomposed()``; for a GRU
or RNN standing for a CPU model, the CPU's branch of it, which tests/test_leftovers.py checks against real CPU kernels):
the trace written directly must equal it event by event (operator, level, parent, scope, phase, arguments, outputs) and
storage by storage (size, dtype, device, kind, birth, death), so every metric counts the same; the metrics are compared
too, through the public API (FLOPs in every convention, activations, bytes, memory, the time on a device, per module).
Calls the fast path does not stand for run the decomposition, checked by counting the emulated calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import modelmeter
from modelmeter.engine import recurrent
from modelmeter.engine.spec import RunSpec
from modelmeter.engine.trace import Trace
from modelmeter.engine.tracer import record_trace
from modelmeter.handles.catalog import CONVENTIONS
from trace_equality import assert_same_trace


@contextlib.contextmanager
def _counting() -> Iterator[list[int]]:
    """Counts the calls the fast path wrote (one per recurrent call it stood for)."""
    calls: list[int] = []
    run_call = recurrent._Run.call

    def counted(self: Any, *args: Any) -> Any:
        calls.append(1)
        return run_call(self, *args)

    recurrent._Run.call = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        recurrent._Run.call = run_call  # type: ignore[method-assign]


@pytest.fixture
def emulated() -> Iterator[list[int]]:
    with _counting() as calls:
        yield calls


def _assert_same_trace(model: nn.Module, args: tuple[Any, ...], **spec: Any) -> Trace:
    fast = record_trace(RunSpec(model, args, **spec))
    with recurrent.decomposed():
        slow = record_trace(RunSpec(model, args, **spec))
    assert_same_trace(fast, slow)
    return fast


class _Stack(nn.Module):
    """A recurrent layer, then a linear layer on its output and final states (their lifetimes matter to memory)."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 3)

    def forward(self, x: torch.Tensor, *state: Any) -> tuple[torch.Tensor, ...]:
        out, hidden = self.rnn(x, *state)
        last = hidden[0] if isinstance(hidden, tuple) else hidden
        del hidden  # an LSTM's cell state is freed here, its hidden state later
        y = self.head(out)
        return y, last.sum(0)


_KINDS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN, "rnn_relu": nn.RNN}
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@st.composite
def recurrent_calls(draw: st.DrawFn) -> tuple[nn.Module, tuple[Any, ...], int]:
    """A model around a recurrent layer, its arguments, and how many calls the fast path writes (0 or 1)."""
    kind = draw(st.sampled_from(sorted(_KINDS)))
    size, hidden = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    layers, bidirectional = draw(st.integers(1, 3)), draw(st.booleans())
    batch_first, bias = draw(st.booleans()), draw(st.booleans())
    steps, batch, dtype = draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.sampled_from(_DTYPES))
    options: dict[str, Any] = {"nonlinearity": kind[4:]} if kind.startswith("rnn") else {}
    dropout = draw(st.sampled_from((0.0, 0.5))) if layers > 1 else 0.0
    rnn = _KINDS[kind](size, hidden, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                       bias=bias, dropout=dropout, **options)
    training = draw(st.booleans())  # dropout between layers in training is left to the decomposition
    model = _Stack(rnn).to(dtype).train(training)
    x = torch.randn((batch, steps, size) if batch_first else (steps, batch, size)).to(dtype)
    written = int(not (training and dropout))
    if not draw(st.booleans()):
        return model, (x,), written
    state = torch.randn(layers * (2 if bidirectional else 1), batch, hidden).to(dtype)
    return model, (x, (state, state.clone()) if kind == "lstm" else state), written


@settings(max_examples=40, deadline=None)
@given(recurrent_calls())
def test_the_written_trace_is_the_decompositions(case: tuple[nn.Module, tuple[Any, ...], int]) -> None:
    model, args, written = case
    with _counting() as calls:
        _assert_same_trace(model, args)
    assert len(calls) == written  # written once, not run (the decomposed recording ran with the fast path off)


def test_an_unbatched_input_and_several_layers_in_one_model(emulated: list[int]) -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 5, num_layers=2, bidirectional=True)
            self.gru = nn.GRU(10, 3, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gru(self.lstm(x)[0].unsqueeze(0))[0] + self.lstm(x)[1][0].sum()

    _assert_same_trace(Two().eval(), (torch.randn(6, 4),))  # unbatched: nn.LSTM makes it 3-D before the call
    assert len(emulated) == 3


def test_a_model_built_on_meta(emulated: list[int]) -> None:
    with torch.device("meta"):
        model = _Stack(nn.GRU(4, 6, num_layers=2, bidirectional=True, batch_first=True)).eval()
        x = torch.empty(3, 5, 4)
    trace = _assert_same_trace(model, (x,))
    assert emulated == [1]
    assert {s.device for s in trace.storages} == {"meta"}


def test_a_state_the_run_has_not_seen_is_left_to_the_decomposition(emulated: list[int]) -> None:
    """A tensor kept in a plain attribute (no parameter, buffer or input) has no storage record yet: the
    decomposition's view of it notes one, so that call is not written."""

    class Unseen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(3, 4)
            self.h0 = torch.zeros(1, 2, 4)  # not a buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gru(x, self.h0)[0]

    with torch.device("meta"):
        model = Unseen().eval()
    trace = _assert_same_trace(model, (torch.empty(5, 2, 3, device="meta"),))
    assert emulated == []
    unbind = next(i for i, e in enumerate(trace.events) if e.op == "aten::unbind")
    assert any(s.born == unbind for s in trace.storages)  # what writing the events would have missed


def test_autocast_around_the_layer_runs_as_the_cpu_does(emulated: list[int]) -> None:
    """Autocast entered by the model casts CPU tensors, not meta stand-ins: the run takes FakeTensors, which it casts,
    and records the real run's bfloat16 products (the fast path, for plain meta tensors, is not taken)."""

    class Autocast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(3, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.gru(x)[0]

    model, args = Autocast().eval(), (torch.randn(2, 1, 3),)
    fake = _assert_same_trace(model, args)
    real = record_trace(RunSpec(model, args, execution="real"))
    assert [(ev.op, ev.outputs) for ev in fake.events] == [(ev.op, ev.outputs) for ev in real.events]
    assert any(ev.op == "aten::addmm" and ev.outputs[0].dtype == "bfloat16" for ev in fake.events)
    assert emulated == []


def _numbers(model: nn.Module, x: torch.Tensor, convention: str) -> dict[str, Any]:
    analysis = modelmeter.analyze(model, x, convention=convention, memory=True, device="h100", quiet=True)
    result = analysis.result().to_dict()
    return {"result": result, "total": analysis.flops.total(), "flops": dict(analysis.flops.by_module_and_operator()),
            "activations": dict(analysis.activations.by_module_and_operator())}


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_every_metric_counts_what_the_decomposition_counts(convention: str, emulated: list[int]) -> None:
    torch.manual_seed(0)
    model = _Stack(nn.LSTM(8, 16, num_layers=2, bidirectional=True)).eval()
    x = torch.randn(7, 2, 8)
    fast = _numbers(model, x.clone(), convention)  # a new tensor each time: no recording is shared in-process
    assert emulated == [1]
    with recurrent.decomposed():
        slow = _numbers(model, x.clone(), convention)
    assert fast == slow
    assert fast["total"] > 0 and fast["result"]["memory"]["peak"] > 0 and fast["result"]["roofline"]


def _fallback_cases() -> dict[str, tuple[nn.Module, tuple[Any, ...], dict[str, Any]]]:
    torch.manual_seed(0)
    x = torch.randn(4, 2, 3)

    class Packed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(3, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lstm(nn.utils.rnn.pack_padded_sequence(x, [4, 2]))[0].data

    return {
        "packed sequence": (Packed().eval(), (x,), {}),
        "proj_size": (nn.LSTM(3, 5, proj_size=2).eval(), (x,), {}),
        "dropout in training": (nn.GRU(3, 5, num_layers=2, dropout=0.5).train(), (x,), {}),
        "backward": (nn.LSTM(3, 5), (x,), {"backward": True}),
        "non-contiguous input": (nn.GRU(3, 5).eval(), (torch.randn(2, 4, 3).transpose(0, 1),), {}),
    }


@pytest.mark.parametrize("name", list(_fallback_cases()))
def test_what_the_fast_path_does_not_stand_for_runs_the_decomposition(name: str, emulated: list[int]) -> None:
    model, args, spec = _fallback_cases()[name]
    trace = record_trace(RunSpec(model, args, **spec))
    assert emulated == []
    assert any(e.level == "dispatch" and e.op in ("aten::addmm", "aten::mm") for e in trace.events)


def test_a_call_of_other_sizes_is_left_to_the_decomposition(emulated: list[int]) -> None:
    """Sizes the weights do not fit are not written: the decomposition fails on meta (its ``addmm`` names the
    mismatch) and the run goes on as it did before, on FakeTensors (where the CPU's fused kernel accepts them)."""
    lstm = nn.LSTM(3, 4)

    class Direct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = lstm

        def forward(self, x: torch.Tensor) -> Any:
            h = torch.zeros(1, x.shape[1], 4)
            return torch.lstm(x, (h, h), lstm._flat_weights, True, 1, 0.0, False, False, False)

    trace = _assert_same_trace(Direct().eval(), (torch.randn(2, 1, 5),))
    assert emulated == []
    assert trace.execution == "fake"
