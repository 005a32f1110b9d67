"""Large language models as a new user would analyse them: transformers models built from configs on the meta
device, forward and backward, checked against the analytic count."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from modelmeter import FlopCountAnalysis

transformers = pytest.importorskip("transformers")


def _llama(**overrides: int) -> tuple[torch.nn.Module, dict[str, int]]:
    sizes = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 3, "num_attention_heads": 8,
             "num_key_value_heads": 2, "vocab_size": 1000, **overrides}
    config = transformers.LlamaConfig(**sizes, attn_implementation="sdpa")
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config), sizes


def _analytic_macs(sizes: dict[str, int], tokens: int, pairs: int) -> int:
    """One multiply-add per non-embedding weight per token (the LM head included), plus the score and value
    products of attention over ``pairs`` attended (query, key) pairs per head."""
    d, ff, heads, kv = sizes["hidden_size"], sizes["intermediate_size"], sizes["num_attention_heads"], \
        sizes["num_key_value_heads"]
    head_dim = d // heads
    per_layer = d * d + 2 * d * kv * head_dim + d * d + 3 * d * ff
    attention = 2 * heads * pairs * head_dim
    return sizes["num_hidden_layers"] * (tokens * per_layer + attention) + tokens * d * sizes["vocab_size"]


@pytest.mark.parametrize("tokens", [1, 7, 128])
def test_llama_forward_macs_match_the_analytic_count(tokens: int) -> None:
    model, sizes = _llama()
    ids = torch.zeros(1, tokens, dtype=torch.long)
    causal = FlopCountAnalysis(model, ids, convention="macs")
    assert causal.unsupported_ops() == {}
    assert causal.total() == _analytic_macs(sizes, tokens, tokens * (tokens + 1) // 2)  # L(L+1)/2 pairs, not L²
    dense = FlopCountAnalysis(model, ids, convention="macs", dense_attention=True)
    assert dense.total() == _analytic_macs(sizes, tokens, tokens * tokens)


def test_llama_backward_is_twice_the_weight_products_and_attention_as_fused_kernels_do() -> None:
    model, sizes = _llama()
    analysis = FlopCountAnalysis(model, torch.zeros(2, 64, dtype=torch.long), convention="macs", backward=True)
    phases = analysis.by_phase()
    pairs = 2 * sizes["num_attention_heads"] * 64 * 65 // 2  # per layer: batch x heads x causal pairs
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    attention = sizes["num_hidden_layers"] * pairs * 2 * head_dim
    # every weight product's input derives from the (trainable) embedding, so each needs both gradients: 2x;
    # causal attention's backward, as a fused kernel runs it, recomputes q·kᵀ before its four gradient products
    # over the same attended pairs: 2.5x
    assert phases["backward"] == 2 * (phases["forward"] - attention) + 5 * attention // 2
    per_layer = analysis.by_phase_and_operator("model.layers.0.self_attn")
    assert per_layer["forward"]["scaled_dot_product_attention"] == pairs * 2 * head_dim
    assert per_layer["backward"]["scaled_dot_product_attention_backward"] == pairs * 5 * head_dim
    assert analysis.by_phase("model.layers.1.mlp") == {"forward": 2 * 64 * 3 * 256 * 688,
                                                        "backward": 4 * 64 * 3 * 256 * 688}


def test_frozen_llama_with_a_trainable_head_costs_less_exactly() -> None:
    model, sizes = _llama()
    model.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    tokens = 32
    analysis = FlopCountAnalysis(model, torch.zeros(1, tokens, dtype=torch.long), convention="macs", backward=True)
    assert analysis.by_phase()["backward"] == tokens * sizes["hidden_size"] * sizes["vocab_size"]


_LARGE = textwrap.dedent("""
    import json, resource, sys, time, torch, transformers
    from modelmeter import FlopCountAnalysis
    which = sys.argv[1]
    if which == "llama2_70b":
        config = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                          num_attention_heads=64, num_key_value_heads=8, vocab_size=32000)
        cls, dtype = transformers.LlamaForCausalLM, torch.float32
    else:  # mixtral 8x7b, in bfloat16 as it is run
        config = transformers.MixtralConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                            num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                            num_local_experts=8, num_experts_per_tok=2)
        cls, dtype = transformers.MixtralForCausalLM, torch.bfloat16
    start = time.perf_counter()
    with torch.device("meta"):
        model = cls(config).to(dtype)
    analysis = FlopCountAnalysis(model, torch.zeros(1, 2048, dtype=torch.long), convention="macs", backward=True)
    phases = analysis.by_phase()
    print(json.dumps({"phases": phases, "unsupported": dict(analysis.unsupported_ops()),
                      "params": sum(p.numel() for p in model.parameters()),
                      "seconds": time.perf_counter() - start,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["llama2_70b", "mixtral_8x7b"])
def test_70b_and_mixtral_forward_and_backward_on_meta_under_2_gb(which: str) -> None:
    done = subprocess.run([sys.executable, "-c", _LARGE, which], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["unsupported"] == {}
    assert report["rss_mb"] < 2048, report  # the whole process: interpreter, torch, transformers and the trace
    forward, backward = report["phases"]["forward"], report["phases"]["backward"]
    tokens = 2048
    if which == "llama2_70b":
        assert report["params"] == 68_976_648_192
        embedding = 32000 * 8192
        # non-embedding weights x tokens (norm weights are no multiply-adds) + causal attention
        linear = report["params"] - embedding - (2 * 80 + 1) * 8192
        attention = 80 * 2 * 64 * (tokens * (tokens + 1) // 2) * 128
        assert forward == tokens * linear + attention
    else:
        assert report["params"] == 46_702_792_704
        # per token: attention projections, the router, two of eight experts, the LM head; plus attention
        d, ff, layers = 4096, 14336, 32
        per_token = layers * (2 * d * d + 2 * d * 1024 + d * 8 + 2 * 3 * d * ff) + d * 32000
        attention = layers * 2 * 32 * (tokens * (tokens + 1) // 2) * 128
        assert forward == tokens * per_token + attention
    assert backward == 2 * (forward - attention) + 5 * attention // 2  # as for the small Llama above
