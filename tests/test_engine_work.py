"""What recording costs grows linearly with the events recorded: counted as work (Python calls), never as time.

An LSTM runs the same cell operators once per time step, so the work per step must not depend on how many steps
came before (nothing scans what was recorded so far), and no step may run PyTorch's Python element-wise meta kernels
(``torch._prims``' ``_prim_elementwise_meta``, what every element-wise reference of ``torch._refs`` runs: hundreds of
microseconds per call, most of an LSTM's analysis before): the direct kernels of ``engine/meta_kernels.py`` make
the cell's outputs.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter.engine import recurrent
from modelmeter.engine.spec import RunSpec
from modelmeter.engine.tracer import record_trace

_ELEMENTWISE_META = "_prim_elementwise_meta"


def _recording_work(model: nn.Module, x: torch.Tensor, backward: bool = False) -> tuple[int, Counter[str]]:
    """(events recorded, Python calls made while recording: "all", and "elementwise meta" kernels)."""
    calls: Counter[str] = Counter()

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if event == "call":
            calls["all"] += 1
            if frame.f_code.co_name == _ELEMENTWISE_META:
                calls["elementwise meta"] += 1

    sys.setprofile(profile)
    try:
        trace = record_trace(RunSpec(model, (x,), backward=backward))
    finally:
        sys.setprofile(None)
    return len(trace.events), calls


@pytest.mark.parametrize("written", [True, False], ids=["written", "decomposed"])
@pytest.mark.parametrize("make", [lambda: nn.LSTM(8, 16, num_layers=2, bidirectional=True),
                                  lambda: nn.GRU(8, 16, num_layers=2)], ids=["lstm", "gru"])
def test_a_recurrent_layer_costs_the_same_work_per_step_however_long_the_sequence(make: Any, written: bool) -> None:
    """Both when the decomposition is written into the trace (engine/recurrent.py, the forward pass without
    autograd) and when it runs (a backward pass needs its autograd graph)."""
    torch.manual_seed(0)
    model = make().eval()
    with contextlib.nullcontext() if written else recurrent.decomposed():
        _flat_per_step(model)


def _flat_per_step(model: nn.Module) -> None:
    _recording_work(model, torch.randn(2, 1, 8))  # first calls of a process (caches, imports) are not the model's
    (e4, c4), (e8, c8), (e16, c16) = (_least_work(model, torch.randn(steps, 1, 8)) for steps in (4, 8, 16))
    assert e4 < e8 < e16
    # linear: the calls per added event are the same from 4 to 8 steps as from 8 to 16
    early = (c8["all"] - c4["all"]) / (e8 - e4)
    late = (c16["all"] - c8["all"]) / (e16 - e8)
    assert abs(late - early) <= 0.02 * early, (early, late)
    # the cell's operators (sigmoid_, tanh_, add_, the products of two gates) run no Python element-wise meta
    # kernel: as many run at 16 steps as at 4 (the layers' set-up only)
    assert c16["elementwise meta"] == c4["elementwise meta"], (c4["elementwise meta"], c16["elementwise meta"])


def _least_work(model: nn.Module, x: torch.Tensor) -> tuple[int, Counter[str]]:
    """:func:`_recording_work` of the least of three recordings: a process-wide memo of metadata may be full and
    start again during one of them (after a whole test suite's shapes), a cost of that recording alone."""
    runs = [_recording_work(model, x) for _ in range(3)]
    return min(runs, key=lambda run: run[1]["all"])


class _Holder(nn.Module):
    """A linear layer beside ``count`` parameters the forward never reads: what they add is the recording's fixed
    work per parameter (the snapshot, the stand-in, its storage record, the module table, the end of the run)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        for i in range(count):
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(3)))
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_a_parameter_costs_a_few_calls_whatever_the_run(backward: bool) -> None:
    """The end of a run reads the parameters (their storages, their gradients) with the function recorder set aside:
    under it every read was a user-level call opened and dropped again, 30 Python calls per parameter in all (42 with
    a backward pass) before; 15 now, a distinct name costing its own description in the module table."""
    x = torch.randn(2, 3)
    _recording_work(_Holder(1), x, backward)  # first calls of a process are not the model's
    (e100, c100), (e200, c200) = (_recording_work(_Holder(count), x, backward) for count in (100, 200))
    assert e100 == e200
    assert (c200["all"] - c100["all"]) / 100 <= 16, (c100["all"], c200["all"])
