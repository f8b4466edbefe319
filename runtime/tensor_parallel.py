"""Tensor parallelism on a rank: plan.json's ``tensor_parallel`` applied with torch's DTensor TP.

With degree ``t`` every pipeline rank of the plan (the ranks the schedule and the stages name) is
``t`` processes: process ``rank`` is pipeline rank ``rank // t`` at tensor index ``rank % t`` (the
(pipeline, data, tensor) mesh with tensor innermost). The processes of one tensor index form a whole
pipeline among themselves: point-to-point transfers go to the peer's process of the same index
(:meth:`TPRank.physical`), and each group of pipeline ranks (replicas, tied copies) is made once per
index (:func:`new_group`). Within a stage the ``t`` processes run the same microbatches on the same
whole activations; ``parallelize_module`` splits the linears the compiler's ``tensor-parallel`` pass
named (``ColwiseParallel``, ``RowwiseParallel``, local outputs), so each row linear's output is
all-reduced in the forward and each column linear's input gradient in the backward. No collective
here is written by hand. Parameters left whole get the same gradient on every index (same inputs, same
whole outputs), so nothing syncs them; the global norm counts them on index 0 only.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.errors import UsageError


@dataclass(frozen=True)
class TPRank:
    """Where a process stands: its pipeline rank and its tensor index, of ``degree``."""

    degree: int
    index: int
    logical: int

    def physical(self, logical: int) -> int:
        """The process of pipeline rank ``logical`` at this process's tensor index."""
        return logical * self.degree + self.index


def degree(raw: Mapping[str, Any]) -> int:
    """plan.json's tensor-parallel degree (1: none)."""
    tp = raw.get("tensor_parallel") or {}
    return int(tp.get("degree", 1))


