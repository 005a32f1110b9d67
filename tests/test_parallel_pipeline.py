"""Pipeline parallelism derived from one trace (modelmeter.parallel): the stages cut between a model's repeated blocks,
checked by hand arithmetic on a small MLP stack and the zoo's Llama, and the 1F1B schedule checked against torch's
own ``Schedule1F1B`` order, the closed forms of Narayanan et al. (2021) and timelines worked out by hand."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import modelmeter
from modelmeter.devices import get_device
from modelmeter.metrics.memory import MemoryModel, saved_bytes
from modelmeter.metrics.roofline import RooflineSettings, roofline
from modelmeter.parallel import schedule
from modelmeter.parallel.pipeline import PipelineSplitError, find_blocks, split_stages, stage_costs
from modelmeter.zoo.llama import Llama, LlamaConfig

D, BATCH = 8, 3  # the MLP stack: 4 -> 8 features, blocks of Linear(8, 8) + ReLU, a Linear(8, 2) head


class Block(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.act = nn.ReLU()
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(lambda t: self.act(self.linear(t)), x, use_reentrant=False)
        return self.act(self.linear(x))


class Stack(nn.Module):
    def __init__(self, blocks: int = 4, checkpointed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(Block(checkpointed) for _ in range(blocks))
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Plain(nn.Module):
    """No repeated blocks: nothing to cut pipeline stages between."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 8)
        self.second = nn.Sequential(nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _trace(model: nn.Module, x: torch.Tensor, **options: object) -> modelmeter.Trace:
    return modelmeter.analyze(model, x, backward=True, quiet=True, **options).trace


@pytest.fixture(scope="module")
def stack() -> modelmeter.Trace:
    return _trace(Stack(), torch.randn(BATCH, 4))


@pytest.fixture(scope="module")
def llama() -> modelmeter.Analysis:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_layers=4, num_heads=4,
                              num_kv_heads=2, max_position_embeddings=64))
    return modelmeter.analyze(model, torch.randint(0, 1000, (2, 16)), backward=True, quiet=True)


# --- the stages of the MLP stack, by hand --------------------------------------------------------------------------
# fvcore counts a Linear as batch x in x out multiply-adds; its backward twice that (input and weight gradients),
# except the first layer's, whose input needs no gradient (weight gradient only). ReLU and the bias gradients are free.
EMBED, BLOCK, HEAD = BATCH * 4 * D, BATCH * D * D, BATCH * D * 2  # 96, 192, 48
ACTIVATION = BATCH * D * 4  # one (3, 8) float32 activation: 96 bytes


def test_stack_split_in_two_by_hand(stack: modelmeter.Trace) -> None:
    found, stages = split_stages(stack, 2)
    assert found.container == "blocks" and found.block_type == "Block"
    assert [s.blocks for s in stages] == [("blocks.0", "blocks.1"), ("blocks.2", "blocks.3")]
    assert [s.forward_flops for s in stages] == [EMBED + 2 * BLOCK, 2 * BLOCK + HEAD]
    assert [s.backward_flops for s in stages] == [EMBED + 4 * BLOCK, 4 * BLOCK + 2 * HEAD]
    assert [s.recompute_flops for s in stages] == [0, 0]
    # embed 4x8+8, each block 8x8+8, head 8x2+2
    assert [s.parameters for s in stages] == [40 + 2 * 72, 2 * 72 + 18]
    assert [s.parameter_bytes for s in stages] == [4 * (40 + 2 * 72), 4 * (2 * 72 + 18)]
    # Stage 0 holds embed's output (saved by blocks.0's linear), ReLU outputs 0 and 1 (the second one is also what it
    # sends); stage 1 holds what it received (saved by blocks.2's linear) and ReLU outputs 2 and 3.
    assert [s.saved_bytes for s in stages] == [3 * ACTIVATION, 3 * ACTIVATION]
    assert [(s.activation_out, s.gradient_out) for s in stages] == [(ACTIVATION, 0), (0, ACTIVATION)]


