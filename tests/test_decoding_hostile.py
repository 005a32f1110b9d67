"""Language-model inference with key-value caches: a decode step given the cache of a prefill (transformers'
``DynamicCache``, ``StaticCache``, sliding-window and encoder-decoder caches, a hand-written model's own cache),
and ``generate`` inside a module.

Oracles: hand arithmetic of a decode step (projections on one token; attention of one query over ``past + 1``
keys per head), torch's ``FlopCounterMode`` on the same real CPU step (its products; eager attention is products
too), the cache compared tensor by tensor before and after, and the count of an analysis without any cache.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from modelmeter import ModelRunError, analyze

transformers = pytest.importorskip("transformers")
# transformers 5 renames ``past_key_values`` to ``cache`` (both taken until 5.40); the step is passed as users pass it
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

WIDTH, HEADS, KV_HEADS, HEAD, FFN, LAYERS, VOCAB = 32, 4, 2, 8, 64, 2, 64
# the products of one token through the model: q, k, v, o, the gated MLP's three, and the head
TOKEN_MACS = LAYERS * (2 * WIDTH * WIDTH + 2 * WIDTH * KV_HEADS * HEAD + 3 * WIDTH * FFN) + WIDTH * VOCAB


def attention_macs(keys: int, queries: int = 1) -> int:
    """One layer's attention: each query head's ``q·k`` and ``p·v`` over ``keys`` attended keys."""
    return HEADS * queries * keys * 2 * HEAD


def llama(attention: str = "sdpa") -> nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                                      attn_implementation=attention)
    return transformers.LlamaForCausalLM(config).eval()


def real_products(model: nn.Module, kwargs: dict[str, Any]) -> int:
    """``FlopCounterMode``'s count of a real call, on copies (the call appends to the cache)."""
    model, kwargs = copy.deepcopy(model), copy.deepcopy(kwargs)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(**kwargs)
    return int(counter.get_total_flops())


def layers_of(cache: Any) -> list[Any]:
    if isinstance(cache, transformers.EncoderDecoderCache):
        return [*cache.self_attention_cache.layers, *cache.cross_attention_cache.layers]
    return list(cache.layers)


def snapshot(cache: Any) -> list[tuple[Any, ...]]:
    """Every layer's tensors (the objects and their values) and its length."""
    kept = []
    for layer in layers_of(cache):
        tensors = [layer.keys, layer.values, *([layer.cumulative_length] if hasattr(layer, "cumulative_length") and
                                               isinstance(layer.cumulative_length, torch.Tensor) else [])]
        kept.append((tensors, [t.clone() for t in tensors]))
    return [*kept, cache.get_seq_length()]


def assert_unchanged(cache: Any, before: list[tuple[Any, ...]]) -> None:
    after = snapshot(cache)
    assert after[-1] == before[-1]  # the length
    for (tensors, _), (kept, values) in zip(after[:-1], before[:-1], strict=True):
        assert all(t is k and type(t) is torch.Tensor and torch.equal(t, v)
                   for t, k, v in zip(tensors, kept, values, strict=True))


def prefilled(model: nn.Module, ids: torch.Tensor, past: int, cache: Any = None) -> Any:
    with torch.no_grad():
        out = model(ids[:, :past], past_key_values=cache, use_cache=True)
    return out.past_key_values


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_a_decode_step_over_a_dynamic_cache_is_counted_by_hand_and_leaves_the_cache(attention: str,
                                                                                   execution: str) -> None:
    model = llama(attention)
    for past in (3, 9):
        ids = torch.randint(1, VOCAB, (1, past + 1))
        cache = prefilled(model, ids, past)
        step = {"input_ids": ids[:, past:], "past_key_values": cache, "use_cache": True,
                "attention_mask": torch.ones(1, past + 1, dtype=torch.long), "cache_position": torch.tensor([past])}
        before = snapshot(cache)
        analysis = analyze(model, step, convention="macs", execution=execution, cache=False, quiet=True)
        assert_unchanged(cache, before)
        attention_key = "matmul" if attention == "eager" else "scaled_dot_product_attention"
        assert analysis.flops.by_operator() == {"linear": TOKEN_MACS, attention_key: LAYERS * attention_macs(past + 1)}
        if attention == "eager":  # FlopCounterMode counts no fused attention on the CPU: eager's are products
            assert 2 * analysis.flops.total() == real_products(model, step)


