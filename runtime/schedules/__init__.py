"""Pipeline schedules as plain data (no torch): per rank, an ordered list of Actions.

One module per concern: :mod:`.actions` (the IR, its text form, rank routing), :mod:`.policy`
and :mod:`.registry` (what each schedule is, by name), :mod:`.gpipe` and :mod:`.one_f_one_b` (the
families' action orders, :mod:`.zero_bubble` ZB-H1's), :mod:`.generate` (weight-version placement; the schedules by name as functions),
:mod:`.versions` (memory read off a rank's actions), :mod:`.replay` (deadlock-free replay, send
release), :mod:`.validate`, :mod:`.periodic` (runs of any length) and :mod:`.transfers` (the order
NCCL needs). A ``W k`` after ``B k`` splits that backward: ``B`` computes only input gradients (sent
at once by ``SB``), ``W`` the weight gradients (gpipe and flush split the drain's last backward of
every stage but the first; zb-h1 every backward). :mod:`.interleaved`: virtual stages (several per
rank; interleaved 1F1B, looped BFS). :func:`make_schedule` builds one by name.
"""

from pdcompile.runtime.schedules.actions import (
    COMPUTE,
    Action,
    Kind,
    Placement,
    Schedule,
    format_grid,
    parse_grid,
    rank_of,
    segment_rank,
    shift,
    stage_of_rank,
    stage_ranks,
    stages_of_rank,
)
from pdcompile.runtime.schedules.generate import flush, gpipe, make_schedule, one_f_one_b, two_bw
from pdcompile.runtime.schedules.periodic import MAX_PERIODIC_BASE, RankRun, rank_run
from pdcompile.runtime.schedules.policy import Layout, Policy, warmup_depth
from pdcompile.runtime.schedules.registry import (
    POLICIES,
    SCHEDULES,
    SPLIT_BACKWARD_SCHEDULES,
    VIRTUAL_SCHEDULES,
    layout,
    policy,
)
from pdcompile.runtime.schedules.replay import replay, send_release
from pdcompile.runtime.schedules.transfers import check_transfers, transfer_plan
from pdcompile.runtime.schedules.validate import check_global_steps, validate
from pdcompile.runtime.schedules.versions import (
    forward_versions,
    live_versions,
    peak_in_flight,
    peak_weight_versions,
    version_copies,
)

__all__ = [
    "COMPUTE", "MAX_PERIODIC_BASE", "POLICIES", "SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "VIRTUAL_SCHEDULES", "Action", "Kind", "Layout",
    "Placement", "Policy", "RankRun", "Schedule", "check_global_steps", "check_transfers", "flush", "format_grid", "forward_versions", "gpipe", "layout",
    "live_versions", "make_schedule", "one_f_one_b", "parse_grid", "peak_in_flight", "peak_weight_versions", "policy",
    "rank_of", "rank_run", "replay", "segment_rank", "send_release", "shift", "stage_of_rank", "stage_ranks", "stages_of_rank", "transfer_plan",
    "two_bw", "validate", "version_copies", "warmup_depth",
]
