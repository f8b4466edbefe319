"""``MemoryModel.sharded_starts`` answers a few queries one by one (``_sharded_direct``, what the search
asks) and many from whole tables (``rows``, built by a range maximum over the chain): both must give
the same start for every in-flight count, end, replica count, mode, shard mode, schedule and budget."""

from __future__ import annotations

import numpy as np
import pytest

import pdcompile.passes.planner.memory as memory
from pdcompile import profile as profile_mod
from pdcompile._cli._args import resolve_cluster
from pdcompile.passes.linearize import linearize
from pdcompile.passes.planner.options import PlanOptions
from pdcompile.passes.planner.search import PlanModel

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("schedule", ["1f1b", "flush", "gpipe", "2bw"])
def test_direct_starts_equal_the_tables(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    chain = linearize(profile_mod.load("pipedream:inception_v3"))
    cluster = resolve_cluster("paper:B")  # 16 workers on two levels
    rng = np.random.default_rng(1)
    if schedule == "flush":  # tables built 3 rows per block (a block ends past the first row that fits nothing)
        monkeypatch.setattr(memory, "ROW_BLOCK_ELEMENTS", 3 * len(chain.layers))
    for num_microbatches in (None, 4):
        model = PlanModel(chain, cluster, PlanOptions(schedule=schedule, memory_limit=True, num_microbatches=num_microbatches,
                                                      recompute="auto", shard="auto"))
        mem = model.mem
        whole = mem.memory(0, model.N - 1, 1)
        for frac in (0.05, 0.3, 1.5):  # most, some, none of the stages clipped
            mem.budget = whole * frac  # (a new budget drops the tables built)
            for mode in ("none", "full"):
                for shard in (("optimizer", "full") if schedule in ("flush", "gpipe") else ("optimizer",)):
                    kin = rng.integers(0, 40, 80)  # past the tables' rows too (more than the 16 workers)
                    ends = rng.integers(0, model.N, 80)
                    reps = rng.integers(1, 40, 80)  # past SHARD_EXACT: classes by powers of two
                    monkeypatch.setattr(memory, "SHARD_DIRECT", 10**9)  # no table built yet: one by one
                    direct = mem.sharded_starts(mode, shard, kin, ends, reps)
                    monkeypatch.setattr(memory, "SHARD_DIRECT", -1)
                    tables = mem.sharded_starts(mode, shard, kin, ends, reps)
                    assert np.array_equal(direct, tables), (schedule, num_microbatches, frac, mode, shard)
                    assert np.any(tables <= ends) or frac < 0.1  # not all "nothing fits"


def test_closed_starts_is_the_smallest_start_whose_every_suffix_fits() -> None:
    """The range maximum (one row or a stack of rows) against the definition, start by start."""
    rng = np.random.default_rng(2)
    for n in (1, 2, 5, 8, 17, 64):
        g = rng.normal(size=(4, n))
        c = rng.normal(size=(4, n)) + 0.5
        got = memory.closed_starts(g, c)
        for r in range(4):
            for e in range(n):
                want = e + 1
                while want > 0 and all(g[r, i] <= c[r, e] for i in range(want - 1, e + 1)):
                    want -= 1
                assert got[r, e] == want, (n, r, e)
            assert np.array_equal(memory.closed_starts(g[r], c[r]), got[r])


def test_the_pooled_search_shares_the_hierarchys_tables_only_when_they_are_the_same() -> None:
    """partition_dp's pooled and hierarchical models rate one chain under one budget: one set of tables;
    a model under another budget (or schedule) keeps its own, and its tables differ where the budget bites."""
    from pdcompile.passes.partition_dp import pool_cluster
    from pdcompile.passes.planner.options import PlanOptions

    chain = linearize(profile_mod.load("pipedream:inception_v3"))
    cluster = resolve_cluster("paper:B")
    opts = PlanOptions(cost_model="default", schedule="1f1b", recompute="auto")
    model = PlanModel(chain, cluster, opts)
    pooled = PlanModel(chain, pool_cluster(cluster), opts)
    own = pooled.mem.rows("none")  # built before sharing: the pooled model's own
    assert pooled.mem.share_tables(model.mem)
    assert np.array_equal(pooled.mem.rows("none"), own)  # the hierarchy's table, built again, equals it
    assert pooled.mem.rows("full") is model.mem.rows("full")
    other = PlanModel(chain, cluster, opts)
    other.mem.budget = model.mem.budget / 8
    assert not other.mem.share_tables(model.mem)
    assert not np.array_equal(other.mem.rows("none"), model.mem.rows("none"))
    assert not PlanModel(chain, cluster, PlanOptions(cost_model="default", schedule="gpipe", recompute="auto")
                         ).mem.share_tables(model.mem)
