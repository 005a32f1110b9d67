"""Caches against changes that should change the answer: each second analysis must count what a fresh analysis
(no shared recording, no disk cache) counts, and an unchanged call must still be served.

The values a fake run reads — an input's or a buffer's (an attention mask's summary, ``.item()`` of a counter) —
are covered by neither key (both key tensors by metadata; in-process also by version counter, which
``.data.fill_()`` and writes through ``.numpy()`` do not bump); a cost guard must judge the model as it runs now,
also after a change no key sees (a data file it reads)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelmeter import analyze
from modelmeter.cache.shared import SHARED
from modelmeter.guard import CostAssertionError, assert_cost


@pytest.fixture(autouse=True)
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache directory (never the user's) and no shared recordings of other tests."""
    root = tmp_path / "modelmeter-cache"
    monkeypatch.setenv("MODELMETER_CACHE", str(root))
    SHARED.clear()
    yield root
    SHARED.clear()


def fresh(model: nn.Module, inputs: Any) -> int:
    """The flops of a new recording: no shared recording, no disk cache."""
    SHARED.clear()
    total = analyze(model, inputs, cache=False, quiet=True).flops.total()
    SHARED.clear()
    return total


class Masked(nn.Module):
    """Self-attention over 8 positions whose mask is an input: a formula counts the pairs it lets through."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.lin(x).view(1, 2, 8, 8)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


class Counter(nn.Module):
    """Runs its layer as often as a buffer says (``int()`` of a buffer: read by the fake run, no real kernels)."""

    def __init__(self, times: int = 1) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("times", torch.tensor(times))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(int(self.times)):
            x = self.lin(x)
        return x


class CausalInside(nn.Module):
    """A mask made inside ``forward`` from shapes alone: its values are read, but none of the caller's."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.lin(x).view(1, 2, 8, 8)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool).tril())


FULL = torch.ones(8, 8, dtype=torch.bool)
CAUSAL = torch.ones(8, 8, dtype=torch.bool).tril()


def test_input_and_buffer_values_a_fake_run_reads_are_never_served_from_the_disk_cache(cache_env: Path) -> None:
    x = torch.randn(1, 8, 16)
    first = analyze(Masked(), (x, FULL), cache=True, quiet=True)
    second = analyze(Masked(), (x, CAUSAL.clone()), cache=True, quiet=True)  # new objects: the disk key alone
    assert not second.from_cache and second.flops.total() == fresh(Masked(), (x, CAUSAL)) < first.flops.total()
    assert analyze(Counter(1), torch.randn(2, 8), cache=True, quiet=True).flops.total() == 2 * 8 * 8
    thrice = analyze(Counter(3), torch.randn(2, 8), cache=True, quiet=True)
    assert not thrice.from_cache and thrice.flops.total() == 3 * 2 * 8 * 8 == fresh(Counter(3), torch.randn(2, 8))
    assert not (cache_env / "traces").exists() or not list((cache_env / "traces").glob("*.json.gz"))


def test_values_made_from_shapes_alone_keep_the_disk_cache(cache_env: Path) -> None:
    x = torch.randn(1, 8, 16)
    first = analyze(CausalInside(), x, cache=True, quiet=True)
    second = analyze(CausalInside(), x.clone(), cache=True, quiet=True)
    assert not first.from_cache and second.from_cache
    assert json.dumps(second.result().to_dict()) == json.dumps(first.result().to_dict())
    assert second.flops.total() == fresh(CausalInside(), x)


def _data_fill(model: Counter, x: torch.Tensor) -> None:
    model.times.data.fill_(3)  # .data has a version counter of its own: the buffer's is not bumped


def _numpy_write(model: Counter, x: torch.Tensor) -> None:
    model.times.numpy()[...] = 3  # numpy writes bump no version counter


def _mask_numpy_write(model: nn.Module, inputs: Any) -> None:
    inputs[1].numpy()[...] = CAUSAL.numpy()


@pytest.mark.parametrize("change", [_data_fill, _numpy_write])
def test_a_buffer_changed_behind_its_version_counter_is_recorded_anew(change: Callable[..., None]) -> None:
    model, x = Counter(1), torch.randn(2, 8)
    assert analyze(model, x, quiet=True).flops.total() == 2 * 8 * 8
    change(model, x)
    assert analyze(model, x, quiet=True).flops.total() == fresh(model, x) == 3 * 2 * 8 * 8


def test_an_input_mask_changed_behind_its_version_counter_is_recorded_anew() -> None:
    model, inputs = Masked(), (torch.randn(1, 8, 16), FULL.clone())
    dense = analyze(model, inputs, quiet=True).flops.total()
    _mask_numpy_write(model, inputs)
    assert analyze(model, inputs, quiet=True).flops.total() == fresh(model, inputs) < dense


def test_a_value_reading_recording_is_still_shared_while_its_values_are_the_same() -> None:
    model, inputs = Masked(), (torch.randn(1, 8, 16), CAUSAL.clone())
    first = analyze(model, inputs, quiet=True)
    second = analyze(model, inputs, quiet=True)
    assert second.trace is first.trace  # one recording for both
    assert json.dumps(second.result().to_dict()) == json.dumps(first.result().to_dict())


class ReadsAFile(nn.Module):
    """Runs its layer as often as a data file says, read in ``forward``: what neither key can see."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = str(path)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with open(self.path) as f:
            times = json.load(f)["times"]
        for _ in range(times):
            x = self.lin(x)
        return x


def test_a_guard_never_takes_a_recording_shared_in_process(tmp_path: Path) -> None:
    data, baseline = tmp_path / "times.json", tmp_path / "costs.json"
    data.write_text('{"times": 1}')
    model, x = ReadsAFile(data), torch.randn(2, 8)
    assert_cost(model, x, baseline, name="m", update=True)
    analyze(model, x, quiet=True).result()  # a plain analysis in this state: kept in-process
    data.write_text('{"times": 3}')
    with pytest.raises(CostAssertionError, match="grew"):
        assert_cost(model, x, baseline, name="m")
    assert fresh(model, x) == 3 * 2 * 8 * 8


class Gated(nn.Module):
    """Runs its layer twice while a parameter is positive: ``.item()`` of a parameter needs real kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gate = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.lin(x)) if self.gate.item() > 0 else self.lin(x)


@pytest.mark.parametrize("execution", ["real", "auto"])
def test_a_parameter_a_real_run_read_changed_behind_its_version_counter_is_recorded_anew(execution: str) -> None:
    model, x = Gated(), torch.randn(2, 8)
    assert analyze(model, x, execution=execution, quiet=True).flops.total() == 2 * 2 * 8 * 8
    model.gate.data.fill_(-1)
    again = analyze(model, x, execution=execution, quiet=True).flops.total()
    SHARED.clear()
    assert again == analyze(model, x, execution=execution, quiet=True).flops.total() == 2 * 8 * 8
