"""Checkpoints of a pipeline run: torch.distributed.checkpoint (DCP) folders keyed by the model's own
names, so a run resumes under another plan (stage count, replicas, synchronous schedule).

A step folder holds DCP's files (``.metadata`` and each rank's ``__R_0.distcp``), each rank's small
state file ``rank_R.state.pt`` (RNG; each of its stages' LR scheduler and optimizer hyperparameters), a copy of the
writer's ``plan.json`` and, written last by rank 0, ``manifest.json``. A folder without the
manifest is incomplete (a crash while writing) and is never resumed from, so such a crash leaves
the previous checkpoint usable. The tensors are keyed by the original model's ``state_dict`` names
(a StageSpec's ``param_names`` map a stage's local names to them): parameters and buffers under
their names, optimizer state under ``optim/NAME/KEY``. A tensor held by several ranks (replicas, a
parameter tied across stages) is written once (DCP's deduplication). Checks before anything is
read: the manifest's SHA-256 of every file a rank reads, and the model (its names and shapes) against
the running program's (:func:`verify`); a mismatch is a :class:`~pdcompile.errors.CheckpointError`
naming the cause. No file is unpickled beyond what ``torch.load(weights_only=True)`` accepts: DCP's
``.metadata`` is read by an unpickler that admits only DCP's metadata types (:class:`SafeReader`).
The collective save and the flush-point rule: :func:`save`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from pdcompile.errors import CheckpointError

FORMAT = 2
MANIFEST = "manifest.json"
METADATA = ".metadata"  # DCP's own index of the tensors
OPTIM = "optim/"  # optimizer state: optim/NAME/KEY (a module's name never holds a '/')
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_STATE_FILE = re.compile(r"^rank_(\d+)\.state\.pt$")


# --- the model a plan trains ------------------------------------------------------------------

def plan_summary(plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each stage's ranks and parameters (recorded in the manifest; a resume may use another plan)."""
    return [{"stage": int(st["index"]), "ranks": [int(r) for r in st["ranks"]],
             "params": sorted(st.get("param_names", {}))} for st in plan["stages"]]


def model_names(plan: Mapping[str, Any]) -> set[str]:
    """The original model's tensor names a plan's stages hold (parameters and buffers)."""
    return {str(n) for st in plan["stages"] for n in st.get("param_names", {}).values()}


# --- atomic files -----------------------------------------------------------------------------

def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes) -> str:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one; return its SHA-256.

    Temporary file in the same folder, fsync, rename over ``path``, fsync the folder.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return hashlib.sha256(data).hexdigest()


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> tuple[str, int]:
    """``torch.save`` through :func:`atomic_write`; return (SHA-256, bytes)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    return atomic_write(path, data), len(data)


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _entry(path: Path) -> dict[str, Any]:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


# --- names ------------------------------------------------------------------------------------

def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def state_name(rank: int) -> str:
    return f"rank_{rank}.state.pt"


def optim_key(name: str, key: str) -> str:
    return f"{OPTIM}{name}/{key}"


# --- what a rank saves ------------------------------------------------------------------------

@dataclass(frozen=True)
class RankState:
    """What one rank restores besides tensors (its ``rank_R.state.pt``)."""

    step: int                    # optimizer steps finished
    data_consumed: int           # minibatches the data iterator has yielded (ranks reading data; else 0)
    lr_scheduler: dict[str, Any] | None
    param_groups: list[dict[str, Any]] | None  # the optimizer's hyperparameters (lr moves with a scheduler)
    rng: dict[str, Any]
    # each stage's {"stage", "lr_scheduler", "param_groups"}: under 1F1B a stage of r replicas steps M / r
    # times a minibatch, so the stages of one rank or one run sit at different scheduler steps
    stages: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class StagePart:
    """One stage a rank holds: its module, optimizer and LR scheduler, and ``names`` (local name ->
    the original model's name, the StageSpec's ``param_names``)."""

    module: torch.nn.Module
    optimizer: Any
    names: Mapping[str, str]
    lr_scheduler: Any = None
    stage: int = 0
    # tensor parallelism: each split parameter's layout by local name (runtime/tensor_parallel.py ``layouts``);
    # its tensors are written and read under the model's names, in the model's order
    layouts: Mapping[str, Any] = field(default_factory=dict)


def rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA) and Python RNG states, in types ``weights_only`` loading accepts."""
    return {"torch": torch.get_rng_state(),
            "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
            "python": random.getstate()}


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state.get("python")
    if py is not None:
        random.setstate((py[0], tuple(py[1]), py[2]))


