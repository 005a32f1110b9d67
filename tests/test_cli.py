"""The ``modelmeter`` command on built-in models."""

from __future__ import annotations

import subprocess
import sys

import pytest

from modelmeter.cli import main


def test_default_model_prints_fvcore_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("resnet50 on input 1x3x224x224 (fake run")
    model_row = next(line for line in out.splitlines() if line.startswith("model "))
    assert model_row.split()[1:] == ["25.557M", "4.112G", "11.115M"]  # params, flops, activations
    assert "aten::max_pool2d x1" in out


def test_zoo_model_with_input_and_depth(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpt2_tiny", "--input", "2x16", "--depth", "1"]) == 0
    out = capsys.readouterr().out
    assert "gpt2_tiny on input 2x16" in out
    assert "scaled_dot_product_attention" in out


def test_unknown_model_and_bad_shape_exit_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    assert "unknown model 'nope'; available: gpt2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["resnet18", "--input", "1xAx2"])
    assert "--input must look like 1x3x224x224" in capsys.readouterr().err


def test_python_dash_m_entry_point() -> None:
    done = subprocess.run([sys.executable, "-m", "modelmeter", "gpt2_tiny", "--depth", "0"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.startswith("gpt2_tiny on input 1x64")
