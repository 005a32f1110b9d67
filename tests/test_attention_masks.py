"""The engine reads how many (query, key) pairs an attention mask lets through, while its values exist."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modelmeter import FlopCountAnalysis, TensorMeta


class Attention(nn.Module):
    def __init__(self, mask: torch.Tensor | None) -> None:
        super().__init__()
        self.mask = mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


def _mask_meta(analysis: FlopCountAnalysis) -> TensorMeta:
    (event,) = [e for e in analysis.trace.events if e.op == "aten::scaled_dot_product_attention"]
    meta = event.inputs[3]
    assert isinstance(meta, TensorMeta)
    return meta


@pytest.mark.parametrize("additive", [False, True])
def test_a_causal_mask_with_values_records_its_attended_pairs(additive: bool) -> None:
    b, h, length = 2, 3, 5
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = torch.zeros(length, length).masked_fill(~causal, float("-inf")) if additive else causal
    q = torch.randn(b, h, length, 4)
    analysis = FlopCountAnalysis(Attention(mask), (q, q, q), execution="real")
    # broadcast over batch and heads: L(L+1)/2 pairs per head
    assert _mask_meta(analysis).attended == b * h * length * (length + 1) // 2
    assert not analysis.assumptions()


def test_a_padding_mask_of_the_finite_minimum_counts_as_masked() -> None:
    q = torch.randn(1, 2, 4, 8)
    mask = torch.zeros(1, 1, 1, 4)
    mask[..., -1] = torch.finfo(torch.float32).min  # the last key is padding, as transformers writes it
    analysis = FlopCountAnalysis(Attention(mask), (q, q, q), execution="real")
    assert _mask_meta(analysis).attended == 2 * 4 * 3


def test_a_mask_built_in_a_fake_run_from_known_values_is_read() -> None:
    class Causal(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(q.shape[-2], device=q.device)
            mask = positions[None, :] <= positions[:, None]  # built during the run, from no data at all
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    q = torch.randn(1, 2, 4, 8)
    for model_input in (q, q.to("meta")):
        analysis = FlopCountAnalysis(Causal(), model_input)
        assert analysis.trace.execution == "fake" and not analysis.assumptions()
        assert _mask_meta(analysis).attended == 2 * 4 * 5 // 2


def test_a_mask_without_values_is_unknown_and_reported() -> None:
    class Learned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.logits = nn.Parameter(torch.randn(4, 4))

        def forward(self, q: torch.Tensor) -> torch.Tensor:  # a mask computed from weights: no values
            return F.scaled_dot_product_attention(q, q, q, attn_mask=self.logits > 0)

    q = torch.randn(1, 2, 4, 8)
    analysis = FlopCountAnalysis(Learned(), q)
    assert analysis.trace.execution == "fake"
    assert _mask_meta(analysis).attended is None
    assert any("counted dense" in note for note in analysis.assumptions())


def test_no_mask_no_note() -> None:
    q = torch.randn(1, 2, 4, 8)
    analysis = FlopCountAnalysis(Attention(None), (q, q, q))
    assert analysis.trace.events and not analysis.assumptions()


class Flex(nn.Module):
    def __init__(self, block_mask: object = None) -> None:
        super().__init__()
        self.block_mask = block_mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=self.block_mask)


@pytest.mark.parametrize("execution", ["fake", "real"])
def test_flex_attention_counts_the_blocks_its_mask_lists(execution: str) -> None:
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    length, heads, dim = 512, 2, 64
    mask = flex.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, length, length, device="cpu")
    q = torch.randn(1, heads, length, dim)
    analysis = FlopCountAnalysis(Flex(mask), (q, q, q), convention="macs", execution=execution)  # type: ignore[arg-type]
    # 128 x 128 blocks: a causal mask lists 4 + 3 + 2 + 1 of the 4 x 4 blocks; each is computed whole
    blocks = 10 * 128 * 128
    assert analysis.by_operator() == {"flex_attention": 2 * heads * blocks * dim}
    assert not analysis.unsupported_ops() and not analysis.assumptions()
    assert flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is False  # the switch is put back
    no_mask = FlopCountAnalysis(Flex(), (q, q, q), convention="macs")
    assert no_mask.total() == 2 * heads * length * length * dim and not no_mask.assumptions()


def test_values_updated_in_place_by_unknown_values_are_forgotten() -> None:
    class Stale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(4, 4))

        def forward(self, q: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(4, 4).tril()  # known ...
            mask.add_(self.bias)  # ... until a weight is added in place: unknown again
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask > 0)

    analysis = FlopCountAnalysis(Stale(), torch.randn(1, 2, 4, 8))
    assert _mask_meta(analysis).attended is None
    assert any("counted dense" in note for note in analysis.assumptions())


def test_large_tensors_are_not_followed() -> None:
    from modelmeter.engine import values

    class Big(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            mask = torch.ones(values.LIMIT + 1, dtype=torch.bool)[: 16].view(4, 4)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    assert _mask_meta(FlopCountAnalysis(Big(), torch.randn(1, 2, 4, 8))).attended is None
