"""The parallel simulation against real process groups: 2 and 4 CPU processes joined by gloo (tests/gloo_runs.py).

Each case (an MLP stack or a tiny Llama, under FSDP2, FSDP2 in mixed precision, DDP, tensor parallelism, or FSDP2
+ TP on a 2-D mesh) runs one training step on real ranks under CommDebugMode and FlopCounterMode, and once more per
rank in this process the way modelmeter simulates a rank (fake process group, meta model, the same plan, fake
tensors). Each simulated rank must issue its real rank's collectives (operators, order, phase, tensor shapes,
dtypes, bytes) and do its matrix-product FLOPs; the ranks' FLOPs added up must be the single-device step's plus the
redundant work docs/parallel.md states ("How it is proven").
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from gloo_runs import (
    BATCH,
    MLP_WIDTH,
    SEQ,
    Case,
    assert_real_run_consistent,
    assert_same_collectives,
    assert_same_matmul_flops,
    build_model,
    collective_bytes,
    matmul_flops_of,
    real_matmul_flops,
    run_cases,
    run_real,
    simulate,
    single_device,
)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]

CASES = {2: [*(Case(model, plan) for model in ("mlp", "llama") for plan in ("fsdp", "ddp", "tp")),
             Case("llama", "fsdp-bf16")],
         # the tiny Llama's 2 key-value heads split over 2 ranks at most
         4: [Case("mlp", "fsdp"), Case("mlp", "ddp"), Case("mlp", "tp"), Case("llama", "fsdp"), Case("llama", "ddp"),
             Case("mlp", "fsdp+tp"), Case("llama", "fsdp+tp")]}
RUNS = [(world_size, case) for world_size, cases in CASES.items() for case in cases]
IDS = [f"{case.name}-{world_size}" for world_size, case in RUNS]
DATA_PARALLEL_RUNS = [(w, c) for w, c in RUNS if c.tp_degree(w) == 1]
TP_RUNS = [(w, c) for w, c in RUNS if c.tp_degree(w) > 1]

@pytest.fixture(autouse=True)
def no_process_group() -> Iterator[None]:
    """Every test leaves torch's default process group as it found it: none."""
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():  # a failed simulation must not leak its group into later tests
        dist.destroy_process_group()
        pytest.fail("a process group was left initialised")


@pytest.fixture(scope="module")
def real_runs() -> dict[int, dict[str, list[dict[str, Any]]]]:
    """One spawned gloo run per world size, every case in it: ``{world size: {case name: [rank records]}}``."""
    return {world_size: run_cases(world_size, cases) for world_size, cases in CASES.items()}


@pytest.fixture(scope="module")
def simulated() -> Iterator[Callable[[Case, int, int], Any]]:
    """:func:`gloo_runs.simulate`, run once per case and rank in this module (several tests read each)."""
    analysis = functools.cache(simulate)
    yield analysis
    analysis.cache_clear()


@pytest.mark.parametrize(("world_size", "case"), RUNS, ids=IDS)
def test_real_ranks_agree_with_torch_trackers(real_runs: Any, world_size: int, case: Case) -> None:
    """The oracle's own records: its collectives are CommDebugMode's; its FLOPs are FlopCounterMode's where no
    DTensor runs."""
    for observed in real_runs[world_size][case.name]:
        assert_real_run_consistent(observed)
        assert observed["collectives"], "every plan communicates"
        assert observed["dtensor"] == (case.tp_degree(world_size) > 1)
    ranks = real_runs[world_size][case.name]
    assert all(r["collectives"] == ranks[0]["collectives"] for r in ranks), "these plans are symmetric"


@pytest.mark.parametrize(("world_size", "case"), RUNS, ids=IDS)
def test_simulated_collectives_are_the_real_ones(simulated: Any, real_runs: Any, world_size: int, case: Case) -> None:
    for rank in range(world_size):
        observed = real_runs[world_size][case.name][rank]
        trace = simulated(case, rank, world_size).trace
        assert_same_collectives(observed, trace)


