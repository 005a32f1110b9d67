"""The built-in zoo: published parameter counts, torchvision-identical layout and numerics, meta building."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from modelmeter.zoo import ZOO, available_models, get_model, input_shape
from modelmeter.zoo.gpt import GPT
from modelmeter.zoo.resnet import ResNet

# torchvision's `num_params` metadata and GPT-2 small's published size.
PUBLISHED_PARAMS = {
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "vit_b_16": 86_567_656,
    "vit_b_32": 88_224_232,
    "vit_l_16": 304_326_632,
    "gpt2": 124_439_808,
}


def _gpt(name: str, device: str | None = None) -> GPT:
    model = get_model(name, device=device)
    assert isinstance(model, GPT)
    return model


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


def test_gpt2_lm_head_is_tied_to_token_embedding() -> None:
    model = _gpt("gpt2", device="meta")
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "vit_b_16"])
def test_layout_and_op_trace_identical_to_torchvision(name: str) -> None:
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        reference = torchvision.models.get_model(name)
    model = get_model(name, device="meta")
    assert _layout(model) == _layout(reference)
    assert _trace(model, name) == _trace(reference, name)


@pytest.mark.parametrize(("name", "side"), [("resnet18", 64), ("resnet50", 64), ("vit_b_16", 224)])
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
    expected = (*shape, model.config.vocab_size) if isinstance(model, GPT) else (2, 1000)
    assert model(x).shape == expected


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
    assert available_models() == sorted(ZOO)


def test_builder_kwargs_and_vit_resolution() -> None:
    model = get_model("vit_b_16", device="meta", num_classes=10, image_size=384)
    assert model(torch.empty(input_shape("vit_b_16", resolution=384), device="meta")).shape == (1, 10)
    resnet = get_model("resnet50", device="meta", num_classes=10)
    assert isinstance(resnet, ResNet)
    assert resnet.fc.out_features == 10


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = _gpt("gpt2_tiny").eval()
    idx = torch.randint(0, 1000, input_shape("gpt2_tiny", batch=2))
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
