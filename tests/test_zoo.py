"""The built-in zoo: published parameter counts, torchvision/Hugging Face-identical layout, FLOPs and numerics,
meta building."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import modelmeter
from modelmeter.zoo import ZOO, ZooEntry, available_models, get_model, input_shape
from modelmeter.zoo.bert import Bert
from modelmeter.zoo.gpt import GPT
from modelmeter.zoo.llama import Llama, LlamaConfig, LlamaDecoderLayer
from modelmeter.zoo.resnet import ResNet

# torchvision's `num_params` metadata, GPT-2 small's, BERT-base's (Hugging Face BertModel with pooler)
# and Llama-2's (Hugging Face LlamaForCausalLM, untied head) sizes.
PUBLISHED_PARAMS = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "vit_b_16": 86_567_656,
    "vit_b_32": 88_224_232,
    "vit_l_16": 304_326_632,
    "mobilenet_v2": 3_504_872,
    "gpt2": 124_439_808,
    "bert_base": 109_482_240,
    "llama2_7b": 6_738_415_616,
    "llama2_70b": 68_976_648_192,
}

LLAMA2_7B_HF_CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def _gpt(name: str, device: str | None = None) -> GPT:
    model = get_model(name, device=device)
    assert isinstance(model, GPT)
    return model


def _llama(name: str, device: str | None = None) -> Llama:
    model = get_model(name, device=device)
    assert isinstance(model, Llama)
    return model


def _bert(name: str, device: str | None = None) -> Bert:
    model = get_model(name, device=device)
    assert isinstance(model, Bert)
    return model


def _hf_llama_config(transformers: Any, cfg: LlamaConfig) -> Any:
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=False,
    )


def _flops(model: nn.Module, inputs: object) -> int:
    analysis = modelmeter.FlopCountAnalysis(model.eval(), inputs)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    return analysis.total()


def _layout(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, then every buffer, in registration order."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [(name, tuple(t.shape)) for name, t in named]


class _OpRecorder(TorchDispatchMode):
    """Records each aten op a forward runs, with its output shape."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), tuple(out.shape) if isinstance(out, torch.Tensor) else ()))
        return out


def _trace(model: nn.Module, name: str) -> list[tuple[str, tuple[int, ...]]]:
    with _OpRecorder() as recorder:
        model(torch.empty(input_shape(name, batch=2), device="meta"))
    return recorder.ops


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_matches_published(name: str) -> None:
    model = get_model(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[name]


def test_llama2_70b_parameter_count_by_arithmetic() -> None:
    """embed + 80 x (q, o: 8192^2 each; k, v: 8192 x 1024 each (8 kv heads of 128); gate, up, down: 8192 x 28672
    each; two RMSNorms) + final norm + untied lm_head."""
    h, kv, ffn, layers, vocab = 8192, 8 * 128, 28672, 80, 32000
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    assert vocab * h + layers * per_layer + h + vocab * h == 68_976_648_192 == PUBLISHED_PARAMS["llama2_70b"]
    layer = _llama("llama2_70b").model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer)
    attn = layer.self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.k_proj.out_features) == (64, 8, kv)


def test_default_device_is_meta_for_flagged_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    flagged = {name for name, entry in ZOO.items() if entry.meta_default}
    assert flagged == {"gpt2", "bert_base", "llama2_7b", "llama2_70b"}
    assert all(t.is_meta for t in _llama("llama2_7b").parameters())
    assert all(t.is_meta for t in [*_bert("bert_base").parameters(), *_bert("bert_base").buffers()])
    assert not any(t.is_meta for t in get_model("llama2_tiny").parameters())
    assert ZOO["resnet18"].default_device is None
    # An explicit device wins over the default, both ways (a stand-in entry keeps it cheap).
    entry = ZooEntry("stand_in", lambda: nn.Linear(2, 2), (1, 2), "stand-in", meta_default=True)
    monkeypatch.setitem(ZOO, "stand_in", entry)
    assert entry.default_device == torch.device("meta")
    assert get_model("stand_in").weight.is_meta
    assert not get_model("stand_in", device="cpu").weight.is_meta


def test_gpt2_lm_head_is_tied_to_token_embedding() -> None:
    model = _gpt("gpt2", device="meta")
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "vit_b_16", "mobilenet_v2"])
def test_layout_and_op_trace_identical_to_torchvision(name: str) -> None:
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        reference = torchvision.models.get_model(name)
    model = get_model(name, device="meta")
    assert _layout(model) == _layout(reference)
    assert _trace(model, name) == _trace(reference, name)


