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
import torch.nn.functional as F
from torch import nn

import modelmeter
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
    # what meta kernels let through and the CPU's refuse (engine/kernel_checks.py): the same error in every execution
    ("transposed conv channels", lambda: nn.Sequential(nn.ConvTranspose2d(3, 8, 3)), torch.zeros(1, 5, 8, 8),
     "'0' (ConvTranspose2d)", "aten::conv_transpose2d",
     lambda m: f"expected {m[0].in_channels} input channels, got 5 (an input of shape 1x5x8x8)"),
    ("grouped transposed conv", lambda: nn.Sequential(nn.ConvTranspose1d(4, 6, 3, groups=2)), torch.zeros(2, 6, 8),
     "'0' (ConvTranspose1d)", "aten::conv_transpose1d",
     lambda m: f"expected {m[0].in_channels} input channels, got 6 (an input of shape 2x6x8)"),
    ("float64 into linear", lambda: nn.Sequential(nn.Linear(4, 3)), torch.zeros(2, 4, dtype=torch.float64),
     "'0' (Linear)", "aten::linear", lambda m: f"expected {str(m[0].weight.dtype)[6:]} inputs (the dtype of its "
                                               "weight), got float64"),
    ("int64 into linear", lambda: nn.Sequential(nn.Linear(4, 3, bias=False)), torch.zeros(2, 4, dtype=torch.long),
     "'0' (Linear)", "aten::linear", lambda m: "expected float32 inputs (the dtype of its weight), got int64"),
    ("float64 into conv", lambda: nn.Sequential(nn.Conv2d(3, 4, 3, bias=False)),
     torch.zeros(1, 3, 8, 8, dtype=torch.float64), "'0' (Conv2d)", "aten::conv2d",
     lambda m: "expected float32 inputs (the dtype of its weight), got float64"),
    ("float16 into transposed conv", lambda: nn.Sequential(nn.ConvTranspose2d(3, 4, 3)),
     torch.zeros(1, 3, 8, 8, dtype=torch.float16), "'0' (ConvTranspose2d)", "aten::conv_transpose2d",
     lambda m: "expected float32 inputs (the dtype of its weight), got float16"),
    ("float64 into batch norm", lambda: nn.Sequential(nn.BatchNorm1d(4)), torch.zeros(2, 4, dtype=torch.float64),
     "'0' (BatchNorm1d)", "aten::batch_norm",
     lambda m: "expected float32 inputs (the dtype of its parameters, or float16 or bfloat16), got float64"),
    ("float64 into layer norm", lambda: nn.Sequential(nn.LayerNorm(4)), torch.zeros(2, 4, dtype=torch.float64),
     "'0' (LayerNorm)", "aten::layer_norm",
     lambda m: "expected float32 inputs (the dtype of its parameters, or float16 or bfloat16), got float64"),
    ("float64 into group norm", lambda: nn.Sequential(nn.GroupNorm(2, 4)), torch.zeros(2, 4, 3, dtype=torch.float64),
     "'0' (GroupNorm)", "aten::group_norm",
     lambda m: "expected float32 inputs (the dtype of its parameters, or float16 or bfloat16), got float64"),
    ("integers into layer norm", lambda: nn.Sequential(nn.LayerNorm(4)), torch.zeros(2, 4, dtype=torch.long),
     "'0' (LayerNorm)", "aten::layer_norm", lambda m: "expected floating-point inputs, got int64"),
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


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_a_transposed_conv_counts_its_weight_the_other_way_round(execution: str) -> None:
    """Its weight is (in, out / groups, ...): the input channels are its first dimension. (PyTorch's meta kernel of
    a transposed convolution does not check them: the fake run does, as the CPU kernel would.)"""
    model = nn.Sequential(nn.ConvTranspose2d(3, 8, 3))
    error = _failure(model, torch.zeros(1, 5, 8, 8), execution)
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


