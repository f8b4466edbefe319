"""``.item()`` turns a tensor into a Python number inside forward()."""

import torch


class Item(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        scale = h.mean().item()  # BAD: host sync
        return self.fc2(h) * scale


def make() -> torch.nn.Module:
    return Item()
