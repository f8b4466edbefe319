"""``pdcompile merge``: a run's stage weights under the original model's names, as a Hugging Face
folder (safetensors, sharded above a size) or one state dict file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pdcompile.errors import CheckpointError, UsageError

EXAMPLES = """\
Examples:
  pdcompile merge ckpt/ -o out/ --like hf_model/      newest checkpoint in ckpt/ as a Hugging Face folder
  pdcompile merge ckpt/step_00000100 -o out/ --max-shard-size 2GB   that checkpoint, in shards of 2 GB
  pdcompile merge results/final --program prog/ -o out/   weights from train.py --save-final
  pdcompile merge ckpt/ -o model.pt                    one state dict file (torch.save), and model.safetensors

A folder output is Hugging Face's layout: model.safetensors, or above --max-shard-size shards
model-00001-of-0000N.safetensors with model.safetensors.index.json. It is written a stage at a
time, so memory stays about the largest stage. --like copies a Hugging Face folder's config and
tokenizer files beside them and writes the tensors that model saves (a tied lm_head once), so
transformers' from_pretrained(out/) loads the result.

A checkpoint is verified first (manifest complete, every checksum matching; with --program, the
same model). Parameters tied across stages, or held by every replica of a stage, appear once."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "merge", help="a run's stage weights as one model: a Hugging Face folder or a state dict file",
        description="Merge the weights of every stage and replica of a checkpoint (or of train.py "
                    "--save-final) back under the original model's parameter names.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="DIR",
                   help="a --checkpoint-dir (its newest complete checkpoint), one step_NNNNNNNN folder, or a "
                        "--save-final folder (then give --program)")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="a folder (Hugging Face's layout), or a file ending in .pt (one torch.save'd state dict)")
    p.add_argument("--program", metavar="DIR", help="the emitted program folder (plan.json); default: the "
                   "copy inside the checkpoint")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="folder output: shards above this size, as Hugging Face cuts them (default 5GB)")
    p.add_argument("--like", metavar="HF_FOLDER",
                   help="folder output: copy this Hugging Face folder's config and tokenizer files, and write the "
                        "tensors its model saves")
    p.add_argument("--no-safetensors", action="store_true", help=".pt output: write only the .pt file")
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
    from pdcompile import merge
    from pdcompile.runtime import checkpoint

    folder = resolve(args.checkpoint)
    out = Path(args.output)
    to_file = out.suffix == ".pt"
    if to_file and args.like:
        raise UsageError("--like writes a Hugging Face folder: give -o a folder, not a .pt file")
    merge.parse_size(args.max_shard_size)
    if args.like:
        merge.like_files(args.like)  # refused before anything is written
    plan = None
    if args.program:
        if not (Path(args.program) / "plan.json").is_file():
            raise UsageError(f"{args.program}: no plan.json. Fix: pass --program with the emitted program folder")
        plan = json.loads((Path(args.program) / "plan.json").read_text())
    step = None
    if (folder / checkpoint.MANIFEST).is_file() or not any(folder.glob("stage_*.rank_*.pt")):
        step = checkpoint.read_manifest(folder)["step"]
        source = merge.checkpoint_source(folder, plan)  # complete and intact (and of --program's model), or refused
    else:
        program = args.program or merge.program_beside(folder)  # run()'s RUN/program beside RUN/final
        if program is None:
            raise UsageError(f"{folder}: train.py --save-final files need --program with the emitted program "
                             f"folder (none beside it: {folder.resolve().parent / 'program'} has no plan.json)")
        source = merge.save_final_source(program, folder)
    where = f"step {step} of {folder}" if step is not None else str(folder)
    if to_file:
        done = merge.save_file(source, out, safetensors=not args.no_safetensors)
        print(f"merged {done.tensors} tensors ({done.nbytes:,} bytes) from {where} into "
              f"{', '.join(map(str, done.files))}")
        return 0
    done = merge.save_folder(source, out, args.max_shard_size, args.like)
    if done.dropped:
        print(f"not written (the Hugging Face model does not save them): {', '.join(done.dropped)}")
    print(f"merged {done.tensors} tensors ({done.nbytes:,} bytes) from {where} into {out}/: "
          f"{', '.join(p.name for p in done.files if p.parent == out)}"
          + (f"; copied {len(done.copied)} files of {args.like}" if done.copied else ""))
    return 0
