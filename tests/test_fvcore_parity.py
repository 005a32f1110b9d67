"""A fvcore user switches by changing an import: the same calls on the same models give the same results.

Oracle: fvcore itself (skipped without it). Every public query of the analyses is compared exactly — values,
types, key names and order — over small models that exercise naming (shared and tied modules, a module called
twice, a module never called, nested containers, a module run through ``.forward()``), both ancestor modes and
user handles; the printed reports are compared character by character with tabulate keeping fvcore's indentation.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import modelmeter
from test_analysis import SharedModules  # fvcore's verified alias example

fvcore_nn = pytest.importorskip("fvcore.nn")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.bn(self.conv(x))).flatten(1))


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.fc(x))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Sequential(nn.Linear(10, 10), nn.ReLU()), nn.Linear(10, 10))
        self.ml = nn.ModuleList([nn.Linear(10, 10)])
        self.md = nn.ModuleDict({"x": nn.Linear(10, 10), "y": nn.LayerNorm(10), "never": nn.Linear(10, 3)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ml[0](self.seq(x))
        return self.md["y"](self.md["x"](x))


class ByForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub, self.other = nn.Sequential(nn.Linear(10, 10)), nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub.forward(x) + self.other(x)


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Sequential(nn.Sequential(nn.Linear(10, 10)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _cnn_eval() -> nn.Module:
    return CNN().eval()


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], Any]]] = {
    "mlp": (MLP, lambda: torch.randn(2, 10)),
    "cnn_eval": (_cnn_eval, lambda: (torch.randn(1, 3, 8, 8),)),
    "cnn_train": (CNN, lambda: (torch.randn(2, 3, 8, 8),)),
    "shared": (SharedModules, lambda: (torch.randn(1, 10),)),
    "twice": (Twice, lambda: (torch.randn(3, 10),)),
    "nested": (Nested, lambda: (torch.randn(2, 10),)),
    "by_forward": (ByForward, lambda: (torch.randn(2, 10),)),
    "wrapped": (Wrapped, lambda: (torch.randn(2, 10),)),
    "tied": (Tied, lambda: (torch.tensor([[1, 2, 3]]),)),
}


def built(name: str) -> tuple[nn.Module, Any]:
    """The model ``name`` of :data:`MODELS` and its inputs (the same weights every time)."""
    make, inputs = MODELS[name]
    torch.manual_seed(0)
    return make(), inputs()


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


def same(theirs: Any, ours: Any) -> None:
    """Equal values of the same type, dictionaries with their keys in the same order."""
    assert type(ours) is type(theirs)
    assert ours == theirs
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs)
        for key, value in theirs.items():
            same(value, ours[key])


def analyses(model: nn.Module, inputs: Any, mode: str, **handles: Any) -> tuple[Any, Any]:
    """(fvcore's, ours): FlopCountAnalysis of ``model`` in ancestor ``mode`` with ``handles`` set."""
    pair = []
    for lib in (fvcore_nn, modelmeter):
        analysis = lib.FlopCountAnalysis(model, inputs).ancestor_mode(mode)
        pair.append(analysis.set_op_handle(**handles) if handles else analysis)
    return pair[0], pair[1]


@pytest.mark.parametrize("mode", ["owner", "caller"])
@pytest.mark.parametrize("name", list(MODELS))
def test_queries_match_fvcore(name: str, mode: str) -> None:
    model, x = built(name)
    for cls in ("FlopCountAnalysis", "ActivationCountAnalysis"):
        theirs = getattr(fvcore_nn, cls)(model, x).ancestor_mode(mode)
        ours = getattr(modelmeter, cls)(model, x).ancestor_mode(mode)
        same(theirs.total(), ours.total())
        same(theirs.by_module(), ours.by_module())
        same(theirs.by_module_and_operator(), ours.by_module_and_operator())
        same(theirs.uncalled_modules(), ours.uncalled_modules())
        for module in dict(model.named_modules(remove_duplicate=False)):
            same(theirs.canonical_module_name(module), ours.canonical_module_name(module))
            same(theirs.total(module), ours.total(module))
            same(theirs.by_operator(module), ours.by_operator(module))


@pytest.fixture
def tabulate_keeping_whitespace() -> Iterator[None]:
    """fvcore's printers as they print with tabulate 0.9: indentation kept, an empty cell a text cell
    (tabulate 0.10 ignores ``PRESERVE_WHITESPACE`` and takes an empty cell for a missing number)."""
    tabulate = pytest.importorskip("tabulate")
    if "preserve_whitespace" not in tabulate.tabulate.__code__.co_varnames:
        pytest.skip("this tabulate has no preserve_whitespace keyword")
    table, cell_type = tabulate.tabulate, tabulate._type

    def keep_whitespace(*args: Any, **kwargs: Any) -> str:
        return table(*args, preserve_whitespace=tabulate.PRESERVE_WHITESPACE, **kwargs)

    def empty_is_text(value: Any, *args: Any, **kwargs: Any) -> Any:
        return str if value == "" else cell_type(value, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tabulate, "tabulate", keep_whitespace)
        patch.setattr(tabulate, "_type", empty_is_text)
        yield


@pytest.mark.usefixtures("tabulate_keeping_whitespace")
@pytest.mark.parametrize("mode", ["owner", "caller"])
@pytest.mark.parametrize("name", list(MODELS))
def test_printed_reports_match_fvcore(name: str, mode: str) -> None:
    model, x = built(name)
    per_lib = {}
    for lib in (fvcore_nn, modelmeter):
        per_lib[lib] = (lib.FlopCountAnalysis(model, x).ancestor_mode(mode),
                        lib.ActivationCountAnalysis(model, x).ancestor_mode(mode))
    (their_flops, their_acts), (our_flops, our_acts) = per_lib[fvcore_nn], per_lib[modelmeter]
    for depth in (1, 2, 3, 4):
        assert modelmeter.parameter_count_table(model, depth) == fvcore_nn.parameter_count_table(model, depth)
        for shapes in (True, False):
            for acts in (False, True):
                theirs = fvcore_nn.flop_count_table(their_flops, depth, their_acts if acts else None, shapes)
                assert modelmeter.flop_count_table(our_flops, depth, our_acts if acts else None, shapes) == theirs
    assert modelmeter.flop_count_str(our_flops) == fvcore_nn.flop_count_str(their_flops)
    assert modelmeter.flop_count_str(our_flops, our_acts) == fvcore_nn.flop_count_str(their_flops, their_acts)
    same(fvcore_nn.parameter_count(model), modelmeter.parameter_count(model))


# An operator that counted 0 ------------------------------------------------------------------------------
ZERO_CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "empty batch": (torch.randn(0, 10), {}),
    "handle returns 0": (torch.randn(2, 10), {"aten::linear": lambda inputs, outputs: 0}),
    "handle returns 0.0": (torch.randn(2, 10), {"aten::linear": lambda inputs, outputs: 0.0}),
    "Counter with a 0": (torch.randn(2, 10), {"aten::linear": lambda inputs, outputs: Counter(x=0, y=3)}),
}


