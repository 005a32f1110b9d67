"""Analysing a model never changes it: after any analysis (fake, real or auto execution, with or without a backward
pass, also one that raised) everything reachable from the model's modules is exactly as before, and the model's
next call gives what it gave before.

The oracle is a walk of its own (:func:`reachable`), independent of the engine's snapshot: every attribute of
every module (parameters, buffers, submodules, hooks, flags and plain attributes) and everything inside lists,
tuples, dicts, sets and deques nested there, by path. Objects must be the very same (identity), tensors keep their
device, dtype, shape, strides, ``requires_grad``, ``.grad`` and values; no meta or fake stand-in, no value the run
made, may be left anywhere. The hostile modules below each keep something in a different place; the property
runs over them, over the built-in zoo and over the real-model families of the other tests.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from families import FAMILIES
from modelmeter import Args, FlopCountAnalysis, ModelRunError
from modelmeter.engine.inputs import split_inputs
from modelmeter.zoo import ZOO, get_model, input_shape

_ATOMS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


# --- the oracle: everything reachable, by path --------------------------------------------------------------------
class TensorState:
    """A tensor as found: the object itself, what describes it, and a copy of its values."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.kind = type(tensor)
        self.fake = isinstance(tensor, FakeTensor)
        self.facts = (tensor.device, tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.requires_grad)
        self.grad = tensor.grad if tensor.is_leaf else None
        self.values = None if tensor.is_meta or self.fake else tensor.detach().clone()

    def differences(self, now: torch.Tensor, path: str) -> list[str]:
        if now is not self.tensor:
            return [f"{path}: another tensor ({_short(now)} instead of {_short(self.tensor)})"]
        found = []
        if type(now) is not self.kind:
            found.append(f"{path}: became a {type(now).__name__}")
        facts = (now.device, now.dtype, tuple(now.shape), now.stride(), now.requires_grad)
        if facts != self.facts:
            found.append(f"{path}: {facts} instead of {self.facts}")
        if now.is_leaf and now.grad is not self.grad:
            found.append(f"{path}: .grad changed")
        if self.values is not None and not (facts == self.facts and torch.equal(self.values, now.detach())):
            found.append(f"{path}: values changed")
        return found


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__}{tuple(value.shape)} on {value.device}"
    return type(value).__name__


def reachable(model: nn.Module) -> dict[str, Any]:
    """Path -> what is there: a :class:`TensorState`, an atom's value, or the object itself (compared by identity,
    with its contents under longer paths)."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    pending: list[tuple[str, Any]] = [("model", model)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, torch.Tensor):
            found[path] = TensorState(value)
            continue
        if isinstance(value, _ATOMS):
            found[path] = ("atom", type(value), value)
            continue
        found[path] = ("object", type(value), value)
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, nn.Module):
            found[f"{path}.__class__"] = ("atom", type, type(value))
            children: list[tuple[str, Any]] = [(f"{path}.{k}", v) for k, v in vars(value).items()]
            children.append((f"{path}.training", value.training))  # a property on some wrappers
        elif isinstance(value, dict):
            children = [(f"{path}[{k!r}]", v) for k, v in value.items()]
            children += [(f"{path}.key{i}", k) for i, k in enumerate(value) if not isinstance(k, _ATOMS)]
        elif isinstance(value, (list, tuple, deque)):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, (set, frozenset)):
            children = [(f"{path}{{{i}}}", v) for i, v in enumerate(sorted(value, key=id))]
        else:
            continue
        pending += children
    return found


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Every way ``after`` differs from ``before``: paths gone or new, other objects, changed tensors."""
    found = [f"{path}: gone" for path in before.keys() - after.keys()]
    found += [f"{path}: new ({_short(_value(after[path]))})" for path in after.keys() - before.keys()]
    for path in before.keys() & after.keys():
        was, now = before[path], after[path]
        if isinstance(was, TensorState):
            found += was.differences(_value(now), path)
        elif was[0] == "atom":
            if now != was:
                found.append(f"{path}: {now[2]!r} instead of {was[2]!r}")
        elif _value(now) is not was[2]:
            found.append(f"{path}: another {_short(_value(now))}")
    return sorted(found)


def _value(entry: Any) -> Any:
    return entry.tensor if isinstance(entry, TensorState) else entry[2]


def stand_ins(model: nn.Module) -> list[str]:
    """Paths of meta or fake tensors reachable from a model that holds real tensors."""
    return sorted(path for path, entry in reachable(model).items()
                  if isinstance(entry, TensorState) and (entry.fake or entry.tensor.is_meta))