def rank_of(raw: Mapping[str, Any], rank: int) -> TPRank:
    t = degree(raw)
    return TPRank(t, rank % t, rank // t)


def stage_entry(raw: Mapping[str, Any], stage: int) -> dict[str, Any]:
    """Stage ``stage``'s entry: ``{"degree", "colwise", "rowwise", "fused", "whole"}``."""
    tp = raw.get("tensor_parallel") or {}
    stages = tp.get("stages") or []
    return dict(stages[stage]) if stage < len(stages) else {"degree": 1}


def new_group(tp: TPRank, ranks: Sequence[int], timeout: datetime.timedelta) -> Any:
    """The group of pipeline ranks ``ranks`` at this process's tensor index: one group per index is
    made (every process makes them all, in the same order, as ``dist.new_group`` needs)."""
    if tp.degree == 1:
        return dist.new_group(list(ranks), timeout=timeout)
    mine = None
    for j in range(tp.degree):
        g = dist.new_group([r * tp.degree + j for r in ranks], timeout=timeout)
        if j == tp.index:
            mine = g
    return mine


def tensor_mesh(raw: Mapping[str, Any], device_type: str) -> Any:
    """The (pipeline, data, tensor) ``DeviceMesh`` of every process, tensor innermost; its tensor
    dimension, this process's tensor group. With replicas differing per stage (or virtual stages) the
    first two are one dimension, ``pipeline_data``."""
    from torch.distributed.device_mesh import DeviceMesh

    t = degree(raw)
    world = int(raw["world_size"])
    replicas = {len(st["ranks"]) for st in raw["stages"]}
    stages = len(raw["stages"])
    ids = torch.arange(world)
    if len(replicas) == 1 and stages * replicas.copy().pop() * t == world:
        mesh = DeviceMesh(device_type, ids.view(stages, replicas.pop(), t), mesh_dim_names=("pipeline", "data", "tensor"))
    else:
        mesh = DeviceMesh(device_type, ids.view(-1, t), mesh_dim_names=("pipeline_data", "tensor"))
    return mesh["tensor"]


def interleave(w: torch.Tensor, chunks: int, t: int, inverse: bool = False) -> torch.Tensor:
    """Rows of a fused column weight (or bias) from ``chunks`` equal parts ``[q; k; v]`` to ``t``
    contiguous blocks ``[q_j; k_j; v_j]`` (``inverse``: back). A column split of the result gives each
    rank its share of every part."""
    rest = tuple(w.shape[1:])
    a, b = (t, chunks) if inverse else (chunks, t)
    return w.reshape(a, b, -1, *rest).transpose(0, 1).reshape(w.shape)


def apply(module: torch.nn.Module, entry: Mapping[str, Any], mesh: Any) -> torch.nn.Module:
    """Split ``module``'s linears as ``entry`` names them, over the tensor ``mesh``: column and row pairs
    (local outputs), embeddings by vocabulary (``RowwiseParallel`` on ``nn.Embedding``: each rank's rows,
    the outputs summed) and the LM head by vocabulary (``ColwiseParallel`` whose logits stay a DTensor
    sharded on the last dimension, for the loss-parallel cross-entropy, :class:`VocabParallelLoss`). A weight
    two split layers share (an embedding tied to the head) is shared again after the split."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    t = int(entry.get("degree", 1))
    if t == 1:
        return module
    with torch.no_grad():
        for name, k in dict(entry.get("fused") or {}).items():
            lin: Any = module.get_submodule(name)
            for p in (lin.weight, getattr(lin, "bias", None)):
                if p is not None:
                    p.copy_(interleave(p, int(k), t))
    plan: dict[str, Any] = {n: ColwiseParallel(use_local_output=True) for n in entry.get("colwise", ())}
    plan.update({n: RowwiseParallel(use_local_output=True) for n in entry.get("rowwise", ())})
    plan.update({n: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True)
                 for n in entry.get("embeddings", ())})
    if entry.get("head"):
        plan[str(entry["head"])] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                   use_local_output=False)
    shared: dict[int, list[tuple[str, str]]] = {}  # a parameter held by several of the split modules
    for name in plan:
        for leaf, p in module.get_submodule(name).named_parameters(recurse=False):
            shared.setdefault(id(p), []).append((name, leaf))
    out = parallelize_module(module, mesh, plan)
    for owners in shared.values():
        first = getattr(out.get_submodule(owners[0][0]), owners[0][1])
        for name, leaf in owners[1:]:
            setattr(out.get_submodule(name), leaf, first)
    return out


def place_grads(params: Mapping[str, torch.Tensor]) -> None:
    """Each split parameter's gradient laid out as the parameter is: an embedding split by vocabulary gets its
    weight's gradient replicated from torch's backward; its shard of it (this rank's rows, no communication)
    is what the rank all-reduces with its peers, counts in the norm and steps with."""
    for p in params.values():
        g = p.grad
        placements = getattr(p, "placements", None)
        held = getattr(g, "placements", None)
        # only a replicated gradient of a shard: its rows are local (any other layout, e.g. FSDP2's, is left alone)
        if placements is not None and held is not None and held != placements and all(q.is_replicate() for q in held):
            with torch.no_grad():
                p.grad = g.redistribute(p.device_mesh, placements)  # type: ignore[union-attr, attr-defined]


def shard_shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    """The shape of this process's shard of each split parameter (the metrics' ``tensor_parallel_shards``)."""
    from torch.distributed.tensor import DTensor

    return {n: list(p.to_local().shape) for n, p in module.named_parameters() if isinstance(p, DTensor)}


def has_vocab_head(entry: Mapping[str, Any]) -> bool:
    """Whether the stage's LM head is split by vocabulary (its loss then runs loss-parallel)."""
    return int(entry.get("degree", 1)) > 1 and bool(entry.get("head"))


class VocabParallelLoss(torch.nn.Module):
    """The program's loss on logits sharded by vocabulary (a DTensor from the split LM head): the traced
    cross-entropy's ``aten._log_softmax`` and ``aten.nll_loss_forward`` run as torch's ``loss_parallel``
    runs them (each rank's shard, the maximum and the sums all-reduced), and so do their backwards: the
    context is entered for the process's life (:func:`loss_parallel_scope`). The value comes back as the
    same plain scalar on every tensor index."""

    def __init__(self, loss: Any) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        value = self.loss(output, target)
        return value.to_local() if isinstance(value, DTensor) else value


def whole_output(output: Any) -> Any:
    """A stage's output as user code (a validation metric) reads it: logits split by vocabulary (a DTensor, from
    the split LM head) gathered whole, any other value itself. A collective over the tensor group where there is
    a DTensor: every tensor index calls it at the same point."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.full_tensor() if isinstance(v, DTensor) else v, output)


def loss_parallel_scope() -> Any:
    """torch's ``loss_parallel`` context; the trainer holds it open while a stage with a split head trains
    (its handlers act only on DTensors: the split head's logits)."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def full_state(module: torch.nn.Module, entry: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The stage's parameters and buffers whole, on the CPU, fused rows back in the model's order
    (collective over the tensor group: every index calls it at the same point)."""
    from pdcompile.runtime.shard import full_tensors

    out = full_tensors(module)
    t = int(entry.get("degree", 1))
    for name, k in dict(entry.get("fused") or {}).items():
        for leaf in ("weight", "bias"):
            key = f"{name}.{leaf}"
            if key in out:
                out[key] = interleave(out[key], int(k), t, inverse=True)
    return out


def whole_parameters(module: torch.nn.Module) -> frozenset[str]:
    """The stage's parameters left whole (not DTensors): each tensor index holds the same gradient."""
    from torch.distributed.tensor import DTensor

    return frozenset(n for n, p in module.named_parameters() if not isinstance(p, DTensor))


# --- checkpoints and init_from: split parameters under the model's own names -------------------------
# Driven by each parameter's placement (the dimension its DTensor is sharded along, its mesh) and the
# entry's ``fused`` chunk counts, not by the kind of module: a column linear (dim 0), a row linear (dim 1)
# and a vocabulary-split embedding (dim 0) are read and written the same way.


@dataclass(frozen=True)
class Layout:
    """Where a split parameter's local tensor lies in the model's whole tensor: ``dim`` is cut into
    ``degree`` parts and this process holds part ``index``; with ``chunks`` > 1 the dimension is that many
    equal parts (a fused q, k, v) and the local tensor is each part's share, in order (:func:`interleave`)."""

    dim: int
    degree: int
    index: int
    chunks: int = 1

    def spans(self, size: int) -> list[tuple[int, int]]:
        """(start, length) along ``dim`` of the whole tensor's pieces the local tensor holds, in order."""
        n = size // (self.chunks * self.degree)
        return [((c * self.degree + self.index) * n, n) for c in range(self.chunks)]

    def local(self, whole: torch.Tensor) -> torch.Tensor:
        """This process's part of the model's ``whole`` tensor (a view where it is one piece)."""
        parts = [whole.narrow(self.dim, a, n) for a, n in self.spans(whole.shape[self.dim])]
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)

    def whole(self, gathered: torch.Tensor) -> torch.Tensor:
        """The model's tensor from the processes' local tensors concatenated along ``dim`` in index order
        (a DTensor's ``full_tensor()``): fused chunks back in the model's order."""
        if self.chunks == 1:
            return gathered
        return interleave(gathered.movedim(self.dim, 0), self.chunks, self.degree, inverse=True).movedim(0, self.dim)


def layouts(module: torch.nn.Module, entry: Mapping[str, Any]) -> dict[str, Layout]:
    """Each split parameter of ``module`` (a DTensor sharded on its tensor mesh) by local name: its
    :class:`Layout`, read off its placement; fused chunk counts from ``entry["fused"]`` (module -> chunks)."""
    from torch.distributed.tensor import DTensor, Shard

    fused = {str(k): int(v) for k, v in dict(entry.get("fused") or {}).items()}
    out: dict[str, Layout] = {}
    for name, p in module.named_parameters(remove_duplicate=False):  # a tied weight under each of its names
        if not isinstance(p, DTensor):
            continue
        shards = [(i, pl) for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
        if not shards:
            continue
        if len(shards) > 1 or p.device_mesh.ndim != 1:
            raise UsageError(f"{name}: split over {p.placements} of a {p.device_mesh.ndim}-D mesh (a split stage's "
                             f"replicas sharded too); checkpoints, init_from and merge read and write parameters split "
                             f"along one dimension of the tensor mesh: run the stage with shard 'none'")
        owner = name.rpartition(".")[0]
        out[name] = Layout(int(shards[0][1].dim), p.device_mesh.size(), p.device_mesh.get_local_rank(),
                           fused.get(owner, 1))
    return out


def saved_tensor(t: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """What a checkpoint holds for a tensor laid out as ``layout``: the DTensor itself where its shards are
    contiguous pieces of the model's tensor (DCP writes each process's shard at its offset), the whole
    tensor in the model's order where they are not (fused chunks: gathered over the tensor group, a
    collective every index calls at the same point)."""
    if layout is None or layout.chunks == 1 or not _is_dtensor(t):
        return t
    split: Any = t
    return layout.whole(split.full_tensor().detach()).cpu()


def read_target(t: torch.Tensor, layout: Layout | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor a checkpoint of the model's names is read into for ``t`` (a parameter or its optimizer
    state): a DTensor like ``t`` (DCP reads its shard alone) where the shard is one piece, else the whole
    tensor on the CPU (:func:`take_local` keeps this process's part of it)."""
    if _is_dtensor(t) and (layout is None or layout.chunks == 1) and tuple(t.shape) == shape:
        return torch.empty_like(t.detach(), dtype=dtype)
    return torch.empty(shape, dtype=dtype)


def take_local(whole: torch.Tensor, like: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A DTensor like ``like`` (its mesh and placements) holding this process's part of ``whole``."""
    from torch.distributed.tensor import DTensor

    split: Any = like
    part = layout.local(whole).to(device=like.device, dtype=like.dtype)
    return DTensor.from_local(part.contiguous(), split.device_mesh, split.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's tensor of ``t``: a DTensor's local shard (its storage), a plain tensor itself."""
    split: Any = t
    return split.to_local() if _is_dtensor(t) else t  # type: ignore[no-any-return]


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@dataclass(frozen=True)
class Split:
    """A stage's split as a stage builder applies it (:meth:`pdcompile.runtime.program.Program.build_stage`):
    on the module built on meta, before any tensor has storage, so that each process fills only its part
    (runtime/sources.py reads each split tensor's slice by its layout)."""

    entry: Mapping[str, Any]
    mesh: Any

    def apply(self, module: torch.nn.Module) -> torch.nn.Module:
        return apply(module, self.entry, self.mesh)

    def layouts(self, module: torch.nn.Module) -> dict[str, Layout]:
        return layouts(module, self.entry)
