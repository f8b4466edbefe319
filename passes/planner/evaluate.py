"""A block tree rated under one of our cost models (``default``, ``paper``): every worker-level
stage's time with its recomputation, every weight sync and boundary, the bottleneck, memory."""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction
from typing import Any, Sequence

from pdcompile.cluster import format_quantity
from pdcompile.passes.planner.arrays import rng
from pdcompile.passes.planner.blocks import Block, Evaluation, StageCost, flatten_blocks, span

__all__ = ["evaluate_tree"]


def evaluate_tree(model: Any, blocks: Sequence[Block]) -> Evaluation:
    """``blocks`` under ``model`` (a ``search.PlanModel``): its cost model's stage, weight-sync and
    boundary times, its recomputation and sharding decision and memory model at each stage's in-flight
    count."""
    costs = model.costs
    terms: list[tuple[str, float]] = []
    stages: list[StageCost] = []
    flat = flatten_blocks(blocks, model.cluster)
    names = model.chain.layers

    def rec(bs: Sequence[Block], level: int, scale: Fraction, e: Fraction) -> None:
        for p, b in enumerate(bs):
            d_after = sum(x.units for x in bs[p + 1:])
            if level == 1:
                depth = math.ceil((b.units + d_after + e) / b.units)
                k = model.in_flight(depth, b.units)
                reps = len(flat[len(stages)][2])
                shard, mode, head = model.choose_stage(b.first, b.last, k, depth, len(stages), reps, b.units)
                again = model.recompute_s(b.first, b.last, mode, head)
                t, comm = costs.stage_time(b.first, b.last, b.units, again, shard)
                terms.append((f"stage {len(stages)} ({span(names, b.first, b.last)})", float(t * scale)))
                compute = rng(model.PC, b.first, b.last) + again
                stages.append(StageCost(
                    b.first, b.last, flat[len(stages)][2],
                    compute_s=float(compute / b.units * scale),
                    comm_s=float(comm * scale), time_s=float(t * scale), send_s=0.0,
                    memory_bytes=model.mem.memory(b.first, b.last, k, mode, depth, head, shard=shard, replicas=reps),
                    in_flight=k, shard=shard,
                    weight_versions=model.versions(depth), recompute=mode,
                    recompute_layers=head if mode == "partial" else (b.last - b.first + 1 if mode == "full" else 0),
                ))
            else:
                first_stage = len(stages)
                rec(b.inner, level - 1, scale / b.units, (e + d_after * model.sizes[level - 1]) / b.units)
                comm = float(costs.weight_sync_time(b.first, b.last, b.units, level) * scale)
                if b.units > 1:
                    lvname = model.cluster.levels[level - 1].name
                    terms.append((f"weight sync of stages {first_stage}-{len(stages) - 1} across "
                                  f"{b.units} {lvname}", comm))
                for q in range(first_stage, len(stages)):
                    stages[q] = replace(stages[q], comm_s=max(stages[q].comm_s, comm))
            if p + 1 < len(bs):
                a = float(model.cut[b.last])
                tl = float(costs.boundary_time(a, level) * scale) if a > 0 else 0.0
                idx = len(stages) - 1
                terms.append((f"link {idx}->{idx + 1} ({model.cluster.levels[level - 1].name}, "
                              f"{format_quantity(a, 'memory')})", tl))
                stages[idx] = replace(stages[idx], send_s=tl)

    rec(blocks, model.L, Fraction(1), Fraction(0))
    seconds = max((t for _, t in terms), default=0.0)
    bottleneck = max(terms, key=lambda kv: kv[1])[0] if terms else ""
    peak = max((s.memory_bytes for s in stages), default=0.0)
    return Evaluation(seconds, bottleneck, tuple(terms), tuple(stages), peak)
