"""Merge the weights of every stage (and replica) back under the original model's parameter names.

A parameter tied across stages (or held by every replica of a stage) is stored once; its copies
are checked to be equal, since the runtime keeps them in sync.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from pdcompile.errors import CheckpointError
from pdcompile.runtime.checkpoint import load_tensors

_FILE = re.compile(r"^stage_(\d+)\.rank_(\d+)\.pt$")


def merge_weights(program_dir: str | os.PathLike[str], weights_dir: str | os.PathLike[str],
                  atol: float = 1e-6) -> dict[str, torch.Tensor]:
    """``{original name: tensor}`` from the per-rank files ``stage_K.rank_R.pt`` in ``weights_dir``."""
    plan = json.loads((Path(program_dir) / "plan.json").read_text())
    names = {st["index"]: st["param_names"] for st in plan["stages"]}
    merged: dict[str, torch.Tensor] = {}
    files = sorted(p for p in Path(weights_dir).iterdir() if _FILE.match(p.name))
    if not files:
        raise CheckpointError(f"{weights_dir}: no stage_K.rank_R.pt files. Fix: point at the folder given to "
                              f"train.py --save-final (or a checkpoint folder)")
    seen_stages = set()
    for path in files:
        stage = int(_FILE.match(path.name).group(1))  # type: ignore[union-attr]  # names were filtered by _FILE
        seen_stages.add(stage)
        tensors = load_tensors(path)
        for local, t in tensors.items():
            orig = names[stage].get(local)
            if orig is None:
                continue
            if orig in merged:
                if not torch.allclose(merged[orig], t, atol=atol, rtol=0):
                    raise CheckpointError(f"{path}: copies of {orig!r} differ between stages/replicas "
                                          f"(max diff {(merged[orig] - t).abs().max().item():.3g})")
                continue
            merged[orig] = t
    missing = set(names) - seen_stages
    if missing:
        raise CheckpointError(f"{weights_dir}: no weights for stages {sorted(missing)}")
    return merged
