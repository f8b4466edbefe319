"""Argument values the subcommands share: a model factory called with its ``--arg`` values, input
shapes, leaf modules, a zoo name and a cluster. The bottom of ``_cli``: it imports no command."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Sequence

from pdcompile.errors import UsageError


def zoo_model(name: str, **kwargs: Any) -> Any:
    """The zoo bundle ``name`` (``pdcompile.zoo.get``), or a UsageError listing the names."""
    from pdcompile.zoo import get, names

    if name not in names():
        raise UsageError(f"unknown zoo model {name!r}; choose one of {names()}")
    return get(name, **kwargs)


def call_factory(spec: str, kv: Sequence[str]) -> Any:
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise UsageError(f"model {spec!r} must be MODULE:FACTORY, e.g. mypkg.models:make_net")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"cannot import {mod_name!r} ({e}); is it on PYTHONPATH?") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"{mod_name} has no callable {fn_name!r}")
    kwargs = {}
    for item in kv:
        key, eq, value = item.partition("=")
        if not eq:
            raise UsageError(f"--arg {item!r} must be KEY=VALUE")
        kwargs[key] = parse_literal(value)
    return fn(**kwargs)


def factory_kwargs(made: Any, args: Any) -> dict[str, Any] | None:
    """A factory object's ``.example_kwargs`` (forward's keyword inputs, as ``emit``/``run``/``check`` take them),
    checked as ``pdcompile(example_kwargs=)`` checks them; None where it gives none. ``--input`` replaces the
    factory's positional example, whose batch its keyword tensors share: the two are refused together."""
    kwargs = getattr(made, "example_kwargs", None)
    if not kwargs:
        return None
    if getattr(args, "inputs", None):
        raise UsageError("--input replaces the factory's example inputs, but its .example_kwargs keep their own "
                         "shapes: drop --input, or change the factory's examples")
    from pdcompile.examples import check_example

    return dict(check_example(tuple(made.example_inputs), kwargs).kwargs)


def parse_literal(value: str) -> Any:
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    return value


def leaf_module(name: str) -> Any:
    """``pkg.mod.Class`` -> the class if it imports, else the name (a qualified submodule)."""
    mod_name, _, cls = name.rpartition(".")
    if mod_name:
        try:
            obj = getattr(importlib.import_module(mod_name), cls, None)
            if isinstance(obj, type):
                return obj
        except ImportError:
            pass
    return name


def parse_inputs(text: str) -> tuple[Any, ...]:
    """``"8x3x32x32,8x50:int64"`` -> a random float tensor and a zero int64 tensor."""
    import torch

    out = []
    gen = torch.Generator().manual_seed(0)
    for part in text.split(","):
        shape_s, _, dtype_s = part.strip().partition(":")
        try:
            shape = tuple(int(d) for d in shape_s.lower().split("x"))
        except ValueError:
            raise UsageError(f"--input {part!r}: a shape is dims joined by 'x', e.g. 8x3x32x32") from None
        if any(d <= 0 for d in shape):
            raise UsageError(f"--input {part!r}: dims must be positive")
        dtype = getattr(torch, dtype_s or "float32", None)
        if not isinstance(dtype, torch.dtype):
            raise UsageError(f"--input {part!r}: unknown dtype {dtype_s!r} (e.g. float32, int64)")
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        else:
            out.append(torch.zeros(shape, dtype=dtype))
    return tuple(out)


def resolve_cluster(text: str) -> Any:
    """``paper:A``, ``paper:B``, ``local:N`` or a TOML file."""
    from pdcompile.cluster import ClusterSpec, local_cpu_cluster, paper_cluster

    kind, _, arg = text.partition(":")
    if kind == "paper" and arg:
        return paper_cluster(arg)
    if kind == "local" and arg:
        try:
            n = int(arg)
        except ValueError:
            raise UsageError(f"--cluster {text!r}: local:N takes a number of processes, e.g. local:4") from None
        return local_cpu_cluster(n)
    if not Path(text).is_file():
        raise UsageError(f"--cluster {text!r}: no such file; give a cluster TOML, paper:A, paper:B or local:N")
    return ClusterSpec.from_toml(Path(text))