@pytest.mark.parametrize("mode", ["owner", "caller"])
@pytest.mark.parametrize("case", list(ZERO_CASES))
def test_an_operator_that_counted_zero_is_not_named(case: str, mode: str) -> None:
    # fvcore adds counts with Counter addition, which keeps no zero: its results never name such an operator,
    # and a total of nothing but zeros is the integer 0
    x, handles = ZERO_CASES[case]
    model = MLP()
    theirs, ours = analyses(model, x, mode, **handles)
    same(theirs.total(), ours.total())
    same(theirs.total("fc1"), ours.total("fc1"))
    same(theirs.by_operator(), ours.by_operator())
    same(theirs.by_operator("fc2"), ours.by_operator("fc2"))
    same(theirs.by_module(), ours.by_module())
    same(theirs.by_module_and_operator(), ours.by_module_and_operator())
    their_flops, _ = fvcore_nn.flop_count(model, (x,), handles)
    our_flops, _ = modelmeter.flop_count(model, (x,), handles)
    same(their_flops, our_flops)


def test_an_operator_that_counted_zero_is_left_out_of_every_phase() -> None:
    model = MLP()
    flops = modelmeter.FlopCountAnalysis(model, torch.randn(0, 10), backward=True)
    assert all(ops == {} for ops in flops.by_phase_and_operator().values())
    assert flops.by_module_and_operator(phase="forward") == {name: Counter() for name in ("", "fc1", "act", "fc2")}
    assert flops.total() == 0 and type(flops.total()) is int


# Inputs --------------------------------------------------------------------------------------------------
class TakesDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 4)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(batch["pixels"])


def test_a_dict_meant_as_the_one_argument_is_answered_with_the_way_to_pass_it() -> None:
    # fvcore calls model(d) with a dict of inputs; here a dict holds keyword arguments, and the error says what
    # gives fvcore's call
    model, batch = TakesDict(), {"pixels": torch.randn(2, 10)}
    expected = fvcore_nn.FlopCountAnalysis(model, batch).total()
    with pytest.raises(TypeError, match=r"give it in a tuple: \(inputs,\)"):
        modelmeter.FlopCountAnalysis(model, batch).total()
    same(expected, modelmeter.FlopCountAnalysis(model, (batch,)).total())


# fvcore's own handles ------------------------------------------------------------------------------------
class Upsampled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(64, 8)
        self.up = nn.Upsample(scale_factor=2, mode="bicubic")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(self.up(self.conv(x)))
        return torch.bmm(self.fc(y.flatten(2)), y.flatten(2)[..., :8].transpose(1, 2)) @ torch.ones(4, 3)


def test_fvcore_tensor_handles_run_unchanged() -> None:
    # handles written against torch._C.Value (fvcore's own helpers read shapes with get_shape: isCompleteTensor,
    # type().sizes()) are set as they are and count what fvcore counts with them
    handles = fvcore_nn.jit_handles
    model, x = Upsampled(), (torch.randn(2, 3, 4, 4),)
    chosen = {
        "aten::upsample_bicubic2d": handles.elementwise_flop_counter(0, 1),
        "aten::sigmoid": handles.elementwise_flop_counter(1, 0),
        "aten::_convolution": handles.generic_activation_jit("conv"),
        "aten::linear": handles.linear_flop_jit,
        "aten::bmm": handles.bmm_flop_jit,
        "aten::matmul": handles.matmul_flop_jit,
    }
    theirs, ours = analyses(model, x, "owner", **chosen)
    same(theirs.by_module_and_operator(), ours.by_module_and_operator())
    assert set(ours.by_operator()) == {"upsample_bicubic2d", "sigmoid", "conv", "linear", "bmm", "matmul"}
