"""The memory timeline a Result carries (``Result.memory["timeline"]``): checked point by point against
``MemoryAnalysis.timeline()`` and ``peak_info()``, its stacks against the storages' lifetimes counted by brute force,
and its downsampling against the full timeline (the highest point of every bucket, the peak always kept)."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from modelmeter import MemoryAnalysis, Point, analyze, result_from_trace
from modelmeter.metrics.memory import MemoryModel, operand_copies
from modelmeter.metrics.memory_timeline import TIMELINE_KINDS, TIMELINE_POINTS, memory_timeline


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


class Checkpointed(nn.Module):
    """A block run under activation checkpointing between two plain layers: forward, backward and recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).relu()
        h = checkpoint(self.block, h, use_reentrant=False)
        return self.out(h)


def _analysis(model: nn.Module, x: torch.Tensor, optimizer: str | None, training: bool) -> MemoryAnalysis:
    return MemoryAnalysis(model, x, training=training, optimizer=optimizer)


CASES = [  # model, input, optimizer, training
    pytest.param(mlp, (3, 4), None, False, id="mlp-inference"),
    pytest.param(mlp, (3, 4), None, True, id="mlp-backward"),
    pytest.param(mlp, (3, 4), "adamw", True, id="mlp-adamw"),
    pytest.param(Checkpointed, (8, 16), "sgd", True, id="checkpointed-sgd"),
]


def _data(mem: MemoryAnalysis, max_points: int = TIMELINE_POINTS) -> dict[str, Any]:
    return memory_timeline(MemoryModel(mem.trace), mem.optimizer, max_points)


def _brute_force_stacks(mem: MemoryAnalysis, point: Point) -> Counter[str]:
    """Bytes live during the point's event by timeline kind, from the storages one by one: saved activations apart
    from the rest, the optimizer's state throughout and its temporaries at the step."""
    out: Counter[str] = Counter()
    for s in mem.trace.storages:
        if s.born <= point.event and (s.died < 0 or s.died > point.event):
            if s.kind == "activation":
                out["activation" if s.saved >= 0 else "temporary"] += s.nbytes
            else:
                out[s.kind] += s.nbytes
    out["temporary"] += operand_copies(mem.trace).get(point.event, 0)  # a kernel's own copies of broadcast operands
    by_kind = mem.peak_info().by_kind  # the optimizer's share is the same at every point of the step
    if "optimizer_state" in by_kind:
        out["optimizer_state"] = by_kind["optimizer_state"]
    if point.phase == "optimizer":
        out["optimizer_temporary"] = point.live - sum(out.values())
    return +out


def _point_values(data: dict[str, Any], i: int) -> dict[str, int]:
    return {kind: data["bytes"][kind][i] for kind in data["kinds"] if data["bytes"][kind][i]}


@pytest.mark.parametrize(("make", "shape", "optimizer", "training"), CASES)
def test_every_point_against_the_analysis(make: Any, shape: tuple[int, ...], optimizer: str | None,
                                          training: bool) -> None:
    torch.manual_seed(0)
    mem = _analysis(make(), torch.randn(*shape), optimizer, training)
    timeline, top = mem.timeline(), mem.peak_info()
    data = _data(mem)
    assert data["length"] == len(timeline) and data["bucket"] == 1
    assert data["position"] == list(range(len(timeline)))
    assert list(data["bytes"]) == data["kinds"] == sorted(data["kinds"], key=TIMELINE_KINDS.index)
    assert all(any(data["bytes"][kind]) for kind in data["kinds"])  # a kind with no bytes anywhere is left out
    for i, point in enumerate(timeline):
        stacks = _point_values(data, i)
        assert sum(stacks.values()) == point.live
        assert stacks == _brute_force_stacks(mem, point)
        assert data["modules"][data["module"][i]] == point.module
        assert data["operators"][data["operator"][i]] == point.operator
    runs = [[point.phase, i] for i, point in enumerate(timeline) if i == 0 or timeline[i - 1].phase != point.phase]
    assert data["phases"] == runs
    # the peak: the analysis's own point, its make-up the peak's by_kind (saved activations and the rest apart)
    assert timeline[data["peak"]] == top.at and top.bytes == max(point.live for point in timeline)
    at_peak = Counter(_point_values(data, data["peak"]))
    at_peak["activation"] += at_peak.pop("temporary", 0)
    assert +at_peak == Counter(top.by_kind)