def test_stack_split_in_four_by_hand(stack: modelmeter.Trace) -> None:
    _, stages = split_stages(stack, 4)
    assert [s.blocks for s in stages] == [("blocks.0",), ("blocks.1",), ("blocks.2",), ("blocks.3",)]
    assert [s.forward_flops for s in stages] == [EMBED + BLOCK, BLOCK, BLOCK, BLOCK + HEAD]
    assert [s.backward_flops for s in stages] == [EMBED + 2 * BLOCK, 2 * BLOCK, 2 * BLOCK, 2 * BLOCK + 2 * HEAD]
    assert [s.parameters for s in stages] == [40 + 72, 72, 72, 72 + 18]
    assert [s.saved_bytes for s in stages] == [2 * ACTIVATION] * 4  # (embed out or received) + sent or ReLU out
    assert [s.activation_out for s in stages] == [ACTIVATION] * 3 + [0]
    assert [s.gradient_out for s in stages] == [0] + [ACTIVATION] * 3


def test_uneven_and_given_layouts(stack: modelmeter.Trace) -> None:
    assert [s.blocks for s in split_stages(stack, 3)[1]] == [("blocks.0", "blocks.1"), ("blocks.2",), ("blocks.3",)]
    _, stages = split_stages(stack, 2, layout=[1, 3])
    assert [s.blocks for s in stages] == [("blocks.0",), ("blocks.1", "blocks.2", "blocks.3")]
    assert [s.forward_flops for s in stages] == [EMBED + BLOCK, 3 * BLOCK + HEAD]


def test_boundary_in_the_dtype_of_the_run() -> None:
    _, stages = split_stages(_trace(Stack().double(), torch.randn(BATCH, 4, dtype=torch.float64)), 2)
    assert stages[0].activation_out == stages[1].gradient_out == BATCH * D * 8


def test_recomputed_blocks_count_on_their_stage() -> None:
    _, stages = split_stages(_trace(Stack(checkpointed=True), torch.randn(BATCH, 4)), 2)
    assert [s.recompute_flops for s in stages] == [2 * BLOCK, 2 * BLOCK]
    assert [s.forward_flops for s in stages] == [EMBED + 2 * BLOCK, 2 * BLOCK + HEAD]
    assert [s.backward_flops for s in stages] == [EMBED + 4 * BLOCK, 4 * BLOCK + 2 * HEAD]


# --- the zoo's Llama -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("convention", ["fvcore", "flops"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_llama_stage_flops_add_up_to_the_model(llama: modelmeter.Analysis, convention: str, pp: int) -> None:
    total = modelmeter.result_from_trace(llama.trace, convention=convention).total("flops")
    _, stages = split_stages(llama.trace, pp, convention=convention)
    assert sum(s.forward_flops + s.backward_flops + s.recompute_flops for s in stages) == total


def test_llama_stages_against_its_modules(llama: modelmeter.Analysis) -> None:
    """With one layer per stage, a middle stage is its layer; the first adds the embedding and the rotary tables, the
    last the final norm and the head (module totals of the same trace, forward and backward)."""
    by_module = llama.flops.by_module()
    _, stages = split_stages(llama.trace, 4)
    totals = [s.forward_flops + s.backward_flops for s in stages]
    layer = [by_module[f"model.layers.{i}"] for i in range(4)]
    assert totals[1] == layer[1] and totals[2] == layer[2]
    assert totals[0] == layer[0] + by_module["model.embed_tokens"] + by_module["model.rotary_emb"]
    assert totals[3] == layer[3] + by_module["model.norm"] + by_module["lm_head"]
    # parameters: a layer is q, o (64x64), k, v (64x32), gate, up, down (64x176) and two norms (64)
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176 + 2 * 64
    assert [s.parameters for s in stages] == [1000 * 64 + per_layer, per_layer, per_layer, per_layer + 64 + 64 * 1000]
    assert sum(s.parameters for s in stages) == llama.parameters[""]


def test_llama_boundary_and_held_activations(llama: modelmeter.Analysis) -> None:
    hidden = 2 * 16 * 64 * 4  # (batch, sequence, hidden) float32
    for pp in (2, 4):
        _, stages = split_stages(llama.trace, pp)
        assert [s.activation_out for s in stages] == [hidden] * (pp - 1) + [0]
        assert [s.gradient_out for s in stages] == [0] + [hidden] * (pp - 1)
        # every saved activation once, plus the boundary a second time: each layer's output is saved by the next
        # layer's norm, and under a pipeline both the stage that sends it and the one that receives it keep it
        saved = sum(saved_bytes(MemoryModel(llama.trace))[""].values())
        assert sum(s.saved_bytes for s in stages) == saved + (pp - 1) * hidden


