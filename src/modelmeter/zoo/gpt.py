"""GPT-2-style causal language model in plain PyTorch (fused qkv projection, SDPA attention, tied head).

Sizes, biases and LayerNorms follow GPT-2, so `gpt2` has GPT-2 small's 124,439,808 parameters; linears
are `nn.Linear` (weight shaped (out, in)), not Hugging Face's transposed `Conv1D`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InvalidValueError

__all__ = ["GPT", "GPTConfig", "gpt2", "gpt2_tiny"]


@dataclass(frozen=True)
class GPTConfig:
    """Model sizes; `dropout` applies to embeddings, attention probabilities and residual branches.

    GPT-2 trained with dropout 0.1; the default here is 0 so that a forward pass runs the same ops in
    train and eval mode (SDPA with dropout falls back to an unfused math path).
    """

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int
    block_size: int
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused q/k/v linear, SDPA with `is_causal`, output linear."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise InvalidValueError(f"n_embd {cfg.n_embd} is not a multiple of n_head {cfg.n_head}")
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        # (b, t, 3c) -> three (b, n_head, t, head_dim) tensors
        q, k, v = self.c_attn(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    """Position-wise feed-forward: expand 4x, tanh-approximated GELU (GPT-2's "gelu_new"), project back."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, transformer blocks, final LayerNorm, LM head tied to `wte`.

    Takes a LongTensor of token ids (batch, seq) with seq <= block_size; returns logits (batch, seq, vocab).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, counted once by parameters()

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise AssertionError(f"sequence length exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2(vocab_size: int = 50257, block_size: int = 1024, dropout: float = 0.0) -> GPT:
    """GPT-2 small (12 layers, 12 heads, 768 dims): 124,439,808 parameters."""
    return GPT(GPTConfig(12, 12, 768, vocab_size, block_size, dropout))


def gpt2_tiny(vocab_size: int = 1000, block_size: int = 64, dropout: float = 0.0) -> GPT:
    """A 2-layer, 4-head, 64-dim GPT-2 for fast tests."""
    return GPT(GPTConfig(2, 4, 64, vocab_size, block_size, dropout))
