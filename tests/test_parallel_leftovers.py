"""Session 12's leftovers of parallel plans: ``pp`` checked against the blocks as soon as the plan is given, the
per-rank summary of an uneven tensor-parallel split (each rank's own shard), and a model's failure under a plan
named in the user's terms from the engine's structured error.

Oracles: hand arithmetic of ``torch.chunk``'s shards and torch's own DTensor sharding of the uneven dimension
(``distribute_tensor`` on a fake process group), and the single plan's own run of every rank (``rank=``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import modelmeter
from modelmeter._torch_compat import kept_distributed_globals
from modelmeter.cli import main
from modelmeter.parallel.pipeline import PipelineSplitError
from modelmeter.parallel.summary import RankCost, RankCosts, with_peers
from modelmeter.reports.ranks import rank_table
from test_parallel_hostile import torch_state  # noqa: F401 (a fixture)


def _stack(layers: int = 2) -> nn.Module:
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers)))


# --- pp larger than the blocks: refused when the plan is given ----------------------------------------------------
@pytest.mark.parametrize("backward", [True, False])
def test_more_stages_than_blocks_are_refused_by_analyze_itself(backward: bool, torch_state: Any) -> None:  # noqa: F811
    """``analyze`` returned, and only ``result()``/``rank_costs()`` refused: the plan was taken as given."""
    with pytest.raises(PipelineSplitError, match=r"pp=3 stages need at least 3 blocks, but .* holds 2 Linear blocks"):
        modelmeter.analyze(_stack(2), torch.randn(4, 8), backward=backward, parallel="pp=3", quiet=True)
    with pytest.raises(PipelineSplitError, match=r"pp=5 stages need at least 5 blocks, .* holds 2 Linear"):
        modelmeter.MemoryAnalysis(_stack(2), torch.randn(4, 8), training=True, parallel="pp=5").peak_info()
    assert len(modelmeter.analyze(_stack(3), torch.randn(4, 8), backward=backward, parallel="pp=3",
                                  quiet=True).rank_costs().entries) == 3  # type: ignore[union-attr]


def test_the_command_refuses_more_stages_than_blocks_as_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["llama2_tiny", "--no-cache", "--parallel", "pp=3"])
    _, err = capsys.readouterr()
    assert status == 2 and "pp=3 stages need at least 3 blocks" in err and "holds 2 LlamaDecoderLayer" in err, err


# --- an uneven tensor-parallel split: every rank's own shard ------------------------------------------------------
class _Vocabulary(nn.Module):
    """A vocabulary of 10 (row-wise embedding, column-wise head), which tp=4 splits 3, 3, 3, 1; an even MLP between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.lm_head = nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.mlp(self.embed(ids)))


def _torch_rows(rows: int, tp: int) -> list[int]:
    """The rows each of ``tp`` ranks holds of a ``rows``-row tensor DTensor shards along them (``Shard(0)``)."""
    held = []
    for rank in range(tp):
        with kept_distributed_globals():  # torch's global state as it was (the fixture checks it)
            held.append(_local_rows(rows, tp, rank))
    return held


def _local_rows(rows: int, tp: int, rank: int) -> int:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,))
        return int(distribute_tensor(torch.empty(rows, 8), mesh, [Shard(0)]).to_local().shape[0])
    finally:
        dist.destroy_process_group()


