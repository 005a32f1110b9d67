"""Memory per rank under a parallel plan: FSDP2 (ZeRO-3), ZeRO-1 and mixed precision.

The simulation runs the real ``fully_shard`` on a fake process group in one process, on FakeTensors, and the memory
model replays its storages: the parameter shards, the unsharded parameters FSDP2 gathers and frees by hand
(``UntypedStorage.resize_``) around each block, the all-gather and reduce-scatter buffers, the gradient shards and the
optimizer state of this rank. Oracles: hand counts, the ZeRO paper's model-state formulas (Rajbhandari et al., "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", SC 2020, arXiv:1910.02054, section 3.1 and
figure 1: mixed-precision Adam keeps 2 + 2 + 12 bytes per parameter; stage 1 divides the 12 by the ranks, stage 3
all 16) and, in the slow tests, the CPU allocator of real multi-process gloo runs (tests/memory_oracle.py), rank by
rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import modelmeter
from memory_oracle import measure_peak, steady_step_peak
from modelmeter.engine.serialize import trace_from_dict, trace_to_dict
from modelmeter.engine.trace import Trace
from modelmeter.errors import ModelRunError
from modelmeter.metrics.memory import OPTIMIZERS, MemoryModel, optimizer_bytes
from modelmeter.zoo.llama import llama2_tiny

WIDTH, BLOCKS, BATCH = 64, 3, 64  # every parameter divides evenly among 2 and 4 ranks: no padding
F32, BF16 = 4, 2
UNEVEN = 66  # among 4 ranks: shards of 17, 17, 17 and 15 rows, the last padded to 17


def blocks(width: int = WIDTH, depth: int = BLOCKS, dtype: torch.dtype | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width, dtype=dtype), nn.ReLU()) for _ in range(depth)])


def tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    return llama2_tiny(vocab_size=128, max_position_embeddings=64)


# A case of the real runs: the model, its inputs, the blocks the plan wraps first, the plan, its mixed precision.
class Case(NamedTuple):
    build: Callable[[], nn.Module]
    inputs: Callable[[], torch.Tensor]
    blocks: Callable[[nn.Module], list[nn.Module]]
    plan: Callable[..., Any] = fully_shard
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy()
    reshard_after_forward: bool = True


MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
CASES = {
    "fsdp": Case(blocks, lambda: torch.randn(BATCH, WIDTH), list),
    "fsdp-bf16": Case(blocks, lambda: torch.randn(BATCH, WIDTH), list, mp_policy=MIXED),
    "fsdp-uneven": Case(lambda: blocks(width=UNEVEN), lambda: torch.randn(BATCH, UNEVEN), list),
    "fsdp-zero2": Case(blocks, lambda: torch.randn(BATCH, WIDTH), list, reshard_after_forward=False),
    "ddp": Case(blocks, lambda: torch.randn(BATCH, WIDTH), list, plan=replicate),
    "fsdp-llama": Case(tiny_llama, lambda: torch.randint(0, 128, (8, 64)), lambda m: list(m.model.layers)),
}


def apply_plan(model: nn.Module, mesh: DeviceMesh, case: Case) -> None:
    """The plan as torch's documentation applies it: every block, then the root."""
    options = {} if case.reshard_after_forward else {"reshard_after_forward": False}
    for block in case.blocks(model):
        case.plan(block, mesh=mesh, mp_policy=case.mp_policy, **options)
    case.plan(model, mesh=mesh, mp_policy=case.mp_policy, **options)


def param_count(width: int = WIDTH, depth: int = BLOCKS) -> int:
    return depth * (width * width + width)


@contextlib.contextmanager
def fake_group(world: int, rank: int = 0) -> Iterator[DeviceMesh]:
    """A fake process group of ``world`` ranks (this process is ``rank``), destroyed on the way out."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def simulate(world: int, case: str = "fsdp", *, rank: int = 0, optimizer: Any = "adam") -> modelmeter.Analysis:
    """One training step of ``case`` under its plan on rank ``rank`` of ``world``: built on meta, planned,
    materialised as FakeTensors, analysed."""
    plan = CASES[case]
    with fake_group(world, rank) as mesh:
        with torch.device("meta"):
            model = plan.build()
        apply_plan(model, mesh, plan)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            # the model's tensors are FakeTensors already: "real" runs them as they are, with no stand-ins
            return modelmeter.analyze(model, plan.inputs(), backward=True, memory=True, optimizer=optimizer,
                                      foreach=False, execution="real", quiet=True)


def model_states(trace: Trace, optimizer: Any) -> dict[str, int]:
    """What lives when the optimizer steps: parameters, gradients, and the optimizer's state."""
    live = MemoryModel(trace).live_by_kind(len(trace.events))
    return {"parameter": live.get("parameter", 0), "gradient": live.get("gradient", 0),
            "optimizer_state": optimizer_bytes(trace, optimizer)[0]}


