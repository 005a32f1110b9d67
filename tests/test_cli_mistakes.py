"""Every mistake on the ``modelmeter`` command line is one clear line on stderr, never a traceback.

A usage error (a bad option value, shape, path, model name or key=value) exits 2 before any model is built; a
model that fails to build or run exits 1; Ctrl-C exits 130. Inputs the command makes take no memory unless
``--real``. In-process through ``main([...])``, except where the process itself is what is tested.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import modelmeter.analysis
from modelmeter import FlopCountAnalysis, ModelRunError
from modelmeter.cli import job, main, output
from modelmeter.cli.models import load_model
from modelmeter.cli.options import build_parser

SRC = str(Path(__file__).resolve().parents[1] / "src")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="what happens where CUDA cannot run")


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], code: int) -> str:
    """``modelmeter ARGV``: check the exit status and that stderr is one ``modelmeter: ...`` line; that line."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == code, f"exit {status}, stderr: {err}"
    assert out == ""
    assert err.startswith("modelmeter: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a model runs: the mistake must be found before."""

    def analyze(*_: Any, **__: Any) -> Any:
        raise AssertionError("the model ran")

    monkeypatch.setattr(modelmeter.analysis, "analyze", analyze)


BIG = str(10**30)


# --- option values ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "words"), [
    (["--fit", "1e400GiB"], ["argument --fit", "out of range: '1e400GiB'"]),
    (["--fit", "1e30GiB"], ["argument --fit", "out of range: '1e30GiB'"]),
    (["--fit", "1e12TiB"], ["argument --fit", "more memory than a machine can address"]),
    (["--fit", "-1GiB"], ["argument --fit", "not a quantity: '-1GiB'"]),
    (["--fit", "nan"], ["argument --fit", "not a quantity: 'nan'"]),
    (["--fit", "inf"], ["argument --fit", "not a quantity: 'inf'"]),
    (["--fit", "0"], ["argument --fit", "at least one byte"]),
    (["--input", "99999999999999999999999x16"], ["argument --input", "more elements than a tensor can hold"]),
    (["--input", "4611686018427387904x2:float32"], ["argument --input", "more elements than a tensor can hold"]),
    (["--input", "0x16"], ["argument --input", "input sizes must be positive, got '0x16'"]),
    (["--input", "-1x3"], ["argument --input", "input sizes must be positive, got '-1x3'"]),
    (["--input", "1x3:notadtype"], ["argument --input", "unknown input dtype 'notadtype'", "float16"]),
    (["--input", "9" * 5000], ["argument --input", "an input shape looks like 1x3x224x224"]),
    (["--input", "1x3", "--batch", "2"], ["--input fixes the input shapes"]),
    (["--batch", BIG], ["argument --batch", "is too large (at most 2**63 - 1)"]),
    (["--batch", "-3"], ["argument --batch", "expected a positive integer, got '-3'"]),
    (["--batch", "1.5"], ["argument --batch", "expected a positive integer, got '1.5'"]),
    (["--resolution", BIG], ["argument --resolution", "too large"]),
    (["--batch", str(10**17)], ["an input of 100000000000000000x3x224x224 float32", "more bytes than a tensor"]),
    (["--resolution", str(10**11)], ["an input of 1x3x100000000000x100000000000 float32", "smaller sizes"]),
    (["--depth", "-1"], ["argument --depth", "expected a depth of 0 or more, got '-1'"]),
    (["--depth", "two"], ["argument --depth", "got 'two'"]),
    (["--sweep", "resolution="], ["argument --sweep", "needs at least one value"]),
    (["--sweep", "batch=-1"], ["argument --sweep", "positive integers, got '-1'"]),
    (["--sweep", "batch=1," + BIG], ["argument --sweep", "positive integers"]),
    (["--sweep", "nonsense"], ["argument --sweep", "--sweep must look like resolution=224,288"]),
    (["--jobs", "0"], ["argument --jobs", "expected a positive integer"]),
    (["--format", "xml"], ["argument --format", "invalid choice: 'xml'", "table"]),
    (["--dtype", "float8"], ["argument --dtype", "invalid choice: 'float8'", "bfloat16"]),
    (["--execution", "gpu"], ["argument --execution", "invalid choice: 'gpu'"]),
    (["--optimizer", "lion"], ["argument --optimizer", "invalid choice: 'lion'"]),
    (["--no-such-option"], ["unrecognized arguments: --no-such-option", "--help"]),
    (["--input"], ["argument --input: expected one argument"]),
    (["width=3"], ["unknown resnet18 argument 'width'", "it takes num_classes"]),
    (["num_clases=3"], ["unknown resnet18 argument 'num_clases'", "did you mean num_classes?"]),
    (["=3"], ["expected key=value, got '=3'"]),
    (["batch=4"], ["resnet18 takes no argument 'batch': the inputs the command makes are sized by --batch N"]),
    (["resolution=64"], ["sized by --resolution N"]),
    (["--state-dtype", "float16"], ["--state-dtype describes the optimizer's step"]),
    # an option that qualifies one not given would be ignored; two that name different runs contradict
    (["--tolerance", "5%"], ["--tolerance sets the growth --check-baseline FILE allows", "drop --tolerance"]),
    (["--name", "mine"], ["--name sets the name the cost guard (--budget, --save-baseline, --check-baseline)"]),
    (["--jobs", "2"], ["--jobs sets the worker processes of --sweep"]),
    (["--jobs", "2", "--check-baseline", "b.json"], ["--jobs sets the worker processes of --sweep"]),
    (["--real", "--execution", "fake"], ["--real and --execution fake contradict each other"]),
    (["--execution", "auto", "--real", "--parallel", "dp=2"], ["simulates its ranks on fake tensors"]),
    # a layout option where no report shows it
    (["--columns", "flops", "--format", "csv"], ["--columns chooses the columns of --format table or markdown"]),
    (["--columns", "flops", "--format", "tree"], ["tree gives every metric"]),
    (["--shapes", "--format", "csv"], ["--shapes adds the output shapes to --format table, markdown and tree"]),
    (["--shapes", "--sweep", "batch=1,2"], ["--shapes chooses the module table's columns: --sweep prints one row"]),
    (["--columns", "flops", "--fit", "1GiB"], ["--fit prints one row per run"]),
])
def test_option_mistakes_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], no_run: None, argv: list[str],
                                                 words: list[str]) -> None:
    err = one_line_error(capsys, ["resnet18", *argv], 2)
    for word in words:
        assert word in err