def test_an_uneven_tensor_parallel_split_shows_each_ranks_own_shard(torch_state: Any) -> None:  # noqa: F811
    """The summary showed rank 0's numbers for all eight ranks: ranks 3 and 7 hold one row of the vocabulary, not
    three. By hand: a rank holds rows x 8 of the embedding, the MLP's 4 x 8 + 4 and 8 x 4 + 8 (its bias whole) and
    rows x 8 + rows of the head; the head's products are 10 tokens x 8 x rows, forward and twice that backward."""
    rows = _torch_rows(10, 4)
    assert rows == [3, 3, 3, 1]  # torch.chunk's split, as DTensor's Shard makes it
    model, ids = _Vocabulary(), torch.randint(0, 10, (2, 5))
    analysis = modelmeter.analyze(model, ids, backward=True, parallel="dp=2,tp=4", quiet=True, memory=True,
                                  optimizer="adamw")
    costs = analysis.rank_costs()
    assert costs is not None
    assert [(e.first, e.last, e.count, e.coordinates) for e in costs.entries] == [
        (0, 6, 6, {"tp": (0, 1, 2)}), (3, 7, 2, {"tp": (3,)})]
    held = [e.parameters for e in costs.entries]
    assert held == [r * 8 + (4 * 8 + 4) + (8 * 4 + 8) + r * 8 + r for r in (rows[0], rows[3])]
    flops = [e.total_flops for e in costs.entries]
    assert flops[0] - flops[1] == 3 * 10 * 8 * (rows[0] - rows[3])
    assert costs.entries[0].peak_memory > costs.entries[1].peak_memory  # type: ignore[operator]
    # every rank's own run (rank=) is the entry that names it
    for rank in (1, 3, 7):
        own = modelmeter.analyze(model, ids, backward=True, parallel=f"dp=2,tp=4,rank={rank}", quiet=True,
                                 memory=True, optimizer="adamw")
        entry = next(e for e in costs.entries if e.coordinates and rank % 4 in e.coordinates["tp"])
        assert own.parameters[""] == entry.parameters
        assert own.memory is not None and own.memory.peak_info().bytes == entry.peak_memory
        assert own.rank_costs().entries == costs.entries  # type: ignore[union-attr]  # any rank's shows every rank
    text = analysis.result().parallel
    assert text is not None and [entry["coordinates"] for entry in text["ranks"]] == [{"tp": [0, 1, 2]}, {"tp": [3]}]
    assert folded_ranks_of(text) == ["0–6 (×6, tp 0–2)", "3–7 (×2, tp 3)"]
    # from the trace alone: the simulated rank's group only, and the others said to be left out
    alone = modelmeter.result_from_trace(analysis.trace, quiet=True).parallel
    assert alone is not None and folded_ranks_of(alone) == ["0–6 (×6, tp 0–2)"]
    assert "Not shown: 2 ranks holding other tensor-parallel shards" in rank_table(alone)


def folded_ranks_of(parallel: dict[str, Any]) -> list[str]:
    from modelmeter.reports.ranks import folded_ranks

    return [folded_ranks(entry) for entry in parallel["ranks"]]


def test_an_even_split_is_still_one_row(torch_state: Any) -> None:  # noqa: F811
    costs = modelmeter.analyze(_Vocabulary(), torch.randint(0, 10, (2, 5)), backward=True, parallel="tp=2",
                               quiet=True).rank_costs()
    assert costs is not None and [(e.first, e.last, e.coordinates) for e in costs.entries] == [(0, 1, None)]


# --- a failure under a plan, worded from the engine's parts --------------------------------------------------------
class _Says(nn.Module):
    """A block that fails with a text of its own, which names what the runner renamed by replacing substrings."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.text = text

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(self.text)


@pytest.mark.parametrize("plan", ["fsdp=2", "dp=2"])
def test_the_models_own_text_is_kept_when_its_failure_is_worded_in_its_terms(plan: str,
                                                                             torch_state: Any) -> None:  # noqa: F811
    """The runner replaced the copy's class names (``FSDP_Says``) and the engine's advice wherever they occurred in
    the message, the model's own text included: only the module's class and the advice are the runner's to word."""
    text = "FSDP_Says and Replicate_Says are not mine; use execution='auto' or 'real' {elsewhere}"
    model = nn.Sequential(_Says(text), _Says(text))  # two blocks: each a group of its own, of a class of its own
    with pytest.raises(modelmeter.ModelRunError) as failure:
        modelmeter.analyze(model, torch.randn(2, 8), backward=True, parallel=plan, quiet=True)
    assert str(failure.value) == f"the model failed in module '0' (_Says): RuntimeError: {text}"
    assert failure.value.module == "0"


def test_a_wording_names_each_module_and_advises_as_asked() -> None:
    """By hand: the parts the engine gives, worded again in other terms."""
    wording = modelmeter.errors.Wording("in {class_0} and {class_1} {{x}}: {advice}", ("a", "b"), ("FSDPA", "B"),
                                        "use execution='real'")
    assert wording.text() == "in FSDPA and B {x}: use execution='real'"
    assert wording.text({"a": "A"}, "no plan can") == "in A and B {x}: no plan can"
    assert wording.reworded({"a": "A"}, "no plan can").text() == "in A and B {x}: no plan can"
    assert modelmeter.errors.literal("{shape}") == "{{shape}}"


# --- probes: training steps under a pipeline -------------------------------------------------------------------
def _first_frozen() -> nn.Module:
    """Four 16 -> 16 Linears (272 parameters each), the first frozen (a frozen embedding or backbone)."""
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    model[0].requires_grad_(False)
    return model