def test_the_command_names_the_dtype_the_first_conv_wants(capsys: pytest.CaptureFixture[str]) -> None:
    """The command's model is built on meta: meta kernels let a float64 image into a float32 conv, the check
    does not."""
    from torchvision.models import resnet18

    with pytest.raises(RuntimeError):  # the oracle: the real model refuses it
        resnet18()(torch.zeros(1, 3, 64, 64, dtype=torch.float64))
    err = _one_line(capsys, ["resnet18", "--input", "1x3x64x64:float64"], 2)
    assert err == ("modelmeter: the model failed in module 'conv1' (Conv2d) at operator aten::conv2d: expected "
                   "float32 inputs (the dtype of its weight), got float64\n")


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
    (_call("aten::linear", _meta(2, 3, dtype="int32"), _meta(5, 3)),
     "expected float32 inputs (the dtype of its weight), got int32"),
    (_call("aten::layer_norm", _meta(2, 5, dtype="bfloat16"), [5], _meta(5), _meta(5), 1e-5, True),
     None),  # a reduced-precision input beside float32 parameters: the CPU's mixed-precision norm
    (_call("aten::layer_norm", _meta(2, 5, dtype="float16"), [5], _meta(5, dtype="bfloat16"), None, 1e-5, True),
     "expected bfloat16 inputs (the dtype of its parameters), got float16"),
    (_call("aten::batch_norm", _meta(2, 4, dtype="float64"), None, None, _meta(4), _meta(4), False, 0.1, 1e-5, True),
     "expected float32 inputs (the dtype of its parameters, or float16 or bfloat16), got float64"),
    (_call("aten::cross_entropy", _meta(4, 5), _meta(4, dtype="int32")),
     "expected a target of int64 class indices (or of class probabilities shaped as the 4x5 input), got int32 of "
     "shape 4"),
    (_call("aten::cross_entropy", _meta(4, 5), _meta(4, 5)), None),  # probabilities
    (_call("aten::nll_loss", _meta(4, 5), _meta(4, dtype="uint8")), None),
])
def test_each_rule_reads_what_its_call_fixes(event: OpEvent, expected: str | None) -> None:
    assert mismatch(event) == expected


# --- every wrong call the CPU refuses, the fake run refuses too ----------------------------------------------------
# Found by running wrong calls on the CPU and on meta tensors side by side: PyTorch's meta kernels (and the direct
# ones of engine/meta_kernels.py) check less than the CPU kernels they stand for. Each case below is refused by
# the CPU; a fake run must not count it. The arguments: shapes (float32), or (shape, dtype).
F64, F16, BF16, I64, I32 = torch.float64, torch.float16, torch.bfloat16, torch.long, torch.int32


