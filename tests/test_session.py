"""The session layer: one run spec and one trace per session, analyses as views over it, the Result from a trace
alone (the same numbers as ``analyze(...).result()``), and the layering of metrics and reports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter import (
    ActivationCountAnalysis,
    FlopCountAnalysis,
    MemoryAnalysis,
    ModelAnalysis,
    RunSpec,
    Session,
    analyze,
    flop_count_str,
    parameter_count,
)
from modelmeter.engine.serialize import dumps, loads
from modelmeter.reports.fvcore_tables import flop_count_str_text
from modelmeter.session import result_from_trace
from modelmeter.zoo import get_model, input_shape

SRC = Path(__file__).resolve().parents[1] / "src" / "modelmeter"


def _tokens(name: str) -> torch.Tensor:
    return torch.randint(0, 100, input_shape(name))


OPTIONS: list[dict[str, Any]] = [
    {},
    {"convention": "flops", "memory": True},
    {"backward": True, "memory": True, "optimizer": "adamw", "state_dtype": "bfloat16"},
    {"backward": True, "convention": "macs", "memory": True, "optimizer": "sgd", "foreach": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=["default", "flops+memory", "training-adamw", "training-sgd"])
def test_result_from_trace_is_the_analysis_result(options: dict[str, Any]) -> None:
    """The pure builder gives the analysis's Result exactly, also on a trace that went through the serialiser."""
    model, x = get_model("gpt2_tiny", device="meta"), _tokens("gpt2_tiny")
    analysis = analyze(model, x, quiet=True, **options)
    expected = analysis.result().to_dict()
    recorded = {k: v for k, v in options.items() if k != "backward"}
    assert result_from_trace(analysis.trace, **recorded).to_dict() == expected
    assert result_from_trace(analysis.trace, **analysis.settings).to_dict() == expected  # what a saved trace keeps
    assert result_from_trace(loads(dumps(analysis.trace)), **recorded).to_dict() == expected
    assert result_from_trace(analysis.trace, name="mine", **recorded).model == "mine"
    assert expected["model"] == type(model).__name__ and expected["modules"][0]["params"] == parameter_count(model)[""]


def test_result_from_a_trace_in_a_process_that_never_built_the_model(tmp_path: Path) -> None:
    """A trace saved here renders the same Result in a process that imports no model code and builds no model."""
    model, x = get_model("resnet18", device="meta"), torch.randn(input_shape("resnet18"))
    analysis = analyze(model, x, quiet=True, memory=True)
    path = tmp_path / "run.trace"
    path.write_bytes(dumps(analysis.trace))
    script = ("import sys, json; from modelmeter.engine.serialize import loads; "
              "from modelmeter.session import result_from_trace; "
              "r = result_from_trace(loads(open(sys.argv[1], 'rb').read()), memory=True); "
              "assert not any(m.startswith(('modelmeter.zoo', 'torchvision')) for m in sys.modules); "
              "print(r.to_json())")
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(SRC.parent), "PATH": ""})
    assert json.loads(done.stdout) == analysis.result().to_dict()


def test_result_from_trace_checks_its_options() -> None:
    trace = analyze(nn.Linear(4, 4), torch.randn(2, 4), quiet=True).trace
    with pytest.raises(ValueError, match="memory options"):
        result_from_trace(trace, optimizer="adam")
    with pytest.raises(ValueError, match="training step"):
        result_from_trace(trace, memory=True, optimizer="adam")  # an inference trace has no optimizer step
    with pytest.raises(ValueError, match="convention"):
        result_from_trace(trace, convention="gflops")


def test_result_from_trace_logs_only_when_not_quiet(caplog: pytest.LogCaptureFixture) -> None:
    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    trace = analyze(Unused(), torch.randn(2, 4), quiet=True).trace
    with caplog.at_level("WARNING", logger="modelmeter"):
        result_from_trace(trace)
        assert caplog.records == []
        result_from_trace(trace, quiet=False)
    assert "never called" in caplog.text and "spare" in caplog.text


def test_views_of_one_analysis_share_one_session() -> None:
    analysis = analyze(get_model("bert_tiny", device="meta"), _tokens("bert_tiny"), quiet=True, memory=True)
    assert analysis.memory is not None
    assert analysis.flops.session is analysis.activations.session is analysis.memory.session is analysis.session
    assert analysis.parameters == parameter_count(analysis.model)
    copied = analysis.flops.copy()
    assert copied.session is analysis.session and copied.total() == analysis.flops.total()
    other = analysis.flops.copy(new_inputs=torch.randint(0, 100, (2, 64)))
    assert other.session is not analysis.session and other.total() == 2 * analysis.flops.total()


