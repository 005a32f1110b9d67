"""The ``modelmeter`` command analyses exactly what was asked, or says what is wrong with which argument.

A fourth, hostile round over the model's loading and the inputs it gets: no weights (nothing downloaded, also
where a builder would fetch a backbone by default), the default images of a model built for another size, a
factory that needs arguments, what model code prints (never into the report on stdout), a reader of the output
that leaves early (``| head -1``), and empty paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from modelmeter.cli import BROKEN_PIPE, main
from test_cli_mistakes import SRC, no_run, one_line_error  # noqa: F401 - no_run: a fixture

torchvision = pytest.importorskip("torchvision")


@pytest.fixture
def no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if torchvision would load (download) pretrained weights."""

    def get_state_dict(*_: Any, **__: Any) -> Any:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(torchvision.models.WeightsEnum, "get_state_dict", get_state_dict)


# --- weights: none are loaded, nothing is downloaded ------------------------------------------------------------
@pytest.mark.parametrize(("argv", "words"), [
    (["torchvision:resnet18", "weights=DEFAULT"], ["torchvision:resnet18 weights='DEFAULT': modelmeter loads no "
                                                   "weights and downloads nothing", "drop weights="]),
    (["torchvision:resnet18", "weights=IMAGENET1K_V1"], ["weights='IMAGENET1K_V1'"]),
    (["torchvision:fasterrcnn_resnet50_fpn", "weights_backbone=DEFAULT"], ["drop weights_backbone="]),
])
def test_weights_asked_for_are_a_usage_error(capsys: pytest.CaptureFixture[str], no_run: None,  # noqa: F811
                                             no_download: None, argv: list[str], words: list[str]) -> None:
    err = one_line_error(capsys, argv, 2)
    for word in words:
        assert word in err


def test_a_builder_that_fetches_a_backbone_by_default_gets_none(no_download: None) -> None:
    """torchvision's detection builders load an ImageNet backbone unless ``weights_backbone=None``: the command
    passes it (before, it tried to download and failed with a URLError)."""
    from modelmeter.cli.models import load_model

    loaded = load_model("torchvision:fasterrcnn_mobilenet_v3_large_fpn")
    assert loaded.name == "torchvision:fasterrcnn_mobilenet_v3_large_fpn"
    assert {p.device.type for p in loaded.model.parameters()} == {"meta"}


def test_timm_pretrained_is_a_usage_error(capsys: pytest.CaptureFixture[str], no_run: None) -> None:  # noqa: F811
    pytest.importorskip("timm")
    err = one_line_error(capsys, ["timm:resnet18", "pretrained=True"], 2)
    assert "timm:resnet18 pretrained=True: modelmeter loads no weights" in err and "drop pretrained=" in err