def _local_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = {n: t.detach() for n, t in module.named_parameters()}
    tensors.update({n: t.detach() for n, t in module.named_buffers()})
    return tensors


def _original(part: StagePart, local: str) -> str:
    name = part.names.get(local)
    if name is None:
        raise CheckpointError(f"stage {part.stage}: tensor {local!r} has no name in the original model (plan.json's "
                              f"param_names); re-emit the program")
    return name


def model_tensors(part: StagePart) -> dict[str, torch.Tensor]:
    """The stage's parameters and buffers under the original model's names."""
    return {_original(part, n): t for n, t in _local_tensors(part.module).items()}


def _param_names(part: StagePart) -> dict[int, str]:
    """id(parameter) -> original name."""
    return {id(p): _original(part, n) for n, p in part.module.named_parameters()}


def optimizer_tensors(part: StagePart) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as ``optim/NAME/KEY`` tensors (non-tensor values are not kept:
    every torch.optim optimizer but LBFGS keeps tensors only)."""
    names = _param_names(part)
    out: dict[str, torch.Tensor] = {}
    for p, st in getattr(part.optimizer, "state", {}).items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                out[optim_key(names[id(p)], key)] = value.detach()
    return out


def _layouts(part: StagePart) -> dict[str, Any]:
    """Original name -> layout of the stage's split parameters (tensor parallelism)."""
    return {_original(part, n): lay for n, lay in part.layouts.items()}


def saved_tensors(part: StagePart) -> dict[str, torch.Tensor]:
    """The stage's tensors and optimizer state as a checkpoint holds them: under the model's names, a split
    parameter (and its optimizer state, split like it) as its shard where that is one piece of the model's
    tensor, else gathered whole in the model's order (runtime/tensor_parallel.py ``saved_tensor``)."""
    from pdcompile.runtime.tensor_parallel import saved_tensor

    lay = _layouts(part)
    shapes = {_original(part, n): tuple(p.shape) for n, p in part.module.named_parameters()}
    out = {k: saved_tensor(v, lay.get(k)) for k, v in model_tensors(part).items()}
    for k, v in optimizer_tensors(part).items():
        name = k[len(OPTIM):].rpartition("/")[0]
        out[k] = saved_tensor(v, lay.get(name) if tuple(v.shape) == shapes.get(name) else None)
    return out


def _hyperparameters(optimizer: Any) -> list[dict[str, Any]] | None:
    groups = getattr(optimizer, "param_groups", [])
    return [{k: v for k, v in g.items() if k != "params"} for g in groups] or None


def rank_state(parts: Sequence[StagePart], step: int, data_consumed: int) -> RankState:
    """This rank's :class:`RankState` at a flush point: each of its stages' scheduler and hyperparameters
    (``stages``; the first's also as ``lr_scheduler``/``param_groups``), its RNG."""
    stages = tuple({"stage": p.stage, "lr_scheduler": p.lr_scheduler.state_dict() if p.lr_scheduler is not None
                    else None, "param_groups": _hyperparameters(p.optimizer)}
                   for p in parts if _hyperparameters(p.optimizer))
    first: dict[str, Any] = stages[0] if stages else {}
    return RankState(step=step, data_consumed=data_consumed, lr_scheduler=first.get("lr_scheduler"),
                     param_groups=first.get("param_groups"), rng=rng_state(), stages=stages)


def _state_payload(state: RankState, rank: int) -> dict[str, Any]:
    return {"format": FORMAT, "rank": rank, "step": state.step, "data_consumed": state.data_consumed,
            "lr_scheduler": state.lr_scheduler, "param_groups": state.param_groups, "rng": state.rng,
            "stages": list(state.stages)}


