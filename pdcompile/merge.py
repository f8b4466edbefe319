"""Stage weights back under the original model's names: as one state dict, or streamed, a stage at a
time, into safetensors files in Hugging Face's layout.

Two sources: a ``train.py --save-final`` folder (``stage_K.rank_R.pt``, local names, mapped by the
program's plan.json) and a checkpoint step folder (torch.distributed.checkpoint, already under the
model's names; runtime/checkpoint.py). A parameter tied across stages, or held by every replica of a
stage, is written once; copies are checked to be equal, since the runtime keeps them in sync.

Hugging Face's layout (:func:`write_hf`): ``model.safetensors``, or above ``max_shard_size`` shards
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json``, as ``save_pretrained``
writes them. The safetensors files are written here, header first (from shapes alone), then each
stage's tensors as it is read, so peak memory is about the largest stage: the safetensors package
writes only from a whole dict in memory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdcompile.errors import CheckpointError, UsageError
from pdcompile.runtime import checkpoint
from pdcompile.runtime.checkpoint import load_tensors

_FILE = re.compile(r"^stage_(\d+)\.rank_(\d+)\.pt$")


# --- sources: tensors by the model's names, a stage at a time ---------------------------------

@dataclass(frozen=True)
class Source:
    """A model's tensors, known by (shape, dtype) before any is read, read a group (a stage) at a time."""

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]  # in the order the groups give them
    groups: list[list[str]]
    read: Callable[[list[str]], dict[str, torch.Tensor]]
    where: str

    def stream(self, names: set[str] | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Each group's tensors (restricted to ``names``), read when asked for."""
        for group in self.groups:
            keep = [n for n in group if names is None or n in names]
            if keep:
                yield self.read(keep)


def save_final_source(program_dir: str | os.PathLike[str], weights_dir: str | os.PathLike[str],
                      atol: float = 1e-6) -> Source:
    """The per-rank files ``stage_K.rank_R.pt`` of ``weights_dir``, named by ``program_dir``'s plan.json.

    Files are opened memory-mapped (shapes without reading data); a stage's replicas and a tied
    tensor's copies in other stages are compared when the stage is read.
    """
    plan = json.loads((Path(program_dir) / "plan.json").read_text())
    names = {int(st["index"]): st["param_names"] for st in plan["stages"]}
    files = sorted((p for p in Path(weights_dir).iterdir() if _FILE.match(p.name)),
                   key=lambda p: tuple(int(g) for g in _FILE.match(p.name).groups()))  # type: ignore[union-attr]
    if not files:
        raise CheckpointError(f"{weights_dir}: no stage_K.rank_R.pt files. Fix: point at the folder given to "
                              f"train.py --save-final (or a checkpoint folder)")
    by_stage: dict[int, list[Path]] = {}
    for path in files:
        by_stage.setdefault(int(_FILE.match(path.name).group(1)), []).append(path)  # type: ignore[union-attr]
    missing = set(names) - set(by_stage)
    if missing:
        raise CheckpointError(f"{weights_dir}: no weights for stages {sorted(missing)}")
    opened: dict[Path, dict[str, torch.Tensor]] = {}

    def tensors(path: Path) -> dict[str, torch.Tensor]:
        if path not in opened:
            try:
                opened[path] = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
            except Exception:  # noqa: BLE001 - the plain reader names the cause
                opened[path] = load_tensors(path)
        return opened[path]

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    owner: dict[str, tuple[Path, str]] = {}  # original name -> (first file, local name)
    holders: dict[str, list[tuple[Path, str]]] = {}
    groups: list[list[str]] = []
    for stage in sorted(by_stage):
        group = []
        for path in by_stage[stage]:
            for local, t in tensors(path).items():
                orig = names.get(stage, {}).get(local)
                if orig is None:
                    continue
                holders.setdefault(orig, []).append((path, local))
                if orig not in owner:
                    owner[orig] = (path, local)
                    shapes[orig] = (tuple(t.shape), t.dtype)
                    group.append(orig)
        groups.append(group)

    def read(keep: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in keep:
            path, local = owner[name]
            t = tensors(path)[local].clone()  # off the mapped file
            for other, other_local in holders[name][1:]:
                u = tensors(other)[other_local]
                if not torch.allclose(t, u, atol=atol, rtol=0):
                    raise CheckpointError(f"{other}: copies of {name!r} differ between stages/replicas "
                                          f"(max diff {(t - u).abs().max().item():.3g})")
            out[name] = t
        return out

    return Source(shapes, groups, read, str(weights_dir))


def checkpoint_source(folder: str | os.PathLike[str], plan: Mapping[str, Any] | None = None) -> Source:
    """A checkpoint step folder (verified first: manifest complete, every file's checksum, the model
    ``plan`` trains if given), grouped by the stages of the plan stored in it."""
    folder = Path(folder)
    checkpoint.verify(folder, plan)
    md = checkpoint.read_metadata(folder)
    shapes_all = checkpoint.tensor_shapes(md)
    stored = json.loads((folder / "plan.json").read_text()) if (folder / "plan.json").is_file() else {"stages": []}
    groups: list[list[str]] = []
    seen: set[str] = set()
    for st in stored["stages"]:
        group = [n for n in st.get("param_names", {}).values() if n in shapes_all and n not in seen]
        seen.update(group)
        groups.append(group)
    rest = [k for k in shapes_all if not k.startswith(checkpoint.OPTIM) and k not in seen]
    if rest:
        groups.append(rest)
    shapes = {n: shapes_all[n] for g in groups for n in g}

    def read(keep: list[str]) -> dict[str, torch.Tensor]:
        targets = {n: torch.empty(shapes[n][0], dtype=shapes[n][1]) for n in keep}
        checkpoint.read_tensors(folder, targets)
        return targets

    return Source(shapes, groups, read, str(folder))


def merge_weights(program_dir: str | os.PathLike[str], weights_dir: str | os.PathLike[str],
                  atol: float = 1e-6) -> dict[str, torch.Tensor]:
    """``{original name: tensor}`` from the per-rank files ``stage_K.rank_R.pt`` in ``weights_dir``."""
    merged: dict[str, torch.Tensor] = {}
    for part in save_final_source(program_dir, weights_dir, atol).stream():
        merged.update(part)
    return merged


def program_beside(weights_dir: str | os.PathLike[str]) -> Path | None:
    """The emitted program a ``--save-final`` folder belongs to when ``run()`` wrote both: ``RUN/program``
    beside ``RUN/final``; None where there is none."""
    prog = Path(weights_dir).resolve().parent / "program"
    return prog if (prog / "plan.json").is_file() else None


@dataclass(frozen=True)
class Written:
    """What :func:`save_file` or :func:`save_folder` wrote: the files, the tensors and their bytes, the
    tensors left out (those a Hugging Face model does not save) and the files copied from ``like``."""

    files: list[Path]
    tensors: int
    nbytes: int
    dropped: list[str]
    copied: list[Path]


def save_file(source: Source, out: str | os.PathLike[str], safetensors: bool = True) -> Written:
    """``source`` as one ``torch.save``'d state dict at ``out`` (a ``.pt`` file) and, with ``safetensors``,
    the same tensors in ``out`` with the suffix ``.safetensors`` beside it; each file written whole or not at all."""
    out = Path(out)
    merged: dict[str, torch.Tensor] = {}
    for part in source.stream():
        merged.update({k: v.contiguous() for k, v in part.items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.atomic_save(merged, out)
    files = [out]
    if safetensors:
        from safetensors.torch import save as st_save

        checkpoint.atomic_write(out.with_suffix(".safetensors"), st_save(merged))
        files.append(out.with_suffix(".safetensors"))
    return Written(files, len(merged), sum(t.numel() * t.element_size() for t in merged.values()), [], [])


def save_folder(source: Source, out: str | os.PathLike[str], max_shard_size: int | str = "5GB",
                like: str | os.PathLike[str] | None = None) -> Written:
    """``source`` into the folder ``out`` in Hugging Face's layout (:func:`write_hf`); ``like``: a Hugging
    Face model folder whose config and tokenizer files are copied beside the weights, and whose model's
    saved tensors are the ones written (a tied copy once), so ``from_pretrained(out)`` loads it. A
    ``like`` without config.json is refused before anything is written."""
    size = parse_size(max_shard_size)
    if like is not None:
        like_files(like)
    names, dropped = None, []
    hf = hf_names(like) if like is not None else None
    if hf is not None:
        names = [n for n in source.shapes if n in hf]
        dropped = sorted(set(source.shapes) - hf)
    files = write_hf(source, out, size, names)
    copied = copy_like(like, out) if like is not None else []
    kept = names if names is not None else list(source.shapes)
    return Written(files, len(kept), sum(_nbytes(*source.shapes[k]) for k in kept), dropped, copied)


# --- safetensors in Hugging Face's layout -----------------------------------------------------

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
           torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def parse_size(text: str | int) -> int:
    """``"5GB"`` (10**9, as Hugging Face counts), ``"500MiB"``, ``"100kB"`` or a number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise UsageError(f"--max-shard-size {text!r}: a size such as 5GB, 500MB, 2GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[unit])


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def shard_plan(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], max_shard_size: int) -> list[list[str]]:
    """Tensors in order into shards of at most ``max_shard_size`` bytes (a bigger tensor alone), as
    Hugging Face's ``save_pretrained`` cuts them."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in shapes.items():
        b = _nbytes(shape, dtype)
        if shards[-1] and size + b > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += b
    return shards


def _header(names: list[str], shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> bytes:
    """A safetensors header: each tensor's dtype, shape and byte range, in ``names`` order; padded to 8."""
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for n in names:
        shape, dtype = shapes[n]
        if dtype not in _DTYPES:
            raise UsageError(f"{n}: dtype {dtype} has no safetensors name")
        b = _nbytes(shape, dtype)
        head[n] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + b]}
        offset += b
    data = json.dumps(head, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)
    return struct.pack("<Q", len(data)) + data


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_hf(source: Source, out: str | os.PathLike[str], max_shard_size: int | str = "5GB",
             names: Iterable[str] | None = None) -> list[Path]:
    """Write ``source`` into the folder ``out`` in Hugging Face's layout; return the files written.

    Files go to temporary names and are renamed once all are whole (a failure leaves none).
    ``names``: only these tensors (e.g. those a Hugging Face model saves; default all).
    """
    keep = set(names) if names is not None else None
    shapes = {n: s for n, s in source.shapes.items() if keep is None or n in keep}
    if not shapes:
        raise CheckpointError(f"{source.where}: no tensors to write")
    shards = shard_plan(shapes, parse_size(max_shard_size))
    files = [WEIGHTS] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = {f: out / f".{f}.tmp.{os.getpid()}" for f in files}
    file_of = {n: i for i, shard in enumerate(shards) for n in shard}
    written: list[Path] = []
    handles: dict[int, Any] = {}
    try:
        pending = {i: list(shard) for i, shard in enumerate(shards)}
        for part in source.stream(set(shapes)):
            for n in [n for n in shapes if n in part]:  # the header's order
                i = file_of[n]
                if i not in handles:
                    handles[i] = open(tmp[files[i]], "wb")
                    handles[i].write(_header(shards[i], shapes))
                if pending[i][0] != n:
                    raise CheckpointError(f"{source.where}: {n} read out of order (expected {pending[i][0]})")
                pending[i].pop(0)
                t = part[n]
                if (tuple(t.shape), t.dtype) != shapes[n]:
                    raise CheckpointError(f"{source.where}: {n} is {tuple(t.shape)} {t.dtype}, its index says "
                                          f"{shapes[n][0]} {shapes[n][1]}")
                handles[i].write(_raw(t))
                if not pending[i]:
                    handles[i].flush()
                    os.fsync(handles[i].fileno())
                    handles.pop(i).close()
            del part
        left = [n for p in pending.values() for n in p]
        if left:
            raise CheckpointError(f"{source.where}: tensors {left[:3]} were never read")
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(_nbytes(*shapes[n]) for n in shapes)},
                     "weight_map": {n: files[file_of[n]] for n in sorted(shapes)}}
            checkpoint.atomic_write(out / INDEX, json.dumps(index, indent=2).encode())
            written.append(out / INDEX)
        for f in files:
            os.replace(tmp[f], out / f)
            written.append(out / f)
    finally:
        for h in handles.values():
            h.close()
        for p in tmp.values():
            if p.exists():
                p.unlink()
    return written


# --- --like: a Hugging Face folder's config and tokenizer -------------------------------------

_WEIGHT_FILE = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.ckpt|\.h5|\.msgpack|\.index\.json|\.distcp)$")


