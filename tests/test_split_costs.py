"""A split backward's two parts per node: annotate-costs measures or counts them, the profile
carries them (older profiles fall back to fixed shares), the simulator charges them to B and W."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pdcompile.ir import Chain, ChainLayer
from pdcompile.passes.annotate_costs import DeviceSpec, annotate_costs, profile_from_graph
from pdcompile.passes.linearize import linearize
from pdcompile.passes.propagate_shapes import propagate_shapes
from pdcompile.passes.trace import trace
from pdcompile.profile import from_json, to_json
from pdcompile.simulate import INPUT_GRAD_SHARE, WEIGHT_GRAD_SHARE, simulate_plan, simulate_schedule

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self, d_in: int = 24, d_hidden: int = 40, d_out: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden, bias=False)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(d_hidden, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _costs(mode: str, net: Net | None = None, batch: int = 8) -> dict[str, object]:
    torch.manual_seed(0)
    net = net or Net()
    x = torch.randn(batch, net.fc1.in_features)
    gm = trace(net)
    propagate_shapes(gm, (x,))
    annotate_costs(gm, (x,), mode=mode, device_spec=DeviceSpec("toy", 1e9, efficiency=1.0), symbolic=False,
                   warmup=1, repeats=3)
    return {n.name: n.meta["pd.cost"] for n in gm.graph.nodes}, gm  # type: ignore[return-value]


def test_analytic_parts_are_the_matmul_flops() -> None:
    costs, _ = _costs("analytic")
    fc1, act, fc2 = costs["fc1"], costs["act"], costs["fc2"]
    # fc2 (40 -> 16, batch 8): dX = dY W is 2*8*16*40 FLOPs, dW = dY^T X as many: half each
    assert fc2.backward_flops == 2 * (2 * 8 * 16 * 40)
    assert fc2.input_grad_s == pytest.approx(fc2.backward_s / 2)
    assert fc2.weight_grad_s == pytest.approx(fc2.backward_s / 2)
    # fc1 reads the model's input (no gradient wanted): its backward is the weights' only
    assert fc1.input_grad_s == 0 and fc1.weight_grad_s == pytest.approx(fc1.backward_s) and fc1.backward_s > 0
    # ReLU has no parameters: all of its backward is input gradients
    assert act.weight_grad_s == 0 and act.input_grad_s == pytest.approx(act.backward_s)


def test_measured_parts_are_timed() -> None:
    # large enough that each part (~1 ms here) stands well above the call's fixed cost, which the
    # measurement takes off (a part of a few microseconds can come out as 0)
    costs, gm = _costs("measured", Net(64, 512, 512), batch=64)
    fc1, act, fc2 = costs["fc1"], costs["act"], costs["fc2"]
    assert fc2.input_grad_s > 0 and fc2.weight_grad_s > 0  # each part timed on its own
    assert fc2.input_grad_s < 2 * fc2.backward_s and fc2.weight_grad_s < 2 * fc2.backward_s
    assert fc1.input_grad_s == 0 and fc1.weight_grad_s == fc1.backward_s
    assert act.weight_grad_s == 0 and act.input_grad_s == act.backward_s
    # the profile carries them, to a file and back
    prof = profile_from_graph(gm, batch_size=64, device="cpu")
    back = from_json(json.loads(json.dumps(to_json(prof))))
    assert back.layer("fc2").input_grad_s == fc2.input_grad_s and back.layer("fc2").weight_grad_s == fc2.weight_grad_s
    # at another batch size they scale with the backward
    half = back.at_batch_size(32).layer("fc2")
    assert half.input_grad_s == pytest.approx(fc2.input_grad_s / 2)
    # and linearize hands them to the planner's chain
    layer = next(l for l in linearize(back).layers if l.name == "fc2")
    assert layer.input_grad_s == fc2.input_grad_s and layer.weight_grad_s == fc2.weight_grad_s


def test_an_older_profile_has_no_parts() -> None:
    costs, gm = _costs("analytic")
    d = to_json(profile_from_graph(gm, batch_size=8, device="cpu"))
    for layer in d["layers"]:
        layer.pop("input_grad_s", None)
        layer.pop("weight_grad_s", None)
    old = from_json(d)
    assert all(l.input_grad_s is None and l.weight_grad_s is None for l in old.layers)
    assert all(l.input_grad_s is None for l in old.at_batch_size(4).layers)


def _plan(stages: list[tuple[int, int]]) -> SimpleNamespace:
    return SimpleNamespace(schedule="zb-h1", microbatch_size=1, stages=[
        SimpleNamespace(first=a, last=b, replicas=1, ranks=[k], recompute="none")
        for k, (a, b) in enumerate(stages)])


class _Cluster:
    def bandwidth_between(self, a: int, b: int) -> float:
        return 1e30


def test_simulator_charges_the_profiled_parts() -> None:
    # two stages of two layers: the profiled parts add up per stage, B costs their input parts, W
    # their weight parts; a layer without them falls back to the fixed shares of its backward
    layers = (ChainLayer("a", "x", 1.0, 2.0, 0.0, 0.0, input_grad_s=0.5, weight_grad_s=1.5),
              ChainLayer("b", "x", 1.0, 2.0, 0.0, 0.0, input_grad_s=1.0, weight_grad_s=1.0),
              ChainLayer("c", "x", 1.0, 3.0, 0.0, 0.0),
              ChainLayer("d", "x", 2.0, 1.0, 0.0, 0.0, input_grad_s=1.0, weight_grad_s=0.0))
    chain = Chain(layers=layers, cut_bytes=(0.0, 0.0, 0.0), batch_size=1)
    got = simulate_plan(_plan([(0, 1), (2, 3)]), chain, _Cluster(), "zb-h1", 4)
    want = simulate_schedule("zb-h1", [1, 1], 4, forward_s=[2.0, 3.0], backward_s=[4.0, 4.0],
                             input_grad_s=[1.5, 3.0 * INPUT_GRAD_SHARE + 1.0],
                             weight_grad_s=[2.5, 3.0 * WEIGHT_GRAD_SHARE + 0.0])
    assert got.makespan_s == pytest.approx(want.makespan_s)
    durations = {e.name: e.end_s - e.start_s for e in got.events}
    assert durations["0B0"] == pytest.approx(1.5) and durations["0W0"] == pytest.approx(2.5)
    assert durations["1B0"] == pytest.approx(3.0 * INPUT_GRAD_SHARE + 1.0)


def test_an_exported_graphs_backward_is_charged_whole_to_b() -> None:
    """A graph whose ops read their weights themselves (torch.export's; here fx over F.linear on the module's own
    parameters) runs each split backward whole (runtime WeightPass.walks_whole_graph): annotate-costs charges those
    nodes' backward to B and nothing to W; a graph of called submodules keeps its split parts."""
    import torch.fx as fx
    from torch.nn import functional as F
    from test_weight_grads import RootOnly

    from pdcompile.passes.annotate_costs import annotate_costs, reads_params_itself

    x = torch.randn(8, 6)
    root = fx.symbolic_trace(RootOnly())
    owned = fx.symbolic_trace(nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8)))
    linears = [n for n in root.graph.nodes if n.op == "call_function" and n.target is F.linear]
    assert reads_params_itself(root, list(root.graph.nodes)) == linears
    assert reads_params_itself(owned, list(owned.graph.nodes)) == []
    for gm, whole in ((root, True), (owned, False)):
        annotate_costs(gm, (x,), mode="analytic")
        for n in gm.graph.nodes:
            c = n.meta.get("pd.cost")
            if c is None or c.param_bytes == 0:
                continue
            assert c.backward_s > 0
            if whole:
                assert (c.input_grad_s, c.weight_grad_s) == (c.backward_s, 0.0)
            else:
                assert c.input_grad_s < c.backward_s and c.weight_grad_s > 0  # the first's input needs none
