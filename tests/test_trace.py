"""The trace pass: leaf policy, and every untraceable construct reported at once with its fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdcompile.errors import UnsupportedModelError
from pdcompile.passes.trace import diagnose, trace

pytestmark = pytest.mark.timeout(60)


class DataIf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:
            y = y * 2
        return y


class LenLoop(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(len(x)):
            x = x + 1
        return x


class Item(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.mean().item()


class AllThree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = DataIf()
        self.loop = LenLoop()
        self.scale = Item()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.scale(self.loop(self.gate(x))))


@pytest.mark.parametrize("model,kind,snippet", [
    (DataIf(), "data-dependent control flow", "if y.sum() > 0:"),
    (LenLoop(), "iteration over a tensor", "for _ in range(len(x)):"),
    (Item(), "host sync", "x.mean().item()"),
])
def test_each_untraceable_construct_is_named_with_its_fix(model: nn.Module, kind: str, snippet: str) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        trace(model)
    msg = str(info.value)
    assert kind in msg and snippet in msg and "Fix:" in msg
    assert "test_trace.py:" in msg  # the source line is located


def test_every_construct_is_listed_not_just_the_first() -> None:
    with pytest.raises(UnsupportedModelError) as info:
        trace(AllThree())
    msg = str(info.value)
    assert "3 construct(s)" in msg
    for module, kind in [("'gate'", "control flow"), ("'loop'", "iteration"), ("'scale'", "host sync")]:
        line = next(ln for ln in msg.splitlines() if module in ln)
        assert kind in line
    assert len(diagnose(AllThree())) == 3


def test_marking_offenders_as_leaves_makes_the_model_traceable() -> None:
    gm = trace(AllThree(), leaf_modules=["gate", LenLoop, "scale"])
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert targets == ["gate", "loop", "scale", "head"]
    x = torch.randn(3, 4)
    m = AllThree()
    gm = trace(m, leaf_modules=["gate", LenLoop, "scale"])
    assert torch.equal(gm(x), m(x))


def test_torch_nn_builtins_are_leaves_and_containers_are_not() -> None:
    m = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.ReLU(), nn.LSTM(3, 3, batch_first=True)))
    gm = trace(m)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "1.0", "1.1"]