def like_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The files of a Hugging Face model folder other than weights: config, generation config, tokenizer."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UsageError(f"--like {folder}: no config.json. Fix: give a Hugging Face model folder (save_pretrained's)")
    return sorted(p for p in folder.iterdir() if p.is_file() and not _WEIGHT_FILE.search(p.name)
                  and not p.name.startswith("."))


def hf_names(folder: str | os.PathLike[str]) -> set[str] | None:
    """The tensor names a Hugging Face model of ``folder``'s config saves (``state_dict`` less the tied
    copies ``save_pretrained`` drops), from the model built on the meta device; None where transformers
    can't build it."""
    try:
        import transformers
    except ImportError:
        return None
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder))
        cls = getattr(transformers, (config.architectures or [""])[0])
        with torch.device("meta"):
            model = cls(config)
    except Exception:  # noqa: BLE001 - any model we can't build: write every tensor
        return None
    seen: dict[int, str] = {}
    names = set()
    for n, t in model.state_dict(keep_vars=True).items():
        first = seen.setdefault(id(t), n)
        if first == n:
            names.add(n)
    return names


def copy_like(folder: str | os.PathLike[str], out: str | os.PathLike[str]) -> list[Path]:
    """Copy :func:`like_files` of ``folder`` into ``out``."""
    copied = []
    for p in like_files(folder):
        shutil.copy2(p, Path(out) / p.name)
        copied.append(Path(out) / p.name)
    return copied
