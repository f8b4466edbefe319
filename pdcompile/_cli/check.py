"""``pdcompile check MODEL``: list every construct that stops a model from being traced and split."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pdcompile._cli._model import add_model_args, load_model


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "check", help="list every unsupported construct of a model at once",
        description="Trace the model and report every construct that stops it from being split into "
                    "pipeline stages (data-dependent control flow, loops over a tensor's length, "
                    ".item()), each with its module, source line and fix.",
        epilog="Examples:\n  pdcompile check zoo:gpt\n  pdcompile check mypkg.models:make_net --input 8x3x32x32",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, training=False)
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdcompile.passes.trace import diagnose

    m = load_model(args)
    found = diagnose(m.model, m.leaf_modules)
    if args.json:
        print(json.dumps({"model": m.name, "ok": not found,
                          "constructs": [dict(kind=o.kind, module=o.module, where=o.where, detail=o.detail,
                                              fix=o.fix) for o in found]}, indent=1))
    elif not found:
        print(f"{m.name}: traceable; nothing to fix")
    else:
        print(f"{m.name}: {len(found)} construct(s) to fix")
        for i, o in enumerate(found, 1):
            print(f"  {i}. {o}")
    return 0 if not found else 2
