"""One home for PyTorch internals: ``modelmeter._torch_compat`` names every private torch API the package uses, and
what a run changes of torch is confined to the recording thread and put back afterwards."""

from __future__ import annotations

import ast
import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import modelmeter
from modelmeter import FlopCountAnalysis
from modelmeter._torch_compat import OpOverload, OpOverloadPacket, TorchDispatchMode
from modelmeter.engine.spec import RunSpec
from modelmeter.engine.tracer import record_trace
from modelmeter.errors import ModelRunError

PACKAGE = Path(modelmeter.__file__).parent
COMPAT = PACKAGE / "_torch_compat.py"
_PRIVATE_PATH = r"torch(\.\w+)*\._"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_private_attributes() -> frozenset[str]:
    """The private attribute names of the torch objects the package handles (modules, tensors, storages, operators,
    autograd Functions, modes): reading one of them off any object is reading torch's internals."""
    module = nn.Module()
    tensor = torch.zeros(1)
    objects: list[Any] = [module, tensor, tensor.untyped_storage(), torch.autograd.Function, torch.ops.aten.add,
                          torch.ops.aten.add.Tensor, OpOverload, OpOverloadPacket, TorchDispatchMode]
    names = {name for obj in objects for name in dir(obj)} | {name for obj in objects for name in vars(obj)}
    return frozenset(name for name in names if _private(name))


TORCH_PRIVATE_ATTRIBUTES = _torch_private_attributes()


class _Finder(ast.NodeVisitor):
    """The private torch APIs one module's source names."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self.torch_names: set[str] = set()  # local names bound to torch or one of its modules (torch, nn, F)

    def _note(self, node: ast.AST, what: str) -> None:
        self.found.append(f"line {getattr(node, 'lineno', '?')}: {what}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "torch":
                if any(map(_private, parts)):
                    self._note(node, f"import {alias.name}")
                self.torch_names.add(alias.asname or "torch")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        parts = (node.module or "").split(".")
        if node.level == 0 and parts[0] == "torch":
            if any(map(_private, parts)):
                self._note(node, f"from {node.module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    self._note(node, f"from {node.module} import {alias.name}")
                self.torch_names.add(alias.asname or alias.name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain = _chain(node)
        if chain and chain[0] in self.torch_names and chain[1:2] != ["ops"]:  # torch.ops.aten._to_copy: an operator
            if any(map(_private, chain[1:])):
                self._note(node, ".".join(chain))
        elif node.attr in TORCH_PRIVATE_ATTRIBUTES and not (isinstance(node.value, ast.Name)
                                                             and node.value.id in ("self", "cls")):
            self._note(node, f"attribute .{node.attr}")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and _is_private_torch_path(node.value):  # a logger, a module in sys.modules
            self._note(node, f"string {node.value!r}")

    def visit_Call(self, node: ast.Call) -> None:
        """``getattr(m, "_forward_hooks")``, ``itemgetter("_parameters")``: torch's private attributes by name; a
        frame's ``co_name in ("_call_impl", ...)``: a private method found on the stack."""
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name in _BY_NAME:
            for arg in node.args:
                if isinstance(arg, ast.Constant) and arg.value in TORCH_PRIVATE_ATTRIBUTES:
                    self._note(arg, f"{name}({arg.value!r})")
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for operand in node.comparators:
            values = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            for value in values:
                if isinstance(value, ast.Constant) and value.value in TORCH_PRIVATE_ATTRIBUTES:
                    self._note(value, f"compared with {value.value!r}")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for item in node.body:  # overriding a private hook of a torch base class
            if isinstance(item, ast.FunctionDef) and item.name in TORCH_PRIVATE_ATTRIBUTES:
                self._note(item, f"def {item.name}")
        self.generic_visit(node)


_BY_NAME = frozenset({"getattr", "hasattr", "setattr", "delattr", "attrgetter", "itemgetter"})


def _chain(node: ast.Attribute) -> list[str]:
    """``["torch", "_C", "_current_autograd_node"]`` for ``torch._C._current_autograd_node``; [] for a chain that
    does not start at a name."""
    parts: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    if not isinstance(current, ast.Name):
        return []
    return [current.id, *reversed(parts)]


