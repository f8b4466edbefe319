"""Checkpoints of a pipeline run: per-rank files written atomically, then a manifest written last.

A step folder without ``manifest.json`` is incomplete (a crash while writing) and is never resumed
from, so such a crash leaves the previous checkpoint usable. Checkpoints fall only on flush points,
where no stashed weights or in-flight activations exist, so the format does not depend on each
schedule's internals or on the action where the run stopped. Loading uses
``torch.load(weights_only=True)``; resuming refuses, with :class:`~pdcompile.errors.CheckpointError`
naming the cause, a checkpoint that doesn't match its manifest or the running program's plan
(:func:`verify`). The folder layout and the flush-point rule: :func:`save`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdcompile.errors import CheckpointError

FORMAT = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


# --- plan identity ----------------------------------------------------------------------------

def plan_summary(plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What a checkpoint must agree on with the running program: each stage's ranks and parameters."""
    return [{"stage": int(st["index"]), "ranks": [int(r) for r in st["ranks"]],
             "params": sorted(st.get("param_names", {}))} for st in plan["stages"]]


def plan_hash(plan: Mapping[str, Any]) -> str:
    """SHA-256 of :func:`plan_summary` (stable JSON)."""
    return hashlib.sha256(json.dumps(plan_summary(plan), sort_keys=True).encode()).hexdigest()


def _plan_difference(saved: list[dict[str, Any]], current: list[dict[str, Any]]) -> str:
    """A human sentence saying how two plan summaries differ."""
    if len(saved) != len(current):
        return f"the checkpoint has {len(saved)} stages, the program {len(current)}"
    for a, b in zip(saved, current):
        if a["ranks"] != b["ranks"]:
            return f"stage {a['stage']} runs on ranks {a['ranks']} in the checkpoint, {b['ranks']} in the program"
        if a["params"] != b["params"]:
            diff = sorted(set(a["params"]) ^ set(b["params"]))
            return f"stage {a['stage']} has different parameters (e.g. {diff[:3]})"
    return "the plans differ"


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


# --- names ------------------------------------------------------------------------------------

def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def weights_name(stage: int, rank: int) -> str:
    return f"stage_{stage}.rank_{rank}.pt"


def state_name(stage: int, rank: int) -> str:
    return f"stage_{stage}.rank_{rank}.state.pt"


def expected_files(plan: Mapping[str, Any]) -> list[str]:
    """Every file a complete checkpoint of ``plan`` lists (besides the manifest itself)."""
    names = ["plan.json"]
    for st in plan["stages"]:
        for r in st["ranks"]:
            names += [weights_name(int(st["index"]), int(r)), state_name(int(st["index"]), int(r))]
    return names


# --- what one rank saves ----------------------------------------------------------------------

@dataclass(frozen=True)
class RankState:
    """Everything one rank restores, besides its weights."""

    step: int                    # optimizer steps finished
    next_microbatch: int         # global index of the first microbatch after the checkpoint
    data_consumed: int           # minibatches the data iterator has yielded (stage 0; else 0)
    optimizer: dict[str, Any]
    lr_scheduler: dict[str, Any] | None
    weight_store: dict[str, Any] | None
    rng: dict[str, Any]


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


def write_rank(root: str | os.PathLike[str], plan: Mapping[str, Any], stage: int, rank: int,
               weights: Mapping[str, torch.Tensor], state: RankState) -> dict[str, tuple[str, int]]:
    """Write this rank's two files of the checkpoint at ``state.step``; return {name: (sha256, bytes)}."""
    folder = step_dir(root, state.step)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().cpu().clone() for n, t in weights.items()}
    payload = {"format": FORMAT, "plan_hash": plan_hash(plan), "stage": stage, "rank": rank,
               "step": state.step, "next_microbatch": state.next_microbatch,
               "data_consumed": state.data_consumed, "optimizer": state.optimizer,
               "lr_scheduler": state.lr_scheduler, "weight_store": state.weight_store, "rng": state.rng}
    return {weights_name(stage, rank): atomic_save(tensors, folder / weights_name(stage, rank)),
            state_name(stage, rank): atomic_save(payload, folder / state_name(stage, rank))}


