"""The ``modelmeter`` command: model specs, inputs, formats, sweeps and exit codes.

Run in-process through ``main([...])`` (one subprocess test for ``python -m modelmeter``); every model
is small or built on the meta device, so the whole file takes seconds. Nothing is downloaded.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from modelmeter import ActivationCountAnalysis, FlopCountAnalysis
from modelmeter.cli import fit, main
from modelmeter.cli.fit import largest_fitting
from modelmeter.cli.job import Job, job_argv
from modelmeter.cli.models import parse_overrides
from modelmeter.reports import FORMATS
from modelmeter.zoo import get_model


def run(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0) -> tuple[str, str]:
    """``modelmeter ARGV`` in-process; its stdout and stderr, after checking the exit status."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert status == code, f"exit {status}, stderr: {err}"
    return out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    return json.loads(run(capsys, *argv, "--format", "json")[0])


def library_totals(model: torch.nn.Module, inputs: Any) -> tuple[int, int]:
    flops = FlopCountAnalysis(model.eval(), inputs)
    return flops.total(), ActivationCountAnalysis(model, inputs, trace=flops.trace).total()


def json_totals(data: dict[str, Any]) -> tuple[int, int]:
    root = data["modules"][0]
    assert root["name"] == ""
    return root["metrics"]["flops"], root["metrics"]["activations"]


# --- the default run and the formats ---------------------------------------------------------------
def test_default_run_is_resnet50_with_fvcore_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run(capsys)
    assert out.startswith("resnet50 on input 1x3x224x224 float32 (fake run")
    model_row = next(line for line in out.splitlines() if line.startswith("model "))
    assert model_row.split()[1:5] == ["ResNet", "25.557M", "4.112G", "100.0%"]
    assert "11.115M" in model_row
    assert "  layer1.0 " in out and "layer1.0.conv1" not in out  # --depth 2 by default
    assert "Unsupported" not in out  # every operator of ResNet-50 is counted or free on purpose


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format(capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    out, _ = run(capsys, "resnet18", "--resolution", "64", "--depth", "1", "--format", fmt)
    expected = library_totals(get_model("resnet18", device="cpu"), torch.randn(1, 3, 64, 64))
    if fmt == "json":
        data = json.loads(out)
        assert json_totals(data) == expected
        assert data["model"] == "resnet18" and data["inputs"][0]["shape"] == [1, 3, 64, 64]
    elif fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(out)))
        assert (int(rows[0]["flops"]), int(rows[0]["activations"])) == expected
        assert "layer1.0.conv1" in {r["name"] for r in rows}  # csv holds every module
    elif fmt == "markdown":
        assert out.startswith("| module") and "| model " in out and "Unsupported" not in out
    elif fmt == "tree":
        assert out.startswith("resnet18 on input 1x3x64x64") and "\nResNet(\n" in out and "(layer1): " in out
    else:
        assert out.startswith("resnet18 on input 1x3x64x64 float32 (fake run")
        assert "  layer1 " in out and "layer1.0" not in out


def test_output_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    out, err = run(capsys, "gpt2_tiny", "--format", "json", "--output", str(target))
    assert out == "" and f"wrote {target}" in err
    assert json_totals(json.loads(target.read_text()))[0] > 0
    _, err = run(capsys, "gpt2_tiny", "--output", str(tmp_path / "missing" / "x.txt"), code=2)
    assert f"--output {tmp_path}/missing/x.txt: the folder {tmp_path}/missing does not exist" in err


def test_list_shows_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run(capsys, "list")
    assert "resnet50      1x3x224x224 float32" in out
    assert "gpt2_tiny" in out and "1x64 int64" in out
    assert "torchvision:NAME" in out
    names = [row["name"] for row in json.loads(run(capsys, "list", "--format", "json")[0])]
    assert "resnet50" in names and "gpt2" in names


