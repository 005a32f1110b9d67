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
from modelmeter.cli import main
from modelmeter.parallel.pipeline import PipelineSplitError
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
