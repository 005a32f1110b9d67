"""modelmeter's own planner, ``analyze(model, x, parallel=...)``, against real multi-process gloo runs.

tests/test_parallel_gloo.py proves the simulation of plans the test applies by hand; here the real ranks run the
plan the planner applies: each of 2 or 4 spawned gloo processes builds the plan's device mesh and calls
``modelmeter.parallel.apply.parallelize`` on a real (not meta) tiny zoo Llama (tests/gloo_runs.py's
:class:`PlannerCase`), so both sides run one plan — the same blocks, order (tensor parallel first), ``replicate``
and mixed-precision policy. Each real rank records its collectives (with CommDebugMode's counts), FLOPs
(FlopCounterMode's formulas on its local operators) and the allocator peak of an AdamW training step
(tests/memory_oracle.py). The planner's answer for the same rank, ``analyze(model, x, parallel="<plan>,rank=<r>",
backward=True, memory=True, optimizer="adamw")``, must match: the collectives exactly, the matrix-product FLOPs
exactly, the ranks' FLOPs adding up to one device's plus the redundant work docs/parallel.md states, and the peak
within 10%.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import modelmeter
from gloo_runs import (
    BATCH,
    LLAMA,
    SEQ,
    PlannerCase,
    assert_real_run_consistent,
    assert_same_collectives,
    assert_same_matmul_flops,
    build_model,
    make_inputs,
    run_cases,
    single_device,
)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]

# the tiny Llama's 2 key-value heads split over 2 tensor-parallel ranks at most
PLANS = {2: ["dp=2", "fsdp=2", "tp=2"], 4: ["fsdp=4", "fsdp=2,tp=2"]}
RUNS = [(world_size, PlannerCase("llama", plan)) for world_size, plans in PLANS.items() for plan in plans]
IDS = [case.plan for _, case in RUNS]


@pytest.fixture(autouse=True)
def no_process_group() -> Iterator[None]:
    """Every test leaves torch's default process group as it found it: none."""
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def real_runs() -> dict[int, dict[str, list[dict[str, Any]]]]:
    """One spawned gloo run per world size, every plan in it: ``{world size: {case name: [rank records]}}``."""
    return {world_size: run_cases(world_size, [case for w, case in RUNS if w == world_size]) for world_size in PLANS}


def planned(case: PlannerCase, rank: int, world_size: int) -> modelmeter.Analysis:
    """The planner's analysis of ``rank``: the user's model (here built on meta: no weights needed), the rank's
    own batch, the plan's text."""
    with torch.device("meta"):
        model = build_model(case.model)
    x = make_inputs(case.model, rank // case.tp_degree(world_size))
    return modelmeter.analyze(model, x, parallel=f"{case.plan},rank={rank}", backward=True, memory=True,
                              optimizer="adamw", foreach=False, convention="flops", quiet=True)


@pytest.fixture(scope="module")
def analyses() -> Iterator[Callable[[PlannerCase, int, int], modelmeter.Analysis]]:
    """:func:`planned`, run once per plan and rank in this module (several tests read each)."""
    analysis = functools.cache(planned)
    yield analysis
    analysis.cache_clear()


@pytest.mark.parametrize(("world_size", "case"), RUNS, ids=IDS)
def test_planner_collectives_are_the_real_ranks(analyses: Any, real_runs: Any, world_size: int,
                                                case: PlannerCase) -> None:
    """Every rank: the same collective operators, in the same order and phase, on tensors of the same shapes,
    dtypes and bytes; the real rank's own records agree with CommDebugMode."""
    for rank in range(world_size):
        observed = real_runs[world_size][case.name][rank]
        assert_real_run_consistent(observed)
        assert observed["collectives"]
        assert_same_collectives(observed, analyses(case, rank, world_size).trace)


@pytest.mark.parametrize(("world_size", "case"), RUNS, ids=IDS)
def test_planner_matmul_flops_are_the_real_ranks(analyses: Any, real_runs: Any, world_size: int,
                                                 case: PlannerCase) -> None:
    for rank in range(world_size):
        assert_same_matmul_flops(real_runs[world_size][case.name][rank], analyses(case, rank, world_size))


def split_regions(one_device: Any) -> int:
    """FLOPs of the one-device step in what the default tensor-parallel plan splits across its ranks (Megatron-LM's
    regions: every block's attention and MLP, column then row; the output head, column-wise): all of their work,
    projections, attention of a rank's heads, activations."""
    names = [f"model.layers.{i}.{region}" for i in range(LLAMA.num_layers) for region in ("self_attn", "mlp")]
    return sum(one_device.total(name) for name in [*names, "lm_head"])


def input_gradient_sums(case: PlannerCase, world_size: int) -> int:
    """Hand arithmetic: the backward pass adds up the input gradients of projections that share an input — q, k
    and v (two additions), gate and up (one) — in every block, one FLOP per element of the block's (batch, seq,
    hidden) input. On a tensor-parallel rank these sums are of whole (partial) activations: replicated work."""
    batch = BATCH * case.dp_degree(world_size)
    return LLAMA.num_layers * (2 + 1) * batch * SEQ * LLAMA.hidden_size


@pytest.mark.parametrize(("world_size", "case"), RUNS, ids=IDS)
def test_planner_flops_add_up_to_one_device(analyses: Any, world_size: int, case: PlannerCase) -> None:
    """The ranks' FLOPs (every operator, convention ``flops``) added up are the single-device step on the whole
    batch plus the redundant work: each rank does the rotary tables (``model.rotary_emb``, no batch dimension)
    whole, and each tensor-parallel rank does whole, on its batch, what the plan leaves replicated (the norms, the
    residual adds, the embedding's gradient, the loss, and the sums of the split regions' input gradients) —
    ``tp - 1`` times more than one device."""
    ranks = sum(analyses(case, rank, world_size).metrics["flops"].total() for rank in range(world_size))
    one_device = single_device(case, world_size).metrics["flops"]
    rotary = one_device.total("model.rotary_emb")
    outside_regions = one_device.total() - split_regions(one_device) - rotary
    replicated = outside_regions + input_gradient_sums(case, world_size)
    tp = case.tp_degree(world_size)
    assert ranks == one_device.total() + (tp - 1) * replicated + (world_size - 1) * rotary
    assert rotary > 0 and (tp == 1 or replicated > 0)


@pytest.mark.parametrize(("world_size", "case"), RUNS, ids=IDS)
def test_planner_peak_per_rank_against_the_allocator(analyses: Any, real_runs: Any, world_size: int,
                                                     case: PlannerCase) -> None:
    """Every rank's allocator peak of a steady AdamW step (forward, backward, ``step()``, ``zero_grad``) within 10%
    of the planner's prediction for that rank; what is resident before the step (parameter shards, AdamW's state
    of them, the input) exactly. The prediction is never above the real peak (1% aside): the gap is gloo's, whose
    all-gather on the CPU allocates a staging buffer of the gathered size inside the call (the allocator's events:
    ``gloo:all_gather``, ``aten::empty``), where FSDP2's real peaks fall, and which a prediction made for a device's
    collectives, writing into their output, leaves out."""
    for rank in range(world_size):
        real = real_runs[world_size][case.name][rank]["memory"]
        predicted = analyses(case, rank, world_size).memory.peak_info()
        parts = predicted.by_kind
        assert real["foreign_frees"] == 0
        assert parts["parameter"] + parts["optimizer_state"] + parts["input"] == real["resident"]
        assert abs(predicted.bytes - real["peak"]) <= 0.10 * real["peak"], (rank, predicted, real)
        assert predicted.bytes <= 1.01 * real["peak"], (rank, predicted, real)
