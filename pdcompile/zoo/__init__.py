"""Example models for the demo, tests and benchmarks, each with its inputs, target and loss.

    >>> from pdcompile.zoo import get, names
    >>> z = get("gpt", size="small", batch_size=8, seed=0)
    >>> loss = z.loss_fn(z.model(*z.example_inputs), z.target)

Every model traces with ``torch.fx.symbolic_trace`` (torch.nn modules kept whole) and passes only
Tensors between layers: shapes come from config constants and ``-1``, never from ``x.shape``.
``small`` configs are tiny (tests run in milliseconds); ``full`` configs are the published sizes
and, with ``device="meta"``, are built without allocating memory.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import Tensor, nn

from pdcompile.errors import UsageError
from pdcompile.zoo import gnmt, gpt, mlp, resnet, vgg
from pdcompile.zoo._common import Family

__all__ = ["ZooModel", "batches", "get", "names", "sizes"]

_FAMILIES: dict[str, Family[Any]] = {
    "mlp": mlp.FAMILY,
    "vgg": vgg.FAMILY,
    "resnet": resnet.FAMILY,
    "gpt": gpt.FAMILY,
    "gnmt": gnmt.FAMILY,
}


@dataclass(frozen=True)
class ZooModel:
    """A built model with everything needed to train it one step."""

    name: str
    size: str
    model: nn.Module  # built, deterministically initialised from the seed
    example_inputs: tuple[Tensor, ...]  # one batch of batch_size: make_batch(seed, batch_size)[0]
    target: Tensor
    loss_fn: nn.Module  # loss_fn(model(*inputs), target); its class rebuilds from no arguments
    leaf_modules: tuple[type[nn.Module], ...]  # module classes the tracer must keep whole
    make_batch: Callable[[int, int], tuple[tuple[Tensor, ...], Tensor]]  # (seed, batch_size) -> batch
    factory: str = "pdcompile.zoo:get"  # where this came from (documentation only)


def names() -> list[str]:
    """The model names ``get`` accepts."""
    return list(_FAMILIES)


def sizes(name: str) -> list[str]:
    """The sizes ``get(name, size=...)`` accepts, e.g. ``["small", "full"]``."""
    return list(_family(name).configs)


def get(
    name: str,
    size: str = "small",
    batch_size: int = 8,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> ZooModel:
    """Build model ``name`` at ``size`` with weights drawn after ``torch.manual_seed(seed)``.

    Weights are drawn on CPU and then moved, so they are the same on every device; on ``meta``
    nothing is allocated (parameters, buffers and the example batch are all meta tensors).
    The global RNG is left seeded with ``seed``.
    """
    family = _family(name)
    if size not in family.configs:
        raise UsageError(f"zoo model {name!r} has no size {size!r}; choose one of {sorted(family.configs)}")
    if batch_size < 1:
        raise UsageError(f"batch_size must be at least 1, got {batch_size}")
    cfg = family.configs[size]
    dev = torch.device(device)
    torch.manual_seed(seed)
    if dev.type == "meta":
        with torch.device("meta"):
            model = family.build(cfg)
    else:
        model = family.build(cfg).to(dev)
    make_batch = functools.partial(family.make_batch, cfg, dev)
    inputs, target = make_batch(seed, batch_size)
    return ZooModel(
        name=name,
        size=size,
        model=model,
        example_inputs=inputs,
        target=target,
        loss_fn=family.loss().to(dev),
        leaf_modules=family.leaf_modules,
        make_batch=make_batch,
    )


def _family(name: str) -> Family[Any]:
    if name not in _FAMILIES:
        raise UsageError(f"unknown zoo model {name!r}; choose one of {names()}")
    return _FAMILIES[name]


def batches(batch_size: int, name: str, size: str = "small", seed: int = 0,
            cycle: int | None = None) -> Iterator[tuple[tuple[Tensor, ...], Tensor]]:
    """Endless seeded minibatches for zoo model ``name``: batch ``i`` is ``make_batch(seed + i, batch_size)``
    (``seed + i % cycle`` with ``cycle``: a small fixed data set, learnable, so the loss falls).

    The data hook of emitted programs (plan.json ``"data": {"factory": "pdcompile.zoo:batches", ...}``).
    """
    family = _family(name)
    cfg = family.configs[size]
    i = 0
    while True:
        yield family.make_batch(cfg, torch.device("cpu"), seed + (i % cycle if cycle else i), batch_size)
        i += 1
