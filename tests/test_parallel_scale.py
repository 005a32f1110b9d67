"""A Llama-3.1-405B-shaped model (126 layers) under ``fsdp=128,tp=8`` (1024 ranks), 8192 tokens per rank, forward
and backward: what one rank computes, holds and sends is exact at that scale.

The shape is the published one (Llama 3 paper, Dubey et al. 2024, table 3; Hugging Face's
``meta-llama/Llama-3.1-405B`` config.json): hidden 16384, 126 layers, 128 heads, 8 key-value heads, FFN 53248,
vocabulary 128256, RoPE theta 500000. Built from the config on the meta device, nothing downloaded.

Oracles, none of which is the code under test run again:
- FLOPs: the linear layers' multiply-adds of one layer on one tensor-parallel rank by hand (a column- or row-sharded
  weight is 1/8 of the layer's), and linearity in depth: the 126-layer total equals the 2-layer run's plus 124 times
  what a third layer adds (every layer of the 126 counts the same).
- Parameters held by the rank: the global count / 1024, within FSDP2's padding (at most one row of dim 0 per
  parameter per rank) and tensor parallelism's replicated norms; a layer's exactly, by hand.
- Collectives: per layer, Megatron-LM's two all-reduces forward and two backward on ``tp`` (Shoeybi et al. 2019,
  section 3), FSDP2's reduce-scatter of the layer's gradients and its all-gathers of the layer's parameters
  (forward, and again for the backward pass: ZeRO-3), with the payloads by hand.

Times and memory of this run are the benchmark's (benchmarks/compare.py ``--parallel-only``), never asserted here.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import modelmeter

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]
transformers = pytest.importorskip("transformers")

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 16384, 53248, 128, 8, 128256
HEAD_DIM = HIDDEN // HEADS
LAYERS, SEQ, FSDP, TP = 126, 8192, 128, 8
PLAN = f"fsdp={FSDP},tp={TP}"
FLOAT = 4


def llama_405b(layers: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, vocab_size=VOCAB, rope_theta=500000.0, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def analysed(layers: int) -> tuple[torch.nn.Module, Any]:
    model = llama_405b(layers)
    tokens = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, modelmeter.analyze(model, tokens, parallel=PLAN, backward=True, quiet=True, memory=True,
                                     optimizer="adamw")


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple[torch.nn.Module, Any]]:
    return {layers: analysed(layers) for layers in (2, 3, LAYERS)}


def layer_names(layers: int) -> list[str]:
    return [f"model.layers.{i}" for i in range(layers)]


def collective_counts(analysis: Any, module: str | None = None) -> Counter[tuple[str, str, str]]:
    """(kind, phase, mesh dimension) -> how many, of the whole run or of the calls ``module`` (inclusive) issued."""
    return Counter((call.kind, call.phase, call.dim) for call in analysis.communication.calls
                   if module is None or module in call.modules)


def test_the_model_is_405b_shaped(runs: dict[int, tuple[torch.nn.Module, Any]]) -> None:
    model, _ = runs[LAYERS]
    total = sum(p.numel() for p in model.parameters())
    assert round(total / 1e9, 1) == 405.9  # 405B: 126 layers of 3.19e9 and two embeddings of 2.1e9


def test_every_layer_computes_the_same_and_depth_is_linear(runs: dict[int, tuple[torch.nn.Module, Any]]) -> None:
    _, two = runs[2]
    _, three = runs[3]
    _, full = runs[LAYERS]
    by_module = full.flops.by_module()
    per_layer = {by_module[name] for name in layer_names(LAYERS)}
    assert len(per_layer) == 1
    (layer,) = per_layer
    assert layer == three.flops.total() - two.flops.total() > 0
    assert full.flops.total() == two.flops.total() + (LAYERS - 2) * layer
    assert full.flops.by_phase() == {phase: two.flops.by_phase()[phase] + (LAYERS - 2) * (
        three.flops.by_phase()[phase] - two.flops.by_phase()[phase]) for phase in two.flops.by_phase()}


def test_a_layers_projections_are_one_tensor_parallel_rank_s(runs: dict[int, tuple[torch.nn.Module, Any]]) -> None:
    _, full = runs[LAYERS]
    kv = KV_HEADS * HEAD_DIM
    # q, k, v, o and gate, up, down, each 1/TP of the layer's on this rank: multiply-adds of the forward pass
    forward = SEQ * (HIDDEN * HIDDEN * 2 + HIDDEN * kv * 2 + HIDDEN * FFN * 3) // TP
    for name in (layer_names(LAYERS)[0], layer_names(LAYERS)[-1]):
        operators = full.flops.by_module_and_operator()[name]
        assert operators["linear"] == forward
        assert operators["mm"] == 2 * forward  # the backward pass: input and weight gradients


def test_the_rank_holds_a_1024th_of_the_parameters(runs: dict[int, tuple[torch.nn.Module, Any]]) -> None:
    model, full = runs[LAYERS]
    ranks = FSDP * TP
    for name in ("", *layer_names(LAYERS)[:2]):
        module = model.get_submodule(name)
        global_count = sum(p.numel() for p in module.parameters())
        padding = sum(p[0].numel() for p in module.parameters())  # one row of dim 0 per parameter, at most
        held = full.parameters[name]
        assert global_count / ranks <= held <= global_count / ranks + padding
        if name:
            # the two norms are replicated over tp (sharded over fsdp only), the projections over both; a layer's
            # dims divide evenly: FSDP2 pads nothing
            norms = 2 * HIDDEN
            assert held == (global_count - norms) // ranks + norms // FSDP


def layer_payload() -> int:
    """Bytes of one layer's parameters on one tensor-parallel rank (FSDP2 gathers them over ``fsdp``, and
    reduce-scatters their gradients): the sharded projections' 1/TP, and the two norms replicated."""
    kv = KV_HEADS * HEAD_DIM
    return FLOAT * ((HIDDEN * HIDDEN * 2 + HIDDEN * kv * 2 + HIDDEN * FFN * 3) // TP + 2 * HIDDEN)


def test_collectives_per_layer(runs: dict[int, tuple[torch.nn.Module, Any]]) -> None:
    _, two = runs[2]
    _, three = runs[3]
    _, full = runs[LAYERS]
    added = collective_counts(three) - collective_counts(two)
    assert added == {("all_reduce", "forward", "tp"): 2, ("all_reduce", "backward", "tp"): 2,
                     ("all_gather", "forward", "fsdp"): 1, ("all_gather", "backward", "fsdp"): 1,
                     ("reduce_scatter", "backward", "fsdp"): 1}
    whole = collective_counts(full)
    assert whole == collective_counts(two) + Counter({key: (LAYERS - 2) * n for key, n in added.items()})
    by_kind = full.communication.by_module_and_kind()
    activation = FLOAT * SEQ * HIDDEN
    for name in layer_names(LAYERS):
        assert by_kind[(name, "all_reduce")].count == 4
        assert by_kind[(name, "all_reduce")].payload == 4 * activation
        assert by_kind[(name, "reduce_scatter")].count == 1
        assert by_kind[(name, "reduce_scatter")].payload == layer_payload()
    # FSDP2 issues a layer's backward all-gather as a prefetch from the backward of the layer after it, and the last
    # layer's from the model's own backward hook: 2 x 126 - 1 under the layers, one more under the root
    gathers = [by_kind[(name, "all_gather")] for name in layer_names(LAYERS)]
    assert sum(g.count for g in gathers) == 2 * LAYERS - 1
    assert sum(g.payload for g in gathers) == (2 * LAYERS - 1) * layer_payload()
    prefetched = [call.payload for call in full.communication.calls
                  if call.module == "" and (call.kind, call.phase, call.dim) == ("all_gather", "backward", "fsdp")]
    assert prefetched == [layer_payload()]
