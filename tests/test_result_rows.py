"""The Result's rows against a naive oracle: every column of every module read straight from statistics counted
here (one ``count`` per metric, the memory model, the roofline), copied and summed the plain way, parameters by
every name prefix, the uncalled modules found eagerly. The builder reads the same tables in a faster way (column by
column, parameters by module only, the uncalled modules when first read); both must agree value for value and in
the order of every dict (compared by ``repr``), on several models and settings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import hypothesis
import pytest
import torch
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

from modelmeter import analyze
from modelmeter.analysis import build_result
from modelmeter.engine.trace import PHASES, Trace
from modelmeter.handles.conventions import get_convention
from modelmeter.handles.fvcore import ACTIVATION_HANDLES
from modelmeter.metrics.counting import Ancestors, count
from modelmeter.metrics.memory import MemoryModel, activation_statistics, module_peaks, optimizer_spec, saved_bytes
from modelmeter.metrics.parameters import count_by_module, count_by_prefix
from modelmeter.metrics.roofline import RooflineSettings, roofline
from modelmeter.reports.result import Result
from modelmeter.session import result_from_trace
from modelmeter.views import ActivationCountAnalysis, FlopCountAnalysis


class Checkpointed(nn.Module):
    """A recompute phase, a shared parameter, a module that never runs and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16))
        self.head = nn.Linear(16, 16)
        self.tied = nn.Linear(16, 16)
        self.tied.weight = self.head.weight
        self.unused = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.body, x, use_reentrant=False)
        return self.tied(self.head(x).softmax(-1))


def _models() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                    enable_nested_tensor=False)
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))
    return {"conv": (conv, torch.randn(2, 3, 16, 16)),
            "checkpointed": (Checkpointed(), torch.randn(4, 16)),
            "encoder": (encoder, torch.randn(2, 5, 16)),
            "lstm": (nn.LSTM(4, 8, num_layers=2, bidirectional=True), torch.randn(3, 2, 4))}


SETTINGS: list[dict[str, Any]] = [
    {},
    {"convention": "macs"},
    {"convention": "flops", "backward": True},
    {"memory": True},
    {"backward": True, "memory": True, "optimizer": "adamw"},
    {"device": "h100"},
    {"backward": True, "convention": "flops", "memory": True, "optimizer": "adam", "device": "a100"},
]


def _phase_columns(columns: dict[str, Mapping[str, Any]], metric: str, counts: Mapping[str, Any],
                   by_phase: Mapping[str, Mapping[str, Any]], phases: list[str]) -> None:
    columns[metric] = counts
    if len(phases) > 1:
        for phase in phases:
            columns[f"{phase}_{metric}"] = by_phase.get(phase, {})