def test_a_different_plan_is_told_apart(simulated: Any, real_runs: Any) -> None:
    """The comparison can fail: FSDP over 4 ranks gathers other shard sizes than over 2."""
    observed = real_runs[2]["mlp-fsdp"][0]
    with pytest.raises(AssertionError):
        assert_same_collectives(observed, simulated(Case("mlp", "fsdp"), 0, 4).trace)
    with pytest.raises(AssertionError):
        assert_same_collectives(observed, simulated(Case("mlp", "ddp"), 0, 2).trace)


@pytest.mark.parametrize(("world_size", "case"), [(w, c) for w, c in RUNS if c.plan in ("fsdp", "ddp")],
                         ids=[i for i, (_, c) in zip(IDS, RUNS, strict=True) if c.plan in ("fsdp", "ddp")])
def test_gradient_collectives_move_every_parameter_once(real_runs: Any, world_size: int, case: Case) -> None:
    """Hand arithmetic: FSDP reduce-scatters every parameter's gradient once (the unsharded input holds them all),
    DDP all-reduces each once, both in the backward pass; float32, so 4 bytes per parameter. An all-gather's output
    holds the ranks' shards."""
    parameter_bytes = 4 * sum(p.numel() for p in build_model(case.model).parameters())
    observed = real_runs[world_size][case.name][0]["collectives"]
    if case.plan == "fsdp":
        reduced = sum(c["tensors"][1][2] for c in observed if c["op"] == "c10d::_reduce_scatter_base_")
        gathered = [c["tensors"] for c in observed if c["op"] == "c10d::_allgather_base_"]
        assert all(output[2] == world_size * shard[2] for output, shard in gathered)
        assert {c["phase"] for c in observed if c["op"] == "c10d::_reduce_scatter_base_"} == {"backward"}
    else:
        reduced = collective_bytes(observed)["c10d::allreduce_"]
        assert {c["phase"] for c in observed} == {"backward"}
    assert reduced == parameter_bytes


def test_mixed_precision_gathers_bfloat16_and_reduces_float32(real_runs: Any) -> None:
    """FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the all-gathers move
    bfloat16 (2 bytes a parameter), the reduce-scatters float32 gradients, every parameter once."""
    observed = real_runs[2]["llama-fsdp-bf16"][0]["collectives"]
    parameters = sum(p.numel() for p in build_model("llama").parameters())
    gathered = [c for c in observed if c["op"] == "c10d::_allgather_base_"]
    reduced = [c for c in observed if c["op"] == "c10d::_reduce_scatter_base_"]
    assert {t[1] for c in gathered for t in c["tensors"]} == {"bfloat16"}
    assert {t[1] for c in reduced for t in c["tensors"]} == {"float32"}
    assert sum(c["tensors"][1][2] for c in reduced) == 4 * parameters
    assert sum(c["tensors"][0][2] for c in gathered if c["phase"] == "forward") == 2 * parameters


def test_tensor_parallel_all_reduces_one_activation_per_row_split(real_runs: Any) -> None:
    """Hand arithmetic: the MLP stack's two row-parallel layers all-reduce their (batch, seq, width) output in the
    forward; the second block's column-parallel input gradient is all-reduced in the backward (the first block's
    input needs none)."""
    activation_bytes = 4 * BATCH * SEQ * MLP_WIDTH
    observed = real_runs[2]["mlp-tp"][0]["collectives"]
    assert Counter((c["op"], c["phase"]) for c in observed) == {("_c10d_functional::all_reduce", "forward"): 2,
                                                                 ("_c10d_functional::all_reduce", "backward"): 1}
    assert all(c["tensors"] == [[[BATCH, SEQ, MLP_WIDTH], "float32", activation_bytes]] for c in observed)


@pytest.mark.parametrize(("world_size", "case"), DATA_PARALLEL_RUNS,
                         ids=[f"{c.name}-{w}" for w, c in DATA_PARALLEL_RUNS])