# --- running a model and comparing what it returns ------------------------------------------------------------------
def call(model: nn.Module, inputs: Any) -> list[torch.Tensor]:
    """The output tensors of one call (the RNG seeded: dropout draws the same masks every time)."""
    args, kwargs = split_inputs(inputs)
    torch.manual_seed(0)
    with torch.no_grad():
        return _tensors(model(*args, **kwargs))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def assert_same_outputs(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(got) == len(expected) > 0
    for want, have in zip(expected, got, strict=True):
        assert have.device == want.device and have.shape == want.shape and have.dtype == want.dtype
        if not want.is_meta:
            assert torch.equal(have, want)


EXECUTIONS = [("auto", False), ("fake", False), ("real", False), ("auto", True), ("fake", True), ("real", True)]


def analyse(model: nn.Module, inputs: Any, execution: str, backward: bool) -> FlopCountAnalysis | ModelRunError:
    """One analysis (computed at once); the error when the model raised."""
    analysis = FlopCountAnalysis(model, inputs, execution=execution, backward=backward)  # type: ignore[arg-type]
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    try:
        analysis.total()
    except ModelRunError as exc:
        return exc
    return analysis


def assert_unchanged(build: Callable[[], tuple[nn.Module, Any]], executions: list[tuple[str, bool]],
                     again: bool = False) -> None:
    """Each analysis leaves a fresh model exactly as it was, and its next call returns what a pristine copy's
    does; ``again``: the same once more after that call filled what the model keeps."""
    for execution, backward in executions:
        model, inputs = build()
        reference = copy.deepcopy(model)
        for _ in range(2 if again else 1):
            before = reachable(model)
            analyse(model, inputs, execution, backward)
            assert differences(before, reachable(model)) == [], (execution, backward)
            assert_same_outputs(call(reference, inputs), call(model, inputs))


# --- hostile modules: each keeps what it computes somewhere else ---------------------------------------------------
class AppendsToList(nn.Module):
    """Keeps every input and output in a list, and a running count as a tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.history: list[torch.Tensor] = []
        self.calls = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.history += [x, y]
        self.calls = self.calls + 1
        return y * self.calls


class CachesByDevice(nn.Module):
    """A bias table computed once per device, as timm's LeViT ``attention_bias_cache`` (keyed ``'meta'`` during a
    fake run); its value is kept on the model only when it is not training."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.randn(4))
        self.cache: dict[str, torch.Tensor] = {}

    def bias(self, device: torch.device) -> torch.Tensor:
        key = str(device)
        if key not in self.cache:
            self.cache[key] = self.table.detach() * 2
        return self.cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.bias(x.device)


class RegistersInForward(nn.Module):
    """Registers a buffer, a non-persistent buffer, a submodule, a parameter and a forward hook on its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "seen"):
            self.register_buffer("seen", x.new_ones(4))
            self.register_buffer("scratch", x.new_zeros(4), persistent=False)
            self.extra = nn.Linear(4, 4)
            self.gain = nn.Parameter(torch.ones(4))
            self.fc.register_forward_hook(lambda module, args, out: out * 2)
        return self.extra(self.fc(x)) * self.seen * self.gain + self.scratch


class KeepsNested(nn.Module):
    """Sets a tuple of tensors, stores tensors in nested dicts, lists, a set and a deque, flips a flag and a
    tensor's ``requires_grad`` inside a container, and replaces a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.store: dict[str, Any] = {"a": {"b": [torch.zeros(2)]}, "levels": (torch.ones(2), [])}
        self.members: set[Any] = set()
        self.window: deque[torch.Tensor] = deque(maxlen=3)
        self.register_buffer("scale", torch.ones(4))
        self.pair: tuple[torch.Tensor, ...] = ()
        self.flag = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.pair = (x, y)
        self.store["a"]["b"].append(y)
        self.store["a"]["c"] = {"deep": [y, {"deeper": x}]}
        self.store["levels"][1].append(y.sum())
        self.store["a"]["b"][0].requires_grad_(True)
        self.members.add(y)
        self.window.append(y)
        self.scale = self.scale * 2
        self.flag = True
        return y * self.scale


class Nonzero(nn.Module):
    """Moves its anchors to the input's device (a list replaced by another, as torchvision's ``AnchorGenerator``
    does), then needs real values (``nonzero``): the fake attempt fails and the real fallback must find the
    anchors as they were, on the CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.anchors = [torch.arange(4.0), torch.ones(4)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.anchors = [a.to(x.device) for a in self.anchors]
        y = self.fc(x) + self.anchors[0]
        picked = (y > 0).nonzero()
        return self.fc(y[picked[:, 0]]) + self.anchors[1]


class RaisesMidway(nn.Module):
    """Fills its caches, registers a buffer, then raises."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.cache: dict[str, Any] = {}
        self.steps: list[torch.Tensor] = []
        self.fail = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        self.cache[str(x.device)] = y
        self.steps.append(y)
        self.register_buffer("late", y.detach())
        self.fc.weight.requires_grad_(False)
        if self.fail:
            raise RuntimeError("broken model")
        return y