def _oracle_rows(trace: Trace, settings: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Every row as ``(name, type, params, metrics, by_operator, called, output_shapes)``, the naive way."""
    chosen = get_convention(settings.get("convention", "fvcore"))
    flops = count(trace, chosen.handles, elementwise=chosen.elementwise)
    activations = count(trace, ACTIVATION_HANDLES, phases=("forward",))
    run_phases = trace.phases()
    columns: dict[str, Mapping[str, Any]] = {}
    _phase_columns(columns, "flops", flops.counts, flops.by_phase, [p for p in run_phases if p in PHASES])
    _phase_columns(columns, "activations", activations.counts, activations.by_phase, ["forward"])
    peaks: Mapping[str, int] | None = None
    spec = None
    if settings.get("memory"):
        model = MemoryModel(trace)
        spec = None if settings.get("optimizer") is None else optimizer_spec(settings["optimizer"])
        columns["activation_bytes"] = activation_statistics(model).counts
        if trace.backward:
            columns["saved_bytes"] = saved_bytes(model)
        peaks = module_peaks(model, spec)
    ratios = {}
    if settings.get("device"):
        time = roofline(trace, RooflineSettings(_device(settings["device"])), optimizer=spec)
        phases = [*run_phases, *(["optimizer"] if time.time.by_phase.get("optimizer") else [])]
        _phase_columns(columns, "bytes", time.bytes.counts, time.bytes.by_phase, phases)
        _phase_columns(columns, "time", time.time.counts, time.time.by_phase, phases)
        ratios = {"intensity": (time.flops.counts, time.bytes.counts),
                  "compute_bound": (time.compute_bound_time.counts, time.time.counts)}
    params = count_by_prefix(trace.modules)
    uncalled = Ancestors(trace, "owner").uncalled()
    rows = []
    for info in trace.modules:
        by_operator = {metric: dict(table.get(info.name, {})) for metric, table in columns.items()}
        values = {metric: sum(ops.values()) for metric, ops in by_operator.items()}
        if peaks is not None:
            values["peak_memory"] = peaks.get(info.name, 0)
        for metric, (numerator, denominator) in ratios.items():
            top, below = numerator.get(info.name, {}), denominator.get(info.name, {})
            by_operator[metric] = {op: top.get(op, 0) / v for op, v in below.items() if v}
            values[metric] = sum(top.values()) / sum(below.values()) if sum(below.values()) else 0.0
        rows.append((info.name, info.type, params.get(info.name, 0), values, by_operator, info.name not in uncalled,
                     dict(trace.output_shapes.get(info.name, {}))))
    return rows


def _device(name: str) -> Any:
    from modelmeter.devices import get_device

    return get_device(name)


def _rows(result: Result) -> list[tuple[Any, ...]]:
    return [(r.name, r.type, r.params, r.metrics, r.by_operator, r.called, r.output_shapes) for r in result.modules]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "plain")
@pytest.mark.parametrize("name", list(_models()))
def test_rows_are_the_naive_rows(name: str, settings: dict[str, Any]) -> None:
    model, x = _models()[name]
    analysis = analyze(model, x, quiet=True, **settings)
    expected = repr(_oracle_rows(analysis.trace, settings))
    assert repr(_rows(analysis.result())) == expected
    options = {k: v for k, v in settings.items() if k != "backward"}
    assert repr(_rows(result_from_trace(analysis.trace, **options))) == expected
    # a second result of the same views: the statistics the rows copied are unchanged
    assert repr(_rows(analysis.result())) == expected


def test_rows_of_views_in_caller_mode_and_with_user_handles() -> None:
    """``build_result`` of views whose counts are not the convention's: the rows follow the views' statistics."""
    model, x = _models()["conv"]
    flops = FlopCountAnalysis(model, x).ancestor_mode("caller").set_op_handle("aten::_convolution", lambda i, o: 7)
    activations = ActivationCountAnalysis(model, x)
    result = build_result(model, {"flops": flops, "activations": activations})
    for row in result.modules:
        assert row.by_operator["flops"] == dict(flops.statistics().counts.get(row.name, {}))
        assert row.metrics["flops"] == flops.total(row.name)
        assert row.metrics["activations"] == activations.total(row.name)
        assert row.called == (row.name not in flops.uncalled_modules())
    row = result.modules[1]
    row.by_operator["flops"]["mine"] = 1  # a row owns its dicts
    assert "mine" not in flops.statistics().counts.get(row.name, {})


@pytest.mark.parametrize("name", list(_models()))
def test_parameters_by_module_are_those_by_prefix(name: str) -> None:
    trace = analyze(_models()[name][0], _models()[name][1], quiet=True).trace
    by_prefix = count_by_prefix(trace.modules)
    by_module = count_by_module(trace.modules)
    assert {info.name: by_module.get(info.name, 0) for info in trace.modules} == \
        {info.name: by_prefix.get(info.name, 0) for info in trace.modules}
    assert set(by_module) <= set(by_prefix)


def test_uncalled_modules_are_found_when_read() -> None:
    trace = analyze(Checkpointed(), torch.randn(2, 16), quiet=True).trace
    stats = count(trace, ACTIVATION_HANDLES)
    assert "uncalled" not in vars(stats)  # not walked yet
    assert stats.uncalled == Ancestors(trace, "owner").uncalled() == {"unused"}
    assert stats.uncalled is stats.uncalled  # found once


def test_roofline_phases_say_whether_the_optimizer_step_was_timed() -> None:
    trace = analyze(Checkpointed(), torch.randn(2, 16), backward=True, quiet=True).trace
    settings = RooflineSettings(_device("h100"))
    assert roofline(trace, settings).phases == trace.phases() == ["forward", "backward", "recompute"]
    timed = roofline(trace, settings, optimizer=optimizer_spec("adamw"))
    assert timed.phases == [*trace.phases(), "optimizer"]
    assert timed.time.by_phase["optimizer"]


def test_table_after_result_counts_nothing_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The printed table reads quiet views that take the analysis's statistics when it has counted them; the text
    is the one a fresh analysis prints."""
    model, x = _models()["conv"]
    expected = analyze(model, x.clone(), quiet=True).table()
    analysis = analyze(model, x.clone(), quiet=True)
    analysis.result()
    calls = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return count(*args, **kwargs)

    monkeypatch.setattr("modelmeter.views.count", counting)
    assert analysis.table() == expected
    assert calls == []
    analysis.flops.set_op_handle("aten::_convolution", lambda i, o: 7)  # new handles: the flops counted again
    assert analysis.table() != expected
    assert len(calls) == 1


# counting: modelmeter's formulas applied once per distinct (arguments, results) objects in a pass ------------------
class _Causal(nn.Module):
    """Attention whose count reads a mask's attended pairs, in repeated layers of two sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            q = layer(x).unflatten(-1, (2, 4)).transpose(1, 2)
            x = x + nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).flatten(2)
            x = x + nn.functional.scaled_dot_product_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3]).mean()
        return x


def _memo_traces() -> dict[str, Trace]:
    stack = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(6)))
    traces = {name: analyze(model, x, quiet=True).trace for name, (model, x) in _models().items()}
    traces["stack"] = analyze(stack, torch.randn(2, 8), quiet=True).trace
    traces["causal"] = analyze(_Causal(), torch.randn(2, 5, 8), quiet=True).trace
    for name in ("checkpointed", "encoder", "stack", "lstm"):
        model, x = _models()[name] if name != "stack" else (stack, torch.randn(2, 8))
        traces[f"{name}-backward"] = analyze(model, x, backward=True, quiet=True).trace
    return traces


def _every_count(trace: Trace) -> str:
    """The repr of every table and unit of the counts a Result and a roofline make over ``trace``."""
    from modelmeter.metrics.traffic import count_bytes

    made = []
    for convention in ("fvcore", "macs", "flops"):
        for dense in (False, True):
            chosen = get_convention(convention, dense_attention=dense)
            units: list[Any] = []
            stats = count(trace, chosen.handles, elementwise=chosen.elementwise, units=units)
            made.append((stats.counts, stats.by_phase, stats.dtypes, stats.unsupported, units))
            caller = count(trace, chosen.handles, "caller", elementwise=chosen.elementwise)
            made.append((caller.counts, caller.dtypes, caller.unsupported))
    activations = count(trace, ACTIVATION_HANDLES, phases=("forward",))
    units = []
    traffic = count_bytes(trace, units=units)
    made += [(activations.counts, activations.dtypes, activations.unsupported),
             (traffic.counts, traffic.by_phase, traffic.dtypes, units)]
    return repr(made)


def test_remembered_formulas_count_what_a_call_per_event_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every table, dict order included, and every unit are those of the pass that calls each formula at every
    event (nothing remembered): on repeated layers, attention under masks, recurrent layers, backward passes."""
    from modelmeter.metrics import counting

    traces = _memo_traces()
    remembered = {name: _every_count(trace) for name, trace in traces.items()}
    monkeypatch.setattr(counting, "_ours", lambda handle: False)
    assert {name: _every_count(trace) for name, trace in traces.items()} == remembered


def test_repeated_layers_apply_a_formula_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memo is used (the test above is not vacuous): six equal layers, one application of linear's formula."""
    from modelmeter.metrics import counting

    trace = _memo_traces()["stack"]
    applied: list[str] = []

    def as_items(op: str, value: Any) -> list[tuple[str, Any]]:
        applied.append(op)
        return [(counting._short_name(op), value)]

    monkeypatch.setattr(counting, "_as_items", as_items)
    chosen = get_convention("fvcore")
    assert count(trace, chosen.handles).counts[""] == {"linear": 6 * 2 * 8 * 8}
    assert applied == ["aten::linear"]
    monkeypatch.setattr(counting, "_ours", lambda handle: False)
    applied.clear()
    count(trace, chosen.handles)
    assert applied == ["aten::linear"] * 6


def test_the_users_handles_are_called_at_every_event() -> None:
    """A handle the user registered or set is the user's code: called for each of six equal layers."""
    from modelmeter.handles.binding import by_name
    from modelmeter.handles.conventions import register_handle, unregister_handle

    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(6)))
    calls: list[int] = []

    def handle(inputs: list[Any], outputs: list[Any]) -> int:
        calls.append(1)
        return 1

    @by_name
    def formula(input: Any) -> int:
        calls.append(2)
        return 2

    for registered, each in ((handle, 1), (formula, 2)):
        register_handle("aten::linear", registered)
        try:
            assert FlopCountAnalysis(model, torch.randn(2, 8)).total() == 6 * each
        finally:
            unregister_handle("aten::linear")
        assert calls == [each] * 6
        calls.clear()
    assert FlopCountAnalysis(model, torch.randn(2, 8)).set_op_handle("aten::linear", handle).total() == 6
    assert calls == [1] * 6

    class Unhashable:  # (equality without a hash: a handle need not be hashable)
        def __eq__(self, other: object) -> bool:
            return other is self

        def __call__(self, inputs: list[Any], outputs: list[Any]) -> int:
            return 3

    register_handle("aten::linear", Unhashable())
    try:
        assert FlopCountAnalysis(model, torch.randn(2, 8)).total() == 18
    finally:
        unregister_handle("aten::linear")