# --- DCP's metadata, read without unpickling arbitrary objects --------------------------------

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,  # None: every name of the module
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType"},
    "torch": {"Size", "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
              "bool", "complex64", "complex128", "strided", "contiguous_format", "preserve_format",
              "channels_last", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "copyreg": {"_reconstructor"},
    "builtins": {"object", "set", "frozenset", "tuple", "list", "dict"},
    "enum": {"Enum"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` only: any other class is refused (a file could run code)."""

    def find_class(self, module: str, name: str) -> Any:
        names = _ALLOWED.get(module, set())
        if names is None or name in names:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(folder: str | os.PathLike[str]) -> Metadata:
    """DCP's ``.metadata`` of a step folder, or CheckpointError."""
    path = Path(folder) / METADATA
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing. Fix: resume from an older step folder") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint index ({type(e).__name__}: {e}). Fix: use "
                              f"a checkpoint written by train.py; never unpickle files you don't trust") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint index")
    return md


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, its ``.metadata`` read by :func:`read_metadata` (tensors are already read with
    ``torch.load(weights_only=True)``; we never ask DCP for pickled non-tensor values)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(self.path)
        meta = md.storage_meta if md.storage_meta is not None else StorageMeta()
        meta.load_id = self.load_id
        md.storage_meta = meta
        return md


def tensor_shapes(md: Metadata) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (shape, dtype)} of every tensor a checkpoint holds."""
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def files_of(md: Metadata, keys: Iterable[str]) -> set[str]:
    """The data files that hold ``keys`` (what a rank must verify before reading them)."""
    wanted = set(keys)
    return {info.relative_path for idx, info in md.storage_data.items() if idx.fqn in wanted}


def read_tensors(folder: str | os.PathLike[str], targets: dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` ({key: tensor}, in place) from a step folder, without a process group."""
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, storage_reader=SafeReader(str(folder)), no_dist=True)


# --- the manifest -----------------------------------------------------------------------------

def checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path, bool]]:
    """Step folders under ``root``, oldest first: (step, folder, has a manifest)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p, (p / MANIFEST).is_file()))
    return sorted(out)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest step folder with a manifest (a complete checkpoint), or None."""
    done = [p for _, p, complete in checkpoints(root) if complete]
    return done[-1] if done else None


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST}, so the checkpoint is incomplete (a crash while "
                              f"writing it?). Fix: resume from an older step folder, or start afresh")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the manifest is truncated or corrupt. "
                              f"Fix: resume from an older step folder") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or "step" not in manifest:
        raise CheckpointError(f"{path}: not a pdcompile checkpoint manifest (no 'files'/'step'). "
                              f"Fix: point at a folder written by train.py --checkpoint-dir")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this pdcompile reads {FORMAT} (per-rank "
                              f"files of format 1 resume only with the pdcompile that wrote them)")
    return manifest


def expected_files(manifest: Mapping[str, Any]) -> list[str]:
    """The files every complete checkpoint lists: DCP's index, the plan, each writing rank's state."""
    return [METADATA, "plan.json", *(state_name(r) for r in range(int(manifest.get("world_size", 0))))]


def check_model(manifest: Mapping[str, Any], plan: Mapping[str, Any], folder: Path) -> None:
    """Refuse a checkpoint of another model: the original names the program's stages hold must be the
    checkpoint's (shapes are checked where a rank reads its tensors)."""
    saved, mine = set(manifest.get("model", {})), model_names(plan)
    if saved != mine:
        only_ck, only_prog = sorted(saved - mine), sorted(mine - saved)
        why = "; ".join(s for s in (f"{len(only_ck)} tensors only in the checkpoint (e.g. {only_ck[:2]})" if only_ck
                                    else "", f"{len(only_prog)} only in this program's model (e.g. {only_prog[:2]})"
                                    if only_prog else "") if s)
        raise CheckpointError(f"{folder}: a checkpoint of another model ({why}). Fix: resume with the model that "
                              f"wrote it, or point --checkpoint-dir at an empty folder")