class BecomesAnother(nn.Module):
    """Changes its own class on the first call (as a lazy module does when it has inferred its shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.__class__ = Became
        return self.fc(x)


class Became(BecomesAnother):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 2


def _hostile(cls: type[nn.Module], train: bool = False) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return cls().train(train), torch.randn(3, 4)

    return build


class Helper(nn.Module):
    """Holds another model's submodule in a plain list (unregistered) and a cache inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.outside = [nn.Linear(4, 4)]  # a module the model keeps outside its submodules
        self.outside[0].memo = {}  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.outside[0]
        inner.memo["y"] = inner(x)  # type: ignore[index]
        inner.last = x
        return self.fc(x) + inner.memo["y"]  # type: ignore[index]


HOSTILE = {
    "appends_to_list": _hostile(AppendsToList),
    "caches_by_device": _hostile(CachesByDevice),
    "registers_in_forward": _hostile(RegistersInForward),
    "keeps_nested": _hostile(KeepsNested),
    "keeps_nested_training": _hostile(KeepsNested, train=True),
    "nonzero": _hostile(Nonzero),
    "becomes_another": _hostile(BecomesAnother),
    "unregistered_module": _hostile(Helper),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_modules_are_left_exactly_as_found(name: str) -> None:
    assert_unchanged(HOSTILE[name], EXECUTIONS, again=True)


def test_the_oracle_sees_what_a_forward_keeps() -> None:
    """The property above could not fail if the walk missed these: a plain call changes every one of them."""
    for name, build in HOSTILE.items():
        model, inputs = build()
        before = reachable(model)
        call(model, inputs)
        assert differences(before, reachable(model)) != [], name


def test_a_model_that_raises_midway_is_left_as_found() -> None:
    for execution, backward in EXECUTIONS:
        model = RaisesMidway()
        before = reachable(model)
        error = analyse(model, torch.randn(3, 4), execution, backward)
        assert isinstance(error, ModelRunError) and "broken model" in str(error)
        assert differences(before, reachable(model)) == [], (execution, backward)
    model.fail = False
    assert model(torch.randn(3, 4)).shape == (3, 4)
    assert model.steps[0].device.type == "cpu" and list(model.cache) == ["cpu"]


def test_the_real_fallback_starts_from_the_pristine_model() -> None:
    """The fake attempt replaced the anchors by meta tensors and failed at ``nonzero``; the real run must not
    find them there (a meta tensor cannot be copied to the CPU), and counts what a real run counts."""
    x = torch.randn(3, 4)
    model = Nonzero()
    auto = FlopCountAnalysis(model, x)
    real = FlopCountAnalysis(model, x, execution="real")
    assert auto.trace.execution == "real"
    assert any("needs real values" in note for note in auto.assumptions())
    assert auto.total() == real.total() > 3 * 16
    assert stand_ins(model) == []
    assert [a.device.type for a in model.anchors] == ["cpu", "cpu"]


# --- wrappers -------------------------------------------------------------------------------------------------------
class WithCompiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), backend="eager")
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_a_compiled_submodule_keeps_its_forward_and_still_runs() -> None:
    torch.manual_seed(0)
    model = WithCompiled()
    x = torch.randn(3, 4)
    expected = call(model, x)
    compiled_forward = vars(model.body)["forward"]
    for execution, backward in EXECUTIONS:
        before = reachable(model)
        analysis = analyse(model, x, execution, backward)
        assert isinstance(analysis, FlopCountAnalysis)
        assert analysis.by_module()["body._orig_mod.0"] == (2 if backward else 1) * 3 * 16  # + weight gradient
        assert differences(before, reachable(model)) == [], (execution, backward)
        assert vars(model.body)["forward"] is compiled_forward
    assert_same_outputs(expected, call(model, x))


def test_a_wrapper_with_a_forward_of_its_own_gets_it_back() -> None:
    """A DataParallel whose instance was given its own ``forward`` (a user's patch): put back, not deleted."""
    model = nn.DataParallel(nn.Linear(4, 4))
    patched = model.module.forward
    model.forward = patched  # type: ignore[method-assign]
    before = reachable(model)
    assert FlopCountAnalysis(model, torch.randn(3, 4)).total() == 3 * 16
    assert differences(before, reachable(model)) == []
    assert vars(model)["forward"] is patched


# --- the built-in zoo and the real-model families -------------------------------------------------------------------
# The fast set runs the small models once, forward and backward by default execution (meta stand-ins, or the model's
# own meta tensors); the slow set runs every model, and real kernels too where the model has values.
def _zoo_case(name: str) -> Any:
    return pytest.param(name, marks=[] if name.endswith("_tiny") else [pytest.mark.slow])