def test_simulated_matmul_flops_are_the_real_ones(simulated: Any, real_runs: Any, world_size: int, case: Case) -> None:
    for rank in range(world_size):
        assert_same_matmul_flops(real_runs[world_size][case.name][rank], simulated(case, rank, world_size))


@pytest.mark.parametrize(("world_size", "case"), TP_RUNS, ids=[f"{c.name}-{w}" for w, c in TP_RUNS])
def test_simulated_tensor_parallel_matmul_flops_are_the_real_ones(simulated: Any, real_runs: Any, world_size: int,
                                                                  case: Case) -> None:
    assert_same_matmul_flops(real_runs[world_size][case.name][0], simulated(case, 0, world_size))


@pytest.mark.parametrize(("world_size", "case"), DATA_PARALLEL_RUNS,
                         ids=[f"{c.name}-{w}" for w, c in DATA_PARALLEL_RUNS])
def test_data_parallel_flops_add_up_to_one_device(simulated: Any, world_size: int, case: Case) -> None:
    """Every rank's FLOPs (all operators, convention ``flops``) added up are the single-device step on the whole
    batch, plus the redundant work: what does not scale with the batch, each rank doing it whole — the Llama's
    rotary tables (``model.rotary_emb``). FSDP2 and DDP average gradients inside the collective: no extra work."""
    ranks = sum(simulated(case, rank, world_size).metrics["flops"].total() for rank in range(world_size))
    one_device = single_device(case, world_size).metrics["flops"]
    redundant = (world_size - 1) * one_device.total("model.rotary_emb") if case.model == "llama" else 0
    assert ranks == one_device.total() + redundant
    assert case.model == "mlp" or redundant > 0


def redundant_matmul_flops(case: Case, world_size: int) -> int:
    """Matrix products tensor parallelism leaves whole on each of its ranks, done ``tp - 1`` times more than on one
    device: the Llama's lm_head (the MLP stack has none), on the whole batch."""
    if case.model == "mlp":
        return 0
    lm_head = single_device(case, world_size).metrics["flops"].total("lm_head")
    return (case.tp_degree(world_size) - 1) * lm_head


@pytest.mark.parametrize(("world_size", "case"), TP_RUNS, ids=[f"{c.name}-{w}" for w, c in TP_RUNS])
def test_real_tensor_parallel_matmul_flops_add_up_to_one_device(real_runs: Any, world_size: int,
                                                                case: Case) -> None:
    """The redundant work tensor parallelism does, shown on the real ranks: column/row-split products divide by the
    tensor-parallel ranks; the replicated ones (lm_head) are done whole by each."""
    ranks = sum(real_matmul_flops(observed) for observed in real_runs[world_size][case.name])
    one_device = matmul_flops_of(single_device(case, world_size))
    assert ranks == one_device + redundant_matmul_flops(case, world_size)
    assert case.model == "mlp" or redundant_matmul_flops(case, world_size) > 0


@pytest.mark.parametrize(("world_size", "case"), TP_RUNS, ids=[f"{c.name}-{w}" for w, c in TP_RUNS])
def test_simulated_tensor_parallel_matmul_flops_add_up_to_one_device(simulated: Any, world_size: int,
                                                                     case: Case) -> None:
    ranks = sum(matmul_flops_of(simulated(case, rank, world_size)) for rank in range(world_size))
    assert ranks == matmul_flops_of(single_device(case, world_size)) + redundant_matmul_flops(case, world_size)


class FailsOnRankOne(Case):
    """A case whose rank 1 fails before its step: rank 0 is left waiting on its first all-gather."""

    def inputs(self, rank: int, world_size: int) -> Any:
        if rank == 1:
            raise ValueError("rank 1 gives up")
        return super().inputs(rank, world_size)


def test_a_failing_rank_fails_the_run_at_once() -> None:
    """The run reports the failing rank's error and kills the rank left waiting, long before any timeout."""
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 gives up"):
        run_real([FailsOnRankOne("mlp", "fsdp")], 2, timeout=60)
    assert time.monotonic() - started < 30