# --- images of the size the model was built for ------------------------------------------------------------
def _total(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[list[Any], int]:
    assert main([*argv, "--format", "json", "--depth", "0", "--no-cache"]) == 0
    data = json.loads(capsys.readouterr().out)
    return [i["shape"] for i in data["inputs"]], _flops(data)


def _flops(data: dict[str, Any]) -> int:
    """The whole model's FLOPs in a report saved with --format json (its first row is the model)."""
    model = data["modules"][0]
    assert model["name"] == ""
    flops: int = model["metrics"]["flops"]
    return flops


@pytest.mark.parametrize(("spec", "key"), [("vit_b_16", "image_size"), ("torchvision:vit_b_16", "image_size"),
                                           ("timm:vit_tiny_patch16_224", "img_size")])
def test_a_model_built_for_a_size_gets_images_of_that_size(capsys: pytest.CaptureFixture[str], spec: str,
                                                          key: str) -> None:
    """``image_size=64`` builds a ViT that takes 64x64 images alone: its default input is that size (before, it was
    224x224 and the model failed), the same run as ``--resolution 64``."""
    if spec.startswith("timm:"):
        pytest.importorskip("timm")
    shapes, flops = _total(capsys, [spec, f"{key}=64"])
    assert shapes == [[1, 3, 64, 64]]
    assert (shapes, flops) == _total(capsys, [spec, "--resolution", "64"])
    assert _total(capsys, [spec, f"{key}=64", "--resolution", "64"]) == (shapes, flops)


def test_a_non_square_size_gives_non_square_images(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("timm")
    shapes, _ = _total(capsys, ["timm:vit_tiny_patch16_224", "img_size=[64,32]"])
    assert shapes == [[1, 3, 64, 32]]


@pytest.mark.parametrize("argv", [["vit_b_16", "image_size=64"], ["torchvision:vit_b_16", "image_size=64"],
                                  ["timm:vit_tiny_patch16_224", "img_size=64"],
                                  ["transformers:ViTConfig", "image_size=64", "num_hidden_layers=1"]])
def test_a_size_and_another_resolution_contradict(capsys: pytest.CaptureFixture[str], no_run: None,  # noqa: F811
                                                  argv: list[str]) -> None:
    pytest.importorskip(argv[0].partition(":")[0] if ":" in argv[0] else "torch")
    err = one_line_error(capsys, [*argv, "--resolution", "32"], 2)
    assert "=64 builds the model for images of that size, and --resolution 32 asks for 32x32 ones" in err


# --- factories ---------------------------------------------------------------------------------------------
FACTORIES = textwrap.dedent("""
    import torch
    from torch import nn


    def needs(width, *, depth):
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


    class Talks(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 2)

        def forward(self, x):
            print("in forward")
            return self.linear(x)


    def talks():
        print("building")
        return Talks()


    def pair():
        return nn.Linear(4, 2), torch.zeros(1, 4)
""")
TALKING_MODULE = 'print("importing the factories")\nfrom factories import talks\n'


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    (tmp_path / "talking.py").write_text(TALKING_MODULE)  # prints when imported, imports its neighbour
    return path


def test_a_factory_with_required_arguments_names_them(capsys: pytest.CaptureFixture[str], no_run: None,  # noqa: F811
                                                      factories: Path) -> None:
    """Before, the factory was called without them: exit 1, "could not build: TypeError: missing ... argument"."""
    spec = f"{factories}:needs"
    err = one_line_error(capsys, [spec], 2)
    assert f"{spec} has required arguments: write `{spec} width=VALUE depth=VALUE`" in err
    assert "depth=VALUE" in one_line_error(capsys, [spec, "width=4"], 2)


def test_a_factory_with_its_arguments_runs(capsys: pytest.CaptureFixture[str], factories: Path) -> None:
    assert main([f"{factories}:needs", "width=4", "depth=3", "--input", "2x4", "--format", "json", "--no-cache"]) == 0
    assert _flops(json.loads(capsys.readouterr().out)) == 3 * 2 * 4 * 4


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_what_model_code_prints_goes_to_stderr(capsys: pytest.CaptureFixture[str], factories: Path,
                                               fmt: str) -> None:
    """Prints at import, in the factory and in forward() went into the report on stdout (JSON no longer parsed)."""
    assert main([f"{factories.parent / 'talking.py'}:talks", "--input", "3x4", "--format", fmt, "--no-cache"]) == 0
    out, err = capsys.readouterr()
    if fmt == "json":
        assert _flops(json.loads(out)) == 3 * 4 * 2
    else:
        assert out.startswith("name,type,")
    assert "importing the factories" not in out and "building" not in out and "in forward" not in out
    assert "importing the factories\n" in err and "building\n" in err and "in forward\n" in err


# --- output ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["list"], ["gpt2_tiny", "--seq-len", "8", "--format", "json", "--no-cache"]])
def test_a_reader_that_left_early_gets_no_traceback(argv: list[str]) -> None:
    """``modelmeter ... | head -1``: the reader gone, nothing more is printed (no BrokenPipeError traceback, before)
    and the status is the shell's for SIGPIPE."""
    read, write = os.pipe()
    os.close(read)  # the reader left before the report was written
    try:
        done = subprocess.run([sys.executable, "-m", "modelmeter", *argv], stdout=write, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=600, check=False)
    finally:
        os.close(write)
    assert done.returncode == BROKEN_PIPE == 141, done.stderr
    assert done.stderr == ""


def test_a_broken_pipe_in_process_is_the_same_status(monkeypatch: pytest.MonkeyPatch) -> None:
    class Gone:
        def fileno(self) -> int:
            raise OSError("no file descriptor")

        def write(self, _: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Gone())
    assert main(["list"]) == BROKEN_PIPE


@pytest.mark.parametrize("option", ["--output", "--html", "--save-trace"])
def test_an_empty_path_is_refused(capsys: pytest.CaptureFixture[str], no_run: None, option: str) -> None:  # noqa: F811
    """Before: ``--output is a directory: give a file name (e.g. report)`` (the empty path read as the working
    directory)."""
    assert f"{option} '': an empty path names no file" in one_line_error(capsys, ["resnet18", option, ""], 2)


def test_a_config_that_builds_no_model_is_not_suggested_as_itself(capsys: pytest.CaptureFixture[str],
                                                                    no_run: None) -> None:  # noqa: F811
    """``transformers:AutoConfig`` was refused with "did you mean AutoConfig?"."""
    pytest.importorskip("transformers")
    err = one_line_error(capsys, ["transformers:AutoConfig"], 2)
    assert "unknown transformers config 'AutoConfig'" in err and "did you mean AutoConfig" not in err
    assert "did you mean LlamaConfig" in one_line_error(capsys, ["transformers:LlamaConfg"], 2)


def test_default_tokens_fit_the_models_positions(capsys: pytest.CaptureFixture[str]) -> None:
    """A config with 16 positions took 128 default tokens, counted on fake tensors (no lookup past the position
    table's end fails there; a real run raises IndexError): the default is now the positions' count, the same run as
    ``--seq-len 16``."""
    pytest.importorskip("transformers")
    small = ["transformers:gpt2", "n_positions=16", "n_layer=1", "n_embd=32", "n_head=2"]
    shapes, flops = _total(capsys, small)
    assert shapes == [[1, 16]]
    assert _total(capsys, [*small, "--seq-len", "16"]) == (shapes, flops)
    assert _total(capsys, ["transformers:bert", "num_hidden_layers=1", "hidden_size=32", "num_attention_heads=2",
                           "intermediate_size=64"])[0] == [[1, 128]]  # 512 positions: the usual 128 tokens


@pytest.mark.parametrize(("first", "second"), [("--output", "--html"), ("--output", "--save-trace"),
                                               ("--html", "--save-baseline")])
def test_two_outputs_to_one_file_are_refused(capsys: pytest.CaptureFixture[str], no_run: None,  # noqa: F811
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: str,
                                             second: str) -> None:
    """``-o same --html same`` wrote the table, then the page over it, and said "wrote same" twice (with
    ``--save-trace``, the trace was lost under the table): one is refused, before the run, however each is spelt."""
    monkeypatch.chdir(tmp_path)
    spelt = f"../{tmp_path.name}/./same.out"  # the same file, by another way
    err = one_line_error(capsys, ["resnet18", first, "same.out", second, spelt], 2)
    assert f"{first} and {second} both write {spelt}: the second would overwrite the first" in err
    assert not (tmp_path / "same.out").exists()


@pytest.mark.parametrize("argv", [["resnet18", "num_classes=10", "num_classes=20"],
                                  ["torchvision:resnet18,num_classes=10", "num_classes=20"],
                                  ["resnet18", "num_classes=10,num_classes=20"]])
def test_a_key_given_twice_is_refused(capsys: pytest.CaptureFixture[str], no_run: None,  # noqa: F811
                                      argv: list[str]) -> None:
    """The last value won, silently (the header named it alone)."""
    err = one_line_error(capsys, argv, 2)
    assert "num_classes is given twice (num_classes=10 and num_classes=20): keep one" in err


def test_a_factorys_own_inputs_under_fit_name_fit(capsys: pytest.CaptureFixture[str], factories: Path) -> None:
    """``--fit`` on a factory that returns its inputs said "--batch does not apply", an option not given."""
    err = one_line_error(capsys, [f"{factories}:pair", "--fit", "1GiB"], 2)
    assert "inputs cannot be set (by --batch, --sweep batch=... or --fit): its factory returned them" in err


# --- the zoo's arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "words"), [
    (["gpt2_tiny", "vocab_size=0"], "gpt2_tiny: vocab_size=0 is out of range (at least 1)"),  # counted, exit 0
    (["mobilenet_v2", "width_mult=-1"], "width_mult=-1 is out of range (above 0)"),  # clamped to 8 channels
    (["mobilenet_v2", "width_mult=nan"], "mobilenet_v2: width_mult is a number, got 'nan'"),  # read as text
    (["resnet18", "num_classes=True"], "resnet18: num_classes is a whole number, got True"),  # was exit 1
    (["resnet18", "num_classes=2.5"], "num_classes is a whole number, got 2.5"),
    (["gpt2_tiny", "dropout=2"], "dropout=2 is out of range (0 <= dropout < 1)"),
    (["vit_b_16", "image_size=60"], "image_size 60 is not a multiple of patch_size 16"),  # the builder's own
])
def test_a_zoo_argument_no_model_has_is_a_usage_error(capsys: pytest.CaptureFixture[str], no_run: None,  # noqa: F811
                                                      argv: list[str], words: str) -> None:
    assert words in one_line_error(capsys, argv, 2)


