"""BERT encoder (BERT-base by default) with Hugging Face `BertModel`'s module and parameter layout.

Names and shapes follow `transformers.BertModel(BertConfig())`, so state_dicts load in either direction
and the analysis numbers equal Hugging Face's model; attention runs through
`F.scaled_dot_product_attention`, as Hugging Face's default "sdpa" implementation does. The forward
returns `(last_hidden_state, pooler_output)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InvalidValueError

__all__ = ["Bert", "BertConfig", "BertEmbeddings", "BertLayer", "bert_base", "bert_tiny"]


@dataclass(frozen=True)
class BertConfig:
    """Model sizes; the defaults are BERT-base (uncased vocabulary)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    dropout: float = 0.1
    attention_dropout: float = 0.1


class BertEmbeddings(nn.Module):
    """Sum of word, token-type and absolute position embeddings, then LayerNorm and dropout."""

    position_ids: Tensor
    token_type_ids: Tensor

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)
        # Non-persistent, as in Hugging Face: same named buffers, nothing extra in the state_dict.
        self.register_buffer("position_ids", torch.arange(cfg.max_position_embeddings).expand(1, -1), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, cfg.max_position_embeddings, dtype=torch.long),
                             persistent=False)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        b, t = input_ids.shape
        if token_type_ids is None:
            token_type_ids = self.token_type_ids[:, :t].expand(b, t)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(self.position_ids[:, :t])
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Separate query/key/value linears and bidirectional SDPA; returns the heads concatenated."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_heads:
            raise InvalidValueError(f"hidden_size {cfg.hidden_size} is not a multiple of num_heads {cfg.num_heads}")
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.attention_dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, t, c = x.shape
        q, k, v = (proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        dropout_p = self.dropout.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return y.transpose(1, 2).reshape(b, t, c)


class BertSelfOutput(nn.Module):
    """Output projection, dropout, then post-norm residual: LayerNorm(dense(y) + x)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, y: Tensor, x: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(y)) + x)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    """Expand to `intermediate_size` with exact (erf) GELU."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        return self.intermediate_act_fn(self.dense(x))


class BertOutput(nn.Module):
    """Project back to `hidden_size`, dropout, then post-norm residual."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, h: Tensor, x: Tensor) -> Tensor:
        return self.LayerNorm(self.dropout(self.dense(h)) + x)


class BertLayer(nn.Module):
    """Post-norm transformer block: attention sub-block, then feed-forward sub-block."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        for layer in self.layer:
            x = layer(x, mask)
        return x


class BertPooler(nn.Module):
    """Dense + tanh on the first ([CLS]) token."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, x: Tensor) -> Tensor:
        return self.activation(self.dense(x[:, 0]))


class Bert(nn.Module):
    """Embeddings, post-norm encoder, pooler.

    Takes token ids (batch, seq) with seq <= max_position_embeddings, optionally `token_type_ids` (same
    shape, default all 0) and a padding `attention_mask` (batch, seq; 1 = attend, 0 = padding); returns
    `(last_hidden_state, pooler_output)` shaped (batch, seq, hidden) and (batch, hidden).
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """BERT's initialisation: N(0, 0.02) weights, zero biases (and padding row), unit LayerNorm."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            with torch.no_grad():
                module.weight[module.padding_idx].zero_()

    def forward(
        self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        t = input_ids.shape[1]
        limit = self.config.max_position_embeddings
        if t > limit:
            raise AssertionError(f"sequence length exceeds max_position_embeddings {limit}")
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()  # (b, 1, 1, s)
        x = self.encoder(self.embeddings(input_ids, token_type_ids), mask)
        return x, self.pooler(x)


def bert_base(vocab_size: int = 30522, max_position_embeddings: int = 512) -> Bert:
    """BERT-base (12 layers, 12 heads, 768 dims, 3072 FFN): 109,482,240 parameters with the pooler."""
    return Bert(BertConfig(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings))


def bert_tiny(vocab_size: int = 1000, max_position_embeddings: int = 64) -> Bert:
    """A 2-layer, 4-head, 64-dim BERT for fast tests."""
    return Bert(BertConfig(vocab_size, 64, 2, 4, 256, max_position_embeddings))