def _is_private_torch_path(text: str) -> bool:
    parts = text.split(".")
    return len(parts) > 1 and parts[0] == "torch" and all(p.isidentifier() for p in parts) and any(map(_private, parts))


def private_torch_names(source: str) -> list[str]:
    finder = _Finder()
    finder.visit(ast.parse(source))
    return finder.found


def _modules() -> Iterator[Path]:
    yield from sorted(p for p in PACKAGE.rglob("*.py") if p != COMPAT)


def test_only_the_compat_module_names_private_torch_apis() -> None:
    found = {str(p.relative_to(PACKAGE)): names for p in _modules()
             if (names := private_torch_names(p.read_text(encoding="utf-8")))}
    assert found == {}, f"private torch APIs outside modelmeter/_torch_compat.py: {found}"


def test_the_compat_module_does_name_them() -> None:
    """The scan sees the compat module's own names (so the check above can fail)."""
    names = private_torch_names(COMPAT.read_text(encoding="utf-8"))
    for expected in ("from torch._subclasses.fake_tensor import ...", "torch._C._current_autograd_node",
                     "attribute ._schema", "attribute ._modules", "def _should_skip_dynamo",
                     "string 'torch._weights_only_unpickler'"):
        assert any(expected in n for n in names), expected


@pytest.mark.parametrize("source", [
    "from torch._subclasses.fake_tensor import FakeTensor",
    "from torch.utils import _pytree",
    "import torch._dynamo",
    "import torch\nnode = torch._C._current_autograd_node()",
    "import torch\nx = isinstance(f, torch._ops.OpOverload)",
    "from torch import nn\nnn.modules.module._global_forward_hooks",
    "def f(m):\n    return m._modules",
    "def f(op):\n    return op._schema.is_mutable",
    "def f(t):\n    return t._base",
    "def f(m):\n    return getattr(m, '_forward_hooks')",
    "import logging\nlogging.getLogger('torch._subclasses.fake_tensor')",
    "from operator import itemgetter\nheld = itemgetter('_parameters', '_buffers')",
    "def f(frame):\n    return frame.f_code.co_name in ('_call_impl', 'forward')",
    "class Mode:\n    def _should_skip_dynamo(cls):\n        return False",
])
def test_the_scan_finds_private_names(source: str) -> None:
    assert private_torch_names(source)


@pytest.mark.parametrize("source", [
    "import torch\nop = torch.ops.aten._to_copy.default",  # an operator, named by its schema
    "import torch\nv = torch.__version__",
    "import torch\ng = torch.Tensor.__getitem__",
    "class A:\n    def f(self):\n        return self._names",
    "from torch.utils.checkpoint import checkpoint",
    "VIEWS = frozenset({'_conj', '_neg_view'})",  # operator names (aten::_conj), not attributes
])
def test_the_scan_allows_public_names(source: str) -> None:
    assert private_torch_names(source) == []


# --- what a run changes ----------------------------------------------------------------------------------------------
def _global_state() -> dict[str, Any]:
    return {"get_rng_state": torch.get_rng_state, "apply": torch.autograd.Function.__dict__["apply"],
            "gc": gc.isenabled()}


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2


_SEEN: dict[str, Any] = {}  # what a forward saw (not in the model: a run puts the model's tables back)


