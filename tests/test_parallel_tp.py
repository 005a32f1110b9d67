"""Tensor parallel plans (modelmeter.parallel.tensor_plans) run on torch's own ``parallelize_module`` under the fake
process group, one rank recorded by ``modelmeter.analyze``.

Oracles:
- FLOPs: one rank's count x tp = the single-device count + (tp - 1) x the work every rank repeats, computed by hand
  below (norms, residual adds and rotary angles outside the sharded regions; with sequence parallelism only the
  rotary angles, the embedding's backward and the partial input gradients a block's column projections add up).
- Collectives: the trace's equal ``CommDebugMode``'s on the same run, and Megatron-LM's counts (Shoeybi et al. 2019,
  section 3 and figure 4: two all-reduces per layer in the forward pass, two in the backward pass; Korthikanti et
  al. 2022, section 4.2.2: with sequence parallelism each becomes an all-gather and a reduce-scatter).

Sizes: a batch of b=2 sequences of s=16 tokens, hidden size h=64, L=2 layers, head_dim d=16; ``convention="flops"``
counts one FLOP per element of an element-wise operator, a mean over n elements as n + its outputs.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree

import modelmeter
from modelmeter._torch_compat import FakeTensorMode
from modelmeter.errors import ParallelPlanError
from modelmeter.parallel.tensor_plans import apply_tensor_parallel, default_tp_plan
from modelmeter.zoo.gpt import GPT, GPTConfig
from modelmeter.zoo.llama import Llama, LlamaConfig

B, S, H, LAYERS, HEAD_DIM, VOCAB = 2, 16, 64, 2, 16, 1000
BSH = B * S * H
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


@pytest.fixture
def mesh(request: pytest.FixtureRequest) -> Iterator[DeviceMesh]:
    """A one-dimensional "tp" mesh of ``request.param`` ranks (2 unless parametrised) on the fake process group,
    torn down afterwards with the globals ``destroy_process_group`` leaves set put back."""
    from torch.distributed import distributed_c10d
    from torch.distributed.tensor import _random

    ranks = getattr(request, "param", 2)
    backend, tracker = distributed_c10d._backend, _random._rng_tracker
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()
        distributed_c10d._backend, _random._rng_tracker = backend, tracker


# --- models ------------------------------------------------------------------------------------------------------
def zoo_llama(kv_heads: int = 2) -> nn.Module:
    with torch.device("meta"):
        return Llama(LlamaConfig(VOCAB, H, 176, LAYERS, 4, kv_heads, 128))


def hf_model(family: str = "llama", **overrides: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    sizes = {"vocab_size": VOCAB, "hidden_size": H, "intermediate_size": 176, "num_hidden_layers": LAYERS,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
             "head_dim": HEAD_DIM, "tie_word_embeddings": False} | overrides
    with torch.device("meta"):
        return model_class(config_class(**sizes))


# --- runs --------------------------------------------------------------------------------------------------------
def single_device(model: nn.Module) -> modelmeter.Analysis:
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        return modelmeter.analyze(model, torch.randint(0, VOCAB, (B, S)), convention="flops", backward=True,
                                  quiet=True)


def one_rank(model: nn.Module, shard: Callable[[nn.Module], Any]) -> tuple[modelmeter.Analysis, CommDebugMode]:
    """``shard(model)`` (on meta), then the rank's training step recorded by modelmeter and, in a plain step of the
    same model (output summed, backward), by torch's CommDebugMode: an analysis sets the caller's modes aside
    (docs/torch.md). The model's tensors are FakeTensors already: ``execution="real"`` runs them as they are, once
    (as modelmeter's parallel runner does)."""
    shard(model)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        tokens = torch.randint(0, VOCAB, (B, S))
        analysis = modelmeter.analyze(model, tokens, convention="flops", backward=True, execution="real", quiet=True)
        with CommDebugMode() as comm:  # modelmeter's default loss: the sum of the output's floating-point tensors
            leaves = pytree.tree_leaves(model(tokens))
            sum(t.sum() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()).backward()
        model.zero_grad(set_to_none=True)
    return analysis, comm


def recorded_collectives(analysis: modelmeter.Analysis, phase: str) -> Counter[str]:
    return Counter(event.op.partition("::")[2] for event in analysis.trace.events
                   if event.level == "dispatch" and event.phase == phase and event.op.partition("::")[2] in COLLECTIVES)


def debug_mode_collectives(comm: CommDebugMode, phase: str) -> Counter[str]:
    return Counter({str(op).rpartition(".")[2]: n for op, n in comm.comm_module_counts["Global"][phase].items()})


# --- redundant work, by hand -------------------------------------------------------------------------------------
def rms_norms_forward(count: int) -> int:
    """pow, mean (n + rows), + eps (rows), rsqrt (rows), x * rsqrt, weight * x, over b x s rows of h."""
    rows = B * S
    return count * (4 * BSH + 3 * rows)


ZOO_ROTARY = 4 * (HEAD_DIM // 2) + S * HEAD_DIM // 2 + 2 * S * HEAD_DIM
"""arange / d, theta ** exponent, 1 / x (a reciprocal and a multiply) on d/2 frequencies; positions x frequencies;
cos and sin of s x d angles."""
HF_ROTARY = S * HEAD_DIM // 2 + 4 * S * HEAD_DIM
"""frequencies @ positions (d/2 x s products of one term); cos and sin of s x d angles, each times the attention
scaling."""
PARTIAL_INPUT_GRADIENTS = LAYERS * ((3 - 1) + (2 - 1)) * BSH
"""A block's column projections (q, k, v; gate, up) each give a partial gradient of the block's whole input, added
up on every rank before it is reduced."""
EMBEDDING_BACKWARD = BSH
"""Every rank scatters the whole output gradient into its slice of the vocabulary."""


def repeated_work(rotary: int, sequence_parallel: bool, norms_in_a_step: int = 0) -> dict[str, int]:
    """What every rank computes whole, by phase. Without sequence parallelism: the 2L + 1 norms and the 2L residual
    adds (forward), the norms' backward (``norms_in_a_step`` less their forward) — the norm modules' count on one
    device — and the partial input gradients and the embedding's backward; with it, the norms and residual adds
    are split too."""
    forward = rotary if sequence_parallel else rotary + rms_norms_forward(2 * LAYERS + 1) + 2 * LAYERS * BSH
    backward = PARTIAL_INPUT_GRADIENTS + EMBEDDING_BACKWARD
    if not sequence_parallel:
        backward += norms_in_a_step - rms_norms_forward(2 * LAYERS + 1)
    return {"forward": forward, "backward": backward}


def norm_modules(analysis: modelmeter.Analysis) -> int:
    return sum(n for name, n in analysis.flops.by_module().items() if name.endswith("norm"))


# --- FLOPs and collectives per rank ------------------------------------------------------------------------------
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("family", ["zoo", "hf"])
def test_a_ranks_flops_times_tp_are_one_devices_plus_the_repeated_work(mesh: DeviceMesh, family: str,
                                                                       sequence_parallel: bool) -> None:
    build, rotary = (zoo_llama, ZOO_ROTARY) if family == "zoo" else (hf_model, HF_ROTARY)
    single = single_device(build())
    rank, _ = one_rank(build(), lambda m: apply_tensor_parallel(m, mesh, sequence_parallel=sequence_parallel))
    repeated = repeated_work(rotary, sequence_parallel, norm_modules(single))
    tp = mesh.size()
    for phase in ("forward", "backward"):
        assert tp * rank.flops.by_phase()[phase] == single.flops.by_phase()[phase] + (tp - 1) * repeated[phase]
    for sharded in ("linear", "mm", "scaled_dot_product_attention", "scaled_dot_product_attention_backward"):
        assert tp * rank.flops.by_operator()[sharded] == single.flops.by_operator()[sharded]


@pytest.mark.parametrize("mesh", [4], indirect=True)
def test_the_repeated_work_is_repeated_on_every_rank_of_a_larger_mesh(mesh: DeviceMesh) -> None:
    single = single_device(zoo_llama(kv_heads=4))
    rank, _ = one_rank(zoo_llama(kv_heads=4), lambda m: apply_tensor_parallel(m, mesh))
    repeated = repeated_work(ZOO_ROTARY, False, norm_modules(single))
    assert 4 * rank.flops.total() == single.flops.total() + 3 * sum(repeated.values())


def test_collectives_are_megatrons_and_those_commdebugmode_counts(mesh: DeviceMesh) -> None:
    analysis, comm = one_rank(zoo_llama(), lambda m: apply_tensor_parallel(m, mesh))
    for phase in ("forward", "backward"):
        assert recorded_collectives(analysis, phase) == debug_mode_collectives(comm, phase)
    # two all-reduces per layer each way (Megatron-LM's f and g); the embedding's partial sums are all-reduced in the
    # forward pass, the output head's input gradient in the backward pass; the logits are gathered whole
    assert recorded_collectives(analysis, "forward") == {"all_reduce": 2 * LAYERS + 1, "all_gather_into_tensor": 1}
    assert recorded_collectives(analysis, "backward") == {"all_reduce": 2 * LAYERS + 1}
    reduced = [event.inputs[0].shape for event in analysis.trace.events
               if event.level == "dispatch" and event.op.endswith("::all_reduce") and event.phase == "forward"]
    assert reduced == [(B, S, H)] * (2 * LAYERS + 1)  # whole activations, not shards


def test_sequence_parallel_gathers_and_scatters_instead(mesh: DeviceMesh) -> None:
    analysis, comm = one_rank(hf_model(), lambda m: apply_tensor_parallel(m, mesh, sequence_parallel=True))
    for phase in ("forward", "backward"):
        assert recorded_collectives(analysis, phase) == debug_mode_collectives(comm, phase)
    # per layer and direction an all-gather and a reduce-scatter per region; the embedding's output is scattered
    # (forward) and gathered back (backward); the output head gathers its input and the logits, and scatters its
    # input's gradient
    assert recorded_collectives(analysis, "forward") == {"all_gather_into_tensor": 2 * LAYERS + 2,
                                                         "reduce_scatter_tensor": 2 * LAYERS + 1}
    assert recorded_collectives(analysis, "backward") == {"all_gather_into_tensor": 2 * LAYERS + 1,
                                                          "reduce_scatter_tensor": 2 * LAYERS + 1}


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_mistral_and_qwen2_are_sharded_by_the_same_plan(mesh: DeviceMesh, family: str) -> None:
    analysis, comm = one_rank(hf_model(family, tie_word_embeddings=family == "qwen2"),
                              lambda m: apply_tensor_parallel(m, mesh))
    assert recorded_collectives(analysis, "forward") == debug_mode_collectives(comm, "forward") == \
        {"all_reduce": 2 * LAYERS + 1, "all_gather_into_tensor": 1}


def test_norms_inside_a_block_stay_replicated_under_sequence_parallelism(mesh: DeviceMesh) -> None:
    """Qwen3 normalises each head's q and k inside attention, on the gathered activations, not on sequence shards."""
    plan = default_tp_plan(hf_model("qwen3"), sequence_parallel=True)
    assert "model.layers.0.self_attn.q_norm" not in plan
    assert isinstance(plan["model.layers.0.input_layernorm"], SequenceParallel)
    analysis, comm = one_rank(hf_model("qwen3"), lambda m: apply_tensor_parallel(m, mesh, sequence_parallel=True))
    assert recorded_collectives(analysis, "forward") == debug_mode_collectives(comm, "forward")


def test_torchs_parallelize_module_takes_the_plan_as_it_is(mesh: DeviceMesh) -> None:
    """A Hugging Face model views its projections with -1 heads: parallelize_module alone is enough."""
    model = hf_model()
    parallelize_module(model, mesh, default_tp_plan(model))
    analysis, _ = one_rank(model, lambda m: None)
    assert 2 * analysis.flops.by_operator()["linear"] == single_device(hf_model()).flops.by_operator()["linear"]


def test_a_plain_mlp_stack_is_sharded_in_linear_pairs(mesh: DeviceMesh) -> None:
    def stack() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 16), nn.Tanh(),
                                 nn.Linear(16, 8))

    plan = default_tp_plan(stack())
    assert {name: type(style) for name, style in plan.items()} == {
        "0": ColwiseParallel, "2": RowwiseParallel, "3": ColwiseParallel, "5": RowwiseParallel}
    model, whole = stack(), stack()
    parallelize_module(model, mesh, plan)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        rank = modelmeter.analyze(model, torch.randn(4, 8), convention="flops", execution="real", quiet=True)
        single = modelmeter.analyze(whole.to_empty(device="cpu"), torch.randn(4, 8), convention="flops", quiet=True)
    # everything is split but the row-parallel Linears' bias adds, which every rank does (batch 4 x 8 outputs, twice)
    assert 2 * rank.flops.total() == single.flops.total() + 2 * 4 * 8
    assert recorded_collectives(rank, "forward") == {"all_reduce": 2}