def test_the_zoos_python_api_checks_its_arguments_too() -> None:
    from modelmeter.errors import InvalidTypeError, InvalidValueError
    from modelmeter.zoo import get_model

    with pytest.raises(InvalidValueError, match=r"bert_tiny: max_position_embeddings=0 is out of range"):
        get_model("bert_tiny", device="meta", max_position_embeddings=0)
    with pytest.raises(InvalidTypeError, match=r"resnet18: num_classes is a whole number, got '10'"):
        get_model("resnet18", device="meta", num_classes="10")
    with pytest.raises(InvalidValueError, match=r"width_mult=inf is out of range \(above 0\)"):
        get_model("mobilenet_v2", device="meta", width_mult=float("inf"))
    assert get_model("mobilenet_v2", device="meta", width_mult=0.5, dropout=0.0).classifier[1].out_features == 1000


@pytest.mark.parametrize("argv", [["list"], ["gpt2_tiny", "--seq-len", "8", "--format", "json", "--no-cache"]])
def test_output_dash_is_stdout(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               argv: list[str]) -> None:
    """``-o -`` wrote a file named ``-`` (and said "wrote -"): it is stdout, as for most commands."""
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "-o", "-"]) == 0
    out, err = capsys.readouterr()
    assert main(argv) == 0
    assert out == capsys.readouterr().out and out and err == ""
    assert list(tmp_path.iterdir()) == []