class _OtherThread(nn.Module):
    """Its forward keeps an RNG state and applies a custom Function on the recording thread, and has another thread
    do the same: that thread must see torch as it is, and nothing it does is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = _SEEN["mine"] = torch.get_rng_state()
        y = _Double.apply(self.linear(x))

        def elsewhere() -> None:
            _SEEN["state"] = torch.get_rng_state()
            _SEEN["applied"] = _Double.apply(torch.ones(3))

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        return y + state[:1].float().sum() * 0


def _record(model: nn.Module, x: torch.Tensor, execution: str = "real") -> Any:
    return record_trace(RunSpec.of(model, x, execution=execution))  # type: ignore[arg-type]


def test_a_run_puts_torch_back_and_touches_no_other_thread() -> None:
    before = _global_state()
    trace = _record(_OtherThread(), torch.randn(2, 4))
    assert _global_state() == before
    # the other thread got torch's own results: the generator's state, the Function's output
    assert torch.equal(_SEEN["state"], _SEEN["mine"])
    assert torch.equal(_SEEN["applied"], torch.full((3,), 2.0))
    # recorded on the recording thread only: one Function call, one RNG state (5056 bytes: the CPU generator's)
    assert [e.op for e in trace.events if e.op.startswith("prim::PythonOp")] == ["prim::PythonOp._Double"]
    states = [s for s in trace.storages if s.kind == "other"]
    assert [(s.nbytes, s.dtype) for s in states] == [(torch.get_rng_state().numel(), "uint8")]


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _Double.apply(x)
        raise RuntimeError("boom")


def test_a_failing_run_puts_torch_back() -> None:
    before = _global_state()
    with pytest.raises(ModelRunError, match="boom"):
        _record(_Fails(), torch.randn(2))
    assert _global_state() == before


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def test_the_rng_state_an_activation_checkpoint_keeps_is_recorded() -> None:
    """The one reason ``torch.get_rng_state`` is observed: a non-reentrant checkpoint keeps the CPU generator's state
    (a tensor no mode sees) until the backward pass replays the block."""
    model = _Checkpointed().train()
    x = torch.randn(2, 8, requires_grad=True)
    trace = record_trace(RunSpec.of(model, x, execution="fake", backward=True))
    states = [s for s in trace.storages if s.kind == "other" and s.dtype == "uint8"]
    assert [s.nbytes for s in states] == [torch.get_rng_state().numel()]
    assert states[0].born >= 0 and states[0].died > states[0].born  # dropped once the backward pass replayed


def test_flex_attention_flag_is_put_back() -> None:
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    seen: list[bool] = []

    class Reads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG)
            return x * 2

    _record(Reads(), torch.randn(2))
    assert seen == [True] and flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is False


def test_the_garbage_collector_is_paused_while_recording_only() -> None:
    seen: list[bool] = []

    class Reads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(gc.isenabled())
            return x * 2

    assert gc.isenabled()
    _record(Reads(), torch.randn(2))
    assert seen == [False] and gc.isenabled()
    FlopCountAnalysis(Reads(), torch.randn(2)).total()
    assert gc.isenabled()


@pytest.fixture
def collections_started() -> Iterator[list[int]]:
    """The generations of the collections that start while the test runs."""
    started: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(note)
    try:
        yield started
    finally:
        gc.callbacks.remove(note)


def _layers(count: int) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(count))).eval()


def test_a_public_call_pauses_the_collector_once_for_all_its_steps(collections_started: list[int]) -> None:
    # fvcore's pair: two keys, a recording, two countings and a table, each step making thousands of objects (each
    # paused on its own, each would meet a collection as it ends); one collection as the call returns is all
    x = torch.randn(1, 4)
    modelmeter.analyze(_layers(2), x, cache=False, quiet=True).result()  # the first run's imports are collected
    model = _layers(100)
    flops = FlopCountAnalysis(model, x).unsupported_ops_warnings(False)
    activations = modelmeter.ActivationCountAnalysis(model, x)
    gc.collect()
    collections_started.clear()
    modelmeter.flop_count_table(flops, activations=activations)
    assert len(collections_started) <= 1 and gc.isenabled()  # (of any generation: gen 0's may be due)
    analysis = modelmeter.analyze(_layers(100), x, cache=False, quiet=True)
    collections_started.clear()
    analysis.result()
    assert len(collections_started) <= 1 and gc.isenabled()  # (of any generation: gen 0's may be due)


def test_a_public_call_that_raises_leaves_the_collector_as_it_found_it() -> None:
    with pytest.raises(ModelRunError):
        modelmeter.analyze(_layers(2), torch.randn(1, 5), cache=False, quiet=True)
    assert gc.isenabled()
    gc.disable()
    try:
        modelmeter.analyze(_layers(2), torch.randn(1, 4), cache=False, quiet=True).result()
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()
