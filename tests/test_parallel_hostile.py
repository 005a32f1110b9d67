"""Parallel plans a hostile user gives: models and plan texts the other tests never tried.

Oracles: hand arithmetic on single Linears and small stacks (parameter elements, the bytes a collective moves), the
single-device analysis of the same per-rank input (data parallelism changes no rank's FLOPs; tensor parallelism
halves a plain MLP's products), and the user's model and torch's distributed state compared before and after.
Every plan that cannot apply must be refused with a :class:`~modelmeter.ParallelPlanError` that names what is wrong,
never counted as if it applied, never a bare error from inside torch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import modelmeter
from modelmeter import ParallelPlan, ParallelPlanError
from test_model_unchanged import differences, reachable
from test_parallel_plan import _distributed_state


@pytest.fixture
def torch_state() -> Any:
    """Torch's global distributed state before the test, which every analysis must leave as it was (checked)."""
    before = _distributed_state()
    yield before
    assert _distributed_state() == before


def _tied_across_layers() -> nn.Module:
    """Two 16 -> 16 Linears sharing one weight (their biases their own): 16 * 16 + 2 * 16 = 288 parameters."""
    first, second = nn.Linear(16, 16), nn.Linear(16, 16)
    second.weight = first.weight
    return nn.Sequential(first, nn.ReLU(), second)


def _analyze(model: nn.Module, x: torch.Tensor, plan: str | ParallelPlan) -> modelmeter.Analysis:
    return modelmeter.analyze(model, x, backward=True, parallel=plan, quiet=True)


# --- the plan's text -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["tp=2_0", "fsdp=\u0662", "tp=\uff12", "dp=2 ", "fsdp=0x4"])
def test_a_number_int_would_read_in_an_odd_spelling_is_refused(text: str) -> None:
    """``int`` reads ``2_0`` as 20 and other scripts' digits as numbers: a plan of twenty ranks from a typo."""
    if text == "dp=2 ":  # surrounding spaces are the plan's own separators: fine
        assert ParallelPlan.parse(text) == ParallelPlan(dp=2)
        return
    with pytest.raises(ParallelPlanError, match="is not a whole number"):
        ParallelPlan.parse(text)


def test_dtype_names_are_read_in_any_case_as_the_other_names_are() -> None:
    assert ParallelPlan.parse("FSDP=2,Param_Dtype=BF16,reduce_dtype=FP32") == \
        ParallelPlan(fsdp=2, param_dtype="bfloat16", reduce_dtype="float32")
    assert ParallelPlan.parse("fsdp=2,mp=Torch.BFloat16").param_dtype == "bfloat16"


# --- data parallelism: ties and what fully_shard refuses -------------------------------------------------------------
@pytest.mark.parametrize(("plan", "held", "collectives"), [
    # FSDP2: one group (the root), its 288 float32 parameters gathered once and their gradients reduce-scattered once
    ("fsdp=2", 144, {"all_gather": (1, 288 * 4), "reduce_scatter": (1, 288 * 4)}),
    ("fsdp=2,zero=2", 144, {"all_gather": (1, 288 * 4), "reduce_scatter": (1, 288 * 4)}),
    ("dp=2", 288, {"all_reduce": (1, 288 * 4)}),  # replicate: one all-reduce of the root's gradients
    ("fsdp=2,zero=1", 288, {"all_reduce": (1, 288 * 4)}),
])
def test_a_weight_tied_across_layers_is_sharded_in_the_roots_group(plan: str, held: int,
                                                                   collectives: dict[str, tuple[int, int]],
                                                                   torch_state: Any) -> None:
    """FSDP2 and replicate manage a parameter in one group only (torch refused the tie at the first forward, which
    was reported as the model failing): the two Linears are left to the root's group."""
    model, x = _tied_across_layers(), torch.randn(4, 16)
    before = reachable(model)
    analysis = _analyze(model, x, plan)
    assert analysis.parameters[""] == held
    assert analysis.flops.by_phase() == modelmeter.FlopCountAnalysis(model, x, backward=True).by_phase()
    assert {kind: (v.count, v.payload) for kind, v in analysis.communication.by_kind().items()} == collectives
    assert differences(before, reachable(model)) == []


