"""Analyses in threads, and the process-wide state a run takes: two analyses at once count as each alone and leave
torch as found; another thread's training is neither recorded nor changed; a module the model runs on a thread of
its own fails the run instead of counting zero; the collector's pauses overlap and leave it as the user left it; the
in-process shared recording notices a library function the user replaced. Threads meet at events, never sleeps."""

from __future__ import annotations

import copy
import gc
import random
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelmeter
from modelmeter import FlopCountAnalysis, ModelRunError, RunSpec
from modelmeter._torch_compat import function_modes
from modelmeter.cache.shared import SHARED
from modelmeter.engine import gc_pause
from modelmeter.engine.tracer import record_trace

LINEAR = 3 * 8 * 8  # multiply-adds of Linear(8, 8) on 3 rows
WAIT = 10.0  # seconds an event is waited for at most: a thread that never comes fails the test, never hangs it


def _total(model: nn.Module, x: torch.Tensor) -> int:
    return int(FlopCountAnalysis(model, x, convention="macs").total())


def _fresh(model: nn.Module, x: torch.Tensor) -> int:
    """What a recording of its own counts now (no shared recording taken)."""
    with SHARED.set_aside():
        return _total(model, x)


def _torch_state() -> tuple[Any, ...]:
    """What a run replaces of torch and puts back (the modes too: this thread's)."""
    module = nn.modules.module
    return (len(function_modes()), len(module._global_forward_pre_hooks), len(module._global_forward_hooks),
            len(module._global_forward_hooks_always_called), torch.autograd.Function.__dict__["apply"],
            torch.get_rng_state, torch.UntypedStorage.__dict__.get("resize_"), gc.isenabled())


