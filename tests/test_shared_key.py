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


# The walk's fast path ----------------------------------------------------------------------------------------------
class Block(nn.Module):
    """A user module with plain attributes, a buffer of each kind and children of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.GELU()
        self.flag = 1
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x)) * self.flag


class OtherBlock(Block):
    pass


class Shadowed(nn.Module):
    """``training`` is a property of the class (the ``training`` its instances' ``__dict__`` also holds is not what
    the module reads): they cannot be read in one step."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = False

    @property  # type: ignore[override]
    def training(self) -> bool:
        return self.mode

    @training.setter
    def training(self, value: bool) -> None:
        self.__dict__["mode"] = self.__dict__["training"] = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _model() -> nn.Sequential:
    shared = nn.Linear(4, 4)
    return nn.Sequential(Block(), shared, nn.Sequential(shared, Block()), Shadowed())


def _flip_training(m: nn.Sequential) -> None:
    m[0].train(not m[0].training)


def _flag_types(m: nn.Sequential) -> None:
    m[0].flag = {int: True, bool: 1.0, float: 1}[type(m[0].flag)]  # equal values of other types: other states


def _extra_attribute(m: nn.Sequential) -> None:
    if "extra" in vars(m[2][1]):
        del m[2][1].extra
    else:
        m[2][1].extra = 3


def _internal_traded(m: nn.Sequential) -> None:
    """One of nn.Module's internals the key does not read traded for an attribute: as many keys as before."""
    block = vars(m[2][1])
    if "traded" in block:
        block["_state_dict_hooks"] = block.pop("traded")
    else:
        block["traded"] = block.pop("_state_dict_hooks")


def _walked_attribute(m: nn.Sequential) -> None:
    sizes = vars(m[0]).get("sizes")
    if sizes is None:
        m[0].sizes = [1, 2]
    elif len(sizes) < 3:
        sizes.append(3)  # in place: another state
    else:
        del m[0].sizes


HANDLES: dict[str, list[Any]] = {"pre": [], "kwargs": []}  # outside the model: a handle cannot be keyed
# What a change replaced, kept alive: a key names objects by identity, trusted while they live (the store drops an
# entry whose objects died), and a new object may take a dead one's id.
REPLACED: list[Any] = []


def _pre_hook(m: nn.Sequential) -> None:
    handles = HANDLES["pre"]
    if handles:
        handles.pop().remove()
    else:
        handles.append(m[1].register_forward_pre_hook(lambda module, args: None))


def _hook_with_kwargs(m: nn.Sequential) -> None:
    handles = HANDLES["kwargs"]
    if handles:
        handles.pop().remove()
    else:
        handles.append(m[0].act.register_forward_hook(lambda module, args, kwargs, out: None, with_kwargs=True,
                                                      always_call=True))


def _requires_grad(m: nn.Sequential) -> None:
    m[1].bias.requires_grad_(not m[1].bias.requires_grad)


def _in_place(m: nn.Sequential) -> None:
    with torch.no_grad():
        m[0].lin.weight.add_(0)  # the same values: the version counter says it changed


def _data_replaced(m: nn.Sequential) -> None:
    REPLACED.append(m[2][1].lin.weight.data)
    m[2][1].lin.weight.data = torch.zeros(4, 4)


def _buffer(m: nn.Sequential) -> None:
    m[2][1].steps.add_(1)


def _child_swapped(m: nn.Sequential) -> None:
    REPLACED.append(m[0].act)
    m[0].act = nn.GELU() if isinstance(m[0].act, nn.ReLU) else nn.ReLU()


def _child_emptied(m: nn.Sequential) -> None:
    if m[2][1].act is None:
        m[2][1].act = REPLACED.pop()
    else:
        REPLACED.append(m[2][1].act)
        m[2][1].register_module("act", None)


def _child_renamed(m: nn.Sequential) -> None:
    names = {"0": "first", "first": "0"}
    m[2]._modules = {names.get(name, name): child for name, child in m[2]._modules.items()}  # the same tree, a path


def _class_changed(m: nn.Sequential) -> None:
    m[2][1].__class__ = Block if type(m[2][1]) is OtherBlock else OtherBlock


def _shadowed_mode(m: nn.Sequential) -> None:
    m[3].mode = not m[3].mode


def _parameter_replaced(m: nn.Sequential) -> None:
    REPLACED.append(m[0].lin.bias)
    m[0].lin.bias = nn.Parameter(torch.zeros(4))


