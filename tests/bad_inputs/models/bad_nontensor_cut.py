"""A Python int (``x.size(0)``) read from the first op to the last, so it is live across every cut."""

import torch


class NonTensorCut(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.fc3 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)  # BAD across a cut: a Python int used from the first op to the last
        h = self.fc1(x.view(n, -1))
        h = self.fc2(h).view(n, -1)
        return self.fc3(h).view(n, -1)


def make() -> torch.nn.Module:
    return NonTensorCut()
