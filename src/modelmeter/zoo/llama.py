"""Llama-2 decoder-only language models with Hugging Face `LlamaForCausalLM`'s module and parameter layout.

Names and shapes follow `transformers.LlamaForCausalLM` (`model.embed_tokens`, `model.layers.i.self_attn
.q_proj` ..., `model.norm`, an untied `lm_head`), so state_dicts load in either direction and the analysis
numbers equal Hugging Face's model. Pre-norm RMSNorm blocks, rotary position embeddings applied
element-wise to queries and keys, grouped-query attention (70B) through causal
`F.scaled_dot_product_attention`, and a SiLU-gated MLP; no biases anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InvalidValueError

__all__ = [
    "Llama",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaMLP",
    "LlamaModel",
    "RMSNorm",
    "RotaryEmbedding",
    "llama2_7b",
    "llama2_70b",
    "llama2_tiny",
]


@dataclass(frozen=True)
class LlamaConfig:
    """Model sizes; `num_kv_heads` < `num_heads` gives grouped-query attention."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back, as Llama does."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """cos and sin of position x inverse frequency, for each (position, head-dim) pair; no state.

    The frequencies are recomputed per forward (head_dim / 2 values) rather than kept in a buffer, so a
    model built on the meta device and then loaded with real weights still runs.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponent)
        freqs = positions[..., None].float() * inv_freq  # (..., seq, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (batch, heads, seq, head_dim) `x` by the position angles; cos/sin are (batch, seq, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention; k/v have `num_kv_heads` heads, each shared by a group of queries."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
            raise InvalidValueError(f"hidden_size {cfg.hidden_size}, num_heads {cfg.num_heads} and num_kv_heads "
                                    f"{cfg.num_kv_heads} must divide one another")
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Token embedding, decoder layers, final RMSNorm; returns hidden states (batch, seq, hidden)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, input_ids: Tensor) -> Tensor:
        x = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Llama(nn.Module):
    """Llama causal LM: `model` (the decoder) and an untied `lm_head`.

    Takes a LongTensor of token ids (batch, seq) with seq <= max_position_embeddings; returns logits
    (batch, seq, vocab).
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for module in self.modules():  # Llama's initialisation: N(0, 0.02); RMSNorm weights stay 1
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: Tensor) -> Tensor:
        t = input_ids.shape[1]
        limit = self.config.max_position_embeddings
        if t > limit:
            raise AssertionError(f"sequence length exceeds max_position_embeddings {limit}")
        return self.lm_head(self.model(input_ids))


def llama2_7b(vocab_size: int = 32000, max_position_embeddings: int = 4096) -> Llama:
    """Llama-2 7B (32 layers, 32 heads, 4096 dims, 11008 FFN): 6,738,415,616 parameters."""
    return Llama(LlamaConfig(vocab_size, 4096, 11008, 32, 32, 32, max_position_embeddings))


def llama2_70b(vocab_size: int = 32000, max_position_embeddings: int = 4096) -> Llama:
    """Llama-2 70B (80 layers, 64 query / 8 key-value heads, 8192 dims, 28672 FFN): 68,976,648,192 parameters."""
    return Llama(LlamaConfig(vocab_size, 8192, 28672, 80, 64, 8, max_position_embeddings))


def llama2_tiny(vocab_size: int = 1000, max_position_embeddings: int = 128) -> Llama:
    """A 2-layer, 64-dim Llama with grouped-query attention (4 query / 2 key-value heads) for fast tests."""
    return Llama(LlamaConfig(vocab_size, 64, 176, 2, 4, 2, max_position_embeddings))
