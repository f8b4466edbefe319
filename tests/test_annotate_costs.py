"""Tests of the annotate-costs pass: hand-computed FLOPs, real bytes, symbolic sizes, profiles."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdcompile.errors import ProfileError
from pdcompile.ir import meta_bytes
from pdcompile.passes.annotate_costs import (
    DeviceSpec,
    NodeCost,
    annotate_costs,
    profile_from_graph,
    profile_model,
    rnn_flops,
)
from pdcompile.passes.linearize import linearize
from pdcompile.passes.propagate_shapes import propagate_shapes
from pdcompile.passes.trace import trace
from pdcompile.zoo import get, names

pytestmark = pytest.mark.timeout(120)


def annotated(model: nn.Module, *inputs: torch.Tensor, **kw) -> torch.fx.GraphModule:
    gm = trace(model, kw.pop("leaf_modules", ()))
    propagate_shapes(gm, inputs)
    return annotate_costs(gm, inputs, **{"mode": "analytic", **kw})


def cost(gm: torch.fx.GraphModule, name: str) -> NodeCost:
    return next(n for n in gm.graph.nodes if n.name == name).meta["pd.cost"]


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 40)
        self.fc2 = nn.Linear(40, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_linear_flops_hand_computed() -> None:
    B = 6
    gm = annotated(TwoLinear(), torch.randn(B, 24))
    fc1, fc2 = cost(gm, "fc1"), cost(gm, "fc2")
    assert fc1.forward_flops == pytest.approx(2 * B * 24 * 40, rel=0.01)
    # fc1 reads the model input (no gradient needed): only the weight gradient
    assert fc1.backward_flops == pytest.approx(2 * B * 24 * 40, rel=0.01)
    assert fc2.forward_flops == pytest.approx(2 * B * 40 * 16, rel=0.01)
    # fc2: gradient of its input and of its weight
    assert fc2.backward_flops == pytest.approx(2 * 2 * B * 40 * 16, rel=0.01)
    assert fc1.param_bytes == (24 * 40 + 40) * 4
    assert fc1.output_bytes == B * 40 * 4


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 12, 3, stride=2, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.c1(x))


def test_conv2d_flops_hand_computed() -> None:
    B, H = 2, 10
    gm = annotated(ConvNet(), torch.randn(B, 3, H, H))
    c1, c2 = cost(gm, "c1"), cost(gm, "c2")
    f1 = 2 * B * 8 * H * H * 3 * 9
    ho = (H - 3) // 2 + 1
    f2 = 2 * B * 12 * ho * ho * (8 // 2) * 9
    assert c1.forward_flops == pytest.approx(f1, rel=0.01)
    assert c1.backward_flops == pytest.approx(f1, rel=0.01)  # weight grad only
    assert c2.forward_flops == pytest.approx(f2, rel=0.01)
    assert c2.backward_flops == pytest.approx(2 * f2, rel=0.01)  # input and weight grads


class Attention(nn.Module):
    def __init__(self, heads: int, d: int) -> None:
        super().__init__()
        self.heads, self.d = heads, d
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(self.d, dim=2)
        hd = self.d // self.heads
        q = q.reshape(x.shape[0], -1, self.heads, hd).transpose(1, 2)
        k = k.reshape(x.shape[0], -1, self.heads, hd).transpose(1, 2)
        v = v.reshape(x.shape[0], -1, self.heads, hd).transpose(1, 2)
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)), dim=-1)
        return torch.matmul(att, v)


def test_matmul_attention_flops_hand_computed() -> None:
    B, T, H, d = 3, 7, 2, 16
    gm = annotated(Attention(H, d), torch.randn(B, T, d), symbolic=False)
    mms = [n.meta["pd.cost"] for n in gm.graph.nodes if n.target is torch.matmul]
    assert len(mms) == 2
    per = 2 * B * H * T * T * (d // H)
    for c in mms:
        assert c.forward_flops == pytest.approx(per, rel=0.01)
        assert c.backward_flops == pytest.approx(2 * per, rel=0.01)  # both operands need grads


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(5, 12)
        self.rnn = nn.LSTM(12, 20, num_layers=2, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.emb(x))[0]


def test_lstm_leaf_flops_hand_computed() -> None:
    B, T, I, Hd = 4, 6, 12, 20
    gm = annotated(LSTMNet(), torch.randn(B, T, 5))
    c = cost(gm, "rnn")
    # two matmuls per step, gate, layer and direction; layer 2 reads both directions (2H)
    hand = 2 * T * (2 * B * 4 * Hd * (I + Hd)) + 2 * T * (2 * B * 4 * Hd * (2 * Hd + Hd))
    assert c.forward_flops == pytest.approx(hand, rel=0.01)
    assert c.backward_flops == pytest.approx(2 * hand, rel=0.01)
    assert rnn_flops(nn.GRU(3, 5), (7, 2, 3)) == 7 * 2 * 2 * 3 * 5 * (3 + 5)
    # output is (out, (h, c)): all of it counted once, from the real shapes
    assert c.output_bytes == 4 * (B * T * 2 * Hd + 2 * (4 * B * Hd))


def test_real_dtypes_not_4_bytes_per_element() -> None:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.to(torch.float16) * 2
            return torch.argmax(h, dim=1)

    x = torch.randn(5, 9)
    gm = annotated(M(), x)
    by_name = {n.name: n.meta["pd.cost"].output_bytes for n in gm.graph.nodes}
    assert by_name["to"] == 5 * 9 * 2
    assert by_name["argmax"] == 5 * 8
    assert by_name["x"] == 5 * 9 * 4


def test_analytic_is_deterministic_and_uses_device_spec() -> None:
    x = torch.randn(6, 24)
    spec = DeviceSpec("toy", peak_flops=1e9, efficiency=1.0)
    a = profile_model(TwoLinear(), (x,), mode="analytic", device_spec=spec)
    b = profile_model(TwoLinear(), (x,), mode="analytic", device_spec=spec)
    assert a.layers == b.layers
    fc2 = a.layer("fc2")
    assert fc2.forward_s == pytest.approx(fc2.forward_flops / 1e9)
    assert a.device == "analytic:toy"


def test_measured_times_and_no_side_effects() -> None:
    torch.manual_seed(0)
    model = TwoLinear()
    x = torch.randn(512, 24)  # each module's backward well above the call's fixed cost, which is taken off
    before = model(x)
    gm = trace(model)
    annotate_costs(gm, (x,), mode="measured", warmup=1, repeats=3, symbolic=False)
    for n in gm.graph.nodes:
        c = n.meta["pd.cost"]
        assert isinstance(c, NodeCost)
        assert c.forward_s >= 0 and c.backward_s >= 0
        if n.op == "call_module":
            assert c.forward_s > 0 and c.backward_s > 0
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(gm(x), before)


def test_optimizer_state_and_tied_parameters_once() -> None:
    z = get("gpt", size="small", batch_size=2)
    p = profile_model(z.model, z.example_inputs, mode="analytic", leaf_modules=z.leaf_modules,
                      optimizer="adam", symbolic=False)
    model_param_bytes = sum(t.numel() * t.element_size() for t in z.model.parameters())
    model_buffer_bytes = sum(t.numel() * t.element_size() for t in z.model.buffers())
    assert p.param_bytes == model_param_bytes  # the tied lm_head/wte weight counted once
    assert sum(l.buffer_bytes for l in p.layers) == model_buffer_bytes  # get_attr buffers folded
    assert p.optimizer_state_bytes() == 2 * model_param_bytes


def test_profile_from_graph_structure() -> None:
    x = torch.randn(4, 24)
    gm = annotated(TwoLinear(), x)
    prof = profile_from_graph(gm, batch_size=4, device="cpu")
    assert [l.name for l in prof.layers] == ["fc1", "relu", "fc2"]
    assert [i.name for i in prof.inputs] == ["x"]
    assert prof.layer("relu").inputs == ("fc1",)
    assert prof.layer("fc1").inputs == ("x",)
    assert prof.outputs == ("fc2",)
    chain = linearize(prof)
    assert chain.cut_bytes == (4 * 40 * 4, 4 * 40 * 4)


@pytest.mark.parametrize("name", names())
def test_symbolic_sizes_exact_at_unfitted_batch(name: str) -> None:
    z = get(name, size="small", batch_size=4)
    prof = profile_model(z.model, z.example_inputs, mode="analytic", leaf_modules=z.leaf_modules)
    b = 7  # not among the fit (2, 3) or check (4, 5) sizes
    inputs7, _ = z.make_batch(0, b)
    gm = trace(z.model, z.leaf_modules)
    propagate_shapes(gm, inputs7)
    truth = {n.name: meta_bytes(n.meta["pd.tensor"]) for n in gm.graph.nodes}
    for layer in prof.layers:
        assert layer.output_bytes_expr is not None, layer.name
        assert not layer.symbolic_note, (layer.name, layer.symbolic_note)
    at7 = prof.at_batch_size(b)
    for layer in at7.layers:
        assert layer.output_bytes == truth[layer.name], layer.name
    for inp in at7.inputs:
        assert inp.output_bytes == truth[inp.name]
    # FLOPs expressions against FLOPs counted at b = 7
    gm7 = trace(z.model, z.leaf_modules)
    annotate_costs(gm7, inputs7, mode="analytic", symbolic=False)
    for n in gm7.graph.nodes:
        if n.op.startswith("call"):
            lay = at7.layer(n.name)
            assert lay.forward_flops == n.meta["pd.cost"].forward_flops, n.name
            assert lay.backward_flops == n.meta["pd.cost"].backward_flops, n.name


def test_non_affine_node_keeps_a_table() -> None:
    class Outer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = x.flatten()
            return torch.outer(f, f)  # (b*3)^2 elements: quadratic in b

    prof = profile_model(Outer(), (torch.randn(4, 3),), mode="analytic")
    outer = prof.layer("outer")
    assert "not affine" in outer.symbolic_note
    assert prof.at_batch_size(5).layer("outer").output_bytes == 4 * (5 * 3) ** 2
    assert prof.layer("flatten").symbolic_note == ""
    with pytest.raises(ProfileError, match="b=11"):
        prof.at_batch_size(11)
    assert prof.at_batch_size(3).layer("outer").output_bytes == 4 * (3 * 3) ** 2


def test_measured_inplace_and_tuple_outputs() -> None:
    torch.manual_seed(0)
    # wide enough that the in-place ReLU's backward stands well above the call's fixed cost
    model = nn.Sequential(nn.Linear(6, 512), nn.ReLU(inplace=True), nn.Linear(512, 2))
    x = torch.randn(1024, 6)
    before = model(x).detach()
    prof = profile_model(model, (x,), mode="measured", repeats=2, warmup=1, symbolic=False)
    assert prof.layer("_1").op == "ReLU" and prof.layer("_1").backward_s > 0
    assert torch.equal(model(x), before)
    z = get("gnmt", size="small", batch_size=2)
    prof = profile_model(z.model, z.example_inputs, mode="measured", leaf_modules=z.leaf_modules,
                         repeats=1, warmup=1, symbolic=False)
    lstms = [l for l in prof.layers if l.op == "LSTM"]
    assert lstms and all(l.forward_s > 0 and l.backward_s > 0 for l in lstms)
    assert all(p.grad is None for p in z.model.parameters())


def test_backward_call_overhead_is_the_fixed_part(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcompile.passes.costs import measure as ac

    # a call costs fixed + n * per_node: 1 node 20 us, 11 nodes 60 us -> per node 4 us, fixed 16 us
    monkeypatch.setattr(ac, "_interleaved_medians", lambda fns, *a, **k: {1: 20e-6, 11: 60e-6})
    assert ac.backward_call_overhead(torch.device("cpu")) == pytest.approx(16e-6)
    monkeypatch.undo()
    real = ac.backward_call_overhead(torch.device("cpu"), warmup=5, repeats=5)
    assert 0 < real < 1e-3  # an autograd.grad call's start-up: microseconds, not milliseconds


def test_visit_medians_ignore_a_burst_that_covers_one_visit(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcompile.passes.costs import measure as ac

    calls: dict[str, int] = {"a": 0, "b": 0}
    # node "a" is hit by a burst (10x slower) during its whole first visit; "b" never
    samples = {"a": iter([10.0] * 3 + [1.0, 1.1, 0.9] + [1.2, 1.0, 1.0]), "b": iter([2.0, 2.1, 1.9] * 3)}
    monkeypatch.setattr(ac, "_calibrate", lambda fn, device, warmup: 1)
    monkeypatch.setattr(ac, "_sample", lambda fn, device, number: next(samples[fn.__name__]))

    def a() -> None:
        calls["a"] += 1

    def b() -> None:
        calls["b"] += 1

    got = ac._visit_medians({"a": a, "b": b, "none": None}, torch.device("cpu"), warmup=1, repeats=9)
    assert got == {"a": 1.0, "b": 2.0, "none": 0.0}
    assert calls == {"a": 3, "b": 3}  # one untimed warm call per visit