# --- the 1F1B schedule ---------------------------------------------------------------------------------------------
class _RecordingStage:
    """What ``Schedule1F1B`` asks of its stage, answered without a process group or a model: no send/recv operations
    (an empty batch of them is never issued), and every forward and backward pass noted."""

    def __init__(self, index: int, stages: int) -> None:
        self.stage_index, self.num_stages, self.is_last = index, stages, index == stages - 1
        self.ran: list[tuple[str, int]] = []

    def get_fwd_recv_ops(self, _: int) -> list[object]:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, micro_batch: int, *_: object, **__: object) -> None:
        self.ran.append(("F", micro_batch))

    def backward_one_chunk(self, micro_batch: int, **_: object) -> None:
        self.ran.append(("B", micro_batch))

    def perform_reduce_grad(self, *_: object) -> None:
        pass


def _torch_1f1b(p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """The passes torch's ``Schedule1F1B._step_microbatches`` runs on ``stage``, driven with a recording stand-in stage
    (its loss and input helpers answered by no-ops). Its ``_get_pipeline_order`` is no oracle: in torch 2.14 it
    numbers the last rank's forward passes from 1."""
    from torch.distributed.pipelining.schedules import Schedule1F1B

    recorder = _RecordingStage(stage, p)
    run = object.__new__(Schedule1F1B)
    run._stage, run._num_stages, run._n_microbatches, run.scale_grads = recorder, p, m, True
    inputs: tuple[list[tuple[()]], list[dict[str, object]]] = ([()] * m, [{}] * m)
    run._check_inputs = lambda *_: inputs
    run._initialize_stage = run._maybe_compute_loss = run._maybe_get_loss = run._update_losses = lambda *_, **__: None
    run._step_microbatches(*inputs)
    return recorder.ran


@pytest.mark.parametrize(("p", "m"), [(1, 1), (1, 4), (2, 2), (2, 5), (3, 3), (3, 8), (4, 4), (4, 8), (5, 7), (8, 16)])
def test_order_is_torchs_schedule_1f1b(p: int, m: int) -> None:
    for stage in range(p):
        assert [(a.kind, a.micro_batch) for a in schedule.one_f_one_b(p, m, stage)] == _torch_1f1b(p, m, stage)


@pytest.mark.parametrize(("p", "m"), list(itertools.product(range(1, 7), range(1, 10))))
def test_in_flight_micro_batches(p: int, m: int) -> None:
    for stage in range(p):
        held, most = 0, 0
        for action in schedule.one_f_one_b(p, m, stage):
            held += 1 if action.kind == "F" else -1
            most = max(most, held)
        assert held == 0
        assert most == schedule.in_flight(p, m, stage) == min(p - stage, m)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 1), (2, 3), (3, 2), (4, 8), (4, 16), (6, 5)])
@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (3.0, 3.0), (0.5, 4.0)])
def test_equal_stages_bubble(p: int, m: int, f: float, b: float) -> None:
    """Narayanan et al. (2021) section 2.2.1: with equal stages a step takes (m + p - 1)(t_f + t_b), of which every
    stage idles (p - 1)(t_f + t_b): (p - 1) / m of the ideal, (p - 1) / (m + p - 1) of the step."""
    timeline = schedule.simulate([f] * p, [b] * p, m)
    assert timeline.makespan == pytest.approx((m + p - 1) * (f + b))
    for stage in range(p):
        assert timeline.busy(stage) == pytest.approx(m * (f + b))
        assert timeline.bubble(stage) == pytest.approx((p - 1) * (f + b))
        assert timeline.bubble(stage) / timeline.makespan == pytest.approx(schedule.bubble_fraction(p, m))
        assert timeline.bubble(stage) / (m * (f + b)) == pytest.approx((p - 1) / m)


def _slots(timeline: schedule.Timeline, stage: int) -> list[tuple[str, float, float]]:
    return [(str(slot.action), slot.start, slot.end) for slot in timeline.slots[stage]]