def check_files(folder: Path, manifest: Mapping[str, Any], names: Iterable[str]) -> None:
    """Each of ``names`` is listed in the manifest and on disk with the recorded size and SHA-256."""
    for name in names:
        entry = manifest["files"].get(name)
        path = folder / name
        if entry is None:
            raise CheckpointError(f"{folder}: incomplete manifest, missing [{name!r}]. Fix: resume from an "
                                  f"older step folder")
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the manifest but missing. Fix: restore the file or "
                                  f"resume from an older step folder")
        size = path.stat().st_size
        if size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch ({size} bytes, manifest says {entry['bytes']}; "
                                  f"SHA-256 differs): the file is corrupt or truncated. Fix: resume from an "
                                  f"older step folder")


def verify(folder: str | os.PathLike[str], plan: Mapping[str, Any] | None,
           names: Iterable[str] | None = None) -> dict[str, Any]:
    """Check a checkpoint; return its manifest or raise CheckpointError.

    In order: the manifest is readable; it holds the model ``plan`` trains (its original names; any
    plan of that model may resume it; None skips this); it lists every file a complete checkpoint
    has; the files in ``names`` (default: all listed) exist with the recorded size and SHA-256.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if plan is not None:
        check_model(manifest, plan, folder)
    missing = [n for n in expected_files(manifest) if n not in manifest["files"]]
    if missing:
        raise CheckpointError(f"{folder}: incomplete manifest, missing {missing}. Fix: resume from an "
                              f"older step folder")
    check_files(folder, manifest, manifest["files"] if names is None else names)
    return manifest


def load_tensors(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "Unsupported global" in ln), lines[0] if lines else "")
        why = why.replace("WeightsUnpickler error: ", "").split(" Please use")[0]
        raise CheckpointError(f"{path}: can't be loaded with weights_only=True ({type(e).__name__}: {why}). "
                              f"Fix: use a checkpoint written by train.py; never unpickle files you don't trust") from None


def _read_state(folder: Path, manifest: Mapping[str, Any], rank: int) -> dict[str, Any]:
    name = state_name(rank)
    check_files(folder, manifest, [name])
    payload = load_tensors(folder / name)
    if not isinstance(payload, dict) or payload.get("step") != manifest["step"] or payload.get("rank") != rank:
        raise CheckpointError(f"{folder / name}: not the state of rank {rank} at step {manifest['step']}")
    return payload


def load_state(folder: Path, manifest: Mapping[str, Any], rank: int) -> RankState:
    """The step, the data position and, where the writing job had this rank, its RNG (its rank
    number may have run another stage there: the stages' schedulers come from :func:`stage_states`)."""
    own = _read_state(folder, manifest, rank) if rank < int(manifest["world_size"]) else None
    return RankState(step=int(manifest["step"]), data_consumed=int(manifest.get("data_consumed", 0)),
                     lr_scheduler=None, param_groups=None, rng=own["rng"] if own is not None else {})


def _position(state: Any) -> list[int]:
    """Where a scheduler's state stands: its (and, for SequentialLR and ChainedScheduler, its parts')
    ``last_epoch`` and ``_step_count``, in order."""
    if isinstance(state, dict):
        return [int(state[k]) for k in ("last_epoch", "_step_count") if isinstance(state.get(k), int)] + \
            [p for k, v in state.items() if isinstance(v, (dict, list)) for p in _position(v)]
    if isinstance(state, list):
        return [p for v in state for p in _position(v)]
    return []


def stage_states(folder: Path, manifest: Mapping[str, Any], parts: Sequence[StagePart]) -> list[dict[str, Any] | None]:
    """Each part's LR scheduler and hyperparameters (``{"lr_scheduler", "param_groups"}``; None for a
    stage without parameters): those of the writing plan's stage that held its parameters, read from
    that stage's first rank. Under 1F1B stages step at their own rates (a stage of r replicas M / r
    times a minibatch), so a stage takes its own position whatever rank now runs it; a stage holding
    parameters of writing stages whose schedulers differ is refused (one scheduler can't continue both)."""
    check_files(folder, manifest, ["plan.json"])
    try:
        written = json.loads((folder / "plan.json").read_text())
        # a writer with tensor parallelism: pipeline rank r's state is its tensor index 0's (runtime/tensor_parallel.py)
        from pdcompile.runtime.tensor_parallel import rank_layout

        lay = rank_layout(written)
        writers = [(int(st["index"]), [lay.process(int(r), 0) for r in st["ranks"]],
                    set(st.get("param_names", {}).values())) for st in written["stages"]]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder / 'plan.json'}: not a plan ({type(e).__name__}: {e}). Fix: resume from "
                              f"an older step folder") from None
    payloads: dict[int, dict[str, Any]] = {}
    world = int(manifest["world_size"])

    def entry(stage: int, ranks: list[int]) -> dict[str, Any]:
        rank = next((r for r in ranks if r < world), 0)  # written offline by fewer ranks: one state for all
        if rank not in payloads:
            payloads[rank] = _read_state(folder, manifest, rank)
        payload = payloads[rank]
        found = [e for e in payload.get("stages") or [] if e.get("stage") == stage]
        # a state file without this stage's entry: its rank's first stage's, as the writer had it
        return found[0] if found else {"lr_scheduler": payload.get("lr_scheduler"),
                                       "param_groups": payload.get("param_groups")}

    out: list[dict[str, Any] | None] = []
    for part in parts:
        if not _hyperparameters(part.optimizer):
            out.append(None)
            continue
        names = [_original(part, n) for n, _ in part.module.named_parameters()]
        held = [next((i for i, w in enumerate(writers) if n in w[2]), None) for n in names]
        owners = [writers[i] for i in dict.fromkeys(i for i in held if i is not None)]
        if not owners:
            out.append(None)
            continue
        states = [(stage, entry(stage, ranks)) for stage, ranks, _ in owners]
        for stage, st in states[1:]:
            if _position(st["lr_scheduler"]) != _position(states[0][1]["lr_scheduler"]):
                steps = [(s.get("lr_scheduler") or {}).get("last_epoch") for _, s in (states[0], (stage, st))]
                raise CheckpointError(
                    f"{folder}: stage {part.stage} holds parameters of the writing plan's stages {states[0][0]} and "
                    f"{stage}, whose LR schedulers are at different steps ({steps[0]} and {steps[1]}: 1F1B steps a "
                    f"stage of r replicas M / r times a minibatch); one scheduler can't continue both. Fix: resume "
                    f"under a plan whose stages each hold parameters of one writing stage (e.g. its stage cuts)")
        out.append(states[0][1])
    return out


