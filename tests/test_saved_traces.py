"""Saved traces (.mmtrace): written whole, read strictly, rendered and diffed without the model."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from modelmeter import OptimizerSpec, Result, analyze, load_trace, save_trace
from modelmeter.engine.serialize import FORMAT_VERSION
from modelmeter.engine.trace import TensorMeta
from modelmeter.guard import load_costs
from modelmeter.guard.values import GuardFileError
from modelmeter.reports.saved import SavedTrace, SavedTraceError, read_saved_trace, write_saved_trace


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).mean((2, 3)))


def saved(tmp_path: Path) -> tuple[Path, SavedTrace]:
    analysis = analyze(Net(), torch.randn(2, 3, 16, 16))
    path = tmp_path / "run.mmtrace"
    original = SavedTrace(analysis.trace, analysis.result(), {"convention": "fvcore"}, {"modelmeter": "test"})
    write_saved_trace(original, path)
    return path, original


def test_a_saved_trace_reads_back_equal(tmp_path: Path) -> None:
    path, original = saved(tmp_path)
    back = read_saved_trace(path)
    assert back.trace == original.trace
    assert back.result == original.result
    assert back.settings["convention"] == "fvcore" and back.settings["attention_kernel"] == "fused"
    assert back.saved_by == {"modelmeter": "test"}
    # conv: 8*3*9 multiply-adds at each of 2*14*14 positions; fc: 2*8*4
    assert back.result.total("flops") == 8 * 3 * 9 * 2 * 14 * 14 + 2 * 8 * 4


def test_unknown_settings_are_refused(tmp_path: Path) -> None:
    _, original = saved(tmp_path)
    original.settings["colour"] = "red"
    with pytest.raises(ValueError, match="unknown saved-trace settings: colour"):
        write_saved_trace(original, tmp_path / "other.mmtrace")


def _rewrite(path: Path, change: object) -> None:
    data = json.loads(gzip.decompress(path.read_bytes()))
    change(data)  # type: ignore[operator]
    path.write_bytes(gzip.compress(json.dumps(data).encode()))


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(version=99), "format version 99"),
    (lambda d: d.update(format="other"), "its format is not"),
    (lambda d: d.update(result=[]), "it holds no result"),
    (lambda d: d["trace"]["fields"].update(model=3), "malformed trace fields"),
    (lambda d: d["trace"]["fields"]["aliases"].update(ghost="nowhere"), "aliases in the trace lead"),
    (lambda d: d.update(settings={"convention": "fvcore", "evil": 1}), "unknown saved-trace settings"),
    (lambda d: d["trace"].update(version=6),
     rf"trace format version 6; this modelmeter reads {FORMAT_VERSION} \(recorded by an older"),
    (lambda d: d["trace"]["events"].__setitem__(0, ["q", "!!"]), "events.op: Only base64 data"),
    (lambda d: d["trace"]["storages"].pop(), "storages: expected 9 columns, got 8"),
])
def test_a_damaged_file_is_one_clear_error_naming_it(tmp_path: Path, change: object, message: str) -> None:
    path, _ = saved(tmp_path)
    _rewrite(path, change)
    with pytest.raises(SavedTraceError, match=message) as info:
        read_saved_trace(path)
    assert "run.mmtrace" in str(info.value)


def _first_row(data: dict) -> dict:  # type: ignore[type-arg]
    return data["result"]["modules"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(version=True), "format version True"),
    (lambda d: d.update(version=1.0), "format version 1.0"),
    (lambda d: d["settings"].update(memory="yes"), "the setting memory is a str"),
    (lambda d: d["settings"].update(name=123), "the setting name is a int"),
    (lambda d: d["settings"].update(convention="bogus"), "the setting convention is 'bogus', not one of"),
    (lambda d: d["settings"].update(attention_kernel=None), "the setting attention_kernel is a NoneType"),
    (lambda d: d["settings"].update(efficiency=-1), "the time on a device without a device"),
    (lambda d: _first_row(d)["metrics"].update(flops=float("nan")), "NaN is not a value a saved trace holds"),
    (lambda d: _first_row(d)["metrics"].update(flops=float("inf")), "Infinity is not a value"),
    (lambda d: _first_row(d)["metrics"].update(flops=-5), "module '' of the result: flops is -5, not a number"),
    (lambda d: _first_row(d)["metrics"].update(flops="1.2G"), "flops is '1.2G', not a number"),
    (lambda d: _first_row(d)["metrics"].update(flops=True), "flops is True, not a number"),
    (lambda d: _first_row(d)["metrics"].update(flops=10**400), "not a number from 0 to 1e\\+30"),
    (lambda d: _first_row(d).update(params=-1), "params is -1"),
    (lambda d: _first_row(d).update(called="no"), "called is a str, not a bool"),
    (lambda d: d["result"].pop("dtypes"), "its result lacks dtypes"),
    (lambda d: _first_row(d)["by_operator"].update(flops={"aten::mm": -1.0}), "by_operator 'flops': aten::mm"),
    (lambda d: _first_row(d).update(output_shapes={"2x4": 0}), "output_shapes holds a count"),
    (lambda d: d["result"].update(schema_version=True), "unsupported result schema_version True"),
    (lambda d: d["result"].update(extra=1), "the result has unknown fields: 'extra'"),
    (lambda d: d["result"].update(metrics=[1]), "the result's metrics are not names"),
    (lambda d: d["result"].update(modules={}), "the result: modules is a dict, not a list"),
    (lambda d: d["result"].update(modules=[]), "the result's first module row must be the model's"),
])
def test_a_file_edited_by_hand_is_refused_not_rendered(tmp_path: Path, change: object, message: str) -> None:
    """Settings and the saved result are what a report prints as they are: a wrong type, a NaN, a negative or
    absurd cost is a SavedTraceError naming the file, never a traceback in a recount or a number printed."""
    path, _ = saved(tmp_path)
    _rewrite(path, change)
    with pytest.raises(SavedTraceError, match=message) as info:
        read_saved_trace(path)
    assert "run.mmtrace" in str(info.value)


def _metas(field: str, value: object) -> Callable[[dict], None]:  # type: ignore[type-arg]
    """A change of the saved trace setting ``field`` of the first dimension of every TensorMeta's shape (or the
    whole field) to ``value``."""
    index = [f.name for f in dataclasses.fields(TensorMeta)].index(field)

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if list(node) == ["$m"]:
                meta = node["$m"]
                if field == "shape" and meta[index]["$t"]:
                    meta[index]["$t"][0] = value
                elif field != "shape":
                    meta[index] = value
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    return lambda data: walk(data["trace"])


@pytest.mark.parametrize(("change", "message"), [
    (_metas("shape", -5), "a TensorMeta shape must be a tuple of sizes"),
    (_metas("shape", 1 << 63), "a TensorMeta shape must be a tuple of sizes"),
    (_metas("dtype", 7), "a TensorMeta dtype and device must be names"),
    (_metas("device", None), "a TensorMeta dtype and device must be names"),
    (_metas("attended", -1), "a TensorMeta attended must be a count of elements or null"),
])
def test_a_tensor_of_an_impossible_shape_or_type_is_refused(tmp_path: Path, change: object, message: str) -> None:
    """A negative or over-int64 size was recounted into a number, a dtype that is not a name was a traceback in a
    recount: each is a damaged file."""
    path, _ = saved(tmp_path)
    _rewrite(path, change)
    with pytest.raises(SavedTraceError, match=message):
        read_saved_trace(path)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000,
                                  '{"format":"modelmeter-saved-trace","version":1,"x":' + "{\"a\":" * 50_000 + "1"
                                  + "}" * 50_001])
def test_deeply_nested_json_is_a_clear_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "deep.mmtrace"
    path.write_bytes(gzip.compress(text.encode()))
    with pytest.raises(SavedTraceError, match="nested too deeply"):
        read_saved_trace(path)


def test_truncated_and_foreign_files(tmp_path: Path) -> None:
    path, _ = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(SavedTraceError, match="truncated"):
        read_saved_trace(path)
    path.write_text("{}")
    with pytest.raises(SavedTraceError, match="not gzip data"):
        read_saved_trace(path)
    with pytest.raises(SavedTraceError, match="cannot read"):
        read_saved_trace(tmp_path / "missing.mmtrace")


def test_diff_reads_saved_traces_beside_json_results(tmp_path: Path) -> None:
    path, original = saved(tmp_path)
    (tmp_path / "r.json").write_text(original.result.to_json())
    assert load_costs(path) == load_costs(tmp_path / "r.json")
    assert load_costs(path)["conv"]["flops"] == 8 * 3 * 9 * 2 * 14 * 14
    _rewrite(path, lambda d: d.update(version=2))
    with pytest.raises(GuardFileError, match="format version 2"):
        load_costs(path)


# --- the feature: save in one process, report in another that never builds the model ------------------------------
SRC = str(Path(__file__).resolve().parents[1] / "src")
MODEL_FILE = '''
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 6 * 6, 10))

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))))


def build():
    return Tiny(), torch.randn(2, 3, 8, 8)
'''


def command(*argv: str, cwd: Path, check_no_torch: bool = False) -> subprocess.CompletedProcess[str]:
    """``modelmeter ARGV`` in a fresh process; with ``check_no_torch``, fails if torch or the model's file was
    imported."""
    code = f"import sys; from modelmeter_cli import main; status = main({list(argv)!r}); "
    if check_no_torch:
        code += "assert 'torch' not in sys.modules and 'm' not in sys.modules, 'torch or the model was imported'; "
    code += "sys.exit(status)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": SRC})


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    (tmp_path / "m.py").write_text(MODEL_FILE)
    return tmp_path


def body(table: str) -> str:
    """A table report without the line above it (which says how long the run took, or which file it came from;
    wrapped to the width, it ends at the first line that ends with its closing parenthesis)."""
    return table.split(")\n", 1)[1]


@pytest.mark.parametrize("options", [[], ["--backward", "--memory", "--optimizer", "adamw"]])
def test_a_saved_trace_renders_identical_reports_in_a_process_without_the_model(model_file: Path,
                                                                                  options: list[str]) -> None:
    ran = command("m.py:build", *options, "--no-cache", "--save-trace", "run.mmtrace", cwd=model_file)
    assert ran.returncode == 0, ran.stderr
    assert "wrote run.mmtrace" in ran.stderr
    for fmt in ("json", "markdown", "csv", "tree", "table"):
        analysed = command("m.py:build", *options, "--no-cache", "--format", fmt, "--depth", "3", cwd=model_file)
        reported = command("report", "run.mmtrace", "--format", fmt, "--depth", "3", cwd=model_file,
                           check_no_torch=True)
        assert reported.returncode == 0, reported.stderr
        if fmt in ("table", "tree"):
            assert body(reported.stdout) == body(analysed.stdout)
            assert "saved trace run.mmtrace" in reported.stdout.split("\n", 1)[0]
        else:
            assert reported.stdout == analysed.stdout
    # conv: 8*3*9 multiply-adds at 2*6*6 positions; the batch norm (eval mode, as the command runs models) 2 per
    # element of its (2, 8, 6, 6) input; the linear layer 2*288*10 (fvcore's convention)
    flops = json.loads(command("report", "run.mmtrace", "--format", "json", cwd=model_file).stdout)["modules"][0]
    assert flops["metrics"]["forward_flops" if options else "flops"] == 8 * 3 * 9 * 2 * 36 + 2 * 576 + 2 * 288 * 10


def test_report_recounts_under_another_convention(model_file: Path) -> None:
    assert command("m.py:build", "--no-cache", "--save-trace", "run.mmtrace", cwd=model_file).returncode == 0
    recounted = command("report", "run.mmtrace", "--convention", "flops", "--format", "json", cwd=model_file)
    analysed = command("m.py:build", "--no-cache", "--convention", "flops", "--format", "json", cwd=model_file)
    assert recounted.returncode == 0, recounted.stderr
    assert recounted.stdout == analysed.stdout
    assert json.loads(recounted.stdout)["convention"] == "flops"


def test_diff_and_compare_take_saved_traces(model_file: Path) -> None:
    assert command("m.py:build", "--no-cache", "--save-trace", "a.mmtrace", cwd=model_file).returncode == 0
    assert command("m.py:build", "--no-cache", "--backward", "--save-trace", "b.mmtrace", cwd=model_file) \
        .returncode == 0
    diffed = command("diff", "a.mmtrace", "b.mmtrace", "--format", "json", cwd=model_file)
    assert diffed.returncode == 0, diffed.stderr
    changes = {(d["module"], d["metric"]): d for d in json.loads(diffed.stdout)}
    # the backward pass of the first convolution: its weight gradient (the input needs none) costs the forward's
    # multiply-adds again
    assert changes[("conv", "flops")]["before"] == 8 * 3 * 9 * 2 * 36
    assert changes[("conv", "flops")]["after"] == 8 * 3 * 9 * 2 * 36 * 2
    html = command("report", "b.mmtrace", "--html", "b.html", "--compare", "a.mmtrace", cwd=model_file)
    assert html.returncode == 0, html.stderr
    assert (model_file / "b.html").read_text().count("<html") == 1


def test_report_mistakes_are_one_line(model_file: Path) -> None:
    (model_file / "bad.mmtrace").write_bytes(b"\x1f\x8bnot really")
    for argv, message in ((["report", "missing.mmtrace"], "cannot read the saved trace"),
                          (["report", "bad.mmtrace"], "is not a readable saved trace"),
                          (["report", "bad.mmtrace", "--compare", "x.json"], "--compare shows the difference"),
                          (["report"], "the following arguments are required: FILE"),
                          (["m.py:build", "--sweep", "batch=1,2", "--save-trace", "s.mmtrace"], "--save-trace")):
        done = command(*argv, cwd=model_file)
        assert done.returncode == 2, (argv, done.stderr)
        assert message in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_report_has_its_own_help(model_file: Path) -> None:
    done = command("report", "--help", cwd=model_file, check_no_torch=True)
    assert done.returncode == 0
    for option in ("FILE", "--format", "--depth", "--html", "--compare", "--convention", "--attention-kernel"):
        assert option in done.stdout
    assert "--budget" not in done.stdout  # the analysis's own options stay out of its help


def test_load_trace_in_another_process_gives_the_analysis_result(tmp_path: Path) -> None:
    """The library: save_trace in this process, load_trace in one that never built the model."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 5))
    analysis = analyze(model, torch.randn(2, 3, 16, 16), backward=True, memory=True, optimizer="adam")
    save_trace(analysis, tmp_path / "run.mmtrace", name="tiny")
    assert load_trace(tmp_path / "run.mmtrace") == analysis.result(name="tiny")
    code = ("import sys, json; from modelmeter import load_trace; "
            f"print(load_trace({str(tmp_path / 'run.mmtrace')!r}).to_json(indent=None)); "
            "print(json.dumps(load_trace(sys.argv[1], convention='macs', memory=False).to_dict()))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run.mmtrace")], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr
    saved_json, macs_json = done.stdout.split("\n", 1)
    assert Result.from_json(saved_json) == analysis.result(name="tiny")
    macs = analyze(model, torch.randn(2, 3, 16, 16), backward=True, convention="macs").result()
    assert json.loads(macs_json) == macs.to_dict() | {"model": "tiny"}


def test_an_optimizer_of_the_users_and_a_torch_dtype_are_saved_as_data(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    lion = OptimizerSpec("lion", states=1, temporaries=1)  # one momentum buffer, one temporary in its step
    analysis = analyze(model, torch.randn(8, 16), backward=True, memory=True, optimizer=lion,
                       state_dtype=torch.bfloat16)
    save_trace(analysis, tmp_path / "lion.mmtrace")
    saved = read_saved_trace(tmp_path / "lion.mmtrace")
    assert saved.settings["optimizer"]["name"] == "lion" and saved.settings["state_dtype"] == "bfloat16"
    assert load_trace(tmp_path / "lion.mmtrace") == analysis.result() == saved.result
    # the optimizer's state: one bfloat16 buffer per parameter element (16*16 + 16 + 16*4 + 4 = 340)
    assert saved.result.memory["by_kind"]["optimizer_state"] == 340 * 2
