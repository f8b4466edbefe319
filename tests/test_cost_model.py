"""The cost model that predicts before the run (issue 36, items 1 and 3): a fixed cost plus a rate per op
class, fitted by the calibration and read by ``cost_mode="auto"``; core contention on a local CPU cluster;
``explain()`` naming the cost mode and the calibration it used."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from pdcompile import machine_cache
from pdcompile.cluster import ClusterSpec, Device, Level, local_cpu_cluster
from pdcompile.passes.costs.opclass import (OP_CLASSES, OpCost, OpCostTable, fit_node_overhead, fit_op_cost,
                                            op_class_of_name)
from pdcompile.passes.costs.roofline import DEVICE_SPECS, contention

pytestmark = pytest.mark.timeout(180)


# -- the fit, a pure function on arrays -------------------------------------------------------------

def test_fit_recovers_alpha_and_rate_from_synthetic_timings() -> None:
    rng = np.random.default_rng(0)
    work = np.geomspace(1e3, 1e8, 12)
    alpha, rate = 25e-6, 3e10
    exact = alpha + work / rate
    fit = fit_op_cost(work, exact)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6) and fit.rate == pytest.approx(rate, rel=1e-6)
    # 3% noise everywhere and two timings a busy machine tripled: still within 10% (trimmed refit)
    noisy = exact * rng.normal(1.0, 0.03, len(work))
    noisy[[3, 8]] *= 3.0
    fit = fit_op_cost(work, noisy)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.1) and fit.rate == pytest.approx(rate, rel=0.1)
    # timings with no fixed part: alpha clamps to 0, the rate through the origin
    fit = fit_op_cost(work, work / rate)
    assert fit.alpha_s == 0.0 and fit.rate == pytest.approx(rate, rel=1e-6)


def test_fit_refuses_what_it_cannot_fit() -> None:
    from pdcompile.errors import UsageError

    with pytest.raises(UsageError, match="two distinct works"):
        fit_op_cost([5.0, 5.0], [1e-5, 1e-5])
    with pytest.raises(UsageError, match="positive"):
        fit_op_cost([1.0, 2.0], [0.0, 1e-5])


def test_op_classes_of_the_ops_that_matter() -> None:
    assert [op_class_of_name(n, module=True) for n in
            ("Linear", "Conv2d", "MultiheadAttention", "LayerNorm", "GELU", "Embedding", "CrossEntropyLoss",
             "MaxPool2d", "AdaptiveAvgPool2d", "BertPooler")] == \
        ["matmul", "conv", "attention", "norm", "elementwise", "embedding", "loss", "pool", "pool", "elementwise"]
    assert [op_class_of_name(n) for n in ("linear", "conv1d", "scaled_dot_product_attention", "group_norm", "add",
                                          "embedding", "cross_entropy", "getitem", "view", "max_pool2d",
                                          "adaptive_avg_pool1d")] == \
        ["matmul", "conv", "attention", "norm", "elementwise", "embedding", "loss", "view", "view", "pool", "pool"]


def test_node_overhead_fit_recovers_the_line_from_synthetic_timings() -> None:
    """The calibration's per-node overhead: whole probe models' time beyond their ops at several node
    counts is ``fixed + nodes x per_node``; the fit recovers both, and a timing a busy machine inflated
    (one call preempted) moves neither (the median of pairwise slopes)."""
    from pdcompile.calibrate import fit_node_samples

    nodes = np.array([34, 34, 34, 88, 88, 88], dtype=float)
    fixed, per_node = 150e-6, 21e-6
    exact = fixed + nodes * per_node
    assert fit_node_overhead(nodes, exact) == pytest.approx((fixed, per_node), rel=1e-9)
    noisy = exact.copy()
    noisy[4] *= 6.0
    assert fit_node_overhead(nodes, noisy) == pytest.approx((fixed, per_node), rel=1e-9)
    assert fit_node_overhead(nodes, np.full(6, 1e-4)) == pytest.approx((1e-4, 0.0))  # no growth: none per node
    # forward and backward each through their own node counts (nodes with a backward: fewer)
    samples = [(int(n), float(fixed + n * per_node), int(n) // 2, float(n // 2 * 40e-6)) for n in nodes]
    assert fit_node_samples(samples) == pytest.approx((per_node, 40e-6), rel=1e-9)
    from pdcompile.errors import UsageError

    with pytest.raises(UsageError, match="two distinct node counts"):
        fit_node_overhead([5, 5], [1e-5, 2e-5])


def test_node_overhead_fit_is_the_same_on_a_loaded_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op-class probes and the whole models the per-node overhead is fitted from are timed on one clock (this
    thread's CPU time), so a load that stretches every call's wall time by the same factor leaves the fitted
    per-node cost where it is. A fake machine: each op costs ``c`` of CPU and ``LOAD x c`` of wall time (preempted
    the rest); a model of ``n`` nodes costs its ops plus ``n x per_node``. Timed wall-clock (the old probes) the
    ops come out ``LOAD`` times dearer and the fit would be left negative (clamped to 0), not ``per_node``."""
    import time as time_mod

    from pdcompile import calibrate
    from pdcompile.passes.costs import measure

    LOAD, per_node = 3.0, 20e-6
    clock = {"cpu": 0.0, "wall": 0.0}

    def spend(c: float) -> None:
        clock["cpu"] += c
        clock["wall"] += LOAD * c

    monkeypatch.setattr(time_mod, "thread_time", lambda: clock["cpu"])
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock["wall"])
    ops = {"matmul": 30e-6, "norm": 12e-6, "add": 4e-6}
    probes = {k: (lambda c=c: spend(c)) for k, c in ops.items()}
    with measure.thread_clock():
        timed = measure.medians(probes, torch.device("cpu"), warmup=1, repeats=3)
    assert timed == pytest.approx(ops, rel=1e-9)  # CPU time: the load left out
    assert measure.medians(probes, torch.device("cpu"), 1, 3) == pytest.approx({k: LOAD * c for k, c in ops.items()})
    samples = []
    for blocks in (1, 3, 5):  # a block: each op once, each op a node
        n = blocks * len(ops)
        whole = calibrate._low_times({"f": lambda n=n: spend(blocks * sum(ops.values()) + n * per_node)}, 5)["f"]
        samples.append((n, whole - blocks * sum(timed.values()), n, whole - blocks * sum(timed.values())))
    assert calibrate.fit_node_samples(samples) == pytest.approx((per_node, per_node), rel=1e-6)

    seen: list[bool] = []

    class Stop(Exception):
        pass

    def stub(*a: Any, **k: Any) -> None:  # the probes' timing: which clock op_cost_samples times them on
        seen.append(measure._THREAD_CLOCK)
        raise Stop

    monkeypatch.setattr("pdcompile.passes.annotate_costs.annotate_costs", stub)
    monkeypatch.setattr("pdcompile.passes.trace.trace", lambda model: model)  # no tracing: only the clock is asked
    with pytest.raises(Stop):
        calibrate.op_cost_samples(sizes=((1, 8, 32, 4),))
    assert seen == [True] and not measure._THREAD_CLOCK


