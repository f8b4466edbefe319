"""A Python ``for`` over a tensor's rows."""

import torch


class IterTensor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        rows = [row * 2 for row in h]  # BAD: iteration over a tensor
        return self.fc2(torch.stack(rows))


def make() -> torch.nn.Module:
    return IterTensor()
