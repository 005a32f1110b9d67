"""Small modules the operator tests share: a functional call as a module, and the fused fast-path operators
of MultiheadAttention and TransformerEncoderLayer called directly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Fn(nn.Module):
    """A module that calls ``fn`` on its arguments (to count a functional call)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


class FusedSelfAttention(nn.Module):
    """Calls the operator of MultiheadAttention's fast path directly."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.mha = mha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mha
        return torch._native_multi_head_attention(x, x, x, m.embed_dim, m.num_heads, m.in_proj_weight,
                                                  m.in_proj_bias, m.out_proj.weight, m.out_proj.bias, None,
                                                  False)[0]


class FusedEncoderLayer(nn.Module):
    """Calls the operator of TransformerEncoderLayer's fast path directly (as its forward does)."""

    def __init__(self, layer: nn.TransformerEncoderLayer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        x = self.layer
        return torch._transformer_encoder_layer_fwd(
            src, x.self_attn.embed_dim, x.self_attn.num_heads, x.self_attn.in_proj_weight, x.self_attn.in_proj_bias,
            x.self_attn.out_proj.weight, x.self_attn.out_proj.bias, x.activation_relu_or_gelu == 2, x.norm_first,
            x.norm1.eps, x.norm1.weight, x.norm1.bias, x.norm2.weight, x.norm2.bias, x.linear1.weight,
            x.linear1.bias, x.linear2.weight, x.linear2.bias, None, None)