def test_only_modelmeters_formulas_are_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    from modelmeter.handles import conventions
    from modelmeter.handles.binding import by_name
    from modelmeter.handles.traffic import kernel_rule
    from modelmeter.metrics.counting import _ours

    monkeypatch.setattr(conventions, "_REGISTERED", {})  # the built-in table alone (other tests register handles)
    chosen = get_convention("flops")
    assert all(_ours(handle) for handle in chosen.handles.values() if callable(handle))
    assert _ours(chosen.elementwise) and _ours(kernel_rule("aten::add"))
    assert _ours(ACTIVATION_HANDLES["aten::linear"])
    assert not _ours(lambda inputs, outputs: 1)
    assert not _ours(by_name(lambda input: 1).bind("aten::linear"))


# fvcore's tables: the sizes as format_size prints each ----------------------------------------------------------
def _format_size_before(x: float, sig_figs: int = 3) -> str:
    """format_size as it was written before (the oracle), with the rule added since for what rounds to zero: an
    exact zero is "0" (-0.0 too), any other value "<0.001" or ">-0.001" (at three decimals)."""
    def fixed(v: float) -> str:
        text = f"{v:.{sig_figs}f}"
        return text.rstrip("0").rstrip(".") if "." in text else text

    for threshold, scale, suffix in ((1e14, 1e15, "P"), (1e11, 1e12, "T"), (1e8, 1e9, "G"), (1e5, 1e6, "M"),
                                     (1e2, 1e3, "K")):
        if abs(x) > threshold:
            return fixed(x / scale) + suffix
    if x == 0:
        return "0"
    if fixed(x) not in ("0", "-0"):
        return fixed(x)
    smallest = fixed(10.0 ** -sig_figs)
    if x > 0:
        return "<" + smallest
    return ">-" + smallest


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.lists(st.one_of(st.integers(-10**18, 10**18), st.floats(allow_nan=True, allow_infinity=True),
                          st.booleans(), st.sampled_from([0, 0.0, -0.0, 100, 100.0, 101, 1e5, 99.9995, True])),
                max_size=12),
       st.integers(0, 4))
