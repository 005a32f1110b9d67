"""The per-rank summary of a parallel analysis (``Analysis.rank_costs()``, ``Result.parallel``), checked against
independent counts: the single-device FLOPs of the same batch (data parallelism does not change a rank's work),
ZeRO's model-state formulas (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020, arXiv:1910.02054, section 3.1 and figure 1), ZeRO-3's 3 psi of communication per step (section 7),
the boundary activation of a pipeline cut by hand, the pipeline and step-time modules' own answers, and the plan's
rank coordinates."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import modelmeter
from modelmeter import ParallelPlan, Result, rank_costs, result_from_trace, stage_costs
from modelmeter.metrics.communication import communication
from modelmeter.metrics.memory import MemoryModel, optimizer_bytes
from modelmeter.zoo.llama import llama2_tiny

WIDTH, BLOCKS, BATCH = 64, 3, 8
PSI = BLOCKS * (WIDTH * WIDTH + WIDTH)  # the MLP stack's parameters
ADAM_STEPS = 4 * 2 * BLOCKS  # Adam's float32 0-d ``step`` per parameter tensor (not per element; not in the paper)
TOKENS = (2, 16)
HIDDEN = 64  # llama2_tiny's width


def mlp(dtype: torch.dtype | None = None) -> nn.Sequential:
    """Its blocks in a container of their own, which the plan shards one by one (the root holds no parameter)."""
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH, dtype=dtype), nn.ReLU()) for _ in range(BLOCKS)]
    return nn.Sequential(nn.Sequential(*layers))


def tokens() -> torch.Tensor:
    return torch.randint(0, 1000, TOKENS)


@pytest.fixture(scope="module")
def fsdp_llama() -> modelmeter.Analysis:
    return modelmeter.analyze(llama2_tiny(), tokens(), backward=True, parallel="fsdp=4", quiet=True)


@pytest.fixture(scope="module")
def pipeline() -> modelmeter.Analysis:
    return modelmeter.analyze(llama2_tiny(), tokens(), backward=True, parallel="pp=2,fsdp=2,mb=4", memory=True,
                              optimizer="adamw", quiet=True)


# --- without a pipeline: one entry for every rank ---------------------------------------------------------------
def test_fsdp_ranks_fold_into_one_entry_with_the_single_device_flops(fsdp_llama: modelmeter.Analysis) -> None:
    summary = fsdp_llama.rank_costs()
    assert summary is not None
    data = summary.to_dict()
    assert (data["plan"], data["world_size"], data["mesh"], data["micro_batches"], data["per"], data["pipeline"]) == \
        ("fsdp=4", 4, {"fsdp": 4}, None, "micro_batch", None)
    [entry] = data["ranks"]
    assert (entry["ranks"], entry["count"], entry["stage"]) == ([0, 3], 4, None)
    one_device = modelmeter.analyze(llama2_tiny(), tokens(), backward=True, quiet=True).flops.by_phase()
    assert entry["flops"] == {"forward": one_device["forward"], "backward": one_device["backward"],
                              "total": one_device["forward"] + one_device["backward"]}
    whole = modelmeter.parameter_count(llama2_tiny())[""]
    assert entry["parameters"] == {"held": whole // 4, "global": whole}  # every dimension divides by 4
    assert entry["memory"] is None and entry["time"] is None  # no memory analysis, no device


def test_the_communication_is_totalled_once_per_analysis(fsdp_llama: modelmeter.Analysis,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    calls = fsdp_llama.communication
    assert fsdp_llama.communication is calls and calls == communication(fsdp_llama.trace)

    def recount(trace: object) -> None:
        raise AssertionError("the per-rank costs totalled the collectives again")

    monkeypatch.setattr("modelmeter.parallel.summary.communication", recount)
    summary = fsdp_llama.rank_costs()
    assert summary is not None and summary.to_dict()["ranks"][0]["communication"]["sent"] == sum(
        call.sent for call in calls.calls)


def test_zero3_communication_is_three_psi_per_step_by_kind_and_dimension() -> None:
    world = 4
    analysis = modelmeter.analyze(mlp(), torch.randn(BATCH, WIDTH), backward=True, parallel=f"fsdp={world}",
                                  quiet=True)
    comm = analysis.result().parallel["ranks"][0]["communication"]  # type: ignore[index]
    psi_bytes, share = PSI * 4, (world - 1) / world
    # every block gathered before its forward and again before its backward, its gradients reduce-scattered once
    assert comm["by_kind"] == {
        "all_gather": {"count": 2 * BLOCKS, "payload": 2 * psi_bytes, "sent": 2 * psi_bytes * share,
                       "received": 2 * psi_bytes * share},
        "reduce_scatter": {"count": BLOCKS, "payload": psi_bytes, "sent": psi_bytes * share,
                           "received": psi_bytes * share}}
    assert comm["by_dim"] == {"fsdp": {"count": 3 * BLOCKS, "sent": 3 * psi_bytes * share,
                                       "received": 3 * psi_bytes * share}}
    assert comm["sent"] == comm["received"] == 3 * psi_bytes * share


def test_memory_parts_add_up_to_the_peak_of_the_memory_analysis() -> None:
    analysis = modelmeter.analyze(llama2_tiny(), tokens(), backward=True, parallel="fsdp=2,tp=2", memory=True,
                                  optimizer="adamw", quiet=True)
    memory = analysis.result().parallel["ranks"][0]["memory"]  # type: ignore[index]
    peak = analysis.memory.peak_info()  # type: ignore[union-attr]
    assert memory == {"peak": peak.bytes, "parts": peak.by_kind}
    assert sum(memory["parts"].values()) == memory["peak"]
    assert {"parameter", "optimizer_state", "unsharded", "communication", "activation"} <= set(memory["parts"])


# --- ZeRO's model states on the planner path ---------------------------------------------------------------------
def model_states(analysis: modelmeter.Analysis) -> dict[str, int]:
    """Parameters and gradients live when the optimizer steps, and its state (less Adam's ``step`` scalars)."""
    trace = analysis.trace
    live = MemoryModel(trace).live_by_kind(len(trace.events))
    state = optimizer_bytes(trace, analysis.memory.optimizer)[0] - ADAM_STEPS  # type: ignore[union-attr, arg-type]
    return {"parameter": live["parameter"], "gradient": live["gradient"], "optimizer_state": state}


def planned(plan: str, dtype: torch.dtype | None = None) -> modelmeter.Analysis:
    return modelmeter.analyze(mlp(dtype), torch.randn(BATCH, WIDTH, dtype=dtype), backward=True, memory=True,
                              optimizer="adamw", parallel=plan, quiet=True)


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_mixed_precision_is_16_bytes_per_parameter_over_the_ranks(world: int) -> None:
    """(2 + 2 + 12) psi / N. A float32 model's FSDP2 shards are the master weights (4 + 4 + 8 bytes); a bfloat16
    model's get float32 master weights besides (2 + 2 + 12, ZeRO's split)."""
    float32 = model_states(planned(f"fsdp={world},mp=bf16"))
    assert float32 == {"parameter": 4 * PSI // world, "gradient": 4 * PSI // world, "optimizer_state": 8 * PSI // world}
    bfloat16 = model_states(planned(f"fsdp={world},mp=bf16", torch.bfloat16))
    assert bfloat16 == {"parameter": 2 * PSI // world, "gradient": 2 * PSI // world,
                        "optimizer_state": 12 * PSI // world}
    assert sum(float32.values()) == sum(bfloat16.values()) == (2 + 2 + 12) * PSI // world


@pytest.mark.parametrize("world", [2, 4])
def test_zero1_mixed_precision_is_2_psi_plus_2_psi_plus_12_psi_over_the_ranks(world: int) -> None:
    analysis = planned(f"fsdp={world},zero=1,mp=bf16", torch.bfloat16)
    assert model_states(analysis) == {"parameter": 2 * PSI, "gradient": 2 * PSI, "optimizer_state": 12 * PSI // world}
    parts = analysis.result().parallel["ranks"][0]["memory"]["parts"]  # type: ignore[index]
    assert parts["optimizer_state"] == 12 * PSI // world + ADAM_STEPS
    # a float32 model's replicated parameters are the master weights: only the moments are sharded
    assert model_states(planned(f"fsdp={world},zero=1,mp=bf16")) == \
        {"parameter": 4 * PSI, "gradient": 4 * PSI, "optimizer_state": 8 * PSI // world}


def test_zero1_without_mixed_precision_shards_the_state_only() -> None:
    assert model_states(planned("fsdp=4,zero=1")) == {"parameter": 4 * PSI, "gradient": 4 * PSI,
                                                       "optimizer_state": 8 * PSI // 4}


# --- a pipeline: one entry per stage -----------------------------------------------------------------------------
def test_pipeline_stages_are_entries_of_their_ranks(pipeline: modelmeter.Analysis) -> None:
    data = pipeline.rank_costs().to_dict()  # type: ignore[union-attr]
    assert (data["micro_batches"], data["per"]) == (4, "step")
    plan = ParallelPlan.parse("pp=2,fsdp=2,mb=4")
    for stage, entry in enumerate(data["ranks"]):
        ranks = [r for r in range(plan.world_size) if plan.with_rank(r).coordinates()["pp"] == stage]
        assert (entry["ranks"], entry["count"], entry["stage"]) == ([ranks[0], ranks[-1]], len(ranks), stage)
    assert data["pipeline"]["stages"] == 2 and data["pipeline"]["micro_batches"] == 4
    assert data["pipeline"]["bubble_fraction"] == stage_costs(pipeline.trace, 2, 4).bubble_fraction


def test_stage_flops_and_parameters_add_up_to_the_ranks(pipeline: modelmeter.Analysis) -> None:
    entries = pipeline.rank_costs().to_dict()["ranks"]  # type: ignore[union-attr]
    phases = pipeline.flops.by_phase()
    assert sum(e["flops"]["forward"] for e in entries) == 4 * phases["forward"]  # 4 micro-batches a step
    assert sum(e["flops"]["backward"] for e in entries) == 4 * phases["backward"]
    assert sum(e["parameters"]["held"] for e in entries) == pipeline.parameters[""]
    assert {e["parameters"]["global"] for e in entries} == {modelmeter.parameter_count(llama2_tiny())[""]}


def test_stage_communication_splits_the_ranks_and_adds_the_boundary(pipeline: modelmeter.Analysis) -> None:
    entries = pipeline.rank_costs().to_dict()["ranks"]  # type: ignore[union-attr]
    recorded = communication(pipeline.trace).total()
    assert sum(e["communication"]["by_dim"]["fsdp"]["sent"] for e in entries) == 4 * recorded.sent
    assert sum(e["communication"]["by_dim"]["fsdp"]["count"] for e in entries) == 4 * recorded.count
    boundary = 4 * TOKENS[0] * TOKENS[1] * HIDDEN * 4  # a float32 (batch, seq, hidden) activation per micro-batch
    for entry in entries:  # stage 0 sends activations and gets gradients; stage 1 the other way round
        by_kind = entry["communication"]["by_kind"]
        assert (by_kind["send"]["sent"], by_kind["recv"]["received"]) == (boundary, boundary)
        assert entry["communication"]["by_dim"]["pp"] == {"count": 8, "sent": boundary, "received": boundary}


def test_stage_memory_is_its_parts_with_in_flight_activations(pipeline: modelmeter.Analysis) -> None:
    entries = pipeline.rank_costs().to_dict()["ranks"]  # type: ignore[union-attr]
    cost = stage_costs(pipeline.trace, 2, 4)
    trace = pipeline.trace
    live = MemoryModel(trace).live_by_kind(len(trace.events))
    for entry, stage in zip(entries, cost.ranks, strict=True):
        parts = entry["memory"]["parts"]
        assert sum(parts.values()) == entry["memory"]["peak"]
        assert parts["activation"] == stage.activation_bytes == stage.in_flight * cost.stages[stage.stage].saved_bytes
    assert [stage.in_flight for stage in cost.ranks] == [2, 1]  # min(pp - stage, micro_batches)
    assert sum(e["memory"]["parts"]["parameter"] for e in entries) == live["parameter"]
    assert sum(e["memory"]["parts"]["gradient"] for e in entries) == pytest.approx(live["gradient"], abs=1)


def test_a_pipeline_without_backward_pass_has_stages_but_no_schedule() -> None:
    analysis = modelmeter.analyze(llama2_tiny(), tokens(), parallel="pp=2,mb=4", quiet=True)
    data = analysis.result().parallel
    assert data is not None and data["pipeline"] == {"stages": 2, "micro_batches": 4, "bubble_fraction": None,
                                                     "schedule": None}
    entries = data["ranks"]
    assert sum(e["flops"]["forward"] for e in entries) == 4 * analysis.flops.total()
    assert [e["flops"]["backward"] for e in entries] == [0, 0]
    boundary = 4 * TOKENS[0] * TOKENS[1] * HIDDEN * 4  # forward only: activations, no gradients
    assert entries[0]["communication"]["by_kind"] == {"send": {"count": 4, "payload": boundary, "sent": boundary,
                                                               "received": 0.0}}
    assert entries[1]["communication"]["by_kind"] == {"recv": {"count": 4, "payload": boundary, "sent": 0.0,
                                                               "received": boundary}}
    assert all(e["memory"] is None and e["time"] is None for e in entries)


# --- time only with a device ------------------------------------------------------------------------------------
def test_step_time_is_the_step_time_metric_with_its_assumption() -> None:
    analysis = modelmeter.analyze(llama2_tiny(), tokens(), backward=True, parallel="fsdp=2,tp=2", device="h100",
                                  quiet=True)
    time = analysis.rank_costs().to_dict()["ranks"][0]["time"]  # type: ignore[union-attr]
    step = analysis.step_time()
    assert step is not None
    assert time["step"] == pytest.approx(step.total) and time["communication"] == pytest.approx(step.communication)
    assert time["compute"] == pytest.approx(sum(step.compute.values()))
    assert time["compute"] + time["exposed"] == pytest.approx(time["step"]) and time["bubble"] is None
    assert time["assumption"].startswith(step.assumption) and "one rank's micro-batch" in time["assumption"]


def test_pipeline_time_without_collectives_is_the_pipelines() -> None:
    analysis = modelmeter.analyze(llama2_tiny(), tokens(), backward=True, parallel="pp=2,mb=4", device="h100",
                                  quiet=True)
    entries = analysis.rank_costs().to_dict()["ranks"]  # type: ignore[union-attr]
    cost = stage_costs(analysis.trace, 2, 4, device="h100")
    for entry, stage in zip(entries, cost.ranks, strict=True):
        time = entry["time"]
        assert time["step"] == pytest.approx(cost.step_time) and time["bubble"] == pytest.approx(stage.bubble_time)
        assert time["compute"] == pytest.approx(stage.busy_time) and time["communication"] == 0
        assert time["compute"] + time["exposed"] + time["bubble"] == pytest.approx(time["step"])


# --- the Result ---------------------------------------------------------------------------------------------------
def test_the_result_carries_it_through_json_and_from_the_trace_alone(pipeline: modelmeter.Analysis) -> None:
    result = pipeline.result()
    assert result.parallel == pipeline.rank_costs().to_dict()  # type: ignore[union-attr]
    assert Result.from_json(result.to_json()) == result
    assert json.loads(result.to_json())["parallel"]["ranks"][1]["stage"] == 1
    again = result_from_trace(pipeline.trace, **pipeline.settings)
    assert again.parallel == result.parallel


def test_a_single_device_run_has_none() -> None:
    analysis = modelmeter.analyze(mlp(), torch.randn(BATCH, WIDTH), quiet=True)
    assert analysis.rank_costs() is None and analysis.result().parallel is None
    assert Result.from_json(analysis.result().to_json()).parallel is None
    with pytest.raises(ValueError, match="parallel"):
        rank_costs(analysis.trace)
