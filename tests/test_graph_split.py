"""The split backward at the graph level (runtime/graph_split.py): the traced backward cut into I
and W gives an unsplit eager backward's gradients bitwise, and falls back to WeightPass where the
graph route does not apply; a zb-h1 launch trains with it as single-process SGD does."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pdcompile.runtime import graph_split
from pdcompile.runtime.graph_split import GraphSplit, Record, graph_route
from pdcompile.runtime.program import TensorSpec
from pdcompile.runtime.weight_grads import WeightPass

pytestmark = pytest.mark.timeout(120)


@functools.cache
def _stages(name: str, stages: int = 3) -> tuple[list[nn.Module], list[list[torch.Tensor]], Any, torch.Tensor]:
    """The zoo model's stage modules (``resnet-batch``: the small ResNet with BatchNorm), each stage's
    inputs for one microbatch (detached activations), the loss and the target."""
    import dataclasses

    from pdcompile.api import pdcompile
    from pdcompile.zoo import get, resnet

    z = get(name.removesuffix("-batch"), batch_size=4, seed=0)
    model = z.model
    if name == "resnet-batch":
        model = resnet.ResNet(dataclasses.replace(resnet.CONFIGS["small"], norm="batch"))
    pipe = pdcompile(model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), stages=stages, schedule="zb-h1",
                     num_microbatches=2, leaf_modules=z.leaf_modules)
    mods = [st.gm for st in pipe.split.stages]
    ins: list[list[torch.Tensor]] = [[x[:2] for x in z.example_inputs]]
    for m in mods[:-1]:
        out = m(*ins[-1])
        ins.append([o.detach().requires_grad_(o.is_floating_point()) for o in out])
    return mods, ins, z.loss_fn, z.target[:2]


def _fresh(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in ts]


def _roots(mod_out: Any, loss_fn: Any,
           target: torch.Tensor | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """A middle stage's roots are its outputs (seeded with fixed gradients), the last stage's its loss."""
    if target is not None:
        return [loss_fn(mod_out, target)], None
    outs = [o for o in mod_out if o.requires_grad]
    gen = torch.Generator().manual_seed(1)
    return outs, [torch.randn(o.shape, generator=gen) for o in outs]


def _backward(mod: nn.Module, ins: list[torch.Tensor], route: WeightPass | GraphSplit | None,
              roots_of: Callable[[Any], tuple[list[torch.Tensor], list[torch.Tensor] | None]],
              seed: int = 0) -> tuple[Any, list[torch.Tensor], list[torch.Tensor | None]]:
    """(outputs, input gradients, weight gradients) of one microbatch: unsplit (``route`` None) or
    split as the executor splits it (capture, forward, ``B``, then ``W``)."""
    mod.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    wrt = [t for t in ins if t.requires_grad]
    if route is None:
        out = mod(*ins)
        roots, seeds = roots_of(out)
        torch.autograd.backward(roots, seeds)
        dins = [t.grad for t in wrt]
    else:
        handles, notes = route.capture()
        out = route.forward(notes, ins) if isinstance(route, GraphSplit) else mod(*ins)
        for h in handles:
            h.remove()
        roots, seeds = roots_of(out)
        dins, work = route.input_grads(roots, seeds, wrt, notes)
        assert all(p.grad is None for p in mod.parameters())  # B leaves the weights' gradients to W
        route.weight_grads(work)
    return out, dins, [p.grad for p in mod.parameters()]


def _same(a: Any, b: Any) -> None:
    a, b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("name", ["gpt", "mlp", "vgg"])
def test_graph_split_is_bitwise_an_unsplit_backward(name: str) -> None:
    mods, ins, loss_fn, target = _stages(name)
    for s in (1, 2):  # a middle stage (seeded outputs) and the last (its loss)
        mod = mods[s]
        roots_of = functools.partial(_roots, loss_fn=loss_fn, target=target if s == 2 else None)
        gs = GraphSplit(mod, _fresh(ins[s]))
        assert gs.check(_fresh(ins[s])) is True
        want = _backward(mod, _fresh(ins[s]), None, roots_of)
        for _ in range(2):  # the graphs are reused
            got = _backward(mod, _fresh(ins[s]), gs, roots_of)
            for w, g in zip(want, got):
                _same(w, g)
        # an unsplit backward through the graph's autograd node: the same again
        mod.zero_grad(set_to_none=True)
        x = _fresh(ins[s])
        out = gs.forward(Record(), x)
        torch.autograd.backward(*roots_of(out))
        _same(want[1:], ([t.grad for t in x if t.requires_grad], [p.grad for p in mod.parameters()]))
        assert got[1] and all(g.abs().sum() > 0 and g.grad_fn is None for g in got[1])
        assert sum(g is not None and g.grad_fn is None for g in got[2]) > 1
        # I holds the input gradients' ancestors only: W has work of its own
        assert any(n.op == "call_function" for n in gs.w_graph.graph.nodes)
        if name == "vgg" and s == 1:
            # each convolution_backward made two: grad_input in I, grad_weight and grad_bias in W
            conv = torch.ops.aten.convolution_backward.default
            masks_i = [n.args[-1] for n in gs.i_graph.graph.nodes if n.target is conv]
            masks_w = [n.args[-1] for n in gs.w_graph.graph.nodes if n.target is conv]
            assert masks_i and gs.masked_split == len(masks_i)
            assert all(m == [True, False, False] for m in masks_i) and masks_w == [[False, True, True]] * len(masks_i)


def test_graph_split_replays_dropout_masks() -> None:
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.GELU(), nn.Linear(16, 4))
    x = torch.randn(8, 6, requires_grad=True)
    gs = GraphSplit(mod, _fresh([x]))
    assert gs.check(_fresh([x]))
    roots_of = functools.partial(_roots, loss_fn=lambda o, t: o.pow(2).mean(), target=torch.zeros(()))
    want = _backward(mod, _fresh([x]), None, roots_of, seed=3)
    _same(want, _backward(mod, _fresh([x]), gs, roots_of, seed=3))
    other = _backward(mod, _fresh([x]), gs, roots_of, seed=4)
    assert not torch.equal(want[0], other[0])  # the masks are drawn, from torch's random state


@pytest.mark.parametrize("kind", ["reuse", "outside", "tie"])
def test_graph_split_is_exact_where_submodules_are_not(kind: str) -> None:
    # the shapes WeightPass distrusts (a submodule called twice, a weight used outside its
    # submodule, one parameter in two submodules): the graph has every use
    from test_weight_grads import Net

    torch.manual_seed(0)
    net = Net(**{kind: True})
    x = torch.randn(4, 6, requires_grad=True)
    gs = GraphSplit(net, _fresh([x]))
    assert gs.check(_fresh([x]))
    roots_of = functools.partial(_roots, loss_fn=lambda o, t: o.pow(2).mean(), target=torch.zeros(()))
    _same(_backward(net, _fresh([x]), None, roots_of), _backward(net, _fresh([x]), gs, roots_of))


def _specs(ins: Sequence[torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec("x", tuple(t.shape), t.dtype, t.requires_grad) for t in ins]


def test_batchnorm_stage_splits_by_the_graph() -> None:
    """A stage whose forward writes buffers (BatchNorm's running statistics in training): the
    forward graph returns their new values and the route writes them back, so outputs, gradients
    and running statistics are bitwise an eager forward and unsplit backward's; tracing and the
    check leave the statistics as they were."""
    mods, ins, loss_fn, target = _stages("resnet-batch", stages=2)
    mod = mods[1]
    assert any(isinstance(m, nn.BatchNorm2d) for m in mod.modules())
    running = {n: b.clone() for n, b in mod.named_buffers()}
    gs = graph_route(mod, _specs(ins[1]), "cpu", stage=1)
    assert isinstance(gs, GraphSplit) and gs.written
    assert {n for j, (n, _) in enumerate(mod.named_buffers()) if j in gs.written} >= \
        {n for n in running if n.endswith("num_batches_tracked")}
    for n, b in mod.named_buffers():  # tracing and the check wrote copies only
        assert torch.equal(b, running[n]), n

    def reset() -> None:
        for n, b in mod.named_buffers():
            b.data.copy_(running[n])

    roots_of = functools.partial(_roots, loss_fn=loss_fn, target=target)
    want = _backward(mod, _fresh(ins[1]), None, roots_of)
    stats = {n: b.clone() for n, b in mod.named_buffers()}
    assert any(not torch.equal(stats[n], running[n]) for n in running)  # eager did write them
    reset()
    _same(want, _backward(mod, _fresh(ins[1]), gs, roots_of))
    for n, b in mod.named_buffers():  # the route wrote them as eager did
        assert torch.equal(b, stats[n]), n
    reset()
    _same(want, _backward(mod, _fresh(ins[1]), WeightPass(mod), roots_of))


def test_a_write_the_graph_does_not_return_falls_back(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Where the forward graph's extra outputs do not match the buffers the forward writes, the
    route does not apply (logged), and the submodules' weight pass splits instead."""
    mods, ins, _, _ = _stages("resnet-batch", stages=2)
    monkeypatch.setattr(graph_split, "_written_buffers", lambda module, examples: [])
    with caplog.at_level(logging.INFO, logger="pdcompile.runtime"):
        assert graph_route(mods[1], _specs(ins[1]), "cpu", stage=1) is None
    assert "buffers" in caplog.text and "WeightPass" in caplog.text


@pytest.mark.parametrize("part", ["outputs", "input grads", "weight grads"])
def test_a_failed_check_falls_back(part: str, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    mods, ins, _, _ = _stages("mlp")
    mod = mods[1]
    bump: Callable[[Any], Any] = lambda t: t * (1 + 2 ** -20)  # one ulp-ish: a bitwise check must see it
    if part == "outputs":
        real_forward = GraphSplit.forward
        monkeypatch.setattr(GraphSplit, "forward", lambda self, r, i: tuple(
            bump(o) for o in real_forward(self, r, i)))
    elif part == "input grads":
        real_i = GraphSplit.run_i
        monkeypatch.setattr(GraphSplit, "run_i", lambda self, env: (
            [bump(g) for g in real_i(self, env)[0]], real_i(self, env)[1]))
    else:
        real_w = GraphSplit.grads_of
        monkeypatch.setattr(GraphSplit, "grads_of", lambda self, work: {
            j: (bump(g) if j == 0 else g) for j, g in real_w(self, work).items()})
    with caplog.at_level(logging.INFO, logger="pdcompile.runtime"):
        assert graph_route(mod, _specs(ins[1]), "cpu", stage=1) is None
    what = {"outputs": "outputs", "input grads": "input gradients", "weight grads": "the gradient of "}[part]
    assert f"graphs' {what}" in caplog.text and "differ from an eager forward" in caplog.text
    monkeypatch.undo()
    gs = graph_route(mod, _specs(ins[1]), "cpu", stage=1)
    assert gs is not None and gs.trusted


def test_other_fallbacks(caplog: pytest.LogCaptureFixture) -> None:
    mods, ins, _, _ = _stages("mlp")
    with caplog.at_level(logging.INFO, logger="pdcompile.runtime"):
        assert graph_route(mods[1], _specs(ins[1]), "cpu", precision="bf16", stage=1) is None
        assert "autocast" in caplog.text

        class Opaque(nn.Module):  # data-dependent control flow: aot_autograd cannot trace it
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lin(x) if float(x.detach().sum()) > 0 else -self.lin(x)

        assert graph_route(Opaque(), _specs([torch.ones(2, 4, requires_grad=True)]), "cpu") is None
        assert "could not trace" in caplog.text
    gs = GraphSplit(mods[1], _fresh(ins[1]))
    assert gs.fits(_fresh(ins[1])) and not gs.fits([t[:1] for t in _fresh(ins[1])])
    assert isinstance(gs.capture()[1], Record) and gs.capture()[0] == []
    assert graph_split.example_inputs(_specs(ins[1]), "cpu")[0].shape == ins[1][0].shape


def test_weight_pass_auto_is_the_graph_where_most_backwards_split(tmp_path: Path) -> None:
    """auto: the graph where most of the rank's backwards in a step are split (zb-h1, zb-v, torch's
    interleaved zero bubble read from its CSV), the submodules' where a few are (flush's drain,
    DualPipeV's), on every rank; a flag given is kept."""
    from pdcompile.runtime.run_schedule import weight_pass
    from pdcompile.runtime.schedules.spec import ScheduleSpec
    from pdcompile.runtime.schedules.torch_csv import register_csv
    from pdcompile.torch_orders import torch_csv

    def spec(name: str, v: int = 1, m: int = 4) -> ScheduleSpec:
        return ScheduleSpec(name, (1,) * (2 * v), m, False, False, True, v)

    izb = register_csv(torch_csv("interleaved-zb", 2, 4, path=tmp_path / "izb.csv"))
    cases = {"zb-h1": (spec("zb-h1"), "graph"), "zb-v": (spec("zb-v", 2), "graph"), "izb": (spec(izb, 2), "graph"),
             "flush": (spec("flush"), "submodules"), "gpipe": (spec("gpipe"), "submodules"),
             "dualpipe-v": (spec("dualpipe-v", 2), "submodules")}
    for name, (sp, want) in cases.items():
        assert [weight_pass("auto", sp, r) for r in range(2)] == [want, want], name
    assert weight_pass("graph", spec("flush"), 0) == "graph"
    assert weight_pass("submodules", spec("zb-h1"), 1) == "submodules"


def _batch_norm_resnet() -> nn.Module:
    """The zoo's small ResNet with BatchNorm, its weights drawn as the zoo draws them (seed 0)."""
    import dataclasses

    from pdcompile.zoo import resnet

    torch.manual_seed(0)
    return resnet.ResNet(dataclasses.replace(resnet.CONFIGS["small"], norm="batch"))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt", "resnet-batch"])
def test_zb_h1_trains_with_the_graph_split(tmp_path: Path, name: str) -> None:
    """2 ranks, every backward split through the graph: single-process SGD's weights (GPT), and with
    BatchNorm its running statistics too (the graph's buffer writes written back)."""
    from test_zero_bubble import MICRO, STEPS, _opt, _train

    from pdcompile.api import pdcompile
    from pdcompile.reference import train_sync
    from pdcompile.zoo import batches, get

    zoo = name.removesuffix("-batch")
    z = get(zoo, batch_size=8, seed=0)
    model = _batch_norm_resnet() if name == "resnet-batch" else z.model
    pipe = pdcompile(model, example_inputs=z.example_inputs, example_target=z.target, loss_fn=z.loss_fn,
                     optimizer=_opt, stages=2, schedule="zb-h1", num_microbatches=MICRO, leaf_modules=z.leaf_modules)
    prog = pipe.emit(tmp_path / "prog", data={"factory": "pdcompile.zoo:batches", "kwargs": {"name": zoo}})
    got = _train(prog, tmp_path / "final", 2, ("--weight-pass", "graph", "--metrics", str(tmp_path / "m")))
    for r in range(2):  # every backward split, every split by the graph
        metrics = json.loads((tmp_path / "m" / f"rank_{r}.json").read_text())
        assert metrics["split_backwards"] == {"graph": STEPS * MICRO, "submodules": 0}
    ref = _batch_norm_resnet() if name == "resnet-batch" else get(zoo, batch_size=8, seed=0).model
    initial = {k: v.detach().clone() for k, v in ref.named_parameters()}
    train_sync(ref, z.loss_fn, _opt(ref.parameters()), batches(8, zoo), steps=STEPS, num_microbatches=MICRO)
    want = dict(ref.named_parameters())
    for k, w in want.items():
        torch.testing.assert_close(got[k], w.detach(), rtol=1e-5, atol=1e-6, msg=k)
    assert sum(not torch.equal(want[k].detach(), initial[k]) for k in want) > len(want) // 2
    if name == "resnet-batch":  # the running statistics, saved with each stage's weights
        import glob

        saved: dict[str, torch.Tensor] = {}
        for f in glob.glob(str(tmp_path / "final" / "stage_*.rank_*.pt")):
            saved.update({k: v for k, v in torch.load(f).items() if "running_" in k})
        assert saved
        buffers = dict(ref.named_buffers())
        for k, v in saved.items():
            key = next(n for n in buffers if n.replace(".", "_") in k.replace(".", "_"))
            torch.testing.assert_close(v, buffers[key], rtol=1e-5, atol=1e-6, msg=k)