def load_rank(folder: str | os.PathLike[str], plan: Mapping[str, Any] | None, rank: int,
              parts: Sequence[StagePart]) -> RankState:
    """Load this rank's stages from a checkpoint, in place: parameters and buffers, optimizer state and
    hyperparameters, LR scheduler (each stage's from the writing stage of its parameters,
    :func:`stage_states`; not the RNG: :func:`set_rng_state` with the returned state's).

    Reads only the files that hold the stages' tensors (DCP's index says which), each verified
    against the manifest first. Refuses a checkpoint of another model (names, then shapes).
    """
    folder = Path(folder)
    manifest = verify(folder, plan, [METADATA])
    md = read_metadata(folder)
    shapes = tensor_shapes(md)
    from pdcompile.runtime.tensor_parallel import local_tensor, read_target, take_local

    targets: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, str]] = []  # a tensor several of the rank's stages hold: read once
    parts_of: list[tuple[torch.Tensor, str, Any]] = []  # split parameters read whole: (parameter, name, layout)
    for part in parts:
        lay = _layouts(part)
        for name, t in model_tensors(part).items():
            if name not in shapes:
                raise CheckpointError(f"{folder}: no tensor {name!r} (stage {part.stage}): a checkpoint of another "
                                      f"model. Fix: resume with the model that wrote it")
            if shapes[name][0] != tuple(t.shape):
                raise CheckpointError(f"{folder}: {name} has shape {list(shapes[name][0])} in the checkpoint, "
                                      f"{list(t.shape)} in stage {part.stage}: a checkpoint of another model. Fix: "
                                      f"resume with the model that wrote it")
            if name in targets:
                copies.append((t, name))
            elif name in lay and lay[name].chunks > 1:  # its shard is pieces of the model's tensor: read whole
                targets[name] = read_target(t, lay[name], shapes[name][0], t.dtype)
                parts_of.append((t, name, lay[name]))
            else:
                targets[name] = t
    optim: list[dict[str, dict[str, torch.Tensor]]] = []
    split_state: list[tuple[dict[str, torch.Tensor], str, str, torch.Tensor, Any]] = []
    for part in parts:
        lay = _layouts(part)
        per_param: dict[str, dict[str, torch.Tensor]] = {}
        for local_name, param in part.module.named_parameters():
            name = _original(part, local_name)
            prefix = f"{OPTIM}{name}/"
            for key, (shape, dtype) in shapes.items():
                if key.startswith(prefix):
                    if key not in targets:  # a sharded parameter's state (a DTensor) is read as its shard
                        targets[key] = read_target(param, lay.get(name), shape, dtype)
                    held = per_param.setdefault(name, {})
                    held[key[len(prefix):]] = targets[key]
                    if _is_dtensor(param) and not _is_dtensor(targets[key]) and shape == tuple(param.shape):
                        split_state.append((held, key[len(prefix):], key, param, lay[name]))
        optim.append(per_param)
    check_files(folder, manifest, sorted(files_of(md, targets)))
    state = load_state(folder, manifest, rank)
    scheds = stage_states(folder, manifest, parts)
    with torch.no_grad():
        read_tensors(folder, targets)
        for t, name in copies:
            t.copy_(targets[name])
        for split, name, layout in parts_of:  # this process's part of a fused parameter read whole
            local_tensor(split).copy_(layout.local(targets[name]))
        for held, k, key, owner, layout in split_state:  # and of its optimizer state
            held[k] = take_local(targets[key], owner, layout)
    for part, per_param, sched in zip(parts, optim, scheds):
        _load_optimizer(part, per_param, sched["param_groups"] if sched else None)
        if part.lr_scheduler is not None and sched and sched["lr_scheduler"] is not None:
            part.lr_scheduler.load_state_dict(sched["lr_scheduler"])
    return state


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _load_optimizer(part: StagePart, per_param: Mapping[str, Mapping[str, torch.Tensor]],
                    saved_groups: list[dict[str, Any]] | None) -> None:
    groups = getattr(part.optimizer, "param_groups", [])
    if not groups:
        return
    names = _param_names(part)
    index: dict[int, int] = {}
    for g in groups:
        for p in g["params"]:
            index.setdefault(id(p), len(index))
    by_index = {index[id(p)]: p for g in groups for p in g["params"]}
    out_groups = []
    for i, g in enumerate(groups):
        hyper = dict(saved_groups[min(i, len(saved_groups) - 1)]) if saved_groups else \
            {k: v for k, v in g.items() if k != "params"}
        hyper["params"] = [index[id(p)] for p in g["params"]]
        out_groups.append(hyper)
    state = {i: dict(per_param[names[id(p)]]) for i, p in by_index.items() if names[id(p)] in per_param}
    part.optimizer.load_state_dict({"state": state, "param_groups": out_groups})


