"""Model transformations users apply before analysing: parametrizations (weight and spectral norm, their caches),
pruning, quantization, wrappers, exported and compiled modules, and the hooks users set. The analysis counts what a
real CPU step runs, fires the user's hooks as a real step does, and leaves the model, its hooks and torch's caches as
it found them.

Oracles: ``torch.utils.flop_counter.FlopCounterMode`` on the same model run for real, hand arithmetic, and the
model's outputs and gradients in a real step after the analysis.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch import nn
from torch.nn.utils import parametrizations
from torch.utils.flop_counter import FlopCounterMode

from modelmeter import FlopCountAnalysis, analyze
from modelmeter.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")

EXECUTIONS = ["auto", "fake", "real"]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _real_macs(model: nn.Module, x: torch.Tensor) -> int:
    """What a real step of ``model`` (forward, and backward from the sum of its output) multiplies and adds."""
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops() // 2


# --- torch's parametrization cache ----------------------------------------------------------------------------------
@pytest.mark.parametrize("execution", EXECUTIONS)
def test_an_analysis_inside_parametrize_cached_leaves_torch_cache_as_it_was(execution: str) -> None:
    """Inside ``parametrize.cached()`` torch keeps each parametrized weight, once computed, in a global dict. The run
    left its stand-in there (a meta tensor, or a real one from the run's clones): the user's next forward in the same
    block read it and returned garbage silently, or gradients that never reached the parameters."""
    x = torch.randn(4, 16)
    model = nn.Linear(16, 16)
    parametrizations.weight_norm(model)
    expected = model(x)
    with parametrize.cached():
        analysis = analyze(model, x, convention="macs", execution=execution)
        after = model(x)
        after.sum().backward()
    assert torch.equal(after, expected)
    assert model.parametrizations.weight.original1.grad is not None  # the weight's graph reaches the parameters
    assert analysis.flops.total() == 4 * 16 * 16


def test_a_run_inside_parametrize_cached_computes_a_parametrization_once() -> None:
    """A weight used twice inside ``cached()`` is computed once, as torch computes it, and the user's entries (made
    by a forward before the analysis) are back afterwards, the same objects."""
    x = torch.randn(4, 16)
    model = _TwiceThroughOne()
    parametrizations.spectral_norm(model.layer)
    model.eval()  # no power iteration: one matrix-vector product per computation of the weight
    with parametrize.cached():
        model(x)
        kept = dict(parametrize._cache)
        cached = FlopCountAnalysis(model, x, convention="macs").by_operator()
        assert dict(parametrize._cache) == kept and all(parametrize._cache[k] is v for k, v in kept.items())
    uncached = FlopCountAnalysis(model, x, convention="macs").by_operator()
    assert cached["mv"] == 16 * 16 and uncached["mv"] == 2 * 16 * 16


def test_the_caches_tell_a_run_inside_parametrize_cached_from_one_outside(tmp_path: Any) -> None:
    """Inside ``cached()`` a weight read twice is computed once, outside twice: the persistent key held neither, and
    served one run's trace to the other (a fresh model each time, so the in-process store cannot answer)."""
    x = torch.randn(4, 16)

    def mv(cached: bool) -> int:
        torch.manual_seed(0)
        model = _TwiceThroughOne()
        parametrizations.spectral_norm(model.layer)
        model.eval()
        with parametrize.cached() if cached else contextlib.nullcontext():
            return FlopCountAnalysis(model, x, convention="macs", cache_dir=str(tmp_path)).by_operator()["mv"]

    assert [mv(True), mv(False), mv(True)] == [16 * 16, 2 * 16 * 16, 16 * 16]


class _TwiceThroughOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.layer(x))


# --- the user's hooks on parameters and inputs ----------------------------------------------------------------------
def _clipped(model: nn.Module, fired: list[str]) -> nn.Module:
    """Gradient hooks on every parameter (clip and halve: work of the step) and one that notes each accumulation."""
    for parameter in model.parameters():
        parameter.register_hook(lambda g: g.clamp(-1, 1) * 0.5)
    model[0].weight.register_post_accumulate_grad_hook(lambda p: fired.append("accumulated"))
    return model


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_hooks_on_parameters_fire_and_count_as_in_a_real_step(execution: str) -> None:
    """A fake run replaced the parameters by stand-ins without the hooks the user set on them: a gradient-clipping hook
    did no work (its clamp and multiplication uncounted, counts differing by execution), where a real step runs it.
    A post-accumulate hook (an optimizer stepping in the backward pass) is set aside in every execution: it would
    step the caller's optimizer. The parameters keep their hooks, and only theirs, afterwards."""
    x = torch.randn(4, 16)
    fired: list[str] = []
    model = _clipped(_mlp(), fired)
    tables = [dict(p._backward_hooks) for p in model.parameters()]
    analysis = analyze(model, x, convention="flops", backward=True, execution=execution)
    macs = FlopCountAnalysis.from_session(analysis.session, convention="macs")
    assert macs.total() == _real_macs(_clipped(_mlp(), []), x)  # macs: the clamp and multiply are not products
    gradients = 16 * 32 + 32 + 32 * 8 + 8
    by_operator = analysis.flops.by_operator()
    assert by_operator["clamp"] == gradients and by_operator["mul"] == gradients
    assert fired == []
    assert [dict(p._backward_hooks) for p in model.parameters()] == tables
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_a_hook_on_an_input_fires_in_the_step(execution: str) -> None:
    """A hook on an input that requires grad fired under real kernels only: a fake run's input stand-in lacked it."""
    fired: list[torch.Size] = []
    x = torch.randn(4, 16, requires_grad=True)
    x.register_hook(lambda g: fired.append(g.shape))
    FlopCountAnalysis(_mlp(), x, backward=True, execution=execution).total()
    assert fired == [torch.Size([4, 16])]
    assert x.grad is None


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_a_hook_set_between_two_analyses_is_counted_by_the_second(execution: str, tmp_path: object) -> None:
    """The in-process store and the disk cache keyed parameters by identity, version and metadata, not their hooks:
    an analysis after ``register_hook`` took the trace recorded before it, without the hook's work."""
    x = torch.randn(4, 16)
    model = _mlp()

    def flops(**options: object) -> int:
        return analyze(model, x, convention="flops", backward=True, execution=execution, **options).flops.total()

    plain = flops()
    assert flops(cache_dir=tmp_path) == plain
    handle = model[0].weight.register_hook(lambda g: g * 2)
    assert flops() == plain + 16 * 32
    assert flops(cache_dir=tmp_path) == plain + 16 * 32
    handle.remove()
    assert flops() == plain


