"""A data-dependent ``if``: the branch taken depends on the input's values."""

import torch


class DataIf(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if h.sum() > 0:  # BAD: data-dependent if
            h = h * 2
        return self.fc2(h)


def make() -> torch.nn.Module:
    return DataIf()