# --- writing ----------------------------------------------------------------------------------

def state_dict_of(parts: Sequence[StagePart]) -> dict[str, torch.Tensor]:
    """What a rank writes: its stages' tensors and optimizer state under the model's names (a tensor
    two of its stages hold, once)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in saved_tensors(part).items():
            out.setdefault(k, v)
    return out


def write_manifest(folder: Path, plan: Mapping[str, Any], step: int, data_consumed: int, world_size: int,
                   files: Mapping[str, Mapping[str, Any]], md: Metadata) -> None:
    """Rank 0, once every rank's files are on disk: copy plan.json, hash DCP's index, write the manifest (last)."""
    entries = {name: dict(e) for name, e in files.items()}
    plan_bytes = json.dumps(plan, indent=1).encode()
    entries["plan.json"] = {"sha256": atomic_write(folder / "plan.json", plan_bytes), "bytes": len(plan_bytes)}
    entries[METADATA] = _entry(folder / METADATA)
    manifest = {"format": FORMAT, "step": step, "data_consumed": data_consumed, "created": time.time(),
                "world_size": world_size, "plan": plan_summary(plan),
                "model": {k: {"shape": list(shape), "dtype": str(dtype).replace("torch.", "")}
                          for k, (shape, dtype) in sorted(tensor_shapes(md).items()) if not k.startswith(OPTIM)},
                "files": dict(sorted(entries.items()))}
    missing = [n for n in expected_files(manifest) if n not in entries]
    if missing:
        raise CheckpointError(f"{folder}: refusing to write a manifest without {missing}")
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1).encode())


def write_offline(root: str | os.PathLike[str], plan: Mapping[str, Any], step: int,
                  tensors: Mapping[str, torch.Tensor], state: RankState, world_size: int = 1) -> Path:
    """A complete checkpoint written by one process (tools and tests): ``tensors`` under the model's
    names (and ``optim/...`` keys), every rank's state ``state``."""
    folder = step_dir(root, step)
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    files = {state_name(r): dict(zip(("sha256", "bytes"), atomic_save(_state_payload(state, r),
                                                                     folder / state_name(r))))
             for r in range(world_size)}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        md = dcp.save(dict(tensors), storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    files.update({p.name: _entry(p) for p in folder.glob("__*.distcp")})
    write_manifest(folder, plan, step, state.data_consumed, world_size, files, md)
    return folder


def prune(root: str | os.PathLike[str], keep: int = 2) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete ones older than them."""
    found = checkpoints(root)
    complete = [p for _, p, done in found if done]
    kept = set(complete[-keep:]) if keep > 0 else set()
    oldest_kept = min((s for s, p, _ in found if p in kept), default=None)
    removed = []
    for s, p, done in found:
        if p in kept:
            continue
        if done or (oldest_kept is not None and s < oldest_kept):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def save(root: str | os.PathLike[str], plan: Mapping[str, Any], rank: int, parts: Sequence[StagePart],
         state: RankState, *, keep: int = 2, before_manifest: Any = None) -> Path:
    """Collective: every rank calls this at the same step boundary (a flush point).

    Writes ``root/step_00000005/`` (``root``: ``train.py --checkpoint-dir``, one folder every rank
    can see): this rank's ``rank_R.state.pt`` (atomically), then, with ``torch.distributed.checkpoint.save``,
    its stages' tensors under the model's names (``__R_0.distcp``, and DCP's ``.metadata`` by rank 0;
    a tensor several ranks hold is written by one). Each rank hashes the files it wrote; the hashes
    are gathered on rank 0 (also the barrier that says every file is on disk); ``before_manifest()``
    runs on every rank (fault injection); after a barrier rank 0 writes ``plan.json`` and, last,
    ``manifest.json`` (every file's SHA-256 and size, the step, the data position, the model's names
    and shapes), then prunes to the newest ``keep``; a last barrier keeps any rank from running ahead.
    An incomplete folder of the same step (a crash while writing it) is cleared first.

    A flush point is where every microbatch of the finished steps has run its backward and its
    optimizer step: synchronous schedules flush after every step; for asynchronous ones (1F1B, 2BW)
    the trainer drains the pipeline at each checkpoint boundary (the schedule is laid out per segment
    of ``--checkpoint-every`` steps) and each segment starts a fresh weight store. So a checkpoint
    holds no stashed weights or activations, and any plan of the model can resume it.
    """
    import torch.distributed as dist

    folder = step_dir(root, state.step)
    if rank == 0 and folder.is_dir() and not (folder / MANIFEST).exists():
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    folder.mkdir(parents=True, exist_ok=True)
    mine = {state_name(rank): dict(zip(("sha256", "bytes"), atomic_save(_state_payload(state, rank),
                                                                       folder / state_name(rank))))}
    md = dcp.save(state_dict_of(parts), storage_writer=dcp.FileSystemWriter(str(folder)))
    mine.update({p.name: _entry(p) for p in folder.glob(f"__{rank}_*.distcp")})
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (mine, state.data_consumed))
    if before_manifest is not None:
        before_manifest()
    dist.barrier()
    if rank == 0:
        files: dict[str, Any] = {}
        for f, _ in gathered:
            files.update(f)
        write_manifest(folder, plan, state.step, max(d for _, d in gathered), world, files, md)
        prune(root, keep)
    dist.barrier()
    return folder


def agree(value: int, device: torch.device | str = "cpu") -> tuple[int, int]:
    """Collective: (min, max) of ``value`` over all ranks (do all ranks resume the same step?)."""
    import torch.distributed as dist

    lo = torch.tensor([value], dtype=torch.int64, device=device)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return int(lo.item()), int(hi.item())