# --- the plan itself ---------------------------------------------------------------------------------------------
def test_the_llama_plan_is_megatrons() -> None:
    llama_on_meta = zoo_llama()
    plan = default_tp_plan(llama_on_meta)
    layer = "model.layers.0"
    kinds = {name: type(style) for name, style in plan.items() if name.startswith(layer)}
    assert kinds == {f"{layer}.self_attn": PrepareModuleInput, f"{layer}.mlp": PrepareModuleInput,
                     **{f"{layer}.self_attn.{p}_proj": ColwiseParallel for p in "qkv"},
                     f"{layer}.self_attn.o_proj": RowwiseParallel,
                     f"{layer}.mlp.gate_proj": ColwiseParallel, f"{layer}.mlp.up_proj": ColwiseParallel,
                     f"{layer}.mlp.down_proj": RowwiseParallel}
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
    assert plan["model.embed_tokens"].input_layouts == (Replicate(),)
    assert isinstance(plan["lm_head"], ColwiseParallel) and plan["lm_head"].output_layouts == (Replicate(),)
    assert "model.norm" not in plan  # replicated: every rank normalises the whole activations
    assert llama_on_meta.model.layers[0].self_attn.num_heads == 4  # the model is only read


@pytest.mark.parametrize(("columns", "row"), [
    (("q_proj", "k_proj", "v_proj"), "o_proj"), (("wq", "wk", "wv"), "wo"),  # Hugging Face / zoo; Meta, torchtitan
    (("gate_proj", "up_proj"), "down_proj"), (("w1", "w3"), "w2"), (("fc1",), "fc2"),
])
def test_each_naming_of_a_block_is_recognised(columns: tuple[str, ...], row: str) -> None:
    block = nn.Module()
    for name in (*columns, row):
        block.add_module(name, nn.Linear(8, 8))
    plan = default_tp_plan(nn.ModuleDict({"block": block}))
    expected = {"block": PrepareModuleInput, **{f"block.{c}": ColwiseParallel for c in columns},
                f"block.{row}": RowwiseParallel}
    assert {name: type(style) for name, style in plan.items()} == expected