def test_a_table_survives_its_json() -> None:
    t = OpCostTable({"matmul": OpCost(2e-5, 3e10), "view": OpCost(2e-6, float("inf"))},
                    {"matmul": OpCost(4e-5, 2e10)}, "test", node_s=(2e-5, 3e-5))
    back = OpCostTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back == t
    # a calibration written before the per-node overhead still reads, with none
    old = {k: v for k, v in t.to_dict().items() if k != "node"}
    assert OpCostTable.from_dict(old).node_s == (0.0, 0.0)
    with pytest.raises(ValueError, match="per-node"):
        OpCostTable.from_dict({**t.to_dict(), "node": [-1.0, 0.0]})


# -- the analytic model charges each op's fixed cost ---------------------------------------------------

class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _compile(batch: int, micro: int, **kw: Any) -> Any:
    from pdcompile.api import pdcompile

    torch.manual_seed(0)
    return pdcompile(_Mlp(), kw.pop("cluster", local_cpu_cluster(2)), example_inputs=(torch.randn(batch, 32),),
                     example_target=torch.randint(0, 10, (batch,)), loss_fn=nn.CrossEntropyLoss(),
                     microbatch_size=micro, stages=2, schedule="gpipe", **kw)


def _compute_per_sample(pipe: Any) -> float:
    chain = pipe.state.chain
    return sum(l.forward_s + l.backward_s for l in chain.layers) / pipe.microbatch_size


def test_one_sample_microbatches_cost_more_per_sample_than_48() -> None:
    one, many = _compile(48, 1), _compile(48, 48)
    assert one.cost_source.mode == many.cost_source.mode == "analytic"  # no calibration in the test's cache
    per_one, per_many = _compute_per_sample(one), _compute_per_sample(many)
    # the fixed costs alone: 5 ops forward (3 matmul + 2 elementwise) at the defaults, 1.5x backward
    alphas = dict(DEVICE_SPECS["cpu"].alphas)
    fixed = (3 * alphas["matmul"] + 2 * alphas["elementwise"]) * 2.5
    assert per_one > 2 * per_many
    assert per_one - per_many == pytest.approx(fixed * (1 - 1 / 48), rel=0.05)


