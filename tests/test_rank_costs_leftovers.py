"""Session 13's leftovers of the per-rank summary: the other ranks of an uneven tensor-parallel split and the stages
of a pipeline counted with the analysis's own handles and attention settings, the other ranks' runs recorded once
per analysis, and a stage's share of parameter bytes taken on the cut the pipeline was given.

Oracles: hand arithmetic (a handle's constant per call times the calls torch makes; parameter bytes of a small
stack cut by hand), the analysis's own totals, another rank's own analysis (``rank=``) and the number of
recordings the runner made."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

import modelmeter
from modelmeter.parallel.pipeline import bytes_by_stage, stage_costs
from modelmeter.zoo.llama import llama2_tiny
from test_parallel_hostile import torch_state  # noqa: F401 (a fixture)
from test_parallel_leftovers import _Layers, _Vocabulary

MARK = 1_000_003  # a count no formula gives: a row holding it was counted with the handle set


def _marked(_inputs: Any, _outputs: Any) -> int:
    return MARK


def _mark(analysis: modelmeter.Analysis, mark: int = MARK) -> None:
    """Every linear and matrix product (its backward's) counts ``mark``, whatever its shapes."""
    analysis.flops.set_op_handle("aten::linear", lambda i, o: mark, "aten::mm", lambda i, o: mark)


def _by_group(costs: modelmeter.RankCosts | None) -> dict[tuple[int, ...], tuple[int, int]]:
    assert costs is not None
    return {tuple((entry.coordinates or {}).get("tp", ())): (entry.forward_flops, entry.backward_flops)
            for entry in costs.entries}


# --- the other ranks of an uneven split: counted with the analysis's handles --------------------------------------
def test_the_other_ranks_of_an_uneven_split_are_counted_with_the_handles_set(torch_state: Any) -> None:  # noqa: F811
    """Ranks 3 and 7 (one row of the vocabulary of 10 under tp=4) were counted with the default handles: their row
    said 720 forward FLOPs when the analysis counted every linear as MARK. By hand: 3 linears forward, and each
    one's backward 2 matrix products (its input's gradient and its weight's), on every rank."""
    analysis = modelmeter.analyze(_Vocabulary(), torch.randint(0, 10, (2, 5)), backward=True, parallel="dp=2,tp=4",
                                  quiet=True)
    _mark(analysis)
    assert analysis.flops.by_phase() == {"forward": 3 * MARK, "backward": 6 * MARK}
    rows = _by_group(analysis.rank_costs())
    assert rows == {(0, 1, 2): (3 * MARK, 6 * MARK), (3,): (3 * MARK, 6 * MARK)}
    # the simulated rank's row is the analysis's own count; the other's is that rank's own analysis, marked alike
    peer = modelmeter.analyze(_Vocabulary(), torch.randint(0, 10, (2, 5)), backward=True,
                              parallel="dp=2,tp=4,rank=3", quiet=True)
    _mark(peer)
    assert rows[(3,)] == (peer.flops.by_phase()["forward"], peer.flops.by_phase()["backward"])
    assert analysis.result().parallel == analysis.rank_costs().to_dict()  # type: ignore[union-attr]


def test_a_handle_changed_between_calls_is_the_one_counted(torch_state: Any) -> None:  # noqa: F811
    """The other ranks' runs are kept; their counts are not: a second handle is what the second call shows."""
    analysis = modelmeter.analyze(_Vocabulary(), torch.randint(0, 10, (2, 5)), backward=True, parallel="tp=4",
                                  quiet=True)
    default = _by_group(analysis.rank_costs())
    _mark(analysis, 7)
    assert _by_group(analysis.rank_costs()) == {(0, 1, 2): (21, 42), (3,): (21, 42)}
    analysis.flops.set_op_handle("aten::linear", None, "aten::mm", None)  # ignored: nothing left to count
    assert _by_group(analysis.rank_costs()) == {(0, 1, 2): (0, 0), (3,): (0, 0)}
    fresh = modelmeter.analyze(_Vocabulary(), torch.randint(0, 10, (2, 5)), backward=True, parallel="tp=4",
                               quiet=True)
    assert _by_group(fresh.rank_costs()) == default


# --- the other ranks' runs: recorded once per analysis ------------------------------------------------------------
@pytest.fixture
def recordings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ranks the parallel runner recorded, one entry per recording."""
    from modelmeter.parallel import runner

    ranks: list[int] = []
    record = runner.record_parallel

    def counted(spec: Any) -> Any:
        ranks.append(spec.parallel.rank)
        return record(spec)

    monkeypatch.setattr(runner, "record_parallel", counted)
    return ranks


class _LayerDrop(_Vocabulary):
    """``_Vocabulary`` whose MLP is a LayerDrop that always keeps it: a run that draws random numbers, which no
    analysis shares with another (the next run draws others)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        if random.random() < 2.0:
            hidden = self.mlp(hidden)
        return self.lm_head(hidden)


@pytest.mark.parametrize("device", [None, "h100"])
def test_the_other_ranks_are_recorded_once_per_analysis(device: str | None, recordings: list[int],
                                                        torch_state: Any) -> None:  # noqa: F811
    """Every call of ``rank_costs()`` (and ``result()``, which calls it) recorded rank 3's run again with the cache
    off; and the second call's numbers are the first's, over another interconnect too."""
    def analysis_of() -> modelmeter.Analysis:
        return modelmeter.analyze(_LayerDrop(), torch.randint(0, 10, (2, 5)), backward=True, parallel="tp=4",
                                  quiet=True, memory=True, optimizer="adamw", device=device)

    analysis = analysis_of()
    assert recordings == [0]
    first = analysis.rank_costs()
    assert recordings == [0, 3]
    assert analysis.rank_costs() == first
    analysis.result()
    assert recordings == [0, 3]
    if device is not None:  # another interconnect: the kept runs, timed again
        slower = analysis.rank_costs("a100")
        assert recordings == [0, 3] and slower != first
        assert slower == analysis_of().rank_costs("a100")


# --- a pipeline's stages: counted with the analysis's handles and attention settings ------------------------------
@pytest.mark.parametrize("backward", [True, False])
def test_a_pipelines_stages_are_counted_with_the_handles_set(backward: bool, torch_state: Any) -> None:  # noqa: F811
    """The stages counted under the convention's table, not the analysis's handles. By hand (pp=2, two layers of
    two linears between the embedding and the head): stage 0 runs layer 0's 2 linears, stage 1 layer 1's and the
    head's 3; each linear's backward 2 matrix products, but the first linear's input gradient is the embedding's
    output's."""
    analysis = modelmeter.analyze(_Layers(), torch.randint(0, 10, (2, 5)), backward=backward, parallel="pp=2,mb=3",
                                  quiet=True)
    _mark(analysis)
    costs = analysis.rank_costs()
    assert costs is not None
    back = 2 * backward
    assert [(e.stage, e.forward_flops, e.backward_flops) for e in costs.entries] == [
        (0, 3 * 2 * MARK, 3 * 2 * back * MARK), (1, 3 * 3 * MARK, 3 * 3 * back * MARK)]
    total = sum(e.total_flops for e in costs.entries)
    assert total == 3 * analysis.flops.total()  # a step of 3 micro-batches, each the recorded one


@pytest.mark.parametrize("setting", [{"dense_attention": True}, {"attention_kernel": "math"}])
def test_a_pipelines_stages_are_counted_with_the_attention_settings(setting: dict[str, Any],
                                                                   torch_state: Any) -> None:  # noqa: F811
    """A causal Llama counted dense (or at the math kernel's cost) had stages counted at the fused kernel's
    masked cost, in the analysis and in ``result_from_trace``: the stages add up to the analysis's total."""
    analysis = modelmeter.analyze(llama2_tiny(), torch.randint(0, 1000, (2, 16)), backward=True, parallel="pp=2",
                                  quiet=True, **setting)
    fused = modelmeter.analyze(llama2_tiny(), torch.randint(0, 1000, (2, 16)), backward=True, parallel="pp=2",
                               quiet=True)
    assert analysis.flops.total() > fused.flops.total()
    costs = analysis.rank_costs()
    assert costs is not None and sum(e.total_flops for e in costs.entries) == analysis.flops.total()
    alone = modelmeter.result_from_trace(analysis.trace, quiet=True, **setting).parallel
    assert alone is not None and sum(e["flops"]["total"] for e in alone["ranks"]) == analysis.flops.total()


# --- bytes by stage: on the cut the pipeline was given ------------------------------------------------------------
def test_bytes_by_stage_follow_the_layout_the_pipeline_was_given() -> None:
    """``bytes_by_stage`` cut the model again with the even layout. By hand, four Linears of 4->8, 8->8, 8->8 and
    8->4 float32 (160, 288, 288 and 144 bytes) cut 1 + 3: stage 0 holds 160 bytes, stage 1 720 (even: 448, 432)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    trace = modelmeter.analyze(model, torch.randn(3, 4), backward=True, quiet=True).trace
    own = {"0": 160, "1": 288, "2": 288, "3": 144}
    cost = stage_costs(trace, 2, 2, layout=[1, 3])
    assert [stage.blocks for stage in cost.stages] == [("0",), ("1", "2", "3")]
    assert bytes_by_stage(trace, cost, own) == [160, 720] == [stage.parameter_bytes for stage in cost.stages]
    assert bytes_by_stage(trace, cost, {"1": 288}) == [0, 288]  # a frozen layer's bytes, on the stage holding it
    even = stage_costs(trace, 2, 2)
    assert bytes_by_stage(trace, even, own) == [448, 432] == [stage.parameter_bytes for stage in even.stages]
    assert bytes_by_stage(trace, stage_costs(trace, 1, 2), own) == [880]


def test_stage_costs_take_the_units_an_analysis_counted() -> None:
    """``stage_costs`` and ``split_stages`` sum an analysis's own counts when given them (``units``): by hand, the
    1 + 3 cut of four linears, each MARK forward and, but for the first (its input needs no gradient), 2 MARK
    backward."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    analysis = modelmeter.analyze(model, torch.randn(3, 4), backward=True, quiet=True)
    _mark(analysis)
    cost = stage_costs(analysis.trace, 2, 1, layout=[1, 3], units=analysis.flops.units())
    assert [(stage.forward_flops, stage.backward_flops) for stage in cost.stages] == [(MARK, MARK),
                                                                                     (3 * MARK, 6 * MARK)]
