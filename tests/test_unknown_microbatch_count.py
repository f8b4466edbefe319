"""A step's microbatch count not given to the planner is unknown, one meaning everywhere: the search's
shard checks (``PlanModel``), the plan it builds, the memory model (in-flight counts not capped) and
``with_shard`` all read it so, as ``pdcompile plan`` (``microbatches_known=False``) does; ``full``
needs a microbatch per replica only where the count is known (the API always gives one)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pdcompile.cluster import ClusterSpec, Device, Level
from pdcompile.errors import UsageError
from pdcompile.ir import Chain
from pdcompile.passes.linearize import linearize
from pdcompile.passes.partition import with_shard
from pdcompile.passes.partition_dp import partition_dp
from pdcompile.passes.planner.options import PlanOptions
from pdcompile.profile import load


def _setup() -> tuple[Chain, ClusterSpec]:
    """AlexNet's profile under Adam on 2 servers of 4, 1.75 GiB each: its 4-replica stage needs sharding."""
    chain = linearize(load("pipedream:alexnet"))
    cluster = ClusterSpec(Device("d", memory=1.75 * 2**30, peak_flops=1e13, memory_bandwidth=9e11),
                          (Level("gpus", 4, 10e9), Level("servers", 2, 1.25e9)))
    return chain, cluster


def _drop(p: Any) -> dict[str, Any]:
    return {k: v for k, v in p.to_dict().items() if k != "planning_seconds"}


def test_auto_reads_a_count_not_given_as_unknown() -> None:
    chain, cluster = _setup()
    kw: dict[str, Any] = dict(schedule="flush", recompute="none", optimizer_state_factor=2.0, shard="auto")
    given = partition_dp(chain, cluster, **kw)
    unknown = partition_dp(chain, cluster, microbatches_known=False, **kw)
    # 16 a step: a replica's share (4) is over its warm-up depth, so forwards follow its gradients, as an
    # unknown count is read (with 8, each of 4 replicas holds its 2 before its first backward: it fits unsharded)
    enough = partition_dp(chain, cluster, num_microbatches=16, **kw)
    assert _drop(given) == _drop(unknown)
    assert [s.shard for s in given.stages] == [s.shard for s in enough.stages]
    big = max(given.stages, key=lambda s: s.replicas)
    assert big.replicas == 4 and big.shard == "full"
    # a count known to be below the replicas: full is not among auto's modes for that stage
    few = partition_dp(chain, cluster, num_microbatches=2, **kw)
    assert all(s.shard != "full" for s in few.stages if s.replicas > 2)


def test_full_asked_without_a_count_plans_as_with_shard_sets_it() -> None:
    chain, cluster = _setup()
    kw: dict[str, Any] = dict(schedule="flush", recompute="none", optimizer_state_factor=2.0)
    full = partition_dp(chain, cluster, shard="full", **kw)
    assert any(s.replicas > 1 for s in full.stages)
    assert [s.shard for s in full.stages] == ["full" if s.replicas > 1 else "none" for s in full.stages]
    # with_shard (the ILP's plans, the partition pass) reads the options' count the same way
    bare = dataclasses.replace(full, stages=tuple(dataclasses.replace(s, shard="none") for s in full.stages),
                               notes=())
    assert [s.shard for s in with_shard(bare, PlanOptions(schedule="flush", shard="full")).stages] == \
        [s.shard for s in full.stages]
    with pytest.raises(UsageError, match="give at least"):
        partition_dp(chain, cluster, shard="full", num_microbatches=1, **kw)