def _t(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> tuple[tuple[int, ...], torch.dtype]:
    return shape, dtype


WRONG_CALLS: dict[str, tuple[Callable[..., Any], list[Any]]] = {
    # products of two dtypes
    "mm": (torch.mm, [_t((2, 3), F64), _t((3, 4))]),
    "mm of integers and floats": (torch.mm, [_t((2, 3), I64), _t((3, 4))]),
    "addmm's bias": (torch.addmm, [_t((4,), F64), _t((2, 3)), _t((3, 4))]),
    "matmul 3-d": (torch.matmul, [_t((2, 2, 3), F64), _t((3, 4))]),
    "mv": (torch.mv, [_t((2, 3), F64), _t((3,))]),
    "linear's bias": (F.linear, [_t((2, 3)), _t((4, 3)), _t((4,), F64)]),
    "cdist": (torch.cdist, [_t((4, 3), F64), _t((5, 3))]),
    "lstm cell": (lambda x, h, c, wi, wh: torch.lstm_cell(x, (h, c), wi, wh),
                  [_t((2, 3), F64), _t((2, 4)), _t((2, 4)), _t((16, 3)), _t((16, 4))]),
    # convolutions
    "conv of integers": (F.conv2d, [_t((1, 3, 8, 8), I64), _t((4, 3, 3, 3))]),
    "conv1d float64": (F.conv1d, [_t((1, 3, 8), F64), _t((4, 3, 3))]),
    "conv groups not dividing the outputs": (lambda x, w: F.conv2d(x, w, groups=2), [_t((1, 6, 8, 8)),
                                                                                     _t((3, 3, 3, 3))]),
    "conv bias size": (F.conv2d, [_t((1, 3, 8, 8)), _t((4, 3, 3, 3)), _t((5,))]),
    "transposed conv channels": (F.conv_transpose2d, [_t((1, 5, 8, 8)), _t((3, 4, 3, 3))]),
    "transposed conv3d channels": (F.conv_transpose3d, [_t((1, 5, 4, 4, 4)), _t((3, 4, 3, 3, 3))]),
    "transposed conv groups": (lambda x, w: F.conv_transpose2d(x, w, groups=2), [_t((1, 3, 8, 8)),
                                                                                 _t((3, 4, 3, 3))]),
    "transposed conv bias size": (F.conv_transpose2d, [_t((1, 3, 8, 8)), _t((3, 4, 3, 3)), _t((5,))]),
    "transposed conv output padding": (lambda x, w: F.conv_transpose2d(x, w, output_padding=1),
                                       [_t((1, 3, 8, 8)), _t((3, 4, 3, 3))]),
    # norms
    "batch norm float64": (lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b),
                           [_t((2, 4, 4), F64), _t((4,)), _t((4,)), _t((4,)), _t((4,))]),
    "batch norm training float64": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                                    [_t((2, 4, 4), F64), _t((4,)), _t((4,))]),
    "batch norm of integers": (lambda x, m, v: F.batch_norm(x, m, v), [_t((2, 4, 4), I64), _t((4,)), _t((4,))]),
    "batch norm weight size": (lambda x, w, m, v: F.batch_norm(x, m, v, w), [_t((2, 4, 4)), _t((3,)), _t((4,)),
                                                                              _t((4,))]),
    "batch norm float32 input, float16 weight": (lambda x, w, m, v: F.batch_norm(x, m, v, w),
                                                 [_t((2, 4, 4)), _t((4,), F16), _t((4,), F16), _t((4,), F16)]),
    "layer norm float64": (lambda x, w, b: F.layer_norm(x, (4,), w, b), [_t((2, 4), F64), _t((4,)), _t((4,))]),
    "layer norm weight shape": (lambda x, w: F.layer_norm(x, (4,), w), [_t((2, 4)), _t((5,))]),
    "layer norm bfloat16 weight": (lambda x, w: F.layer_norm(x, (4,), w), [_t((2, 4), F16), _t((4,), BF16)]),
    "group norm float64": (lambda x, w, b: F.group_norm(x, 2, w, b), [_t((2, 6, 5), F64), _t((6,)), _t((6,))]),
    "instance norm float64": (lambda x, w, b: F.instance_norm(x, weight=w, bias=b),
                              [_t((2, 4, 5), F64), _t((4,)), _t((4,))]),
    # losses, lookups, index updates
    "cross entropy of int32 classes": (F.cross_entropy, [_t((4, 5)), _t((4,), I32)]),
    "nll loss of float classes": (F.nll_loss, [_t((4, 5)), _t((4,))]),
    "binary cross entropy float64 target": (F.binary_cross_entropy, [_t((4, 5)), _t((4, 5), F64)]),
    "embedding bag weights": (lambda i, o, w, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p),
                              [_t((6,), I64), _t((2,), I64), _t((10, 4)), _t((6,), F64)]),
    "index_select float index": (lambda x, i: torch.index_select(x, 0, i), [_t((4, 3)), _t((2,))]),
    "index_add": (lambda x, i, s: x.index_add(0, i, s), [_t((4, 3)), _t((2,), I64), _t((2, 3), F64)]),
    "index_copy": (lambda x, i, s: x.index_copy(0, i, s), [_t((4, 3)), _t((2,), I64), _t((2, 3), F64)]),
    "index_put": (lambda x, i, v: x.index_put((i,), v), [_t((4, 3)), _t((2,), I64), _t((2, 3), F64)]),
    "grid sample": (lambda x, g: F.grid_sample(x, g, align_corners=False), [_t((1, 3, 4, 4)), _t((1, 2, 2, 2), F64)]),
    "polar": (torch.polar, [_t((3,)), _t((3,), F64)]),
    "attention mask float64": (lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m),
                               [_t((1, 2, 4, 8)), _t((4, 4), F64)]),
    "attention mask shape": (lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m),
                             [_t((1, 2, 4, 8)), _t((3, 4))]),
    # kernels written for floating-point tensors
    "softmax of integers": (lambda x: F.softmax(x, -1), [_t((4, 3), I64)]),
    "log_softmax of integers": (lambda x: F.log_softmax(x, -1), [_t((4, 3), I32)]),
    "gelu of integers": (F.gelu, [_t((4, 3), I64)]),
    "silu in place of integers": (lambda x: F.silu(x, inplace=True), [_t((4, 3), I64)]),
    "hardswish of integers": (F.hardswish, [_t((4, 3), I64)]),
    "softplus of integers": (F.softplus, [_t((4, 3), I64)]),
    "var of integers": (torch.var, [_t((4, 3), I64)]),
    "nearest upsampling of integers": (lambda x: F.interpolate(x, scale_factor=2), [_t((1, 3, 4, 4), I64)]),
    "bilinear upsampling of integers": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
                                        [_t((1, 3, 4, 4), I32)]),
    "area resampling of bytes": (lambda x: F.interpolate(x, size=3, mode="area"), [_t((1, 3, 4, 4), torch.uint8)]),
}

