"""The partition pass's balanced split, and the pass list's shape (one file per pass, typed state)."""

from __future__ import annotations

import dataclasses
import importlib
import math
import random
from typing import Any

import pytest
import torch

from pdcompile.cluster import flat_cluster, local_cpu_cluster
from pdcompile.errors import UsageError
from pdcompile.ir import Chain, ChainLayer, CompileState
from pdcompile.passes.annotate_costs import AnnotateOptions
from pdcompile.passes.partition import PASS_PLANNING, PartitionOptions, balanced_bounds, balanced_split, choose
from pdcompile.passes.partition_dp import partition_dp
from pdcompile.passes.schedule import ScheduleOptions
from pdcompile.passes.trace import TraceOptions
from pdcompile.passes.trace_loss import TraceLossOptions
from pdcompile.pipeline import PassOptions, passes


def _slowest(chain: Chain, bounds: list[int]) -> float:
    edges = [0, *bounds, len(chain)]
    return max(sum(chain.layers[i].compute_s for i in range(a, b)) for a, b in zip(edges, edges[1:]))


def _random_chain(rng: random.Random) -> Chain:
    n = rng.randint(2, 12)
    layers = tuple(ChainLayer(f"l{i}", "op", rng.uniform(0.1, 1.0), rng.uniform(0.1, 2.0), 0.0,
                              rng.choice([0.0, 1e6]), (f"l{i}",)) for i in range(n))
    return Chain(layers, tuple(math.inf if rng.random() < 0.2 else 0.0 for _ in range(n - 1)))


def test_balanced_split_and_the_planner_without_replication_agree() -> None:
    """With free links, PipeDream's DP without replication minimises the same thing as the balanced
    split: the slowest stage's compute. (It may use fewer stages when that ties.)"""
    rng = random.Random(0)
    checked = 0
    for _ in range(150):
        chain = _random_chain(rng)
        stages = rng.randint(2, min(4, len(chain)))
        try:
            bounds = balanced_bounds(chain, stages)
        except UsageError:
            continue
        plan = partition_dp(chain, local_cpu_cluster(stages), allow_replication=False, memory_limit=False)
        planned = sorted(s.first for s in plan.stages)[1:]
        assert len(planned) <= stages - 1
        assert _slowest(chain, bounds) == pytest.approx(_slowest(chain, planned), rel=1e-9)
        assert plan.seconds_per_minibatch == pytest.approx(_slowest(chain, bounds), rel=1e-9)
        checked += 1
    assert checked > 100


def test_the_pass_plans_with_every_planning_option_it_holds() -> None:
    """The pass hands its ``planning`` options to the planner whole: ``allow_replication``, which the
    pass has no field of its own for, changes its plan (three compute-heavy layers without weights are
    best replicated on four workers; forbidden, a pipeline without replicas), exactly as it changes
    partition_dp's."""
    layers = tuple(ChainLayer(f"l{i}", "op", 1.0, 2.0, 1.0, 0.0, (f"l{i}",)) for i in range(3))
    chain = Chain(layers, (1.0, 1.0))
    cluster = flat_cluster(4, 1e9, memory=1e12)
    plans = {}
    for allow in (True, False):
        # 1f1b: the steady-state objective partition_dp minimises (a flush plan is rated by its simulated step)
        planning = PASS_PLANNING.with_({"allow_replication": allow, "schedule": "1f1b"})
        got = choose(chain, PartitionOptions(planning, cluster=cluster))[0]
        want = partition_dp(chain, cluster, planning)
        assert (got.configuration, got.seconds_per_minibatch) == (want.configuration, want.seconds_per_minibatch)
        plans[allow] = got
    assert any(st.replicas > 1 for st in plans[True].stages)
    assert all(st.replicas == 1 for st in plans[False].stages)


