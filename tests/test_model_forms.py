"""Models in unusual forms: what their forward takes and returns (dataclasses, generators, outputs without a
floating-point tensor), beside the forms that already counted right (fx GraphModules, torch.export's unlifted
module, functional_call, vmap, shared and tied modules, ModuleDict/ParameterList, user hooks).

Oracles: hand arithmetic of the linear layers (``tokens * in * out`` multiply-adds forward; the weight's gradient
and, where the input requires grad, the input's, the same again backward), torch's ``FlopCounterMode`` (its two
flops per multiply-add halved) on the eager model, and the same model given its tensors in a plain tuple.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from modelmeter import InvalidValueError, UnsupportedError, analyze, parameter_count
from modelmeter.cli import main

TOKENS, IN, OUT = 2, 8, 4
MACS = TOKENS * IN * OUT  # one Linear(IN, OUT) on TOKENS rows


def products(model: nn.Module, *args: Any) -> int:
    """``FlopCounterMode``'s multiply-adds of the eager model (two flops each)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(*args)
    return int(counter.get_total_flops()) // 2


def state_of(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    return [(name, t.detach().clone(), t.requires_grad) for name, t in model.state_dict(keep_vars=True).items()]


def assert_same_state(model: nn.Module, before: list[tuple[str, torch.Tensor, bool]]) -> None:
    after = state_of(model)
    assert [(n, g) for n, _, g in after] == [(n, g) for n, _, g in before]
    assert all(torch.equal(a, b) for (_, a, _), (_, b, _) in zip(after, before, strict=True))
    assert all(p.grad is None for p in model.parameters())


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor
    scale: float = 1.0


@dataclasses.dataclass
class Pair:
    logits: torch.Tensor
    doubled: torch.Tensor


class PairTuple(NamedTuple):
    logits: torch.Tensor
    doubled: torch.Tensor


class _TakesBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT)

    def forward(self, batch: Any) -> torch.Tensor:
        x = batch if isinstance(batch, torch.Tensor) else batch.x
        return self.proj(x) * 1.0


class _ReturnsPair(nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        y = self.proj(x)
        return self.kind(y, y * 2)


@dataclasses.dataclass
class _Node:
    x: torch.Tensor
    parent: _Node | None = None
    cache: list[Any] = dataclasses.field(default_factory=list)


class _TakesNode(nn.Module):
    """Its forward checks the node's cache is the caller's list (``cache``, when given) and a node referring to
    itself still does."""

    def __init__(self, cache: list[Any] | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT)
        self.cache = cache

    def forward(self, node: _Node) -> torch.Tensor:
        if self.cache is not None and node.cache is not self.cache:
            raise ValueError("the node's cache is not the caller's list")
        if node.parent is not None and node.parent.x is not node.x:
            raise ValueError("the node no longer refers to itself")
        return self.proj(node.x)


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_a_dataclass_referring_to_itself_is_an_input(execution: str) -> None:
    node = _Node(torch.randn(TOKENS, IN))
    node.parent = node
    analysis = analyze(_TakesNode(), (node,), execution=execution, memory=True, quiet=True)
    assert analysis.flops.total() == MACS  # was a RecursionError
    assert analysis.memory.peak_info().by_kind["input"] == TOKENS * IN * 4


def test_a_dataclass_inputs_field_without_tensors_is_the_callers_object() -> None:
    node = _Node(torch.randn(TOKENS, IN))
    for execution in ("fake", "real"):  # the list was rebuilt: the forward raised
        assert analyze(_TakesNode(node.cache), (node,), execution=execution, quiet=True).flops.total() == MACS


# --- dataclasses: what pytree leaves whole ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", [Pair, PairTuple])
def test_a_dataclass_output_feeds_the_default_loss(kind: type) -> None:
    # The default loss sums the output's floating-point tensors: those of a dataclass too (it was taken for an
    # output without any, and the backward pass was empty: "nothing requires grad")
    model = _ReturnsPair(kind)
    analysis = analyze(model, torch.randn(TOKENS, IN), backward=True, convention="macs", quiet=True)
    assert analysis.flops.by_phase() == {"forward": MACS, "backward": MACS}  # the weight's gradient
    assert not any("backward pass is empty" in a for a in analysis.flops.assumptions())


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
@pytest.mark.parametrize("wrap", [Batch, FrozenBatch])
def test_a_dataclass_input_is_cut_from_the_callers_graph_as_a_tensor_is(execution: str, wrap: type) -> None:
    # A tensor made by the caller's own graph is cut from it at the model's input: the backward pass neither runs
    # into the caller's layer (its work is not the model's) nor leaves a gradient on it. In a dataclass it was
    # passed on as it was: the caller's layer's backward was counted and its weight got a gradient.
    caller = nn.Linear(IN, IN)
    model = _TakesBatch()
    before = state_of(model)
    plain = analyze(model, (caller(torch.randn(TOKENS, IN)),), backward=True, execution=execution,
                    convention="macs", memory=True, quiet=True)
    batch = wrap(caller(torch.randn(TOKENS, IN)))
    given = batch.x
    wrapped = analyze(model, (batch,), backward=True, execution=execution, convention="macs", memory=True,
                      quiet=True)
    # forward, then the weight's gradient and the input's
    assert wrapped.flops.by_phase() == plain.flops.by_phase() == {"forward": MACS, "backward": 2 * MACS}
    assert wrapped.memory.peak() == plain.memory.peak()
    assert wrapped.memory.peak_info().by_kind == plain.memory.peak_info().by_kind
    assert caller.weight.grad is None and caller.bias.grad is None
    assert batch.x is given and batch.scale == 1.0  # the caller's dataclass is left as it was
    assert_same_state(model, before)


def test_a_dataclass_input_counts_its_tensor_as_an_input() -> None:
    model = _TakesBatch()
    x = torch.randn(TOKENS, IN)
    plain = analyze(model, (x,), memory=True, quiet=True)
    wrapped = analyze(model, (Batch(x),), memory=True, quiet=True)
    assert wrapped.flops.total() == plain.flops.total() == products(model, x) == MACS
    assert wrapped.memory.peak() == plain.memory.peak()  # the input's bytes were missing from the peak
    assert wrapped.trace.inputs == plain.trace.inputs


# --- outputs that ran nothing, or hold nothing to differentiate -------------------------------------------------
class _Generates(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> Iterator[torch.Tensor]:
        for _ in range(2):
            yield self.proj(x)


class _Awaits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT)

    async def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


@pytest.mark.parametrize("model_class", [_Generates, _Awaits])
@pytest.mark.parametrize("options", [{}, {"backward": True}, {"memory": True}])
def test_a_forward_that_returns_a_generator_or_coroutine_is_refused(model_class: type,
                                                                     options: dict[str, Any]) -> None:
    # Its body runs only as it is consumed: the run recorded nothing, and counted 0 FLOPs without a word
    model = model_class()
    before = state_of(model)
    with pytest.raises(UnsupportedError, match=f"{model_class.__name__}.forward returned an object of type "
                                               r"(generator|coroutine).*none of it ran"):
        analyze(model, torch.randn(TOKENS, IN), quiet=True, **options)
    assert_same_state(model, before)


class _Argmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).argmax(-1)


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _ReturnsObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> _Holder:
        return _Holder(self.proj(x))


