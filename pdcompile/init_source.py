"""plan.json's ``init``: where each rank's stage weights come from (read by ``runtime/sources.py``).

A model with real weights keeps the emitted ``stage_K.pt`` (``{"source": "weights"}``). A model on the
meta device has no values to write: its ranks either read a checkpoint (``init_from=PATH``,
``"pretrained"``) or run the model's own initialisers stage by stage (``"fresh"``). For the latter the
entry records how a rank rebuilds each owning module on the meta device: a Hugging Face model's class
and config (its ``_init_weights`` then initialises any of its modules), else each owning module's class
and constructor arguments (its ``reset_parameters()`` initialises it). A meta tensor that neither can
fill is a :class:`UsageError` here, at compile time, not on the ranks.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from pdcompile.errors import UsageError
from pdcompile.passes.codegen import class_path, object_spec
from pdcompile.passes.split_stages import StageSplit


def has_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device (no values to emit)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _is_hf(m: torch.nn.Module) -> bool:
    """A Hugging Face PreTrainedModel (duck-typed: transformers need not be installed)."""
    return (hasattr(m, "_init_weights") and hasattr(type(m), "config_class")
            and callable(getattr(getattr(m, "config", None), "to_json_string", None)))


def _hf_models(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The outermost Hugging Face models in ``model``, by qualified name ("" for the model itself)."""
    if _is_hf(model):
        return {"": model}
    out: dict[str, torch.nn.Module] = {}
    for name, m in model.named_modules():
        if name and _is_hf(m) and not any(name.startswith(p + ".") for p in out):
            out[name] = m
    return out


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def _under(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def init_entry(model: torch.nn.Module, split: StageSplit, init_from: str | os.PathLike[str] | None,
               seed: int = 0) -> dict[str, Any]:
    """The ``init`` entry of plan.json for ``model`` compiled into ``split``, with the checkpoint
    ``init_from`` if given. Raises :class:`UsageError` for meta tensors no source can fill."""
    meta = has_meta(model)
    if not meta and init_from is None:
        return {"source": "weights"}
    names = sorted({orig for st in split.stages for orig in st.param_names.values()})
    canonical = {id(t): n for n, t in itertools.chain(model.named_parameters(), model.named_buffers())}
    saved = model.state_dict(keep_vars=True)
    aliases: dict[str, list[str]] = {}
    for key, t in saved.items():
        c = canonical.get(id(t))
        if c is not None and c != key:
            aliases.setdefault(c, []).append(key)
    not_saved = [n for n in names if n not in saved and n not in aliases]
    entry: dict[str, Any] = {"source": "pretrained" if init_from is not None else "fresh", "seed": seed,
                             "aliases": aliases, "not_in_state_dict": not_saved}
    if init_from is not None:
        entry["path"] = str(Path(init_from).resolve())
        _check_checkpoint(model, init_from, [n for n in names if n not in not_saved], aliases)
    if meta:
        fresh = not_saved if init_from is not None else names
        entry.update(_initialisers(model, fresh))
        values = _small_values(model, entry, not_saved)
        if values:
            entry["values"] = values
    return entry


MAX_VALUE_ELEMENTS = 4096  # plan.json stays small: rotary frequencies are head_dim / 2 numbers


def _small_values(model: torch.nn.Module, entry: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The values of the small buffers among ``names`` (kept out of the state_dict, so no checkpoint holds
    them) whose initialiser does not depend on the seed, made here by the ranks' own code
    (``runtime/sources.py`` ``FreshInit``, under two seeds: kept where both agree). A rank filled from a
    checkpoint then needs no initialiser: it neither imports the model's library (transformers: ~80 MiB
    of a rank's memory) nor builds the model on meta."""
    from pdcompile.runtime.sources import FreshInit

    buffers = dict(model.named_buffers())
    small = [n for n in names if n in buffers and buffers[n].numel() <= MAX_VALUE_ELEMENTS]
    if not small:
        return {}
    hf = _hf_models(model).get(str((entry.get("hf") or {}).get("prefix", "")))
    made: list[dict[str, torch.Tensor]] = []
    for seed in (0, 1):
        fresh = FreshInit({**entry, "seed": seed}, hf_model=hf)
        try:
            made.append({n: t.clone() for n, t in fresh.tensors(small)})
        except Exception:  # noqa: BLE001 - any initialiser's failure: the ranks run it themselves and report it
            return {}
    out: dict[str, Any] = {}
    total = 0
    for n in small:
        a, b = made[0][n], made[1][n]
        if torch.equal(a, b) and total + a.numel() <= MAX_VALUE_ELEMENTS:
            total += a.numel()
            out[n] = {"dtype": str(a.dtype).replace("torch.", ""), "shape": list(a.shape), "data": a.tolist()}
    return out


def _initialisers(model: torch.nn.Module, names: Iterable[str]) -> dict[str, Any]:
    """How a rank rebuilds and initialises the modules owning ``names``: ``hf`` (a Hugging Face model's
    class, config and place in ``model``) and ``owners`` (other modules' class and arguments)."""
    hf = _hf_models(model)
    out: dict[str, Any] = {}
    owners: dict[str, Any] = {}
    for name in names:
        owner = _owner(name)
        prefix = next((p for p in hf if _under(owner, p)), None)
        if prefix is not None:
            m = hf[prefix]
            out.setdefault("hf", {"class": class_path(type(m)), "prefix": prefix,
                                  "config": json.loads(getattr(m, "config").to_json_string(use_diff=False))})
            if out["hf"]["prefix"] != prefix:
                raise UsageError(f"pdcompile: the model holds several Hugging Face models ({', '.join(hf)}) on the "
                                 f"meta device; a fresh initialisation supports one. Fix: init_from=PATH (a "
                                 f"checkpoint), or build the model with real weights")
            continue
        if owner in owners:
            continue
        module = model.get_submodule(owner)
        if not callable(getattr(module, "reset_parameters", None)):
            raise UsageError(f"pdcompile: {name!r} is on the meta device and nothing can fill it: its module "
                             f"{owner or 'the model'} ({type(module).__name__}) has no reset_parameters(). Fix: "
                             f"pass init_from=PATH (a checkpoint of the model), define "
                             f"{type(module).__name__}.reset_parameters(), or build the model with real weights")
        with torch.device("meta"):  # object_spec rebuilds it to check: no storage needed
            owners[owner] = object_spec(module).to_json()
    if owners:
        out["owners"] = owners
    return out


def _check_checkpoint(model: torch.nn.Module, init_from: str | os.PathLike[str], names: list[str],
                      aliases: dict[str, list[str]]) -> None:
    """The checkpoint opens and holds every tensor the stages will read, in the model's shapes (its
    headers only): a bad ``init_from`` is refused here rather than on every rank."""
    from pdcompile.runtime.sources import locate, open_checkpoint

    reader = open_checkpoint(init_from)
    own = dict(itertools.chain(model.named_parameters(), model.named_buffers()))
    locate(reader, {n: own[n] for n in names}, aliases, stage=-1)