# The CPU's own rules: a model built on meta (or given meta inputs) may be meant for another device, whose kernels
# take these (CUDA's histc and norms take other dtypes), and is counted as given.
CPU_ONLY = {"batch norm float64", "batch norm training float64", "batch norm float32 input, float16 weight",
            "layer norm float64", "layer norm bfloat16 weight", "group norm float64", "instance norm float64",
            "nearest upsampling of integers", "bilinear upsampling of integers", "area resampling of bytes"}

# The same operators on arguments the CPU takes (mixed-precision norms, a boolean or float32 mask beside float16
# queries, bytes resampled, int32 indices, ...): the checks refuse none of them.
RIGHT_CALLS: dict[str, tuple[Callable[..., Any], list[Any]]] = {
    "mm": (torch.mm, [_t((2, 3), F64), _t((3, 4), F64)]),
    "linear": (F.linear, [_t((2, 3)), _t((4, 3)), _t((4,))]),
    "grouped conv": (lambda x, w: F.conv2d(x, w, groups=2), [_t((1, 6, 8, 8)), _t((4, 3, 3, 3))]),
    "grouped transposed conv": (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, output_padding=1, groups=2),
                                [_t((1, 4, 8, 8)), _t((4, 3, 3, 3)), _t((6,))]),
    "batch norm bfloat16 input, float32 parameters": (
        lambda x, w, b, m, v: F.batch_norm(x, m, v, w, b), [_t((2, 4, 4), BF16), _t((4,)), _t((4,)), _t((4,)),
                                                            _t((4,))]),
    "batch norm training": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                            [_t((2, 4, 4)), _t((4,)), _t((4,))]),
    "layer norm float16 input, float32 weight": (lambda x, w, b: F.layer_norm(x, (4,), w, b),
                                                 [_t((2, 4), F16), _t((4,)), _t((4,))]),
    "group norm": (lambda x, w, b: F.group_norm(x, 2, w, b), [_t((2, 6, 5)), _t((6,)), _t((6,))]),
    "nll loss": (F.nll_loss, [_t((4, 5)), _t((4,), I64)]),
    "cross entropy of probabilities": (F.cross_entropy, [_t((4, 5)), _t((4, 5))]),
    "index_select int32 index": (lambda x, i: torch.index_select(x, 0, i), [_t((4, 3)), _t((2,), I32)]),
    "index_add": (lambda x, i, s: x.index_add(0, i, s), [_t((4, 3)), _t((2,), I64), _t((2, 3))]),
    "attention float16 with a float32 mask": (lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m),
                                              [_t((1, 2, 4, 8), F16), _t((2, 1, 4))]),
    "attention with a boolean mask": (lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m),
                                      [_t((1, 2, 4, 8)), _t((4, 4), torch.bool)]),
    "softmax": (lambda x: F.softmax(x, -1), [_t((4, 3), F16)]),
    "gelu": (F.gelu, [_t((4, 3), BF16)]),
    "nearest upsampling of bytes": (lambda x: F.interpolate(x, scale_factor=2), [_t((1, 3, 4, 4), torch.uint8)]),
    "bilinear upsampling": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), [_t((1, 3, 4, 4))]),
}


