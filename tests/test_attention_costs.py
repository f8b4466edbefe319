"""An attention written out in the cost model (issue 36): its batched matmuls (``bmm``), softmax (``softmax``),
``masked_fill`` (``masked``) and GELU's tanh approximation (``gelu_tanh``) are op classes of their own, probed by the
calibration at the sizes models use (``calibrate.kernel_samples``), and charged as their fits say."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdcompile.passes.costs.opclass import OP_CLASSES, OpCost, OpCostTable, op_class

NEW = ("bmm", "softmax", "masked", "gelu_tanh")


def _gpt_graph(frontend: str) -> Any:
    from pdcompile.passes.propagate_shapes import propagate_shapes
    from pdcompile.passes.trace import trace_any
    from pdcompile.zoo import gpt

    torch.manual_seed(0)
    cfg = gpt.CONFIGS["small"]
    model = gpt.GPT(cfg)
    (x,), _ = gpt.make_batch(cfg, torch.device("cpu"), 0, 2)
    gm = trace_any(model, (x,), frontend=frontend)
    return propagate_shapes(gm, (x,)), cfg


def _expected(node: Any, gm: Any) -> str | None:
    """The class an attention's node should get, read independently of the classifier: from the op's own name as the
    graph prints it (``node.format_node()``: the target and its keyword arguments) and, for a module, the module
    object; None for nodes outside the attention and the GELU."""
    printed = node.format_node()  # "%name : [...] = call_function[target=torch.matmul](args = (...), kwargs = {...})"
    text = printed.split("target=", 1)[1].split("]", 1)[0] + printed.split("kwargs =", 1)[1]  # the op and keywords
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        return "gelu_tanh" if isinstance(mod, nn.GELU) and mod.approximate == "tanh" else None
    if "softmax" in text:
        return "softmax"
    if "masked_fill" in text:
        return "masked"
    if "gelu" in text:
        return "gelu_tanh" if "approximate: tanh" in text or "approximate = tanh" in text else "elementwise"
    if "matmul" in text or "bmm" in text:
        ranks = [len(a.meta["pd.tensor"].shape) for a in node.args[:2]]
        return "bmm" if min(ranks) >= 3 else "matmul"
    return None


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_the_gpts_attention_nodes_get_their_own_classes(frontend: str) -> None:
    """The zoo GPT (2 blocks) traced by torch.fx and by torch.export (ATen overloads): every ``q @ k^T`` and
    ``scores @ v`` is ``bmm``, every softmax ``softmax``, every masked_fill ``masked``, every tanh GELU ``gelu_tanh``,
    as read off the graph's own op names; and each block has one softmax, one masked_fill, one GELU and two batched
    matmuls."""
    gm, cfg = _gpt_graph(frontend)
    got: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        want = _expected(node, gm)
        if want is None:
            assert op_class(node, gm) not in NEW, node.format_node()
            continue
        assert op_class(node, gm) == want, node.format_node()
        got[want] = got.get(want, 0) + 1
    n = cfg.n_layers
    assert got == {"bmm": 2 * n, "softmax": n, "masked": n, "gelu_tanh": n}


def test_other_spellings_are_classified_alike() -> None:
    """``F.gelu(approximate="tanh")`` is ``gelu_tanh``, the exact GELU (module or function) stays elementwise;
    ``nn.Softmax`` and ``log_softmax`` are ``softmax``; a batched operand times a weight matrix stays matmul."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sm = nn.Softmax(dim=-1)
            self.exact = nn.GELU()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = F.gelu(x, approximate="tanh") + F.gelu(x) + self.exact(x)
            return self.sm(a).log_softmax(-1) @ self.w

    from pdcompile.passes.propagate_shapes import propagate_shapes
    from pdcompile.passes.trace import trace_any

    x = torch.randn(2, 3, 4)
    gm = propagate_shapes(trace_any(M(), (x,), frontend="fx"), (x,))
    classes = [op_class(n, gm) for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]
    assert classes == ["gelu_tanh", "elementwise", "elementwise", "elementwise", "elementwise", "softmax", "softmax",
                       "matmul"]


def _bytes(*tensors: torch.Tensor) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors))