@pytest.mark.parametrize("model_class", [_Argmax, _ReturnsObject])
def test_a_backward_pass_without_a_floating_point_output_is_refused(model_class: type) -> None:
    # The default loss found nothing to sum and the step was counted with an empty backward pass, "because no
    # parameter or input requires grad" (they did)
    model = model_class()
    with pytest.raises(UnsupportedError, match=rf"output \({'Tensor' if model_class is _Argmax else '_Holder'}\) "
                                               "holds no floating-point tensor for the default loss.*loss_fn"):
        analyze(model, torch.randn(TOKENS, IN), backward=True, quiet=True)


def test_an_object_output_is_differentiated_through_the_loss_fn_given() -> None:
    model = _ReturnsObject()
    counted = analyze(model, torch.randn(TOKENS, IN), backward=True, convention="macs", quiet=True,
                      loss_fn=lambda out: out.t.sum())
    assert counted.flops.by_phase() == {"forward": MACS, "backward": MACS}


# --- objects of other classes: what the run cannot replace (a key-value cache) ----------------------------------
class _Keys:
    """An object holding tensors, passed to the model (as transformers' ``DynamicCache`` is)."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys


class _Attends(nn.Module):
    """One query row's scores over cached keys: ``TOKENS x IN`` by ``IN x cached``."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(IN, IN)

    def forward(self, x: torch.Tensor, cache: Any) -> torch.Tensor:
        keys = cache.keys if isinstance(cache, _Keys) else cache[0]
        return self.query(x) @ keys.T


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_the_tensors_of_an_object_passed_in_are_inputs_of_the_step(execution: str) -> None:
    # The cache's bytes are live for the whole step, as an argument's are: they were missing from the peak
    cached = 64
    x, keys = torch.randn(TOKENS, IN), torch.randn(cached, IN)
    model = _Attends()
    in_object = analyze(model, (x, _Keys(keys)), memory=True, execution=execution, convention="macs", quiet=True)
    in_list = analyze(model, (x, [keys]), memory=True, execution=execution, convention="macs", quiet=True)
    assert in_object.flops.total() == in_list.flops.total() == TOKENS * IN * IN + TOKENS * IN * cached
    assert in_object.memory.peak_info().by_kind["input"] == (x.numel() + keys.numel()) * 4
    assert in_object.memory.peak() == in_list.memory.peak()