def test_timeline_two_stages_three_micro_batches_by_hand() -> None:
    """Forward 1, backward 2 on both stages; worked out on paper."""
    timeline = schedule.simulate([1, 1], [2, 2], 3)
    assert _slots(timeline, 0) == [("F0", 0, 1), ("F1", 1, 2), ("B0", 4, 6), ("F2", 6, 7), ("B1", 7, 9),
                                   ("B2", 10, 12)]
    assert _slots(timeline, 1) == [("F0", 1, 2), ("B0", 2, 4), ("F1", 4, 5), ("B1", 5, 7), ("F2", 7, 8),
                                   ("B2", 8, 10)]
    assert timeline.makespan == 12
    assert [timeline.bubble(s) for s in (0, 1)] == [3, 3]


def test_timeline_four_stages_eight_micro_batches_by_hand() -> None:
    """Unit forward and backward times. Stage s runs forward j at s + j while it warms up (j < p - s), then each
    forward right after the backward of micro-batch j - (p - s), at 2j + s; backward j leaves the last stage at
    5 + 2j and reaches stage s p - 1 - s steps later: it runs at 7 - s + 2j. The last one ends at 22 = (8 + 3) x 2."""
    p, m = 4, 8
    timeline = schedule.simulate([1] * p, [1] * p, m)
    for s in range(p):
        starts = {str(slot.action): slot.start for slot in timeline.slots[s]}
        for j in range(m):
            assert starts[f"F{j}"] == (s + j if j < p - s else 2 * j + s)
            assert starts[f"B{j}"] == 7 - s + 2 * j
    assert timeline.makespan == 22


def test_unequal_stages_by_hand() -> None:
    """Stage 1 twice as slow as stage 0 (forward 1 / 2, backward 2 / 4), two micro-batches:
    stage 0: F0 0-1, F1 1-2, B0 7-9 (after stage 1's B0), B1 13-15;
    stage 1: F0 1-3, B0 3-7, F1 7-9, B1 9-13."""
    timeline = schedule.simulate([1, 2], [2, 4], 2)
    assert _slots(timeline, 0) == [("F0", 0, 1), ("F1", 1, 2), ("B0", 7, 9), ("B1", 13, 15)]
    assert _slots(timeline, 1) == [("F0", 1, 3), ("B0", 3, 7), ("F1", 7, 9), ("B1", 9, 13)]
    assert (timeline.makespan, timeline.busy(0), timeline.busy(1)) == (15, 6, 12)


def test_transfers_delay_the_next_stage() -> None:
    """One micro-batch, unit times, half a unit per transfer: F 0-1, 1.5-2.5; B 2.5-3.5, 4-5."""
    timeline = schedule.simulate([1, 1], [1, 1], 1, transfer=[0.5])
    assert _slots(timeline, 1) == [("F0", 1.5, 2.5), ("B0", 2.5, 3.5)]
    assert _slots(timeline, 0) == [("F0", 0, 1), ("B0", 4, 5)]


# --- the per-rank cost ---------------------------------------------------------------------------------------------
def test_stage_costs_of_the_stack(stack: modelmeter.Trace) -> None:
    cost = stage_costs(stack, 2, 4, flops_per_second=96.0)
    assert (cost.pp, cost.micro_batches, cost.schedule, cost.time_unit) == (2, 4, "1F1B", "s")
    first, last = cost.ranks
    assert (first.forward_flops, first.backward_flops) == (4 * (EMBED + 2 * BLOCK), 4 * (EMBED + 4 * BLOCK))
    assert (last.forward_flops, last.backward_flops) == (4 * (2 * BLOCK + HEAD), 4 * (4 * BLOCK + 2 * HEAD))
    assert (first.in_flight, last.in_flight) == (2, 1)
    assert (first.activation_bytes, last.activation_bytes) == (2 * 3 * ACTIVATION, 3 * ACTIVATION)
    # four activations forward and four gradients back over the one boundary
    assert (first.send_bytes, first.recv_bytes, last.send_bytes, last.recv_bytes) == (4 * ACTIVATION,) * 4
    # per micro-batch: stage 0 forward 480 / 96 = 5 s, backward 864 / 96 = 9 s; stage 1 432 / 96 = 4.5, 9
    assert cost.timeline.makespan == schedule.simulate([5, 4.5], [9, 9], 4).makespan
    assert first.busy_time == 4 * 14 and last.busy_time == 4 * 13.5
    assert first.step_time == last.step_time == cost.step_time
    assert first.bubble_time == cost.step_time - 56
    assert cost.bubble_fraction == pytest.approx((first.bubble_time + last.bubble_time) / (2 * cost.step_time))


