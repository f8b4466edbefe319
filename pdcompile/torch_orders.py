"""torch.distributed.pipelining's own compute orders (``pipeline_order``) and CSVs, built without a
process group: its schedule classes on stand-in stages that only report their indices. The
independent reference for our ZB-V, DualPipeV and the CSV reader (tests), and the CSVs the
benchmarks run on our runtime beside torch's."""

from __future__ import annotations

from typing import Any

from torch.distributed.pipelining import schedules as tps
from torch.distributed.pipelining.stage import _PipelineStageBase


class _Stage(_PipelineStageBase):
    """A stage that is only its index: what a schedule's constructor reads to lay out its order."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int) -> None:  # no super(): no module
        self.stage_index, self.num_stages, self.group_size, self.group_rank = stage_index, num_stages, group_size, 0
        self.submod = None  # type: ignore[assignment]
        self.has_backward, self.dw_builder, self.stage_index_to_group_rank = True, None, {}

    def _create_grad_recv_info(self, *a: Any, **k: Any) -> Any:
        return None

    def _prepare_backward_infra(self, *a: Any, **k: Any) -> Any:
        return None

    def _prepare_forward_infra(self, *a: Any, **k: Any) -> Any:
        return None


CLASSES = {"interleaved-1f1b": (tps.ScheduleInterleaved1F1B, "loop"),
           "interleaved-zb": (tps.ScheduleInterleavedZeroBubble, "loop"),
           "zb-v": (tps.ScheduleZBVZeroBubble, "v"), "dualpipe-v": (tps.ScheduleDualPipeV, "v")}


def torch_schedule(which: str, p: int, m: int, v: int = 2) -> Any:
    """torch's schedule object ``which`` (a key of :data:`CLASSES`) for ``p`` ranks, ``v`` stages
    per rank, ``m`` microbatches (rank 0's view; its ``pipeline_order`` covers every rank)."""
    cls, style = CLASSES[which]
    mine = [0, 2 * p - 1] if style == "v" else [c * p for c in range(v)]
    return cls([_Stage(s, p * v, p) for s in mine], m)


def torch_order(which: str, p: int, m: int, v: int = 2) -> dict[int, list[str]]:
    """Per rank, torch's compute actions as text (``'0F0'``, ``'3I1'``, an overlapped pair as
    ``'(0F3;3B1)OVERLAP_F_B'``), its empty cells (bubbles) left out."""
    order = torch_schedule(which, p, m, v).pipeline_order
    return {r: [str(a) for a in acts if a is not None] for r, acts in order.items()}


def torch_csv(which: str, p: int, m: int, v: int = 2, path: Any = None) -> str:
    """torch's own ``_dump_csv`` (compute only) of schedule ``which``, as text (written to ``path``)."""
    sch = torch_schedule(which, p, m, v)
    sch._dump_csv(str(path), format="compute_only")
    with open(path) as f:
        return f.read()