def write_manifest(root: str | os.PathLike[str], plan: Mapping[str, Any], step: int,
                   files: Mapping[str, tuple[str, int]]) -> Path:
    """Rank 0, after every rank's files are written: copy plan.json, then write the manifest (last)."""
    folder = step_dir(root, step)
    plan_bytes = json.dumps(plan, indent=1).encode()
    entries = {name: {"sha256": sha, "bytes": size} for name, (sha, size) in files.items()}
    entries["plan.json"] = {"sha256": atomic_write(folder / "plan.json", plan_bytes), "bytes": len(plan_bytes)}
    missing = sorted(set(expected_files(plan)) - set(entries))
    if missing:
        raise CheckpointError(f"{folder}: refusing to write a manifest without {missing}")
    manifest = {"format": FORMAT, "step": step, "created": time.time(), "plan_hash": plan_hash(plan),
                "plan": plan_summary(plan), "world_size": int(plan["world_size"]),
                "files": dict(sorted(entries.items()))}
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
    return folder


# --- finding, checking, loading ---------------------------------------------------------------

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
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this pdcompile reads {FORMAT}")
    return manifest


def verify(folder: str | os.PathLike[str], plan: Mapping[str, Any],
           names: Iterable[str] | None = None) -> dict[str, Any]:
    """Check a checkpoint against the running plan; return its manifest or raise CheckpointError.

    Checks, in order: the manifest is readable; it was made for the same plan (stages, ranks,
    parameter names); it lists every file the plan needs; and the files in ``names`` (default: all)
    exist with the recorded size and SHA-256.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest.get("plan_hash") != plan_hash(plan):
        why = _plan_difference(manifest.get("plan", []), plan_summary(plan))
        raise CheckpointError(f"{folder}: made by another plan ({why}). Fix: resume with the program that "
                              f"wrote it, or point --checkpoint-dir at an empty folder")
    missing = [n for n in expected_files(plan) if n not in manifest["files"]]
    if missing:
        raise CheckpointError(f"{folder}: incomplete manifest, missing {missing}. Fix: resume from an "
                              f"older step folder")
    for name in (manifest["files"] if names is None else names):
        entry = manifest["files"][name]
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the manifest but missing. Fix: restore the file or "
                                  f"resume from an older step folder")
        size = path.stat().st_size
        if size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch ({size} bytes, manifest says {entry['bytes']}; "
                                  f"SHA-256 differs): the file is corrupt or truncated. Fix: resume from an "
                                  f"older step folder")
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


def load_rank(folder: str | os.PathLike[str], plan: Mapping[str, Any], stage: int,
              rank: int) -> tuple[dict[str, torch.Tensor], RankState]:
    """Verify this rank's files (and the manifest) and load them: (weights, state)."""
    folder = Path(folder)
    names = [weights_name(stage, rank), state_name(stage, rank), "plan.json"]
    manifest = verify(folder, plan, names)
    weights = load_tensors(folder / names[0])
    payload = load_tensors(folder / names[1])
    if not isinstance(payload, dict) or payload.get("step") != manifest["step"] or \
            (payload.get("stage"), payload.get("rank")) != (stage, rank):
        raise CheckpointError(f"{folder / names[1]}: not the state of stage {stage} rank {rank} at step "
                              f"{manifest['step']}")
    state = RankState(step=int(payload["step"]), next_microbatch=int(payload["next_microbatch"]),
                      data_consumed=int(payload["data_consumed"]), optimizer=payload["optimizer"],
                      lr_scheduler=payload.get("lr_scheduler"), weight_store=payload.get("weight_store"),
                      rng=payload["rng"])
    return weights, state


