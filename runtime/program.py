"""Reading an emitted program: plan.json, stage modules, weights, and objects named by class path.

Only torch here (no fx, no OR-Tools, no sympy): this is what the emitted ``train.py`` imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdcompile.errors import UsageError

if TYPE_CHECKING:
    from pdcompile.runtime import tensor_parallel

@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def from_json(d: dict[str, Any]) -> "TensorSpec":
        return TensorSpec(d.get("name", ""), tuple(d["shape"]), getattr(torch, d["dtype"]), bool(d.get("requires_grad")))

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def wire(self, precision: str) -> torch.dtype:
        """The dtype this tensor travels in between stages: bf16 for a floating tensor under
        ``precision="bf16"`` (half the bytes), else its own."""
        return wire_dtype(self.dtype, precision)

    def empty_wire(self, precision: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """A receive buffer in the dtype the tensor travels in (:meth:`wire`)."""
        return torch.empty(self.shape, dtype=self.wire(precision), device=device)


PRECISIONS = ("fp32", "bf16")


def wire_dtype(dtype: torch.dtype, precision: str) -> torch.dtype:
    """The dtype a boundary tensor of ``dtype`` is sent in under ``precision`` (bf16 halves floating ones)."""
    return torch.bfloat16 if precision == "bf16" and dtype.is_floating_point else dtype


@dataclass(frozen=True)
class StageSpec:
    index: int
    module: str
    cls: str
    weights: str | None  # None: no stage_K.pt (a meta model's stages are filled from plan.json's init source)
    ranks: tuple[int, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    param_names: dict[str, str]
    # model inputs the stage reads from the data itself, after ``inputs`` in forward's arguments: (index
    # among stage 0's inputs, spec)
    data: tuple[tuple[int, TensorSpec], ...] = ()

    @staticmethod
    def from_json(d: dict[str, Any]) -> "StageSpec":
        return StageSpec(d["index"], d["module"], d["class"], d["weights"], tuple(d["ranks"]),
                         tuple(TensorSpec.from_json(t) for t in d["inputs"]),
                         tuple(TensorSpec.from_json(t) for t in d["outputs"]), dict(d.get("param_names", {})),
                         tuple((int(t["index"]), TensorSpec.from_json(t)) for t in d.get("data_inputs", ())))

    @property
    def args(self) -> tuple[TensorSpec, ...]:
        """forward's arguments: the received inputs, then the data inputs."""
        return self.inputs + tuple(s for _, s in self.data)


