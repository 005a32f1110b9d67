"""The public API given wrong arguments, or used in ways the other tests never tried (round 4): every mistake a
clear modelmeter error naming the argument, never a bare built-in error, a silent default or a wrong number."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import modelmeter as mm
from modelmeter import FlopCountAnalysis, InvalidTypeError, InvalidValueError


@pytest.fixture(autouse=True)
def _quiet_log() -> Any:
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def two_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 3))


# --- a trace given for another run -----------------------------------------------------------------------------
def test_a_trace_of_another_model_inputs_or_pass_is_refused() -> None:
    one = nn.Sequential(nn.Linear(10, 10))
    x = torch.randn(1, 10)
    recorded = FlopCountAnalysis(one, x).trace
    with pytest.raises(InvalidValueError, match="another model"):  # counted as 100, the model's is 260
        FlopCountAnalysis(two_linears(), x, trace=recorded)
    with pytest.raises(InvalidValueError, match=r"other inputs \(1x10 float32, not 7x10 float32\)"):
        FlopCountAnalysis(one, torch.randn(7, 10), trace=recorded)  # counted as 100, the run is 700
    with pytest.raises(InvalidValueError, match="without its backward pass"):
        FlopCountAnalysis(one, x, backward=True, trace=recorded)
    with pytest.raises(InvalidTypeError, match="trace must be a modelmeter Trace"):
        FlopCountAnalysis(one, x, trace="trace.json")  # type: ignore[arg-type]
    assert FlopCountAnalysis(one, x, trace=recorded).total() == 100  # the same run is taken as it is


def test_cache_must_be_a_flag_or_a_cache() -> None:
    with pytest.raises(InvalidTypeError, match="cache must be True, False, None or a TraceCache, got 'no'"):
        FlopCountAnalysis(two_linears(), torch.randn(1, 10), cache="no")  # type: ignore[arg-type]