def test_inference_by_hand() -> None:
    """The MLP of tests/test_memory.py: inference saves nothing, so every activation is a temporary; the peak is
    at the ReLU, with linear1's 3x8 output and the ReLU's own beside the parameters and the input."""
    data = _data(MemoryAnalysis(mlp(), torch.randn(3, 4)))
    assert data["kinds"] == ["parameter", "input", "temporary"]
    assert data["phases"] == [["forward", 0]]
    peak = data["peak"]
    assert _point_values(data, peak) == {"parameter": 232, "input": 48, "temporary": 2 * 3 * 8 * 4}
    assert (data["modules"][data["module"][peak]], data["operators"][data["operator"][peak]]) == ("1", "relu")


def test_training_splits_saved_activations_from_temporaries() -> None:
    """The checkpointed block saves only its input in the forward pass and its intermediates are made again in the
    backward pass; a training step has the optimizer's state throughout and its temporaries at the step only."""
    torch.manual_seed(0)
    mem = _analysis(Checkpointed(), torch.randn(8, 16), "adam", True)
    data = _data(mem)
    assert [phase for phase, _ in data["phases"]] == ["forward", "backward", "recompute", "backward", "optimizer"]
    assert {"activation", "temporary", "gradient", "optimizer_state", "optimizer_temporary"} <= set(data["kinds"])
    state = data["bytes"]["optimizer_state"]
    assert len(set(state)) == 1 and state[0] == mem.peak_info().by_kind["optimizer_state"] > 0
    assert [i for i, b in enumerate(data["bytes"]["optimizer_temporary"]) if b] == [data["length"] - 1]
    assert data["operators"][data["operator"][-1]] == "adam.step"
    forward_end = data["phases"][1][1]
    assert all(b == 0 for b in data["bytes"]["gradient"][:forward_end])  # no .grad before the backward pass


@pytest.mark.parametrize("max_points", [1, 2, 5, 9])
@pytest.mark.parametrize(("make", "shape", "optimizer", "training"), CASES[2:])
def test_downsampling_keeps_each_buckets_highest_point(make: Any, shape: tuple[int, ...], optimizer: str | None,
                                                       training: bool, max_points: int) -> None:
    torch.manual_seed(0)
    mem = _analysis(make(), torch.randn(*shape), optimizer, training)
    timeline, full = mem.timeline(), _data(mem)
    data = _data(mem, max_points)
    bucket = math.ceil(len(timeline) / max_points)
    assert len(timeline) > max_points and data["bucket"] == bucket and data["length"] == len(timeline)
    assert len(data["position"]) == math.ceil(len(timeline) / bucket) <= max_points
    for i, position in enumerate(data["position"]):
        lives = [point.live for point in timeline[i * bucket:(i + 1) * bucket]]
        assert position == i * bucket + lives.index(max(lives))  # the bucket's highest, the first of equals
        assert sum(_point_values(data, i).values()) == timeline[position].live
        assert _point_values(data, i) == _point_values(full, position)  # the same numbers as the full timeline's
        assert data["operators"][data["operator"][i]] == timeline[position].operator
    assert data["peak"] == full["peak"] and data["peak"] in data["position"]  # the peak is never lost
    assert data["phases"] == full["phases"]


def test_max_points_must_be_positive() -> None:
    mem = MemoryAnalysis(mlp(), torch.randn(3, 4))
    with pytest.raises(ValueError, match="max_points must be at least 1, got 0"):
        _data(mem, 0)


def test_a_run_without_operators() -> None:
    data = _data(MemoryAnalysis(nn.Identity(), torch.randn(3, 4)))
    assert data["length"] == 0 and data["position"] == [] and data["peak"] is None and data["phases"] == []


def test_the_result_carries_the_timeline_bounded() -> None:
    """A deep stack has more points than a report keeps: the Result's timeline is cut to TIMELINE_POINTS, keeps the
    peak, survives JSON, and is the same from the trace alone."""
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(300) for layer in (nn.Linear(8, 8), nn.Tanh())])
    analysis = analyze(model, torch.randn(2, 8), backward=True, memory=True, optimizer="sgd", quiet=True)
    result = analysis.result()
    data = result.memory["timeline"]
    timeline = analysis.memory.timeline()  # type: ignore[union-attr]
    assert len(timeline) > 2 * TIMELINE_POINTS and data["length"] == len(timeline)
    assert len(data["position"]) <= TIMELINE_POINTS
    assert timeline[data["peak"]].live == result.memory["peak"] and data["peak"] in data["position"]
    assert json.loads(result.to_json())["memory"]["timeline"] == data
    assert result_from_trace(analysis.trace, memory=True, optimizer="sgd").memory["timeline"] == data
    assert "timeline" not in analyze(model, torch.randn(2, 8), quiet=True).result().memory
