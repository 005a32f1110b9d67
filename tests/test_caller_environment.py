"""The caller's environment around an analysis: the caller's own modes, torch's settings, re-entrant analyses.

The semantics tested here: an analysis is a measurement of the model, not a call of it in the caller's program.

- The caller's ``TorchDispatchMode``s and ``TorchFunctionMode``s (a ``FlopCounterMode``, a logging mode) see none of
  its work, whichever run it picks (a meta run, FakeTensors, real kernels; a cached trace runs nothing), and do not
  change its numbers. They used to see the real run's operators and the analysis's own copies, none of a meta run's.
- A mode the model enters inside its ``forward`` sees the model's operators, as in a plain call.
- An analysis started inside the model's ``forward`` or a forward hook (under another analysis) counts what it counts
  alone, and the outer analysis does not count it: it used to count part of the inner one's work, and the inner
  analysis of a hooked module counted zero.
- Torch's settings a ``forward`` changes (default dtype, deterministic algorithms, threads, ...) are put back after
  each run, also when it raises: they used to leak into the caller's program (and a fallback run).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from modelmeter import analyze
from modelmeter._torch_compat import default_device_set

SRC = Path(__file__).resolve().parents[1] / "src"

# Hand counts (fvcore's convention: one FLOP per multiply-add) of _model()'s products on a (2, 3, 8, 8) input
CONV = 2 * 8 * 6 * 6 * 3 * 3 * 3  # outputs x (in-channels x kernel)
LINEAR = 2 * 8 * 6 * 6 * 10
TORCH_FLOPS = 2 * (CONV + LINEAR)  # FlopCounterMode: two per multiply-add, products only


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


X = torch.randn(2, 3, 8, 8)


@functools.cache
def _forward() -> int:
    """The oracle of every environment: the count of the same analysis in a plain one (the products' hand count, and
    the training-mode batch norm's rule of the handles)."""
    return analyze(_model(), X).flops.total()


@pytest.fixture(autouse=True)
def _plain_count_first() -> None:
    _forward()  # the oracle is counted before a test sets up its environment


def test_the_plain_count_holds_the_products_hand_count() -> None:
    assert analyze(_model(), X).flops.by_operator()["conv"] == CONV
    assert analyze(_model(), X).flops.by_operator()["linear"] == LINEAR


_FP32_SWITCHES = ["backends", "backends.cuda.matmul", "backends.cudnn", "backends.cudnn.conv", "backends.cudnn.rnn",
                  "backends.mkldnn", "backends.mkldnn.matmul", "backends.mkldnn.conv", "backends.mkldnn.rnn"]


def _switch(path: str) -> Any:
    owner: Any = torch
    for name in path.split("."):
        owner = getattr(owner, name)
    return owner


def _matmul_precisions() -> tuple[str, list[str]]:
    """The older matmul precision (or torch's refusal to read it, once a newer switch was written) and the newer
    ``fp32_precision`` switches."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = "refused"
    return legacy, [_switch(path).fp32_precision for path in _FP32_SWITCHES]


def _state() -> dict[str, Any]:
    """Torch's process-wide state an analysis must leave as found."""
    return {
        "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled(),
        "dtype": torch.get_default_dtype(), "device": (torch.get_default_device(), default_device_set()),
        "deterministic": (torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()),
        "autocast": (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
        "threads": torch.get_num_threads(), "rng": torch.get_rng_state().tolist(),
        "matmul": _matmul_precisions(), "anomaly": torch.is_anomaly_enabled(),
        "function_modes": torch._C._len_torch_function_stack(),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "module_hooks": [len(getattr(nn.modules.module, name)) for name in dir(nn.modules.module)
                         if name.startswith("_global_") and isinstance(getattr(nn.modules.module, name), dict)],
        "warning_filters": list(warnings.filters),
    }


class _Ops(TorchDispatchMode):
    """The caller's dispatch mode: notes every operator it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class _Calls(TorchFunctionMode):
    """The caller's function mode: notes every call it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class _RefusesClone(TorchDispatchMode):
    """The caller's guard that refuses an operator the model never runs."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.clone.default:
            raise RuntimeError("the caller's mode refuses clone")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_the_callers_modes_see_nothing_of_an_analysis(execution: str) -> None:
    model = _model()
    before = _state()
    with FlopCounterMode(display=False) as flops, _Ops() as ops, _Calls() as calls:
        total = analyze(model, X, execution=execution).flops.total()
    assert total == _forward()
    assert (flops.get_total_flops(), ops.seen, calls.seen) == (0, [], [])
    assert _state() == before
    with FlopCounterMode(display=False) as flops:  # the oracle: the same mode around a plain call
        model(X)
    assert flops.get_total_flops() == TORCH_FLOPS


def test_a_callers_mode_refusing_an_operator_the_model_never_runs_does_not_fail_the_analysis() -> None:
    with _RefusesClone():
        assert analyze(_model(), X, execution="real").flops.total() == _forward()


class _CountsItself(nn.Module):
    """A model that counts its own FLOPs with torch's FlopCounterMode inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with FlopCounterMode(display=False) as flops:
            y = self.body(x)
        SEEN.append(flops.get_total_flops())
        return y


SEEN: list[int] = []  # what the models' own counts found (outside the model: the run puts its attributes back)


@pytest.mark.parametrize("execution", ["auto", "real"])
@pytest.mark.parametrize("backward", [False, True])
def test_a_mode_the_model_enters_sees_the_models_operators(execution: str, backward: bool) -> None:
    SEEN.clear()
    analysis = analyze(_CountsItself(), X, execution=execution, backward=backward)
    assert SEEN == [TORCH_FLOPS]
    assert analysis.flops.by_phase()["forward"] == _forward()


class _AnalysesItself(nn.Module):
    """A model whose forward analyses its body before running it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(analyze(self.body, x).flops.total())
        return self.body(x)


@pytest.mark.parametrize("execution", ["auto", "real"])
def test_an_analysis_inside_the_forward_is_counted_alone_and_not_by_the_outer_one(execution: str) -> None:
    SEEN.clear()
    model = _AnalysesItself()
    before = _state()
    assert analyze(model, X, execution=execution).flops.total() == _forward()
    assert [_forward()] == SEEN
    assert _state() == before


def test_an_analysis_inside_a_forward_hook_counts_the_hooked_module() -> None:
    model = _model()
    inner: list[int] = []

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not inner:  # (the inner analysis runs the module too: its hook must not start a third)
            inner.append(-1)
            inner[0] = analyze(module, args[0]).flops.total()

    handle = model[0].register_forward_hook(hook)
    try:
        assert analyze(model, X).flops.total() == _forward()
    finally:
        handle.remove()
    assert inner == [CONV]


class _ChangesTorchSettings(nn.Module):
    """A model whose forward changes torch's settings and leaves them so (then raises, if asked)."""

    def __init__(self, failure: BaseException | None) -> None:
        super().__init__()
        self.body = _model()
        self.failure = failure

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_num_threads(1)
        torch.set_float32_matmul_precision("medium")
        torch.set_default_device("meta")
        y = self.body(x)
        if self.failure is not None:
            raise self.failure
        return y


@contextlib.contextmanager
def _settings_put_back() -> Iterator[None]:
    """Puts torch's settings back should a test fail with them changed."""
    dtype, device, threads = torch.get_default_dtype(), default_device_set(), torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_default_device(device)
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision("highest")


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
@pytest.mark.parametrize("failure", [None, KeyboardInterrupt(), RuntimeError("boom")],
                         ids=["returns", "ctrl-c", "fails"])
def test_torch_settings_a_forward_changes_are_put_back(execution: str, failure: BaseException | None) -> None:
    model = _ChangesTorchSettings(failure)
    with _settings_put_back():
        before = _state()
        if failure is None:  # twice: the second run meets what the first left (a default device put back wrongly)
            for _ in range(2):
                assert analyze(model, X, execution=execution, cache=False).flops.total() == _forward()
                assert _state() == before
        else:
            with contextlib.suppress(BaseException):
                analyze(model, X, execution=execution)
            assert _state() == before
    assert torch._C._len_torch_function_stack() == 0  # (nor does the test's own clean-up leave a default device)


@contextlib.contextmanager
def _set(setter: Callable[[Any], Any], value: Any, found: Any) -> Iterator[None]:
    setter(value)
    try:
        yield
    finally:
        setter(found)


@contextlib.contextmanager
def _warnings_are_errors() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# The caller's environments: each must give the plain call's numbers and leave the state as found
CALLER_ENVIRONMENTS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "autocast(cpu, bfloat16)": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "default dtype float64": lambda: _set(torch.set_default_dtype, torch.float64, torch.get_default_dtype()),
    "default device meta": lambda: _set(torch.set_default_device, "meta", default_device_set()),
    "deterministic algorithms": lambda: _set(torch.use_deterministic_algorithms, True, False),
    "one thread": lambda: _set(torch.set_num_threads, 1, torch.get_num_threads()),
    "warnings are errors": _warnings_are_errors,
    "profiler": lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]),
    "record_function": lambda: torch.profiler.record_function("caller"),
}


