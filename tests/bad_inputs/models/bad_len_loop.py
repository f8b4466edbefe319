"""A loop over ``range(len(x))``: the length of a tensor is data to fx."""

import torch


class LenLoop(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        for i in range(len(h)):  # BAD: len() of a tensor
            h = h + i
        return self.fc2(h)


def make() -> torch.nn.Module:
    return LenLoop()