def test_sequence_parallel_shards_the_norms_and_the_activations_between_regions() -> None:
    plan = default_tp_plan(zoo_llama(), sequence_parallel=True)
    norms = [name for name in plan if name.endswith("norm")]
    assert len(norms) == 2 * LAYERS + 1 and all(isinstance(plan[name], SequenceParallel) for name in norms)
    assert plan["model.embed_tokens"].output_layouts == (Shard(1),)
    assert plan["model.layers.0.self_attn.o_proj"].output_layouts == (Shard(1),)
    assert plan["model.layers.1.mlp.down_proj"].output_layouts == (Shard(1),)
    assert plan["lm_head"].input_layouts == (Shard(1),)
    attention = plan["model.layers.0.self_attn"]
    assert isinstance(attention, PrepareModuleInput)
    assert attention.input_layouts == (Shard(1), None, None)  # (x, cos, sin): the hidden states gathered
    assert attention.desired_input_layouts == (Replicate(), None, None)


def test_hugging_face_attention_is_prepared_by_keyword() -> None:
    attention = default_tp_plan(hf_model(), sequence_parallel=True)["model.layers.0.self_attn"]
    assert isinstance(attention, PrepareModuleInput)
    assert attention.input_kwarg_layouts == {"hidden_states": Shard(1)}


