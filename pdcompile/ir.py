"""IR types shared by the passes: tensor metadata, the layer chain the planners read, and the
compile state that flows through the pass pipeline.

All are frozen dataclasses on plain data with a deterministic ``__str__``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


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


@dataclass(frozen=True)
class CompileState:
    """What flows through the pass pipeline. Each pass returns a new state (``replace``).

    Fields fill in as passes run: ``gm`` after trace, ``chain`` after linearize, ``plan`` after
    partition, ``stages`` after split-stages, ``schedule`` after schedule, ``out_dir`` after emit.
    """

    model: Any
    example_inputs: tuple[Any, ...]
    gm: Any = None
    profile: Any = None
    chain: Chain | None = None
    plan: Any = None
    stages: Any = None
    schedule: Any = None
    out_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def replace(self, **changes: Any) -> "CompileState":
        return dataclasses.replace(self, **changes)
