"""Training steps as a demanding user writes them: losses over one element of the output, targets captured by the
loss, frozen and tied parameters, activation checkpointing, inputs that require grad.

Oracles: the real CPU allocator (tests/memory_oracle.py, a steady step after a warm-up step), torch's own
FlopCounterMode on the same step run for real, and hand arithmetic on the optimizer's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from memory_oracle import measure_peak, resident_bytes, training_step, warm_up
from modelmeter import MemoryAnalysis, analyze, result_from_trace
from modelmeter.errors import InvalidTypeError, InvalidValueError, ModelRunError
from modelmeter.metrics.memory import optimizer_bytes


def _measured_sgd_step(model: nn.Module, inputs: tuple[Any, ...], resident: tuple[Any, ...],
                       loss_fn: Callable[[Any], torch.Tensor] | None = None) -> int:
    """The allocator's peak of a steady SGD step: the bytes alive before it (``resident``: the inputs and any
    tensor the step reads from outside, as a loss's target) plus the largest rise during it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up(model, inputs, optimizer, loss_fn)
    return resident_bytes(model, resident, optimizer) + measure_peak(
        training_step(model, inputs, optimizer, loss_fn)).peak_delta


# --- tensors from outside the run, saved for the backward pass ------------------------------------------------
_SCALE = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


class _ScaledByAGlobal(nn.Module):
    """Multiplies by a module-level tensor (no parameter, no buffer, no input): ``mul`` saves it for the backward
    pass, which reaches it last, so it is saved through the widest layer's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 512), nn.Linear(512, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(self.a(x) * _SCALE)))


@pytest.mark.parametrize("execution", ["fake", "real"])
def test_a_tensor_from_outside_the_run_saved_for_backward_is_no_copy(execution: str) -> None:
    """The fake run detached what autograd saves under the fake mode: a real tensor from outside the run (a global,
    a loss's target) became a fake copy, a second storage its size that no real step allocates (8 KiB over here)."""
    torch.manual_seed(0)
    model, x = _ScaledByAGlobal(), torch.randn(32, 64)
    mem = MemoryAnalysis(model, x, training=True, optimizer="sgd", execution=execution)  # type: ignore[arg-type]
    assert mem.trace.execution == execution
    assert mem.peak() == _measured_sgd_step(model, (x,), (x, _SCALE))


def test_a_target_captured_by_the_loss_is_counted_once_in_both_runs() -> None:
    """``loss_fn=lambda out: cross_entropy(out, labels)``, the usual way: the labels are there before the step (once),
    and the fake run's timeline is the real run's, point by point."""
    torch.manual_seed(0)
    model, x, labels = nn.Linear(16, 10), torch.randn(8, 16), torch.randint(0, 10, (8,))

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, labels)

    fake, real = (MemoryAnalysis(model, x, training=True, optimizer="adam", loss_fn=loss_fn, execution=execution)
                  for execution in ("fake", "real"))
    assert fake.trace.execution == "fake"
    assert [p.live for p in fake.timeline()] == [p.live for p in real.timeline()]
    assert [s.nbytes for s in fake.trace.storages if s.dtype == "int64"] == [labels.nbytes]


# --- the optimizer's step over parameters of several dtypes --------------------------------------------------
class _ThreeDtypes(nn.Module):
    """Three Linears, each in its own dtype (its input cast to it): parameters of up to three dtypes, in the order
    float32, ``middle``, ``last``."""

    def __init__(self, middle: torch.dtype, last: torch.dtype) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 64), nn.Linear(64, 64).to(middle), nn.Linear(64, 8).to(last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)).to(self.b.weight.dtype)
        return self.c(torch.tanh(self.b(h)).to(self.c.weight.dtype))


@pytest.mark.parametrize("middle,last", [(torch.bfloat16, torch.float32), (torch.float64, torch.float32),
                                         (torch.float16, torch.float64)], ids=["bf16", "f64", "three"])