def test_a_session_records_once_and_views_made_from_it_share_the_run() -> None:
    model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4)
    session = Session(RunSpec.of(model, x))
    assert not session.recorded
    flops = FlopCountAnalysis.from_session(session, convention="macs")
    acts = ActivationCountAnalysis.from_session(session)
    assert flops.total() == 3 * (4 * 8 + 8 * 2) and acts.total() == 3 * (8 + 2)
    assert flops.trace is acts.trace is session.trace and session.recorded and not session.from_cache
    with pytest.raises(ValueError, match="loss_fn is only used for the backward pass"):
        RunSpec.of(model, x, loss_fn=torch.sum)
    direct = FlopCountAnalysis.from_session(Session(RunSpec(model, (x,))))  # a spec made without .of
    assert direct.copy(new_model=nn.Sequential(nn.Linear(4, 2))).total() == 3 * 4 * 2


def test_separate_analyses_of_one_call_share_one_recording(recordings: list[RunSpec]) -> None:
    """fvcore's pattern: a flops and an activations analysis of the same model and inputs run the model once,
    and count what their own runs would."""
    model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4)
    flops, acts = FlopCountAnalysis(model, x), ActivationCountAnalysis(model, x)
    assert (flops.total(), acts.total()) == (3 * (4 * 8 + 8 * 2), 3 * (8 + 2))
    assert acts.trace is flops.trace and len(recordings) == 1
    other = ActivationCountAnalysis(model, torch.randn(3, 4))  # equal shapes, another tensor: another call
    assert other.total() == acts.total() and other.trace is not flops.trace and len(recordings) == 2


def _changes() -> dict[str, Any]:
    """What must make a second analysis run the model again, each applied to (model, input) after the first."""
    def in_place_parameter(model: nn.Module, x: torch.Tensor) -> None:
        with torch.no_grad():
            model[0].weight.mul_(2)

    def parameter_data(model: nn.Module, x: torch.Tensor) -> None:
        model[0].weight.data = torch.randn(8, 4)  # the same Parameter object, new data

    def swapped_submodule(model: nn.Module, x: torch.Tensor) -> None:
        model[1] = nn.GELU()

    def attribute(model: nn.Module, x: torch.Tensor) -> None:
        model[2].p = 0.7

    def in_place_input(model: nn.Module, x: torch.Tensor) -> None:
        x.add_(1)

    def hook(model: nn.Module, x: torch.Tensor) -> None:
        model[0].register_forward_hook(lambda *_: None)

    return {"in_place_parameter": in_place_parameter, "parameter_data": parameter_data,
            "swapped_submodule": swapped_submodule, "attribute": attribute, "in_place_input": in_place_input,
            "train": lambda model, x: model.train(), "submodule_eval": lambda model, x: model[2].eval(),
            "requires_grad": lambda model, x: model[0].weight.requires_grad_(False), "hook": hook}


