"""A wrong input is one line that names the module and operator where the model failed and what it expected there.

The expectation is read from the failing call's parameters (a convolution's weight, a linear layer's, a norm's),
never from a list of models. Oracles: the module's own public attributes (``in_channels``, ``in_features``,
``num_features``), and a real run of the same model, which must fail too (the input really does not fit). The
library raises :class:`InputMismatchError` (a :class:`ModelRunError`) from torch's error; the command exits 2.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter import FlopCountAnalysis, InputMismatchError, ModelRunError
from modelmeter.cli import main
from modelmeter.engine.expectations import mismatch
from modelmeter.engine.trace import OpEvent, TensorMeta


class Tokens(nn.Module):
    """A language model in miniature: ids (batch, seq) -> embeddings -> a reshape that needs (batch, seq)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 8)
        self.head = nn.Linear(8, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, seq = ids.shape[:2]
        hidden = self.embed(ids)
        return self.head(hidden.view(batch, seq, 8))


class GroupedConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _small_cnn() -> nn.Module:
    """A CNN whose classifier fixes the resolution: 3x16x16 images only."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 16 * 16, 10))


# (name, model, input, module named in the error, operator, the expectation as the module's attributes say it)
CASES: list[tuple[str, Callable[[], nn.Module], torch.Tensor, str, str, Callable[[nn.Module], str]]] = [
    ("conv channels", lambda: nn.Sequential(nn.Conv2d(3, 8, 3)), torch.zeros(1, 1, 8, 8), "'0' (Conv2d)",
     "aten::conv2d", lambda m: f"expected {m[0].in_channels} input channels, got 1 (an input of shape 1x1x8x8)"),
    ("grouped conv", GroupedConv, torch.zeros(1, 2, 8, 8), "'body.0' (Conv2d)", "aten::conv2d",
     lambda m: f"expected {m.body[0].in_channels} input channels, got 2"),
    ("conv rank", lambda: nn.Sequential(nn.Conv2d(3, 8, 3)), torch.zeros(1, 224), "'0' (Conv2d)", "aten::conv2d",
     lambda m: "expected a 4-d input (batch, channels, H, W) or a 3-d one without the batch, got shape 1x224"),
    ("conv1d rank", lambda: nn.Sequential(nn.Conv1d(3, 8, 3)), torch.zeros(1, 3, 8, 8, 8), "'0' (Conv1d)",
     "aten::conv1d", lambda m: "expected a 3-d input (batch, channels, L) or a 2-d one without the batch"),
    ("linear features", _small_cnn, torch.zeros(1, 3, 8, 8), "'2' (Linear)", "aten::linear",
     lambda m: f"expected last dimension {m[2].in_features} (the in_features of its 10x1024 weight), got 256 "
               "(an input of shape 1x256)"),
    ("float token ids", Tokens, torch.zeros(2, 5), "'embed' (Embedding)", "aten::embedding",
     lambda m: "expected integer token ids of shape (batch, seq), got float32 of shape 2x5"),
    ("layer norm", lambda: nn.Sequential(nn.LayerNorm(6)), torch.zeros(2, 5), "'0' (LayerNorm)", "aten::layer_norm",
     lambda m: f"expected an input whose last dimensions are {m[0].normalized_shape[0]}, got shape 2x5"),
    ("batch norm", lambda: nn.Sequential(nn.BatchNorm2d(4)), torch.zeros(2, 3, 5, 5), "'0' (BatchNorm2d)",
     "aten::batch_norm", lambda m: f"expected {m[0].num_features} channels in dimension 1, got an input of shape "
                                   "2x3x5x5"),
]


def _failure(model: nn.Module, x: Any, execution: str) -> ModelRunError:
    with pytest.raises(ModelRunError) as caught:
        FlopCountAnalysis(model, x, execution=execution).total()  # type: ignore[arg-type]
    return caught.value


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
@pytest.mark.parametrize(("name", "build", "x", "module", "op", "expected"), CASES, ids=[c[0] for c in CASES])
def test_a_wrong_input_says_what_the_module_expected(name: str, build: Callable[[], nn.Module], x: torch.Tensor,
                                                     module: str, op: str, expected: Callable[[nn.Module], str],
                                                     execution: str) -> None:
    model = build().eval()
    with pytest.raises(RuntimeError):  # the oracle: the input really does not fit
        model(x)
    error = _failure(model, x, execution)
    assert isinstance(error, InputMismatchError)
    assert str(error).startswith(f"the model failed in module {module} at operator {op}: {expected(model)}")
    assert "\n" not in str(error) and "Traceback" not in str(error)
    assert isinstance(error.__cause__, RuntimeError) and not isinstance(error.__cause__, ModelRunError)
    assert error.operator == op and error.module == re.match(r"'([^']*)'", module).group(1)  # type: ignore[union-attr]


def test_a_model_on_meta_says_the_same() -> None:
    """The command's models are built on the meta device: the same error, from meta kernels."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3)).to("meta")
    error = _failure(model, torch.zeros(1, 1, 8, 8, device="meta"), "auto")
    assert isinstance(error, InputMismatchError)
    assert "at operator aten::conv2d: expected 3 input channels, got 1" in str(error)


def test_a_transposed_conv_counts_its_weight_the_other_way_round() -> None:
    """Its weight is (in, out / groups, ...): the input channels are its first dimension. (Run on real kernels: the
    meta kernel of a transposed convolution does not check the channels.)"""
    model = nn.Sequential(nn.ConvTranspose2d(3, 8, 3))
    error = _failure(model, torch.zeros(1, 5, 8, 8), "real")
    assert isinstance(error, InputMismatchError)
    assert f"aten::conv_transpose2d: expected {model[0].in_channels} input channels, got 5" in str(error)


def test_token_ids_of_more_than_two_dimensions_are_named_where_they_entered() -> None:
    """An image given to a language model: the embedding takes any shape, the model fails later; the error names
    the lookup the ids entered by, and what it expected."""
    model = Tokens()
    ids = torch.zeros(1, 3, 4, 4, dtype=torch.long)
    with pytest.raises(RuntimeError):
        model(ids)
    for execution in ("auto", "real"):
        error = _failure(model, ids, execution)
        assert isinstance(error, InputMismatchError)
        assert str(error) == ("the model failed in Tokens.forward at operator aten::view: the input of module 'embed' "
                              "(Embedding) at operator aten::embedding does not fit it: expected integer token ids "
                              "of shape (batch, seq), got int64 of shape 1x3x4x4")


class NotTheInput(nn.Module):
    """Fails on its own: a constant whose shape does not fit, an input that does."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.fc(x), torch.ones(5, 5))


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise ValueError("not today")


@pytest.mark.parametrize(("model", "x", "words"), [
    (NotTheInput(), torch.zeros(2, 4), "at operator aten::matmul: RuntimeError:"),
    (Raises(), torch.zeros(2, 3, 3, dtype=torch.long), "ValueError: not today"),
])
def test_other_failures_are_not_taken_for_a_wrong_input(model: nn.Module, x: torch.Tensor, words: str) -> None:
    error = _failure(model, x, "auto")
    assert type(error) is ModelRunError and words in str(error)


# --- the command: exit 2, one line -------------------------------------------------------------------------------
def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], code: int) -> str:
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == code, err
    assert out == "" and err.startswith("modelmeter: ") and err.count("\n") == 1
    return err


def test_the_command_names_the_first_conv_and_its_channels(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line(capsys, ["resnet18", "--input", "1x1x64x64"], 2)
    assert err == ("modelmeter: the model failed in module 'conv1' (Conv2d) at operator aten::conv2d: expected 3 "
                   "input channels, got 1 (an input of shape 1x1x64x64)\n")
    err = _one_line(capsys, ["resnet18", "--input", "1x224"], 2)
    assert "module 'conv1' (Conv2d) at operator aten::conv2d: expected a 4-d input" in err


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "expected"), [
    ("1x16:float32", "module 'model.embed_tokens' (Embedding) at operator aten::embedding: expected integer token "
                     "ids of shape (batch, seq), got float32 of shape 1x16\n"),
    ("1x3x32x32", "the input of module 'model.embed_tokens' (Embedding) at operator aten::embedding does not fit "
                  "it: expected integer token ids of shape (batch, seq), got int64 of shape 1x3x32x32\n"),
])
def test_a_language_model_says_it_wants_token_ids(capsys: pytest.CaptureFixture[str], shape: str,
                                                  expected: str) -> None:
    err = _one_line(capsys, ["transformers:LlamaConfig", "num_hidden_layers=1", "hidden_size=64",
                             "intermediate_size=128", "num_attention_heads=4", "num_key_value_heads=4",
                             "--input", shape], 2)
    assert err.endswith(expected), err


def test_too_few_inputs_say_what_forward_takes(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    path = tmp_path / "two.py"
    path.write_text("import torch\n\nclass Two(torch.nn.Module):\n    def forward(self, x, y):\n"
                    "        return x + y\n\ndef build():\n    return Two()\n")
    err = _one_line(capsys, [f"{path}:build", "--input", "2x4"], 2)
    assert "Two.forward(x, y): missing a required argument: 'y'" in err


# --- the rules, on recorded calls written by hand ----------------------------------------------------------------
def _meta(*shape: int, dtype: str = "float32") -> TensorMeta:
    return TensorMeta(tuple(shape), dtype, "cpu")


def _call(op: str, *inputs: Any) -> OpEvent:
    return OpEvent(op, "function", -1, 0, "forward", list(inputs), [])


@pytest.mark.parametrize(("event", "expected"), [
    (_call("aten::convolution", _meta(1, 4, 8, 8), _meta(4, 6, 3, 3), None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1),
     None),  # transposed: 4 input channels, the weight's first dimension
    (_call("aten::convolution", _meta(1, 4, 8, 8), _meta(6, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0],
           2), None),  # 2 channels per group x 2 groups
    (_call("aten::convolution", _meta(1, 3, 8, 8), _meta(6, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0],
           2), "expected 4 input channels, got 3 (an input of shape 1x3x8x8)"),
    (_call("aten::conv2d", _meta(3, 8, 8), _meta(6, 3, 3, 3), None, [1, 1], [0, 0], [1, 1], 1), None),  # unbatched
    (_call("aten::conv2d", _meta(1, 3, 8, 8, dtype="float64"), _meta(6, 3, 3, 3), None, [1, 1], [0, 0], [1, 1], 1),
     "expected float32 inputs (the dtype of its weight), got float64"),
    (_call("aten::group_norm", _meta(2, 6, 5), 2, _meta(4), _meta(4), 1e-5, True),
     "expected 4 channels in dimension 1, got an input of shape 2x6x5"),
    (_call("aten::group_norm", _meta(2, 6, 5), 2, None, None, 1e-5, True), None),  # no weight: nothing to read
    (_call("aten::instance_norm", _meta(2, 4, 5), _meta(4), _meta(4), None, None, True, 0.1, 1e-5, True), None),
    (_call("aten::layer_norm", _meta(5), [2, 5], None, None, 1e-5, True),
     "expected an input whose last dimensions are 2x5, got shape 5"),
    (_call("aten::linear", _meta(2, 3), _meta(5, 3), None), None),
    (_call("aten::embedding", _meta(10, 4), _meta(2, 3, dtype="int32"), -1, False, False), None),
    (_call("aten::linear", _meta(2, 3)), None),  # a call recorded without its weight: nothing to say
    (_call("aten::matmul", _meta(2, 3), _meta(4, 5)), None),  # no parameters: no rule
])
def test_each_rule_reads_what_its_call_fixes(event: OpEvent, expected: str | None) -> None:
    assert mismatch(event) == expected