@pytest.mark.parametrize(
    ("name", "side"), [("resnet18", 64), ("resnet50", 64), ("vit_b_16", 224), ("mobilenet_v2", 64)]
)
def test_torchvision_state_dict_loads_and_gives_same_outputs(name: str, side: int) -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    reference = torchvision.models.get_model(name).eval()
    with torch.no_grad():  # torchvision zero-initialises these; randomise so the comparison means something
        for p in reference.parameters():
            if not p.any():
                p.normal_()
    # Built on meta and materialised from the checkpoint: no second random init of ~86M weights.
    model = get_model(name, device="meta").eval()
    model.load_state_dict(reference.state_dict(), strict=True, assign=True)
    x = torch.randn(1, 3, side, side)
    with torch.no_grad():
        expected = reference(x)
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=0)
    assert expected.abs().max() > 1e-3


@pytest.mark.parametrize("name", available_models())
def test_meta_build_allocates_nothing_and_runs_default_input(name: str) -> None:
    model = get_model(name, device="meta")
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.is_meta for t in tensors)
    shape = input_shape(name, batch=2)
    x = torch.zeros(shape, dtype=ZOO[name].input_dtype, device="meta")
    if isinstance(model, Bert):
        hidden, pooled = model(x)
        assert (hidden.shape, pooled.shape) == ((*shape, model.config.hidden_size), (2, model.config.hidden_size))
        return
    expected = (*shape, model.config.vocab_size) if isinstance(model, (GPT, Llama)) else (2, 1000)
    assert model(x).shape == expected


def _layout(model: nn.Module) -> list[tuple[object, ...]]:
    return [(name, type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
            for name, t in [*model.named_parameters(), *model.named_buffers()]]


@pytest.mark.parametrize("name", ["gpt2_tiny", "bert_tiny", "llama2_tiny", "resnet18", "vit_b_32", "mobilenet_v2"])
def test_a_meta_build_skips_initialisation_and_nothing_else(name: str) -> None:
    """On meta, initialisers are skipped (no values to fill) and ``arange`` runs on the CPU: the model is the one
    ``torch.device("meta")`` alone builds, tensor by tensor; on the CPU every initialiser runs."""
    with torch.device("meta"):
        plain = ZOO[name].builder()
    assert _layout(get_model(name, device="meta")) == _layout(plain)
    torch.manual_seed(0)
    first = get_model(name, device="cpu")
    torch.manual_seed(1)
    second = get_model(name, device="cpu")
    assert not all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))


def test_building_a_language_model_on_meta_imports_neither_dynamo_nor_sympy() -> None:
    """PyTorch's meta kernels of ``normal_`` and of ``arange`` under a default device import both (over a second):
    a cached analysis of a zoo language model needs neither."""
    code = ("import sys, modelmeter.zoo as zoo\n"
            "before = {'torch._dynamo', 'sympy'} & set(sys.modules)\n"
            "for name in ('gpt2', 'bert_base', 'llama2_7b'):\n"
            "    zoo.get_model(name)\n"
            "print(sorted(({'torch._dynamo', 'sympy'} & set(sys.modules)) - before))")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_unknown_name_error_lists_available_models() -> None:
    with pytest.raises(KeyError) as info:
        get_model("resnet9000")
    message = str(info.value)
    assert "resnet9000" in message
    assert all(name in message for name in available_models())
    with pytest.raises(KeyError, match="vit_b_16"):
        input_shape("nope")


def test_input_shape() -> None:
    assert input_shape("resnet50") == (1, 3, 224, 224)
    assert input_shape("resnet50", batch=8, resolution=64) == (8, 3, 64, 64)
    assert input_shape("vit_b_16", batch=4) == (4, 3, 224, 224)
    assert input_shape("gpt2") == (1, 1024)
    assert input_shape("gpt2_tiny", batch=3, resolution=16) == (3, 16)
    assert input_shape("mobilenet_v2") == (1, 3, 224, 224)
    assert input_shape("bert_base") == input_shape("llama2_7b") == input_shape("llama2_70b") == (1, 128)
    assert all(ZOO[name].input_dtype == torch.long for name in ("bert_base", "llama2_7b", "llama2_70b"))
    assert available_models() == sorted(ZOO)


def test_builder_kwargs_and_vit_resolution() -> None:
    model = get_model("vit_b_16", device="meta", num_classes=10, image_size=384)
    assert model(torch.empty(input_shape("vit_b_16", resolution=384), device="meta")).shape == (1, 10)
    resnet = get_model("resnet50", device="meta", num_classes=10)
    assert isinstance(resnet, ResNet)
    assert resnet.fc.out_features == 10


@pytest.mark.parametrize("name", ["gpt2_tiny", "llama2_tiny"])
def test_causal_lms_are_causal(name: str) -> None:
    torch.manual_seed(0)
    model = get_model(name).eval()
    idx = torch.randint(0, 1000, input_shape(name, batch=2))
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 1000
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


