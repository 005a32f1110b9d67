"""ResNet v1.5 (stride on the 3x3 conv of Bottleneck) with torchvision's exact module and parameter layout.

Matching torchvision's names and shapes lets state_dicts load in either direction and makes every
analysis number comparable with torchvision's models and the published figures.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

__all__ = ["BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]


def _conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs with an identity (or 1x1 projection) shortcut; used by ResNet-18/34."""

    expansion: ClassVar[int] = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        out += identity  # in place, as torchvision, so traced op sequences match too
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride: v1.5), 1x1 expand by 4; used by ResNet-50/101/152."""

    expansion: ClassVar[int] = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = _conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """Stem (7x7/2 conv, 3x3/2 max-pool), four residual stages, global average pool, linear classifier."""

    def __init__(self, block: type[BasicBlock | Bottleneck], layers: list[int], num_classes: int = 1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0], stride=1)
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)

    def _make_layer(self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int, stride: int) -> nn.Sequential:
        """One stage; its first block changes stride/width, projecting the shortcut when shapes differ."""
        out_ch = planes * block.expansion
        downsample = None
        if stride != 1 or self.inplanes != out_ch:
            downsample = nn.Sequential(_conv1x1(self.inplanes, out_ch, stride), nn.BatchNorm2d(out_ch))
        stage = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = out_ch
        stage += [block(out_ch, planes) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18: 11,689,512 parameters at 1000 classes."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes)


def resnet34(num_classes: int = 1000) -> ResNet:
    """ResNet-34: 21,797,672 parameters at 1000 classes."""
    return ResNet(BasicBlock, [3, 4, 6, 3], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 v1.5: 25,557,032 parameters at 1000 classes."""
    return ResNet(Bottleneck, [3, 4, 6, 3], num_classes)


def resnet101(num_classes: int = 1000) -> ResNet:
    """ResNet-101 v1.5: 44,549,160 parameters at 1000 classes."""
    return ResNet(Bottleneck, [3, 4, 23, 3], num_classes)


def resnet152(num_classes: int = 1000) -> ResNet:
    """ResNet-152 v1.5: 60,192,808 parameters at 1000 classes."""
    return ResNet(Bottleneck, [3, 8, 36, 3], num_classes)
