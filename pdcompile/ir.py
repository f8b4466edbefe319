"""IR types shared by the passes: tensor metadata, the layer chain the planners read, and the
compile state that flows through the pass pipeline (frozen dataclasses, one typed field each).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pdcompile.errors import PassError

if TYPE_CHECKING:  # types of CompileState's fields only; ir stays importable without them
    import torch
    import torch.fx as fx

    from pdcompile.cluster import ClusterSpec
    from pdcompile.passes.split_stages import StageSplit
    from pdcompile.passes.tensor_parallel import TensorParallelPlan
    from pdcompile.passes.trace_loss import LossProgram
    from pdcompile.plan import Plan
    from pdcompile.profile import Profile
    from pdcompile.runtime.schedules import Schedule
    from pdcompile.runtime.schedules.spec import ScheduleSpec


@dataclass(frozen=True)
class TensorMeta:
    """What ``propagate-shapes`` records for one tensor: ``node.meta["pd.tensor"]``.

    For a node producing a tuple/list/dict of tensors, the meta is a tuple/dict of TensorMeta
    (non-tensor leaves are kept as ``None``).
    """

    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.float32"
    nbytes: int
    requires_grad: bool = False

    def __str__(self) -> str:
        dt = self.dtype.replace("torch.", "")
        return f"{dt}[{','.join(str(s) for s in self.shape)}]"


def meta_bytes(meta: Any) -> int:
    """Total bytes of a (possibly nested) ``pd.tensor`` value."""
    if meta is None:
        return 0
    if isinstance(meta, TensorMeta):
        return meta.nbytes
    if isinstance(meta, dict):
        return sum(meta_bytes(v) for v in meta.values())
    if isinstance(meta, (tuple, list)):
        return sum(meta_bytes(v) for v in meta)
    return 0


@dataclass(frozen=True)
class ChainLayer:
    """One element of the chain the planners partition (a layer, or several merged ones).

    Times are seconds per *minibatch* of the profile's batch size; bytes likewise.
    ``members`` are the names of the profile layers (fx node names) this element stands for.
    """

    name: str
    op: str
    forward_s: float
    backward_s: float
    output_bytes: float
    param_bytes: float
    members: tuple[str, ...] = ()
    saved_bytes: float | None = None  # what autograd saves for backward (None: unknown; use output_bytes)
    saved_input_bytes: float = 0.0  # of it, storages an earlier layer produced (received, at a stage's start)
    saved_output_bytes: float = 0.0  # of its own output, what it saves itself (sent, at a stage's end)
    shared_param_bytes: float = 0.0  # parameters an earlier layer uses too (a later stage holds a copy)
    tied_params: tuple[tuple[str, float], ...] = ()  # (name, bytes) of its parameters another layer uses too
    # trainable parameter tensors it owns (each once, at its first user, as param_bytes counts them): a stage's
    # optimizer step and all-reduce pay per tensor (simulate.stage_step_s, collective_s); 0: not profiled
    param_tensors: int = 0
    input_grad_s: float | None = None  # a split backward's parts (None: not profiled; the simulator's shares)
    weight_grad_s: float | None = None
    # under selective recomputation: bytes that stay saved per microbatch (the cached outputs of its
    # FLOP-counted ops) and the forward time rebuilt at backward (None: not profiled, as in imported profiles)
    selective_saved_bytes: float | None = None
    selective_recompute_s: float | None = None
    selective_rebuilt_bytes: float | None = None  # of saved_bytes, what a backward's rebuild makes (not cached)
    resaved_bytes: float = 0.0  # what it saves that an earlier layer saved first (a tail keeps it under partial)
    # of forward_s and backward_s, the fixed part (its ops' fixed costs): what a smaller or larger microbatch
    # pays alike (the simulator scales only the rest, :meth:`scaled`)
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0
    # tensor parallelism (passes/planner/tensor.py): the shares of its compute, parameters and saved bytes
    # that Megatron's layout splits t ways, the bytes its row linears' outputs all-reduce per forward (the
    # backward all-reduces as many at its column linears' inputs) in how many all-reduces, and the number
    # every degree must divide (the gcd of the head counts and split sizes; 0: no constraint)
    tp_share: float = 0.0
    tp_param_share: float = 0.0
    tp_saved_share: float = 0.0
    tp_allreduce_bytes: float = 0.0
    tp_allreduces: int = 0
    tp_divisor: int = 0

    def scaled(self, scale: float) -> tuple[float, float, float]:
        """(forward, backward, backward / profiled backward) at ``scale`` times the profiled batch: the
        fixed parts as they are, the rest ``scale`` times."""
        f = self.forward_fixed_s + (self.forward_s - self.forward_fixed_s) * scale
        b = self.backward_fixed_s + (self.backward_s - self.backward_fixed_s) * scale
        return f, b, (b / self.backward_s if self.backward_s else scale)

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class Chain:
    """A topologically ordered chain of layers and the bytes live across every cut.

    ``cut_bytes[i]`` is the number of bytes produced at or before ``layers[i]`` and consumed
    after it: what a stage boundary after layer ``i`` must send forward (and receive back as
    gradients). ``math.inf`` marks a cut that is not allowed (a non-tensor value is live there).
    ``len(cut_bytes) == len(layers) - 1``.
    """

    layers: tuple[ChainLayer, ...]
    cut_bytes: tuple[float, ...]
    batch_size: int = 1
    name: str = "model"

    def __post_init__(self) -> None:
        if len(self.cut_bytes) != max(0, len(self.layers) - 1):
            raise ValueError(
                f"Chain needs len(cut_bytes) == len(layers) - 1 "
                f"(layers: {len(self.layers)}, cut_bytes: {len(self.cut_bytes)})"
            )

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def widest_cut(self) -> float:
        finite = [c for c in self.cut_bytes if math.isfinite(c)]
        return max(finite, default=0.0)

    def __str__(self) -> str:
        lines = [f"chain {self.name}: {len(self.layers)} layers, batch {self.batch_size}"]
        for i, layer in enumerate(self.layers):
            cut = f"  | cut {self.cut_bytes[i]:.0f} B" if i < len(self.cut_bytes) else ""
            lines.append(
                f"  {i:4d} {layer.name:<28} {layer.op:<24} fwd {layer.forward_s:.3e}s "
                f"bwd {layer.backward_s:.3e}s out {layer.output_bytes:.0f} B "
                f"param {layer.param_bytes:.0f} B{cut}"
            )
        return "\n".join(lines)

    def at_batch(self, batch_size: int) -> "Chain":
        """This chain's costs at another batch (microbatch) size, as the simulator scales them
        (:meth:`ChainLayer.scaled`): times less their fixed parts scaled linearly (a split backward's
        parts as the backward), activation and boundary bytes linearly; parameters stay."""
        if batch_size == self.batch_size:
            return self
        f = batch_size / self.batch_size

        def sc(x: float | None) -> float | None:
            return None if x is None else x * f

        def one(l: ChainLayer) -> ChainLayer:
            fwd, bwd, k = l.scaled(f)
            return dataclasses.replace(
                l, forward_s=fwd, backward_s=bwd, output_bytes=l.output_bytes * f,
                saved_bytes=sc(l.saved_bytes), saved_input_bytes=l.saved_input_bytes * f,
                saved_output_bytes=l.saved_output_bytes * f,
                input_grad_s=None if l.input_grad_s is None else l.input_grad_s * k,
                weight_grad_s=None if l.weight_grad_s is None else l.weight_grad_s * k,
                selective_saved_bytes=sc(l.selective_saved_bytes), selective_recompute_s=sc(l.selective_recompute_s),
                selective_rebuilt_bytes=sc(l.selective_rebuilt_bytes), resaved_bytes=l.resaved_bytes * f,
                tp_allreduce_bytes=l.tp_allreduce_bytes * f)

        return dataclasses.replace(self, layers=tuple(one(l) for l in self.layers), batch_size=batch_size,
                                   cut_bytes=tuple(c * f for c in self.cut_bytes))

    def on_the_wire(self, precision: str) -> "Chain":
        """This chain with the cut bytes a boundary sends under ``precision``: bf16 sends floating
        tensors in half the bytes (the cuts don't record dtypes; boundaries are taken as floating)."""
        if precision != "bf16":
            return self
        return dataclasses.replace(self, cut_bytes=tuple(c / 2 if math.isfinite(c) else c for c in self.cut_bytes))


@dataclass(frozen=True)
class CompileState:
    """What flows through the pass pipeline; each pass returns a new one (``replace``).

    Fields start as ``None`` and fill in as passes run, each written by one pass (ARCHITECTURE.md):
    trace writes ``gm`` and ``output_key``; propagate-shapes and annotate-costs annotate ``gm``;
    annotate-costs writes ``profile``; linearize ``chain``; partition ``plan``, ``assignment``,
    ``stage_ranks`` and ``cluster``; split-stages ``stages``; tensor-parallel ``stages`` (rewritten where split) and
    ``tensor_parallel``; schedule ``schedule_spec`` and ``schedule``; trace-loss ``loss``.
    """

    model: torch.nn.Module
    example_inputs: tuple[torch.Tensor, ...]  # one microbatch: the positional inputs
    example_kwargs: Mapping[str, Any] | None = None  # one microbatch: the keyword inputs (tensors and constants)
    gm: fx.GraphModule | None = None
    output_key: str | None = None  # the model output's key the graph returns ("logits"), if any
    profile: Profile | None = None
    chain: Chain | None = None
    plan: Plan | None = None
    assignment: dict[str, int] | None = None  # fx node name -> stage
    stage_ranks: tuple[tuple[int, ...], ...] | None = None  # stage -> its ranks
    cluster: ClusterSpec | None = None  # the cluster the plan is for
    stages: StageSplit | None = None
    tensor_parallel: TensorParallelPlan | None = None  # None: no stage split across ranks (t = 1)
    schedule_spec: ScheduleSpec | None = None
    schedule: Schedule | None = None
    loss: LossProgram | None = None

    def replace(self, **changes: Any) -> "CompileState":
        return dataclasses.replace(self, **changes)

    @property
    def graph_inputs(self) -> tuple[torch.Tensor, ...]:
        """What the traced graph takes, in order: the positional inputs, then the keyword inputs' tensors
        (other keyword values are constants of the graph)."""
        return graph_inputs(self.example_inputs, self.example_kwargs)


def graph_inputs(args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """``args``, then the tensors among ``kwargs``' values in their order: the placeholders of a graph
    traced from ``model(*args, **kwargs)``."""
    import torch

    return (*args, *(v for v in (kwargs or {}).values() if isinstance(v, torch.Tensor)))


T = TypeVar("T")


def need(value: T | None, what: str) -> T:
    """``value``, which an earlier pass must have written (``what`` names the field)."""
    if value is None:
        raise PassError(f"the compile state has no {what} yet; the pass that writes it must run first")
    return value
