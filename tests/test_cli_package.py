"""The ``modelmeter`` command as a package of subcommands: each with its own ``--help``, the analysis the default,
help and listings without torch, one module per subcommand, and the formatters it shares with the reports."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from modelmeter.cli import commands, main, options
from modelmeter.reports.format import aligned_table, format_bytes, titled_table

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 0) -> tuple[str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert status == code, f"exit {status}, stderr: {err}"
    return out, err


# --- without torch ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["--help"], ["analyse", "--help"], ["list", "--help"], ["list"],
                                  ["list", "--format", "json"], ["cache", "--help"], ["diff", "--help"]])
def test_help_and_list_do_not_import_torch(argv: list[str]) -> None:
    """In a fresh process (this one has torch already): the command answers, and torch was never imported."""
    code = (f"import sys; from modelmeter_cli import main; status = main({argv!r}); "
            "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr
    assert done.stdout and not done.stderr


def test_the_package_root_imports_torch_on_first_use() -> None:
    code = ("import sys, modelmeter; assert 'torch' not in sys.modules; "
            "assert modelmeter.FlopCountAnalysis.__name__ == 'FlopCountAnalysis'; assert 'torch' in sys.modules; "
            "missing = [n for n in modelmeter.__all__ if not hasattr(modelmeter, n)]; assert not missing, missing; "
            "assert set(modelmeter.__all__) <= set(dir(modelmeter))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr


def test_the_commands_choices_are_the_librarys() -> None:
    """The parser names its choices without importing torch; they must be the library's own."""
    from modelmeter import CONVENTIONS, OPTIMIZERS
    from modelmeter.handles.attention import ATTENTION_KERNELS
    from modelmeter.reports import FORMATS

    assert options.FORMATS == FORMATS
    assert options.CONVENTIONS == CONVENTIONS
    assert options.ATTENTION_KERNELS == ATTENTION_KERNELS
    assert tuple(OPTIMIZERS) == options.OPTIMIZERS
    assert all(isinstance(getattr(torch, name), torch.dtype) for name in options.INPUT_DTYPES.values())


def test_the_list_is_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    from modelmeter.zoo import ZOO

    rows = json.loads(run(capsys, "list", "--format", "json")[0])
    assert [row["name"] for row in rows] == list(ZOO)
    for row in rows:
        entry = ZOO[row["name"]]
        assert row["input"] == "x".join(map(str, entry.input_shape)) + " " + str(entry.input_dtype).split(".")[1]
        assert row["description"] == entry.description


@pytest.mark.parametrize("width", [60, 80, 200])
def test_the_list_fits_the_terminal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                    width: int) -> None:
    from modelmeter.zoo import ZOO

    monkeypatch.setenv("COLUMNS", str(width))
    lines = run(capsys, "list")[0].splitlines()
    assert max(map(len, lines)) <= width
    column = lines[1].index(ZOO[lines[1].split()[0]].description[:5])  # where the descriptions start
    table = lines[1:lines.index("")]
    rows = " ".join(line[column:] if line[:column].strip() == "" else "\n" + line[column:] for line in table)
    assert [" ".join(row.split()) for row in rows.split("\n") if row.strip()] == [e.description for e in ZOO.values()]


