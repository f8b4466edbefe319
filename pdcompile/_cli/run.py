"""``pdcompile run``: train a model (or an emitted folder) locally through torchrun."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from pdcompile._cli._model import add_clip_arg, add_compile_args, add_model_args, compile_from_args
from pdcompile.errors import UsageError

# train.py's --grad-accumulation choices (runtime/fused_grads.py GRAD_ACCUMULATIONS; not imported: the
# CLI's parser is built without torch)
GRAD_ACCUMULATIONS = ("auto", "fused", "autograd")
MALLOC_MODES = ("keep", "release", "glibc")  # train.py's --malloc (runtime/allocator.py MODES)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run", help="compile and train a model (or run an emitted folder) on this machine",
        description="Emit the program (unless MODEL is an emitted folder) and train it through torchrun on "
                    "this machine's CPU processes (gloo), streaming the loss.",
        epilog="Examples:\n  pdcompile run zoo:mlp --stages 2 --steps 20\n  pdcompile run out/ --steps 5\n"
               "  pdcompile run zoo:gpt --stages 2 -- --precision bf16 --checkpoint-dir ckpt\n\n"
               "Arguments after a bare '--' go to train.py as they are (any of its flags: "
               "docs/emitted-program.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_compile_args(p)
    add_clip_arg(p)
    p.add_argument("--steps", type=int, default=None, help="training steps (default 10; or --epochs)")
    loop = p.add_argument_group("training loop (passed to train.py; docs/training-loop.md)")
    loop.add_argument("--epochs", type=int, default=None, metavar="N", help="passes over --data instead of --steps")
    for flag, meta, text in (("--data", "MODULE:FUNCTION", "training data: a function of the minibatch size "
                              "returning a DataLoader or iterable of (inputs, target)"),
                             ("--lr-scheduler", "MODULE:FUNCTION", "a function from the optimizer to a "
                              "torch.optim.lr_scheduler, stepped after every optimizer step"),
                             ("--eval-data", "MODULE:FUNCTION", "validation data, run forward only"),
                             ("--eval-every", "N", "evaluate after every N steps, and at the end"),
                             ("--eval-metric", "accuracy|MODULE:FUNCTION", "a metric besides the loss"),
                             ("--log-every", "N", "a log line every N steps"),
                             ("--tensorboard", "DIR", "TensorBoard event files into DIR")):
        loop.add_argument(flag, default=None, metavar=meta, help=text)
    p.add_argument("--out", help="folder for the program and results (default: a temporary folder)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the whole run is stopped")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("--init-from", metavar="PATH", default=None,
                   help="start from this checkpoint, each rank reading only its stage's tensors under the model's "
                        "names: a Hugging Face model folder, a .safetensors file, a torch.save'd state_dict or a "
                        "torch.distributed.checkpoint folder (docs/big-models.md)")
    p.add_argument("--grad-accumulation", choices=GRAD_ACCUMULATIONS, default=None,
                   help="how a weight's microbatch gradients are summed (train.py's flag): 'fused' into .grad "
                        "without a weight-sized transient, 'autograd', or 'auto' (the default: fused for weights "
                        "of 4 MiB and more; docs/big-models.md)")
    p.add_argument("--malloc", choices=MALLOC_MODES, default=None,
                   help="glibc malloc's thresholds on the ranks (train.py's flag): 'keep' (the default on CPU) "
                        "reuses freed memory, 'release' hands large blocks back at once for a lower peak RSS at "
                        "the price of page faults, 'glibc' its own (docs/big-models.md)")
    p.set_defaults(func=run, takes_passthrough=True)


def run(args: argparse.Namespace) -> int:
    from pdcompile.launcher import check_train_args, launch

    if args.steps is not None and args.epochs is not None:
        raise UsageError("--steps and --epochs both given: give one")
    length = ["--epochs", str(args.epochs)] if args.epochs is not None else ["--steps", str(args.steps or 10)]
    if (args.epochs if args.epochs is not None else args.steps or 10) < 1:
        raise UsageError(f"{length[0]} must be at least 1")
    for flag in ("data", "lr_scheduler", "eval_data", "eval_every", "eval_metric", "log_every", "tensorboard",
                 "grad_accumulation", "malloc"):
        if getattr(args, flag) is not None:
            length += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    folder = Path(args.model)
    if (folder / "plan.json").is_file():
        prog = folder
        world = json.loads((folder / "plan.json").read_text())["world_size"]
        results = Path(args.out) if args.out else folder / "results"
    else:
        m, pipe = compile_from_args(args)
        results = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="pdcompile-run-"))
        prog = pipe.emit(results / "program", data=m.data, init_from=args.init_from)
        world = pipe.world_size
    train_args = [*length, "--metrics", str(results / "metrics"), "--save-final", str(results / "final"),
                  "--timeout", "60", *(["--init-from", str(args.init_from)] if args.init_from else []),
                  *getattr(args, "passthrough", [])]
    check_train_args(prog, train_args, world)  # a flag train.py refuses: one line and exit 2, before torchrun
    rc, log = launch(prog, world, train_args, timeout=args.timeout, on_line=None if args.json else print)
    results.mkdir(parents=True, exist_ok=True)
    (results / "train.log").write_text(log)
    if args.json:
        print(json.dumps({"status": rc, "results": str(results), "program": str(prog)}))
    if rc != 0:
        print(f"pdcompile: training failed (exit {rc}); log: {results / 'train.log'}")
        return 1
    return 0