def test_sizes_are_format_sizes(values: list[Any], sig_figs: int) -> None:
    """Each cell as the former format_size printed its value (an int met again reuses its text; 0, 0.0, -0.0, True
    and 1 each their own)."""
    from modelmeter.reports.fvcore_tables import _sizes, format_size

    rows = {f"m{i}": {"a": value, "b": values[-1 - i]} for i, value in enumerate(values)}
    expected = {name: {c: _format_size_before(v, sig_figs) for c, v in row.items()} for name, row in rows.items()}
    assert repr(_sizes(rows, sig_figs)) == repr(expected)
    assert [format_size(v, sig_figs) for v in values] == [_format_size_before(v, sig_figs) for v in values]


def _children_before(names: Any) -> dict[str, list[str]]:
    kids: dict[str, list[str]] = {}
    for name in names:
        if name:
            kids.setdefault(name.rsplit(".", 1)[0] if "." in name else "", []).append(name)
    return kids


def _drop_zero_rows_before(stats: dict[str, dict[str, Any]], keep: set[str], keep_parents: bool) -> dict[str, Any]:
    kids = _children_before(stats)
    kept: set[str] = set()

    def visit(name: str) -> bool:
        child_kept = [visit(child) for child in kids.get(name, [])]
        if any(v != 0 for v in stats[name].values()) or name in keep or (keep_parents and any(child_kept)):
            kept.add(name)
            return True
        return False

    visit("")
    return {name: row for name, row in stats.items() if name in kept}


_names = st.lists(st.lists(st.sampled_from(["a", "b", "0", "1", "conv"]), min_size=1, max_size=4)
                  .map(".".join), max_size=25)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(_names, st.lists(st.sampled_from([0, 0, 1, 0.0, -0.0, 5, 0.5]), min_size=1, max_size=60),
                  st.booleans(), st.sets(st.sampled_from(["", "a", "a.b", "b.0", "conv"])))
def test_zero_rows_are_dropped_as_before(names: list[str], values: list[Any], keep_parents: bool,
                                         keep: set[str]) -> None:
    """The table's tree (children by dotted name, rows kept by value, by ``keep`` or for a kept child) as the code
    before built it, on random module trees (parents missing, names repeated, zeros of every type)."""
    from modelmeter.reports.fvcore_tables import _children, _drop_zero_rows

    all_names = ["", *dict.fromkeys(names)]
    stats = {name: {"x": values[i % len(values)], "y": values[(3 * i + 1) % len(values)]}
             for i, name in enumerate(all_names)}
    assert repr(_children(stats)) == repr(_children_before(stats))
    assert repr(_drop_zero_rows(stats, keep, keep_parents)) == repr(_drop_zero_rows_before(stats, keep, keep_parents))