def _zoo(name: str) -> Callable[[], tuple[nn.Module, Any]]:
    def build() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = get_model(name).eval()
        device = next(model.parameters()).device
        if ZOO[name].input_dtype == torch.long:
            return model, torch.randint(0, 100, input_shape(name, resolution=16), device=device)
        resolution = None if name.startswith("vit") else 64  # a ViT's resolution is fixed when it is built
        return model, torch.randn(input_shape(name, resolution=resolution), device=device)

    return build


@pytest.mark.parametrize("name", [_zoo_case(name) for name in ZOO])
def test_zoo_models_are_left_exactly_as_found(name: str) -> None:
    executions = [("auto", True)]
    if not name.endswith("_tiny") and not ZOO[name].meta_default:
        executions.append(("real", False))
    assert_unchanged(_zoo(name), executions)


FAST_FAMILIES = {"layers", "reductions", "losses", "vit", "deit_tiny_patch16_224", "gpt2", "llama"}


def _family_case(package: str, name: str) -> Any:
    marks = [] if name in FAST_FAMILIES else [pytest.mark.slow]
    return pytest.param(package, name, id=f"{package}-{name}", marks=marks)


@pytest.mark.parametrize(("package", "name"),
                         [_family_case(p, n) for p, builders in FAMILIES.items() for n in builders])
def test_real_model_families_are_left_exactly_as_found(package: str, name: str) -> None:
    """In training mode (batch statistics, dropout) as the families come."""
    if package != "torch":
        pytest.importorskip(package)

    def build() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return FAMILIES[package][name]()

    assert_unchanged(build, [("auto", True)] if name in FAST_FAMILIES else [("auto", True), ("real", False)])


# --- the models of the issue ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fasterrcnn_by_default_counts_what_fvcore_and_a_real_run_count_and_is_left_as_found() -> None:
    """Detection needs real values (``nonzero`` in the box selection): the default run falls back to real kernels
    and must start from the pristine model, whose anchors the fake attempt had moved to the meta device."""
    torchvision = pytest.importorskip("torchvision")
    fvcore_nn = pytest.importorskip("fvcore.nn")
    logging.getLogger("fvcore").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(weights=None,
                                                                                weights_backbone=None).eval()
    images = [torch.randn(3, 160, 160)]
    reference = copy.deepcopy(model)
    before = reachable(model)
    ours = FlopCountAnalysis(model, (images,)).unsupported_ops_warnings(False)
    assert ours.total() == 2_893_363_200  # fvcore's count (1 per multiply-add), by its own run below
    assert ours.trace.execution == "real"
    assert differences(before, reachable(model)) == []
    real = FlopCountAnalysis(model, (images,), execution="real").unsupported_ops_warnings(False)
    assert dict(real.by_operator()) == dict(ours.by_operator())
    theirs = fvcore_nn.FlopCountAnalysis(model, (images,)).unsupported_ops_warnings(False)
    assert dict(theirs.by_operator()) == dict(ours.by_operator()) and theirs.total() == ours.total()
    assert_same_outputs(call(reference, (images,)), call(model, (images,)))


@pytest.mark.slow
@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_timm_levit_attention_bias_cache_is_left_empty(execution: str) -> None:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("levit_128s", pretrained=False, num_classes=10).eval()
    x = torch.randn(1, 3, 224, 224)
    before = reachable(model)
    FlopCountAnalysis(model, x, execution=execution).unsupported_ops_warnings(False).total()  # type: ignore[arg-type]
    assert differences(before, reachable(model)) == []
    caches = [m.attention_bias_cache for m in model.modules() if hasattr(m, "attention_bias_cache")]
    assert caches and all(cache == {} for cache in caches)


@pytest.mark.slow
def test_torchvision_raft_correlation_pyramid_is_left_as_found() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.optical_flow.raft_small(weights=None).eval()
    images = (torch.randn(1, 3, 128, 128), torch.randn(1, 3, 128, 128))  # the smallest the pyramid takes
    reference = copy.deepcopy(model)
    before = reachable(model)
    FlopCountAnalysis(model, Args(*images, num_flow_updates=2)).unsupported_ops_warnings(False).total()
    assert differences(before, reachable(model)) == []
    assert_same_outputs(call(reference, Args(*images, num_flow_updates=2)),
                        call(model, Args(*images, num_flow_updates=2)))


def test_an_inplace_update_of_batch_statistics_stays_on_the_stand_ins() -> None:
    """Training-mode batch norm updates its running statistics in place: under every execution the model's own
    buffers keep their values (the oracle compares values, not only objects)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).train()
    before = reachable(model)
    for execution, backward in EXECUTIONS:
        analyse(model, torch.randn(2, 3, 8, 8), execution, backward)
        assert differences(before, reachable(model)) == [], (execution, backward)
    assert int(model[1].num_batches_tracked) == 0
    assert F.relu(model[1].running_var - 1).sum() == 0