def test_the_local_head_counts_are_set_on_the_copy_only(mesh: DeviceMesh) -> None:
    model = zoo_llama()
    apply_tensor_parallel(model, mesh)
    attention = model.model.layers[1].self_attn
    assert (attention.num_heads, attention.num_kv_heads) == (2, 1)
    assert zoo_llama().model.layers[1].self_attn.num_heads == 4


def test_tied_embeddings_stay_tied(mesh: DeviceMesh) -> None:
    model = hf_model("qwen2", tie_word_embeddings=True)
    apply_tensor_parallel(model, mesh)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.placements == (Shard(0),)


# --- what it cannot place ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mesh", [4], indirect=True)
@pytest.mark.parametrize("family", ["zoo", "hf"])
def test_head_counts_tp_does_not_divide_are_refused(mesh: DeviceMesh, family: str) -> None:
    model = zoo_llama() if family == "zoo" else hf_model()
    with pytest.raises(ParallelPlanError, match=r"'model\.layers\.0\.self_attn' has 2 key/value heads.*tp=4"):
        apply_tensor_parallel(model, mesh)


@pytest.mark.parametrize("mesh", [3], indirect=True)
def test_an_intermediate_size_tp_does_not_divide_is_refused_naming_the_row_parallel_linear(mesh: DeviceMesh) -> None:
    """DTensor rebuilds a row-parallel Linear's input from equal shards: 176 features over 3 ranks (and 64 over 3 in a
    plain MLP stack, and under a plan of the user's with a wildcard) would fail deep inside torch's sharding
    propagation; head counts that 3 does not divide are not the problem here (no attention is sharded)."""
    with torch.device("meta"):
        stack = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        wide = nn.Sequential(nn.Linear(16, 66), nn.ReLU(), nn.Linear(66, 16))
    with pytest.raises(ParallelPlanError, match=r"module '2' \(Linear, 64 input features\) is row-parallel over tp=3"):
        apply_tensor_parallel(stack, mesh)
    user_plan = {"0": ColwiseParallel(), "[2]": RowwiseParallel()}
    with pytest.raises(ParallelPlanError, match=r"module '2' .* tp=3 ranks, which do not divide 64"):
        apply_tensor_parallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)).to("meta"), mesh,
                              user_plan)
    apply_tensor_parallel(wide, mesh)  # 66 features: 22 on each rank
    assert wide[2].weight.to_local().shape == (16, 22)
    with torch.device("meta"):
        llama = Llama(LlamaConfig(VOCAB, H, 175, LAYERS, 4, 2, 128))
    with pytest.raises(ParallelPlanError, match=r"'model\.layers\.0\.mlp\.down_proj' \(Linear, 175 input"):
        apply_tensor_parallel(llama, mesh, {"model.layers.*.mlp.gate_proj": ColwiseParallel(),
                                            "model.layers.*.mlp.up_proj": ColwiseParallel(),
                                            "model.layers.*.mlp.down_proj": RowwiseParallel()})