class _Chain(nn.Module):
    """A linear, then ``n`` cheap elementwise nodes: a chain whose cost is mostly per node."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        for _ in range(self.n):
            x = x * 1.5
        return x


def test_a_chain_of_n_nodes_is_charged_n_times_the_node_overhead() -> None:
    """With a calibration's per-node overhead ``(f, b)``, a chain of ``n`` nodes that all have a backward
    is predicted dearer by ``n x f`` forward and ``n x b`` backward than with none, whatever their sizes,
    and the whole of it is fixed cost (a microbatch of any size pays it)."""
    from pdcompile.passes.annotate_costs import annotate_costs
    from pdcompile.passes.costs.roofline import device_spec_for
    from pdcompile.passes.trace import trace

    table = OpCostTable({c: OpCost(1e-6, 1e10) for c in OP_CLASSES}, {c: OpCost(2e-6, 1e10) for c in OP_CLASSES},
                        "synthetic")
    f, b = 7e-6, 11e-6

    def totals(n: int, node_s: tuple[float, float]) -> tuple[float, float, float, float]:
        from dataclasses import replace

        gm = trace(_Chain(n))
        spec = device_spec_for(None).calibrated(replace(table, node_s=node_s))
        annotate_costs(gm, (torch.randn(4, 8),), mode="analytic", device_spec=spec, symbolic=False, progress=False)
        costs = [nd.meta["pd.cost"] for nd in gm.graph.nodes if nd.op in ("call_module", "call_function", "call_method")]
        assert len(costs) == n + 1  # the linear and the n products: every one a node with a backward
        return (sum(c.forward_s for c in costs), sum(c.backward_s for c in costs),
                sum(c.forward_fixed_s for c in costs), sum(c.backward_fixed_s for c in costs))

    for n in (3, 40):
        plain, charged = totals(n, (0.0, 0.0)), totals(n, (f, b))
        assert [c - p for c, p in zip(charged, plain)] == pytest.approx([(n + 1) * f, (n + 1) * b] * 2, rel=1e-9)


def test_weights_are_charged_at_the_calibrated_rate_as_fixed_cost() -> None:
    """With a calibration's weight rate ``(wf, wb)``, a Linear's forward costs ``weight bytes / wf`` more and its
    backward ``/ wb`` more than without, all of it fixed cost (a microbatch of any size streams the weights once);
    the ReLU beside it (no weights, not a matmul) nothing more. The rate fit recovers ``wb`` from synthetic
    timings of three weight sizes whatever their FLOP costs, and the table survives its JSON."""
    from dataclasses import replace

    from pdcompile.passes.annotate_costs import annotate_costs
    from pdcompile.passes.costs.opclass import fit_weight_rate
    from pdcompile.passes.costs.roofline import device_spec_for
    from pdcompile.passes.trace import trace

    table = OpCostTable({c: OpCost(1e-6, 1e10) for c in OP_CLASSES}, {c: OpCost(2e-6, 1e10) for c in OP_CLASSES},
                        "synthetic")
    wf, wb = 8e9, 2e9
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
    weight_bytes = (64 * 32 + 32) * 4

    def costs(t: OpCostTable) -> list[Any]:
        gm = trace(model)
        annotate_costs(gm, (torch.randn(4, 64),), mode="analytic", device_spec=device_spec_for(None).calibrated(t),
                       symbolic=False, progress=False)
        return [nd.meta["pd.cost"] for nd in gm.graph.nodes if nd.op == "call_module"]

    (lin0, relu0), (lin1, relu1) = costs(table), costs(replace(table, weight_rate=(wf, wb)))
    assert lin1.forward_s - lin0.forward_s == pytest.approx(weight_bytes / wf, rel=1e-9)
    assert lin1.backward_s - lin0.backward_s == pytest.approx(weight_bytes / wb, rel=1e-9)
    assert lin1.forward_fixed_s - lin0.forward_fixed_s == pytest.approx(weight_bytes / wf, rel=1e-9)
    assert lin1.backward_fixed_s - lin0.backward_fixed_s == pytest.approx(weight_bytes / wb, rel=1e-9)
    assert (relu1.forward_s, relu1.backward_s) == (relu0.forward_s, relu0.backward_s)
    # a split backward's weight pass: its cost per parameter tensor (the Linear's weight and bias) on W alone
    (lin2, relu2) = costs(replace(table, w_param_s=5e-5))
    assert lin2.weight_grad_s - lin0.weight_grad_s == pytest.approx(2 * 5e-5, rel=1e-9)
    assert (lin2.input_grad_s, lin2.backward_s, relu2.weight_grad_s) == \
        (lin0.input_grad_s, lin0.backward_s, relu0.weight_grad_s)
    sizes, flop_s = [1e6, 4e6, 8e6], [3e-5, 2e-4, 1e-4]
    assert fit_weight_rate(sizes, [f + n / wb for n, f in zip(sizes, flop_s)], flop_s) == pytest.approx(wb, rel=1e-9)
    assert fit_weight_rate(sizes, flop_s, flop_s) == 0.0  # nothing beyond the FLOPs: nothing to charge
    t = replace(table, weight_rate=(wf, wb), w_param_s=5e-5)
    assert OpCostTable.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    assert OpCostTable.from_dict({k: v for k, v in t.to_dict().items() if k != "weight"}).weight_rate == (0.0, 0.0)


# -- the runtime's all-reduce, calibrated --------------------------------------------------------------

def test_the_all_reduce_fit_recovers_its_fixed_cost_and_rate() -> None:
    """``fit_collective`` through synthetic timings ``fixed + bytes / rate`` at the link probe's sizes (4 KiB -
    16 MiB) recovers both; timings through the origin give no fixed cost; one size cannot be fitted."""
    from pdcompile.calibrate import fit_collective

    sizes = [4 << 10, 64 << 10, 512 << 10, 4 << 20, 16 << 20]
    fixed, rate = 6e-4, 7.5e8
    assert fit_collective([(n, fixed + n / rate) for n in sizes]) == pytest.approx((fixed, rate), rel=1e-9)
    f0, r0 = fit_collective([(n, n / rate) for n in sizes])
    assert f0 == pytest.approx(0.0, abs=1e-12) and r0 == pytest.approx(rate, rel=1e-9)
    with pytest.raises(ValueError, match="2 or more"):
        fit_collective([(4096, 1e-3)])


def test_simulate_charges_the_calibrated_all_reduce() -> None:
    """A data-parallel stage (2 replicas) with ``collective=(fixed, rate)``: its all-reduce lasts ``fixed + p /
    rate`` (the runtime's all-reduce, measured between 2 processes) instead of the ring at the link's ``p /
    bw``, and the flush step grows by the difference; on a link slower than the host's own path (an emulated
    one on one host) the link's ring time is added; with 3 replicas the bytes scale as a ring's, ``4/3``."""
    from pdcompile.simulate import collective_s, simulate_plan

    params = (3e6, 1e6)
    plan, chain, cluster = _two_stage(params, "flush", replicas=(2, 1))  # links at 1 GB/s
    fixed, rate, bw = 2e-3, 5e8, 1e9
    ring = simulate_plan(plan, chain, cluster, "flush", 4, split_backward=False)
    host = simulate_plan(plan, chain, cluster, "flush", 4, split_backward=False, collective=(fixed, rate))

    def ar(res: Any) -> set[float]:
        return {round(e.end_s - e.start_s, 15) for e in res.events if e.name == "0AR"}

    assert ar(ring) == {round(params[0] / bw, 15)}
    assert ar(host) == {round(fixed + params[0] / rate, 15)}
    grown = float(host.step_time_s) - float(ring.step_time_s)
    assert grown == pytest.approx(fixed + params[0] / rate - params[0] / bw, rel=1e-9)
    slow = 1e8  # an emulated 100 MB/s link, slower than the host's 500 MB/s: both paid
    assert collective_s(params[0], 2, slow, 0.0, (fixed, rate)) == pytest.approx(fixed + 3e6 / rate + 3e6 / slow)
    assert collective_s(params[0], 3, bw, 0.0, (fixed, rate)) == pytest.approx(fixed + 4 / 3 * 3e6 / rate)
    assert collective_s(params[0], 1, bw, 0.0, (fixed, rate)) == 0.0  # one replica: no all-reduce


def test_a_local_clusters_simulate_charges_the_calibrated_all_reduce(pdcompile_cache: Path) -> None:
    """On a local CPU cluster with this machine's calibration of the runtime's all-reduce, ``pdcompile()``'s
    ``simulate()`` of a data-parallel plan charges it (``fixed + weight bytes / rate`` per all-reduce), as the
    step search does; a cluster that is not this host does not (the ring at its link)."""
    from pdcompile.api import step_costs

    _write_calibration(pdcompile_cache)
    d = json.loads((pdcompile_cache / "machine-constants.json").read_text())
    fixed, rate = 3e-3, 4e8
    d.update(overhead_s={"F": 1e-4}, collective_fixed_s=fixed, collective_rate=rate)
    (pdcompile_cache / "machine-constants.json").write_text(json.dumps(d))
    torch.manual_seed(0)
    from pdcompile.api import pdcompile

    pipe = pdcompile(_Mlp(), local_cpu_cluster(2), example_inputs=(torch.randn(8, 32),),
                     example_target=torch.randint(0, 10, (8,)), loss_fn=nn.CrossEntropyLoss(),
                     num_microbatches=2, stages=1, replicas=[2], schedule="flush")
    # the fit's fixed part less the probe's gradients' flatten and copy back, charged per tensor (CPU's default:
    # this calibration has none)
    flat = machine_cache.FLATTEN_TENSOR_KEY
    per = pipe.action_cost.seconds[flat] if pipe.action_cost is not None else 0.0
    probe = machine_cache.COLLECTIVE_PROBE_TENSORS * per
    assert pipe.action_cost is not None and pipe.action_cost.collective == pytest.approx((fixed - probe, rate))
    weight_bytes = sum(p.numel() * p.element_size() for p in _Mlp().parameters())
    tensors = sum(1 for _ in _Mlp().parameters())
    ars = {e.end_s - e.start_s for e in pipe.simulate().events if e.name == "0AR"}
    assert ars and all(a == pytest.approx(fixed - probe + weight_bytes / rate + tensors * per, rel=1e-9) for a in ars)
    assert pipe.plan.seconds_per_minibatch == pytest.approx(float(pipe.simulate().step_time_s), rel=1e-12)
    assert f"each all-reduce the runtime's own, calibrated on this host: {(fixed - probe) * 1e3:.2f} ms + bytes / " \
        f"0.4 GB/s" in pipe.explain()
    gpus = ClusterSpec(Device("cpu", memory=80e9), (Level("hosts", 2, 1e9),))  # CPU workers, not this host's
    cost, _, _ = step_costs(gpus, machine_cache.cost_source("auto", False))
    assert cost is not None and cost.collective is None


# -- cost_mode="auto" and explain() ------------------------------------------------------------------

def _write_calibration(folder: Path, node_s: tuple[float, float] = (0.0, 0.0)) -> OpCostTable:
    table = OpCostTable({c: OpCost(1e-3, 1e12) for c in OP_CLASSES}, {c: OpCost(2e-3, 1e12) for c in OP_CLASSES},
                        "python -m pdcompile.calibrate, 2026-12-07 05:00 UTC on testhost", node_s=node_s)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "machine-constants.json").write_text(json.dumps({"key": machine_cache.machine_key(),
                                                               "op_costs": table.to_dict()}))
    return table


def test_auto_reads_this_machines_calibration_and_explain_says_which(pdcompile_cache: Path) -> None:
    before = _compile(8, 4)
    text = before.explain()
    assert "cost_mode=auto -> analytic: no fitted cost per op class for this machine (no calibration at" in text
    assert "fix: python -m pdcompile.calibrate" in text
    assert "default fixed cost per op" in text
    _write_calibration(pdcompile_cache)
    after = _compile(8, 4)
    assert after.cost_source.mode == "analytic" and after.cost_source.table is not None
    text = after.explain()
    assert "cost_mode=auto -> calibrated: python -m pdcompile.calibrate, 2026-12-07 05:00 UTC on testhost" in text
    # every op costs its fitted 1 ms forward and 2 ms backward (the rate makes the work negligible)
    for layer in after.state.chain.layers:
        n = len(layer.members or (layer.name,))
        assert layer.forward_s == pytest.approx(1e-3 * n, rel=1e-3)
    assert "no per-node overhead of a whole stage (calibrated before it" in text
    # with the per-node overhead: each op 1 ms + 0.25 ms forward, and explain() names it
    _write_calibration(pdcompile_cache, node_s=(2.5e-4, 5e-4))
    noded = _compile(8, 4)
    for layer in noded.state.chain.layers:
        n = len(layer.members or (layer.name,))
        assert layer.forward_s == pytest.approx(1.25e-3 * n, rel=1e-3)
    assert "every node 250.0 us forward, 500.0 us backward beyond its op (per-node overhead" in noded.explain()
    # a cluster that is not this host (GPUs) stays analytic, and says why
    gpus = ClusterSpec(Device("H100", memory=80e9, peak_flops=67e12, memory_bandwidth=3.35e12),
                       (Level("gpus", 2, 450e9),))
    remote = _compile(8, 4, cluster=gpus)
    assert remote.cost_source.table is None
    assert "cost_mode=auto -> analytic: the target is not this host" in remote.explain()
    # measured says so too
    assert "cost_mode=measured -> measured" in _compile(8, 4, cost_mode="measured").explain()


def test_calibrated_without_a_calibration_names_the_fix() -> None:
    from pdcompile.errors import UsageError

    with pytest.raises(UsageError, match="python -m pdcompile.calibrate"):
        _compile(8, 4, cost_mode="calibrated")
    with pytest.raises(UsageError, match="cost_mode must be one of"):
        _compile(8, 4, cost_mode="guess")


# -- cores as a resource -----------------------------------------------------------------------------

def test_more_processes_than_cores_are_charged(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdcompile.cluster as cl

    monkeypatch.setattr(cl, "host_cores", lambda: 2)
    two, four = local_cpu_cluster(2), local_cpu_cluster(4)
    assert (two.device.cores, contention(two), contention(four)) == (2, 1.0, 2.0)
    assert ClusterSpec.from_dict(four.to_dict()) == four  # the cores survive the cluster's TOML/dict form
    fair, crowded = _compile(16, 4, cluster=two), _compile(16, 4, cluster=four)
    f, c = (sum(l.forward_s for l in p.state.chain.layers) for p in (fair, crowded))
    assert c == pytest.approx(2.0 * f, rel=1e-9)
    assert "4 processes x 1 thread on 2 cores: every compute time charged x2.00" in crowded.explain()
    assert "cores:" not in fair.explain()


def test_side_by_side_slowdown_is_read_from_the_calibration(pdcompile_cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration's co-running slowdown (two processes computing at once, each on its own core: a
    run's compute against its profile) is read for a local cluster of 2 or more processes and handed to the
    simulator (``CompiledPipeline.corun``), not charged on the chain; a table without it, or one process,
    charges nothing."""
    import pdcompile.cluster as cl
    from pdcompile.calibrate import with_corun
    from pdcompile.passes.annotate_costs import corun

    monkeypatch.setattr(cl, "host_cores", lambda: 2)
    base = _write_calibration(pdcompile_cache)
    table = with_corun(base, 1.5)
    assert OpCostTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table  # survives the cache
    assert with_corun(base, 0.9).corun == {2: 1.0}  # noise never makes company faster
    assert [table.corun_factor(n) for n in (1, 2, 8)] == [1.0, 1.5, 1.5]
    one, two, four = local_cpu_cluster(1), local_cpu_cluster(2), local_cpu_cluster(4)
    assert (corun(one, table), corun(two, table), corun(four, table), corun(two, base), corun(two, None)) == \
        (1.0, 1.5, 1.5, 1.0, 1.0)
    with pytest.raises(ValueError, match="co-running"):
        OpCostTable.from_dict({**table.to_dict(), "corun": {"2": 0.5}})
    plain = _compile(16, 4, cluster=two)
    (pdcompile_cache / "machine-constants.json").write_text(json.dumps({"key": machine_cache.machine_key(),
                                                                        "op_costs": table.to_dict()}))
    slowed, crowded = _compile(16, 4, cluster=two), _compile(16, 4, cluster=four)
    f0, f1, f2 = (sum(l.forward_s for l in p.state.chain.layers) for p in (plain, slowed, crowded))
    # the chain carries time-sharing (4 on 2 cores) only; the side-by-side slowdown goes to the simulator, which
    # charges it while ranks compute together (simulate.shared_cores; tests/test_cores.py)
    assert f1 == pytest.approx(f0, rel=1e-9)
    assert f2 == pytest.approx(2.0 * f0, rel=1e-9)
    assert (plain.corun, slowed.corun, crowded.corun) == ((), ((2, 1.5),), ((2, 1.5),))
    assert "2 processes computing at once each run x1.50 slower than one alone" in slowed.explain()
    assert "side by side" not in plain.explain()