@pytest.mark.parametrize("execution", ["auto", "real"])
def test_a_backward_pass_refuses_an_object_holding_a_tensor_of_the_callers_graph(execution: str) -> None:
    # The run cannot cut it from the caller's graph (it is no argument it replaces): the backward pass ran on into
    # the caller's layer, counted its work and left a gradient on its weight
    caller, model = nn.Linear(IN, IN), _Attends()
    before = state_of(model)
    cache = _Keys(caller(torch.randn(16, IN)))
    with pytest.raises(InvalidValueError, match=r"an object passed to the model \(_Keys\) holds a tensor made by "
                                                r"your autograd graph \(grad_fn AddmmBackward0\).*\.detach\(\)"):
        analyze(model, (torch.randn(TOKENS, IN), cache), backward=True, execution=execution, quiet=True)
    assert caller.weight.grad is None
    assert_same_state(model, before)
    detached = analyze(model, (torch.randn(TOKENS, IN), _Keys(cache.keys.detach())), backward=True,
                       execution=execution, convention="macs", quiet=True)
    # forward: the query and the scores; backward: the query's weight, and the query output's gradient
    assert detached.flops.by_phase() == {"forward": TOKENS * IN * IN + TOKENS * IN * 16,
                                         "backward": TOKENS * IN * IN + TOKENS * 16 * IN}


def test_a_leaf_held_by_an_object_passed_in_gets_its_gradient_and_keeps_its_own() -> None:
    model, keys = _Attends(), torch.randn(16, IN, requires_grad=True)
    keys.grad = torch.ones_like(keys)
    analysis = analyze(model, (torch.randn(TOKENS, IN), _Keys(keys)), backward=True, convention="macs", quiet=True)
    # the keys' gradient too: scores' gradient (TOKENS x 16) by the query output (TOKENS x IN)
    assert analysis.flops.by_phase()["backward"] == TOKENS * IN * IN + 2 * TOKENS * 16 * IN
    assert torch.equal(keys.grad, torch.ones_like(keys))


# --- the command -------------------------------------------------------------------------------------------------
_FACTORIES = '''
import torch
from torch import nn


def exported():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    return torch.export.export(model, (torch.randn(2, 8),)).module()


def generates():
    class Generates(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, x):
            yield self.proj(x)

    return Generates()
'''


