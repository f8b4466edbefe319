"""Losses used by the zoo; each is constructible from keyword arguments alone."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SequenceCrossEntropy(nn.Module):
    """Cross-entropy over every position of a sequence: logits (B, T, V), targets (B, T) class ids.

    Both are flattened to (B*T, V) and (B*T,) so the mean is over all tokens. Every argument is a
    keyword with a default, so an emitted program can rebuild the loss from its class path alone.
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean"):
        super().__init__()
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(
            logits.flatten(0, -2),
            target.flatten(),
            ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing,
            reduction=self.reduction,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
            f"reduction={self.reduction!r}"
        )