SHARD_HELP = ("how a replicated stage's replicas hold its weights, gradients and optimizer state: none (whole "
              "copies), optimizer (ZeRO-1), full (FSDP2), auto (the planner: the cheapest that fits; default), "
              "or one per stage separated by commas (with --stages)")


def parse_shard(text: str) -> str | tuple[str, ...]:
    """``--shard MODE`` or ``--shard M1,M2,...`` (one per stage), checked."""
    from pdcompile.passes.planner.sharding import check_option

    parts = [x.strip() for x in text.split(",")]
    return check_option(parts[0] if len(parts) == 1 else tuple(parts), where=f"--shard {text!r}")


STALENESS_HELP = ("1f1b/2bw's stale weights: none (as PipeDream), lr (PipeMare: each stage's rate divided by its "
                  "delay^(1 - t/K) until K), predict (each forward on the weights its optimizer will reach: Adam, "
                  "AdamW, SGD with momentum), predict+lr (both), auto (predict where the optimizer has a rule, lr where not, none for "
                  "synchronous schedules); default none")
#: a profile's optimizer name -> the optimizer the staleness rules read (class, options)
PROFILE_OPTIMIZERS = {"sgd": ("torch.optim.sgd.SGD", {}), "sgd-momentum": ("torch.optim.sgd.SGD", {"momentum": 0.9}),
                      "adam": ("torch.optim.adam.Adam", {}), "adamw": ("torch.optim.adamw.AdamW", {})}


def add_staleness_args(p: Any) -> None:
    """``--staleness MODE`` and ``--staleness-warmup K`` (runtime/staleness.py), for every command that plans."""
    from pdcompile.runtime.staleness import DEFAULT_WARMUP, MODES

    p.add_argument("--staleness", choices=MODES, default="none", help=STALENESS_HELP)
    p.add_argument("--staleness-warmup", type=float, default=DEFAULT_WARMUP, metavar="K",
                   help=f"with --staleness lr or predict+lr: PipeMare's K, a fraction of the run (default {DEFAULT_WARMUP})")
    p.add_argument("--staleness-sync", type=int, default=0, metavar="N",
                   help="1f1b/2bw: run the first N minibatches synchronously (each flushed, delay 0), then the "
                   "schedule with the --staleness correction (default 0)")


def staleness_of_plan(args: Any, schedule: str, replicas: Sequence[int], optimizer: str,
                      options: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What ``--staleness`` does to a plan of ``replicas`` under ``schedule`` for ``optimizer`` (a
    profile's name, or a class path with its ``options``): plan.json's entry (each stage's delay), or
    None without the flag."""
    from pdcompile.runtime.schedules.spec import ScheduleSpec
    from pdcompile.runtime.staleness import plan_entry

    mode = getattr(args, "staleness", "none")
    if mode == "none":
        return None
    cls, kwargs = PROFILE_OPTIMIZERS.get(optimizer.lower(), (optimizer, options or {}))
    spec = ScheduleSpec(schedule, tuple(replicas), max(2, sum(replicas)))
    return plan_entry(mode, args.staleness_warmup, spec, {"class": cls, "kwargs": kwargs},
                      sync=getattr(args, "staleness_sync", 0))


TENSOR_PARALLEL_HELP = ("split every stage's attention and MLP linear pairs across N processes each (Megatron's "
                        "layout, torch's DTensor tensor parallelism; docs/tensor-parallel.md), or auto: the planner chooses 1, 2, 4 "
                        "or 8 inside the innermost level (1 on CPU workers); default 1")


def parse_tensor_parallel(text: str) -> int | str | tuple[int, ...]:
    """``--tensor-parallel N`` (or ``N,N,...``, one per stage; ``auto``: the planner chooses)."""
    parts = [x.strip() for x in str(text).split(",")]
    if parts == ["auto"]:
        return "auto"
    try:
        values = tuple(int(x) for x in parts)
    except ValueError:
        raise UsageError(f"--tensor-parallel {text!r}: give a number of processes per stage, e.g. 2") from None
    return values[0] if len(values) == 1 else values


