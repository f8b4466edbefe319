"""Where a rank's stage weights come from, and filling a stage from there without the whole model.

plan.json's ``init`` says it (written by :mod:`pdcompile.init_source`):

- ``"weights"`` (a model compiled with real weights): the emitted ``stage_K.pt``, as always;
- ``"fresh"`` (a meta model, no checkpoint): each of the stage's tensors is made by its owning module's
  own initialiser (``reset_parameters()``, or a Hugging Face model's ``_init_weights``), run on a CPU copy
  of that module alone, seeded from ``(seed, the module's original name)``: a seed gives the same initial
  weights under every plan, stage count and replica;
- ``"pretrained"`` (``init_from=PATH``): the stage's tensors read under the original model's names from
  PATH, lazily: a safetensors file (a file, an HF folder's ``model.safetensors`` or shards with
  ``model.safetensors.index.json``; headers by ``safe_open``, each tensor read with plain reads into the
  stage's own tensor), ``torch.load(mmap=True)`` (a ``torch.save``d state_dict), or
  torch.distributed.checkpoint's ``load`` of only the stage's keys (a DCP folder). A tensor the model keeps
  out of its state_dict (a non-persistent buffer such as rotary frequencies) comes from plan.json's
  ``values`` (made at compile time when small and the same under every seed), else its initialiser.

The stage module is built on the meta device, given storage on the rank's device with ``to_empty``,
and every tensor filled (dtypes cast: a bf16 checkpoint into fp32 master weights). A tensor no source
fills is an error: a meta tensor never reaches training. Only torch and safetensors here.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import hashlib
import importlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from pdcompile.errors import CheckpointError, UsageError

SOURCES = ("weights", "fresh", "pretrained")
_NO_WEIGHTS_FIX = ("Fix: give init_from a Hugging Face model folder (model.safetensors, or shards with "
                   "model.safetensors.index.json), a .safetensors file, a torch.save'd state_dict, or a "
                   "torch.distributed.checkpoint folder")


def source_of(init: Mapping[str, Any] | None, init_from: str | None) -> str:
    """Which source fills the stages: ``init_from`` (a flag, or plan.json's path) wins, then plan.json's."""
    if init_from:
        return "pretrained"
    return str((init or {}).get("source", "weights"))


def param_seed(seed: int, name: str) -> int:
    """The seed of the module named ``name`` (its original qualified name): the same on every rank,
    under every plan."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


# -- reading a checkpoint lazily --------------------------------------------------------------------

class Reader(Protocol):
    path: Path

    def shape(self, name: str) -> tuple[int, ...] | None: ...

    def read(self, names: list[str], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


def _unreadable(path: Path, e: BaseException) -> CheckpointError:
    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CheckpointError(f"init_from: {path} can't be read ({type(e).__name__}: {why}); it may be truncated "
                           f"or not a checkpoint. Fix: save or download it again")


class SafetensorsReader:
    """One or several ``.safetensors`` files (an index's shards), opened lazily: a tensor is read only
    when asked for."""

    def __init__(self, path: Path, files: Mapping[str, Path] | None = None) -> None:
        from safetensors import safe_open

        self.path = path
        self._where: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._offsets: dict[Path, dict[str, tuple[int, int, torch.dtype]]] = {}
        for f in sorted(set(files.values())) if files is not None else [path]:
            try:
                with safe_open(str(f), framework="pt", device="cpu") as h:
                    for k in h.keys():
                        self._where[k] = f
                        self._shapes[k] = tuple(h.get_slice(k).get_shape())
            except FileNotFoundError:
                raise CheckpointError(f"init_from: {path} names the shard {f.name}, which is not there. "
                                      f"Fix: download every shard the index names") from None
            except Exception as e:  # noqa: BLE001 - safetensors' own error types vary by version
                raise _unreadable(f, e) from None

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self._shapes.get(name)

    def read(self, names: list[str], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        out: dict[str, torch.Tensor] = {}
        for f in sorted({self._where[n] for n in names}):
            try:
                with safe_open(str(f), framework="pt", device="cpu") as h:
                    for n in names:
                        if self._where[n] == f:
                            out[n] = h.get_tensor(n)
            except Exception as e:  # noqa: BLE001
                raise _unreadable(f, e) from None
        return out


    def read_spans(self, name: str, dim: int, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The pieces ``(start, length)`` along ``dim`` of tensor ``name``, concatenated: a tensor-parallel
        process's part, read as slices (safetensors' ``get_slice``) without the whole tensor."""
        from safetensors import safe_open

        f = self._where[name]
        try:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                sl = h.get_slice(name)
                parts = [sl[(slice(None),) * dim + (slice(a, a + n),)] for a, n in spans]
        except Exception as e:  # noqa: BLE001
            raise _unreadable(f, e) from None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def copy_into(self, name: str, dest: torch.Tensor, chunk_bytes: int = 16 << 20) -> None:
        """Copy tensor ``name`` into ``dest`` (casting), read from the file with plain reads: straight into
        ``dest``'s memory when the dtypes agree, else through a buffer of about ``chunk_bytes`` (rows of
        dim 0). No mapping of the file: a mapped file's pages count in the process's RSS while mapped (a
        rank would hold its largest tensor twice); read pages stay in the page cache, not the process."""
        f = self._where[name]
        try:
            if f not in self._offsets:
                self._offsets[f] = _data_offsets(f)
            begin, end, dtype = self._offsets[f][name]
        except Exception as e:  # noqa: BLE001 - a header the safe_open above accepted, but damaged
            raise _unreadable(f, e) from None
        if end - begin != dest.numel() * torch.empty((), dtype=dtype).element_size():
            raise _unreadable(f, ValueError(f"{name!r} holds {end - begin} bytes, not {dest.numel()} {dtype}"))
        try:
            with open(f, "rb", buffering=0) as h:
                if dtype == dest.dtype and dest.is_contiguous() and dest.device.type == "cpu":
                    _read_exactly(h, begin, _bytes_of(dest))
                    return
                flat = dest.reshape(-1) if dest.is_contiguous() else None
                row = max(1, dest[0].numel() if dest.dim() else 1)
                src_row_bytes = (end - begin) // max(1, dest.shape[0] if dest.dim() else 1)
                rows = dest.shape[0] if dest.dim() else 1
                step = max(1, chunk_bytes // max(1, src_row_bytes))
                buf = bytearray(min(rows, step) * src_row_bytes)
                for i in range(0, rows, step):
                    n = min(step, rows - i)
                    view = memoryview(buf)[:n * src_row_bytes]
                    _read_exactly(h, begin + i * src_row_bytes, view)
                    part = torch.frombuffer(view, dtype=dtype)
                    if flat is not None:
                        flat[i * row:(i + n) * row].copy_(part)
                    elif dest.dim():
                        dest[i:i + n].copy_(part.view(n, *dest.shape[1:]))
                    else:
                        dest.copy_(part.view(()))
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _unreadable(f, e) from None


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _data_offsets(path: Path) -> dict[str, tuple[int, int, torch.dtype]]:
    """A safetensors file's tensors: absolute ``(begin, end)`` byte offsets and dtype, from its header (an
    8-byte little-endian length, then JSON; the data follows it: the format's own definition)."""
    with open(path, "rb") as h:
        n = int.from_bytes(h.read(8), "little")
        header = json.loads(h.read(n))
    base = 8 + n
    return {k: (base + v["data_offsets"][0], base + v["data_offsets"][1], _ST_DTYPES[v["dtype"]])
            for k, v in header.items() if k != "__metadata__"}


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, writable, as bytes (through ctypes: no numpy needed); valid while
    ``t`` lives."""
    raw = (ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return memoryview(raw).cast("B")


def _read_exactly(h: Any, offset: int, into: memoryview) -> None:
    """Fill ``into`` from byte ``offset`` of the open file ``h`` (short reads continued; end of file is an
    error: a truncated file)."""
    h.seek(offset)
    got = 0
    while got < len(into):
        n = h.readinto(into[got:])
        if not n:
            raise EOFError(f"the file ends {len(into) - got} bytes early")
        got += n


class TorchSaveReader:
    """A ``torch.save``d state_dict, memory-mapped (``torch.load(mmap=True)``): pages are read only for
    the tensors used."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            sd = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001
            raise _unreadable(path, e) from None
        if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
            sd = sd["state_dict"]
        if not isinstance(sd, dict):
            raise CheckpointError(f"init_from: {path} holds a {type(sd).__name__}, not a state_dict. Fix: "
                                  f"torch.save(model.state_dict(), PATH)")
        self._sd: dict[str, Any] = sd

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self._sd.get(name)
        return tuple(t.shape) if isinstance(t, torch.Tensor) else None

    def read(self, names: list[str], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: self._sd[n] for n in names}


class DCPReader:
    """A torch.distributed.checkpoint folder: ``load`` of a state_dict holding only the stage's keys
    (``no_dist``: each rank reads its own part, no collective)."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.path = path
        try:
            self._meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception as e:  # noqa: BLE001
            raise _unreadable(path / ".metadata", e) from None

    def shape(self, name: str) -> tuple[int, ...] | None:
        m = self._meta.get(name)
        size = getattr(m, "size", None)
        return tuple(size) if size is not None else None

    def read(self, names: list[str], like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        sd = {n: torch.empty(tuple(self._meta[n].size), dtype=self._meta[n].properties.dtype)  # type: ignore[union-attr]
              for n in names}
        try:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
                dcp.load(sd, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
        except Exception as e:  # noqa: BLE001
            raise _unreadable(self.path, e) from None
        return sd


def open_checkpoint(path: str | os.PathLike[str]) -> Reader:
    """The reader of ``path``, by what it is; a path with no weights is a :class:`UsageError`."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"init_from: {p} does not exist. {_NO_WEIGHTS_FIX}")
    if p.is_dir():
        index = p / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise _unreadable(index, e) from None
            return SafetensorsReader(p, {k: p / f for k, f in weight_map.items()})
        if (p / "model.safetensors").is_file():
            return SafetensorsReader(p / "model.safetensors")
        if (p / ".metadata").is_file():
            return DCPReader(p)
        if (p / "pytorch_model.bin").is_file():
            return TorchSaveReader(p / "pytorch_model.bin")
        raise UsageError(f"init_from: the folder {p} holds no weights (no model.safetensors, "
                         f"model.safetensors.index.json, pytorch_model.bin or torch.distributed.checkpoint "
                         f".metadata). {_NO_WEIGHTS_FIX}")
    if p.suffix == ".safetensors":
        return SafetensorsReader(p)
    return TorchSaveReader(p)


def check_init_from(init_from: str | None) -> None:
    """Before any process group: ``init_from`` names a checkpoint that can be opened (a
    :class:`UsageError`, said once by rank 0, rather than the same error on every rank later)."""
    if not init_from:
        return
    try:
        open_checkpoint(init_from)
    except CheckpointError as e:
        raise UsageError(str(e)) from None


def locate(reader: Reader, wanted: Mapping[str, torch.Tensor], aliases: Mapping[str, list[str]],
           stage: int) -> dict[str, str]:
    """Where each tensor of ``wanted`` (original name -> the stage's tensor, for its shape) is in
    ``reader``: under its name or one of its ``aliases`` (tied names). From the headers only; a missing
    tensor or another shape is a :class:`CheckpointError` naming it (``stage`` -1: the whole model's,
    checked at compile time)."""
    who = f"stage {stage}" if stage >= 0 else "the model"
    found: dict[str, str] = {}
    for name, t in wanted.items():
        key = next((k for k in (name, *aliases.get(name, ())) if reader.shape(k) is not None), None)
        if key is None:
            raise CheckpointError(f"init_from: {reader.path} has no tensor {name!r}, which {who} needs. "
                                  f"Fix: init_from a checkpoint of this model (saved from its state_dict() or "
                                  f"with save_pretrained)")
        shape = reader.shape(key)
        if shape != tuple(t.shape):
            raise CheckpointError(f"init_from: tensor {key!r} in {reader.path} has shape {list(shape or ())}, "
                                  f"{who} needs {list(t.shape)}. Fix: init_from a checkpoint of the "
                                  f"same model configuration")
        found[name] = key
    return found


# -- fresh initialisation by the owning modules -----------------------------------------------------

def _import(path: str) -> Any:
    mod, _, name = path.rpartition(".")
    obj: Any = importlib.import_module(mod)
    return getattr(obj, name)


class FreshInit:
    """Makes a stage's tensors the way the model's own initialisation does, one owning module at a time:
    the owner rebuilt on the meta device (from its class and arguments, or a Hugging Face model built
    from its config on meta), given CPU storage (``to_empty``), initialised under its own seed."""

    def __init__(self, init: Mapping[str, Any], hf_model: torch.nn.Module | None = None) -> None:
        """``hf_model``: the Hugging Face model ``init["hf"]`` describes, already built (on meta, in the
        compiling process): its owning modules are copied, not rebuilt, and the model is left as it was."""
        self.seed = int(init.get("seed", 0))
        self.owners: dict[str, dict[str, Any]] = dict(init.get("owners") or {})
        self.hf: dict[str, Any] | None = init.get("hf")
        self._hf_model: torch.nn.Module | None = hf_model
        self._copy = hf_model is not None

    def _hf(self) -> torch.nn.Module:
        if self._hf_model is None:
            assert self.hf is not None
            cls = _import(self.hf["class"])
            config = cls.config_class.from_dict(self.hf["config"])
            with torch.device("meta"):
                self._hf_model = cls(config)
        return self._hf_model

    def _owner(self, name: str) -> tuple[torch.nn.Module, Any]:
        """The module called ``name`` in the original model (on meta), and its initialiser."""
        spec = self.owners.get(name)
        if spec is not None:
            with torch.device("meta"):
                module: torch.nn.Module = _import(spec["class"])(**spec.get("kwargs", {}))
            return module, lambda m: m.reset_parameters()
        prefix = str((self.hf or {}).get("prefix", ""))
        if self.hf is None or not (prefix == "" or name == prefix or name.startswith(prefix + ".")):
            raise UsageError(f"stage tensors of module {name!r} are on the meta device and nothing fills them. "
                             f"Fix: init_from=PATH (a checkpoint), or give the module reset_parameters()")
        model = self._hf()
        name = name[len(prefix):].lstrip(".")
        module = model.get_submodule(name)
        if self._copy:  # another's model: initialise a copy of the module (on meta: no storage copied)
            module = copy.deepcopy(module)
        hf_owner = model  # the nearest enclosing PreTrainedModel dispatches its own _init_weights
        parts = name.split(".") if name else []
        for i in range(len(parts), 0, -1):
            m = model.get_submodule(".".join(parts[:i]))
            if hasattr(m, "_init_weights") and hasattr(m, "config"):
                hf_owner = m
                break
        return module, getattr(hf_owner, "_init_weights")

    def tensors(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(original name, CPU tensor)`` for ``names``, each from its owning module's initialiser, one
        owning module at a time (a stage never holds a second copy of itself)."""
        by_owner: dict[str, list[str]] = {}
        for n in names:
            owner, _, _ = n.rpartition(".")
            by_owner.setdefault(owner, []).append(n)
        for owner, members in sorted(by_owner.items()):
            module, init = self._owner(owner)
            module.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                    if hasattr(t, "_is_hf_initialized"):  # a Hugging Face flag that would make its init skip it
                        t._is_hf_initialized = False
                    if t.is_floating_point():
                        t.fill_(float("nan"))  # what the initialiser leaves unset shows as NaN below
            with _seeded(param_seed(self.seed, owner)), torch.no_grad():
                init(module)
            own: dict[str, torch.Tensor] = dict(module.named_parameters(recurse=False))
            own.update(dict(module.named_buffers(recurse=False)))
            for n in members:
                made = own.get(n.rpartition(".")[2])
                if made is None or made.is_meta or (made.is_floating_point() and bool(torch.isnan(made).any())):
                    raise UsageError(f"stage tensor {n!r} is on the meta device and its module's initialiser "
                                     f"({type(module).__name__}) does not set it. Fix: init_from=PATH (a "
                                     f"checkpoint of the model), or build the model with real weights")
                yield n, made.detach()  # copied into the stage before the next is made
            module.to_empty(device="meta", recurse=False)  # the owner's CPU copy freed


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def given_values(init: Mapping[str, Any], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``names`` that plan.json's ``init["values"]`` holds (``{name: {"dtype", "shape",
    "data"}}``: small buffers no checkpoint holds, such as rotary frequencies, made once at compile time by
    the same initialiser: :func:`pdcompile.init_source.init_entry`). A rank that finds all of its stage's
    tensors there or in the checkpoint never imports the model's library nor builds its model on meta."""
    values: Mapping[str, Any] = init.get("values") or {}
    for n in names:
        v = values.get(n)
        if v is not None:
            yield n, torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])


# -- filling a stage ------------------------------------------------------------------------------

def _storage(t: torch.Tensor) -> torch.Tensor:
    """What holds ``t``'s values on this process: a DTensor's local tensor (tensor parallelism), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def stage_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers by local name, shared ones under each of their names."""
    own: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    own.update(dict(module.named_buffers(remove_duplicate=False)))
    return own


def fill_stage(module: torch.nn.Module, stage: int, param_names: Mapping[str, str], init: Mapping[str, Any],
               init_from: str | None, reader: Reader | None = None, rest_fresh: bool = True,
               layouts: Mapping[str, Any] | None = None) -> None:
    """Fill every tensor of ``module`` (materialised, uninitialised) from its source: the checkpoint at
    ``init_from`` for what the model's state_dict holds, the owning modules' initialisers for the rest
    (or everything, with no ``init_from``). ``rest_fresh=False``: the module already holds its emitted
    weights; only the checkpoint's tensors are copied in. ``layouts`` (tensor parallelism, local name ->
    runtime/tensor_parallel.py's ``Layout``): a split tensor gets only this process's part, read as slices
    from a safetensors file, else cut from the tensor read (a DTensor left whole gets the whole tensor)."""
    own = stage_tensors(module)
    layouts = layouts or {}
    unnamed = sorted(set(own) - set(param_names))
    if unnamed and rest_fresh:
        raise UsageError(f"stage {stage}: tensors {unnamed} are not the model's own (tensor constants made while "
                         f"tracing) and are on the meta device. Fix: compile the model with real weights")
    locals_of: dict[str, list[str]] = {}
    for local, orig in param_names.items():
        locals_of.setdefault(orig, []).append(local)
    done: set[str] = set()

    def put(orig: str, value: torch.Tensor) -> None:
        with torch.no_grad():
            for local in locals_of[orig]:
                lay = layouts.get(local)
                # casts: a bf16 checkpoint into fp32 master weights
                _storage(own[local]).copy_(lay.local(value) if lay is not None else value)
        done.add(orig)

    if init_from:  # tensor by tensor: a rank holds its stage and one tensor read, never a whole file
        not_saved = set(init.get("not_in_state_dict") or ())
        reader = reader if reader is not None else open_checkpoint(init_from)
        keys = locate(reader, {n: own[ls[0]] for n, ls in locals_of.items() if n not in not_saved},
                      init.get("aliases") or {}, stage)
        for orig, key in keys.items():
            split = [ls for ls in locals_of[orig] if ls in layouts]
            lay = layouts[split[0]] if split else None
            if lay is not None and isinstance(reader, SafetensorsReader) and \
                    all(layouts.get(ls) == lay for ls in locals_of[orig]):  # this process's slices alone
                part = reader.read_spans(key, lay.dim, lay.spans(own[split[0]].shape[lay.dim]))
                with torch.no_grad():
                    for local in locals_of[orig]:
                        _storage(own[local]).copy_(part)
                done.add(orig)
            elif split:  # cut from the tensor read (mapped: a torch.save'd file's pages read are the slice's)
                put(orig, reader.read([key], {})[key])
            elif isinstance(reader, SafetensorsReader):  # sliced: no whole copy of a big tensor
                first, *more = locals_of[orig]
                with torch.no_grad():
                    reader.copy_into(key, _storage(own[first]))
                    for local in more:
                        _storage(own[local]).copy_(_storage(own[first]))
                done.add(orig)
            else:
                put(orig, reader.read([key], {})[key])
    rest = [n for n in locals_of if n not in done]
    if rest and rest_fresh:
        for orig, value in given_values(init, rest):  # small buffers made at compile time: no initialiser here
            put(orig, value)
        rest = [n for n in rest if n not in done]
    if rest and rest_fresh:
        for orig, value in FreshInit(init).tensors(rest):
            put(orig, value)