def test_a_static_cache_is_left_as_it_was_and_real_kernels_count_its_filled_slots() -> None:
    model = llama()
    past, slots = 5, 16
    ids = torch.randint(1, VOCAB, (1, past + 1))
    cache = prefilled(model, ids, past, transformers.StaticCache(config=model.config, max_cache_len=slots))
    step = {"input_ids": ids[:, past:], "past_key_values": cache, "use_cache": True}
    before = snapshot(cache)
    real = analyze(model, step, convention="macs", execution="real", cache=False, quiet=True)
    assert_unchanged(cache, before)
    assert real.flops.by_operator()["scaled_dot_product_attention"] == LAYERS * attention_macs(past + 1)
    fake = analyze(model, step, convention="macs", execution="fake", cache=False, quiet=True)
    assert_unchanged(cache, before)
    # the cache's length is a tensor of the cache's, which a fake run does not follow: the mask over the slots is
    # unknown, counted dense, and said so
    assert fake.flops.by_operator()["scaled_dot_product_attention"] == LAYERS * attention_macs(slots)
    assert any("mask's values are unknown" in line for line in fake.assumptions())


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_sliding_window_cache_attends_over_the_window(attention: str) -> None:
    window = 4
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN,
                                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                        num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                                        sliding_window=window, attn_implementation=attention)
    model = transformers.MistralForCausalLM(config).eval()
    for past in (2, 9):
        ids = torch.randint(1, VOCAB, (1, past + 1))
        cache = prefilled(model, ids, past)
        step = {"input_ids": ids[:, past:], "past_key_values": cache, "use_cache": True,
                "attention_mask": torch.ones(1, past + 1, dtype=torch.long)}
        before = snapshot(cache)
        analysis = analyze(model, step, convention="macs", cache=False, quiet=True)
        assert_unchanged(cache, before)
        by_operator = analysis.flops.by_operator()
        attended = by_operator.get("matmul", 0) + by_operator.get("scaled_dot_product_attention", 0)
        assert attended == LAYERS * attention_macs(min(past + 1, window))


def test_an_encoder_decoder_step_reuses_the_encoder_outputs_and_both_caches() -> None:
    config = transformers.T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=HEAD, d_ff=FFN, num_layers=LAYERS,
                                   num_heads=HEADS, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    source, past = 7, 4
    src, target = torch.randint(1, VOCAB, (1, source)), torch.randint(1, VOCAB, (1, past + 1))
    with torch.no_grad():
        out = model(input_ids=src, decoder_input_ids=target[:, :past], use_cache=True)
    encoded = transformers.modeling_outputs.BaseModelOutput(last_hidden_state=out.encoder_last_hidden_state)
    step = {"encoder_outputs": encoded, "decoder_input_ids": target[:, past:], "past_key_values": out.past_key_values,
            "use_cache": True, "attention_mask": torch.ones(1, source, dtype=torch.long)}
    before, states = snapshot(out.past_key_values), encoded.last_hidden_state.clone()
    analysis = analyze(model, step, convention="macs", cache=False, quiet=True)
    assert_unchanged(out.past_key_values, before)
    assert torch.equal(states, encoded.last_hidden_state)
    # per decoder layer: self-attention's four projections, cross-attention's query and output (its keys and values
    # are cached), the feed-forward; then the head. Attention: self over past + 1, cross over the source
    linear = LAYERS * (4 * WIDTH * WIDTH + 2 * WIDTH * WIDTH + 2 * WIDTH * FFN) + WIDTH * VOCAB
    attention = LAYERS * (attention_macs(past + 1) + attention_macs(source))
    assert analysis.flops.by_operator() == {"linear": linear, "scaled_dot_product_attention": attention}
    assert 2 * linear == real_products(model, step)


class _Generates(nn.Module):
    """Greedy decoding of three new tokens inside ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN,
                                          num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                          num_key_value_heads=KV_HEADS, max_position_embeddings=64, pad_token_id=0)
        self.lm = transformers.LlamaForCausalLM(config).eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                                eos_token_id=None)


@pytest.mark.parametrize("execution", ["fake", "real"])
def test_generate_inside_a_module_counts_its_prefill_and_decode_steps(execution: str) -> None:
    model, prompt = _Generates(), 5
    ids = torch.randint(1, VOCAB, (1, prompt))
    analysis = analyze(model, (ids,), convention="macs", execution=execution, cache=False, quiet=True)
    # the prompt (the head on its last token only), then two steps of one token: the third token comes from the
    # second step's logits
    layer_token = TOKEN_MACS - WIDTH * VOCAB
    linear = prompt * layer_token + WIDTH * VOCAB + 2 * TOKEN_MACS
    causal = attention_macs(prompt * (prompt + 1) // 2)  # the prompt's L(L+1)/2 pairs
    attention = LAYERS * (causal + attention_macs(prompt + 1) + attention_macs(prompt + 2))
    assert analysis.flops.by_operator() == {"linear": linear, "scaled_dot_product_attention": attention}
    assert 2 * linear == real_products(model, {"ids": ids})


class _Failing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("failed after the cache was written")


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_a_step_that_raises_after_writing_the_cache_leaves_it_and_names_the_module(execution: str) -> None:
    model = llama()
    ids = torch.randint(1, VOCAB, (1, 7))
    cache = prefilled(model, ids, 6)
    model.model.norm = _Failing()
    before = snapshot(cache)
    with pytest.raises(ModelRunError, match=r"module 'model.norm' \(_Failing\)"):
        analyze(model, {"input_ids": ids[:, 6:], "past_key_values": cache, "use_cache": True}, execution=execution,
                cache=False, quiet=True)
    assert_unchanged(cache, before)


class _OwnCache(nn.Module):
    """Attention whose keys and values the model keeps itself, in a list it appends to."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48, bias=False), nn.Linear(16, 16, bias=False)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, 2, 8).permute(2, 0, 3, 1, 4)
        self.keys.append(k)
        self.values.append(v)
        y = F.scaled_dot_product_attention(q, torch.cat(self.keys, 2), torch.cat(self.values, 2),
                                           is_causal=length > 1)
        return self.out(y.transpose(1, 2).reshape(batch, length, 16))