@dataclass(frozen=True)
class Program:
    """plan.json, parsed."""

    folder: Path
    raw: dict[str, Any]
    stages: tuple[StageSpec, ...]

    @staticmethod
    def load(folder: str | Path) -> "Program":
        folder = Path(folder)
        raw = json.loads((folder / "plan.json").read_text())
        return Program(folder, raw, tuple(StageSpec.from_json(s) for s in raw["stages"]))

    @property
    def world_size(self) -> int:
        return int(self.raw["world_size"])

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_of_rank(self, rank: int) -> StageSpec:
        for st in self.stages:
            if rank in st.ranks:
                return st
        raise ValueError(f"rank {rank} runs no stage (world size {self.world_size})")

    def stages_of_rank(self, rank: int) -> list[StageSpec]:
        """The stages ``rank`` runs, in order: one, or several with virtual stages."""
        out = [st for st in self.stages if rank in st.ranks]
        if not out:
            raise ValueError(f"rank {rank} runs no stage (world size {self.world_size})")
        return out

    def relayed(self, stage: int) -> tuple[int, ...]:
        """The model inputs (indices among stage 0's) that travel on the activations' message into
        ``stage`` when later stages do not read the data themselves (``--targets send``): those read by
        ``stage`` or a stage after it, relayed from stage 0. With ``--targets local`` none travels."""
        return tuple(sorted({j for st in self.stages[max(stage, 1):] for j, _ in st.data})) if stage >= 1 else ()

    def reads_data(self, stage: int) -> bool:
        """Whether ``stage`` reads model inputs from the data (stage 0, or a later stage with data inputs)."""
        return stage == 0 or bool(self.stages[stage].data)

    @property
    def keywords(self) -> tuple[str, ...]:
        """The model's keyword inputs that are tensors, in the order the first stage takes them after the
        positional ones (``example_kwargs=``; a minibatch's kwargs are read in this order)."""
        return tuple(self.raw.get("input_keywords", ()))

    @property
    def precision(self) -> str:
        """The compiled precision (``"fp32"`` or ``"bf16"``: autocast and bf16 boundary tensors)."""
        return str(self.raw.get("precision", "fp32"))

    @property
    def clip_grad_norm(self) -> float | None:
        """The compiled global-norm clipping threshold (None: no clipping)."""
        v = self.raw.get("clip_grad_norm")
        return None if v is None else float(v)

    @property
    def target(self) -> TensorSpec:
        return TensorSpec.from_json(self.raw["target"])

    @property
    def init(self) -> dict[str, Any]:
        """Where the stages' weights come from (``runtime/sources.py``): ``{"source": "weights"}`` (the
        emitted ``stage_K.pt``), ``"fresh"`` (the owning modules' initialisers) or ``"pretrained"``."""
        return dict(self.raw.get("init") or {"source": "weights"})

    def build_stage(self, index: int, device: torch.device | str | None = None,
                    init_from: str | None = None, seed: int | None = None,
                    split: tensor_parallel.Split | None = None) -> torch.nn.Module:
        """Stage ``index``'s module with its initial weights, on ``device`` (default the CPU), from the
        program's source; ``init_from`` (a checkpoint) overrides it, ``seed`` the fresh initialisation's.
        From a checkpoint or a fresh initialisation the module is built on the meta device and only this
        stage's tensors get storage. ``split`` (tensor parallelism): the stage's linears split across the
        tensor group; built on meta, the split is applied there and each process fills only its shards."""
        from pdcompile.runtime import sources

        st = self.stages[index]
        cls = getattr(_load_file(self.folder / st.module, f"pdcompile_stage_{index}"), st.cls)
        init = self.init if seed is None else {**self.init, "seed": seed}
        init_from = init_from or init.get("path")
        source = sources.source_of(init, init_from)
        if source == "weights" or (init_from and st.weights and (self.folder / st.weights).is_file()):
            module: torch.nn.Module = cls()  # today's path; with init_from the checkpoint overrides what it holds
            if st.weights is None:
                raise ValueError(f"plan.json: stage {index} names no weights file and no source for its weights")
            load_weights(module, self.folder / st.weights)
            if device is not None:
                module = module.to(device)
            if init_from:
                sources.fill_stage(module, index, st.param_names, init, init_from, rest_fresh=False)
            return split.apply(module) if split is not None else module  # whole here: index 0's scattered
        with torch.device("meta"):
            module = cls()
        if split is not None:
            module = split.apply(module)
        module = module.to_empty(device=device if device is not None else "cpu")
        sources.fill_stage(module, index, st.param_names, init, init_from,
                           layouts=split.layouts(module) if split is not None else None)
        return module

    def build_loss(self, device: torch.device | str | None = None) -> Any:
        """The training loss ``loss(output, target)``: the traced ``class Loss`` of the emitted source
        (``{"module", "class", "weights"}``), or, in programs that name it by class path
        (``{"class", "kwargs"}``), that class rebuilt. Moved to ``device`` when given."""
        spec = self.raw.get("loss")
        if spec is None:
            return None
        if "module" in spec:
            loss = getattr(_load_file(self.folder / spec["module"], "pdcompile_loss"), spec["class"])()
            if spec.get("weights"):
                load_weights(loss, self.folder / spec["weights"])
        else:
            loss = build(spec)
        if device is not None and isinstance(loss, torch.nn.Module):
            loss = loss.to(device)
        return loss


def _load_file(path: Path, name: str) -> Any:
    """Import the Python file ``path`` as a fresh module called ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_weights(module: torch.nn.Module, path: str | Path) -> None:
    """Copy saved tensors into a freshly built module (before training; names must match)."""
    saved = torch.load(path, weights_only=True, map_location="cpu")
    own: dict[str, torch.Tensor] = dict(module.named_parameters())
    own.update(dict(module.named_buffers()))
    if set(saved) != set(own):
        raise ValueError(f"{path}: tensors {sorted(set(saved) ^ set(own))} don't match the stage module")
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(saved[name])


def import_object(path: str) -> Any:
    """'pkg.mod.Name' or 'pkg.mod:name' -> the object."""
    if ":" in path:
        mod, _, name = path.partition(":")
    else:
        mod, _, name = path.rpartition(".")
    obj: Any = importlib.import_module(mod)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


PICKLED = ".pkl"  # a callable pdcompile serialized by value (pdcompile/callables.py), beside plan.json


def load_callable(ref: str, folder: str | Path | None = None) -> Any:
    """A callable a flag or plan.json names: ``MODULE:NAME`` (imported), or ``FILE.pkl``, one pdcompile
    serialized by value with cloudpickle (a lambda, a closure, a function of ``__main__``), read with
    :mod:`pickle`; a relative file is looked for in the program ``folder`` first, then the working folder.
    The file is the program's own, as trusted as its ``stage_K.py``."""
    if not ref.endswith(PICKLED):
        return import_object(ref)
    path = Path(ref)
    if not path.is_absolute() and folder is not None and (Path(folder) / path).is_file():
        path = Path(folder) / path
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except OSError as e:
        raise UsageError(f"{ref}: can't read it ({e.strerror}); give MODULE:FUNCTION or the .pkl file pdcompile "
                         f"wrote into the program folder") from None
    except Exception as e:  # noqa: BLE001 - unpickling raises anything the pickled code's imports raise
        raise UsageError(f"{path}: can't load the callable pdcompile serialized by value ({type(e).__name__}: {e}); "
                         f"the ranks need the modules it uses, and the Python and cloudpickle versions that "
                         f"emitted it") from None


def build(spec: dict[str, Any] | None, *args: Any) -> Any:
    """Build ``{"class": path, "kwargs": {...}}`` with positional ``args`` first."""
    if spec is None:
        return None
    return import_object(spec["class"])(*args, **spec.get("kwargs", {}))