def test_layers_that_tie_nothing_outside_them_stay_groups_of_their_own(torch_state: Any) -> None:
    """Only the layers holding a tied weight leave their group: three Linears, the last two tied, make two groups
    (the first Linear's, and the root's with the other two)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), *_tied_across_layers())
    analysis = _analyze(model, torch.randn(4, 16), "fsdp=2")
    assert analysis.communication.by_kind()["reduce_scatter"].count == 2
    assert analysis.parameters[""] == (16 * 16 + 16 + 288) // 2


class _Scaled(nn.Module):
    """A Linear and a learned scalar (CLIP's logit scale): FSDP2 shards no 0-dimensional parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


@pytest.mark.parametrize(("plan", "api"), [("fsdp=2", "fully_shard"), ("dp=2", "replicate"),
                                           ("fsdp=2,zero=1", "replicate")])
def test_what_torchs_data_parallelism_refuses_is_a_plan_error_naming_the_module(plan: str, api: str,
                                                                                torch_state: Any) -> None:
    model = _Scaled()
    before = reachable(model)
    with pytest.raises(ParallelPlanError, match=rf"{api} refused the model \(_Scaled\): .*scalar parameters"):
        _analyze(model, torch.randn(2, 8), plan)
    assert differences(before, reachable(model)) == []
    assert _distributed_state() == torch_state


# --- tensor parallelism: a plan that shards nothing, or cannot apply -------------------------------------------------
def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))


@pytest.mark.parametrize(("tp_plan", "message"), [
    ({"5": ColwiseParallel()}, "entry '5' names no module of Sequential"),  # torch skips it with a warning
    ({"layers.*": ColwiseParallel(), "0": ColwiseParallel(), "2": RowwiseParallel()}, "entry 'layers.*' names no"),
    ({}, "the tensor-parallel plan given shards nothing"),
    ({"0": "colwise"}, "entry '0' is a str, not a torch.distributed.tensor.parallel ParallelStyle"),
    ({"1": ColwiseParallel()}, "entry '1': torch's ColwiseParallel cannot apply to it: NotImplementedError"),
    ({"*": ColwiseParallel()}, r"entry '\*': torch's ColwiseParallel cannot apply"),  # the ReLU among the matches
])
def test_a_tensor_parallel_plan_that_cannot_apply_is_refused_not_counted(tp_plan: dict[str, Any], message: str,
                                                                         torch_state: Any) -> None:
    """A key naming no module was skipped and the plan counted as applied: the whole model's FLOPs on every rank
    of ``tp=2`` and no collective, with nothing said."""
    model = _mlp()
    before = reachable(model)
    with pytest.raises(ParallelPlanError, match=message):
        _analyze(model, torch.randn(4, 16), ParallelPlan.parse("tp=2", tp_plan=tp_plan))
    assert differences(before, reachable(model)) == []
    assert _distributed_state() == torch_state


def test_a_model_the_default_plan_shards_nothing_of_is_refused(torch_state: Any) -> None:
    with pytest.raises(ParallelPlanError, match="default tensor-parallel plan of LayerNorm shards nothing"):
        _analyze(nn.LayerNorm(16), torch.randn(4, 16), "tp=2")


def test_a_plan_naming_its_modules_by_pattern_still_applies(torch_state: Any) -> None:
    """Hand arithmetic (fvcore's multiply-adds): each of the four Linears is 4 x 16 x 64 products forward, and as
    many for its weight's gradient and for its input's (but the first Linear's: the input needs none); tp=2 halves
    each product."""
    model, x = nn.Sequential(_mlp(), _mlp()), torch.randn(4, 16)
    plan = ParallelPlan.parse("tp=2", tp_plan={"*.0": ColwiseParallel(), "*.2": RowwiseParallel()})
    analysis = _analyze(model, x, plan)
    single = modelmeter.FlopCountAnalysis(model, x, backward=True)
    assert analysis.flops.total() * 2 == single.total() == 4 * 16 * 64 * (4 + 4 + 3)


