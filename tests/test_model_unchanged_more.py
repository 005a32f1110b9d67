"""Analysing a model leaves the process as it found it, beyond the model's own tables (test_model_unchanged.py):
the random number generators a model's ``forward`` draws from (dropout, ``torch.randn``), and the caller's modes
(autocast, the default dtype, grad mode) change no number.

Oracles: torch's own generator state compared before and after (and the next random numbers drawn); for modes,
the numbers of the same analysis outside the mode, and of real kernels against the fake run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parameter import is_lazy

from modelmeter import Args, FlopCountAnalysis, analyze
from modelmeter.engine.snapshot import ModelSnapshot

EXECUTIONS = [("auto", False), ("fake", False), ("real", False), ("auto", True), ("fake", True), ("real", True)]


class DrawsRandomNumbers(nn.Module):
    """Dropout in training mode, and noise drawn on the CPU's default generator whatever the input's device."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x)) + torch.randn(4).to(x.device)


@pytest.mark.parametrize(("execution", "backward"), EXECUTIONS)
def test_the_random_number_generator_is_left_where_it_was(execution: str, backward: bool) -> None:
    model, x = DrawsRandomNumbers().train(), torch.randn(3, 4)
    torch.manual_seed(7)
    expected = torch.rand(5)  # what the caller's next draw gives had nothing run in between
    torch.manual_seed(7)
    before = torch.get_rng_state()
    FlopCountAnalysis(model, x, execution=execution, backward=backward).total()  # type: ignore[arg-type]
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(torch.rand(5), expected)


def test_the_generator_is_put_back_when_the_model_raises() -> None:
    class DrawsThenRaises(DrawsRandomNumbers):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            super().forward(x)
            raise RuntimeError("broken after drawing")

    model, x = DrawsThenRaises().train(), torch.randn(3, 4)
    before = torch.get_rng_state()
    with pytest.raises(Exception, match="broken after drawing"):
        FlopCountAnalysis(model, x, execution="real").total()
    assert torch.equal(torch.get_rng_state(), before)


# --- the caller's autocast: every execution runs what real kernels run -----------------------------------------------
def _mixed_numbers(model: nn.Module, x: torch.Tensor, execution: str, backward: bool) -> dict[str, Any]:
    a = analyze(model, x, execution=execution, backward=backward, memory=True, quiet=True)  # type: ignore[arg-type]
    assert a.memory is not None
    return {"flops": a.flops.by_module_and_operator(), "phases": a.flops.by_phase(),
            "activations": a.activations.by_module_and_operator(), "dtypes": a.memory.by_dtype(),
            "peak": a.memory.peak(), "saved": a.memory.saved_for_backward()}


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_the_callers_cpu_autocast_every_execution_counts_what_real_kernels_run(dtype: torch.dtype,
                                                                                    backward: bool) -> None:
    """The default run of a CPU model used meta stand-ins, which autocast does not cast: its products ran in
    float32 while real kernels ran them in ``dtype`` (other activation bytes, another peak)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 10), nn.GELU())
    x = torch.randn(2, 3, 8, 8)
    plain = _mixed_numbers(model, x, "auto", backward)
    with torch.autocast("cpu", dtype=dtype):
        real = _mixed_numbers(model, x, "real", backward)
        assert real["dtypes"][str(dtype).removeprefix("torch.")] > 0  # the oracle: torch's autocast cast them
        assert real["flops"] == plain["flops"] and real["dtypes"] != plain["dtypes"]
        for execution in ("auto", "fake"):
            assert _mixed_numbers(model, x, execution, backward) == real, execution


# --- lazy modules: their parameters are the model's to initialise --------------------------------------------------
@pytest.mark.parametrize(("execution", "backward"), EXECUTIONS)
@pytest.mark.parametrize("options", [{}, {"cache": True}, {"parallel": "dp=2"}], ids=["plain", "cache", "parallel"])
def test_a_lazy_module_not_yet_called_is_refused_clearly_and_left_lazy(execution: str, backward: bool,
                                                                       options: dict[str, Any],
                                                                       tmp_path: Any) -> None:
    """A lazy module infers its parameters' shapes on its first call, changing their class and the module's: an
    analysis must not be that call. It raised torch's ``Attempted to use an uninitialized parameter in <method
    'is_inference'...>`` from deep inside the cache's walk; now a ValueError that says what to do."""
    if options.get("cache"):
        options = {"cache_dir": tmp_path}
    model, x = nn.Sequential(nn.Linear(5, 5), nn.LazyLinear(4), nn.ReLU(), nn.LazyBatchNorm1d()), torch.randn(3, 5)
    weight = model[1].weight
    with pytest.raises(ValueError, match=r"not initialised yet \(1\.weight, 1\.bias, 3\.weight.*call the model once"):
        analyze(model, x, execution=execution, backward=backward, quiet=True, **options)  # type: ignore[arg-type]
    assert type(model[1]) is nn.LazyLinear and model[1].weight is weight and is_lazy(weight)
    if execution == "real" and "parallel" in options:
        return  # a plan's ranks run on FakeTensors only
    model(x)  # initialised by the user: analysed as any model
    flops = analyze(model, x, execution=execution, backward=backward, quiet=True, **options).flops  # type: ignore[arg-type]
    assert flops.by_module()["1"] == (3 if backward else 1) * 3 * 5 * 4  # backward: input and weight gradients