def test_backward_and_convention(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run(capsys, "resnet18", "--resolution", "64", "--backward", "--convention", "macs", "--depth", "1",
                 "--wide")  # every column, under its full header
    assert out.startswith("resnet18 on input 1x3x64x64 float32 (fake run, forward + backward, macs convention")
    assert "#forward_flops" in out and "#backward_flops" in out and "Convention: macs (" in out
    data = run_json(capsys, "resnet18", "--resolution", "64", "--backward", "--convention", "macs")
    model = get_model("resnet18", device="cpu")
    flops = FlopCountAnalysis(model, torch.randn(1, 3, 64, 64), convention="macs", backward=True)
    root = data["modules"][0]["metrics"]
    assert data["convention"] == "macs"
    assert (root["flops"], root["forward_flops"], root["backward_flops"]) == (
        flops.total(), flops.by_phase()["forward"], flops.by_phase()["backward"])
    assert data["dtypes"]["flops"] == {"float32": flops.total()}


def test_attention_kernel_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("gpt2_tiny", "--seq-len", "16", "--backward", "--convention", "macs")
    fused, math_kernel = (run_json(capsys, *argv, *extra)["modules"][0]["metrics"]
                          for extra in ((), ("--attention-kernel", "math")))
    model, ids = get_model("gpt2_tiny", device="cpu"), torch.randint(0, 100, (1, 16))
    for metrics, kernel in ((fused, "fused"), (math_kernel, "math")):
        flops = FlopCountAnalysis(model, ids, convention="macs", backward=True, attention_kernel=kernel)
        assert (metrics["forward_flops"], metrics["backward_flops"]) == (
            flops.by_phase()["forward"], flops.by_phase()["backward"])
    # causal attention: the math kernel computes every pair, and its backward recomputes nothing
    assert math_kernel["forward_flops"] > fused["forward_flops"]
    job = Job(spec="gpt2_tiny", attention_kernel="math")
    assert job_argv(job)[-2:] == ["--attention-kernel", "math"]  # a baseline entry runs it the same way
    run(capsys, "gpt2_tiny", "--attention-kernel", "flash", code=2)


# --- inputs -------------------------------------------------------------------------------------------
def test_inputs_batch_seq_len_and_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    one = run_json(capsys, "gpt2_tiny", "--seq-len", "16")
    two = run_json(capsys, "gpt2_tiny", "--seq-len", "16", "--batch", "2")
    assert one["inputs"] == [{"shape": [1, 16], "dtype": "int64"}]
    assert two["inputs"][0]["shape"] == [2, 16]
    assert json_totals(two)[0] == 2 * json_totals(one)[0]
    explicit = run_json(capsys, "gpt2_tiny", "--input", "2x16")
    assert explicit["inputs"] == two["inputs"] and json_totals(explicit) == json_totals(two)
    half = run_json(capsys, "resnet18", "--resolution", "32", "--dtype", "float16")
    assert half["inputs"] == [{"shape": [1, 3, 32, 32], "dtype": "float16"}]


def test_real_kernels_give_the_fake_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    fake = run_json(capsys, "gpt2_tiny", "--seq-len", "32")
    real = run_json(capsys, "gpt2_tiny", "--seq-len", "32", "--real")
    assert (fake["execution"], real["execution"]) == ("fake", "real")
    assert json_totals(real) == json_totals(fake)
    assert [m["metrics"] for m in real["modules"]] == [m["metrics"] for m in fake["modules"]]


# --- third-party specs ---------------------------------------------------------------------------------
def test_torchvision_spec(capsys: pytest.CaptureFixture[str]) -> None:
    torchvision = pytest.importorskip("torchvision")
    data = run_json(capsys, "torchvision:resnet18", "--resolution", "64")
    assert data["model"] == "torchvision:resnet18"
    assert json_totals(data) == library_totals(torchvision.models.resnet18(), torch.randn(1, 3, 64, 64))
    vit = run_json(capsys, "torchvision:vit_b_32", "--resolution", "96", "num_classes=10")  # ViT built for 96px
    assert vit["inputs"][0]["shape"] == [1, 3, 96, 96] and vit["modules"][0]["params"] < 88_000_000


def test_timm_spec_uses_the_models_default_input_size(capsys: pytest.CaptureFixture[str]) -> None:
    timm = pytest.importorskip("timm")
    data = run_json(capsys, "timm:test_resnet")
    assert data["inputs"][0]["shape"] == [1, 3, 160, 160]  # pretrained_cfg input_size, not 224
    assert json_totals(data) == library_totals(timm.create_model("test_resnet"), torch.randn(1, 3, 160, 160))


def test_transformers_config_with_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1000)
    argv = ["transformers:LlamaConfig,hidden_size=64,intermediate_size=128",  # after commas ...
            *(f"{k}={v}" for k, v in list(settings.items())[2:]), "--seq-len", "16"]  # ... and as arguments
    data = run_json(capsys, *argv)
    assert data["model"].endswith("(LlamaForCausalLM)")
    assert data["inputs"] == [{"shape": [1, 16], "dtype": "int64"}]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))
    assert json_totals(data) == library_totals(model, torch.randint(0, 1000, (1, 16)))
    assert data["modules"][0]["params"] == sum(p.numel() for p in model.parameters())

    _, err = run(capsys, "transformers:LlamaConfig", "hiden_size=64", code=2)
    assert "unknown LlamaConfig setting 'hiden_size'; did you mean hidden_size" in err


