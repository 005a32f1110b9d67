"""Small modules the operator tests share: a functional call as a module, the fused fast-path operators of
MultiheadAttention and TransformerEncoderLayer called directly, and random convolutions (a hypothesis strategy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st
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


@st.composite
def conv_modules(draw: st.DrawFn) -> tuple[nn.Module, tuple[int, ...]]:
    """A convolution of any dimension (plain or transposed; groups, stride, padding, dilation, bias) and an input
    shape it accepts (batched or not)."""
    dim = draw(st.integers(1, 3))
    transposed = draw(st.booleans())
    groups = draw(st.integers(1, 3))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    ints = st.integers
    kernel = [draw(ints(1, 3)) for _ in range(dim)]
    stride = [draw(ints(1, 2)) for _ in range(dim)]
    dilation = [draw(ints(1, 2)) for _ in range(dim)]
    span = [d * (k - 1) + 1 for k, d in zip(kernel, dilation, strict=True)]
    if transposed:
        padding = [draw(ints(0, (s - 1) // 2)) for s in span]
        output_padding = [draw(ints(0, max(s, d) - 1)) for s, d in zip(stride, dilation, strict=True)]
        spatial = [draw(ints(1, 4)) for _ in range(dim)]
        cls = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[dim - 1]
        module = cls(cin, cout, kernel, stride, padding, output_padding, groups, draw(st.booleans()), dilation)
    else:
        padding = [draw(ints(0, 1)) for _ in range(dim)]
        spatial = [draw(ints(max(1, s - 2 * p), s - 2 * p + 3)) for s, p in zip(span, padding, strict=True)]
        cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dim - 1]
        module = cls(cin, cout, kernel, stride, padding, dilation, groups, draw(st.booleans()))
    batch = [] if draw(st.booleans()) and dim < 3 else [draw(ints(1, 2))]
    return module, (*batch, cin, *spatial)


class _Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm, a shortcut (a strided 1x1 convolution where the
    shape changes)."""

    def __init__(self, channels: int, out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut = nn.Identity() if stride == 1 and channels == out else nn.Sequential(
            nn.Conv2d(channels, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def small_resnet(classes: int = 10) -> nn.Module:
    """torchvision's ResNet-18 layout, narrow and two blocks deep (torchvision itself imports torch._dynamo): stem
    convolution, max pooling, basic blocks, average pooling and a linear head."""
    return nn.Sequential(nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.MaxPool2d(3, 2, 1), _Block(8, 8, 1), _Block(8, 16, 2), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, classes))