@pytest.mark.parametrize("environment", list(CALLER_ENVIRONMENTS))
@pytest.mark.parametrize("backward", [False, True])
def test_the_callers_environment_changes_no_number_and_is_left_as_found(environment: str, backward: bool) -> None:
    model = _model()
    with CALLER_ENVIRONMENTS[environment](), torch.no_grad(), torch.enable_grad(), torch.inference_mode():
        before = _state()
        analysis = analyze(model, X, backward=backward)
        assert _state() == before
    assert analysis.flops.by_phase()["forward"] == _forward()


# torch warns once per process when a FakeTensor's data pointer is read: only a fresh process sees the warning
_FAKE_DATA_POINTERS = """
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from modelmeter import analyze
from modelmeter._torch_compat import default_device_set
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
x = torch.randn(4, 16)
print(analyze(model, FakeTensorMode().from_tensor(x)).flops.total())
print(analyze(model, x, parallel="dp=2").flops.total())
"""


def test_fake_tensor_data_pointers_under_python_w_error() -> None:
    """Keying a FakeTensor input read its data pointer, and a plan's run (``dp=2``) read the address of a FakeTensor
    parameter's storage it wrote: torch answers both with a deprecation warning, an error under ``python -W error``."""
    done = subprocess.run([sys.executable, "-W", "error", "-c", _FAKE_DATA_POINTERS], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(16 * 32 * 4 + 32 * 16 * 4)] * 2  # the two products, forward, per rank's batch