class _Attention(nn.Module):
    """q/k/v/o projections viewed into heads of its ``head_dim`` (``view(..., -1, head_dim)``), no head counts kept."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int = 8, hidden: int = 48) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize(("heads", "kv_heads", "message"), [
    (6, 6, "has 6 query heads, which tp=4 does not divide"),
    (8, 2, "has 2 key/value heads, which tp=4 does not divide"),  # grouped-query: fewer key/value heads than tp
])
def test_head_counts_are_read_from_the_projections_widths_over_head_dim(heads: int, kv_heads: int, message: str,
                                                                         torch_state: Any) -> None:
    """An attention without head-count attributes failed inside torch's ``view`` (a ModelRunError naming no head)."""
    with pytest.raises(ParallelPlanError, match=rf"the attention model \(_Attention\) {message}"):
        _analyze(_Attention(heads, kv_heads), torch.randn(2, 8, 48), "tp=4")


def test_an_attention_whose_heads_tp_divides_runs_a_quarter_of_every_product(torch_state: Any) -> None:
    model, x = _Attention(8, 4), torch.randn(2, 8, 48)
    rank = _analyze(model, x, "tp=4")
    assert rank.flops.total() * 4 == modelmeter.FlopCountAnalysis(model, x, backward=True).total()


# --- the pipeline: where the model is cut -------------------------------------------------------------------------
class _Experts(nn.Module):
    """A dense mixture of four 16 -> 32 -> 16 experts after a LayerNorm, its output added to its input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + sum(expert(h) for expert in self.experts) / 4


class _MixtureModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList(_Experts() for _ in range(2))
        self.head = nn.Linear(16, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_a_pipeline_is_cut_between_layers_not_among_a_layers_experts(torch_state: Any) -> None:
    """Each layer's four experts are a longer list than the two layers: the pipeline was cut between layer 0's second
    and third expert, stage 1 holding the rest of layer 0 and all of layer 1. Hand arithmetic (fvcore, 2 x 8
    tokens): a layer's forward is 4 experts x 16 x (16 x 32 + 32 x 16) products + its LayerNorm's 5 x 16 x 16; its
    parameters 4 x (16 x 32 + 32 + 32 x 16 + 16) + 2 x 16."""
    model, tokens = _MixtureModel(), torch.randint(0, 50, (2, 8))
    costs = _analyze(model, tokens, "pp=2").rank_costs()
    assert costs is not None
    layer_flops, layer_params = 4 * 16 * (16 * 32 + 32 * 16) + 5 * 16 * 16, 4 * (16 * 32 + 32 + 32 * 16 + 16) + 32
    assert [(e.stage, e.forward_flops, e.parameters) for e in costs.entries] == [
        (0, layer_flops, 50 * 16 + layer_params),  # the embedding and layer 0
        (1, layer_flops + 16 * 16 * 50, layer_params + 16 * 50 + 50)]  # layer 1 and the head
    with pytest.raises(modelmeter.PipelineSplitError, match="'layers' holds 2 _Experts blocks"):
        _analyze(model, tokens, "pp=4").rank_costs()  # not four stages of experts


# --- a model that fails under a plan: the error in the user's terms ---------------------------------------------
class _ReadsItsMask(nn.Module):
    """Reads a buffer's value, which a plan's copy (FakeTensors, buffers made with ``to_empty``) does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("mask", torch.ones(8, dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) if self.mask.all() else x


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this block is broken")


@pytest.mark.parametrize("plan", ["fsdp=2", "dp=2"])
def test_a_model_needing_values_is_told_no_plan_can_run_it_in_its_own_class_names(plan: str,
                                                                                torch_state: Any) -> None:
    """The engine's advice, execution='real', is refused under a plan; the class was FSDP2's (FSDP_ReadsItsMask)."""
    with pytest.raises(modelmeter.ModelRunError) as failure:
        _analyze(_ReadsItsMask(), torch.randn(2, 8), plan)
    message = str(failure.value)
    assert "in _ReadsItsMask.forward" in message and "cannot run under one" in message
    assert "FSDP" not in message and "Replicate" not in message and "execution=" not in message


def test_a_failing_block_is_named_by_its_own_class(torch_state: Any) -> None:
    model = nn.Sequential(_Fails(), _Fails())  # two blocks: each fully_shard's own group, of class FSDP_Fails
    with pytest.raises(modelmeter.ModelRunError, match=r"module '0' \(_Fails\): RuntimeError: this block is broken"):
        _analyze(model, torch.randn(2, 8), "fsdp=2")
