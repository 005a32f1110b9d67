"""Every operator of the model families of issue 4 is counted or classified, in every convention and phase.

Each family (tests/families.py: tiny torchvision, timm and transformers models, recurrent layers,
embeddings, pooling of every dimension, every upsample mode, layers, reductions, losses) runs once in
training mode, forward and backward, and once for inference (eval mode, no grad); the three conventions
are counted from those traces. Under each: no unsupported operator; something counted in both phases
(every family has parameters or inputs that require grad); phases that add up to the total; ``macs`` <=
``fvcore`` and 2 x ``macs`` <= ``flops``. Independent oracles:

* ``torch.utils.flop_counter`` (2 per multiply-add, products only) equals 2 x ``macs`` with dense
  attention, forward and backward, family by family;
* hand arithmetic: Llama's causal attention pairs L·(L+1)/2 per head (L² dense) and its analytic
  multiply-adds, Mistral's sliding window, ResNet's backward (2x forward but the stem, frozen backbone);
* real kernels: Mixtral on the meta device counts what a real run counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from families import FAMILIES, llama_config
from modelmeter import FlopCountAnalysis
from modelmeter.engine.inputs import split_inputs
from modelmeter.engine.trace import Trace
from modelmeter.handles.base import backward_key

CONVENTIONS = ("fvcore", "macs", "flops")
PHASES = ("forward", "backward")
# Families without a matrix product or convolution: only the ``flops`` convention counts their work.
NO_PRODUCTS = {"pooling", "upsampling", "embeddings"}
# The slowest families to trace (~1 s or more each on two cores).
SLOW = {"inception_v3", "googlenet", "efficientnet_b0", "s3d", "maxvit",
        "r2plus1d_18", "mixtral", "mobilenet_v3_small", "mobilenetv3_small_100", "recurrent"}


def _case(package: str, name: str) -> Any:
    marks = [pytest.mark.slow] if name in SLOW else []
    return pytest.param((package, name), id=f"{package}-{name}", marks=marks)


def analysis(model: nn.Module, inputs: Any, convention: str, trace: Trace | None = None,
             **kwargs: Any) -> FlopCountAnalysis:
    flops = FlopCountAnalysis(model, inputs, convention=convention, trace=trace, **kwargs)
    return flops.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


@dataclass
class Family:
    """One family's model and inputs, run once forward and backward, counted under every convention."""

    name: str
    model: nn.Module
    inputs: Any
    trace: Trace
    analyses: dict[str, FlopCountAnalysis]
    inference: dict[str, FlopCountAnalysis]


@pytest.fixture(scope="module", params=[_case(p, n) for p, builders in FAMILIES.items() for n in builders])
def family(request: pytest.FixtureRequest) -> Family:
    package, name = request.param
    if package != "torch":
        pytest.importorskip(package)
    model, inputs = FAMILIES[package][name]()
    trace = analysis(model, inputs, "fvcore", backward=True).trace
    analyses = {c: analysis(model, inputs, c, trace, backward=True) for c in CONVENTIONS}
    model.eval()
    with torch.no_grad():  # inference: eval-mode kernels and fused fast paths
        inference_trace = analysis(model, inputs, "fvcore").trace
    model.train()
    inference = {c: analysis(model, inputs, c, inference_trace) for c in CONVENTIONS}
    return Family(name, model, inputs, trace, analyses, inference)


def test_every_operator_is_known(family: Family) -> None:
    found = {c: dict(a.unsupported_ops()) for c, a in family.analyses.items()}
    assert found == {c: {} for c in CONVENTIONS}


def test_every_inference_operator_is_known(family: Family) -> None:
    """Eval mode under ``torch.no_grad``, forward only."""
    found = {c: dict(a.unsupported_ops()) for c, a in family.inference.items()}
    assert found == {c: {} for c in CONVENTIONS}
    for convention, flops in family.inference.items():
        if convention == "flops" or family.name not in NO_PRODUCTS:
            assert flops.by_phase() == {"forward": flops.total(), "backward": 0}
            assert flops.total() > 0, convention


