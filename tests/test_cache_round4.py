"""Caches against staleness, a fourth round: a library function replaced by the user, the user's code put into a
library's namespace, an enum's class edited. Oracle: the model analysed afresh, without a cache."""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelmeter import FlopCountAnalysis, analyze
from modelmeter.cache import trace_key
from modelmeter.cache.shared import SHARED
from modelmeter.engine.spec import RunSpec


@pytest.fixture(autouse=True)
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache directory for every test, and no recording shared from another test."""
    root = tmp_path / "modelmeter-cache"
    monkeypatch.setenv("MODELMETER_CACHE", str(root))
    SHARED.clear()
    return root


class Gelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


REPEAT = 2


def my_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return torch.cat([x] * REPEAT) @ torch.ones(16, 16)


def fresh(model: nn.Module, x: torch.Tensor) -> int:
    """The oracle: the model analysed now, with neither cache."""
    SHARED.clear()
    return FlopCountAnalysis(model, x, cache=False).total()


def key(model: nn.Module, x: torch.Tensor) -> str:
    k = trace_key(RunSpec(model, (x,)))
    assert k is not None
    return k


def test_a_library_function_replaced_changes_the_disk_key_and_put_back_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4, 16)
    base = key(Gelu(), x)
    monkeypatch.setattr(F, "gelu", my_gelu)  # the user's function, in torch's namespace
    mine = key(Gelu(), x)
    assert mine != base
    monkeypatch.setattr(sys.modules[__name__], "REPEAT", 3)  # what the user's function reads: walked as code
    assert key(Gelu(), x) not in (base, mine)
    monkeypatch.setattr(F, "gelu", F.relu)  # another of torch's own functions under the name
    assert key(Gelu(), x) != base
    monkeypatch.undo()
    assert key(Gelu(), x) == base  # put back: the same key (a hit)


def test_a_process_that_replaced_a_library_function_is_not_served_the_others_trace(cache_env: Path) -> None:
    script = (
        "import sys, json, torch, modelmeter\n"
        "import torch.nn.functional as F\n"
        "from torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = nn.Linear(16, 16)\n"
        "    def forward(self, x):\n"
        "        return F.gelu(self.fc(x))\n"
        "if sys.argv[1] == 'patched':\n"
        "    F.gelu = lambda x, approximate='none': torch.cat([x, x]) @ torch.ones(16, 16)\n"
        "if sys.argv[1] == 'more of torch':\n"
        "    import torch._dynamo, torch.distributed  # more submodules, torch's own wrappers: the same lookups\n"
        "x = torch.randn(4, 16)\n"
        "oracle = modelmeter.analyze(M(), x).flops.total()\n"
        "modelmeter.cache.shared.SHARED.clear()\n"
        "cached = modelmeter.analyze(M(), x, cache=True)\n"
        "print(json.dumps([oracle, cached.flops.total(), cached.from_cache]))\n")
    env = {**os.environ, "MODELMETER_CACHE": str(cache_env)}

    def run(mode: str) -> list[int]:
        proc = subprocess.run([sys.executable, "-c", script, mode], env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        return list(json.loads(proc.stdout.strip().splitlines()[-1]))

    plain = run("plain")
    assert plain[:2] == [plain[0]] * 2 and not plain[2]
    assert run("more of torch") == [plain[0], plain[0], True]  # unchanged lookups: a hit
    patched = run("patched")
    assert patched[0] == 3 * plain[0] and patched[:2] == [patched[0]] * 2 and not patched[2]
    assert run("patched") == [patched[0], patched[0], True]  # the same replacement again: a hit of its own
    assert run("plain") == [plain[0], plain[0], True]


def test_the_users_function_in_a_librarys_namespace_is_walked_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "gelu", my_gelu)
    model, x = Gelu(), torch.randn(4, 16)
    first = FlopCountAnalysis(model, x)
    assert first.total() == fresh(model, x)
    again = FlopCountAnalysis(model, x)
    second = FlopCountAnalysis(model, x)
    assert second.trace is again.trace  # unchanged: shared
    monkeypatch.setattr(sys.modules[__name__], "REPEAT", 5)  # a global of the user's function, not of the model
    changed = FlopCountAnalysis(model, x).total()
    assert changed == fresh(model, x) == first.total() + 3 * 4 * 16 * 16  # three more 4x16 @ 16x16


def make_mode(repeat: int) -> type[enum.Enum]:
    """An enum class as a file of the user's defines it: another process may read another version of the file."""
    namespace: dict[str, object] = {"enum": enum, "__name__": __name__}
    exec(f"class Mode(enum.Enum):\n    A = {repeat}\n    B = 7\n", namespace)
    mode = namespace["Mode"]
    assert isinstance(mode, type) and issubclass(mode, enum.Enum)
    return mode


