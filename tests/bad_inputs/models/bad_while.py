"""A ``while`` on a tensor's value: the trip count is data."""

import torch


class WhileOnTensor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        while h.abs().max() > 1:  # BAD: while on a tensor
            h = h / 2
        return self.fc2(h)


def make() -> torch.nn.Module:
    return WhileOnTensor()
