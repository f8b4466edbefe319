"""The schedules by name: one :class:`~.policy.Policy` each. The only place a name is looked up."""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.errors import UsageError
from pdcompile.runtime.schedules.actions import stage_ranks
from pdcompile.runtime.schedules.gpipe import gpipe_order
from pdcompile.runtime.schedules.one_f_one_b import one_f_one_b_order
from pdcompile.runtime.schedules.policy import Layout, Policy
from pdcompile.runtime.schedules.zero_bubble import zb_h1_order

POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("gpipe", gpipe_order, update_per_microbatch=False, version_lag=0, holds_step=True, split_backward=True,
           vertical_sync=False, synchronous=True, planner_model="flush",
           summary="all forwards, then all backwards, then one update (synchronous SGD)"),
    Policy("flush", one_f_one_b_order, update_per_microbatch=False, version_lag=0, holds_step=False,
           split_backward=True, vertical_sync=False, synchronous=True,
           summary="1F1B within a minibatch, one update at the flush (synchronous SGD)"),
    Policy("1f1b", one_f_one_b_order, update_per_microbatch=True, version_lag=None, holds_step=False,
           split_backward=False, vertical_sync=True, synchronous=False,
           summary="PipeDream 1F1B: an update per minibatch, weight stashing"),
    Policy("2bw", one_f_one_b_order, update_per_microbatch=False, version_lag=1, holds_step=False,
           split_backward=False, vertical_sync=False, synchronous=False,
           summary="PipeDream-2BW: 1F1B without flushes, two weight versions, updates one step late"),
    Policy("zb-h1", zb_h1_order, update_per_microbatch=False, version_lag=0, holds_step=False, split_backward=True,
           vertical_sync=False, synchronous=True, splits_every_backward=True, planner_model="flush",
           summary="zero bubble ZB-H1: 1F1B with every backward split, weight gradients delayed into the "
                   "bubbles, one update per step (synchronous SGD)"),
)}
SCHEDULES: list[str] = list(POLICIES)
SPLIT_BACKWARD_SCHEDULES = tuple(n for n, p in POLICIES.items() if p.split_backward)


def policy(name: str) -> Policy:
    """The policy of schedule ``name``; a :class:`UsageError` listing the known ones otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise UsageError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None


def layout(name: str, replicas: Sequence[int], num_microbatches: int, num_steps: int,
           vertical_sync: bool = False, split_backward: bool = False) -> Layout:
    """Schedule ``name`` with its parameters, checked."""
    pol = policy(name)
    stage_ranks(replicas)  # checks the replica counts
    if int(num_microbatches) != num_microbatches or num_microbatches < 1:
        raise UsageError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if int(num_steps) != num_steps or num_steps < 1:
        raise UsageError(f"num_steps must be a positive integer, got {num_steps!r}")
    return Layout(pol, tuple(int(r) for r in replicas), int(num_microbatches), int(num_steps),
                  bool(vertical_sync) and pol.vertical_sync, bool(split_backward) and pol.split_backward)
