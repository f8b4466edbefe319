"""The schedules by name: one :class:`~.policy.Policy` each. The only place a name is looked up."""

from __future__ import annotations

from collections.abc import Sequence

from pdcompile.errors import UsageError
from pdcompile.runtime.schedules.actions import stage_ranks
from pdcompile.runtime.schedules.dualpipe_v import dualpipe_v_in_flight, dualpipe_v_order
from pdcompile.runtime.schedules.gpipe import gpipe_order
from pdcompile.runtime.schedules.interleaved import (
    interleaved_1f1b_order,
    interleaved_in_flight,
    interleaved_placement,
    looped_bfs_in_flight,
    looped_bfs_order,
)
from pdcompile.runtime.schedules.one_f_one_b import one_f_one_b_order
from pdcompile.runtime.schedules.policy import Layout, Policy
from pdcompile.runtime.schedules.zero_bubble import zb_h1_order
from pdcompile.runtime.schedules.zero_bubble_v import v_placement, zbv_held, zbv_in_flight, zbv_order

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
    Policy("interleaved-1f1b", interleaved_1f1b_order, update_per_microbatch=False, version_lag=0, holds_step=False,
           split_backward=False, vertical_sync=False, synchronous=True, placement=interleaved_placement,
           rank_in_flight=interleaved_in_flight,
           summary="interleaved 1F1B (Megatron): v stages per rank, stage s on rank s % p, depth-first 1F1B, "
                   "one update per step (synchronous SGD)"),
    Policy("looped-bfs", looped_bfs_order, update_per_microbatch=False, version_lag=0, holds_step=True,
           split_backward=False, vertical_sync=False, synchronous=True, placement=interleaved_placement,
           rank_in_flight=looped_bfs_in_flight,
           summary="looped BFS: v stages per rank, stage s on rank s % p, each stage's forwards of a step in "
                   "turn, then its backwards, one update per step (synchronous SGD)"),
    Policy("zb-v", zbv_order, update_per_microbatch=False, version_lag=0, holds_step=False, split_backward=True,
           vertical_sync=False, synchronous=True, splits_every_backward=True, placement=v_placement,
           rank_in_flight=zbv_in_flight, rank_held=zbv_held,
           summary="zero bubble ZB-V: 2 stages per rank in a V (stage s on rank min(s, 2p-1-s)), every backward "
                   "split, W's filling the bubbles at 1F1B's memory, one update per step (synchronous SGD)"),
    Policy("dualpipe-v", dualpipe_v_order, update_per_microbatch=False, version_lag=0, holds_step=False,
           split_backward=True, vertical_sync=False, synchronous=True, order_splits=True, placement=v_placement,
           rank_in_flight=dualpipe_v_in_flight,
           summary="DualPipeV (DeepSeek): 2 stages per rank in a V, a forward of one stage paired with a backward "
                   "of the other (run one after the other here), m >= 2p, one update per step (synchronous SGD)"),
)}
SCHEDULES: list[str] = [n for n, p in POLICIES.items() if not p.virtual_stages]  # one stage per rank
VIRTUAL_SCHEDULES: list[str] = [n for n, p in POLICIES.items() if p.virtual_stages]  # several stages per rank
SPLIT_BACKWARD_SCHEDULES = tuple(n for n, p in POLICIES.items() if p.split_backward)


def policy(name: str) -> Policy:
    """The policy of schedule ``name``; a :class:`UsageError` listing the known ones otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise UsageError(f"unknown schedule {name!r}; choose one of {', '.join(POLICIES)}") from None


def layout(name: str | Policy, replicas: Sequence[int], num_microbatches: int, num_steps: int,
           vertical_sync: bool = False, split_backward: bool = False, virtual_stages: int = 1) -> Layout:
    """Schedule ``name`` with its parameters, checked; ``virtual_stages`` (stages per rank) only
    for a policy with a placement, which needs one replica per stage. ``name`` may be a policy that
    is not registered (a torch CSV's)."""
    pol = name if isinstance(name, Policy) else policy(name)
    name = pol.name
    stage_ranks(replicas)  # checks the replica counts
    if int(virtual_stages) != virtual_stages or virtual_stages < 1:
        raise UsageError(f"virtual_stages must be a positive integer, got {virtual_stages!r}")
    if pol.placement is None and virtual_stages != 1:
        raise UsageError(f"{name} runs one stage per rank; virtual_stages={virtual_stages} needs a schedule with "
                         f"virtual stages ({', '.join(n for n, p in POLICIES.items() if p.placement)})")
    if pol.placement is not None:
        if any(r != 1 for r in replicas):
            raise UsageError(f"{name} places one replica per stage; replicas {list(replicas)} are not all 1")
        pol.placement(len(replicas), int(virtual_stages))  # checks the stage count
    if int(num_microbatches) != num_microbatches or num_microbatches < 1:
        raise UsageError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if int(num_steps) != num_steps or num_steps < 1:
        raise UsageError(f"num_steps must be a positive integer, got {num_steps!r}")
    return Layout(pol, tuple(int(r) for r in replicas), int(num_microbatches), int(num_steps),
                  bool(vertical_sync) and pol.vertical_sync, bool(split_backward) and pol.split_backward,
                  int(virtual_stages))
