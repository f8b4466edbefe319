"""``pdcompile merge``: a checkpoint's stage weights as one state dict under the original model's names."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pdcompile.errors import CheckpointError, UsageError

EXAMPLES = """\
Examples:
  pdcompile merge ckpt/ -o model.pt                   newest complete checkpoint in ckpt/
  pdcompile merge ckpt/step_00000100 -o model.pt      that checkpoint
  pdcompile merge results/final --program out/ -o model.pt   weights from train.py --save-final

A checkpoint is verified first (manifest complete, every checksum matching) and merged with the
plan.json stored in it. Parameters tied across stages, or held by every replica of a stage,
appear once. Besides the .pt file (torch.save of {name: tensor}; load it with
torch.load(path, weights_only=True)), a .safetensors file is written when safetensors is installed."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "merge", help="merge a checkpoint's per-stage weights into one state dict of the original model",
        description="Merge the weights of every stage and replica of a checkpoint (or of train.py "
                    "--save-final) back under the original model's parameter names.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                   help="a --checkpoint-dir (its newest complete checkpoint), one step_NNNNNNNN folder, or a "
                        "--save-final folder (then give --program)")
    p.add_argument("-o", "--output", required=True, metavar="PATH", help="the merged .pt file to write")
    p.add_argument("--program", metavar="DIR", help="the emitted program folder (plan.json); default: the "
                   "copy inside the checkpoint")
    p.add_argument("--no-safetensors", action="store_true", help="write only the .pt file")
    p.set_defaults(func=run)


def resolve(path: str | Path) -> Path:
    """The folder to merge: a step folder, the newest complete one under a checkpoint dir, or ``path``."""
    from pdcompile.runtime import checkpoint

    folder = Path(path)
    if not folder.is_dir():
        raise UsageError(f"{folder}: no such folder. Fix: give train.py's --checkpoint-dir or a step folder in it")
    if checkpoint._STEP_DIR.match(folder.name):
        checkpoint.read_manifest(folder)  # a step folder must be complete (raises CheckpointError)
        return folder
    if (folder / checkpoint.MANIFEST).is_file() or any(folder.glob("stage_*.rank_*.pt")):
        return folder
    found = checkpoint.checkpoints(folder)
    newest = checkpoint.latest(folder)
    if newest is None:
        raise CheckpointError(f"{folder}: no complete checkpoint ({len(found)} step folders, none with a "
                              f"manifest). Fix: point at a folder written by train.py --checkpoint-dir")
    return newest


def run(args: argparse.Namespace) -> int:
    from pdcompile.merge import merge_weights
    from pdcompile.runtime import checkpoint

    folder = resolve(args.checkpoint)
    program = Path(args.program) if args.program else folder
    if not (program / "plan.json").is_file():
        raise UsageError(f"{program}: no plan.json. Fix: pass --program with the emitted program folder")
    plan = json.loads((program / "plan.json").read_text())
    step = None
    if not any(folder.glob("stage_*.rank_*.pt")) or (folder / checkpoint.MANIFEST).is_file():
        step = checkpoint.verify(folder, plan)["step"]  # a checkpoint: complete and intact, or refused
    merged = merge_weights(program, folder)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.atomic_save({k: v.contiguous() for k, v in merged.items()}, out)
    written = [out]
    if not args.no_safetensors:
        try:
            from safetensors.torch import save as st_save
        except ImportError:  # safetensors is optional: the .pt file is always written
            st_save = None  # type: ignore[assignment]  # optional import
        if st_save is not None:
            side = out.with_suffix(".safetensors")
            checkpoint.atomic_write(side, st_save({k: v.contiguous() for k, v in merged.items()}))
            written.append(side)
    n = sum(t.numel() for t in merged.values())
    where = f"step {step} of {folder}" if step is not None else str(folder)
    print(f"merged {len(merged)} tensors ({n:,} values) from {where} into {', '.join(map(str, written))}")
    return 0