# -- the runtime's own costs: the memory meter off in a timed run -----------------------------------

@pytest.mark.multiproc
def test_metrics_without_the_memory_meter(tmp_path: Path) -> None:
    """``--metrics DIR --no-memory-meter``: step times written, the meter (a hook per saved tensor, which the
    prediction does not charge) never ran, so no stage reports memory."""
    from _ranks import run_ranks

    prog = _compile(8, 4).emit(tmp_path / "program")
    rc, log = run_ranks(prog, 2, ["--steps", "2", "--metrics", str(tmp_path / "m"), "--no-memory-meter",
                                  "--timeout", "60"], timeout=150)
    assert rc == 0, log[-2000:]
    ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / "m").glob("rank_*.json"))]
    assert len(ranks) == 2 and all(len(r["step_times_s"]) == 2 for r in ranks)
    assert all(r["memory"]["total"] == 0 for r in ranks)
    # --pin-cores auto (the default): on 2 cores or more, each rank on its own equal share of this process's cores
    cores = set(os.sched_getaffinity(0))
    mine = [set(r["cpu_affinity"]) for r in ranks]
    if len(cores) >= 2:
        assert mine[0] and not mine[0] & mine[1] and mine[0] | mine[1] <= cores and len(mine[0]) == len(mine[1])
    else:
        assert mine == [cores, cores]
    assert all(r["sched"]["run_s"] > 0 and r["sched"]["wait_s"] >= 0 and r["sched"]["slices"] > 0 for r in ranks)