@pytest.mark.parametrize("change", list(_changes()))
def test_a_changed_call_runs_again(change: str, recordings: list[RunSpec]) -> None:
    """Every change between two analyses that could change the run invalidates the shared recording: the
    second analysis runs the model (and would count its own run)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5)).train()
    if change == "train":
        model.eval()
    x = torch.randn(3, 4)
    flops = FlopCountAnalysis(model, x)
    flops.total()
    ActivationCountAnalysis(model, x).total()
    assert len(recordings) == 1  # unchanged: shared
    _changes()[change](model, x)
    acts = ActivationCountAnalysis(model, x)
    assert acts.total() == 3 * 8 and acts.trace is not flops.trace and len(recordings) == 2


def test_a_tuple_attribute_is_keyed_by_its_values_and_their_types(recordings: list[RunSpec]) -> None:
    """A tuple of plain values (sizes, paddings) is keyed at once, by its values and their types: an equal tuple
    shares the recording, one whose element changed value or type (``1 == True``) does not."""
    model, x = nn.Sequential(nn.Linear(4, 8)), torch.randn(3, 4)
    model[0].sizes = (1, 2)
    FlopCountAnalysis(model, x).total()
    model[0].sizes = tuple([1, 2])  # another object, the same values
    ActivationCountAnalysis(model, x).total()
    assert len(recordings) == 1
    for changed in ((True, 2), (1, 3), (1.0, 2)):
        model[0].sizes = changed
        ActivationCountAnalysis(model, x).total()
    assert len(recordings) == 4


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "autocast", "default_dtype"])
def test_another_global_mode_runs_again(mode: str, recordings: list[RunSpec]) -> None:
    model, x = nn.Sequential(nn.Linear(4, 8)), torch.randn(3, 4)
    flops = FlopCountAnalysis(model, x)
    flops.total()
    contexts = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
                "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
    if mode == "default_dtype":
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            acts = ActivationCountAnalysis(model, x)
            acts.total()
        finally:
            torch.set_default_dtype(before)
    else:
        with contexts[mode]():
            acts = ActivationCountAnalysis(model, x)
            acts.total()
    assert acts.trace is not flops.trace and len(recordings) == 2
    assert FlopCountAnalysis(model, x).trace is flops.trace and len(recordings) == 2  # back in the first mode: shared


def test_other_run_options_do_not_share() -> None:
    model, x = nn.Sequential(nn.Linear(4, 8)), torch.randn(3, 4, requires_grad=True)
    flops = FlopCountAnalysis(model, x)
    assert FlopCountAnalysis(model, x, backward=True).trace is not flops.trace
    assert FlopCountAnalysis(model, x, execution="real").trace is not flops.trace
    assert FlopCountAnalysis(model, x, convention="macs").trace is flops.trace  # counting settings are irrelevant
    assert ActivationCountAnalysis(model, x).set_op_handle("aten::addmm", None).trace is flops.trace


def test_shared_recordings_hold_no_model_or_input() -> None:
    """The store keeps weak references only: a model and inputs analysed once are freed with the analyses, and
    their entry goes with them."""
    import gc
    import weakref

    from modelmeter.cache.shared import SHARED

    model, x = nn.Sequential(nn.Linear(4, 8)), torch.randn(3, 4)
    FlopCountAnalysis(model, x).total()
    refs = [weakref.ref(model), weakref.ref(x), weakref.ref(model[0].weight)]
    before = len(SHARED)
    del model, x
    gc.collect()
    assert all(ref() is None for ref in refs)
    FlopCountAnalysis(nn.Linear(2, 2), torch.randn(1, 2)).total()  # a lookup drops the dead entries
    assert len(SHARED) <= before


def test_an_unkeyable_attribute_is_recorded_anew(recordings: list[RunSpec]) -> None:
    """An attribute Python cannot look into (no ``__dict__``) could change unseen: no sharing."""
    model, x = nn.Sequential(nn.Linear(4, 8)), torch.randn(3, 4)
    model.opaque = bytearray(b"state")  # no __dict__, mutable
    FlopCountAnalysis(model, x).total()
    ActivationCountAnalysis(model, x).total()
    assert len(recordings) == 2


def test_memory_analysis_exposes_only_what_it_honours() -> None:
    """Memory has no handles and is attributed to the module that owns an operator: the counting analysis's
    settings are not there to be silently ignored."""
    model, x = nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.randn(2, 4)
    mem = MemoryAnalysis(model, x)
    for name in ("set_op_handle", "clear_op_handles", "ancestor_mode", "unsupported_ops_warnings"):
        with pytest.raises(AttributeError):
            getattr(mem, name)
    assert not isinstance(mem, ModelAnalysis)  # not a counting analysis
    assert mem.total() == mem.by_module()[""] == 2 * 8 * 4 * 2  # the Linear's and the ReLU's outputs, float32
    assert mem.by_operator() == {"linear": 64, "relu": 64} and mem.by_dtype() == {"float32": 128}
    assert mem.uncalled_modules() == set() and mem.canonical_module_name("0") == "0"


class SharedAndUnused(nn.Module):
    """A child reached by two paths (``a``, ``b`` and ``d.1``) and one never called (``e``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = self.a
        self.d = nn.Sequential(nn.ReLU(), self.a)
        self.e = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.b(self.a(x)))


def test_flop_count_str_renders_the_trace_module_table(caplog: pytest.LogCaptureFixture) -> None:
    """fvcore's module printout is rebuilt from the trace's plain module table (labels, extra_repr, child slots,
    a shared child under each path): the same characters as fvcore prints from the live model, and the same
    again from a trace that went through the serialiser."""
    import fvcore.nn as fvcore_nn

    model, x = SharedAndUnused(), torch.randn(2, 4)
    flops, acts = FlopCountAnalysis(model, x), ActivationCountAnalysis(model, x)
    text = flop_count_str(flops, acts)
    with caplog.at_level("ERROR"), warnings.catch_warnings():  # fvcore logs and warns about the jit trace
        warnings.simplefilter("ignore")
        expected = fvcore_nn.flop_count_str(fvcore_nn.FlopCountAnalysis(model, x),
                                            fvcore_nn.ActivationCountAnalysis(model, x))
    assert text == expected and "(b): Linear(in_features=4, out_features=4, bias=True)" in text
    trace = loads(dumps(flops.trace))
    columns = {"#params": parameter_count(model), "#flops": flops.by_module(), "#acts": acts.by_module()}
    assert flop_count_str_text(trace.modules, columns, {"#flops": {"e"}, "#acts": {"e"}}) == text


def _imports(path: Path) -> set[str]:
    """Every module a file imports, function-level and TYPE_CHECKING imports included, as absolute names."""
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = f"{base}.{node.module}" if base and node.module else base or node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("folder, forbidden", [
    ("metrics", ("torch.nn", "modelmeter.engine.naming", "modelmeter.analysis", "modelmeter.memory",
                 "modelmeter.session", "modelmeter.views", "modelmeter.reports")),
    ("reports", ("modelmeter.analysis", "modelmeter.memory", "modelmeter.session", "modelmeter.views",
                 "modelmeter.fvcore_api", "modelmeter.metrics", "modelmeter.engine.naming", "torch.nn")),
])
def test_layers_below_the_session_do_not_import_it(folder: str, forbidden: tuple[str, ...]) -> None:
    for path in sorted((SRC / folder).glob("*.py")):
        bad = sorted(m for m in _imports(path) if m.startswith(forbidden))
        assert not bad, f"{path.name} imports {bad}"