def test_transformers_vision_config_takes_images(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    data = run_json(capsys, "transformers:vit", "num_hidden_layers=1", "hidden_size=32", "intermediate_size=64",
                    "num_attention_heads=2", "--resolution", "64")
    assert data["model"] == "transformers:ViTConfig num_hidden_layers=1 hidden_size=32 intermediate_size=64 " \
                            "num_attention_heads=2 image_size=64 (ViTModel)"
    assert data["inputs"] == [{"shape": [1, 3, 64, 64], "dtype": "float32"}]


# --- factories ----------------------------------------------------------------------------------------
FACTORIES = textwrap.dedent("""
    import torch
    from torch import nn

    def mlp(width=8):
        return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))

    def with_inputs():
        return mlp(), torch.randn(3, 4)

    def broken():
        raise RuntimeError("cannot build\\nthis model")
""")


def test_file_factory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "my_models.py"
    path.write_text(FACTORIES)
    data = run_json(capsys, f"{path}:with_inputs")
    assert data["inputs"][0]["shape"] == [3, 4] and json_totals(data)[0] == 3 * (4 * 8 + 8 * 2)
    data = run_json(capsys, f"{path}:mlp", "width=16", "--input", "5x4")  # key=value goes to the factory
    assert json_totals(data)[0] == 5 * (4 * 16 + 16 * 2)
    _, err = run(capsys, f"{path}:mlp", code=2)
    assert "has no default input: give its shape with --input" in err
    _, err = run(capsys, f"{path}:mpl", "--input", "1x4", code=2)
    assert "has no factory 'mpl'; did you mean mlp?" in err
    _, err = run(capsys, f"{path}:broken", code=1)
    assert err == f"modelmeter: could not build {path}:broken: RuntimeError: cannot build this model\n"


def test_module_factory(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "mm_cli_test_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = run_json(capsys, "mm_cli_test_pkg.nets:with_inputs")
    assert data["model"] == "mm_cli_test_pkg.nets:with_inputs" and json_totals(data)[0] == 3 * (4 * 8 + 8 * 2)
    _, err = run(capsys, "mm_cli_test_pkg.nope:mlp", code=2)
    assert "no module named 'mm_cli_test_pkg.nope'" in err


# --- errors and exit codes ----------------------------------------------------------------------------
@pytest.mark.parametrize(("spec", "extra"), [("torchvision:resnet18", "vision"), ("timm:resnet18", "timm"),
                                             ("transformers:LlamaConfig", "transformers")])
def test_missing_optional_package_hint(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                       spec: str, extra: str) -> None:
    monkeypatch.setitem(sys.modules, spec.split(":")[0], None)  # importing it now raises ImportError
    _, err = run(capsys, spec, code=1)
    assert err.endswith(f"pip install modelmeter[{extra}]\n") and len(err.splitlines()) == 1


def test_unknown_names_suggest_close_matches(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = run(capsys, "resnet5", code=2)
    assert err.startswith("modelmeter: unknown model 'resnet5'; did you mean resnet50, ")
    _, err = run(capsys, "no_such_thing_at_all", code=2)
    assert "`modelmeter list` shows the built-in models" in err
    _, err = run(capsys, "torchvision:resnt18", code=2)
    assert "unknown torchvision model 'resnt18'; did you mean resnet18" in err
    _, err = run(capsys, "transformers:LlamaConfg", code=2)
    assert "did you mean LlamaConfig" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["resnet18", "--input", "1xAx2"], "argument --input: an input shape looks like 1x3x224x224"),
    (["resnet18", "--input", "1x0x2"], "argument --input: input sizes must be positive"),
    (["resnet18", "--input", "1x3x8x8", "--batch", "2"], "--input fixes the input shapes"),
    (["resnet18", "--input", "1x3x8x8", "--input", "1x3"], "inputs do not match ResNet.forward"),
    (["gpt2_tiny", "--resolution", "64"], "--resolution applies to image models; gpt2_tiny takes token ids"),
    (["resnet18", "--seq-len", "64"], "--seq-len applies to token models"),
    (["resnet18", "--format", "html"], "invalid choice: 'html'"),
    (["resnet18", "--convention", "pytorch"], "invalid choice: 'pytorch'"),
    (["resnet18", "--sweep", "width=1,2"], "--sweep must look like resolution=224,288"),
    (["resnet18", "--depth", "-1"], "expected a depth of 0 or more"),
    (["resnet18", "nokeyvalue"], "expected key=value, got 'nokeyvalue'"),
])
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    _, err = run(capsys, *argv, code=2)
    assert message in err