class Repeats(nn.Module):
    def __init__(self, mode: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.mode = mode  # reached only as an attribute's value: its class is not named by the code

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([x] * self.mode.value))


def test_an_enum_member_is_keyed_with_its_classs_code() -> None:
    x = torch.randn(4, 16)
    one, two = make_mode(1).A, make_mode(2).A  # the same module, name and member: other values
    assert key(Repeats(one), x) == key(Repeats(make_mode(1).A), x)  # the same definition: a hit
    assert key(Repeats(one), x) != key(Repeats(two), x)
    assert analyze(Repeats(two), x, cache=True).flops.total() == fresh(Repeats(two), x) == 2 * fresh(Repeats(one), x)


SCALE = 1


class Scaled(enum.Enum):
    A = 1

    @property
    def repeat(self) -> int:
        return self.value * SCALE


class ScaledRepeats(Repeats):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([x] * self.mode.repeat))  # (Scaled is not named here)


def test_an_enums_method_reading_a_global_records_again_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = ScaledRepeats(Scaled.A), torch.randn(4, 16)
    first = FlopCountAnalysis(model, x)
    assert first.total() == fresh(model, x)
    kept = FlopCountAnalysis(model, x)
    assert FlopCountAnalysis(model, x).trace is kept.trace  # unchanged: shared
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3)
    assert FlopCountAnalysis(model, x).total() == fresh(model, x) == 3 * first.total()


class AddsTwo(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * 2 + b).sum()


def two_key(model: nn.Module, *args: torch.Tensor) -> str:
    k = trace_key(RunSpec(model, args))
    assert k is not None
    return k


def test_inputs_that_are_views_of_one_storage_are_keyed_as_such() -> None:
    from modelmeter.memory import MemoryAnalysis

    def peaks(*args: torch.Tensor) -> tuple[int, int]:
        SHARED.clear()
        oracle = MemoryAnalysis(AddsTwo(), args, cache=False).peak()
        SHARED.clear()
        return oracle, MemoryAnalysis(AddsTwo(), args, cache=True).peak()

    big = torch.randn(100, 64, 64)
    separate = (torch.randn(64, 64), torch.randn(64, 64))
    separate_peak, _ = peaks(*separate)  # stored first: views of a 100x larger base must not be served its trace
    views_peak, served = peaks(big[50], big[51])
    assert served == views_peak > 20 * separate_peak  # the whole base (1.6 MB) is live
    assert peaks(big[49], big[50]) == (views_peak, views_peak)
    assert two_key(AddsTwo(), big[50], big[51]) == two_key(AddsTwo(), *torch.randn(100, 64, 64)[50:52])  # a hit
    assert two_key(AddsTwo(), big[50], big[51]) != two_key(AddsTwo(), big[50], big[50])  # one storage, one offset
    assert two_key(AddsTwo(), big[50], big[51]) != two_key(AddsTwo(), big[50], torch.randn(100, 64, 64)[51])


