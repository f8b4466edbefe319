"""Sharded replicas of a stage (plan.json's per-stage ``shard``), on torch's own machinery.

* ``none``: each replica holds the whole stage; ``AR`` all-reduces its gradients (today's run).
* ``optimizer`` (ZeRO-1): gradients all-reduced as with ``none``; the stage's optimizer is a
  ``ZeroRedundancyOptimizer`` over the replica group: each replica keeps and steps the state of
  its share of the parameters, then the updated parameters are broadcast (:class:`Zero1`). Every
  schedule runs it, the weight-stashing ones too (stashed versions are full weights: there the
  mode shards the optimizer state only, as everywhere). On a stage split by tensor parallelism the
  replica group is one tensor index's, and a split parameter (a DTensor) is broadcast as its local
  shard (:func:`zero1`).
* ``full`` (FSDP2): ``fully_shard`` over the replica group (a ``DeviceMesh`` made from it): the
  parameters, gradients and optimizer state are 1/r per replica. As torchtitan runs it under a
  pipeline, parameters are gathered at a step's first forward and kept (``reshard_after_forward``
  off) until the replica's last backward of the step, which alone reduce-scatters the gradients
  (``requires_gradient_sync`` off before it: :class:`FullShard`). The reduction sums, as ``AR``
  does (the loss is already scaled by 1/microbatches). Its backward is never split into ``B`` and
  ``W`` (FSDP2 reduces in its backward hooks; ``W`` is then a no-op). Refused with weight
  versions (1F1B, 2BW: a stash is a full copy) and on a stage with a parameter tied to another stage
  (:func:`refuse`).

Global-norm clipping counts each replica's own shard under ``full`` (:func:`local`); a checkpoint
saves sharded tensors with DCP under the model's names, so it resumes under any mode or replica
count (runtime/checkpoint.py).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from pdcompile.errors import UsageError
from pdcompile.runtime.schedules import Action, Kind

log = logging.getLogger("pdcompile.runtime")

MODES = ("none", "optimizer", "full")


def stage_modes(raw: Mapping[str, Any]) -> list[str]:
    """Each stage's mode as plan.json names it (the stage's ``shard``, in ``stages`` or in
    ``plan.stages``; ``none`` where neither has one); an unknown mode is a :class:`UsageError`."""
    stages = raw.get("stages", [])
    planned = raw.get("plan", {}).get("stages", []) if isinstance(raw.get("plan"), Mapping) else []
    out = []
    for k, st in enumerate(stages):
        mode = st.get("shard", planned[k].get("shard", "none") if k < len(planned) else "none")
        if mode not in MODES:
            raise UsageError(f"plan.json: stage {k} has shard {mode!r}; use one of {', '.join(MODES)} "
                             f"(re-emit the program)")
        out.append(str(mode))
    return out


def effective(mode: str, replicas: int) -> str:
    """What a stage runs: a stage of one replica has nothing to shard over (``none``)."""
    return mode if replicas > 1 else "none"


def refuse(modes: Sequence[str], replicas: Sequence[int], *, schedule: str, version_lag: int | None,
           tied: Collection[int], microbatches: int) -> None:
    """A :class:`UsageError` for a ``full`` stage the run cannot honour (plain data, before any process
    group): weight versions, a parameter tied with another stage (``tied``: the stages holding one),
    fewer microbatches than replicas."""
    full = [k for k, (m, r) in enumerate(zip(modes, replicas)) if effective(m, r) == "full"]
    if not full:
        return
    k = full[0]
    if version_lag != 0:
        raise UsageError(f"stage {k} has shard 'full' under --schedule {schedule}, which keeps stashed weight "
                         f"versions (each a full copy of the stage). Fix: shard='optimizer' (optimizer state only), "
                         f"or a synchronous schedule (flush, gpipe, zb-h1, ...)")
    for k in full:
        if k in tied:
            raise UsageError(f"stage {k} has shard 'full' and a parameter tied with another stage, whose gradients "
                             f"are summed outside FSDP. Fix: shard='optimizer' or 'none' for stage {k}")
        if microbatches < replicas[k]:
            raise UsageError(f"stage {k} has shard 'full' over {replicas[k]} replicas but a step has {microbatches} "
                             f"microbatches: a replica without one would miss the step's reduce-scatter. Fix: "
                             f"--microbatches {replicas[k]} or more")


def _mesh(group: Any, device: torch.device) -> Any:
    """A 1-D ``DeviceMesh`` over the replica group (explicit: the default mesh picks the accelerator)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type=device.type)


