"""The split backward's weight pass (runtime/weight_grads.py): per-submodule weight gradients equal
an unsplit backward's bitwise, and every model shape where they would not falls back to the plain walk."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pdcompile.runtime.weight_grads import WeightPass

pytestmark = pytest.mark.timeout(60)


class Net(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear, plus a parameter of the root used directly."""

    def __init__(self, reuse: bool = False, outside: bool = False, tie: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)
        self.b = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.full((8,), 1.5))
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.reuse, self.outside = reuse, outside
        if tie:
            self.c = nn.Linear(8, 8)
            self.c.weight = self.b.weight  # one parameter object owned by two submodules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(F.gelu(self.ln(self.a(x))))
        if self.reuse:
            h = self.b(h)  # a submodule called twice
        if self.outside:
            h = h + h @ self.b.weight  # b's weight also used outside b's call
        if hasattr(self, "c"):
            h = self.c(h)
        return self.frozen(h * self.scale)


def _grads(net: Net, x: torch.Tensor, split: bool, wp: WeightPass | None = None,
           steps: int = 3) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """Accumulate ``steps`` microbatches' gradients (the last split, as the drain's); return them and
    the last input gradient."""
    net.zero_grad(set_to_none=True)
    for i in range(steps):
        xi = (x + i).requires_grad_(True)
        last = split and i == steps - 1
        handles, notes = wp.capture() if last else ([], {})
        loss = net(xi).pow(2).mean()
        for h in handles:
            h.remove()
        if last:
            dx, work = wp.input_grads([loss], None, [xi], notes)
            wp.weight_grads(work)
            dxi = dx[0]
        else:
            loss.backward()
            dxi = xi.grad
    return [p.grad for p in net.parameters()], dxi


@pytest.mark.parametrize("kind", ["plain", "reuse", "outside", "tie"])
def test_weight_pass_equals_an_unsplit_backward(kind: str) -> None:
    torch.manual_seed(0)
    net = Net(reuse=kind == "reuse", outside=kind == "outside", tie=kind == "tie")
    x = torch.randn(4, 6)
    want, want_dx = _grads(net, x, split=False)
    wp = WeightPass(net)
    for _ in range(2):  # the first W verifies, the second runs as verified
        got, dx = _grads(net, x, split=True, wp=wp)
        assert torch.equal(dx, want_dx)
        for g, w in zip(got, want):
            assert (g is None and w is None) or torch.equal(g, w)
    # the fast path only where each parameter is used inside its own submodule's single call
    assert wp.trusted is (kind == "plain")
    assert all(p.grad is None for p in net.frozen.parameters())


def _node(root: torch.Tensor, name: str) -> object:
    """The first autograd node named like ``name`` in the graph behind ``root``."""
    todo, seen = [root.grad_fn], set()
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        if name in n.name():
            return n
        todo += [f for f, _ in n.next_functions]
    raise AssertionError(f"no {name} node")


@pytest.mark.parametrize("trusted", [True, False])
def test_weight_pass_does_not_walk_the_graph_again(trusted: bool) -> None:
    # the GELU between the submodules has no parameter: the verified per-submodule pass never runs
    # its backward again; the plain walk (the fallback) does
    torch.manual_seed(0)
    net = Net()
    wp = WeightPass(net)
    _grads(net, torch.randn(4, 6), split=True, wp=wp)  # the first W verifies
    assert wp.trusted is True
    wp.trusted = trusted or False
    x = torch.randn(4, 6, requires_grad=True)
    handles, notes = wp.capture()
    loss = net(x).pow(2).mean()
    for h in handles:
        h.remove()
    assert set(notes) == ({net.a, net.ln, net.b} if trusted else set())  # frozen owns nothing trainable
    _, work = wp.input_grads([loss], None, [x], notes)
    calls = []
    _node(loss, "Gelu").register_prehook(lambda g: calls.append(1))
    wp.weight_grads(work)
    assert len(calls) == (0 if trusted else 1)


class RootOnly(nn.Module):
    """Two linears whose weights the module reads itself (as every op of an exported graph does)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 6))
        self.w2 = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x, self.w1)), self.w2)


def test_a_stage_reading_every_parameter_itself_would_walk_its_whole_graph() -> None:
    # the executor runs such a stage's backward unsplit (B whole, W nothing); submodule-owned weights stay split
    assert WeightPass(RootOnly()).walks_whole_graph
    assert not WeightPass(Net()).walks_whole_graph  # its root parameter is read at the end: a short walk
    torch.manual_seed(0)
    outside = Net(outside=True)
    wp = WeightPass(outside)
    assert not wp.walks_whole_graph  # not known before the first W's check
    _grads(outside, torch.randn(4, 6), split=True, wp=wp)
    assert wp.trusted is False and wp.walks_whole_graph  # the check found b's weight used outside b: plain walks
    # and the walk is whole: W of RootOnly runs the GELU's backward again, which an unsplit backward runs once
    net = RootOnly()
    wp = WeightPass(net)
    x = torch.randn(4, 6, requires_grad=True)
    handles, notes = wp.capture()
    loss = net(x).pow(2).mean()
    _, work = wp.input_grads([loss], None, [x], notes)
    calls: list[int] = []
    _node(loss, "Gelu").register_prehook(lambda g: calls.append(1))
    wp.weight_grads(work)
    assert calls == [1]
