"""Recomputation as the planner decides it, end to end: under a cluster's memory limit
``recompute="auto"`` gives a stage that does not fit its fewest first layers to recompute (partial);
the emitted plan.json names its head for the runtime; through torchrun (1F1B with weight stashing,
the NCCL-rules mode) it trains bitwise like no recomputation, rebuilds at its backwards, and the
stage's measured peak is within 10% of the plan's."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _emitted import launch_two  # noqa: E402
from test_memory_model import CFG  # noqa: E402

from pdcompile.api import pdcompile  # noqa: E402
from pdcompile.errors import UsageError  # noqa: E402
from pdcompile.runtime.recompute import compute_nodes, graph_signature  # noqa: E402
from pdcompile.zoo import gpt  # noqa: E402

M, B = 4, 2


def _compile(**kw: Any) -> Any:
    cfg = gpt.GPTConfig(**CFG)
    torch.manual_seed(0)
    (x,), y = gpt.make_batch(cfg, torch.device("cpu"), 0, M * B)
    return pdcompile(gpt.GPT(cfg), example_inputs=(x,), example_target=y, loss_fn=gpt.SequenceCrossEntropy(),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), stages=2, schedule="1f1b",
                     num_microbatches=M, **kw)


def test_auto_recomputes_the_fewest_first_layers_that_fit() -> None:
    free = _compile(recompute="none")
    need = [s.memory_bytes for s in free.plan.stages]
    assert need[0] > need[1]
    limit = 0.9 * need[0]  # stage 0 does not fit as it is; stage 1 does
    pipe = _compile(recompute="auto", cluster=free.cluster.with_memory(limit))
    s0, s1 = pipe.plan.stages
    assert (s0.first, s0.last) == (free.plan.stages[0].first, free.plan.stages[0].last)  # the same split
    assert s0.recompute == "partial" and 1 <= s0.recompute_layers < s0.num_layers
    assert s0.memory_bytes <= limit * (1 + 1e-9) < need[0]
    assert s1.recompute == "none"
    assert f"first {s0.recompute_layers} of {s0.num_layers} layers" in str(pipe.plan)
    # the time it pays: the head's forward again
    again = sum(l.forward_s for l in pipe.state.chain.layers[s0.first:s0.first + s0.recompute_layers])
    scale = pipe.plan.microbatch_size / pipe.state.chain.batch_size
    assert s0.compute_s == pytest.approx(free.plan.stages[0].compute_s + again * scale, rel=1e-9)
    fields = pipe.program_fields()
    entry = fields["plan"]["stages"][0]
    graph = pipe.split.stages[0].gm.graph
    head = {m for l in pipe.state.chain.layers[s0.first:s0.first + s0.recompute_layers] for m in l.members}
    nodes = compute_nodes(graph)
    assert nodes[entry["recompute_nodes"] - 1].name in head and entry["recompute_nodes"] < len(nodes)
    assert all(n.name not in head for n in nodes[entry["recompute_nodes"]:])
    assert entry["graph_signature"] == graph_signature(graph)
    assert "recompute_nodes" not in fields["plan"]["stages"][1]


def test_selective_is_refused_where_layers_lack_its_costs() -> None:
    from pdcompile.cluster import paper_cluster
    from pdcompile.passes.linearize import linearize
    from pdcompile.passes.partition_dp import partition_dp
    from pdcompile.profile import load

    with pytest.raises(UsageError, match="selective"):
        partition_dp(linearize(load("pipedream:vgg16")), paper_cluster("A"), recompute="selective")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_partial_recompute_trains_bitwise_like_none_through_torchrun(tmp_path: Path) -> None:
    free = _compile(recompute="none")
    limit = 0.9 * free.plan.stages[0].memory_bytes
    pipe = _compile(recompute="auto", cluster=free.cluster.with_memory(limit))
    assert pipe.plan.stages[0].recompute == "partial"
    data = {"factory": "tests.test_memory_model:batches", "kwargs": CFG}
    runs = {}
    for tag, p in (("none", free), ("partial", pipe)):
        prog = p.emit(tmp_path / f"prog_{tag}", data=data)
        runs[tag] = launch_two(tmp_path, prog, "1f1b", tag)
        assert json.loads((prog / "plan.json").read_text())["plan"]["stages"][0]["recompute"] == tag
    (m_none, w_none), (m_part, w_part) = runs["none"], runs["partial"]
    assert w_none.keys() == w_part.keys() and all(
        torch.equal(w_none[s][n], w_part[s][n]) for s in w_none for n in w_none[s])
    assert m_part[0]["memory"]["recompute"] > 0  # its backwards rebuilt the head
    assert m_part[0]["memory"]["activations"] < m_none[0]["memory"]["activations"]
    measured = m_part[0]["memory"]["total"]
    assert abs(pipe.plan.stages[0].memory_bytes - measured) <= 0.10 * measured, (pipe.plan.stages[0].memory_bytes,
                                                                               measured)


def test_schedule_auto_refits_recomputation_for_each_microbatch_count() -> None:
    """``schedule="auto"``'s candidates (schedule x microbatch count) each get the recomputation their
    memory needs, charged in their time: a candidate that does not fit without recomputing fits with
    it, slower by what its stages run again, and equals a simulation of the plan with those modes set
    by hand; with ``recompute="none"`` nothing is recomputed."""
    from pdcompile import autoschedule
    from pdcompile.passes.partition_dp import PlanOptions, stage_memory_at
    from pdcompile.simulate import simulate_plan

    free = _compile(recompute="none")
    limit = 0.9 * max(s.memory_bytes for s in free.plan.stages)
    cluster = free.cluster.with_memory(limit)
    chain, batch = free.wire_chain, M * B
    names, counts = ["flush", "1f1b"], [1, 2, 4, 8]
    plain = {(c.schedule, c.num_microbatches): c for c in autoschedule.candidates(free.plan, chain, cluster, batch,
                                                                                   names, counts)}
    refit = {(c.schedule, c.num_microbatches): c for c in autoschedule.candidates(free.plan, chain, cluster, batch,
                                                                                   names, counts, recompute="auto")}
    rescued = [key for key in plain if not plain[key].fits and refit[key].fits]
    assert rescued, [(k, plain[k].peak_memory_bytes, refit[k].peak_memory_bytes) for k in plain]
    for key in rescued:
        name, m = key
        assert refit[key].step_s > plain[key].step_s
        micro = dataclasses.replace(free.plan, microbatch_size=batch // m)
        res = simulate_plan(micro, chain, cluster, name, m, refit_recompute=limit)
        first = simulate_plan(micro, chain, cluster, name, m)
        chosen = []
        for s, st in enumerate(micro.stages):  # the modes it chose, held to the memory model by hand
            none = stage_memory_at(chain, st.first, st.last, PlanOptions(schedule=name, num_microbatches=m),
                                   in_flight=first.peak_in_flight[s], weight_versions=first.peak_weight_versions[s],
                                   activation_scale=micro.microbatch_size / chain.batch_size)
            chosen.append(none <= limit)
        assert not all(chosen)  # some stage needed recomputation
        assert max(res.peak_memory_bytes or [0.0]) <= limit * (1 + 1e-9)
        assert res.step_time_s == pytest.approx(refit[key].step_s)
