"""A multilayer perceptron: Linear/ReLU layers ending in a classifier."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pdcompile.zoo._common import Batch, Family, generator, randint, randn


@dataclass(frozen=True)
class MLPConfig:
    in_features: int
    hidden: tuple[int, ...]
    num_classes: int


CONFIGS = {
    "small": MLPConfig(in_features=16, hidden=(32, 32, 32), num_classes=10),
    # A wide MLP (~42M parameters): three 4096-wide hidden layers.
    "full": MLPConfig(in_features=1024, hidden=(4096, 4096, 4096), num_classes=1000),
}


class MLP(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        layers: list[nn.Module] = []
        width = cfg.in_features
        for h in cfg.hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, cfg.num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def make_batch(cfg: MLPConfig, device: torch.device, seed: int, batch_size: int) -> Batch:
    gen = generator(seed)
    x = randn(gen, (batch_size, cfg.in_features), device)
    return (x,), randint(gen, cfg.num_classes, (batch_size,), device)


FAMILY = Family(configs=CONFIGS, build=MLP, make_batch=make_batch, loss=nn.CrossEntropyLoss)