def test_both_phases_count(family: Family) -> None:
    for convention, flops in family.analyses.items():
        phases = flops.by_phase()
        assert sum(phases.values()) == flops.total(), convention
        if convention == "flops" or family.name not in NO_PRODUCTS:
            assert all(phases[p] > 0 for p in PHASES), (convention, phases)


def test_conventions_agree(family: Family) -> None:
    """``macs`` <= ``fvcore`` and 2 x ``macs`` <= ``flops``, in each phase."""
    phases = {c: a.by_phase() for c, a in family.analyses.items()}
    for p in PHASES:
        assert phases["macs"][p] <= phases["fvcore"][p], p
        assert 2 * phases["macs"][p] <= phases["flops"][p], p


# --- products against torch.utils.flop_counter -----------------------------------------------------------
# Families whose products torch's counter does not see: fused RNN kernels, grouped_mm (MoE).
UNSEEN_BY_TORCH = NO_PRODUCTS | {"recurrent", "mixtral"}
# torch's own dense attention formulas for the CPU flash kernel, which its counter leaves out.
TORCH_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *_, **__: flop_counter.sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad, q, k, v, *_, **__: flop_counter.sdpa_backward_flop_count(grad, q, k, v),
}


def float_outputs(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors that require grad in a (nested) output: the default loss sums them."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and value.requires_grad else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in float_outputs(v)]
    return []


def torch_flop_counts(model: nn.Module, inputs: Any) -> dict[str, int]:
    """Forward and backward flops of ``torch.utils.flop_counter`` (2 per multiply-add), on FakeTensors."""
    args, kwargs = split_inputs(inputs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        def fake(t: torch.Tensor) -> torch.Tensor:
            return mode.from_tensor(t, static_shapes=True)

        state = {name: fake(t) for name, t in [*model.named_parameters(), *model.named_buffers()]}
        args = tuple(fake(a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: fake(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        forward = FlopCounterMode(display=False, custom_mapping=TORCH_ATTENTION)
        with forward:
            output = functional_call(model, state, args, kwargs)
        loss = sum(t.sum() for t in float_outputs(output))
        backward = FlopCounterMode(display=False, custom_mapping=TORCH_ATTENTION)
        with backward:
            loss.backward()  # type: ignore[union-attr]
    return {"forward": forward.get_total_flops(), "backward": backward.get_total_flops()}


def test_products_match_torch_flop_counter(family: Family) -> None:
    """``macs`` with dense attention, doubled, is torch's count of products, forward and backward.

    Backward is compared only without grouped convolutions: torch's counter ignores ``groups`` in the
    weight gradient and over-counts it by the group count (a depthwise 3x3 conv over C channels: C x).
    """
    if family.name in UNSEEN_BY_TORCH:
        pytest.skip("torch's counter does not count this family's products")
    dense = analysis(family.model, family.inputs, "macs", family.trace, backward=True, dense_attention=True)
    # attention's backward operator by operator, as they ran (math path or fused kernel), as torch counts it
    dense.set_op_handle(backward_key("aten::scaled_dot_product_attention"), None)
    ours = {p: 2 * n for p, n in dense.by_phase().items()}
    theirs = torch_flop_counts(family.model, family.inputs)
    grouped = any(getattr(m, "groups", 1) > 1 for m in family.model.modules() if isinstance(m, nn.modules.conv._ConvNd))
    assert ours["forward"] == theirs["forward"]
    if not grouped:
        assert ours["backward"] == theirs["backward"]


# --- causal attention in a real Llama -------------------------------------------------------------------
ATTENTION = "scaled_dot_product_attention"


@pytest.mark.parametrize("execution", ["auto", "real"])
@pytest.mark.parametrize("convention", ["macs", "fvcore"])
@pytest.mark.parametrize("dense", [False, True])
def test_llama_counts_causal_pairs(execution: str, convention: str, dense: bool) -> None:
    """Per layer and query head: L·(L+1)/2 attended pairs (L² dense), each a dot product over the head
    dimension for the score and one for the value: 2 x 16 multiply-adds. ``auto`` runs on FakeTensors,
    where transformers builds an explicit causal mask instead of passing ``is_causal``."""
    transformers = pytest.importorskip("transformers")
    config = llama_config()
    model = transformers.LlamaForCausalLM(config)
    length, layers, heads, head_dim = 16, 2, 4, 16
    assert (config.num_hidden_layers, config.num_attention_heads, config.hidden_size) == (layers, heads, 64)
    ids = torch.randint(0, 100, (1, length))
    flops = analysis(model, {"input_ids": ids}, convention, dense_attention=dense, execution=execution)
    pairs = length * length if dense else length * (length + 1) // 2
    assert flops.by_operator()[ATTENTION] == layers * heads * pairs * 2 * head_dim


def test_llama_macs_match_the_analytic_count() -> None:
    """``macs``, forward: one multiply-add per non-embedding weight per token, plus the LM head, plus the
    score and value products of causal attention (real execution: the mask is passed as ``is_causal``)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(llama_config())
    tokens, hidden, kv, mlp, layers, vocab = 16, 64, 2 * 16, 128, 2, 100
    per_layer = hidden * hidden + 2 * hidden * kv + hidden * hidden + 3 * hidden * mlp  # q, k and v, o, MLP
    non_embedding = sum(p.numel() for n, p in model.named_parameters() if "proj" in n)
    assert non_embedding == layers * per_layer
    attention = layers * 4 * tokens * (tokens + 1) // 2 * 2 * 16
    flops = analysis(model, {"input_ids": torch.randint(0, vocab, (1, tokens))}, "macs", execution="real")
    assert flops.total() == tokens * (layers * per_layer + hidden * vocab) + attention


@pytest.mark.parametrize("execution", ["auto", "real"])
def test_mistral_counts_sliding_window_pairs(execution: str) -> None:
    """Window 8 over 16 tokens: query i attends keys i-7..i, min(i + 1, 8) of them: 36 + 8 x 8 = 100 pairs."""
    transformers = pytest.importorskip("transformers")
    model, inputs = FAMILIES["transformers"]["mistral"]()
    assert isinstance(model, transformers.MistralForCausalLM)
    assert (model.config.sliding_window, inputs["input_ids"].shape[1]) == (8, 16)
    flops = analysis(model, inputs, "macs", execution=execution)
    assert sum(min(i + 1, 8) for i in range(16)) == 100
    assert flops.by_operator()[ATTENTION] == 2 * 4 * 100 * 2 * 16


# --- backward of a real CNN: exact relations to its forward ------------------------------------------
def test_resnet_backward_is_twice_forward_but_for_the_stem_input() -> None:
    """``macs``: each convolution and linear layer repeats its multiply-adds once for the gradient of its
    weight and once for that of its input, except the stem, whose input (the image) needs no gradient."""
    model, inputs = FAMILIES["torchvision"]["resnet18"]()
    flops = analysis(model, inputs, "macs", backward=True)
    stem = 2 * 64 * 32 * 32 * 3 * 7 * 7  # batch x out channels x 32 x 32 output positions x 3 x 7 x 7 kernel
    assert flops.by_phase("conv1") == {"forward": stem, "backward": stem}
    phases = flops.by_phase()
    assert phases["backward"] == 2 * phases["forward"] - stem


def test_frozen_resnet_backward_is_only_its_classifier_weight_gradient() -> None:
    model, inputs = FAMILIES["torchvision"]["resnet18"]()
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith("fc."))
    flops = analysis(model, inputs, "macs", backward=True)
    classifier = 2 * 512 * 1000  # batch x in features x out features
    assert flops.by_phase("fc") == {"forward": classifier, "backward": classifier}
    assert flops.by_phase()["backward"] == classifier


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_mixtral_on_the_meta_device_counts_as_real_kernels(dtype: torch.dtype) -> None:
    """Mixture-of-experts routing needs values; on the meta device the engine's placeholders stand in. With
    dense attention (mask values are unknown there), forward and backward match a run of real kernels."""
    pytest.importorskip("transformers")
    model, inputs = FAMILIES["transformers"]["mixtral"]()
    real = analysis(model.to(dtype), inputs, "macs", backward=True, dense_attention=True, execution="real")
    with torch.device("meta"):
        meta_model, _ = FAMILIES["transformers"]["mixtral"]()
    meta = analysis(meta_model.to(dtype), inputs, "macs", backward=True, dense_attention=True)
    assert dict(meta.unsupported_ops()) == {}
    assert meta.by_phase() == real.by_phase()
