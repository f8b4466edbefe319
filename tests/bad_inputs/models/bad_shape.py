"""A plain MLP expecting 16 features; the bad inputs give it 10 (its forward fails on them)."""

import torch


def make() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