def test_stage_costs_times_and_bandwidth(stack: modelmeter.Trace) -> None:
    given = stage_costs(stack, 2, 3, times=[(1, 2), (1, 2)])
    assert given.step_time == 12 and given.time_unit == "s"
    slowed = stage_costs(stack, 2, 3, times=[(1, 2), (1, 2)], bandwidth=ACTIVATION / 0.5)
    assert slowed.step_time == schedule.simulate([1, 1], [2, 2], 3, transfer=[0.5]).makespan > 12
    unitless = stage_costs(stack, 2, 3)
    assert unitless.time_unit == "flop" and unitless.ranks[0].busy_time == 3 * (EMBED + 2 * BLOCK + EMBED + 4 * BLOCK)


def test_stage_times_on_a_device(llama: modelmeter.Analysis) -> None:
    """On a device, a stage's time is the roofline time of its operators: the stages' times add up to the model's
    (docs/roofline.md), and the two middle stages, one identical layer each, take the same time."""
    settings = RooflineSettings(get_device("h100"), efficiency=0.5)
    cost = stage_costs(llama.trace, 4, 8, device=settings)
    assert cost.time_unit == "s"
    whole = sum(roofline(llama.trace, settings).time.counts[""].values())
    assert sum(rank.busy_time for rank in cost.ranks) / 8 == pytest.approx(whole)
    assert cost.ranks[1].busy_time == pytest.approx(cost.ranks[2].busy_time)
    assert stage_costs(llama.trace, 4, 8, device="h100").step_time == pytest.approx(cost.step_time / 2)


# --- clear errors --------------------------------------------------------------------------------------------------
def test_more_stages_than_blocks(stack: modelmeter.Trace) -> None:
    with pytest.raises(PipelineSplitError, match=r"pp=5 .*Stack's 'blocks' holds 4 Block blocks: use pp <= 4"):
        split_stages(stack, 5)


def test_no_repeated_blocks() -> None:
    trace = _trace(Plain(), torch.randn(2, 4))
    with pytest.raises(PipelineSplitError, match=r"^Plain has no repeated block list .* ModuleList, ModuleDict or "
                                                 r"Sequential of two or more modules of one class"):
        find_blocks(trace)
    assert issubclass(PipelineSplitError, modelmeter.ModelMeterError)
    whole = split_stages(trace, 1)[1]  # one stage needs no blocks: it is the whole model
    assert [(s.blocks, s.forward_flops, s.parameters) for s in whole] == [((), 2 * 4 * 8 + 2 * 8 * 2, 40 + 18)]


def test_bad_arguments(stack: modelmeter.Trace) -> None:
    with pytest.raises(ValueError, match="pp must be an integer >= 1, got 0"):
        stage_costs(stack, 0, 2)
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1, got 0"):
        stage_costs(stack, 2, 0)
    with pytest.raises(PipelineSplitError,
                       match=r"layout must give 2 block counts >= 1 .* Block blocks of Stack's 'blocks', got \[4, 0\]"):
        split_stages(stack, 2, layout=[4, 0])
    with pytest.raises(ValueError, match="pass one of times, device and flops_per_second, not several"):
        stage_costs(stack, 2, 2, times=[(1, 1), (1, 1)], flops_per_second=1.0)
    with pytest.raises(ValueError, match=r"times must give \(forward, backward\) seconds for each of the 2 stages"):
        stage_costs(stack, 2, 2, times=[(1, 1)])
    with pytest.raises(ValueError, match="bandwidth needs times in seconds"):
        stage_costs(stack, 2, 2, bandwidth=1e9)
    with pytest.raises(ValueError, match="backward=True"):
        stage_costs(modelmeter.analyze(Stack(), torch.randn(BATCH, 4), quiet=True).trace, 2, 2)
    with pytest.raises(ValueError, match="forward times must be finite numbers >= 0"):
        schedule.simulate([1, -1], [1, 1], 2)
