"""``pdcompile profile``: profile a model into a profile file, or show a profile file."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from pdcompile._cli._args import call_factory, factory_kwargs, leaf_module, parse_inputs, zoo_model
from pdcompile.errors import UsageError
from pdcompile.profile import Profile, load, save, to_json

EXAMPLES = """\
Examples:
  pdcompile profile mypkg.models:make_net --input 32x3x224x224 -o net.json
  pdcompile profile mypkg.models:make_seq2seq --input 16x50:int64,16x50:int64 --mode analytic \\
      --device-spec a100 -o s2s.json
  pdcompile profile pdcompile.zoo:get --arg name=gpt --arg batch_size=8 -o gpt.json
  pdcompile profile --show gpt.json
  pdcompile profile --show pipedream:vgg16 --top 5 --json

MODULE:FACTORY names a function called with the --arg values; it returns an nn.Module (then
--input gives the example inputs) or an object with .model, .example_inputs and, optionally,
.leaf_modules (as pdcompile.zoo.get does). SHAPE is dims joined by 'x', with an optional dtype:
8x128:int64 (integer inputs are zeros, valid indices for any embedding)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile",
        help="measure or compute per-layer costs into a profile file; show a profile",
        description="Trace a model, annotate every layer's forward/backward time, activation and "
        "parameter bytes (measured here, or analytic from FLOPs and a device spec), and write "
        "the profile the planner reads. With --show, print a profile (ours or PipeDream's).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("factory", nargs="?", metavar="MODEL", help="zoo:NAME or MODULE:FACTORY, the model to profile")
    p.add_argument("--input", dest="inputs", metavar="SHAPE[,SHAPE]",
                   help="example input shapes, e.g. 8x3x32x32 or 8x50:int64,8x50:int64")
    p.add_argument("--arg", dest="factory_args", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory (repeatable)")
    p.add_argument("--mode", choices=("measured", "analytic"), default="measured")
    p.add_argument("--device-spec", default=None,
                   help="analytic mode: cpu, v100, a100, h100 or h200 (default cpu)")
    p.add_argument("--device", default="cpu", help="where to run the model (cpu, cuda)")
    p.add_argument("--leaf", action="append", default=[], metavar="NAME",
                   help="keep this submodule (qualified name) or class (module.Class) whole")
    p.add_argument("--optimizer", default="sgd-momentum", help="sgd, sgd-momentum, adam")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per node (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per node")
    p.add_argument("--no-symbolic", action="store_true", help="skip the batch-size fit")
    p.add_argument("--cross-check", action="store_true",
                   help="measured mode: also time the nodes inside a whole step with torch.profiler and "
                        "print both side by side")
    p.add_argument("-o", "--output", metavar="PATH", help="write the profile JSON here")
    p.add_argument("--show", metavar="PATH", help="print a profile file (JSON or graph.txt), or pipedream:NAME")
    p.add_argument("--top", type=int, default=10, help="rows per table in --show")
    p.add_argument("--json", action="store_true", help="print data as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.show:
        if args.factory:
            raise UsageError("give either MODULE:FACTORY or --show PATH, not both")
        prof = load(args.show)
        if args.json:
            print(json.dumps(summary(prof, args.top), indent=1))
        else:
            print(show(prof, args.top))
        return 0
    if not args.factory:
        raise UsageError("nothing to do: give MODULE:FACTORY to profile, or --show PATH")
    if args.cross_check and args.mode != "measured":
        raise UsageError("--cross-check compares measured costs with torch.profiler; use --mode measured")
    done = _profile(args)
    prof = done.profile
    check = _cross_check(done) if args.cross_check else None
    if args.output:
        save(prof, args.output)
    if args.json:
        data = to_json(prof)
        if check is not None:
            from pdcompile.profiler_check import summary as check_summary

            data["cross_check"] = check_summary(check)
        print(json.dumps(data, indent=1))
    else:
        print(show(prof, args.top))
        if check is not None:
            from pdcompile.profiler_check import summary as check_summary

            sm = check_summary(check)
            print(f"\ntorch.profiler cross-check (one whole step; forward = the node's operators, backward = its "
                  f"autograd functions):\n{check}\nmeasured / profiler over all nodes {sm['ratio']:.2f}; heavy nodes "
                  f"within {sm['tolerance']:.0%}: {sm['heavy_within']}/{sm['heavy']}")
        if args.output:
            print(f"\nwrote {args.output}")
    return 0


@dataclass(frozen=True)
class _Profiled:
    """A profile and what made it (the cross-check re-runs the model)."""

    profile: Profile
    model: Any
    inputs: tuple[Any, ...]
    leaf_modules: tuple[Any, ...]
    loss_fn: Any = None
    target: Any = None


def _cross_check(done: _Profiled) -> Any:
    from pdcompile.profiler_check import cross_check_model

    return cross_check_model(done.model, done.inputs, done.profile, leaf_modules=done.leaf_modules,
                             loss_fn=done.loss_fn, target=done.target)


def _profile(args: argparse.Namespace) -> _Profiled:
    import torch

    from pdcompile.passes.annotate_costs import profile_model

    if args.factory.startswith("zoo:"):
        made = zoo_model(args.factory[4:])
    else:
        made = call_factory(args.factory, args.factory_args)
    leaf: list[Any] = [leaf_module(name) for name in args.leaf]
    loss_fn = target = kwargs = None
    if isinstance(made, torch.nn.Module):
        if not args.inputs:
            raise UsageError(f"{args.factory} returned a module; give its inputs with --input SHAPE")
        model, inputs = made, parse_inputs(args.inputs)
    elif hasattr(made, "model") and hasattr(made, "example_inputs"):
        model = made.model
        inputs = parse_inputs(args.inputs) if args.inputs else tuple(made.example_inputs)
        leaf += list(getattr(made, "leaf_modules", ()))
        kwargs = factory_kwargs(made, args)
        if kwargs and args.cross_check:
            raise UsageError("--cross-check runs the model with positional inputs only; this factory's "
                             ".example_kwargs give keyword ones: profile without --cross-check")
        if not args.inputs:  # a zoo-style bundle: its loss and target make the cross-check's step real
            loss_fn, target = getattr(made, "loss_fn", None), getattr(made, "target", None)
    else:
        raise UsageError(f"{args.factory} returned {type(made).__name__}; it must return an "
                         f"nn.Module or an object with .model and .example_inputs")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        raise UsageError(f"--device {args.device!r}: {e}") from None
    model = model.to(device)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    if kwargs:
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    prof = profile_model(
        model, inputs, mode=args.mode, leaf_modules=tuple(leaf), device_spec=args.device_spec,
        optimizer=args.optimizer, repeats=args.repeats, warmup=args.warmup,
        symbolic=not args.no_symbolic, name=getattr(made, "name", None) or type(model).__name__,
        example_kwargs=kwargs, loss_fn=getattr(made, "loss_fn", None) if kwargs else None,
    )
    if loss_fn is None or target is None:
        loss_fn = target = None
    else:
        target = target.to(device)
    return _Profiled(prof, model, inputs, tuple(leaf), loss_fn, target)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def summary(prof: Profile, top: int = 10) -> dict[str, Any]:
    """Totals and the top layers by time, activation bytes and parameter bytes, as data."""
    from pdcompile.passes.linearize import linearize

    chain = linearize(prof)

    def rows(key: Any) -> list[dict[str, Any]]:
        ranked = sorted(prof.layers, key=lambda l: (-key(l), l.name))[:top]
        return [{"name": l.name, "op": l.op, "forward_s": l.forward_s, "backward_s": l.backward_s,
                 "output_bytes": l.output_bytes, "param_bytes": l.param_bytes} for l in ranked]

    return {
        "name": prof.name, "mode": prof.mode, "device": prof.device,
        "batch_size": prof.batch_size, "layers": len(prof.layers), "inputs": len(prof.inputs),
        "forward_s": prof.forward_s, "backward_s": prof.backward_s,
        "output_bytes": prof.output_bytes, "param_bytes": prof.param_bytes,
        "optimizer": prof.optimizer, "optimizer_state_bytes": prof.optimizer_state_bytes(),
        "widest_cut_bytes": chain.widest_cut,
        "top_by_time": rows(lambda l: l.compute_s),
        "top_by_activation": rows(lambda l: l.output_bytes),
        "top_by_params": rows(lambda l: l.param_bytes),
    }


def show(prof: Profile, top: int = 10) -> str:
    """A text report: totals, then the top layers by time, activation bytes, parameter bytes."""
    s = summary(prof, top)
    total_t = s["forward_s"] + s["backward_s"] or 1.0
    lines = [
        f"profile {s['name']}  ({s['mode']}, device {s['device']}, batch {s['batch_size']})",
        f"  layers {s['layers']}, model inputs {s['inputs']}",
        f"  time      fwd {s['forward_s'] * 1e3:.3f} ms  bwd {s['backward_s'] * 1e3:.3f} ms  "
        f"total {(s['forward_s'] + s['backward_s']) * 1e3:.3f} ms",
        f"  bytes     activations {_fmt_bytes(s['output_bytes'])}  params "
        f"{_fmt_bytes(s['param_bytes'])}  optimizer ({s['optimizer']}) "
        f"{_fmt_bytes(s['optimizer_state_bytes'])}",
        f"  widest cut (linearized) {_fmt_bytes(s['widest_cut_bytes'])}",
    ]
    for title, key in (("time", "top_by_time"), ("activation bytes", "top_by_activation"),
                       ("parameter bytes", "top_by_params")):
        lines += ["", f"top {len(s[key])} by {title}:",
                  f"  {'layer':<24} {'op':<18} {'fwd ms':>10} {'bwd ms':>10} {'% time':>7} "
                  f"{'output':>12} {'params':>12}"]
        for r in s[key]:
            pct = 100 * (r["forward_s"] + r["backward_s"]) / total_t
            lines.append(
                f"  {r['name'][:24]:<24} {r['op'][:18]:<18} {r['forward_s'] * 1e3:>10.4f} "
                f"{r['backward_s'] * 1e3:>10.4f} {pct:>6.1f}% {_fmt_bytes(r['output_bytes']):>12} "
                f"{_fmt_bytes(r['param_bytes']):>12}"
            )
    return "\n".join(lines)
