"""VGG: blocks of 3x3 convolutions and ReLUs separated by max-pools, then a Linear classifier.

``full`` is VGG-16 (configuration "D" of Simonyan & Zisserman, 2014) on 224x224 images, 1000
classes, ~138M parameters. Dropout is left out so training is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pdcompile.zoo._common import Batch, Family, generator, randint, randn

M = "M"  # a 2x2 max-pool in a layer list


@dataclass(frozen=True)
class VGGConfig:
    layers: tuple[int | str, ...]  # output channels of each 3x3 conv, or M for a max-pool
    image_size: int
    hidden: int  # width of the two hidden classifier layers
    num_classes: int
    in_channels: int = 3


CONFIGS = {
    "small": VGGConfig(layers=(4, 4, M, 8, 8, M, 16, M), image_size=16, hidden=32, num_classes=10),
    "full": VGGConfig(
        layers=(64, 64, M, 128, 128, M, 256, 256, 256, M, 512, 512, 512, M, 512, 512, 512, M),
        image_size=224,
        hidden=4096,
        num_classes=1000,
    ),
}


class VGG(nn.Module):
    def __init__(self, cfg: VGGConfig):
        super().__init__()
        layers: list[nn.Module] = []
        channels, side = cfg.in_channels, cfg.image_size
        for v in cfg.layers:
            if v == M:
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
                side //= 2
            else:
                assert isinstance(v, int)
                layers += [nn.Conv2d(channels, v, kernel_size=3, padding=1), nn.ReLU()]
                channels = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(channels * side * side, cfg.hidden),
            nn.ReLU(),
            nn.Linear(cfg.hidden, cfg.hidden),
            nn.ReLU(),
            nn.Linear(cfg.hidden, cfg.num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def make_batch(cfg: VGGConfig, device: torch.device, seed: int, batch_size: int) -> Batch:
    gen = generator(seed)
    x = randn(gen, (batch_size, cfg.in_channels, cfg.image_size, cfg.image_size), device)
    return (x,), randint(gen, cfg.num_classes, (batch_size,), device)


FAMILY = Family(configs=CONFIGS, build=VGG, make_batch=make_batch, loss=nn.CrossEntropyLoss)