@pytest.mark.parametrize("name", ["momentum", "adamw"])
def test_a_multi_tensor_step_over_several_dtypes_is_the_allocators(name: str, middle: torch.dtype,
                                                                  last: torch.dtype) -> None:
    """torch's multi-tensor step runs one group of parameters per dtype, after the other: Adam's ``sqrt`` of a group
    is made while the previous group's is still bound. The model held every parameter's at once (float16, float64
    and float32 groups: 20,940 bytes predicted, 16,768 allocated)."""
    torch.manual_seed(0)
    model, x = _ThreeDtypes(middle, last), torch.randn(16, 32)
    mem = MemoryAnalysis(model, x, training=True, optimizer=name, foreach=True)
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True) if name == "momentum"
                 else torch.optim.AdamW(model.parameters(), foreach=True))
    model(x).sum().backward()
    optimizer.step()  # the first step makes the state
    model(x).sum().backward()
    assert optimizer_bytes(mem.trace, mem.optimizer)[1] == measure_peak(optimizer.step).peak_delta


# --- arguments: each mistake names the argument of the call it was made in --------------------------------------
def test_a_step_without_its_switch_names_the_callers_argument() -> None:
    """``analyze`` and a trace have no ``training``: they were told to pass it; ``MemoryAnalysis`` has no
    ``backward``, and was told to pass that."""
    model, x = nn.Linear(4, 2), torch.randn(3, 4)
    with pytest.raises(InvalidValueError, match=r"pass backward=True with it"):
        analyze(model, x, memory=True, optimizer="adam")
    with pytest.raises(InvalidValueError, match=r"pass a trace recorded with backward=True"):
        result_from_trace(analyze(model, x).trace, memory=True, optimizer="adam")
    with pytest.raises(InvalidValueError, match=r"pass training=True with it"):
        MemoryAnalysis(model, x, optimizer="adam")
    with pytest.raises(InvalidValueError, match=r"loss_fn .* pass training=True with it"):
        MemoryAnalysis(model, x, loss_fn=lambda output: output.sum())


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, "instance", 3])
def test_an_optimizer_that_is_no_name_is_refused_as_a_type(optimizer: Any) -> None:
    """A torch.optim optimizer (its class or an instance) is named by its class, not dumped with every parameter
    group's settings in a ValueError."""
    model, x = nn.Linear(4, 2), torch.randn(3, 4)
    if optimizer == "instance":
        optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    named = r"got (torch.optim's AdamW, whose settings are not read: pass the name|int$)"
    with pytest.raises(InvalidTypeError, match=r"must be a name \(sgd, momentum, adam, adamw\) or an OptimizerSpec, "
                                               + named) as raised:
        MemoryAnalysis(model, x, training=True, optimizer=optimizer)
    assert "Parameter Group" not in str(raised.value)


# --- CTC: a loss whose kernels need the targets' values ----------------------------------------------------------
def _ctc_step() -> tuple[nn.Module, torch.Tensor, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]:
    torch.manual_seed(0)
    x, lengths = torch.randn(50, 4, 16), torch.tensor([10, 4, 7, 2])
    targets, frames = torch.randint(1, 12, (4, 10)), torch.full((4,), 50)

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        return nn.functional.ctc_loss(output.log_softmax(-1), targets, frames, lengths, reduction="sum")

    return nn.Linear(16, 12), x, (x, targets, frames, lengths), loss_fn


def test_the_ctc_backward_scratch_is_counted() -> None:
    """CTC's CPU backward computes ``log_beta``, the size of the ``log_alpha`` its forward kept, and frees it before
    returning: the step peaks there, 8 KiB (the size of ``log_alpha``: 4 x 50 x 21 floats) over what was predicted."""
    model, x, resident, loss_fn = _ctc_step()
    mem = MemoryAnalysis(model, x, training=True, optimizer="sgd", loss_fn=loss_fn)
    assert mem.trace.execution == "real"  # the output's shape follows the target lengths' values
    assert mem.peak_info().at.operator == "ctc_loss backward"
    assert mem.peak() == _measured_sgd_step(model, (x,), resident, loss_fn)


def test_a_fake_loss_that_needs_values_says_which_execution_runs_it() -> None:
    model, x, _, loss_fn = _ctc_step()
    with pytest.raises(ModelRunError, match=r"the loss_fn failed at operator aten::ctc_loss: .*use execution='auto' or "
                                            r"'real'\)$"):
        MemoryAnalysis(model, x, training=True, loss_fn=loss_fn, execution="fake").peak()