def restore_module(module: torch.nn.Module, weights: Mapping[str, torch.Tensor], where: str = "") -> None:
    """Copy checkpointed parameters and buffers into ``module`` in place (names must match exactly)."""
    own: dict[str, torch.Tensor] = dict(module.named_parameters())
    own.update(dict(module.named_buffers()))
    if set(own) != set(weights):
        raise CheckpointError(f"{where}: tensors {sorted(set(own) ^ set(weights))[:5]} don't match the stage module")
    with torch.no_grad():
        for name, t in own.items():
            if t.shape != weights[name].shape:
                raise CheckpointError(f"{where}: {name} has shape {tuple(weights[name].shape)}, the stage "
                                      f"module's is {tuple(t.shape)}")
            t.copy_(weights[name])


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


# --- the collective save (every rank at the same step boundary) ------------------------------

def _encode(files: Mapping[str, tuple[str, int]], names: list[str], device: torch.device) -> torch.Tensor:
    """(sha256, size) of ``names`` as a uint8 tensor [len(names), 40], to gather without pickling."""
    rows = [bytes.fromhex(files[n][0]) + int(files[n][1]).to_bytes(8, "big") for n in names]
    return torch.tensor([list(r) for r in rows], dtype=torch.uint8, device=device)


def _decode(t: torch.Tensor) -> list[tuple[str, int]]:
    out = []
    for row in t.cpu().tolist():
        b = bytes(row)
        out.append((b[:32].hex(), int.from_bytes(b[32:], "big")))
    return out


def save(root: str | os.PathLike[str], plan: Mapping[str, Any], rank: int,
         weights: Mapping[str, torch.Tensor], state: RankState, *, keep: int = 2,
         device: torch.device | str = "cpu", before_manifest: Any = None) -> Path:
    """Collective: every rank calls this at the same step boundary (a flush point).

    Writes ``root/step_00000005/`` (``root``: ``train.py --checkpoint-dir``, one folder every rank
    can see): ``stage_K.rank_R.pt`` (the rank's parameters and buffers, {local name: tensor}: the
    format of --save-final, read by ``pdcompile.merge.merge_weights``), ``stage_K.rank_R.state.pt``
    (:class:`RankState`), ``plan.json`` (a copy, so the folder merges on its own) and, last, by rank
    0, ``manifest.json`` (every file with its SHA-256 and size, the step, the plan's hash). Every
    file goes to a temporary name, is fsynced and renamed, its folder fsynced; the newest ``keep``
    complete checkpoints are kept.

    A flush point is where every microbatch of the finished steps has run its backward and its
    optimizer step. Synchronous schedules (GPipe, Flush) flush after every step; for asynchronous
    ones (1F1B, 2BW) launch.py drains the pipeline at each checkpoint boundary (the schedule is laid
    out per segment of ``--checkpoint-every`` steps) and each segment starts a fresh weight store
    (``weight_store`` stays None). We chose this over saving stash buffers and in-flight
    activations, which would tie the format to each schedule's internals.

    Each rank writes its files atomically; their checksums are gathered on rank 0 (which is also
    the barrier that says every file is on disk); ``before_manifest()`` runs on every rank (fault
    injection); after a second barrier rank 0 writes the manifest and prunes old checkpoints; a
    last barrier keeps any rank from running ahead of the manifest.
    """
    import torch.distributed as dist

    stage = next(int(st["index"]) for st in plan["stages"] if rank in st["ranks"])
    files = write_rank(root, plan, stage, rank, weights, state)
    world = dist.get_world_size()
    names_of = {}
    for st in plan["stages"]:
        for r in st["ranks"]:
            names_of[int(r)] = [weights_name(int(st["index"]), int(r)), state_name(int(st["index"]), int(r))]
    dev = torch.device(device)
    mine = _encode(files, names_of[rank], dev)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if before_manifest is not None:
        before_manifest()
    dist.barrier()
    folder = step_dir(root, state.step)
    if rank == 0:
        every: dict[str, tuple[str, int]] = {}
        for r, t in enumerate(gathered):
            every.update(zip(names_of[r], _decode(t)))
        write_manifest(root, plan, state.step, every)
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