# -- the optimizer step and weight stashing in simulate() -----------------------------------------------

@pytest.mark.parametrize("make, moved", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 3),  # reads w, g; writes w
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 5),  # + reads and writes the momentum buffer
    (lambda ps: torch.optim.Adam(ps), 7),  # + reads and writes exp_avg and exp_avg_sq
])
def test_the_optimizer_step_streams_what_the_algorithm_reads_and_writes(make: Any, moved: int) -> None:
    """Bytes of one step per weight byte, from the optimizer the user passes (its state measured as the API
    measures it, ``optimizer_state_factor_of``) against the algorithm's own count of tensors read and written."""
    from pdcompile.options import optimizer_state_factor_of
    from pdcompile.passes.costs.roofline import optimizer_step_bytes, optimizer_step_s, weight_copy_s

    factor = optimizer_state_factor_of(make)
    assert optimizer_step_bytes(4e6, factor) == pytest.approx(moved * 4e6)
    assert optimizer_step_s(4e6, factor, 2e9) == pytest.approx(moved * 4e6 / 2e9)
    assert weight_copy_s(4e6, 2e9) == pytest.approx(2 * 4e6 / 2e9)  # a clone reads and writes the weights


def _two_stage(params: tuple[float, float], schedule: str, replicas: tuple[int, int] = (1, 1)) -> tuple[Any, Any, Any]:
    """Two stages of two layers each (forward 1 ms, backward 2 ms per minibatch of 4), with ``params`` bytes
    of weights per stage, on a flat cluster of as many workers as replicas."""
    from pdcompile.ir import Chain, ChainLayer
    from pdcompile.passes.partition_dp import plan_from_assignment

    layers = tuple(ChainLayer(f"l{i}", "linear", 1e-3, 2e-3, 4096.0, params[i // 2] / 2) for i in range(4))
    chain = Chain(layers, (4096.0,) * 3, batch_size=4)
    n0, n1 = replicas
    cluster = ClusterSpec(Device("worker", memory=None), (Level("workers", n0 + n1, 1e9),))
    assignment = [(0, 1, n0, tuple(range(n0))), (2, 3, n1, tuple(range(n0, n0 + n1)))]
    plan = plan_from_assignment(chain, cluster, assignment, schedule=schedule, num_microbatches=4)
    return plan, chain, cluster


@pytest.mark.parametrize("schedule", ["flush", "gpipe", "1f1b", "2bw"])
def test_simulate_charges_each_stages_step_and_the_stash_copies(schedule: str) -> None:
    """With ``update_bandwidth``, every ``ST`` of stage ``s`` lasts ``(3 + 2 f) p_s / bw`` and every copy weight
    stashing makes (runtime/schedules/versions.py ``version_copies``, what runtime/weights.py clones) adds
    ``2 p_s / bw`` to its action: each rank's busy time grows by exactly those terms; under flush, whose ranks
    end on their ``ST``, the step grows to the latest rank's end before its ``ST`` plus that ``ST``."""
    from pdcompile.runtime.schedules import make_schedule, version_copies
    from pdcompile.simulate import simulate_plan

    params, f, bw = (3e6, 1e6), 2.0, 5e9
    plan, chain, cluster = _two_stage(params, schedule)
    kw = dict(num_steps=2, split_backward=False, optimizer_state_factor=f)
    free = simulate_plan(plan, chain, cluster, schedule, 4, **kw)
    paid = simulate_plan(plan, chain, cluster, schedule, 4, update_bandwidth=bw, **kw)
    sched = make_schedule(schedule, [1, 1], 4, num_steps=2, split_backward=False)
    stashed = 0
    for r, acts in sched.items():
        steps = sum(a.kind.value == "ST" for a in acts)
        copies = sum(version_copies(acts))
        stashed += copies
        want = steps * (3 + 2 * f) * params[r] / bw + copies * 2 * params[r] / bw
        assert float(paid.busy[r]) - float(free.busy[r]) == pytest.approx(want, rel=1e-9), (r, steps, copies)
        assert {round(e.end_s - e.start_s, 15) for e in paid.events if e.rank == r and e.name.endswith("ST")} \
            <= {round((3 + 2 * f) * params[r] / bw + 2 * params[r] / bw * c, 15) for c in (0, 1)}
    assert (stashed > 0) == (schedule in ("1f1b", "2bw"))  # GPipe and Flush copy nothing
    if schedule == "flush":
        one = simulate_plan(plan, chain, cluster, schedule, 4, update_bandwidth=bw, split_backward=False,
                            optimizer_state_factor=f)
        before = simulate_plan(plan, chain, cluster, schedule, 4, split_backward=False, optimizer_state_factor=f)
        ends = {e.rank: e.start_s for e in before.events if e.name.endswith("ST")}
        assert float(one.step_time_s) == pytest.approx(
            max(float(ends[r]) + (3 + 2 * f) * params[r] / bw for r in ends), rel=1e-12)


def test_sharded_replicas_step_their_share_and_no_bandwidth_charges_nothing() -> None:
    """A replicated stage whose replicas shard their state steps ``1 / replicas`` of its weights each; an
    infinite bandwidth (a spec that ignores memory traffic) and none given charge nothing."""
    from pdcompile.simulate import simulate_plan, stage_step_s

    assert stage_step_s(6e6, 3, "optimizer", 2.0, 1e9) == pytest.approx(7 * 2e6 / 1e9)
    assert stage_step_s(6e6, 3, "none", 2.0, 1e9) == pytest.approx(7 * 6e6 / 1e9)
    assert stage_step_s(6e6, 1, "full", 2.0, 1e9) == pytest.approx(7 * 6e6 / 1e9)
    plan, chain, cluster = _two_stage((3e6, 1e6), "flush", replicas=(2, 1))
    base = float(simulate_plan(plan, chain, cluster, "flush", 4).step_time_s)
    assert float(simulate_plan(plan, chain, cluster, "flush", 4, update_bandwidth=math.inf).step_time_s) == base
    assert float(simulate_plan(plan, chain, cluster, "flush", 4, update_bandwidth=1e9).step_time_s) > base


def test_a_compiled_pipelines_simulate_charges_the_users_optimizer(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``simulate()`` of a compiled 2-stage pipeline with Adam: each stage's ``ST`` lasts 7 x its weights' bytes
    at the CPU's streamed bandwidth (the roofline's memory bandwidth x efficiency), and the plan's headline,
    the step search's objective, is that simulate()."""
    from pdcompile.passes.costs.roofline import DEVICE_SPECS, TENSOR_STEP_S, tensor_work
    from pdcompile.simulate import stage_param_tensors

    monkeypatch.setenv("PDCOMPILE_CACHE", str(tmp_path))
    pipe = _compile(8, 2, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    spec = DEVICE_SPECS["cpu"]
    bw = spec.mem_bandwidth * spec.bandwidth_efficiency
    sim = pipe.simulate()
    for s, st in enumerate(pipe.plan.stages):
        p = sum(l.param_bytes for l in pipe.wire_chain.layers[st.first:st.last + 1])
        # and CPU's default per parameter tensor (no calibration), x Adam's work per tensor
        n = stage_param_tensors(pipe.wire_chain.layers[st.first:st.last + 1])
        want = 7 * p / bw + n * TENSOR_STEP_S["cpu"] * tensor_work(2.0)
        durations = {e.end_s - e.start_s for e in sim.events if e.name == f"{s}ST"}
        assert p > 0 and n > 0 and durations and all(d == pytest.approx(want, rel=1e-9) for d in durations), \
            (s, durations)
    assert pipe.plan.seconds_per_minibatch == pytest.approx(float(sim.step_time_s), rel=1e-12)


# -- session 21: ATen graphs, batched matmuls, the kernel probes' fit --------------------------------------------

def _aten_graph() -> Any:
    """A hand-built graph of what torch.export emits (ATen overloads) beside a plain torch function, each input's
    ``pd.tensor`` set as propagate-shapes sets it."""
    import torch.fx as fx

    from pdcompile.ir import TensorMeta

    g = fx.Graph()
    x, w, q, k, m = (g.placeholder(n) for n in ("x", "w", "q", "k", "m"))
    for node, shape in ((x, (4, 8, 16)), (w, (32, 16)), (q, (4, 2, 8, 8)), (k, (4, 2, 8, 8)), (m, (16, 32))):
        node.meta["pd.tensor"] = TensorMeta(shape, "torch.float32", 4 * math.prod(shape))
    nodes = {
        "linear": g.call_function(torch.ops.aten.linear.default, (x, w)),
        "view": g.call_function(torch.ops.aten.view.default, (x, [32, 16])),
        "slice": g.call_function(torch.ops.aten.slice.Tensor, (x, 1, 0, 4)),
        "norm": g.call_function(torch.ops.aten.native_layer_norm.default, (x, [16], None, None, 1e-5)),
        "embedding": g.call_function(torch.ops.aten.embedding.default, (w, x)),
        "heads": g.call_function(torch.matmul, (q, k)),  # both batched: the heads' scores
        "aten_heads": g.call_function(torch.ops.aten.matmul.default, (q, k)),
        "folded": g.call_function(torch.matmul, (x, m)),  # 3-D by 2-D: a Linear's GEMM
        "add": g.call_function(torch.add, (x, x)),
    }
    return nodes


def test_aten_overloads_are_classified_by_their_op_and_batched_matmuls_as_bmm() -> None:
    """A graph torch.export made calls ``torch.ops.aten.X.overload``: classified by ``X`` (before, every one of them
    fell through to elementwise: a Llama's 29 Linears and 60 views charged as additions); a matmul of two batched
    operands is bmm-class (an attention written out), one of a batched by a 2-D operand stays matmul; only ATen
    calls are ``is_aten``."""
    from pdcompile.passes.costs.opclass import is_aten, op_class, op_name

    nodes = _aten_graph()
    assert {k: op_class(n) for k, n in nodes.items()} == {
        "linear": "matmul", "view": "view", "slice": "view", "norm": "norm", "embedding": "embedding",
        "heads": "bmm", "aten_heads": "bmm", "folded": "matmul", "add": "elementwise"}
    assert op_name(torch.ops.aten.linear.default) == "linear" and op_name(torch.add) == "add"
    assert [k for k, n in nodes.items() if is_aten(n)] == ["linear", "view", "slice", "norm", "embedding",
                                                           "aten_heads"]


def test_aten_nodes_pay_their_own_per_node_overhead() -> None:
    """``OpCostTable.node_aten_s``: an ATen call's per-node overhead, charged instead of ``node_s`` (and only where
    fitted: a calibration without it charges ``node_s``); it survives the cache, and a cache written before it
    reads as none."""
    from pdcompile.passes.costs.roofline import device_spec_for

    fit = {"elementwise": OpCost(1e-6, 1e10)}
    table = OpCostTable(fit, fit, "test", node_s=(2e-6, 3e-6), node_aten_s=(5e-6, 7e-6))
    assert OpCostTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    old = {k: v for k, v in table.to_dict().items() if k != "node_aten"}
    assert OpCostTable.from_dict(old).node_aten_s == (0.0, 0.0)
    spec = device_spec_for(None).calibrated(table)
    for backward, plain, aten in ((False, 2e-6, 5e-6), (True, 3e-6, 7e-6)):
        base = 1e-6 + 1e4 / 1e10
        assert spec.op_seconds("elementwise", 0, 1e4, backward=backward) == pytest.approx(base + plain, rel=1e-12)
        assert spec.op_seconds("elementwise", 0, 1e4, backward=backward, aten=True) == \
            pytest.approx(base + aten, rel=1e-12)
        assert spec.op_fixed("elementwise", backward=backward, aten=True) == pytest.approx(1e-6 + aten, rel=1e-12)
    without = device_spec_for(None).calibrated(OpCostTable(fit, fit, "test", node_s=(2e-6, 3e-6)))
    assert without.op_seconds("elementwise", 0, 1e4, aten=True) == pytest.approx(1e-6 + 1e-6 + 2e-6, rel=1e-12)


def test_kernel_probe_fit_recovers_known_rates_through_a_slow_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """The matmul and convolution rates come from Linears and Conv2ds at model sizes (``kernel_samples``): on a fake
    machine where each costs ``alpha + FLOPs / rate`` forward and ``beta + 2 FLOPs / rate_b`` backward, the fit
    recovers all four per class, though one of the three rounds ran 3x slow (a burst of other work: the median
    round is kept)."""
    from pdcompile import calibrate

    truth = {"matmul": (12e-6, 150e9, 35e-6, 130e9), "conv": (60e-6, 140e9, 150e-6, 120e9)}
    calls = {"n": 0}
    per_round = len(calibrate.MATMUL_PROBES) + len(calibrate.CONV_PROBES)
    cases = [c for c in calibrate.kernel_cases() if c[0] in ("matmul", "conv")]

    def fake_low_times(fns: dict[str, Any], repeats: int, quantile: float = 0.5) -> dict[str, float]:
        mod, (x,) = fns["f"].__defaults__
        if isinstance(mod, nn.Linear):
            cls, flops = "matmul", 2.0 * x.shape[0] * mod.in_features * mod.out_features
        else:
            cls, flops = "conv", 2.0 * mod.in_channels * mod.out_channels * 9 * x.shape[0] * x.shape[2] * x.shape[3]
        a, r, b, rb = truth[cls]
        slow = 3.0 if calls["n"] // per_round == 1 else 1.0
        calls["n"] += 1
        f = a + flops / r
        return {"f": slow * f, "fb": slow * (f + b + 2 * flops / rb)}

    monkeypatch.setattr(calibrate, "_low_times", fake_low_times)
    table = calibrate.fit_op_costs(calibrate.kernel_samples(repeats=1, rounds=3, cases=cases), "test")
    assert calls["n"] == 3 * per_round
    for cls, (a, r, b, rb) in truth.items():
        assert (table.forward[cls].alpha_s, table.forward[cls].rate) == pytest.approx((a, r), rel=1e-6)
        assert (table.backward[cls].alpha_s, table.backward[cls].rate) == pytest.approx((b, rb), rel=1e-6)


def test_in_run_factor_is_the_run_over_the_stage_alone_less_the_per_action_cost() -> None:
    """``stage_timing.in_run_factor``: per (stage, F/B) the run's median action less the per-action cost over the
    same stage timed alone, the median over them; unpaired or unmeasured keys ignored; never below 1."""
    from pdcompile.stage_timing import in_run_factor

    over = {"F": 1e-4, "B": 2e-4}
    in_run = {(0, "F"): [1.3e-3, 1.4e-3, 9.0e-3], (0, "B"): [2.6e-3, 2.6e-3, 2.7e-3],  # medians 1.4 and 2.6 ms
              (1, "F"): [1.1e-3], (1, "B"): [], (2, "F"): [5e-3]}
    alone = {(0, "F"): 1.0e-3, (0, "B"): 2.0e-3, (1, "F"): 1.0e-3, (1, "B"): 1e-3}  # (2, "F") never timed alone
    # ratios: (1.4 - 0.1) / 1.0 = 1.3, (2.6 - 0.2) / 2.0 = 1.2, (1.1 - 0.1) / 1.0 = 1.0 -> median 1.2
    assert in_run_factor(in_run, alone, over) == pytest.approx(1.2)
    assert in_run_factor({(0, "F"): [0.5e-3]}, {(0, "F"): 1e-3}, {}) == 1.0  # a faster run is noise: at least 1
    assert in_run_factor({}, alone, over) == 1.0


def test_the_gap_after_a_step_is_charged_with_the_step_not_with_every_action() -> None:
    """``calibrate.action_gaps``: the executor's gap between actions and the trainer's gap after a rank's optimizer
    step (to its next minibatch's first action) told apart, each the median over every rank."""
    from pdcompile.calibrate import action_gaps
    from pdcompile.timeline import Event

    events = []
    for r in (0, 1):
        t = 0.0
        for step in range(3):
            for name, dur in ((f"{r}F{step}", 1e-3), (f"{r}B{step}", 2e-3), (f"{r}ST", 3e-4)):
                events.append(Event(r, name, t, t + dur, "compute"))
                t += dur + (5e-4 if name.endswith("ST") else 2e-5)  # 0.5 ms after a step, 20 us after the rest
    gap, after = action_gaps(events)
    assert gap == pytest.approx(2e-5) and after == pytest.approx(5e-4)
    assert action_gaps([Event(0, "0F0", 0.0, 1.0, "compute")]) == (0.0, 0.0)
