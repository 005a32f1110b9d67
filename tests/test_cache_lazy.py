"""A trace read from the cache makes its events and storages only when something reads them (issue 20): a hit with
a result kept beside it makes none, and what is made equals the recording, field by field, and counts what the
recording counts (results compared by ``repr``, every field and its type)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from families import _llama
from modelmeter import analyze
from modelmeter.engine import serialize
from modelmeter.engine.serialize import dumps, loads
from modelmeter.engine.trace import OpEvent, Storage, TensorMeta, Trace
from trace_equality import assert_same_trace


@pytest.fixture
def cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache directory for the test (never the user's real cache)."""
    root = tmp_path / "modelmeter-cache"
    monkeypatch.setenv("MODELMETER_CACHE", str(root))
    monkeypatch.delenv("MODELMETER_CACHE_SIZE", raising=False)
    return root


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How often a trace read back made its events and storages."""
    calls: list[int] = []
    make = serialize._Records.__call__

    def counting(self: Any) -> Any:
        calls.append(1)
        return make(self)

    monkeypatch.setattr(serialize._Records, "__call__", counting)
    return calls


def _encoder() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True), torch.randn(2, 10, 32)


def _cnn() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4))
    return model, torch.randn(2, 3, 16, 16)


def _mlp() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)), torch.randn(4, 16)


def _meta_llama() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    return _llama()


TRAINING = {"backward": True, "memory": True, "optimizer": "adamw", "device": "h100", "quiet": True}
CASES: dict[str, tuple[Callable[[], tuple[nn.Module, Any]], dict[str, Any]]] = {
    "attention, a training step": (_encoder, TRAINING),
    "llama, backward and memory": (_meta_llama, {"backward": True, "memory": True, "quiet": True}),
    "cnn, inference memory": (_cnn, {"memory": True, "device": "a100", "quiet": True}),
    # No device: a roofline counted in this process before the plan's run would fail it (the FSDP operators' byte
    # formulas bound before torch.distributed registers their schemas; a failure of its own, not the cache's).
    "parallel plan": (_mlp, {"backward": True, "memory": True, "optimizer": "adamw", "quiet": True,
                             "parallel": "fsdp=2"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hit_makes_no_events_for_a_kept_result_and_counts_what_a_recording_counts(cache_env: Path, made: list[int],
                                                                                     case: str) -> None:
    build, settings = CASES[case]
    other = {**settings, "convention": "flops"}  # a result not kept: counted from the trace read back
    fresh = analyze(*build(), cache=False, **settings)  # the oracle: a recording, no cache
    expected, expected_other = repr(fresh.result()), repr(analyze(*build(), cache=False, **other).result())
    first = analyze(*build(), cache=True, **settings)
    assert not first.from_cache and repr(first.result()) == expected  # recorded, stored, its result kept
    hit = analyze(*build(), cache=True, **settings)  # a new model: the disk cache, not the in-process recording
    assert hit.from_cache and repr(hit.result()) == expected
    assert made == []  # the kept result needed no events
    assert repr(analyze(*build(), cache=True, **other).result()) == expected_other and made == [1]
    assert hit.trace == fresh.trace and made == [1, 1]
    assert_same_trace(hit.trace, fresh.trace)


def _small_trace() -> Trace:
    meta = TensorMeta((2, 3), "float32", "cpu")
    events = [OpEvent("aten::relu", "dispatch", -1, 0, "forward", [meta], [meta]),
              OpEvent("aten::add", "dispatch", -1, 0, "backward", [meta, 1.5], [meta], {"alpha": 2}, origin=0)]
    return Trace(events=events, scopes=[()], storages=[Storage(24, "float32", "cpu", "input"),
                                                       Storage(24, "float32", "cpu", "activation", born=0, died=2)],
                 backward=True, model="Toy")


def test_a_deferred_trace_behaves_as_the_trace_it_was_read_from(made: list[int]) -> None:
    trace = _small_trace()
    back = loads(dumps(trace))
    assert back.size("events") == 2 and back.size("storages") == 2 and back.size("scopes") == 1 and made == []
    assert back.model == "Toy" and made == []  # fields that were never deferred
    assert back == trace and repr(back) == repr(trace) and made == [1]
    assert back.size("events") == 2 and back.events[1].kwargs == {"alpha": 2}
    for other in (copy.copy(loads(dumps(trace))), copy.deepcopy(loads(dumps(trace))),
                  pickle.loads(pickle.dumps(loads(dumps(trace)))),
                  dataclasses.replace(loads(dumps(trace)), model="Toy")):
        assert other == trace
    assert dataclasses.asdict(loads(dumps(trace))) == dataclasses.asdict(trace)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = loads(dumps(trace)).nothing  # type: ignore[attr-defined]
    assert not hasattr(back, "nothing") and getattr(loads(dumps(trace)), "nothing", 7) == 7


def test_a_field_assigned_before_the_deferred_ones_are_made_keeps_its_value(made: list[int]) -> None:
    trace = _small_trace()
    back = loads(dumps(trace))
    back.events = trace.events[:1]
    assert back.size("events") == 1 and back.size("storages") == 2 and made == []
    assert back.storages == trace.storages and made == [1]
    assert back.events == trace.events[:1]


def test_a_damaged_column_is_found_when_the_entry_is_read_not_when_a_metric_reads_it() -> None:
    data = serialize.trace_to_dict(_small_trace())
    origin = [f.name for f in dataclasses.fields(OpEvent)].index("origin")
    data["events"][origin] = serialize._packed([-1, 1])  # the second event's origin is itself
    with pytest.raises(ValueError, match="origin is not an earlier event"):
        serialize.trace_from_dict(data)
