"""The public API given wrong arguments, or used in ways the other tests never tried (round 4): every mistake a
clear modelmeter error naming the argument, never a bare built-in error, a silent default or a wrong number."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
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
    # what fvcore's callers pass besides bools: 0 and 1, numpy's bool (fvcore takes any truthy value)
    assert flops.unsupported_ops_warnings(0) is flops  # type: ignore[arg-type]
    assert flops.uncalled_modules_warnings(np.bool_(True)) is flops  # type: ignore[arg-type]
    assert mm.flop_count_table(flops, 1, None, 1) == mm.flop_count_table(flops, 1, None, True)  # type: ignore[arg-type]


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


# --- the printed reports ------------------------------------------------------------------------------------------
def test_report_functions_refuse_what_is_not_an_analysis_a_depth_or_a_flag() -> None:
    model = two_linears()
    flops = FlopCountAnalysis(model, torch.randn(1, 10))
    with pytest.raises(InvalidTypeError, match="flops must be an analysis such as FlopCountAnalysis"):
        mm.flop_count_table(model)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="activations must be an analysis.*got str"):
        mm.flop_count_str(flops, "activations")  # type: ignore[arg-type]
    for table in (lambda depth: mm.flop_count_table(flops, depth),
                  lambda depth: mm.parameter_count_table(model, depth)):
        with pytest.raises(InvalidValueError, match="max_depth must be 0 or more"):
            table(-1)
        for wrong in ("2", 1.5, None, True):
            with pytest.raises(InvalidTypeError, match="max_depth must be an integer number of levels"):
                table(wrong)
    with pytest.raises(InvalidTypeError, match="show_param_shapes must be True or False, got 'no'"):
        mm.flop_count_table(flops, 3, None, "no")  # type: ignore[arg-type]
    # the edges that are right: the model's row alone, and every level
    assert mm.flop_count_table(flops, 0).count("\n") == 2
    assert mm.flop_count_table(flops, 10**9) == mm.flop_count_table(flops, 2)


def test_activations_of_another_model_are_refused() -> None:
    model = two_linears()
    x = torch.randn(1, 10)
    flops = FlopCountAnalysis(model, x)
    other_model = mm.ActivationCountAnalysis(nn.Sequential(nn.Linear(10, 3)), x)
    with pytest.raises(InvalidValueError, match=r"activations analyses another model \(Sequential\)"):
        mm.flop_count_table(flops, activations=other_model)  # fvcore prints its 3 under this model's rows
    with pytest.raises(InvalidValueError, match="another model"):
        mm.flop_count_str(flops, other_model)
    same = mm.ActivationCountAnalysis(model, torch.randn(1, 10))  # another call of the same model: its own run
    assert mm.flop_count_table(flops, 0, activations=same).endswith("| model    | 0.283K                 | 0.26K    "
                                                                    "|             23 |")


# --- analyze, results, build_result, render -----------------------------------------------------------------------
def test_analyze_flags_and_names_are_checked() -> None:
    model = two_linears()
    x = torch.randn(1, 10)
    for option in ("quiet", "memory"):
        with pytest.raises(InvalidTypeError, match=f"{option} must be True or False, got 'no'"):
            mm.analyze(model, x, **{option: "no"})  # a truthy "no" turned the memory analysis on
    with pytest.raises(InvalidTypeError, match="dense_attention must be True or False"):
        FlopCountAnalysis(model, x, dense_attention="no")  # type: ignore[arg-type]
    analysis = mm.analyze(model, x, quiet=True)
    with pytest.raises(InvalidTypeError, match="name must be a string"):
        analysis.result(3)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="interconnect describes the time on a device"):
        analysis.step_time("nvlink")  # was None, the interconnect unread
    with pytest.raises(InvalidValueError, match="interconnect describes the time on a device"):
        analysis.rank_costs("nvlink")
    with pytest.raises(mm.DeviceError):
        mm.analyze(model, x, quiet=True, device="h100").step_time("no-such-link")


def test_result_totals_json_and_render_refuse_wrong_arguments() -> None:
    result = mm.analyze(two_linears(), torch.randn(1, 10), quiet=True).result()
    assert result.total("flops") == 260
    assert result.total("time") == 0  # one of modelmeter's metrics, not counted without a device
    for wrong in ("flop", "params", 3):
        with pytest.raises(mm.InvalidNameError, match="no metric .* in the result; its metrics: flops, activations"):
            result.total(wrong)  # type: ignore[arg-type]
    with pytest.raises(mm.InvalidNameError, match="no metric 'flop'"):
        result.share("", "flop")
    with pytest.raises(InvalidValueError, match="indent must be a number of spaces"):
        result.to_json(-1)
    with pytest.raises(InvalidValueError, match="indent must be whitespace"):
        result.to_json("--")
    assert result.to_json("\t") == json.dumps(json.loads(result.to_json()), indent="\t")  # as json.dumps takes it
    with pytest.raises(InvalidTypeError, match="a result's JSON is text, got dict"):
        mm.Result.from_json(result.to_dict())  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="result must be a modelmeter Result"):
        mm.render(result.to_dict())  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="unknown report format"):
        mm.render(result, ["table"])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="columns must be a list of column keys"):
        mm.render(result, columns="flops")  # was read as the columns 'f', 'l', 'o', 'p', 's'
    with pytest.raises(InvalidTypeError, match="shapes must be True or False"):
        mm.render(result, shapes="no")  # type: ignore[arg-type]


def test_build_result_refuses_analyses_of_another_model() -> None:
    model = two_linears()
    x = torch.randn(1, 10)
    flops = FlopCountAnalysis(model, x)
    with pytest.raises(InvalidTypeError, match="model must be a torch.nn.Module"):
        mm.build_result("model", {"flops": flops})  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="needs a dict of at least one analysis"):
        mm.build_result(model, [flops])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="map metric names to analyses"):
        mm.build_result(model, {"flops": "flops"})  # type: ignore[dict-item]
    with pytest.raises(InvalidValueError, match="of another model"):
        mm.build_result(nn.Linear(10, 3), {"flops": flops})  # its rows were this model's, named after the other
    with pytest.raises(InvalidValueError, match="'activations' analysis analyses another model"):
        mm.build_result(model, {"flops": flops, "activations": mm.ActivationCountAnalysis(nn.Linear(10, 3), x)})
    result = mm.build_result(model, {"flops": flops, "activations": mm.ActivationCountAnalysis(model, x)})
    assert (result.total("flops"), result.total("activations")) == (260, 23)


def test_build_result_parts_html_and_result_from_trace_refuse_wrong_types() -> None:
    model = two_linears()
    analysis = mm.analyze(model, torch.randn(1, 10), quiet=True)
    for part in ("name", "memory", "time", "parallel"):
        with pytest.raises(InvalidTypeError, match=f"{part} must be a .* or None, got int"):
            mm.build_result(model, analysis.metrics, **{part: 3})
    result = analysis.result()
    with pytest.raises(InvalidTypeError, match="result must be a modelmeter Result"):
        mm.render_html(result.to_json())  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="compare must be a modelmeter Result"):
        mm.render_html(result, compare=result.to_dict())  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="trace must be a modelmeter Trace"):
        mm.result_from_trace(result)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="memory must be True or False, got 'no'"):
        mm.result_from_trace(analysis.trace, memory="no")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="name must be a string or None"):
        mm.result_from_trace(analysis.trace, name=3)  # type: ignore[arg-type]
    assert mm.result_from_trace(analysis.trace) == result


def test_malformed_result_json_is_a_modelmeter_error() -> None:
    with pytest.raises(InvalidValueError, match="a result is not valid JSON: Expecting property name"):
        mm.Result.from_json("{bad")
    with pytest.raises(InvalidValueError, match="not valid JSON"):
        mm.Result.from_json('{"schema_version": 1' + "1" * 5000 + "}")  # an integer of too many digits


# --- reusing and copying an analysis --------------------------------------------------------------------------------
def test_copy_copy_of_an_analysis_has_handles_and_modes_of_its_own() -> None:
    import copy

    flops = FlopCountAnalysis(two_linears(), torch.randn(1, 10))
    assert flops.total() == 260
    copied = copy.copy(flops)
    copied.set_op_handle("aten::linear", None).ancestor_mode("caller")
    assert copied.total() == 0
    flops.ancestor_mode("caller")  # a recount of the original: its own handles still count the linears
    assert flops.total() == 260
    assert copied.trace is flops.trace  # the same run, not run again
    deep = copy.deepcopy(flops)
    deep.set_op_handle("aten::linear", None)
    assert (deep.total(), flops.total()) == (0, 260)


def test_settings_changed_after_results_recount_and_chain() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(10, 10)), nn.Linear(10, 3))
    flops = FlopCountAnalysis(model, torch.randn(1, 10))
    assert flops.by_module()["0"] == 100
    same = flops.ancestor_mode("caller").tracer_warnings("none").unsupported_ops_warnings(False)
    assert same is flops and flops.by_module()["0"] == 100  # fvcore keeps its stale cache here; this recounts
    flops.set_op_handle("aten::linear", lambda inputs, outputs: 7)
    assert flops.by_module() == {"": 14, "0": 7, "0.0": 7, "1": 7}
    assert flops.clear_op_handles().total() == 0


def test_handle_counters_are_keyed_by_names_and_registered_handles_are_checked() -> None:
    from collections import Counter

    flops = FlopCountAnalysis(two_linears(), torch.randn(1, 10))
    with pytest.raises(InvalidValueError, match="returned a Counter keyed by 1; its keys are the names"):
        flops.set_op_handle("aten::linear", lambda inputs, outputs: Counter({1: 5})).total()  # JSON made it "1"
    with pytest.raises(InvalidValueError, match="a cost cannot be negative"):
        flops.set_op_handle("aten::linear", lambda inputs, outputs: Counter({"linear": -5})).total()
    with pytest.raises(InvalidTypeError, match="the handle for mylib::fused must be callable or None, got int"):
        mm.register_handle("mylib::fused", 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="operator names are strings, 'namespace::name'.*got 3"):
        mm.register_handle(3, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="operator names are 'namespace::name'.*got 'fused'"):
        mm.register_handle("fused", None)


def test_a_result_with_a_nan_cost_renders_in_every_format() -> None:
    def nan_for_the_first(inputs: list[Any], outputs: list[Any]) -> float:
        return float("nan") if outputs[0].shape[-1] == 20 else 1000.0

    analysis = mm.analyze(two_linears(), torch.randn(1, 10), quiet=True)
    analysis.flops.set_op_handle("aten::linear", nan_for_the_first)
    result = analysis.result()
    table = mm.render(result).splitlines()  # the model's NaN set the column's unit: int(NaN) failed
    assert table[2].split()[:4] == ["model", "Sequential", "0.283K", "nan"]
    assert table[4].split()[:4] == ["1", "Linear", "0.063K", "1K"]  # the finite one keeps its unit
    assert "|      nan |" in mm.render(result, "markdown")
    assert mm.render(result, width=1).splitlines()[2].split() == ["model", "nan"]
    for fmt in ("tree", "csv", "json"):
        assert "nan" in mm.render(result, fmt) or "null" in mm.render(result, fmt)


def test_parameter_count_of_a_torchscript_module_is_its_parameters() -> None:
    import warnings

    model = two_linears()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        scripted = torch.jit.script(model)
    # fvcore counts it (named_parameters); its class computes `forward` on access, which failed on the class
    assert mm.parameter_count(scripted) == mm.parameter_count(model)
    assert mm.parameter_count_table(scripted) == mm.parameter_count_table(model)


def test_register_handle_still_takes_a_formula() -> None:
    from modelmeter.handles.binding import by_name

    @by_name()
    def scale(self: Any) -> int:
        return 1

    mm.register_handle("mylib::round4_scale", scale)
    mm.unregister_handle("mylib::round4_scale")