def test_the_attention_probes_fit_recovers_known_rates_through_a_slow_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a fake machine where each probe of the new classes costs ``alpha + bytes / rate`` forward and
    ``beta + 2 bytes / rate_b`` backward, its bytes those of the tensors the probe's op reads and writes (counted here
    from the call itself, not the probe's own figure), ``kernel_samples`` and ``fit_op_costs`` recover all four per
    class though one of three rounds ran 3x slow; and each probe's declared work is those bytes."""
    from pdcompile import calibrate

    truth = {"softmax": (4e-6, 12e9, 12e-6, 30e9), "masked": (3e-6, 7e9, 15e-6, 12e9),
             "gelu_tanh": (4e-6, 4.4e9, 14e-6, 7.6e9), "bmm": (7e-6, 10e9, 38e-6, 13e9)}
    cases = [c for c in calibrate.kernel_cases() if c[0] in NEW]
    assert {c[0] for c in cases} == set(NEW)
    assert len(cases) == 2 * len(calibrate.SCORES_PROBES) + len(calibrate.GELU_PROBES) + 2 * len(calibrate.BMM_PROBES)
    cls_of = {id(c[1]): c[0] for c in cases}  # each probe's class by its op (a probe's input may serve two)
    for cls, mod, x, work in cases:
        xs = x if isinstance(x, tuple) else (x,)
        with torch.no_grad():
            out = mod(*xs)
        # masked_fill reads its (tokens x tokens) bool mask beside the scores, as annotate-costs counts its arguments
        mask = out.shape[-1] * out.shape[-2] if cls == "masked" else 0
        assert work == pytest.approx(_bytes(*xs, out) + mask), cls
    calls = {"n": 0}

    def fake(fns: dict[str, Any], repeats: int, quantile: float = 0.5) -> dict[str, float]:
        mod, xs = fns["f"].__defaults__
        with torch.no_grad():
            out = mod(*xs)
        cls = cls_of[id(mod)]
        nbytes = _bytes(*xs, out) + (out.shape[-1] * out.shape[-2] if cls == "masked" else 0)
        a, r, b, rb = truth[cls]
        slow = 3.0 if calls["n"] // len(cases) == 1 else 1.0
        calls["n"] += 1
        f = a + nbytes / r
        return {"f": slow * f, "fb": slow * (f + b + 2 * nbytes / rb)}

    monkeypatch.setattr(calibrate, "_low_times", fake)
    table = calibrate.fit_op_costs(calibrate.kernel_samples(repeats=1, rounds=3, cases=cases), "test")
    assert calls["n"] == 3 * len(cases)
    for cls, (a, r, b, rb) in truth.items():
        assert (table.forward[cls].alpha_s, table.forward[cls].rate) == pytest.approx((a, r), rel=1e-6), cls
        assert (table.backward[cls].alpha_s, table.backward[cls].rate) == pytest.approx((b, rb), rel=1e-6), cls


def test_a_node_of_each_new_class_costs_what_the_table_says() -> None:
    """annotate-costs (calibrated) charges a node of each new class its class's ``alpha + bytes / rate`` plus the
    per-node overhead, forward and backward (``2 x bytes``), bytes being its inputs' and output's as counted here from
    the shapes."""
    from pdcompile.passes.annotate_costs import annotate_costs
    from pdcompile.passes.costs.roofline import device_spec_for
    from pdcompile.passes.trace import trace_any

    b, h, t, d = 2, 3, 8, 4
    mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", mask)
            self.act = nn.GELU(approximate="tanh")
            self.w = nn.Parameter(torch.ones(d))  # every node after it needs a gradient: each has a backward

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q, k, v = q * self.w, k * self.w, v * self.w
            s = torch.matmul(q, k.transpose(-2, -1))
            s = s.masked_fill(self.get_buffer("mask"), float("-inf"))
            p = torch.softmax(s, dim=-1)
            return self.act(torch.matmul(p, v))

    fwd = {c: OpCost(1e-6 * (i + 1), 1e9 * (i + 1)) for i, c in enumerate(OP_CLASSES)}
    bwd = {c: OpCost(3e-6 * (i + 1), 2e9 * (i + 1)) for i, c in enumerate(OP_CLASSES)}
    table = OpCostTable(fwd, bwd, "synthetic", node_s=(5e-7, 7e-7))
    spec = device_spec_for(None).calibrated(table)
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    gm = trace_any(Attn(), (q, k, v), frontend="fx")
    annotate_costs(gm, (q, k, v), mode="analytic", device_spec=spec, symbolic=False, progress=False)
    score, hd = 4.0 * b * h * t * t, 4.0 * b * h * t * d
    io = {"bmm": [2 * hd + score, score + 2 * hd], "masked": [2 * score + t * t], "softmax": [2 * score],
          "gelu_tanh": [2 * hd]}
    seen: dict[str, int] = {}
    for node in gm.graph.nodes:
        cls = op_class(node, gm) if node.op in ("call_module", "call_function", "call_method") else None
        if cls not in io:
            continue
        nbytes = io[cls][seen.get(cls, 0)]
        seen[cls] = seen.get(cls, 0) + 1
        c = node.meta["pd.cost"]
        assert c.forward_s == pytest.approx(fwd[cls].alpha_s + nbytes / fwd[cls].rate + 5e-7, rel=1e-9), cls
        assert c.backward_s == pytest.approx(bwd[cls].alpha_s + 2 * nbytes / bwd[cls].rate + 7e-7, rel=1e-9), cls
    assert seen == {"bmm": 2, "masked": 1, "softmax": 1, "gelu_tanh": 1}


def test_a_calibration_from_before_the_new_classes_charges_them_as_it_did() -> None:
    """A cached table without the new classes (``from_dict`` of an older calibration) charges the elementwise kinds
    as elementwise, as that calibration's code did (their work is bytes alike); a batched matmul it did not fit (its
    work bytes, attention's FLOPs) is left to the roofline; a table that has them keeps its own."""
    old = {"source": "old", "forward": {"elementwise": [1e-6, 5e10], "attention": [1e-5, 3e10]},
           "backward": {"elementwise": [4e-6, 7e11], "attention": [2e-5, 4e10]}}
    table = OpCostTable.from_dict(old)
    for part, src in ((table.forward, old["forward"]), (table.backward, old["backward"])):
        for cls in ("softmax", "masked", "gelu_tanh"):
            assert part[cls] == OpCost(*src["elementwise"])
        assert "bmm" not in part
    mine = OpCostTable.from_dict({**old, "forward": {**old["forward"], "softmax": [2e-6, 1e10]}})
    assert mine.forward["softmax"] == OpCost(2e-6, 1e10) and mine.forward["masked"] == OpCost(1e-6, 5e10)
    assert OpCostTable.from_dict(table.to_dict()) == table
