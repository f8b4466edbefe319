"""The model of the demo's local run: VGG-shaped, with its parameters in the classifier as VGG-16's are.

Three 3x3 convolutions (16-M-32-M-64-M on 32x32 images) then Linear 1024-1024-1024-10: nearly all
its parameters sit in the Linear layers, while the activations after the convolutions are small
(64 x 4 x 4 per sample). That is the shape PipeDream wins on: data parallelism all-reduces every
parameter each step, a pipeline cut after the convolutions sends only the small activations.
The data is learnable in a few steps (each class is a fixed random image plus noise), so both the
pipeline and the data-parallel baseline show their loss falling. ``build`` is the factory
``pdcompile.ddp_worker --model`` calls; ``batches`` is the emitted program's data hook.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pdcompile.zoo import vgg

CONFIG = vgg.VGGConfig(layers=(16, vgg.M, 32, vgg.M, 64, vgg.M), image_size=32, hidden=1024, num_classes=10)
SIGNAL = 3.0  # class image scale against unit noise
LR, MOMENTUM = 0.02, 0.9


@dataclass(frozen=True)
class DemoModel:
    """The model, one minibatch, its loss and what the tracer keeps whole."""

    model: nn.Module
    example_inputs: tuple[Tensor, ...]
    target: Tensor
    loss_fn: nn.Module
    leaf_modules: tuple[type[nn.Module], ...]


def optimizer(params: object) -> torch.optim.Optimizer:
    """SGD with momentum: what both the pipeline and the data-parallel baseline train with."""
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)  # type: ignore[arg-type]  # torch's SGD stub takes an iterable of tensors


@functools.lru_cache(maxsize=1)
def _templates() -> Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn((CONFIG.num_classes, CONFIG.in_channels, CONFIG.image_size, CONFIG.image_size), generator=g)


def make_batch(seed: int, batch_size: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """Minibatch ``seed``: labels drawn at random, each image its class's template plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CONFIG.num_classes, (batch_size,), generator=g)
    shape = (batch_size, CONFIG.in_channels, CONFIG.image_size, CONFIG.image_size)
    return (SIGNAL * _templates()[y] + torch.randn(shape, generator=g),), y


def build(batch_size: int = 32, seed: int = 0) -> DemoModel:
    """The model with weights drawn after ``torch.manual_seed(seed)``, and minibatch 0."""
    torch.manual_seed(seed)
    model = vgg.VGG(CONFIG)
    inputs, target = make_batch(seed, batch_size)
    return DemoModel(model, inputs, target, nn.CrossEntropyLoss(), vgg.FAMILY.leaf_modules)


def batches(batch_size: int, seed: int = 0, pool: int = 8) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    """Endless minibatches: minibatch ``i`` is ``make_batch(seed + i % pool, batch_size)``, made up front,
    so handing one out costs nothing inside a timed step (the prediction has no data loading)."""
    made = [make_batch(seed + i, batch_size) for i in range(pool)]
    i = 0
    while True:
        yield made[i % pool]
        i += 1