class _LeavesAModeOn(nn.Module):
    """A model whose forward enters torch's FlopCounterMode by hand and never leaves it (its ModuleTracker registers
    global module hooks): a plain call leaves that mode on; a run of the analysis must leave nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FlopCounterMode(display=False).__enter__()
        return self.body(x)


@pytest.mark.parametrize("execution", ["auto", "real"])
def test_a_mode_the_forward_leaves_on_leaves_neither_it_nor_the_recorder_behind(execution: str) -> None:
    before = _state()
    assert analyze(_LeavesAModeOn(), X, execution=execution).flops.total() == _forward()
    assert _state() == before  # the run's dispatch recorder popped the model's mode in its place and stayed on


@pytest.mark.parametrize("execution", ["auto", "real"])
def test_a_training_step_under_the_callers_disable_saved_tensors_hooks(execution: str) -> None:
    """A plain step runs under ``disable_saved_tensors_hooks`` (it has no hooks); the analysis's own, which note what
    the forward saves, were refused with the caller's message, a bare RuntimeError."""
    plain = analyze(_model(), X, execution=execution, backward=True, memory=True, optimizer="adam")
    with torch.autograd.graph.disable_saved_tensors_hooks("the caller's step takes no hooks"):
        analysis = analyze(_model(), X, execution=execution, backward=True, memory=True, optimizer="adam")
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        with pytest.raises(RuntimeError, match="the caller's step takes no hooks"), hooks:  # the caller's: refused
            pass
    assert (analysis.flops.by_phase(), analysis.memory.peak()) == (plain.flops.by_phase(), plain.memory.peak())


@pytest.mark.parametrize("plan", ["dp=2", "dp=2,tp=2"])
@pytest.mark.parametrize("backward", [False, True])
def test_parallel_plans_under_warnings_as_errors(plan: str, backward: bool) -> None:
    """A plan's run wrote a FakeTensor parameter, whose storage's address torch answers with a warning (``dp=2``), and
    FSDP2 warned of its own wrapping's view outputs (``tp``, a training step): both errors under ``python -W error``,
    neither the user's."""
    x = torch.randn(4, 16)
    plain = analyze(_mlp(), x, parallel=plan, backward=backward).flops.by_operator()
    with _warnings_are_errors():  # (another model: the same one's trace would be shared, not recorded again)
        assert analyze(_mlp(), x, parallel=plan, backward=backward).flops.by_operator() == plain


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