def doubled_linear(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(torch.cat([x] * REPEAT), self.weight, self.bias)


def test_a_method_of_an_installed_class_replaced_changes_both_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = nn.Sequential(nn.Linear(16, 16), nn.ReLU()), torch.randn(4, 16)
    base = key(model, x)
    plain = FlopCountAnalysis(model, x)
    assert plain.total() == fresh(model, x)
    monkeypatch.setattr(nn.Linear, "forward", doubled_linear)  # the user's method on torch's class
    assert key(model, x) != base
    doubled = FlopCountAnalysis(model, x).total()  # in-process: recorded anew
    assert doubled == fresh(model, x) == 2 * plain.total()
    assert analyze(model, x, cache=True).flops.total() == doubled  # the disk: not the plain run's entry
    monkeypatch.setattr(sys.modules[__name__], "REPEAT", 3)  # what the user's method reads
    assert FlopCountAnalysis(model, x).total() == fresh(model, x) == 3 * plain.total()
    monkeypatch.setattr(nn.ReLU, "forward", nn.Identity.forward)  # one of torch's methods in another's place
    relu_swapped = key(model, x)
    monkeypatch.undo()
    assert relu_swapped != key(model, x) == base  # put back: the same key (a hit)


def test_the_class_records_keep_no_class_alive() -> None:
    """A class made at run time that counts as installed (torch.fx makes one per GraphModule) is freed with its last
    user, after both keys read its namespace."""
    import gc
    import weakref

    from modelmeter.cache.shared import call_state

    made = type("Made", (nn.Linear,), {"__module__": "torch.nn.modules.linear"})
    spec = RunSpec(made(2, 2), (torch.randn(1, 2),))
    assert trace_key(spec) is not None and call_state(spec) is not None
    ref = weakref.ref(made)
    del made, spec
    gc.collect()
    assert ref() is None


def doubled_grads(module: nn.Module, grad_input: Any, grad_output: Any) -> Any:
    return tuple(None if g is None else g * 2 for g in grad_input)


@pytest.mark.parametrize("where", ["module", "every module"])
def test_a_backward_hook_is_keyed(where: str) -> None:
    """A full backward hook wraps the module's call in BackwardHookFunctions (in the forward pass too): the trace
    differs, so neither cache may answer with the trace of the model without it."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 16, requires_grad=True)  # (a full hook on the first module wants an input with a gradient)
    base = key(model, x)
    plain = analyze(model, x, backward=True, cache=True)
    assert len(plain.trace.events) == len(analyze(model, x, backward=True, cache=False).trace.events)
    if where == "module":
        handle = model[0].register_full_backward_hook(doubled_grads)
    else:
        handle = nn.modules.module.register_module_full_backward_hook(doubled_grads)
    try:
        assert key(model, x) != base
        shared = analyze(model, x, backward=True)  # in-process: not the plain run's recording
        SHARED.clear()
        oracle = analyze(model, x, backward=True, cache=False).trace.events
        SHARED.clear()
        disk = analyze(model, x, backward=True, cache=True)  # the disk: not the plain run's entry
        assert shared.trace.events == oracle == disk.trace.events != plain.trace.events
    finally:
        handle.remove()
    assert key(model, x) == base


def test_a_namespace_that_makes_what_it_is_asked_for_is_keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``torch.classes`` namespace object (loading a quantized tensor leaves one in ``torch.classes``) raises
    RuntimeError, not AttributeError, for a name it does not know (``__file__``): both keys' walks of the namespaces
    the model's code reaches failed on one, and with them every later analysis of the process (found by the full
    suite's order: a checkpoint test, then the command's). Put where the walk of a Linear's code reads it."""
    monkeypatch.setattr(F, "made_on_demand", torch.classes.per_tensor_affine, raising=False)
    model, x = nn.Linear(3, 2), torch.randn(1, 3)
    trace_key(RunSpec(model, (x,), {}, None, "auto", False, None))  # raised "Tried to instantiate class ..."
    first = analyze(model, x, cache_dir=tmp_path, quiet=True)
    assert first.result().total("flops") == 6 and not first.from_cache
    again = analyze(model, x.clone(), cache_dir=tmp_path, quiet=True)
    assert again.result().total("flops") == 6 and again.from_cache


def test_a_wrapper_subclass_input_without_a_storage_address_is_keyed() -> None:
    """The disk key's record of where an input lies read its storage's address outside the guard that its storage
    has for: a wrapper subclass (``TwoTensor``, as DTensor) raised there, and its analyses were never cached."""
    from torch.testing._internal.two_tensor import TwoTensor

    x = TwoTensor(torch.randn(2, 4), torch.randn(2, 4))
    assert trace_key(RunSpec(nn.Linear(4, 2), (x,), {}, None, "auto", False, None)) is not None
