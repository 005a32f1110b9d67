"""Vision Transformer (ViT-B/16, ViT-B/32, ViT-L/16) with torchvision's exact module and parameter layout.

Matching torchvision's names, shapes and op order lets state_dicts load in either direction and makes
every analysis number comparable with torchvision's models and the published figures.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from ..errors import InvalidValueError

__all__ = ["Encoder", "EncoderBlock", "VisionTransformer", "vit_b_16", "vit_b_32", "vit_l_16"]


class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, num_heads: int, hidden_dim: int, mlp_dim: int, dropout: float, attention_dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads, dropout=attention_dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden_dim, eps=1e-6)
        # A plain Sequential gives the same names ("0" and "3" for the linears) as torchvision's MLPBlock.
        self.mlp = nn.Sequential(
            nn.Linear(hidden_dim, mlp_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp_dim, hidden_dim),
            nn.Dropout(dropout),
        )

    def forward(self, input: Tensor) -> Tensor:
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x) + input
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    """Learned position embedding, a stack of encoder blocks and a final LayerNorm."""

    def __init__(
        self,
        seq_length: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        mlp_dim: int,
        dropout: float,
        attention_dropout: float,
    ):
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(
            OrderedDict(
                (
                    f"encoder_layer_{i}",
                    EncoderBlock(num_heads, hidden_dim, mlp_dim, dropout, attention_dropout),
                )
                for i in range(num_layers)
            )
        )
        self.ln = nn.LayerNorm(hidden_dim, eps=1e-6)

    def forward(self, input: Tensor) -> Tensor:
        return self.ln(self.layers(self.dropout(input + self.pos_embedding)))


class VisionTransformer(nn.Module):
    """Patchify with a strided conv, prepend a class token, encode, classify from the class token.

    The position embedding fixes the input resolution to `image_size` (224 by default).
    """

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        num_layers: int,
        num_heads: int,
        hidden_dim: int,
        mlp_dim: int,
        num_classes: int = 1000,
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
    ):
        super().__init__()
        if image_size % patch_size:
            raise InvalidValueError(f"image_size {image_size} is not a multiple of patch_size {patch_size}")
        self.image_size = image_size
        self.patch_size = patch_size
        self.hidden_dim = hidden_dim
        self.conv_proj = nn.Conv2d(3, hidden_dim, kernel_size=patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        seq_length = (image_size // patch_size) ** 2 + 1
        self.encoder = Encoder(seq_length, num_layers, num_heads, hidden_dim, mlp_dim, dropout, attention_dropout)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(hidden_dim, num_classes)))

    def forward(self, x: Tensor) -> Tensor:
        n, _, h, w = x.shape
        if h != self.image_size or w != self.image_size:
            raise AssertionError(f"expected {self.image_size}px input")
        x = self.conv_proj(x)  # (n, hidden, h/p, w/p)
        x = x.reshape(n, self.hidden_dim, -1).permute(0, 2, 1)  # (n, seq, hidden)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        x = self.encoder(x)
        return self.heads(x[:, 0])


def vit_b_16(num_classes: int = 1000, image_size: int = 224) -> VisionTransformer:
    """ViT-Base, 16px patches: 86,567,656 parameters at 224px and 1000 classes."""
    return VisionTransformer(image_size, 16, 12, 12, 768, 3072, num_classes)


def vit_b_32(num_classes: int = 1000, image_size: int = 224) -> VisionTransformer:
    """ViT-Base, 32px patches: 88,224,232 parameters at 224px and 1000 classes."""
    return VisionTransformer(image_size, 32, 12, 12, 768, 3072, num_classes)


def vit_l_16(num_classes: int = 1000, image_size: int = 224) -> VisionTransformer:
    """ViT-Large, 16px patches: 304,326,632 parameters at 224px and 1000 classes."""
    return VisionTransformer(image_size, 16, 24, 16, 1024, 4096, num_classes)