def _join(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(WAIT)
        assert not thread.is_alive()


class Waiting(nn.Module):
    """Linear(8, 8) whose forward marks ``inside`` and waits (at most ``wait`` seconds) for ``go``; ``overlapped``
    is told whether ``go`` came while it waited (the list's ``append``: a run puts back the lists a model holds)."""

    def __init__(self, inside: threading.Event, go: threading.Event, wait: float,
                 overlapped: Callable[[bool], None]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.inside, self.go, self.wait = inside, go, wait
        self.overlapped = overlapped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inside.set()
        self.overlapped(self.go.wait(self.wait))
        return self.lin(x)


def test_two_analyses_in_two_threads_run_one_after_the_other_and_leave_torch_as_found() -> None:
    """The first run waits inside its forward for the second to start its own: runs overlapping in two threads put
    back each other's replacements of torch (``Function.apply``, ``torch.get_rng_state`` left replaced for good).
    One run at a time: the second starts once the first is over, and both count as alone."""
    before = _torch_state()
    first_in, second_in = threading.Event(), threading.Event()
    overlapped: list[bool] = []
    first = Waiting(first_in, second_in, 0.5, overlapped.append)
    second = Waiting(second_in, threading.Event(), 0.0, overlapped.append)
    x = torch.randn(3, 8)
    totals: dict[str, int] = {}

    def run(name: str, model: nn.Module, after: threading.Event | None) -> None:
        if after is not None:
            assert after.wait(WAIT)
        totals[name] = _fresh(model, x)

    threads = [threading.Thread(target=run, args=("first", first, None)),
               threading.Thread(target=run, args=("second", second, first_in))]
    for thread in threads:
        thread.start()
    _join(*threads)
    assert overlapped == [False, False]  # the second run never started while the first ran
    assert totals == {"first": LINEAR, "second": LINEAR}
    assert _torch_state() == before


@pytest.mark.parametrize("same", [False, True], ids=["different models", "one model"])
def test_analyses_in_threads_count_as_alone_and_leave_the_model(same: bool) -> None:
    """Analyses of one model or of two, from several threads started together, count what one alone counts;
    the model is left as it was (its tensors, not stand-ins of another thread's run), torch as found."""
    before = _torch_state()
    models = [nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(2)]
    if same:
        models[1] = models[0]
    x = torch.randn(3, 8)
    parameters = [list(m.parameters()) for m in models]
    values = [[p.detach().clone() for p in ps] for ps in parameters]
    start = threading.Barrier(4)
    totals: list[int] = []

    def run(model: nn.Module) -> None:
        start.wait(WAIT)
        for _ in range(3):
            totals.append(_fresh(model, x))

    threads = [threading.Thread(target=run, args=(models[i % 2],)) for i in range(4)]
    for thread in threads:
        thread.start()
    _join(*threads)
    assert totals == [2 * LINEAR] * 12
    for model, ps, vs in zip(models, parameters, values, strict=True):
        assert all(a is b and torch.equal(a, v) for a, b, v in zip(model.parameters(), ps, vs, strict=True))
    assert _torch_state() == before


def _training_step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """A forward, a backward and a plain gradient step; the parameters after it."""
    loss = model(x).pow(2).sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return [p.detach().clone() for p in model.parameters()]


def test_another_threads_training_is_neither_recorded_nor_changed() -> None:
    """A training step in another thread while the analysis's forward waits: its module calls reach the recorder's
    process-wide hooks, its operators none (the modes are the recording thread's); the analysis counts as alone, the
    step's parameters end as without the analysis, and the other model keeps no hook."""
    inside, done = threading.Event(), threading.Event()
    overlapped: list[bool] = []
    analysed = Waiting(inside, done, WAIT, overlapped.append)
    x = torch.randn(3, 8)
    alone = _fresh(Waiting(threading.Event(), threading.Event(), 0.0, [].append), x)
    trainee = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    batch = torch.randn(5, 8)
    expected = _training_step(copy.deepcopy(trainee), batch)
    stepped: list[list[torch.Tensor]] = []

    def train() -> None:
        assert inside.wait(WAIT)
        stepped.append(_training_step(trainee, batch))
        done.set()

    thread = threading.Thread(target=train)
    thread.start()
    with SHARED.set_aside():
        analysis = FlopCountAnalysis(analysed, x, convention="macs")
        total = analysis.total()
    _join(thread)
    assert overlapped == [True]  # the step ran during the analysis's run
    assert total == alone == LINEAR
    assert {scope[-1] for scope in analysis.trace.scopes if scope} == {"", "lin"}  # the model and its Linear
    assert all(torch.equal(a, b) for a, b in zip(stepped[0], expected, strict=True))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in trainee.modules())


class Threaded(nn.Module):
    """A forward that runs one of its two Linear(8, 8) on a thread of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with ThreadPoolExecutor(1) as pool:
            branch = pool.submit(self.b, x)
            return self.a(x) + branch.result()


def test_a_module_run_on_a_thread_of_the_models_own_fails_the_run() -> None:
    """Its operators reach no recorder (the modes are the recording thread's): counted, ``b`` would be a silent
    zero. The run fails and says which module; torch and the model are left as found."""
    before = _torch_state()
    model = Threaded()
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ModelRunError, match="module 'b' of the model was called on another thread"), \
            SHARED.set_aside():
        modelmeter.analyze(model, torch.randn(3, 8), quiet=True, execution="real")
    assert _torch_state() == before
    assert all(p.device.type == "cpu" and torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))


# --- the collector's pauses ----------------------------------------------------------------------------------------


@pytest.fixture
def collector() -> Iterator[None]:
    """The collector back on after the test, whatever it did."""
    try:
        yield
    finally:
        gc.enable()


def _overlapping_pauses(first_ends_first: bool, during: Callable[[], None] = lambda: None) -> list[bool]:
    """Two pauses in two threads, the second beginning while the first is open, ending in the order asked;
    ``during`` runs while both are open. The collector's state after each end."""
    states: list[bool] = []
    begun = [threading.Event(), threading.Event()]
    end = [threading.Event(), threading.Event()]
    ended = [threading.Event(), threading.Event()]

    def pause(i: int) -> None:
        if i == 1:
            assert begun[0].wait(WAIT)
        with gc_pause.no_gc():
            begun[i].set()
            assert end[i].wait(WAIT)
        states.append(gc.isenabled())
        ended[i].set()

    threads = [threading.Thread(target=pause, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    assert begun[1].wait(WAIT)
    during()
    for i in ((0, 1) if first_ends_first else (1, 0)):
        end[i].set()
        assert ended[i].wait(WAIT)
    _join(*threads)
    return states


@pytest.mark.parametrize("first_ends_first", [True, False])
def test_overlapping_pauses_restore_the_collector_when_the_last_ends(collector: None, first_ends_first: bool) -> None:
    """The first pause to end must not turn the collector on while the other runs; the last puts it back on."""
    assert _overlapping_pauses(first_ends_first) == [False, True]
    gc.disable()
    assert _overlapping_pauses(first_ends_first) == [False, False]  # the user's: off


def test_a_collector_turned_on_during_the_pauses_stays_on(collector: None) -> None:
    """The user turned it off, then on again in another thread while two pauses ran: the last leaves it on."""
    gc.disable()
    assert _overlapping_pauses(True, during=gc.enable) == [True, True]


def test_an_analysis_leaves_a_collector_the_user_turned_off_off(collector: None) -> None:
    gc.disable()
    modelmeter.analyze(nn.Linear(8, 8), torch.randn(3, 8), quiet=True)
    assert not gc.isenabled()


# --- the shared recording across threads, and library functions replaced ----------------------------------------


def test_a_recording_is_shared_across_threads_and_not_after_an_in_place_change_made_meanwhile(
        recordings: list[RunSpec]) -> None:
    """A recording made in one thread is shared by another thread's analysis of the same call. A parameter changed
    in place by another thread while a recording is under way (the recording waits for it: ``record`` is no part of
    the key) makes the next look-up record anew: the recording is kept under the state before it."""
    model, x = nn.Linear(8, 8), torch.randn(3, 8)
    SHARED.clear()
    traces: list[Any] = []
    for _ in range(2):
        thread = threading.Thread(target=lambda: traces.append(FlopCountAnalysis(model, x).trace))
        thread.start()
        _join(thread)
    assert traces[0] is traces[1] and len(recordings) == 1
    spec = RunSpec.of(model, x)
    recording, changed = threading.Event(), threading.Event()

    def change() -> None:
        assert recording.wait(WAIT)
        with torch.no_grad():
            model.weight.add_(1.0)
        changed.set()

    def record() -> Any:
        recording.set()
        assert changed.wait(WAIT)
        return record_trace(spec)

    SHARED.clear()
    changer = threading.Thread(target=change)
    changer.start()
    first = SHARED.share(spec, record)
    _join(changer)
    assert first.recorded
    again = SHARED.share(spec, lambda: record_trace(spec))
    assert again.recorded and again.trace is not first.trace
    assert SHARED.share(spec, lambda: record_trace(spec)).trace is again.trace  # unchanged since: shared


def mine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear of the user's: two products, twice the multiply-adds of ``F.linear``."""
    y = x @ weight.t() @ torch.eye(weight.shape[0])
    return y if bias is None else y + bias


class CallsLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LinearOf:
    """Stands for ``torch.nn.functional`` in ``torch.nn.modules.linear``: its ``linear`` is :func:`mine`."""

    linear = staticmethod(mine)


@pytest.mark.parametrize("where", ["F.linear", "linear.F"])
@pytest.mark.parametrize("model_of", [lambda: nn.Linear(8, 8), CallsLinear], ids=["nn.Linear", "user code"])
def test_a_library_function_replaced_between_two_analyses_is_not_taken_from_the_shared_recording(
        where: str, model_of: Callable[[], nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    """``F.linear = mine`` (or ``F`` itself replaced in the module of ``nn.Linear``) between two analyses: the second
    counts what a fresh recording counts, and so does a third once the function is put back."""
    model, x = model_of(), torch.randn(3, 8)
    SHARED.clear()
    assert _total(model, x) == LINEAR
    if where == "F.linear":
        monkeypatch.setattr(F, "linear", mine)
    else:
        monkeypatch.setattr(nn.modules.linear, "F", LinearOf)
    if where == "linear.F" and isinstance(model, CallsLinear):
        assert _total(model, x) == LINEAR == _fresh(model, x)  # its code reads F from its own module
    else:
        assert _total(model, x) == 2 * LINEAR == _fresh(model, x)
    monkeypatch.undo()
    assert _total(model, x) == LINEAR == _fresh(model, x)


def test_a_submodule_imported_meanwhile_keeps_the_recording_shared(recordings: list[RunSpec],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing a submodule adds its name to its package (``torch._dynamo`` on a first compile): no lookup that
    worked before changes, so the recording is still shared; a name bound to a function added is a change."""
    import types

    model, x = nn.Linear(8, 8), torch.randn(3, 8)
    SHARED.clear()
    first = FlopCountAnalysis(model, x).trace
    monkeypatch.setattr(F, "modelmeter_test_submodule", types.ModuleType("modelmeter_test_submodule"), raising=False)
    assert FlopCountAnalysis(model, x).trace is first and len(recordings) == 1
    monkeypatch.setattr(F, "modelmeter_test_function", mine, raising=False)
    assert FlopCountAnalysis(model, x).trace is not first and len(recordings) == 2


Draws = tuple[float, float, float]  # one number from each of torch's, Python's and numpy's generators


def _seeded() -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def _draws() -> Draws:
    """One number from each of torch's CPU generator, Python's ``random`` and numpy's global generator."""
    return float(torch.rand(())), random.random(), float(np.random.rand())


def _two_draws_in_turn() -> tuple[Draws, Draws]:
    """The oracle: the first and second numbers of each generator after :func:`_seeded`, drawn by one thread."""
    _seeded()
    return _draws(), _draws()


class Drawing(nn.Module):
    """Linear(8, 8) whose forward draws from Python's ``random`` (``"random"`` in ``generators``), marks ``inside``,
    waits (at most ``WAIT`` seconds) for ``go``, then reads a number drawn by torch (``"torch"``: a fake run fails on
    the read and the real one runs); ``read`` is told the numbers (a list's ``append``: a run puts
    back the lists a model holds)."""

    def __init__(self, generators: tuple[str, ...], inside: threading.Event, go: threading.Event,
                 read: Callable[[float], None]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.generators, self.inside, self.go, self.read = generators, inside, go, read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "random" in self.generators:
            self.read(random.random())
        self.inside.set()
        self.go.wait(WAIT)
        if "torch" in self.generators:
            self.read(torch.rand_like(x)[0, 0].item())
        return self.lin(x)


def _analysed_while_another_thread_draws(model_draws: tuple[str, ...], execution: str
                                         ) -> tuple[list[float], Draws, Draws]:
    """Seed, analyse a :class:`Drawing` model while another thread draws once from each generator inside the first
    attempt's forward, then draw once more here: (what the model read, the other thread's draws, the draws after)."""
    inside, go = threading.Event(), threading.Event()
    read: list[float] = []
    model, x = Drawing(model_draws, inside, go, read.append), torch.randn(3, 8)
    drawn: list[Draws] = []

    def draw() -> None:
        assert inside.wait(WAIT)
        drawn.append(_draws())
        go.set()

    thread = threading.Thread(target=draw)
    _seeded()
    thread.start()
    with SHARED.set_aside():
        analysis = FlopCountAnalysis(model, x, convention="macs", execution=execution)  # type: ignore[arg-type]
        assert analysis.total() == LINEAR
    _join(thread)
    return read, drawn[0], _draws()


@pytest.mark.parametrize("execution", ["fake", "real", "auto"])
def test_another_threads_draws_during_an_analysis_are_not_drawn_again(execution: str) -> None:
    """Thread B draws from torch's, Python's and numpy's generators while an analysis's forward (of a model that
    draws nothing) waits: afterwards the next numbers are the ones after B's, not B's again (the run puts back only
    the generators it drew from)."""
    first, second = _two_draws_in_turn()
    assert _analysed_while_another_thread_draws((), execution) == ([], first, second)


def test_generators_the_run_drew_from_are_put_back_and_the_others_not() -> None:
    """The model draws from Python's ``random``, thread B from all three during the forward: Python's generator is
    put back as the caller left it (the run drew: B's number is drawn again, as documented), torch's and numpy's
    keep B's draws."""
    first, second = _two_draws_in_turn()
    read, other, after = _analysed_while_another_thread_draws(("random",), "fake")
    assert read == [first[1]]
    assert other == (first[0], second[1], first[2])  # B drew after the model's random.random()
    assert after == (second[0], first[1], second[2])


def test_every_attempt_starts_from_the_callers_states_while_another_thread_draws() -> None:
    """The model draws from Python's ``random``, waits for thread B's draws (in the first attempt only), then reads a
    number drawn by torch: the fake attempts fail on the read (their ``rand_like`` drew nothing: no kernels) and the
    real one runs. Every attempt reads Python's first number (put back after each); the real one reads torch's
    number after B's (the fake ones left B's draw in place), and torch's generator is put back to it; numpy's keeps
    B's draw."""
    first, second = _two_draws_in_turn()
    read, other, after = _analysed_while_another_thread_draws(("random", "torch"), "auto")
    assert len(read) > 2  # random's number in each attempt, torch's in the real one
    assert read == [first[1]] * (len(read) - 1) + [second[0]]
    assert other == (first[0], second[1], first[2])
    assert after == (second[0], first[1], second[2])


class Seeding(nn.Module):
    """Linear(8, 8) whose forward seeds torch's, Python's and numpy's generators (no operator draws)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(123)
        random.seed(123)
        np.random.seed(123)
        return self.lin(x)


@pytest.mark.parametrize("execution", ["fake", "real"])
def test_a_forward_that_seeds_the_generators_leaves_the_callers_states(execution: str) -> None:
    """Seeding is no operator (no recorder sees it): the seeding functions called on the recording thread count as
    the run's draws, so the caller's next numbers are those it would have drawn without the analysis."""
    first, _ = _two_draws_in_turn()
    model, x = Seeding(), torch.randn(3, 8)
    _seeded()
    with SHARED.set_aside():
        assert _total_with(model, x, execution) == LINEAR
    assert _draws() == first


@pytest.mark.parametrize("seeding", ["wrapped manual_seed", "the generator's own"])
def test_a_forward_that_seeds_torch_however_leaves_the_callers_state(seeding: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Importing torch._dynamo replaces ``torch.manual_seed`` with a wrapper of its own (no longer the function a
    watch would replace), and ``torch.default_generator.manual_seed`` is no function of torch's module at all: a
    seeding is told by the generator's new seed instead."""
    original = torch.manual_seed
    if seeding == "wrapped manual_seed":
        monkeypatch.setattr(torch, "manual_seed", lambda seed: original(seed))  # as torch._dynamo's wrapper

    class Seeds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if seeding == "wrapped manual_seed":
                torch.manual_seed(123)
            else:
                torch.default_generator.manual_seed(123)
            return self.lin(x)

    model, x = Seeds(), torch.randn(3, 8)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    with SHARED.set_aside():
        assert _total_with(model, x, "fake") == LINEAR
    assert torch.equal(torch.rand(4), expected)


def _total_with(model: nn.Module, x: torch.Tensor, execution: str) -> int:
    return int(FlopCountAnalysis(model, x, convention="macs", execution=execution).total())  # type: ignore[arg-type]