def test_gpt2s_fused_qkv_is_refused_by_name() -> None:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        hf_gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=H, n_layer=1,
                                                                       n_head=4, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ParallelPlanError, match=r"'transformer\.h\.0\.attn\.c_attn' is a Hugging Face Conv1D.*tp_plan"):
        default_tp_plan(hf_gpt2)
    with torch.device("meta"):
        zoo_gpt = GPT(GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=1, n_head=4, n_embd=H))
    with pytest.raises(ParallelPlanError, match=r"'h\.0\.attn\.c_attn' is a projection computing q, k and v"):
        default_tp_plan(zoo_gpt)


@pytest.mark.parametrize(("model", "first"), [
    (nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()), "'0' (Conv2d)"),
    (nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), "'4' (Linear)"),
    (nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)), "'0' (Linear)"),
], ids=["conv", "odd-linear", "norm-between"])
def test_an_unknown_layout_names_the_first_module_it_cannot_place(model: nn.Module, first: str) -> None:
    with pytest.raises(ParallelPlanError, match=rf"module {re.escape(first)}.*pass a plan explicitly.*tp_plan"):
        default_tp_plan(model)



def test_the_optimizer_state_follows_a_parameters_shard_not_its_replicated_gradient() -> None:
    """DTensor leaves the vocabulary-sharded embedding's gradient replicated, whole on every rank: the gradient
    memory counts it whole, while AdamW's two moments follow each parameter's shard (``zeros_like`` of it), as the
    real run's optimizer state does (tests/test_parallel_planner_proof.py measures it on gloo)."""
    from modelmeter.metrics.memory import OPTIMIZERS, optimizer_bytes

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, max_position_embeddings=32)
    with torch.device("meta"):
        model = Llama(config)
    trace = modelmeter.analyze(model, torch.randint(0, 128, (2, 8)), parallel="tp=2", backward=True, memory=True,
                               optimizer="adamw", quiet=True).memory.trace
    # rank 0's shards: embedding and lm_head half the vocabulary, q/k/v/gate/up half their rows, o/down half their
    # columns, the three norms whole
    vocab_half, attention, mlp, norms = 64 * 32, (16 + 8 + 8) * 32 + 32 * 16, 3 * 32 * 32, 3 * 32
    shards = 2 * vocab_half + attention + mlp + norms
    assert sum(g.numel() for g in trace.gradients) == shards
    assert sum(s.nbytes for s in trace.storages if s.kind == "gradient") == 4 * (shards + vocab_half)
    parameter_tensors = 12
    assert optimizer_bytes(trace, OPTIMIZERS["adamw"])[0] == 2 * 4 * shards + 4 * parameter_tensors
