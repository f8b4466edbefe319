"""Tensor parallelism on a rank: plan.json's ``tensor_parallel`` applied with torch's DTensor TP.

Each stage has a degree ``t_s``: every pipeline rank of the plan (the ranks the schedule and the stages
name) is a contiguous block of ``t_s`` processes (:class:`RankLayout`: with one ``t`` for all, process
``rank`` is pipeline rank ``rank // t`` at tensor index ``rank % t``, the (pipeline, data, tensor) mesh with
tensor innermost). Point-to-point transfers go from a pipeline rank's processes to its peer's: receiving
index ``k`` takes each value from sending index ``k % t_send`` (:meth:`RankLayout.source`), so with one
degree the processes of one index form a whole pipeline; each group of pipeline ranks (replicas, tied
copies) is made once per index (:func:`make_group`). Within a stage the ``t`` processes run the same
microbatches on the same whole activations; ``parallelize_module`` splits the linears the compiler's
``tensor-parallel`` pass named (``ColwiseParallel``, ``RowwiseParallel``, local outputs), so each row
linear's output is all-reduced in the forward and each column linear's input gradient in the backward, and
what crosses a stage boundary is whole on every index. No collective here is written by hand. Parameters
left whole get the same gradient on every index (same inputs, same whole outputs), so nothing syncs them;
the global norm counts them on index 0 only.
"""

from __future__ import annotations

import bisect
import datetime
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.errors import UsageError


@dataclass(frozen=True)
class TPRank:
    """Where a process stands: its pipeline rank ``logical``, the degree of the stage that rank runs, and its
    tensor index of that degree."""

    degree: int
    index: int
    logical: int


@dataclass(frozen=True)
class RankLayout:
    """The processes of a plan whose stages each have their own tensor-parallel degree.

    ``stage_ranks[s]`` are stage ``s``'s pipeline ranks (one per replica, as the schedule names them) and
    ``degrees[s]`` its degree ``t_s``. Pipeline rank ``q`` is a contiguous block of ``t_q`` processes, the
    blocks in rank order, so the world is the sum over stages of replicas x ``t_s`` (with one degree for all,
    process ``q * t + j`` is rank ``q``'s index ``j``, the (pipeline, data, tensor) mesh, tensor innermost).
    A value crossing a stage boundary (activations forward, gradients backward) is whole and the same on
    each of the sender's tensor indices, and every receiving process needs it whole: receiving index ``k``
    takes it from sending index ``k % t_send`` (:meth:`source`), so each receiving process gets each value
    exactly once, sender ``j`` sends to the indices ``k`` of the receiver with ``k % t_send == j``
    (:meth:`targets`: several where the receiver has more indices, none where ``j`` is past the receiver's
    degree). With virtual stages a rank holds several stages: they must have one degree."""

    stage_ranks: tuple[tuple[int, ...], ...]
    degrees: tuple[int, ...]

    @staticmethod
    def of(stage_ranks: Sequence[Sequence[int]], degrees: Sequence[int]) -> RankLayout:
        if len(stage_ranks) != len(degrees):
            raise ValueError(f"{len(degrees)} tensor-parallel degrees for {len(stage_ranks)} stages")
        return RankLayout(tuple(tuple(int(q) for q in rs) for rs in stage_ranks), tuple(int(t) for t in degrees))

    @functools.cached_property
    def rank_degrees(self) -> tuple[int, ...]:
        """Each pipeline rank's degree (its stages')."""
        n = 1 + max(q for rs in self.stage_ranks for q in rs)
        out: list[int | None] = [None] * n
        for s, (rs, t) in enumerate(zip(self.stage_ranks, self.degrees)):
            for q in rs:
                if out[q] not in (None, t):
                    raise ValueError(f"pipeline rank {q} holds stages of tensor-parallel degrees {out[q]} and {t} "
                                     f"(stage {s}); the stages of one rank need one degree")
                out[q] = t
        if any(t is None for t in out):
            raise ValueError(f"pipeline ranks {[q for q, t in enumerate(out) if t is None]} run no stage")
        return tuple(int(t or 1) for t in out)

    @functools.cached_property
    def bases(self) -> tuple[int, ...]:
        """Each pipeline rank's first process."""
        return tuple(itertools.accumulate(self.rank_degrees, initial=0))[:-1]

    @property
    def world(self) -> int:
        return sum(self.rank_degrees)

    @property
    def uniform(self) -> bool:
        return len(set(self.degrees)) == 1

    def process(self, logical: int, index: int) -> int:
        """The process of pipeline rank ``logical`` at tensor index ``index``."""
        if not 0 <= index < self.rank_degrees[logical]:
            raise ValueError(f"tensor index {index} of pipeline rank {logical} (degree {self.rank_degrees[logical]})")
        return self.bases[logical] + index

    def locate(self, process: int) -> TPRank:
        """Where ``process`` stands."""
        if not 0 <= process < self.world:
            raise ValueError(f"process {process} of a world of {self.world}")
        q = bisect.bisect_right(self.bases, process) - 1
        return TPRank(self.rank_degrees[q], process - self.bases[q], q)

    def block(self, logical: int) -> list[int]:
        """Pipeline rank ``logical``'s processes (its tensor group)."""
        return [self.bases[logical] + j for j in range(self.rank_degrees[logical])]

    def source(self, receiver: int, index: int, sender: int) -> int:
        """The process that sends pipeline rank ``receiver``'s index ``index`` what rank ``sender`` sends it."""
        return self.process(sender, index % self.rank_degrees[sender])

    def targets(self, sender: int, index: int, receiver: int) -> list[int]:
        """The processes of pipeline rank ``receiver`` that rank ``sender``'s index ``index`` sends to."""
        t = self.rank_degrees[sender]
        return [self.process(receiver, k) for k in range(self.rank_degrees[receiver]) if k % t == index]

    def groups(self, ranks: Sequence[int]) -> list[list[int]]:
        """Pipeline ranks of one degree (a stage's replicas) as process groups, one per tensor index."""
        degrees = {self.rank_degrees[q] for q in ranks}
        if len(degrees) != 1:
            raise ValueError(f"pipeline ranks {list(ranks)} have tensor-parallel degrees {sorted(degrees)}")
        return [[self.process(q, j) for q in ranks] for j in range(degrees.pop())]

    def tied_groups(self, ranks: Sequence[int]) -> list[list[int]]:
        """Process groups for a weight tied across the stages of pipeline ranks ``ranks`` (whole, or split alike
        where their degrees agree): with ``m`` the least degree, group ``i`` holds every index ``k`` with
        ``k % m == i`` of every rank, so each process is in one group and each group has every stage."""
        m = min(self.rank_degrees[q] for q in ranks)
        return [[self.process(q, k) for q in sorted(ranks) for k in range(self.rank_degrees[q]) if k % m == i]
                for i in range(m)]

    def tied_share(self, logical: int, index: int, ranks: Sequence[int]) -> int:
        """How many of pipeline rank ``logical``'s processes share ``index``'s tied group (each adds its copy of
        the rank's gradient, so each adds 1 / that many of it)."""
        m = min(self.rank_degrees[q] for q in ranks)
        return sum(1 for k in range(self.rank_degrees[logical]) if k % m == index % m)