def test_a_saved_traces_report_refuses_a_layout_it_cannot_show(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    err = one_line_error(capsys, ["report", str(tmp_path / "none.mmtrace"), "--columns", "flops", "--format",
                                  "json"], 2)
    assert "--columns chooses the columns of --format table or markdown; json gives every metric" in err


@pytest.mark.parametrize(("argv", "words"), [
    (["resnet5"], ["unknown model 'resnet5'; did you mean resnet50"]),
    (["gpt2_tiny", "--seq-len", BIG], ["argument --seq-len", "too large"]),
    (["gpt2_tiny", "--seq-len", str(2**62)], ["an input of 1x4611686018427387904 int64", "more bytes than a tensor"]),
    (["gpt2_tiny", "--resolution", "64"], ["--resolution applies to image models"]),
    (["gpt2_tiny", "n_layr=2"], ["unknown gpt2_tiny argument 'n_layr'"]),
    (["gpt2_tiny", "seq_len=32"], ["gpt2_tiny takes no argument 'seq_len'", "sized by --seq-len N"]),
    (["gpt2_tiny", "list"], ["'list' is a command, not a model's argument: give it first (`modelmeter list ...`)"]),
    (["cache", "wipe"], ["usage: modelmeter cache info|clear"]),
    (["cahce", "info"], ["unknown model or command 'cahce'; did you mean `modelmeter cache`?"]),
    (["lsit"], ["unknown model or command 'lsit'; did you mean `modelmeter list`?"]),
    (["dif", "a.json", "b.json"], ["did you mean `modelmeter diff`?"]),
    (["torchvision:resnt18"], ["unknown torchvision model 'resnt18'; did you mean resnet18"]),
])
def test_model_argument_mistakes_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], no_run: None,
                                                         argv: list[str], words: list[str]) -> None:
    err = one_line_error(capsys, argv, 2)
    for word in words:
        assert word in err


