"""ResNet: convolutional blocks whose outputs are added to their inputs (He et al., 2015).

Every skip connection is written ``out + identity`` in ``forward``, so it is an explicit edge of
the traced graph (a branch the linearizer must carry across cuts). ``full`` is ResNet-50 with
BatchNorm2d, as published; ``small`` uses GroupNorm, which normalises each sample on its own with
no running state, so the tests' split-vs-whole comparisons stay exact (BatchNorm in training mode
uses the whole batch's statistics and updates running buffers, so microbatches would differ).
GroupNorm has the same two parameters per channel, so parameter counts don't depend on the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pdcompile.zoo._common import Batch, Family, generator, randint, randn


@dataclass(frozen=True)
class ResNetConfig:
    block: Literal["basic", "bottleneck"]
    depths: tuple[int, ...]  # blocks per stage
    widths: tuple[int, ...]  # base width per stage (a bottleneck block outputs 4x this)
    stem: Literal["small", "imagenet"]  # 3x3 conv; or 7x7/2 conv + 3x3/2 max-pool
    norm: Literal["group", "batch"]
    image_size: int
    num_classes: int
    groups: int = 2  # GroupNorm groups (norm="group" only)
    in_channels: int = 3


CONFIGS = {
    "small": ResNetConfig(
        block="basic", depths=(1, 1), widths=(8, 16), stem="small", norm="group", image_size=16, num_classes=10
    ),
    "full": ResNetConfig(  # ResNet-50
        block="bottleneck",
        depths=(3, 4, 6, 3),
        widths=(64, 128, 256, 512),
        stem="imagenet",
        norm="batch",
        image_size=224,
        num_classes=1000,
    ),
}


def _norm(cfg: ResNetConfig, channels: int) -> nn.Module:
    return nn.GroupNorm(cfg.groups, channels) if cfg.norm == "group" else nn.BatchNorm2d(channels)


def _downsample(cfg: ResNetConfig, cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), _norm(cfg, cout))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions: ``out = relu(norm(conv(relu(norm(conv(x))))) + identity)``."""

    expansion = 1

    def __init__(self, cfg: ResNetConfig, cin: int, width: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(cfg, width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = _norm(cfg, width)
        self.downsample = _downsample(cfg, cin, width, stride)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, then the residual add."""

    expansion = 4

    def __init__(self, cfg: ResNetConfig, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = _norm(cfg, width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = _norm(cfg, width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = _norm(cfg, cout)
        self.downsample = _downsample(cfg, cin, cout, stride)

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        block = BasicBlock if cfg.block == "basic" else Bottleneck
        stem_width = cfg.widths[0]
        if cfg.stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(cfg.in_channels, stem_width, 7, stride=2, padding=3, bias=False),
                _norm(cfg, stem_width),
                nn.ReLU(),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(cfg.in_channels, stem_width, 3, padding=1, bias=False),
                _norm(cfg, stem_width),
                nn.ReLU(),
            )
        blocks: list[nn.Module] = []
        cin = stem_width
        for i, (depth, width) in enumerate(zip(cfg.depths, cfg.widths)):
            for j in range(depth):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(block(cfg, cin, width, stride))
                cin = width * block.expansion
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, cfg.num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def make_batch(cfg: ResNetConfig, device: torch.device, seed: int, batch_size: int) -> Batch:
    gen = generator(seed)
    x = randn(gen, (batch_size, cfg.in_channels, cfg.image_size, cfg.image_size), device)
    return (x,), randint(gen, cfg.num_classes, (batch_size,), device)


FAMILY = Family(configs=CONFIGS, build=ResNet, make_batch=make_batch, loss=nn.CrossEntropyLoss)