class FullShard:
    """A stage under ``fully_shard``: tells FSDP2, before each backward, whether it is the replica's
    last of the step (then the gradients are reduce-scattered and the parameters resharded)."""

    def __init__(self, module: torch.nn.Module, group: Any, device: torch.device) -> None:
        from torch.distributed.fsdp import fully_shard

        self.module: Any = fully_shard(module, mesh=_mesh(group, device), reshard_after_forward=False)
        self.module.set_gradient_divide_factor(1.0)  # a sum, as AR's all-reduce,
        self.module.set_force_sum_reduction_for_comms(True)  # with SUM (gloo has no PREMUL_SUM)
        self.stage = -1
        self.last: set[int] = set()  # microbatches whose backward is the replica's last before an AR

    def prepare(self, actions: Sequence[Action], stage: int) -> None:
        """Read the actions about to run: each step's last backward of ``stage`` (the one before its ``AR``)."""
        pending: int | None = None
        for a in actions:
            if a.stage != stage:
                continue
            if a.kind is Kind.BACKWARD:
                pending = a.mb
            elif a.kind in (Kind.ALLREDUCE, Kind.STEP) and pending is not None:
                self.last.add(pending)
                pending = None

    def before_backward(self, microbatch: int) -> None:
        last = microbatch in self.last
        self.last.discard(microbatch)
        self.module.set_is_last_backward(last)
        self.module.set_requires_gradient_sync(last)
        self.module.set_reshard_after_backward(last)


def zero1(spec: Mapping[str, Any], params: Sequence[torch.nn.Parameter], group: Any) -> Any:
    """ZeRO-1: the optimizer ``spec`` (plan.json's ``{"class", "kwargs"}``) as a
    :class:`~torch.distributed.optim.ZeroRedundancyOptimizer` over the replica group, whose ``state``
    is this replica's share (what checkpoints save and the memory meter counts)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from pdcompile.runtime.program import import_object

    class Zero1(ZeroRedundancyOptimizer):
        """``state`` is the local optimizer's: the state of the parameters this replica steps."""

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            super().load_state_dict(state_dict)  # keeps this replica's share, in self.optim
            self.state = self.optim.state  # type: ignore[assignment]

        def _broadcast_params_from_rank(self, rank: int) -> list[Any]:
            """The updated parameters of replica ``rank``'s share sent to the others, as torch's own does (one
            broadcast per parameter), a split parameter's (a DTensor: tensor parallelism) as its local shard:
            the replicas of one tensor index hold the same shard (c10d's broadcast has no DTensor rule)."""
            import torch.distributed as dist

            zero: Any = self  # (torch's private methods, untyped)
            if zero.parameters_as_bucket_view:  # flat buckets of plain tensors: torch's own
                base: Any = ZeroRedundancyOptimizer
                handles: list[Any] = base._broadcast_params_from_rank(zero, rank)
                return handles
            src = dist.get_global_rank(zero.process_group, rank)
            return [dist.broadcast(local(p.data), src=src, group=zero.process_group, async_op=True)
                    for g in zero._partition_parameters()[rank] for p in g["params"]]

    opt = Zero1(list(params), optimizer_class=import_object(spec["class"]), process_group=group,
                **spec.get("kwargs", {}))
    opt.state = opt.optim.state  # type: ignore[assignment]
    return opt


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (a plain tensor is its own): what clipping and the meter count here."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The stage's parameters and buffers whole, on the CPU (collective over a ``full`` stage's
    replicas: each shard is all-gathered; every replica calls it at the same point)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, t in [*module.named_parameters(), *module.named_buffers()]:
        t = t.detach()
        out[n] = (t.full_tensor() if isinstance(t, DTensor) else t).cpu()
    return out