def rank_layout(raw: Mapping[str, Any]) -> RankLayout:
    """plan.json's processes: its stages' pipeline ranks and each stage's degree."""
    stages = raw["stages"]
    return RankLayout.of([st["ranks"] for st in stages], [int(stage_entry(raw, k).get("degree", 1))
                                                         for k in range(len(stages))])


def degree(raw: Mapping[str, Any]) -> int:
    """plan.json's largest tensor-parallel degree (1: none)."""
    tp = raw.get("tensor_parallel") or {}
    return int(tp.get("degree", 1))


def rank_of(raw: Mapping[str, Any], rank: int) -> TPRank:
    """Where process ``rank`` stands in plan.json's layout."""
    if degree(raw) == 1:
        return TPRank(1, 0, rank)
    return rank_layout(raw).locate(rank)


def route(raw: Mapping[str, Any], process: int) -> Callable[[str, int], list[int]] | None:
    """What ``comm.configure`` routes transfers by (None without tensor parallelism): a send of this process to
    a pipeline rank goes to :meth:`RankLayout.targets`, a receive from one comes from :meth:`RankLayout.source`."""
    if degree(raw) == 1:
        return None
    lay = rank_layout(raw)
    me = lay.locate(process)

    def to(kind: str, peer: int) -> list[int]:
        if kind == "send":
            return lay.targets(me.logical, me.index, peer)
        return [lay.source(me.logical, me.index, peer)]
    return to


def stage_entry(raw: Mapping[str, Any], stage: int) -> dict[str, Any]:
    """Stage ``stage``'s entry: ``{"degree", "colwise", "rowwise", "fused", "whole"}``."""
    tp = raw.get("tensor_parallel") or {}
    stages = tp.get("stages") or []
    return dict(stages[stage]) if stage < len(stages) else {"degree": 1}


def make_group(groups: Sequence[Sequence[int]], process: int, timeout: datetime.timedelta) -> Any:
    """Every one of ``groups`` (lists of processes) made, in order, as ``dist.new_group`` needs every process to;
    the one holding ``process`` (None: none does)."""
    mine = None
    for ranks in groups:
        g = dist.new_group(list(ranks), timeout=timeout)
        if process in ranks:
            mine = g
    return mine


def tensor_mesh(raw: Mapping[str, Any], device_type: str, timeout: datetime.timedelta | None = None) -> Any:
    """This process's tensor ``DeviceMesh``: with one degree ``t`` for every stage, the tensor dimension of the
    (pipeline, data, tensor) mesh of every process, tensor innermost (with replicas differing per stage, or
    virtual stages, the first two are one dimension, ``pipeline_data``); with degrees per stage, a 1-D mesh over
    its pipeline rank's block of processes alone (each block's group made by every process, in rank order).
    Called by every process, at the same point."""
    from torch.distributed.device_mesh import DeviceMesh

    lay = rank_layout(raw)
    world = int(raw["world_size"])
    if not lay.uniform:
        me = lay.locate(dist.get_rank())
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        mine = None
        for q in range(len(lay.rank_degrees)):
            block = lay.block(q)
            if len(block) > 1:
                g = dist.new_group(block, **kw)
                if q == me.logical:
                    mine = g
        if mine is None:
            return None
        return DeviceMesh.from_group(mine, device_type, mesh_dim_names=("tensor",))
    t = lay.degrees[0]
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
                             f"along one dimension of the tensor mesh: run the stage with shard 'none' or 'optimizer'")
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