# --- the caller's inputs: a model that updates them in place updates copies -----------------------------------------
class UpdatesItsInputs(nn.Module):
    """Updates its input, a view of it passed beside it and a tensor in a dict in place (and makes that one require
    grad); ``needs_values``: then selects by value (``nonzero``), so ``auto`` falls back to real kernels."""

    def __init__(self, needs_values: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.needs_values = needs_values

    def forward(self, x: torch.Tensor, row: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        x.mul_(2)
        row.add_(1)
        state["count"].add_(1)
        state["count"].requires_grad_(True)
        y = self.fc(x) + row
        return y[(y > 0).nonzero()[:, 0]] if self.needs_values else y


@pytest.mark.parametrize(("execution", "backward"), EXECUTIONS)
@pytest.mark.parametrize("needs_values", [False, True], ids=["any", "needs_values"])
def test_inputs_updated_in_place_by_the_model_keep_their_values(execution: str, backward: bool,
                                                                needs_values: bool) -> None:
    """Real kernels ran on the caller's own input tensors, so ``x.mul_(2)`` in ``forward`` doubled the caller's
    ``x`` (and ``auto`` falls back to them for a model that needs values)."""
    if needs_values and execution == "fake":
        pytest.skip("a model that needs values has no fake run")
    x = torch.randn(3, 4)
    state = {"count": torch.zeros(())}
    inputs = Args(x, x[0], {"count": state["count"]})
    expected = x.clone()
    flops = FlopCountAnalysis(UpdatesItsInputs(needs_values), inputs, execution=execution,  # type: ignore[arg-type]
                              backward=backward)
    assert flops.by_module()["fc"] == (2 if backward else 1) * 3 * 16
    assert torch.equal(x, expected) and state["count"].item() == 0 and not state["count"].requires_grad
    assert (flops.trace.execution == "real") is (execution == "real" or needs_values)


class UpdatesWhatItKeeps(nn.Module):
    """Accumulates into a tensor it keeps in a list and into one in a dict (no buffer: no stand-in for them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.totals = [torch.zeros(4)]
        self.stats = {"seen": torch.zeros(())}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        with torch.no_grad():
            self.totals[0].add_(y.sum(0))
            self.stats["seen"].add_(1)
        return y


@pytest.mark.parametrize(("execution", "backward"), EXECUTIONS)
def test_tensors_the_model_keeps_in_lists_and_dicts_keep_their_values(execution: str, backward: bool) -> None:
    model = UpdatesWhatItKeeps()
    kept = [model.totals[0], model.stats["seen"]]
    FlopCountAnalysis(model, torch.randn(3, 4), execution=execution, backward=backward).total()  # type: ignore[arg-type]
    assert model.totals[0] is kept[0] and model.stats["seen"] is kept[1]
    assert not model.totals[0].any() and model.stats["seen"].item() == 0


# --- parameters under real kernels: not copied, so copied when written -----------------------------------------------
class ClampsItsWeights(nn.Module):
    """Renormalises its embedding rows in place (``nn.Embedding(max_norm=...)``, a standard layer), clamps a weight
    in place and scales another through ``.data``; ``needs_values``: then selects by value, so ``auto`` falls back
    to real kernels."""

    def __init__(self, needs_values: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4, max_norm=0.5)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.needs_values = needs_values

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.clamp_(-0.1, 0.1)
        self.head.weight.data.mul_(2)
        y = self.head(self.fc(self.embedding(ids)))
        return y[(y > 0).nonzero()[:, 0]] if self.needs_values else y


@pytest.mark.parametrize(("execution", "backward"), EXECUTIONS)
@pytest.mark.parametrize("needs_values", [False, True], ids=["any", "needs_values"])
def test_parameters_updated_in_place_under_real_kernels_keep_their_values(execution: str, backward: bool,
                                                                         needs_values: bool) -> None:
    if needs_values and execution == "fake":
        pytest.skip("a model that needs values has no fake run")
    torch.manual_seed(0)
    model = ClampsItsWeights(needs_values)
    weights = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    ids = torch.randint(0, 10, (3, 5))
    flops = FlopCountAnalysis(model, ids, execution=execution, backward=backward)  # type: ignore[arg-type]
    assert flops.by_module()["fc"] == (3 if backward else 1) * 15 * 16  # backward: input and weight gradients
    for name, (parameter, values) in weights.items():
        assert dict(model.named_parameters())[name] is parameter and torch.equal(parameter, values), name


# --- one tensor passed several times: one stand-in -------------------------------------------------------------------
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_self_attention_on_one_tensor_counts_as_real_kernels_do_in_every_execution(backward: bool) -> None:
    """``mha(x, x, x)``: each occurrence of ``x`` got a stand-in of its own in a fake run, so the input was counted
    three times and ``query is key`` (MultiheadAttention's packed projection) was false; real kernels see one
    tensor. The oracle is the real run."""
    torch.manual_seed(0)
    model, x = nn.MultiheadAttention(16, 2, batch_first=True), torch.randn(2, 8, 16)
    inputs = Args(x, x, x, need_weights=False)

    def numbers(execution: str) -> dict[str, Any]:
        a = analyze(model, inputs, execution=execution, backward=backward, memory=True,  # type: ignore[arg-type]
                    quiet=True)
        assert a.memory is not None
        return {"flops": a.flops.by_module_and_operator(), "activations": a.activations.by_module_and_operator(),
                "peak": a.memory.peak_info().by_kind, "saved": a.memory.saved_for_backward(),
                "timeline": [point.live for point in a.memory.timeline()]}

    real = numbers("real")
    assert real["peak"]["input"] == x.numel() * 4
    for execution in ("auto", "fake"):
        assert numbers(execution) == real, execution


def test_a_list_of_the_models_own_parameters_is_not_copied() -> None:
    """Tensors kept in containers are copied before a run; the model's own parameters and buffers listed there
    (``self.every = list(self.parameters())``) are not: that would be a second copy of the model every analysis."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.every = [*model.parameters(), *model.buffers()]  # type: ignore[assignment]
    model.extra = [torch.zeros(3)]  # type: ignore[assignment]
    snapshot = ModelSnapshot(list(model.modules()))
    assert [values.nbytes() for _, values in snapshot.values.copies.values()] == [3 * 4]