def test_the_devices_table_fits_the_terminal(capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from modelmeter.devices import list_devices

    monkeypatch.setenv("COLUMNS", "200")
    full = run(capsys, "devices")[0].splitlines()
    assert full[1].split() == ["name", "device", "memory", "bandwidth", "bf16", "fp16", "fp32", "tf32", "fp8", "ridge"]
    monkeypatch.setenv("COLUMNS", "60")
    lines = run(capsys, "devices")[0].splitlines()
    assert max(map(len, lines)) <= 60
    header = next(line.split() for line in lines if line.startswith("name "))
    assert header == ["name", "memory", "bandwidth", "bf16", "fp16", "fp32", "ridge"]  # the label, fp8, tf32 left out
    rows = [line.split() for line in lines if line.split() and line.split()[0] in {d.name for d in list_devices()}]
    assert [row[0] for row in rows] == [d.name for d in list_devices()]
    assert [row[-1] for row in rows] == [line.split()[-1] for line in full[3:3 + len(rows)]]  # the same ridge
    assert "left out to fit 60 characters: device, fp8, tf32" in " ".join(lines)


# --- subcommands ---------------------------------------------------------------------------------------------
def test_the_help_names_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run(capsys, "--help")
    usage, words = out.split("\n\n")[0], " ".join(out.split())  # the help as words: argparse wraps it
    for name in ("list", "cache", "diff"):
        assert f"\n       modelmeter {name} " in usage and f"`modelmeter {name}`" in words
    assert "modelmeter [analyse] [MODEL]" in usage and "--sweep" in out


@pytest.mark.parametrize(("name", "words"), [
    ("list", ["--format {table,json}", "built-in models"]),
    ("cache", ["{info,clear}", "--cache-dir", "delete every cached trace"]),
    ("diff", ["BEFORE", "AFTER", "the largest change first"]),
])
def test_each_subcommand_has_its_own_help(capsys: pytest.CaptureFixture[str], name: str, words: list[str]) -> None:
    out, _ = run(capsys, name, "--help")
    assert out.startswith(f"usage: modelmeter {name} ")
    for word in words:
        assert word in out
    assert "--sweep" not in out and "--budget" not in out  # the analysis's options: accepted, not described


def test_a_subcommand_refuses_what_no_subcommand_takes(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = run(capsys, "list", "--bogus", code=2)
    assert err == "modelmeter: unrecognized arguments: --bogus (`modelmeter list --help` lists the options)\n"
    _, err = run(capsys, "list", "--format", "csv", code=2)
    assert "argument --format: invalid choice: 'csv'" in err and err.count("\n") == 1


def test_analyse_is_the_default_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["gpt2_tiny", "--seq-len", "8", "--format", "json", "--no-cache"]
    explicit = json.loads(run(capsys, "analyse", *argv)[0])
    default = json.loads(run(capsys, *argv)[0])
    assert explicit["modules"] == default["modules"] and explicit["model"] == "gpt2_tiny"


def test_a_command_name_after_options_is_not_a_model(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = run(capsys, "--depth", "1", "list", code=2)
    assert err == "modelmeter: 'list' is a command, not a model: give it first (`modelmeter list ...`)\n"


def test_a_file_named_like_a_command_is_a_model(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "list.py").write_text("import torch\n\ndef build():\n    return torch.nn.Linear(8, 4)\n")
    monkeypatch.chdir(tmp_path)
    data = json.loads(run(capsys, "list.py:build", "--input", "2x8", "--format", "json", "--no-cache")[0])
    assert data["modules"][0]["metrics"]["flops"] == 2 * 8 * 4  # one multiply-add per weight and row, by hand


def test_a_new_subcommand_is_one_module(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A module with SUMMARY, build_parser() and run(args), and its line in COMMANDS: dispatched, with its own
    help, and named in the command's help."""
    module = types.ModuleType("modelmeter.cli.hello")

    def build_parser() -> argparse.ArgumentParser:
        parser = options.subcommand_parser("modelmeter hello", "modelmeter hello NAME", "Says hello.")
        parser.add_argument("who", metavar="NAME")
        return parser

    def run_hello(args: argparse.Namespace) -> int:
        print(f"hello {args.who}")
        return 3

    module.SUMMARY, module.build_parser, module.run = "says hello", build_parser, run_hello  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "modelmeter.cli.hello", module)
    monkeypatch.setitem(commands.COMMANDS, "hello", "hello")
    assert run(capsys, "hello", "you", "--no-cache", code=3)[0] == "hello you\n"
    assert "`modelmeter hello` says hello" in " ".join(run(capsys, "--help")[0].split())  # as wrapped
    assert run(capsys, "hello", "--help")[0].startswith("usage: modelmeter hello NAME")


def test_cache_info_prints_sizes_as_the_reports_do(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELMETER_CACHE_SIZE", "1536")
    out, _ = run(capsys, "cache", "info", "--cache-dir", str(tmp_path))
    assert "size:        0B (0 bytes)\n" in out
    assert "limit:       1.5KiB (1536 bytes) ($MODELMETER_CACHE_SIZE)\n" in out


# --- the formatters shared with the reports ----------------------------------------------------------------
def test_aligned_and_titled_tables() -> None:
    rows = [["name", "n"], ["a", "1000"], ["bbb", "2"]]
    assert aligned_table(rows, ["left", "right"]) == ["name     n", "a     1000", "bbb      2"]
    assert aligned_table(rows, ["right", "left"], rule=True) == ["name  n", "----  ----", "   a  1000", " bbb  2"]
    assert titled_table(rows[0], rows[1:], "table", "T") == ["T", "name     n", "a     1000", "bbb      2"]
    assert titled_table(rows[0], rows[1:], "markdown", "T") == ["| name | n |", "|:---|---:|", "| a | 1000 |",
                                                                "| bbb | 2 |"]
    assert [format_bytes(n) for n in (0, 1023, 1536, 225699420, 5 << 40)] == ["0B", "1023B", "1.5KiB", "215MiB",
                                                                             "5TiB"]


_IMPORTS_AFTER_ANALYSIS = """
import sys, torch
from torch import nn
import modelmeter
sys.path.insert(0, sys.argv[3])
from model_helpers import small_resnet
model_name, step = sys.argv[1], sys.argv[2]
if model_name == "cnn":
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 2)).eval()
    x = torch.randn(1, 3, 16, 16)
elif model_name == "resnet":
    model, x = small_resnet(), torch.randn(2, 3, 32, 32)
elif model_name == "transformer":
    model, x = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), torch.randn(2, 5, 32)
elif model_name in ("llama2", "gpt2", "bert"):  # the zoo's, on meta
    from modelmeter.zoo import get_model
    model, x = get_model(f"{model_name}_tiny", device="meta"), torch.randint(0, 100, (1, 16))
else:
    model, x = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)), torch.randn(2, 16)
options = {"forward": {}, "backward": {"backward": True},
           "training": {"backward": True, "memory": True, "optimizer": "adamw"}}[step]
before = {"torch._dynamo", "sympy"} & set(sys.modules)
analysis = modelmeter.analyze(model, x, quiet=True, **options)
assert analysis.result().total("flops") > 0
assert analysis.trace.execution == "fake" and not analysis.trace.assumptions  # meta stand-ins, no fallback
print(sorted(({"torch._dynamo", "sympy"} & set(sys.modules)) - before))
"""


@pytest.mark.parametrize("model,step", [("mlp", "forward"), ("cnn", "forward"), ("mlp", "backward"),
                                        ("cnn", "backward"), ("resnet", "backward"), ("mlp", "training"),
                                        ("resnet", "training"), ("transformer", "backward"),
                                        ("transformer", "training"), ("llama2", "forward"),
                                        ("llama2", "backward"), ("gpt2", "forward"), ("gpt2", "backward"),
                                        ("bert", "forward"), ("bert", "backward")])
def test_an_analysis_of_a_plain_model_does_not_import_dynamo(model: str, step: str) -> None:
    """torch._dynamo and sympy take over a second to import: a plain model's analysis, forward, backward or a
    training step with its memory, imports neither (PyTorch's meta kernels of convolution, of the backward
    kernels, of ``ones_like`` (the loss's seed gradient), ``mm``, ``sum`` and others are Python code whose
    ``torch._check`` imports sympy, and whose ``torch._disable_dynamo`` wrapper imports torch._dynamo: those the
    models here run are made directly, see engine/meta_kernels.py)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER_ANALYSIS, model, step, str(Path(__file__).parent)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1].replace("'", '"')) == []