def test_balanced_split_respects_blocked_cuts_and_prefers_narrow_ones() -> None:
    w = [1.0, 1.0, 1.0, 1.0, 4.0]
    assert balanced_split(w, 2, [0.0] * 4) == [4]
    assert balanced_split(w, 2, [0.0, 0.0, 0.0, math.inf]) == [3]
    # [1 | 0, 1] and [1, 0 | 1] tie on the slowest part: the narrower cut wins, else the earlier one
    assert balanced_split([1.0, 0.0, 1.0], 2, [5.0, 1.0]) == [2]
    assert balanced_split([1.0, 0.0, 1.0], 2, [1.0, 5.0]) == [1]
    assert balanced_split([1.0, 0.0, 1.0], 2, [0.0, 0.0]) == [1]
    with pytest.raises(UsageError, match="has only 2 layers"):
        balanced_split([1.0, 1.0], 3, [0.0])
    with pytest.raises(UsageError, match="no way to cut"):
        balanced_split([1.0, 1.0, 1.0], 2, [math.inf, math.inf])


def test_every_pass_lives_in_the_file_its_name_spells() -> None:
    """A pass named ``split-stages`` is ``run`` in ``passes/split_stages.py``."""
    opts = PassOptions(trace=TraceOptions(), annotate=AnnotateOptions(microbatch_size=1),
                       partition=PartitionOptions(), schedule=ScheduleOptions("flush", 2),
                       loss=TraceLossOptions(torch.nn.MSELoss(), torch.zeros(1)))
    names = [p.name for p in passes(opts)]
    assert names == ["trace", "propagate-shapes", "annotate-costs", "linearize", "partition", "split-stages",
                     "trace-loss", "tensor-parallel", "schedule"]
    for name in names:
        module = importlib.import_module(f"pdcompile.passes.{name.replace('-', '_')}")
        assert callable(module.run), name
    assert "trace-loss" not in [p.name for p in passes(dataclasses.replace(opts, loss=None))]


def test_compile_state_has_a_named_field_for_everything() -> None:
    fields = {f.name for f in dataclasses.fields(CompileState)}
    assert "extra" not in fields
    assert fields >= {"gm", "output_key", "profile", "chain", "plan", "assignment", "stage_ranks", "cluster",
                      "stages", "schedule", "loss"}


def _balanced_split_every_cut(weights: list[float], num_stages: int, cut_bytes: list[float]) -> list[int]:
    """The reference: balanced_split's DP comparing every last cut for every prefix (no window)."""
    n = len(weights)
    pre = [0.0]
    for w in weights:
        pre.append(pre[-1] + w)
    ok = [True] + [math.isfinite(c) for c in cut_bytes]
    cut = [0.0] + list(cut_bytes)
    inf = math.inf
    big = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    wide = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    back = [[0] * (n + 1) for _ in range(num_stages + 1)]
    big[0][0] = wide[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            best = None
            for j in range(k - 1, i):
                if not (math.isfinite(big[k - 1][j]) and ok[j]):
                    continue
                key = (max(big[k - 1][j], pre[i] - pre[j]), max(wide[k - 1][j], cut[j] if j > 0 else 0.0))
                if best is None or key < best[0]:
                    best = (key, j)
            if best is not None:
                (big[k][i], wide[k][i]), back[k][i] = best
    if not math.isfinite(big[num_stages][n]):
        raise UsageError("no split")
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        i = back[k][i]
        bounds.append(i)
    return sorted(b for b in bounds if b > 0)


def test_balanced_split_compares_only_the_cuts_that_can_tie_and_finds_the_same_split() -> None:
    """balanced_split skips the last cuts whose part alone passes the previous prefix's choice: the same
    split, ties included (zero weights, equal weights, forbidden and equal cuts), as comparing every cut."""
    rng = random.Random(5)
    for _ in range(1500):
        n = rng.randint(1, 16)
        w = [rng.choice([0.0, 1.0, 2.0, rng.random(), 5 * rng.random()]) for _ in range(n)]
        cuts = [rng.choice([0.0, 1.0, 2.0, math.inf, rng.random()]) for _ in range(n - 1)]
        s = rng.randint(1, n)
        try:
            want: Any = _balanced_split_every_cut(w, s, cuts)
        except UsageError:
            want = UsageError
        try:
            got: Any = balanced_split(w, s, cuts)
        except UsageError:
            got = UsageError
        assert got == want, (w, s, cuts)