MUTATIONS: list[Callable[[nn.Sequential], None]] = [
    _flip_training, _flag_types, _extra_attribute, _internal_traded, _walked_attribute, _pre_hook, _hook_with_kwargs,
    _requires_grad, _in_place, _data_replaced, _buffer, _child_swapped, _child_emptied, _child_renamed,
    _class_changed, _shadowed_mode, _parameter_replaced,
]
TOGGLES = {_flip_training, _extra_attribute, _internal_traded, _pre_hook, _hook_with_kwargs, _requires_grad,
           _child_emptied, _child_renamed, _class_changed, _shadowed_mode}  # applied twice: the state as it was
CYCLES = {_flag_types, _walked_attribute}  # applied a few times: a state met before


def _keys(spec: RunSpec, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The call's key as :func:`call_state` makes it, and as it makes it with every module read part by part."""
    from modelmeter.cache import shared

    class Unread(shared._Layout):
        def __init__(self, kind: type, attributes: dict[str, Any]) -> None:
            super().__init__(kind, attributes)
            self.tables = shared._unreadable

    fast = call_state(spec)
    with monkeypatch.context() as m:
        m.setattr(shared, "_Layout", Unread)
        slow = call_state(spec)
    assert fast is not None and slow is not None
    return fast[0], slow[0]


@pytest.mark.parametrize("seed", range(6))
def test_the_fast_walk_decides_as_the_part_by_part_one(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random runs of changes of every kind a module's key covers: two states key alike through the one-step read
    of a module's ``__dict__`` exactly when they key alike read part by part (the walk before it); a change
    applied twice (a toggle) keys as before it, and a change that cannot come back keys as no state before it."""
    import random

    rng = random.Random(seed)
    model, x = _model(), torch.randn(2, 4)
    monkeypatch.setattr(THIS, "HANDLES", {"pre": [], "kwargs": []})
    monkeypatch.setattr(THIS, "REPLACED", [])
    spec = RunSpec(model, (x,), {})
    states = [_keys(spec, monkeypatch)]
    for _ in range(30):
        change = rng.choice(MUTATIONS)
        change(model)
        states.append(_keys(spec, monkeypatch))
        if change in TOGGLES:
            change(model)
            states.append(_keys(spec, monkeypatch))
            assert states[-1] == states[-3], change.__name__
        elif change not in CYCLES:
            assert all(states[-1][0] != before[0] for before in states[:-1]), change.__name__
    for i, (fast, slow) in enumerate(states):
        for other_fast, other_slow in states[:i]:
            assert (fast == other_fast) == (slow == other_slow)


def test_the_fast_walk_reads_most_modules_through_their_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the modules a layout cannot read are read part by part: those with hooks, or of a class that defines one
    of the names read (here one of each); a module with attributes other than plain values is read through it."""
    from modelmeter.cache.shared import _State

    model = _model()
    monkeypatch.setattr(THIS, "HANDLES", {"pre": [], "kwargs": []})
    _walked_attribute(model)
    _pre_hook(model)
    walked: list[type] = []
    part_by_part = _State.walked

    def spy(self: _State, module: nn.Module, klass: Any) -> Any:
        walked.append(type(module))
        return part_by_part(self, module, klass)

    monkeypatch.setattr(_State, "walked", spy)
    assert call_state(RunSpec(model, (torch.randn(2, 4),), {})) is not None
    assert sorted(kind.__name__ for kind in walked) == ["Linear", "Linear", "Shadowed"]  # (shared: 2 paths)


def test_an_entry_whose_objects_died_is_not_found() -> None:
    """A look-up reads only the entry it finds, and drops it (a miss) when an object its key names died: a new
    object may have taken that one's id."""
    import gc

    from modelmeter.cache.shared import SharedRecordings

    store = SharedRecordings()
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    state = call_state(RunSpec(model, (x,), {}))
    assert state is not None
    trace = FlopCountAnalysis(model, x).trace
    assert store.share(RunSpec(model, (x,), {}), lambda: trace).recorded and len(store) == 1
    assert not store.share(RunSpec(model, (x,), {}), lambda: trace).recorded  # found while they live
    del x
    gc.collect()
    assert store._find(state[0]) is None and len(store) == 0


def test_attributes_other_than_plain_values_are_keyed_by_content() -> None:
    """A module's list changed in place, a tuple's element of another type, an object's field: each another state
    (read through the layout, by :meth:`value`); equal contents in a new list: the same."""
    block = Block()
    block.sizes, block.pads, block.config = [1, 2], (1, 2), Config()
    spec = RunSpec(nn.Sequential(block), (torch.randn(2, 4),), {})

    def key() -> Any:
        state = call_state(spec)
        assert state is not None
        return state[0]

    keys = [key()]
    block.sizes.append(3)
    keys.append(key())
    block.pads = (1, 2.0)
    keys.append(key())
    block.config.extra = True
    keys.append(key())
    assert len(set(keys)) == len(keys)
    block.sizes = [1, 2, 3]
    assert key() == keys[-1]