def test_a_negative_value_reaches_its_options_check(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse reads ``-1x3`` as an option; the command hands it to --input, whose check says what is wrong, and
    a value for a short option (``-o``) the same way."""
    assert output.attach_negative_values(build_parser(), ["m", "--input", "-1x3", "-o", "-2.txt", "--backward"]) \
        == ["m", "--input=-1x3", "-o-2.txt", "--backward"]
    assert output.attach_negative_values(build_parser(), ["m", "--backward", "-1"]) == ["m", "--backward", "-1"]


# --- paths: checked before the model runs ----------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--output", "--html", "--save-baseline"])
def test_an_unwritable_path_is_refused_before_the_run(capsys: pytest.CaptureFixture[str], no_run: None,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      option: str) -> None:
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("x")
    err = one_line_error(capsys, ["resnet18", option, str(tmp_path)], 2)
    assert f"{option} {tmp_path} is a directory: give a file name" in err
    err = one_line_error(capsys, ["resnet18", option, str(tmp_path / "missing" / "out")], 2)
    assert f"the folder {tmp_path / 'missing'} does not exist: create it first" in err
    err = one_line_error(capsys, ["resnet18", option, str(a_file / "out")], 2)
    assert f"the folder {a_file} is not a directory" in err
    # no permission (the tests may run as root, whom chmod does not stop: the permission check itself is patched)
    denied = {str(tmp_path)}
    monkeypatch.setattr(output.os, "access", lambda path, mode: os.fspath(path) not in denied)
    err = one_line_error(capsys, ["resnet18", option, str(tmp_path / "out")], 2)
    assert f"{option} {tmp_path / 'out'}: no permission to write there" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", ["--output", "--html", "--compare", "--save-baseline", "--check-baseline",
                                    "--cache-dir"])
def test_a_path_with_a_nul_character_is_refused(capsys: pytest.CaptureFixture[str], no_run: None,
                                                option: str) -> None:
    err = one_line_error(capsys, ["list", option, "a\0b"], 2)
    assert f"{option} 'a\\x00b': a path cannot hold a NUL character" in err


def test_a_cache_dir_that_is_a_file_is_refused(capsys: pytest.CaptureFixture[str], no_run: None,
                                               tmp_path: Path) -> None:
    a_file = tmp_path / "cache"
    a_file.write_text("x")
    assert f"--cache-dir {a_file} is not a directory" in one_line_error(capsys, ["resnet18", "--cache-dir",
                                                                                 str(a_file)], 2)
    assert "is not a directory" in one_line_error(capsys, ["cache", "clear", "--cache-dir", str(a_file)], 2)
    assert a_file.read_text() == "x"


def test_a_bad_compare_file_is_refused_before_the_run(capsys: pytest.CaptureFixture[str], no_run: None,
                                                      tmp_path: Path) -> None:
    page = str(tmp_path / "page.html")
    err = one_line_error(capsys, ["resnet18", "--html", page, "--compare", str(tmp_path / "none.json")], 2)
    assert f"cannot read --compare {tmp_path / 'none.json'}: No such file or directory" in err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("[1, 2")
    err = one_line_error(capsys, ["resnet18", "--html", page, "--compare", str(garbage)], 2)
    assert "not a saved analysis (--format json)" in err


def test_a_writable_path_still_works(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "new.html"
    assert main(["gpt2_tiny", "--seq-len", "8", "--html", str(target)]) == 0
    assert f"wrote {target}" in capsys.readouterr().err and target.read_text().startswith("<!DOCTYPE html>")


# --- model files -----------------------------------------------------------------------------------------------
MODELS = textwrap.dedent("""
    import torch
    from torch import nn

    def build():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


    def tokens():
        return nn.Sequential(nn.Embedding(1000, 8), nn.Linear(8, 2))


    def not_a_module():
        return 5


    def raises(depth=2):
        raise ValueError("depth must be even")


    def cuda_build():
        return nn.Linear(4, 4).cuda()


    class NewTensorOnCuda(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x) + torch.ones(4, device="cuda")


    def cuda_forward():
        return NewTensorOnCuda()


    class OutputToCuda(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x).cuda()


    def output_to_cuda():
        return OutputToCuda()
""")


@pytest.fixture
def models(tmp_path: Path) -> Path:
    path = tmp_path / "my_models.py"
    path.write_text(MODELS)
    (tmp_path / "broken_syntax.py").write_text("def build(:\n")
    (tmp_path / "bad_import.py").write_text("import no_such_module_anywhere\n\ndef build():\n    pass\n")
    return path


@pytest.mark.parametrize(("spec", "argv", "code", "words"), [
    ("missing.py:build", [], 2, ["no such file: ", "missing.py"]),
    ("my_models.py:biuld", [], 2, ["has no factory 'biuld'; did you mean build?"]),
    ("my_models.py:", [], 2, ["expected path/file.py:factory"]),
    ("my_models.py", [], 2, ["my_models.py is a file: name the function that returns the model",
                             "my_models.py:FACTORY; it defines: build, tokens, not_a_module, raises, "]),
    ("bad_import.py", [], 2, ["bad_import.py:FACTORY; it defines: build"]),  # read, not imported
    ("broken_syntax.py", [], 2, ["broken_syntax.py is a file: name the function", "broken_syntax.py:FACTORY"]),
    ("missing.py", [], 2, ["no such file: ", "missing.py"]),
    ("my_models.py:build", ["x=1"], 2, ["my_models.py:build argument 'x'", "no key=value arguments"]),
    ("my_models.py:raises", ["deph=1"], 2, ["unknown", "argument 'deph'; did you mean depth?"]),
    ("my_models.py:build", [], 2, ["has no default input: give its shape with --input"]),
    ("my_models.py:build", ["--batch", "2"], 2, ["has no default input"]),
    ("my_models.py:build", ["--input", "2x15"], 2, ["the model failed in module '0' (Linear)",
                                                     "expected last dimension 16", "got 15"]),
    ("my_models.py:not_a_module", [], 1, ["returned int; expected an nn.Module or a (model, inputs) pair"]),
    ("my_models.py:raises", [], 1, ["could not build", "ValueError: depth must be even"]),
    ("broken_syntax.py:build", [], 1, ["could not build", "SyntaxError"]),
    ("bad_import.py:build", [], 1, ["could not build", "ModuleNotFoundError", "no_such_module_anywhere"]),
])
def test_model_file_mistakes_are_one_line(capsys: pytest.CaptureFixture[str], models: Path, spec: str,
                                          argv: list[str], code: int, words: list[str]) -> None:
    err = one_line_error(capsys, [str(models.parent / spec), *argv], code)
    for word in words:
        assert word in err


@NO_CUDA
def test_a_model_built_on_cuda_says_what_to_do(capsys: pytest.CaptureFixture[str], models: Path) -> None:
    err = one_line_error(capsys, [f"{models}:cuda_build"], 1)
    assert err.startswith(f"modelmeter: could not build {models}:cuda_build: it puts tensors on CUDA")
    assert "which this machine cannot run (RuntimeError)" in err or "(AssertionError)" in err  # CPU-only torch
    assert "modelmeter needs no GPU" in err and "build the model on cpu" in err and not err.endswith("...\n")


@NO_CUDA
def test_a_forward_that_creates_cuda_tensors_needs_a_fake_run(capsys: pytest.CaptureFixture[str],
                                                               models: Path) -> None:
    """Real kernels cannot put tensors on CUDA here: the error says so, and that a fake run counts them (a fake run
    does: tests/test_cuda_models.py)."""
    err = one_line_error(capsys, [f"{models}:cuda_forward", "--input", "2x4", "--execution", "real"], 1)
    assert err.startswith("modelmeter: the model failed in NewTensorOnCuda.forward at operator aten::")
    assert "it puts tensors on CUDA" in err
    assert "a fake run (execution 'auto' or 'fake') counts them on cuda, forward and backward" in err
    model = load_model(f"{models}:cuda_forward").model  # the Python API raises the same
    with pytest.raises(ModelRunError, match=r"it puts tensors on CUDA, .* modelmeter needs no GPU"):
        FlopCountAnalysis(model, torch.zeros(2, 4), execution="real").total()


def test_a_cuda_call_on_the_output_is_counted(capsys: pytest.CaptureFixture[str], models: Path) -> None:
    """Moving the result to CUDA costs no flops: the fake run does it on fake tensors, no GPU needed."""
    out = main([f"{models}:output_to_cuda", "--input", "2x4", "--format", "json"])
    assert out == 0
    data = json.loads(capsys.readouterr().out)
    assert data["modules"][0]["metrics"]["flops"] == 2 * 4 * 4


def test_other_errors_are_not_taken_for_cuda(capsys: pytest.CaptureFixture[str], models: Path) -> None:
    err = one_line_error(capsys, [f"{models}:build", "--input", "2x15"], 2)
    assert "CUDA" not in err and "expected last dimension 16 (the in_features of its 32x16 weight), got 15" in err


# --- inputs take no memory unless --real -----------------------------------------------------------------------
def test_inputs_of_every_kind_of_model_are_meta_unless_real(models: Path) -> None:
    loaded = load_model(f"{models}:build")  # a file model: built on cpu by its factory
    assert loaded.device.type == "cpu"
    huge = loaded.explicit_inputs([((100_000_000, 16), None)])
    assert huge[0].is_meta and huge[0].shape == (100_000_000, 16) and huge[0].dtype == torch.float32
    small = loaded.explicit_inputs([((2, 16), None)], real=True)
    assert small[0].device.type == "cpu" and not small[0].any()
    tokens = load_model(f"{models}:tokens").explicit_inputs([((2, 128), torch.long)])
    assert tokens[0].is_meta and tokens[0].dtype == torch.long
    zoo = load_model("gpt2_tiny", device="cpu")  # built on cpu, as with --real
    assert zoo.inputs(batch=3).is_meta and zoo.inputs(batch=3).shape == (3, 64)
    assert zoo.inputs(batch=3, real=True).device.type == "cpu"


def test_token_inputs_of_a_file_model_count_as_real_ones(capsys: pytest.CaptureFixture[str], models: Path) -> None:
    """Token ids made by the command: int64, fake (meta) by default; the count is that of a real run."""
    fake = main([f"{models}:tokens", "--input", "2x128:long", "--format", "json"])
    fake_data = json.loads(capsys.readouterr().out)
    real = main([f"{models}:tokens", "--input", "2x128:long", "--real", "--format", "json"])
    real_data = json.loads(capsys.readouterr().out)
    assert (fake, real) == (0, 0)
    assert fake_data["inputs"] == [{"shape": [2, 128], "dtype": "int64"}]
    assert (fake_data["execution"], real_data["execution"]) == ("fake", "real")
    assert fake_data["modules"][0]["metrics"]["flops"] == real_data["modules"][0]["metrics"]["flops"] == 2 * 128 * 8 * 2


def test_fake_inputs_of_a_file_model_give_the_real_runs_numbers(capsys: pytest.CaptureFixture[str],
                                                                 models: Path) -> None:
    """Meta inputs for a model built on the CPU: flops, activations and the training step's memory are those of a
    run of real kernels on real zeros."""
    argv = [f"{models}:build", "--input", "64x16", "--memory", "--backward", "--optimizer", "adam", "--format", "json",
            "--no-cache"]
    runs = []
    for extra in ([], ["--real"]):
        assert main([*argv, *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    fake, real = runs
    assert (fake["execution"], real["execution"]) == ("fake", "real")
    assert [m["metrics"] for m in fake["modules"]] == [m["metrics"] for m in real["modules"]]
    assert fake["memory"]["peak"] == real["memory"]["peak"] > 64 * 16 * 4


def test_a_huge_input_of_a_file_model_takes_no_memory(models: Path) -> None:
    """``--input 100000000x16`` on a small MLP: 6.4 GB as real zeros; the command's peak stays far below."""
    code = ("import resource, sys; from modelmeter_cli import main; status = main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr); sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code, f"{models}:build", "--input", "100000000x16", "--format",
                           "json", "--no-cache"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["modules"][0]["metrics"]["flops"] == 100_000_000 * (16 * 32 + 32 * 4)  # by hand
    peak = int(done.stderr.split()[-1])
    assert peak < 2 * 1024**3, f"peak RSS {peak / 1024**3:.1f} GiB"


# --- Ctrl-C ----------------------------------------------------------------------------------------------------
def test_ctrl_c_while_building_is_one_line(capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "load_model", interrupted)
    assert main(["resnet18"]) == 130
    assert capsys.readouterr() == ("", "modelmeter: interrupted\n")


def test_ctrl_c_at_start_up_is_one_line() -> None:
    """SIGINT a fraction of a second after start: while torch loads (or, on a fast machine, while the model is
    built): exit 130, one line, no traceback."""
    code = ("import os, signal, sys, threading, modelmeter_cli; "
            "threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start(); "
            "sys.exit(modelmeter_cli.main(['resnet50', '--no-cache']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert (done.returncode, done.stderr, done.stdout) == (130, "modelmeter: interrupted\n", "")


def test_the_entry_point_module_imports_nothing_heavy() -> None:
    code = "import sys, modelmeter_cli; print(sorted(m for m in ('torch', 'modelmeter') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.stdout.strip() == "[]"


def test_the_entry_point_runs_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    import modelmeter_cli

    assert modelmeter_cli.main(["gpt2_tiny", "--seq-len", "8", "--depth", "0"]) == 0
    assert capsys.readouterr().out.startswith("gpt2_tiny on input 1x8 int64 (fake run")


# --- huge sizes that are valid are counted, not hung on ------------------------------------------------------
CAUSAL = textwrap.dedent("""
    import torch.nn.functional as F
    from torch import nn


    class Causal(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)


    def build():
        return Causal()
""")


def test_a_billion_token_causal_attention_is_counted_at_once(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    """The attended pairs of a causal mask are counted in closed form (a loop over queries took minutes at a
    billion tokens): the count is proportional to the pairs, n(n+1)/2, at 64 tokens and at 10**9."""
    path = tmp_path / "causal.py"
    path.write_text(CAUSAL)

    def flops(tokens: int) -> int:
        assert main([f"{path}:build", "--input", f"1x2x{tokens}x8", "--format", "json", "--no-cache"]) == 0
        return int(json.loads(capsys.readouterr().out)["modules"][0]["metrics"]["flops"])

    small, huge = 64, 10**9
    assert flops(small) == 2 * (small * (small + 1) // 2) * (8 + 8)  # heads x pairs x (q.k and p.v products)
    assert flops(huge) == 2 * (huge * (huge + 1) // 2) * (8 + 8)


SLOW_POINT = textwrap.dedent("""
    import os
    import pathlib
    import time


    def slow_point(job):
        pathlib.Path(os.environ["MARKERS"], str(os.getpid())).touch()
        time.sleep(120)
""")


def test_ctrl_c_during_a_sweep_ends_the_workers_quietly(tmp_path: Path) -> None:
    """Ctrl-C reaches every process of the command (the terminal signals the process group): the workers quit at
    once and print nothing, the command prints its one line."""
    (tmp_path / "slow_helper.py").write_text(SLOW_POINT)
    markers = tmp_path / "markers"
    markers.mkdir()
    code = ("import sys, modelmeter_cli, slow_helper; from modelmeter.cli import sweep; "
            "sweep.sweep_point = slow_helper.slow_point; "
            "sys.exit(modelmeter_cli.main(['resnet18', '--sweep', 'batch=1,2', '--jobs', '2', '--no-cache']))")
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{tmp_path}", "MARKERS": str(markers)}
    command = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while len(list(markers.iterdir())) < 2 and command.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(p.name) for p in markers.iterdir()]
        assert len(workers) == 2, command.communicate(timeout=60)
        os.killpg(command.pid, signal.SIGINT)
        out, err = command.communicate(timeout=60)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
    assert (command.returncode, err, out) == (130, "modelmeter: interrupted\n", "")
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --- environment variables -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("variable", "value"), [("MODELMETER_CACHE_SIZE", "lots"), ("MODELMETER_CACHE_SIZE", "1e400"),
                                                 ("MODELMETER_CACHE", "a_file")])
def test_a_bad_environment_variable_is_one_warning_line(tmp_path: Path, variable: str, value: str) -> None:
    """The run goes on with the default (the cache's documented fallback), saying so in one line."""
    (tmp_path / "a_file").write_text("x")
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp_path), "MODELMETER_CACHE": str(tmp_path / "cache"),
           variable: str(tmp_path / value) if value == "a_file" else value}
    done = subprocess.run([sys.executable, "-m", "modelmeter_cli", "gpt2_tiny", "--seq-len", "8", "--depth", "0"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.startswith("gpt2_tiny on input 1x8")
    assert done.stderr.count("\n") == 1 and variable.removeprefix("MODELMETER_") in done.stderr.upper(), done.stderr
    assert "Traceback" not in done.stderr