def test_the_command_analyses_an_exported_programs_module(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # torch.export's module refuses eval() (its graph fixed the mode): the command stopped on torch's traceback
    (tmp_path / "forms.py").write_text(_FACTORIES)
    assert main([f"{tmp_path / 'forms.py'}:exported", "--input", "2x8", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    model = report["modules"][0]
    assert model["name"] == "" and model["metrics"]["flops"] == 2 * 8 * 4  # one Linear(8, 4) on 2 rows
    assert any("cannot be put in eval mode" in note for note in report["assumptions"])


def test_the_command_refuses_a_forward_that_returns_a_generator(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "forms.py").write_text(_FACTORIES)
    assert main([f"{tmp_path / 'forms.py'}:generates", "--input", "2x8"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err == ("modelmeter: Generates.forward returned an object of type generator, whose body runs only as it is "
                   "iterated or awaited: none of it ran. Analyse a module whose forward iterates or awaits it\n")


# --- transforms inside forward --------------------------------------------------------------------------------
class _Hessian(nn.Module):
    """``torch.func.hessian`` of a squared linear form: its forward-mode pass runs torch's primitives
    (``prims::add``, ``prims::mul``) beside aten's operators."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.hessian(lambda y: self.proj(y).pow(2).sum())(x[0])


@pytest.mark.parametrize("convention", ["fvcore", "macs", "flops"])
def test_the_element_wise_primitives_of_a_hessian_are_element_wise_operators(convention: str) -> None:
    # They were reported as unsupported operators, and the "flops" convention left their work out
    analysis = analyze(_Hessian(), torch.randn(3, IN), convention=convention, quiet=True)
    assert not analysis.flops.unsupported_ops()
    without = analysis.flops.copy().set_op_handle("prims::add", None, "prims::mul", None)
    # one flop per output element: two adds of IN x 1 (x 1) gradients, one product of a 1 x 1 one
    assert analysis.flops.total() - without.total() == (2 * IN + 1 if convention == "flops" else 0)


# --- sparse tensors: what they store ----------------------------------------------------------------------------
class _SparseWeight(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.weight, x.T)


class _SparseInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(IN, OUT))

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(a, self.weight)


def _stored_bytes(sparse: torch.Tensor) -> int:
    """Its values' and indices' bytes, by hand: COO keeps nnz values and a 2 x nnz int64 index."""
    nnz = sparse.coalesce().values().numel()
    return nnz * sparse.element_size() + 2 * nnz * 8


@pytest.mark.parametrize("execution", ["auto", "real"])
def test_a_sparse_parameter_or_input_counts_what_it_stores(execution: str) -> None:
    # Its bytes were left out of memory (a sparse tensor has no storage of its own: its values and indices have),
    # and a fake run's copy stores nothing: it runs real kernels, as a quantized tensor does
    weight = (torch.randn(64, IN) * (torch.rand(64, IN) < 0.3)).to_sparse()
    model = _SparseWeight(weight)
    analysis = analyze(model, torch.randn(TOKENS, IN), memory=True, execution=execution, quiet=True)
    assert analysis.memory.peak_info().by_kind["parameter"] == _stored_bytes(weight)
    assert analysis.trace.execution == "real"
    assert any("sparse tensors ('weight', held by the model)" in a for a in analysis.assumptions()) \
        == (execution == "auto")
    a = torch.randn(TOKENS, IN).relu().to_sparse()
    given = analyze(_SparseInput(), a, memory=True, execution=execution, quiet=True)
    assert given.memory.peak_info().by_kind["input"] == _stored_bytes(a)


def test_a_fake_run_of_a_sparse_tensor_is_refused_by_name() -> None:
    model = _SparseWeight(torch.eye(IN).to_sparse())
    with pytest.raises(InvalidValueError, match=r"sparse tensors \('weight', held by the model\) need real kernels"):
        analyze(model, torch.randn(TOKENS, IN), execution="fake", quiet=True)
    with pytest.raises(InvalidValueError, match=r"sparse tensors \(inputs\[0\]\) need real kernels"):
        analyze(_SparseInput(), torch.eye(IN).to_sparse(), execution="fake", quiet=True)


@dataclasses.dataclass
class _SparseBatch:
    a: torch.Tensor


class _SparseHolder:
    def __init__(self, a: torch.Tensor) -> None:
        self.a = a


class _SparseInField(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(IN, OUT))

    def forward(self, given: Any) -> torch.Tensor:
        return torch.sparse.mm(given.a, self.weight)


@pytest.mark.parametrize("wrap", [_SparseBatch, _SparseHolder], ids=["dataclass", "object"])
def test_a_sparse_tensor_in_a_dataclass_or_object_passed_in_runs_real_kernels(wrap: type) -> None:
    # an object's tensor was no argument and a dataclass's field no leaf: a fake run, whose copy stores nothing
    a = torch.randn(TOKENS, IN).relu().to_sparse()
    analysis = analyze(_SparseInField(), (wrap(a),), memory=True, quiet=True)
    assert analysis.trace.execution == "real"
    assert analysis.memory.peak_info().by_kind["input"] == _stored_bytes(a)
    with pytest.raises(InvalidValueError, match=r"sparse tensors \(.*\) need real kernels"):
        analyze(_SparseInField(), (wrap(a),), execution="fake", quiet=True)


def test_a_numpy_array_in_a_dataclass_field_is_the_models_to_read() -> None:
    # the walk into fields that finds a sparse tensor there leaves the refusal of a numpy argument to arguments
    np = pytest.importorskip("numpy")
    batch = Batch(torch.randn(TOKENS, IN), np.float64(2.0))
    assert analyze(_TakesBatch(), (batch,), quiet=True).flops.total() == MACS


# --- module trees -------------------------------------------------------------------------------------------------
class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, IN)

    def forward(self, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
        return self.proj(x) if inner else self.loop(x)


class _Loop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(IN, IN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.back(self.proj(x), inner=True)


def test_a_cycle_of_submodules_is_refused_by_path() -> None:
    # It runs (each call takes another branch), but every walk of its tree went round it: a RecursionError from
    # deep inside the shared store's walk
    outer, loop = _Outer(), _Loop()
    outer.loop = loop
    loop.back = outer
    assert outer(torch.randn(TOKENS, IN)).shape == (TOKENS, IN)
    weights = [p.detach().clone() for p in outer.parameters()]
    for options in ({}, {"backward": True, "memory": True}):
        with pytest.raises(InvalidValueError, match=r"module 'loop.back' is 'the model' again, which contains it: "
                                                    r"a cycle of submodules \(_Outer\)"):
            analyze(outer, torch.randn(TOKENS, IN), quiet=True, **options)
    with pytest.raises(InvalidValueError, match="a cycle of submodules"):
        parameter_count(outer)
    assert all(torch.equal(a, b) for a, b in zip(outer.parameters(), weights, strict=True))


def test_a_module_shared_by_two_parents_is_no_cycle() -> None:
    shared = nn.Linear(IN, IN)
    model = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared, nn.ReLU()))
    analysis = analyze(model, torch.randn(TOKENS, IN), convention="macs", quiet=True)
    assert analysis.flops.total() == products(model, torch.randn(TOKENS, IN)) == 2 * TOKENS * IN * IN
