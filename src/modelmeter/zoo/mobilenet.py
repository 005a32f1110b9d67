"""MobileNetV2 with torchvision's exact module and parameter layout.

Matching torchvision's names, shapes and op order lets state_dicts load in either direction and makes
every analysis number comparable with torchvision's model and the published figures.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InvalidValueError

__all__ = ["ConvBNReLU6", "InvertedResidual", "MobileNetV2", "mobilenet_v2"]

# (expansion t, output channels c, repeats n, first stride s) of the seven bottleneck stages.
_STAGES: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


def _make_divisible(value: float, divisor: int = 8) -> int:
    """Round `value` to the nearest multiple of `divisor`, never going more than 10% below it."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class ConvBNReLU6(nn.Sequential):
    """Conv (no bias, "same" padding) -> BatchNorm -> ReLU6, children named 0, 1, 2 like torchvision's
    `Conv2dNormActivation`."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(in_ch, out_ch, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU6(inplace=True),
        )
        self.out_channels = out_ch


class InvertedResidual(nn.Module):
    """1x1 expand (skipped when t = 1), 3x3 depthwise (carrying the stride), linear 1x1 project; residual
    when the shape is kept. The layers sit in `.conv`, as in torchvision."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int):
        super().__init__()
        if stride not in (1, 2):
            raise InvalidValueError(f"stride should be 1 or 2, got {stride}")
        self.stride = stride
        hidden = round(inp * expand_ratio)
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = [ConvBNReLU6(inp, hidden, kernel_size=1)] if expand_ratio != 1 else []
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)
        self.out_channels = oup

    def forward(self, x: Tensor) -> Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """Stem conv, 17 inverted-residual blocks, 1x1 conv to 1280 channels, global average pool, classifier."""

    def __init__(
        self, num_classes: int = 1000, width_mult: float = 1.0, round_nearest: int = 8, dropout: float = 0.2
    ):
        super().__init__()
        in_ch = _make_divisible(32 * width_mult, round_nearest)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult), round_nearest)
        features: list[nn.Module] = [ConvBNReLU6(3, in_ch, stride=2)]
        for t, c, n, s in _STAGES:
            out_ch = _make_divisible(c * width_mult, round_nearest)
            for i in range(n):
                features.append(InvertedResidual(in_ch, out_ch, s if i == 0 else 1, t))
                in_ch = out_ch
        features.append(ConvBNReLU6(in_ch, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(self.last_channel, num_classes))

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def mobilenet_v2(num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2) -> MobileNetV2:
    """MobileNetV2: 3,504,872 parameters at width 1.0 and 1000 classes."""
    return MobileNetV2(num_classes, width_mult, dropout=dropout)