@pytest.mark.parametrize("execution", ["auto", "fake", "real"])
def test_a_model_keeping_its_own_cache_list_is_counted_and_left_as_it_was(execution: str) -> None:
    model = _OwnCache()
    with torch.no_grad():
        model(torch.randn(1, 5, 16))
    keys, kept = model.keys, [k.clone() for k in model.keys]
    analysis = analyze(model, torch.randn(1, 1, 16), convention="macs", execution=execution, cache=False, quiet=True)
    assert analysis.flops.by_operator() == {"linear": 64 * 16, "scaled_dot_product_attention": 2 * 6 * 16}
    assert model.keys is keys and len(keys) == 1 and torch.equal(keys[0], kept[0]) and len(model.values) == 1


class _Held:
    """A cache of fixed shape whose filled length is a value: a tensor, or a boolean mask over its slots."""

    def __init__(self, filled: int) -> None:
        self.keys = torch.randn(1, 2, 32, 8)
        self.length = torch.tensor(filled)
        self.mask = (torch.arange(32) < filled).view(1, 1, 1, 32)


class _ReadsLength(nn.Module):
    def __init__(self, read: str) -> None:
        super().__init__()
        self.query, self.read = nn.Linear(16, 16), read
        self.kept = [_Held(3)]  # the model's own, in a list

    def forward(self, x: torch.Tensor, cache: _Held | None = None) -> torch.Tensor:
        held = self.kept[0] if cache is None else cache
        q = self.query(x).view(1, 1, 2, 8).transpose(1, 2)
        if self.read == "mask":
            return F.scaled_dot_product_attention(q, held.keys, held.keys, attn_mask=held.mask)
        if self.read == "mask made of it":  # the run's own arange compared with the length
            mask = (torch.arange(32) < held.length).view(1, 1, 1, 32)
            return F.scaled_dot_product_attention(q, held.keys, held.keys, attn_mask=mask)
        filled = int(held.length)
        return F.scaled_dot_product_attention(q, held.keys[:, :, :filled], held.keys[:, :, :filled])


@pytest.mark.parametrize("where", ["passed", "kept by the model"])
@pytest.mark.parametrize("read", ["length", "mask", "mask made of it"])
@pytest.mark.parametrize("execution", ["auto", "fake"])
def test_the_trace_cache_never_serves_a_step_with_another_filled_length(tmp_path: Path, where: str, read: str,
                                                                       execution: str) -> None:
    # The tensors of an object passed as input, or of the model's lists, run as they are in a fake run (no stand-in):
    # a fake run that read their values (int() of a length, a mask's attended pairs) was stored under a key that
    # covers their shapes alone, and the next step, of another length, was served its count
    counts, fresh = [], []
    for filled in (3, 9, 3):
        model = _ReadsLength(read)
        inputs: tuple[Any, ...] = (torch.randn(1, 1, 16), _Held(filled))
        if where == "kept by the model":
            model.kept[0] = inputs[1]
            inputs = inputs[:1]
        for counted, options in ((counts, {"cache_dir": tmp_path}), (fresh, {"cache": False})):
            analysis = analyze(model, inputs, convention="macs", execution=execution, quiet=True, **options)
            counted.append(analysis.flops.by_operator()["scaled_dot_product_attention"])
    assert counts == fresh
    if read != "mask made of it":  # (that mask's values are unknown to a fake run: counted dense, and said so)
        assert counts == [2 * filled * 16 for filled in (3, 9, 3)]