# --- an optimizer stepping in the backward pass ---------------------------------------------------------------
@pytest.mark.parametrize("execution", ["fake", "real"])
def test_an_optimizer_in_the_backward_pass_is_not_stepped_by_the_analysis(execution: str) -> None:
    """``register_post_accumulate_grad_hook`` hooks that step an optimizer per parameter ran in a real run's backward
    pass: the caller's optimizers got their state and first step, their work was recorded as the model's, and the
    real run's peak was not the fake run's (which never runs them). Both runs now set them aside, and leave them."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(4, 8)
    optimizers = {p: torch.optim.AdamW([p], foreach=False) for p in model.parameters()}

    def step(parameter: torch.Tensor) -> None:
        optimizers[parameter].step()
        optimizers[parameter].zero_grad()

    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(step)
    mem = MemoryAnalysis(model, x, training=True, optimizer="adamw", execution=execution)  # type: ignore[arg-type]
    plain = MemoryAnalysis(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)), x, training=True,
                           optimizer="adamw", execution=execution)  # type: ignore[arg-type]
    assert mem.peak_info() == plain.peak_info()
    assert all(not optimizer.state for optimizer in optimizers.values())
    model(x).sum().backward()  # the hooks are the caller's still
    assert all(len(optimizer.state) == 1 for optimizer in optimizers.values())


def test_gradient_hooks_on_parameters_run_in_a_fake_run_too() -> None:
    """``register_hook`` on a parameter (its gradient clipped by a hook) ran in a real run only: the fake run's
    stand-ins did not carry the hook, so its clamps, their FLOPs and the gradients they copy were missing (a peak
    30% under the allocator's here)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)), torch.randn(4, 64)
    for parameter in model.parameters():
        parameter.register_hook(lambda gradient: gradient.clamp(-1.0, 1.0))
    fake, real = (analyze(model, x, backward=True, memory=True, optimizer="sgd", convention="flops", quiet=True,
                          execution=execution)
                  for execution in ("fake", "real"))
    assert fake.trace.execution == "fake" and fake.flops.by_operator() == real.flops.by_operator()
    assert fake.memory is not None and real.memory is not None
    assert fake.memory.peak() == real.memory.peak() == _measured_sgd_step(model, (x,), (x,))


@pytest.mark.parametrize("cache", [None, True])
def test_a_gradient_hook_added_after_an_analysis_is_a_new_run(cache: bool | None, tmp_path: Any) -> None:
    """The keys of the in-process and on-disk caches read a tensor's metadata, not the hooks on its gradient: the
    analysis after ``register_hook`` was the one before it, unhooked (in a real run as in a fake one)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)), torch.randn(4, 64)

    def peak() -> int:
        analysis = analyze(model, x, backward=True, memory=True, optimizer="sgd", quiet=True, cache=cache,
                           cache_dir=tmp_path if cache else None)
        assert analysis.memory is not None
        return analysis.memory.peak()

    plain = peak()
    handles = [parameter.register_hook(lambda gradient: gradient.clamp(-1.0, 1.0)) for parameter in
               model.parameters()]
    hooked = peak()
    assert hooked == _measured_sgd_step(model, (x,), (x,)) > plain
    for handle in handles:
        handle.remove()
    assert peak() == plain


class _ScaledByAttribute(nn.Module):
    """A plain tensor attribute that requires grad (no parameter): a real run keeps it as a clone of it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.ones(4, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


@pytest.mark.parametrize("execution", ["real", "fake", "auto"])
def test_a_gradient_hook_fires_once_whatever_the_stand_in(execution: str) -> None:
    # a real run's clone of the attribute carried its hooks as well, and passed its gradient on to the original,
    # whose own hooks fired again: twice per step (a plain step: once)
    model, fired = _ScaledByAttribute(), []
    model.scale.register_hook(lambda g: fired.append("scale"))
    model.lin.weight.register_hook(lambda g: fired.append("weight"))
    model(torch.randn(2, 4)).sum().backward()
    assert sorted(fired) == ["scale", "weight"]
    fired.clear()
    analyze(model, torch.randn(2, 4), backward=True, execution=execution, cache=False, quiet=True).flops.total()
    assert sorted(fired) == ["scale", "weight"]
