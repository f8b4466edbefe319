"""A leaf module in the last stage whose constructor argument isn't kept: emit can't rebuild it."""

import torch


class Scale(torch.nn.Module):
    """Kept whole (a leaf); ``factor`` is folded into a buffer, so it can't be read back."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.register_buffer("w", torch.full((4,), float(factor)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def make() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4), Scale(3.0))
