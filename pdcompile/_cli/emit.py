"""``pdcompile emit MODEL -o DIR``: write the torchrun program for a model."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pdcompile._cli._model import add_clip_arg, add_compile_args, add_model_args, compile_from_args


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "emit", help="compile a model and write its torchrun program",
        description="Trace, cost, plan and split a model, then write a folder with one Python module per "
                    "stage, their weights, plan.json and train.py (run it with torchrun).",
        epilog="Examples:\n  pdcompile emit zoo:gpt --stages 2 -o out/\n"
               "  pdcompile emit mypkg.models:make --input 32x16 --target 32:int64:10 --cluster c.toml -o out/\n"
               "  pdcompile emit mypkg.models:make_on_meta --input 8x128:int64 --init-from hf_folder/ -o out/\n"
               "  cd out && torchrun --nproc-per-node=2 train.py --steps 10",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    add_compile_args(p)
    add_clip_arg(p)
    p.add_argument("-o", "--out", required=True, help="output folder")
    p.add_argument("--ir", metavar="DIR", help="also write the IR after every pass here")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.add_argument("--init-from", metavar="PATH", default=None,
                   help="start from this checkpoint, each rank reading only its stage's tensors under the model's "
                        "names: a Hugging Face model folder, a .safetensors file, a torch.save'd state_dict or a "
                        "torch.distributed.checkpoint folder (docs/big-models.md)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    m, pipe = compile_from_args(args)
    out = pipe.emit(args.out, data=m.data, init_from=args.init_from)
    if args.ir:
        pipe.dump_ir(args.ir)
    info = {"out": str(out), "stages": len(pipe.split.stages), "world_size": pipe.world_size,
            "schedule": pipe.options.schedule, "num_microbatches": pipe.num_microbatches,
            "command": f"cd {out} && torchrun --nproc-per-node={pipe.world_size} train.py --steps 10"}
    if args.json:
        print(json.dumps(info))
    else:
        if pipe.schedule_choice is not None:
            from pdcompile.autoschedule import format_choice

            print(format_choice(*pipe.schedule_choice))
        print(f"wrote {out}: {info['stages']} stages on {info['world_size']} processes\nrun it: {info['command']}")
    return 0