def test_a_sequence_past_the_block_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """An input the model's code refuses, where its default input runs: a usage error (a model failing on its
    default input too exits 1: tests/test_leftovers.py)."""
    _, err = run(capsys, "gpt2_tiny", "--seq-len", "100", code=2)
    assert err.startswith("modelmeter: the model failed in ") and "exceeds block_size 64" in err
    assert "its default input (1x64 int64)" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_overrides_are_python_literals() -> None:
    assert parse_overrides(["a=1,b=2.5", "c=true", "d=None", "e=[2, 2]", "f=gelu", "g=1e-5"]) == \
        {"a": 1, "b": 2.5, "c": True, "d": None, "e": [2, 2], "f": "gelu", "g": 1e-5}


# --- sweeps and the entry point ------------------------------------------------------------------------
def test_sweep_in_parallel_workers(capsys: pytest.CaptureFixture[str]) -> None:
    out, err = run(capsys, "gpt2_tiny", "--seq-len", "16", "--sweep", "batch=1,2", "--jobs", "2")
    lines = out.splitlines()
    assert lines[0] == "gpt2_tiny: sweep of batch (fake run)"
    assert lines[1].split() == ["batch", "#params", "flops", "activations", "flops", "ratio"]
    assert lines[2].split()[0] == "1" and lines[2].endswith("1.00x")
    assert lines[3].split()[0] == "2" and lines[3].endswith("2.00x")
    assert "flops grow 2.00x from batch 1 to 2, about batch^1.00" in out
    assert "sweep batch [" in err and "2/2" in err


def test_sweep_rejects_an_axis_the_model_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = run(capsys, "gpt2_tiny", "--sweep", "resolution=32,64", code=2)
    assert "--resolution applies to image models" in err


def test_python_dash_m_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "modelmeter", "gpt2_tiny", "--depth", "0"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.startswith("gpt2_tiny on input 1x64 int64 (fake run")
    assert "model " in done.stdout


