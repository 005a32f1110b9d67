"""The in-process shared recording's key covers the user's code as the persistent cache's key does: the module-level
globals, helper functions, helper modules and class attributes that a model's code reads. Changed between two
analyses of the same call — rebound, mutated in place, a tensor changed in place — the second analysis records
anew and counts what a fresh recording counts; unchanged, it shares the first one's recording."""

from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from modelmeter import ActivationCountAnalysis, FlopCountAnalysis, RunSpec
from modelmeter.cache import cache_key
from modelmeter.cache.shared import SHARED, call_state

THIS = sys.modules[__name__]
SCALE = 2.0
REPEAT = {"times": 1}
OFFSET = torch.zeros(4)
HELPERS = types.ModuleType("modelmeter_test_helpers")  # a user module without a file, reached as an attribute


class Config:
    def __init__(self) -> None:
        self.extra = False

    def layers(self) -> int:
        return 1


CONFIG = Config()


def helper(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE


def another_helper(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE + x


class Reader(nn.Module):
    """A model whose run depends on globals of its module: each Linear(4, 4) on 3 rows is 48 multiply-adds."""

    LAYERS = 1

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(REPEAT["times"] * self.LAYERS * HELPERS.FACTOR * CONFIG.layers()):
            x = self.lin(x)
        if CONFIG.extra:
            x = self.lin(x)
        return helper(x) + OFFSET


LINEAR = 3 * 4 * 4


@pytest.fixture(autouse=True)
def fresh_globals(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts from the globals above (and no shared recording); what it changes is put back."""
    SHARED.clear()
    HELPERS.FACTOR = 1
    monkeypatch.setitem(REPEAT, "times", 1)
    monkeypatch.setattr(CONFIG, "extra", False)
    original = helper
    code = original.__code__
    yield
    original.__code__ = code
    OFFSET.zero_()
    SHARED.clear()


def _rebound(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(THIS, "REPEAT", {"times": 2})
    return 2 * LINEAR


def _mutated_dict(monkeypatch: pytest.MonkeyPatch) -> int:
    REPEAT["times"] = 3
    return 3 * LINEAR


def _mutated_object(monkeypatch: pytest.MonkeyPatch) -> int:
    CONFIG.extra = True
    return 2 * LINEAR


def _helper_module(monkeypatch: pytest.MonkeyPatch) -> int:
    HELPERS.FACTOR = 2
    return 2 * LINEAR


def _class_attribute(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(Reader, "LAYERS", 2)
    return 2 * LINEAR


def _helper_function(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(THIS, "helper", another_helper)  # one more operator, no more multiply-adds
    return LINEAR


def _method_of_a_global_object(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(Config, "layers", lambda self: 2)  # CONFIG's class: its code, as the persistent key's
    return 2 * LINEAR


def _helper_code(monkeypatch: pytest.MonkeyPatch) -> int:
    helper.__code__ = another_helper.__code__  # the same function object, other code
    return LINEAR


def _scale(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(THIS, "SCALE", 3.0)
    return LINEAR


def _tensor_in_place(monkeypatch: pytest.MonkeyPatch) -> int:
    OFFSET.add_(1)  # the same tensor, its version counter bumped
    return LINEAR


CHANGES: dict[str, Callable[[pytest.MonkeyPatch], int]] = {
    "rebound global": _rebound, "mutated global dict": _mutated_dict, "mutated global object": _mutated_object,
    "helper module attribute": _helper_module, "class attribute": _class_attribute,
    "method of a global object": _method_of_a_global_object,
    "helper function's code": _helper_code, "helper function rebound": _helper_function,
    "rebound global number": _scale, "global tensor in place": _tensor_in_place,
}


def _operators(analysis: FlopCountAnalysis) -> list[str]:
    return [event.op for event in analysis.trace.events]


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_global_records_again(change: str, recordings: list[RunSpec],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The oracle: a fresh recording after the change (the shared recordings cleared) counts the same."""
    model, x = Reader(), torch.randn(3, 4)
    flops = FlopCountAnalysis(model, x, convention="macs")
    assert flops.total() == LINEAR
    assert ActivationCountAnalysis(model, x).trace is flops.trace and len(recordings) == 1  # unchanged: shared
    expected = CHANGES[change](monkeypatch)
    again = FlopCountAnalysis(model, x, convention="macs")
    assert again.total() == expected and again.trace is not flops.trace and len(recordings) == 2
    SHARED.clear()
    fresh = FlopCountAnalysis(model, x, convention="macs")
    assert fresh.total() == expected and _operators(fresh) == _operators(again) and len(recordings) == 3


def test_changes_that_key_alike_share_again(recordings: list[RunSpec], monkeypatch: pytest.MonkeyPatch) -> None:
    """A global put back as it was, or rebound to an equal value, is the same state: shared again."""
    model, x = Reader(), torch.randn(3, 4)
    first = FlopCountAnalysis(model, x)
    first.total()
    REPEAT["times"] = 2
    FlopCountAnalysis(model, x).total()
    REPEAT["times"] = 1
    monkeypatch.setattr(THIS, "CONFIG", Config())  # another object: keyed by identity, so recorded anew
    FlopCountAnalysis(model, x).total()
    monkeypatch.setattr(THIS, "SCALE", float(SCALE))  # an equal float: the same state
    assert FlopCountAnalysis(model, x).total() == first.total() and len(recordings) == 3


def test_the_code_walk_is_the_persistent_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both keys walk the same code: what changes the persistent cache's key of this model changes the in-process
    key too (the in-process key by identity and version counter where the persistent one reads content)."""
    model, x = Reader(), torch.randn(3, 4)

    def keys() -> tuple[str, Any]:
        spec = RunSpec(model, (x,), {})
        state = call_state(spec)
        assert state is not None
        return cache_key(spec).digest, state[0]

    before = keys()
    for change in CHANGES.values():
        change(monkeypatch)
        after = keys()
        assert after[0] != before[0] and after[1] != before[1], change.__name__
        before = after


def test_a_run_that_changes_what_its_code_reads_is_not_shared(recordings: list[RunSpec]) -> None:
    """A forward hook appending to a list it holds changes the call's state each run: the next analysis cannot
    know the run does not read that list, so it records anew (as the persistent key would not hit)."""
    model, x = Reader(), torch.randn(3, 4)
    seen: list[int] = []
    model.register_forward_hook(lambda *_: seen.append(1))
    FlopCountAnalysis(model, x).total()
    ActivationCountAnalysis(model, x).total()
    assert len(recordings) == 2 and len(seen) == 2


@dataclasses.dataclass
class Output:
    """What :class:`Wrapped` returns: its class is code the model names, walked field by field (``Field`` objects
    have slots and no weak references, their ``metadata`` is a mapping proxy)."""

    logits: torch.Tensor
    scale: float = dataclasses.field(default=1.0, metadata={"unit": "none"})


class Slotted:
    __slots__ = ("repeat",)

    def __init__(self) -> None:
        self.repeat = 1


SLOTTED = Slotted()


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Output:
        for _ in range(SLOTTED.repeat):
            x = self.lin(x)
        return Output(x)


def test_dataclasses_and_slotted_objects_are_keyed_by_their_fields(recordings: list[RunSpec],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A model returning a dataclass of its own still shares its recording; a slotted global changed in place does
    not."""
    model, x = Wrapped(), torch.randn(3, 4)
    flops = FlopCountAnalysis(model, x, convention="macs")
    assert flops.total() == LINEAR and ActivationCountAnalysis(model, x).trace is flops.trace
    assert len(recordings) == 1
    monkeypatch.setattr(SLOTTED, "repeat", 2)
    assert FlopCountAnalysis(model, x, convention="macs").total() == 2 * LINEAR and len(recordings) == 2


def test_an_installed_class_keyed_by_identity_still_sees_its_forward_replaced(recordings: list[RunSpec],
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed classes are keyed by identity (once found installed through their MRO), their ``forward`` by
    identity too: replacing ``nn.Linear.forward`` in this process records anew, and counts the new forward."""
    model, x = Reader(), torch.randn(3, 4)
    assert FlopCountAnalysis(model, x, convention="macs").total() == LINEAR
    linear = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: linear(self, linear(self, x)))
    assert FlopCountAnalysis(model, x, convention="macs").total() == 2 * LINEAR and len(recordings) == 2


def test_the_installed_class_memo_keeps_no_class_alive() -> None:
    """A class made at run time that counts as installed (its module is torch's) is remembered as such while it
    lives, and freed with its last user."""
    import gc
    import weakref

    from modelmeter.cache.shared import _INSTALLED_CLASSES

    made = type("Made", (nn.Linear,), {"__module__": "torch.nn.modules.linear"})
    assert call_state(RunSpec(made(2, 2), (torch.randn(1, 2),), {})) is not None and made in _INSTALLED_CLASSES
    ref = weakref.ref(made)
    del made
    gc.collect()
    assert ref() is None