class _SetsFp32Precision(nn.Module):
    """A model whose forward writes torch's newer TF32 switch (after which the older getter raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        return self.body(x)


@contextlib.contextmanager
def _fp32_precisions_put_back() -> Iterator[None]:
    found = [_switch(path).fp32_precision for path in _FP32_SWITCHES]
    try:
        yield
    finally:
        for path, value in zip(_FP32_SWITCHES, found, strict=True):
            _switch(path).fp32_precision = value
        torch.set_float32_matmul_precision("highest")  # (the older switch readable again, as the process began)


@pytest.mark.parametrize("by", ["forward", "caller", "both"])
@pytest.mark.parametrize("execution", ["auto", "real"])
def test_torchs_newer_tf32_switch_fails_no_run_and_is_put_back(by: str, execution: str) -> None:
    """``torch.get_float32_matmul_precision()`` raises once a newer ``fp32_precision`` switch was written: every run
    read it, and each analysis failed with a bare RuntimeError."""
    with _fp32_precisions_put_back():
        if by != "forward":  # (a mix the older getter refuses to read)
            torch.backends.cudnn.fp32_precision = "ieee"
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            torch.backends.mkldnn.matmul.fp32_precision = "tf32"
        model = _SetsFp32Precision() if by != "caller" else _model()
        before = _state()
        assert analyze(model, X, execution=execution, cache=False).flops.total() == _forward()
        assert _state() == before  # the caller's switches exactly, and the older getter readable where it was


class _PutBackFails:
    """A setting whose setter is interrupted (ctrl-c as the analysis puts it back)."""

    value = 0

    @classmethod
    def get(cls) -> int:
        return cls.value

    @staticmethod
    def put(value: int) -> None:
        raise KeyboardInterrupt


def test_kept_settings_cut_the_stacks_back_when_a_setting_cannot_be_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from modelmeter.engine import environment

    monkeypatch.setattr(environment, "SETTINGS", (*environment.SETTINGS, (_PutBackFails.get, _PutBackFails.put)))
    monkeypatch.setattr(_PutBackFails, "value", 0)
    before = _state()
    kept = environment.KeptSettings()  # held, as the interrupt's traceback holds it (its collection cut the stacks)
    with pytest.raises(KeyboardInterrupt), kept:
        _Ops().__enter__()  # left on, as a forward may
        _PutBackFails.value = 1
    assert _state() == before  # the mode was left on the dispatch stack
    del kept


class _WritesAndLeavesAMode(nn.Module):
    def __init__(self, leave: bool) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.leave = leave

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.add_(1)  # the input written: its value is put back after the run, by kernels the recorder must not see
        if self.leave:
            _Ops().__enter__()
        return self.body(x)


@pytest.mark.parametrize("backward", [False, True])
def test_a_mode_the_forward_leaves_on_records_no_operator_of_its_own(backward: bool) -> None:
    # the recorder popped the model's mode in its place and stayed on while the run's contexts exited: it recorded
    # their copies (empty, set_, copy_) as the model's work
    x = torch.randn(2, 4)
    traces = [analyze(_WritesAndLeavesAMode(leave), x, execution="real", backward=backward, cache=False).trace
              for leave in (False, True)]
    plain, left = ([(e.op, e.phase) for e in trace.events] for trace in traces)
    assert left == plain
    assert torch._C._len_torch_dispatch_stack() == 0


def test_the_callers_modes_come_back_when_setting_them_aside_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from modelmeter._torch_compat import caller_modes_set_aside

    def refuses() -> bool:
        raise RuntimeError("refused")

    with _Calls() as calls:
        monkeypatch.setattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", refuses)
        with pytest.raises(RuntimeError, match="refused"), caller_modes_set_aside():
            pass
        monkeypatch.undo()
        assert torch._C._len_torch_function_stack() == 1 and torch._C._get_function_stack_at(0) is calls