@pytest.mark.parametrize(("plan", "shards"), [("pp=2", 1), ("dp=2,pp=2", 1), ("fsdp=2,pp=2", 2)])
def test_a_stage_of_frozen_layers_keeps_no_gradients_or_optimizer_state(plan: str, shards: int,
                                                                        torch_state: Any) -> None:  # noqa: F811
    """The stages split the gradients and AdamW's state by their share of all parameter bytes: stage 0 (a frozen
    layer and a trained one) was given 3 layers' worth / 2, stage 1 (two trained layers) the same — 25% under its
    own, below the upper bound the stage's memory is said to be. By hand: a trained layer has 272 float32
    gradients and 272 x 8 bytes of AdamW moments plus a 4-byte step count for each of its 2 parameters."""
    analysis = modelmeter.analyze(_first_frozen(), torch.randn(4, 16), backward=True, parallel=plan, quiet=True,
                                  memory=True, optimizer="adamw")
    costs = analysis.rank_costs()
    assert costs is not None
    parts = [e.memory_parts or {} for e in costs.entries]
    layer = 272 // shards
    assert [p.get("gradient") for p in parts] == [layer * 4, 2 * layer * 4]
    assert [p.get("optimizer_state") for p in parts] == [layer * 8 + 2 * 4, 2 * (layer * 8 + 2 * 4)]


class _Layers(nn.Module):
    """``_Vocabulary`` with its MLP twice, as a list of layers a pipeline cuts between."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(2))
        self.lm_head = nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def test_an_uneven_split_under_a_pipeline_is_one_row_per_stage_and_group(torch_state: Any) -> None:  # noqa: F811
    """Stage 0 holds the embedding (3 or 1 rows of 8), stage 1 the head (3 or 1 rows of 8, and their biases); the
    pipeline has 2 stages, not one per row."""
    costs = modelmeter.analyze(_Layers(), torch.randint(0, 10, (2, 5)), backward=True, parallel="pp=2,tp=4",
                               quiet=True).rank_costs()
    assert costs is not None
    layer = (4 * 8 + 4) + (8 * 4 + 8)
    assert [(e.stage, e.first, e.last, e.count, e.parameters) for e in costs.entries] == [
        (0, 0, 2, 3, 3 * 8 + layer), (0, 3, 3, 1, 1 * 8 + layer),
        (1, 4, 6, 3, layer + 3 * 8 + 3), (1, 7, 7, 1, layer + 1 * 8 + 1)]
    assert costs.to_dict()["pipeline"]["stages"] == 2


def _entry(first: int, last: int, count: int, tp: tuple[int, ...], flops: int) -> RankCost:
    return RankCost(first, last, count, None, flops, 2 * flops, 10, 40, None, None, {"sent": 0.0}, None, {"tp": tp})


def test_groups_of_other_shards_but_equal_cost_are_one_row() -> None:
    """By hand, tp=4 over dp=2: coordinates 0-1, 2 and 3 hold other shards; 0-1 and 3 cost the same (a shard that
    no counted operator reads), so they are one row of 6 ranks, named by their coordinates 0, 1 and 3."""
    def costs(*entries: RankCost) -> RankCosts:
        return RankCosts("dp=2,tp=4", 8, {"dp": 2, "tp": 4}, None, "micro_batch", entries)

    merged = with_peers(costs(_entry(0, 5, 4, (0, 1), 100)), [costs(_entry(2, 6, 2, (2,), 90)),
                                                             costs(_entry(3, 7, 2, (3,), 100))])
    assert [(e.first, e.last, e.count, e.coordinates, e.forward_flops) for e in merged.entries] == [
        (0, 7, 6, {"tp": (0, 1, 3)}, 100), (2, 6, 2, {"tp": (2,)}, 90)]
    assert folded_ranks_of(merged.to_dict()) == ["0–7 (×6, tp 0,1,3)", "2–6 (×2, tp 2)"]
    whole = with_peers(costs(_entry(0, 6, 6, (0, 1, 2), 100)), [costs(_entry(3, 7, 2, (3,), 100))])
    assert [(e.first, e.last, e.count, e.coordinates) for e in whole.entries] == [(0, 7, 8, None)]


def test_a_loss_that_needs_values_under_a_plan_is_not_told_to_run_real() -> None:
    # the loss_fn's error was worded as text, not from parts: under a plan it kept the engine's advice,
    # execution='auto' or 'real', which a plan refuses
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(modelmeter.ModelRunError) as raised:
        modelmeter.analyze(model, torch.randn(2, 8), backward=True, parallel="dp=2", loss_fn=lambda o: o[o > 0].sum(),
                cache=False, quiet=True).flops.total()
    assert "execution=" not in str(raised.value) and "cannot run under one" in str(raised.value)