@pytest.fixture(scope="module")
def two_ranks() -> modelmeter.Analysis:
    return simulate(2)


# --- the simulation, counted by hand -----------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_parameters_and_gradients_count_at_this_ranks_shard(world: int) -> None:
    trace = simulate(world).memory.trace
    states = model_states(trace, OPTIMIZERS["adam"])
    assert states["parameter"] == param_count() * F32 // world
    assert states["gradient"] == param_count() * F32 // world
    assert states["optimizer_state"] == 2 * param_count() * F32 // world + 4 * 2 * BLOCKS  # + Adam's float32 step
    assert [g.shape for g in trace.gradients] == [(WIDTH // world, WIDTH), (WIDTH // world,)] * BLOCKS


def test_an_uneven_shard_is_padded_state_from_the_start() -> None:
    """FSDP2 pads the last rank's shorter shard into a new storage during the first forward: the model's state in
    every later step, so a parameter there from the start, and the unpadded one it replaced is gone."""
    trace = simulate(4, "fsdp-uneven", rank=3).memory.trace
    padded = -(-UNEVEN // 4)
    assert model_states(trace, OPTIMIZERS["adam"])["parameter"] == BLOCKS * (padded * UNEVEN + padded) * F32
    replaced = [s for s in trace.storages if s.kind == "parameter" and s.died >= 0]
    assert [s.died for s in replaced] == [0] * 2 * BLOCKS


def test_unsharded_parameters_live_once_per_pass(two_ranks: modelmeter.Analysis) -> None:
    """FSDP2 gathers each block's parameters before its forward and its backward, and frees them after: two
    lifetimes per parameter, of its full size, each ending before the next block's gather of the same pass ends."""
    trace = two_ranks.memory.trace
    unsharded = [s for s in trace.storages if s.kind == "unsharded"]
    assert sorted(s.nbytes for s in unsharded) == sorted([WIDTH * WIDTH * F32, WIDTH * F32] * BLOCKS * 2)
    assert all(0 <= s.born < s.died for s in unsharded)
    phases = [trace.events[s.born].phase for s in unsharded]
    assert phases.count("forward") == phases.count("backward") == 2 * BLOCKS
    live = MemoryModel(trace).live_by_kind
    assert max(live(i).get("unsharded", 0) for i in range(len(trace.events))) <= 2 * (WIDTH * WIDTH + WIDTH) * F32


def test_without_resharding_after_forward_parameters_stay_unsharded_until_their_backward() -> None:
    """``reshard_after_forward=False``: one gather per block, in the forward pass, freed after its backward."""
    trace = simulate(2, "fsdp-zero2").memory.trace
    unsharded = [s for s in trace.storages if s.kind == "unsharded"]
    assert len(unsharded) == 2 * BLOCKS
    lifetimes = {(trace.events[s.born].phase, trace.events[s.died - 1].phase) for s in unsharded}
    assert lifetimes == {("forward", "backward")}


def test_a_second_analysis_of_the_sharded_model_sees_the_same_step() -> None:
    """The second time, FSDP2's unsharded buffers exist already, resized to nothing (as in a steady step): their
    first lifetime starts with ``resize_``, not with an operator, and the step's memory is the same."""
    with fake_group(2) as mesh:
        with torch.device("meta"):
            model = blocks()
        apply_plan(model, mesh, CASES["fsdp"])
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            x = torch.randn(BATCH, WIDTH)
            first, second = (modelmeter.analyze(model, x, backward=True, memory=True, optimizer="adam",
                                                execution="real", quiet=True).memory for _ in range(2))
    top, again = first.peak_info(), second.peak_info()
    assert (again.bytes, again.by_kind, again.at.module, again.at.operator) == \
        (top.bytes, top.by_kind, top.at.module, top.at.operator)  # fewer events: FSDP2 made its buffers the first time
    unsharded = [s for s in second.trace.storages if s.kind == "unsharded"]
    assert len(unsharded) == 4 * BLOCKS and all(s.born >= 0 and s.died > s.born for s in unsharded)


def test_the_peak_names_every_part(two_ranks: modelmeter.Analysis) -> None:
    peak = two_ranks.memory.peak_info()
    assert {"parameter", "gradient", "optimizer_state", "unsharded", "communication", "activation"} <= set(peak.by_kind)
    assert sum(peak.by_kind.values()) == peak.bytes
    kinds = two_ranks.result().memory["timeline"]["kinds"]
    assert {"unsharded", "communication"} <= set(kinds)


def test_the_trace_keeps_lifetimes_and_gradients_when_saved(two_ranks: modelmeter.Analysis) -> None:
    trace = two_ranks.memory.trace
    again = trace_from_dict(json.loads(json.dumps(trace_to_dict(trace))))
    assert again.storages == trace.storages and again.gradients == trace.gradients


def test_resize_is_observed_only_while_recording(two_ranks: modelmeter.Analysis) -> None:
    assert "resize_" not in torch.UntypedStorage.__dict__
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # type: ignore[attr-defined]


# --- ZeRO's model states, as formulas --------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4])
def test_zero3_mixed_precision_model_states_are_16_bytes_per_parameter_over_the_ranks(world: int) -> None:
    """FSDP2 with bf16 parameters and compute and float32 reduction keeps float32 shards of the parameters (the
    master weights) and gradients, and Adam's two float32 moments: ZeRO-3's (2 + 2 + 12) psi / N — the same 16 bytes,
    split 4 + 4 + 8 rather than 2 + 2 + 12, the bf16 copies being the transient unsharded ones."""
    analysis = simulate(world, "fsdp-bf16")
    trace, psi = analysis.memory.trace, param_count()
    states = model_states(trace, OPTIMIZERS["adam"])
    adam_steps = 4 * 2 * BLOCKS  # one float32 0-d ``step`` per parameter tensor: not per element, not in the paper
    assert sum(states.values()) - adam_steps == (2 + 2 + 12) * psi // world
    unsharded = [s for s in trace.storages if s.kind == "unsharded"]
    assert {s.dtype for s in unsharded} == {"bfloat16"}
    assert max(s.nbytes for s in unsharded) == WIDTH * WIDTH * BF16


@pytest.mark.parametrize("world", [2, 8])
def test_zero1_shards_the_optimizer_state_of_replicated_parameters(world: int) -> None:
    """ZeRO-1 (P_os): bf16 parameters and gradients on every rank, float32 master weights and Adam moments split
    across the ranks: 2 psi + 2 psi + 12 psi / N."""
    spec = replace(OPTIMIZERS["adam"], state_dtype="float32", master_weights=True, shards=world)
    model, psi = blocks(dtype=torch.bfloat16), param_count()
    analysis = modelmeter.analyze(model, torch.randn(BATCH, WIDTH, dtype=torch.bfloat16), backward=True,
                                  memory=True, optimizer=spec, quiet=True)
    states = model_states(analysis.memory.trace, spec)
    assert states == {"parameter": 2 * psi, "gradient": 2 * psi, "optimizer_state": 12 * psi // world + 4 * 2 * BLOCKS}
    assert analysis.memory.peak_info().by_kind["optimizer_state"] == states["optimizer_state"]


def test_shards_must_be_a_count_of_ranks() -> None:
    from modelmeter.metrics.memory import optimizer_spec

    with pytest.raises(ValueError, match="shards"):
        optimizer_spec("adam", shards=0)


# --- a storage freed by hand, against the allocator ----------------------------------------------------------
class FreesByHand(nn.Module):
    """Frees an intermediate by hand and allocates it again, as FSDP2 does with an unsharded parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + x  # no Python-number operands: their hidden 0-d tensors are no part of this test
        y.untyped_storage().resize_(0)
        total = x.neg().exp().sum()  # x, its negation and the exponential live at once: y's bytes are free meanwhile
        y.untyped_storage().resize_(y.numel() * y.element_size())
        return y + total


@pytest.mark.parametrize("execution", ["fake", "real"])
def test_a_storage_freed_by_hand_matches_the_allocator(execution: str) -> None:
    from memory_oracle import inference

    model, x = FreesByHand(), torch.randn(16, 32)
    memory = modelmeter.analyze(model, x, memory=True, execution=execution, quiet=True).memory  # type: ignore[arg-type]
    measured = x.nbytes + measure_peak(inference(model, (x,))).peak_delta
    assert memory.peak() == measured == 3 * x.nbytes + F32  # x, y (again), the sum and y + total (4 x if y stayed)
    lives = [s for s in memory.trace.storages if s.kind == "unsharded"]
    assert [s.nbytes for s in lives] == [x.nbytes] * 2 and lives[0].died <= lives[1].born
    assert "resize_" not in torch.UntypedStorage.__dict__


class FailsAfterFreeing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (x * 2).untyped_storage().resize_(0)
        raise RuntimeError("the model's own failure")


def test_the_storage_class_is_put_back_when_the_run_raises() -> None:
    with pytest.raises(ModelRunError, match="own failure"):
        modelmeter.analyze(FailsAfterFreeing(), torch.randn(2, 3), memory=True, execution="fake", quiet=True)
    assert "resize_" not in torch.UntypedStorage.__dict__


# --- real runs: gloo on CPU, one process per rank --------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(world: int, worker: Callable[..., dict[str, Any]], *args: Any) -> list[dict[str, Any]]:
    """Run ``worker(*args)`` in ``world`` processes joined in a gloo group on a free localhost port; what each rank
    returns, in rank order (through a JSON file per rank)."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank_main, args=(world, _free_port(), folder, worker, args), nprocs=world, join=True)
        return [json.loads(Path(folder, f"{rank}.json").read_text()) for rank in range(world)]


def _rank_main(rank: int, world: int, port: int, folder: str, worker: Callable[..., dict[str, Any]],
               args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = worker(init_device_mesh("cpu", (world,)), *args)
    finally:
        dist.destroy_process_group()
    Path(folder, f"{rank}.json").write_text(json.dumps(result))


def training_peak(mesh: DeviceMesh, case: str) -> dict[str, Any]:
    """This rank's allocator peak of a steady training step with Adam under the case's plan (tests/memory_oracle.py):
    the lowest of five identical steps (a buffer a collective's asynchronous work holds longer can only add)."""
    plan = CASES[case]
    model, x = plan.build(), plan.inputs()
    apply_plan(model, mesh, plan)
    return steady_step_peak(model, (x,), torch.optim.Adam(model.parameters(), foreach=False), steps=5)


def bf16_gemm_workspace() -> int:
    """The most scratch memory the CPU's bf16 matrix products of this model take beyond their output (oneDNN packs
    float32 copies of the operands: kernel detail of the CPU, no GPU does so, and no part of the prediction)."""
    g, x, w = (torch.randn(*shape, dtype=torch.bfloat16) for shape in ((BATCH, WIDTH), (BATCH, WIDTH), (WIDTH, WIDTH)))
    products = [(lambda: torch.mm(g.t(), x), WIDTH * WIDTH), (lambda: torch.mm(g, w), BATCH * WIDTH)]
    return max(measure_peak(run).peak_delta - out * BF16 for run, out in products)


def assert_within_ten_percent(world: int, case: str, allowance: int = 0) -> None:
    """Every rank's allocator peak within 10% of the simulation's prediction for that rank (plus ``allowance``:
    what the CPU's kernels take that a device's do not); the resident part (parameter shards, optimizer state,
    inputs) exactly."""
    measured = spawn_ranks(world, training_peak, case)
    for rank, real in enumerate(measured):
        predicted = simulate(world, case, rank=rank).memory.peak_info()
        parts = predicted.by_kind
        assert real["foreign_frees"] == 0
        assert parts["parameter"] + parts["optimizer_state"] + parts["input"] == real["resident"]
        assert abs(predicted.bytes + allowance - real["peak"]) <= 0.10 * real["peak"], (rank, predicted, real)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "case"), [(2, "fsdp"), (4, "fsdp"), (2, "fsdp-zero2"), (2, "ddp"),
                                             (2, "fsdp-llama"), (4, "fsdp-llama"), (4, "fsdp-uneven")])
def test_peak_per_rank_against_the_allocator(world: int, case: str) -> None:
    """FSDP2 (resharding after forward, or keeping the parameters unsharded until the backward: ZeRO-2's nearest
    form), DDP as FSDP2's ``replicate`` (whole parameters, gradients all-reduced), and the zoo's tiny Llama with every
    decoder layer and the root sharded: exact on every rank when this was written. On a much smaller input the
    Llama's peak falls during an all-gather, where gloo allocates a second buffer of the gathered size for a moment,
    and was 4% above the prediction."""
    assert_within_ten_percent(world, case)


@pytest.mark.slow
def test_fsdp2_mixed_precision_peak_per_rank_against_the_allocator() -> None:
    """bf16 parameters and compute, float32 shards, gradients and Adam state. The CPU's bf16 products take scratch
    memory of their own (measured alone here: ~16% of this small model's peak) that the prediction, made for the
    device, leaves out."""
    assert_within_ten_percent(2, "fsdp-bf16", allowance=bf16_gemm_workspace())


if __name__ == "__main__":  # a quick look: python tests/test_parallel_memory.py 2 fsdp-llama
    ranks, name = int(sys.argv[1]), sys.argv[2]
    print(spawn_ranks(ranks, training_peak, name), simulate(ranks, name).memory.peak_info())
