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


# --- settings and handles ----------------------------------------------------------------------------------------
def test_warning_toggles_take_only_flags() -> None:
    flops = FlopCountAnalysis(two_linears(), torch.randn(1, 10))
    with pytest.raises(InvalidTypeError, match="enabled must be True or False, got 'no'"):
        flops.unsupported_ops_warnings("no")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="enabled must be True or False, got None"):
        flops.uncalled_modules_warnings(None)  # type: ignore[arg-type]


def test_set_op_handle_refuses_a_name_no_operator_has_and_sets_nothing_when_one_pair_is_wrong() -> None:
    flops = FlopCountAnalysis(two_linears(), torch.randn(1, 10))
    assert flops.total() == 260
    with pytest.raises(InvalidValueError, match="'namespace::name'.*got 'linear'"):
        flops.set_op_handle(linear=lambda inputs, outputs: 1)  # fvcore: silently counts nothing under it
    with pytest.raises(InvalidTypeError, match="the handle for aten::addmm must be callable"):
        flops.set_op_handle("aten::linear", None, "aten::addmm", 3)
    with pytest.raises(InvalidTypeError, match="operator names must be strings"):
        flops.set_op_handle(["aten::linear"], None)
    assert flops.total() == 260  # the first, valid pair was not set either
    assert flops.counts_as_made()


def test_a_handle_that_fails_or_returns_a_negative_cost_names_the_operator() -> None:
    def failing(inputs: list[Any], outputs: list[Any]) -> int:
        return 1 // 0

    def negative(inputs: list[Any], outputs: list[Any]) -> int:
        return -5

    flops = FlopCountAnalysis(two_linears(), torch.randn(1, 10))
    with pytest.raises(InvalidValueError, match=r"handle of aten::linear \(failing\) raised ZeroDivisionError") as info:
        flops.set_op_handle("aten::linear", failing).total()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(InvalidValueError, match=r"raised TypeError: .*positional argument"):
        flops.set_op_handle("aten::linear", lambda inputs: 1).total()
    with pytest.raises(InvalidValueError, match="aten::linear returned -5; a cost cannot be negative"):
        flops.set_op_handle("aten::linear", negative).total()  # its result could not be read back from JSON
    with pytest.raises(InvalidValueError, match="returned -1.5; a cost cannot be negative"):
        mm.flop_count(two_linears(), torch.randn(1, 10), {"aten::linear": lambda i, o: -1.5})


def test_flop_count_supported_ops_must_be_a_mapping() -> None:
    with pytest.raises(InvalidTypeError, match="supported_ops must be a dict of operator names to handles"):
        mm.flop_count(two_linears(), torch.randn(1, 10), [("aten::linear", None)])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="supported_ops must be a dict"):
        mm.activation_count(two_linears(), torch.randn(1, 10), "aten::linear")  # type: ignore[arg-type]