# --- quantization ---------------------------------------------------------------------------------------------------
def _dynamic(dtype: torch.dtype = torch.qint8) -> nn.Module:
    with warnings.catch_warnings():  # torch.ao.quantization warns that it moves to torchao
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.ao.quantization import quantize_dynamic

        return quantize_dynamic(_mlp(), {nn.Linear}, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float16])
def test_a_dynamic_quantized_model_takes_meta_inputs(dtype: torch.dtype) -> None:
    """Every weight of a ``quantize_dynamic`` model is packed (no tensor parameter), so meta inputs — the command's —
    stayed FakeTensors on meta, where its packed kernel cannot run: the command failed with torch's "could not find
    the fake impl" for every such model, while the same model counted with CPU inputs."""
    model = _dynamic(dtype)
    expected = 4 * 16 * 32 + 4 * 32 * 8
    assert FlopCountAnalysis(model, torch.zeros(4, 16, device="meta")).total() == expected
    assert FlopCountAnalysis(model, torch.zeros(4, 16)).total() == expected


def test_the_command_counts_a_dynamic_quantized_model(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "quantized_models.py"
    path.write_text("import torch\nfrom torch import nn\n\n\ndef build():\n"
                    "    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))\n"
                    "    return torch.ao.quantization.quantize_dynamic(model, {nn.Linear})\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        status = main([f"{path}:build", "--input", "4x16", "--format", "csv"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert out.splitlines()[1].split(",")[4] == str(4 * 16 * 32 + 4 * 32 * 8)


# --- compiled modules -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backward", [False, True])
def test_a_module_compiled_in_place_runs_eagerly_and_keeps_its_compiled_call(backward: bool) -> None:
    """``module.compile()`` (compiled in place, no wrapper) made the run call torch.compile's call, which compiled the
    recorders' own code with the model's (over a minute for a small MLP, dynamo's recompile limits hit). The run
    calls the module's eager call, as for a ``torch.compile`` wrapper, and the compiled call is left in place."""
    x = torch.randn(4, 16)
    expected = FlopCountAnalysis(_mlp(), x, convention="flops", backward=backward).by_operator()
    model = _mlp()
    model[2].compile()
    model.compile()
    compiled = model._compiled_call_impl
    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return compiled(*args, **kwargs)

    model._compiled_call_impl = counted
    try:
        assert FlopCountAnalysis(model, x, convention="flops", backward=backward).by_operator() == expected
    finally:
        assert model._compiled_call_impl is counted
        model._compiled_call_impl = compiled
    assert not calls
    assert model[2]._compiled_call_impl is not None


# --- TorchScript inside an eager model ------------------------------------------------------------------------------
class _WithScripted(nn.Module):
    def __init__(self, scripted: nn.Module) -> None:
        super().__init__()
        self.inner = scripted
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


@pytest.mark.parametrize("how", ["script", "trace"])
@pytest.mark.parametrize("cache", [False, True])
def test_a_torchscript_submodule_is_refused_naming_it(how: str, cache: bool, tmp_path: object) -> None:
    """A scripted or traced submodule inside an eager model failed with a bare ``AttributeError`` from inside torch
    (``'_CachedForward' object has no attribute '__getattr__'``, the in-process key reading its ``forward``). Its
    operators run in TorchScript's interpreter, where the model's modules cannot be followed: it is refused as a
    TorchScript model is, naming the submodule."""
    x = torch.randn(4, 16)
    layers = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated
        scripted = torch.jit.script(layers) if how == "script" else torch.jit.trace(layers, x)
    model = _WithScripted(scripted)
    options = {"cache_dir": tmp_path} if cache else {}
    with pytest.raises(TypeError, match=r"module 'inner' is a TorchScript module \((RecursiveScriptModule|"
                                        r"TopLevelTracedModule)"):
        FlopCountAnalysis(model, x, **options).total()
    assert torch.equal(model(x), model.head(layers(x)))