def test_html_report_and_compare(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    before, page = tmp_path / "before.json", tmp_path / "report.html"
    run(capsys, "resnet18", "--resolution", "32", "--format", "json", "--output", str(before))
    _, err = run(capsys, "resnet18", "--resolution", "64", "--html", str(page), "--compare", str(before))
    assert f"wrote {page}" in err
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "resnet18" in text and "1x3x32x32" in text  # the compared run
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "https://" not in text
    run(capsys, "resnet18", "--compare", str(before), code=2)  # --compare belongs to --html
    (tmp_path / "bad.json").write_text("{}")
    _, err = run(capsys, "resnet18", "--html", str(page), "--compare", str(tmp_path / "bad.json"), code=2)
    assert "not a saved analysis" in err


# --- memory -------------------------------------------------------------------------------------------
def library_memory(spec: str, batch: int | None = None, **options: Any) -> Any:
    """The library's MemoryAnalysis of a built-in model on its default inputs (the command's numbers' oracle)."""
    from modelmeter import MemoryAnalysis
    from modelmeter.cli.models import load_model

    loaded = load_model(spec, (), device="meta")
    return MemoryAnalysis(loaded.model, loaded.inputs(batch=batch, seq_len=16), **options)


def test_memory_and_optimizer_options(capsys: pytest.CaptureFixture[str]) -> None:
    from modelmeter.reports.render import format_bytes

    out, _ = run(capsys, "gpt2_tiny", "--seq-len", "16", "--memory", "--depth", "0", "--wide")
    inference = library_memory("gpt2_tiny").peak()
    header = out.splitlines()[0]
    assert header.startswith("gpt2_tiny on input 1x16 int64 (fake run, forward, fvcore convention, ")
    assert header.endswith(f" s, peak memory {format_bytes(inference)})")
    assert "#activation_bytes" in out and "#peak_memory" in out and "#saved_bytes" not in out
    assert "Peak memory (inference): " in out
    data = run_json(capsys, "gpt2_tiny", "--seq-len", "16", "--optimizer", "adamw", "--state-dtype", "bfloat16",
                    "--foreach")
    step = library_memory("gpt2_tiny", training=True, optimizer="adamw", state_dtype="bfloat16", foreach=True)
    assert data["memory"]["optimizer"] == {"name": "adamw", "state_dtype": "bfloat16", "foreach": True}
    assert data["memory"]["training"] and data["memory"]["peak"] == step.peak()
    assert data["memory"]["saved_bytes"] == step.saved_for_backward() > 0
    assert "saved_bytes" in data["metrics"] and "backward_flops" in data["metrics"]  # --optimizer: a training step
    plain = run_json(capsys, "gpt2_tiny", "--seq-len", "16", "--memory", "--backward")
    assert plain["memory"]["optimizer"] is None and plain["memory"]["peak"] < step.peak()
    out, _ = run(capsys, "gpt2_tiny", "--seq-len", "16", "--optimizer", "sgd", "--depth", "0")
    assert "forward + backward + sgd step" in out.splitlines()[0]


@pytest.mark.parametrize(("argv", "message"), [
    (["--state-dtype", "bfloat16"], "--state-dtype describes the optimizer's step: add --optimizer"),
    (["--foreach", "--state-dtype", "float16"], "--state-dtype and --foreach describe the optimizer's step"),
    (["--optimizer", "lion"], "invalid choice: 'lion'"),
    (["--budget", "saved_bytes=1M"], "add --backward (or --optimizer)"),
    (["--fit", "1GiB", "--batch", "2"], "--fit searches the batch size: drop --batch/--input/--sweep"),
    (["--fit", "1GiB", "--sweep", "batch=1,2"], "--fit searches the batch size"),
    (["--fit", "1GiB", "--budget", "flops=1G"], "--fit analyses many batches"),
    (["--fit", "lots"], "not a quantity: 'lots'"),
    (["--fit", "0.5"], "a memory size must be at least one byte"),
    (["--fit", "1GiB", "--format", "tree"], "--fit prints the batches it tried"),
])
def test_memory_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    _, err = run(capsys, "resnet18", "--resolution", "32", *argv, code=2)
    assert message in err


def test_a_memory_budget_turns_the_memory_analysis_on(capsys: pytest.CaptureFixture[str]) -> None:
    peak = library_memory("gpt2_tiny").peak()
    run(capsys, "gpt2_tiny", "--seq-len", "16", "--budget", f"peak_memory={peak}")
    _, err = run(capsys, "gpt2_tiny", "--seq-len", "16", "--budget", f"peak_memory={peak - 1024}", code=1)
    assert "peak_memory: " in err and f"({peak:,} bytes) is over the budget of " in err and "by 1KiB" in err
    saved = library_memory("gpt2_tiny", training=True).saved_for_backward()
    _, err = run(capsys, "gpt2_tiny", "--seq-len", "16", "--backward", "--budget", f"saved_bytes={saved - 1}", code=1)
    assert "saved_bytes: " in err and f"({saved:,} bytes)" in err and "by 1B" in err


def test_sweep_with_memory_has_a_peak_column(capsys: pytest.CaptureFixture[str]) -> None:
    from modelmeter.guard import parse_quantity

    argv = ["gpt2_tiny", "--seq-len", "16", "--sweep", "batch=1,3", "--memory", "--jobs", "1"]
    peaks = [library_memory("gpt2_tiny", batch=b).peak() for b in (1, 3)]
    out, _ = run(capsys, *argv)
    lines = out.splitlines()
    assert lines[1].split() == ["batch", "#params", "flops", "activations", "peak", "memory", "flops", "ratio"]
    shown = [parse_quantity(line.split()[4]) for line in lines[2:4]]  # in the unit of the larger, four figures
    assert all(abs(value - peak) <= peaks[1] / 1000 for value, peak in zip(shown, peaks, strict=True))
    assert f"peak memory grows {peaks[1] / peaks[0]:.2f}x from batch 1 to 3" in out
    rows = list(csv.DictReader(io.StringIO(run(capsys, *argv, "--format", "csv")[0])))
    assert [int(r["peak_memory"]) for r in rows] == peaks and rows[1]["flops_ratio"] == "3"
    data = run_json(capsys, *argv)
    assert [r["peak_memory"] for r in data["rows"]] == peaks
    assert "| peak memory |" in run(capsys, *argv, "--format", "markdown")[0]
    assert "peak" not in run(capsys, *argv[:-3], "--jobs", "1")[0]  # no --memory, no column


# --- the largest batch that fits ----------------------------------------------------------------------
@given(threshold=st.integers(0, 5000), cap=st.integers(1, 6000))
def test_largest_fitting_doubles_then_bisects(threshold: int, cap: int) -> None:
    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= threshold

    assert largest_fitting(fits, cap) == min(threshold, cap)
    assert len(tried) == len(set(tried)) and all(1 <= n <= cap for n in tried)
    assert len(tried) <= 2 * max(1, math.ceil(math.log2(cap))) + 1


def test_fit_finds_the_largest_batch(capsys: pytest.CaptureFixture[str]) -> None:
    from modelmeter.reports.render import format_bytes

    peaks = {b: library_memory("gpt2_tiny", batch=b, training=True, optimizer="adam").peak() for b in (1, 5, 6)}
    limit = (peaks[5] + peaks[6]) // 2  # batch 5 fits, 6 does not
    argv = ["gpt2_tiny", "--seq-len", "16", "--optimizer", "adam", "--fit", str(limit)]
    data = run_json(capsys, *argv)
    assert [t["batch"] for t in data["tried"]] == [1, 2, 4, 5, 6, 8]  # doubling 1, 2, 4, 8; then 6, 5
    assert [t["fits"] for t in data["tried"]] == [True] * 4 + [False] * 2
    assert (data["largest"], data["peak"], data["next"]) == (5, peaks[5], {"batch": 6, "peak": peaks[6]})
    assert data["limit"] == limit and data["step"] == "training step with adam" and not data["capped"]
    out, err = run(capsys, *argv)
    assert out.splitlines()[-1] == (f"largest batch that fits in {format_bytes(limit)}: 5 (peak "
                                    f"{format_bytes(peaks[5])}; batch 6 needs {format_bytes(peaks[6])})")
    assert out.splitlines()[1].split() == ["batch", "peak", "fits"] and "fit: batch 8: peak" in err
    _, err = run(capsys, "gpt2_tiny", "--seq-len", "16", "--optimizer", "adam", "--fit", str(peaks[1] - 1), code=1)
    assert err.splitlines()[0].startswith(f"fit: batch 1: peak {format_bytes(peaks[1])} (")
    assert err.splitlines()[1:] == [f"modelmeter: batch 1 does not fit in {format_bytes(peaks[1] - 1)}: its training "
                                    f"step with adam peaks at {format_bytes(peaks[1])} ({peaks[1]:,} bytes)"]


def test_fit_never_rounds_the_failing_batch_into_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    from modelmeter.guard import parse_quantity
    from modelmeter.reports.render import format_bytes

    peaks = {b: library_memory("gpt2_tiny", batch=b, training=True, optimizer="adam").peak() for b in (5, 6)}
    limit = peaks[6] - 1  # batch 6 misses by one byte: at three figures, it and the limit read the same
    assert format_bytes(limit) == format_bytes(peaks[6])
    out, _ = run(capsys, "gpt2_tiny", "--seq-len", "16", "--optimizer", "adam", "--fit", str(limit))
    last = out.splitlines()[-1]
    match = re.fullmatch(r"largest batch that fits in (\S+): 5 \(peak (\S+); batch 6 needs (\S+)\)", last)
    assert match, out
    size, fitting, failing = (parse_quantity(shown) for shown in match.groups())
    assert fitting < size < failing  # as the bytes are: peaks[5] <= limit < peaks[6]
    assert abs(failing - peaks[6]) < peaks[6] - limit + 1 and abs(size - limit) < 1  # each reads as itself


@pytest.mark.parametrize("amounts", [[24 << 30, (24 << 30) - 5, (24 << 30) + 1], [1000, 1023, 1024, 1025],
                                     [5 << 40, 5 << 40, (5 << 40) + 1], [3 << 20, 3 << 20]])
def test_distinct_bytes_tells_different_amounts_apart_in_order(amounts: list[int]) -> None:
    from modelmeter.guard import parse_quantity

    shown = fit.distinct_bytes(amounts)
    assert len(set(shown)) == len(set(amounts))
    values = [parse_quantity(text) for text in shown]
    pairs = list(zip(amounts, values, strict=True))
    assert all((a < b) == (va < vb) for a, va in pairs for b, vb in pairs)


def test_fit_stops_at_its_cap(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fit, "FIT_CAP", 4)
    data = run_json(capsys, "gpt2_tiny", "--seq-len", "16", "--fit", "1TiB")
    assert [t["batch"] for t in data["tried"]] == [1, 2, 4] and data["capped"] and data["next"] is None
    assert data["step"] == "inference"
    out, _ = run(capsys, "gpt2_tiny", "--seq-len", "16", "--fit", "1TiB")
    assert out.splitlines()[-1].endswith("the search stops at batch 4, larger ones were not tried")


# --- one unit down each column of the command's run tables ------------------------------------------------
def _suffixes(cells: list[str]) -> set[str]:
    """The units of a column's cells (``0.05GiB`` -> ``GiB``, ``11.69M`` -> ``M``); a zero has none."""
    return {re.sub(r"^[<\d.,-]+", "", cell) for cell in cells if cell != "0"}


def test_sweep_and_fit_tables_print_one_unit_per_column(capsys: pytest.CaptureFixture[str]) -> None:
    from modelmeter.reports.render import format_bytes

    out, _ = run(capsys, "gpt2_tiny", "--seq-len", "16", "--sweep", "batch=1,4096", "--memory", "--jobs", "1")
    rows = [line.split() for line in out.splitlines()[2:4]]
    data = run_json(capsys, "gpt2_tiny", "--seq-len", "16", "--sweep", "batch=1,4096", "--memory", "--jobs", "1")
    peaks = [row["peak_memory"] for row in data["rows"]]
    assert len({format_bytes(p)[-3:] for p in peaks}) == 2  # each on its own would take its own unit
    for column in (1, 2, 3, 4):  # #params, flops, activations, peak memory
        assert len(_suffixes([row[column] for row in rows])) == 1, out
    limit = 3 * data["rows"][0]["peak_memory"] // 2 + (1 << 20)  # from KiB-sized peaks to MiB-sized ones
    out, _ = run(capsys, "gpt2_tiny", "--seq-len", "16", "--fit", str(limit))
    table = [line.split() for line in out.splitlines()[2:] if line and line[0].isdigit()]
    fits = run_json(capsys, "gpt2_tiny", "--seq-len", "16", "--fit", str(limit))
    assert len({format_bytes(t["peak"])[-3:] for t in fits["tried"]}) == 2
    assert len(_suffixes([row[1] for row in table])) == 1 and len(table) == len(fits["tried"]), out


def test_a_sweep_table_fits_the_terminal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["gpt2_tiny", "--seq-len", "16", "--sweep", "batch=1,2", "--memory", "--jobs", "1"]
    wide, _ = run(capsys, *argv, "--wide")
    assert wide.splitlines()[1].split() == ["batch", "#params", "flops", "activations", "peak", "memory", "flops",
                                            "ratio"]
    monkeypatch.setenv("COLUMNS", "32")
    out, _ = run(capsys, *argv)
    lines = out.splitlines()
    assert max(map(len, lines)) <= 32, out
    assert lines[:2] == ["gpt2_tiny: sweep of batch (fake", "  run)"]
    assert lines[2].split() == ["batch", "flops", "peak", "memory"]  # the flops and the peak stay
    assert [line.split() for line in lines[3:5]] == [line.split()[:1] + line.split()[2:3] + line.split()[4:5]
                                                     for line in wide.splitlines()[2:4]]
    note = " ".join(" ".join(lines[5:]).split())
    assert note.startswith("Left out to fit 32 characters: #params, activations, flops ratio (all columns: --wide)")
    assert "flops grow 2.00x from batch 1 to 2, about batch^1.00" in note