class Call(nn.Module):
    """One functional call on the inputs, as a model."""

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__()
        self.function = function

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.function(*inputs)


def _tensors(specs: list[Any], device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Valid values: positive floats, zeros as indices and classes (in range), masks that keep everything."""
    return tuple(_tensor(shape, dtype).to(device) for shape, dtype in specs)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.rand(shape).to(dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("name", list(WRONG_CALLS))
def test_a_call_the_cpu_refuses_is_refused_by_a_fake_run_too(name: str) -> None:
    function, specs = WRONG_CALLS[name]
    with pytest.raises((RuntimeError, NotImplementedError)):  # the oracle: the CPU refuses it
        function(*_tensors(specs))
    real = _failure(Call(function), _tensors(specs), "real")
    runs = [("fake", "cpu"), ("auto", "cpu")]  # meta stand-ins, then FakeTensors on the CPU
    if name in CPU_ONLY:
        assert FlopCountAnalysis(Call(function), _tensors(specs, "meta")).trace.execution == "fake"
    else:
        runs.append(("auto", "meta"))  # meta inputs: meta kernels
    for execution, device in runs:
        error = _failure(Call(function), _tensors(specs, device), execution)
        assert type(error) is type(real), (execution, device, str(error))
        assert "\n" not in str(error) and "Traceback" not in str(error)
        if isinstance(real, InputMismatchError):
            assert str(error) == str(real)


@pytest.mark.parametrize("name", list(RIGHT_CALLS))
def test_the_same_operators_on_what_the_cpu_takes_are_counted_as_a_real_run(name: str) -> None:
    function, specs = RIGHT_CALLS[name]
    inputs = _tensors(specs)
    real = FlopCountAnalysis(Call(function), inputs, execution="real")  # type: ignore[arg-type]
    for execution, device in (("fake", "cpu"), ("fake", "meta")):
        analysis = FlopCountAnalysis(Call(function), _tensors(specs, device), execution=execution)  # type: ignore
        assert analysis.trace.execution == "fake"
        assert analysis.total() == real.total() and analysis.by_operator() == real.by_operator()


class Codebooks(nn.Module):
    """Token ids of three dimensions (batch, time, codebooks), as multi-codebook audio models take them, and a
    value read from a parameter: the fake run fails on the value, not on the ids, and the real kernels get past it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = int(self.embed.weight.abs().sum().item()) % 3 + 1
        return self.embed(ids).sum(-2)[:, :keep]


def test_ids_of_three_dimensions_that_a_model_takes_are_not_refused() -> None:
    """The token-ids guess (ids of more than (batch, seq) before a failure) is only a guess: the fallbacks still run."""
    model, ids = Codebooks(), torch.zeros(2, 5, 3, dtype=torch.long)
    analysis = modelmeter.analyze(model, ids, convention="flops", cache=False, quiet=True)
    real = modelmeter.analyze(model, ids, convention="flops", execution="real", cache=False, quiet=True)
    assert analysis.result().total("flops") == real.result().total("flops") > 0


class _Concat(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], 1)


@pytest.mark.parametrize("execution", ["fake", "auto"])
def test_a_rejected_input_prints_no_torch_traceback(execution: str, capfd: pytest.CaptureFixture[str]) -> None:
    # torch's FakeTensor logger printed the whole traceback (some 45 lines, at ERROR) of an operator that rejects its
    # inputs before the analysis raised its one-line error: the command silenced it, the Python API did not
    with pytest.raises(ModelRunError, match=r"_Concat\.forward at operator aten::cat"):
        modelmeter.analyze(_Concat(), (torch.randn(2, 3), torch.randn(3, 3)), execution=execution, cache=False,
                           quiet=True).flops.total()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "fake_tensor" not in err, err[:400]


def test_a_rejected_input_under_a_plan_prints_no_torch_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    # a plan's rank runs under the runner's own FakeTensorMode, which the engine's silencing did not cover
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(ModelRunError):
        modelmeter.analyze(model, torch.randn(2, 5), parallel="dp=2", cache=False, quiet=True).flops.total()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "fake_tensor" not in err, err[:400]
