"""``.tolist()`` turns a tensor into a Python value inside forward()."""

import torch


class ToList(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        scale = h.mean().tolist()  # BAD: host sync
        return self.fc2(h) * scale


def make() -> torch.nn.Module:
    return ToList()