@pytest.mark.slow
def test_gpt_matches_hugging_face_gpt2() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = _gpt("gpt2_tiny").eval()
    cfg = ours.config
    hf_config = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
    )
    reference = transformers.GPT2LMHeadModel(hf_config).eval()
    # Hugging Face's Conv1D stores (in, out) weights; nn.Linear stores (out, in).
    state = {}
    for key, value in reference.state_dict().items():
        key = key.removeprefix("transformer.")
        if key.endswith(".weight") and any(f".{n}." in key for n in ("c_attn", "c_proj", "c_fc")):
            value = value.t()
        state[key] = value
    ours.load_state_dict(state, strict=True)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), reference(idx).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_bert_base_matches_hugging_face_layout_and_flops() -> None:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        reference = transformers.BertModel(transformers.BertConfig())
    model = _bert("bert_base")
    assert _layout(model) == _layout(reference)  # parameters and (non-persistent) buffers
    assert sum(p.numel() for p in reference.parameters()) == PUBLISHED_PARAMS["bert_base"]
    ids = torch.zeros(input_shape("bert_base"), dtype=torch.long)
    # 12 x 128 x (4 x 768^2 + 2 x 768 x 3072) + 768^2 (pooler), + attention, + 25 LayerNorms x 5 per element
    assert _flops(model, ids) == _flops(reference, ids) == 11_186_503_680


@pytest.mark.slow
def test_bert_matches_hugging_face_outputs() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _bert("bert_tiny").eval()
    cfg = model.config
    reference = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            num_hidden_layers=cfg.num_layers,
            num_attention_heads=cfg.num_heads,
            intermediate_size=cfg.intermediate_size,
            max_position_embeddings=cfg.max_position_embeddings,
        )
    ).eval()
    with torch.no_grad():  # biases and LayerNorms start at 0 / 1: randomise so they matter
        for p in reference.parameters():
            if p.ndim == 1:
                p.normal_(0, 0.5)
    model.load_state_dict(reference.state_dict(), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.max_position_embeddings))
    token_types = torch.randint(0, cfg.type_vocab_size, ids.shape)
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0  # padding on the second sequence
    with torch.no_grad():
        hidden, pooled = model(ids, token_types, mask)
        expected = reference(ids, attention_mask=mask, token_type_ids=token_types)
    torch.testing.assert_close(hidden, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, expected.pooler_output, atol=1e-5, rtol=1e-5)
    assert pooled.abs().max() > 1e-2


@pytest.mark.slow
def test_llama2_7b_matches_hugging_face_layout_and_flops() -> None:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA2_7B_HF_CONFIG))
    model = _llama("llama2_7b")
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert named == [(name, tuple(p.shape)) for name, p in reference.named_parameters()]
    assert sum(p.numel() for p in reference.parameters()) == PUBLISHED_PARAMS["llama2_7b"]
    ids = torch.zeros(input_shape("llama2_7b"), dtype=torch.long)
    # 128 tokens x (parameters less embedding and norms), + causal attention: 32 x 32 x (128·129/2) x 256
    assert _flops(model, ids) == _flops(reference, modelmeter.Args(ids, use_cache=False)) == 847_870_164_992


def test_llama2_70b_flops_by_arithmetic() -> None:
    ids = torch.zeros(input_shape("llama2_70b"), dtype=torch.long)
    linear = 128 * (PUBLISHED_PARAMS["llama2_70b"] - 32000 * 8192 - 161 * 8192)  # all but embedding and norms
    # query heads x causal pairs L(L+1)/2 x (E + Ev), k/v shared (GQA)
    attention = 80 * 64 * (128 * 129 // 2) * (128 + 128)
    assert _flops(_llama("llama2_70b"), ids) == linear + attention == 8_806_109_020_160


@pytest.mark.slow
def test_llama_matches_hugging_face_logits() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = _llama("llama2_tiny").eval()
    cfg = model.config
    assert cfg.num_kv_heads < cfg.num_heads  # grouped-query attention is exercised
    reference = transformers.LlamaForCausalLM(_hf_llama_config(transformers, cfg)).eval()
    with torch.no_grad():  # RMSNorm weights start at 1: randomise so they matter
        for p in reference.parameters():
            if p.ndim == 1:
                p.normal_(1, 0.1)
    model.load_state_dict(reference.state_dict(), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.max_position_embeddings))
    with torch.no_grad():
        expected = reference(ids, use_cache=False).logits
        torch.testing.assert_close(model(ids), expected, atol=1e-5, rtol=1e-5)
    assert expected.abs().max() > 1e-2
