"""Model arguments shared by the subcommands that take a model: check, emit, run (and plan)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pdcompile._cli._args import (SHARD_HELP, TENSOR_PARALLEL_HELP, add_staleness_args, call_factory, leaf_module,
                                  parse_inputs, parse_literal, parse_shard, parse_tensor_parallel, resolve_cluster,
                                  zoo_model)
from pdcompile.errors import UsageError

MODEL_HELP = ("a model: zoo:NAME (gpt, mlp, resnet, vgg, gnmt) or MODULE:FACTORY returning an nn.Module "
              "(give --input) or an object with .model, .example_inputs, .target, .loss_fn (and, optionally, "
              ".example_kwargs: forward's keyword inputs)")


@dataclass(frozen=True)
class LoadedModel:
    name: str
    model: Any
    example_inputs: tuple[Any, ...]
    target: Any
    loss_fn: Any
    leaf_modules: tuple[Any, ...]
    data: dict[str, Any] | None  # the emitted program's data hook, when known
    example_kwargs: dict[str, Any] | None = None  # forward's keyword inputs (a factory's .example_kwargs)


def add_model_args(p: argparse.ArgumentParser, *, training: bool = True) -> None:
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--arg", dest="factory_args", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory (repeatable)")
    p.add_argument("--input", dest="inputs", metavar="SHAPE[,SHAPE]",
                   help="example input shapes (one minibatch), e.g. 8x16 or 8x50:int64")
    p.add_argument("--leaf", action="append", default=[], metavar="NAME",
                   help="keep this submodule (qualified name) or class (module.Class) whole")
    if training:
        p.add_argument("--target", metavar="SHAPE[:DTYPE[:HIGH]]",
                       help="target shape for a plain module, e.g. 8:int64:10 (class ids below 10)")
        p.add_argument("--loss", default="torch.nn.CrossEntropyLoss", help="loss class path")
        p.add_argument("--batch-size", type=int, default=16, help="zoo models: minibatch size (default 16)")


def load_model(args: argparse.Namespace) -> LoadedModel:
    import torch

    from pdcompile.runtime.program import import_object

    spec: str = args.model
    leaf = [leaf_module(n) for n in args.leaf]
    if spec.startswith("zoo:"):
        name = spec[4:]
        z = zoo_model(name, batch_size=getattr(args, "batch_size", 16))
        return LoadedModel(name, z.model, z.example_inputs, z.target, z.loss_fn, tuple(leaf) + z.leaf_modules,
                           {"factory": "pdcompile.zoo:batches", "kwargs": {"name": name, "cycle": 4}})
    made = call_factory(spec, args.factory_args)
    if isinstance(made, torch.nn.Module):
        if not args.inputs:
            raise UsageError(f"{spec} returned a module; give its inputs with --input SHAPE")
        inputs = parse_inputs(args.inputs)
        target = _target(getattr(args, "target", None), inputs)
        try:
            loss = import_object(getattr(args, "loss", "torch.nn.CrossEntropyLoss"))()
        except (ImportError, AttributeError, TypeError) as e:
            raise UsageError(f"--loss {args.loss!r}: {e}") from None
        return LoadedModel(type(made).__name__, made, inputs, target, loss, tuple(leaf), None)
    if hasattr(made, "model") and hasattr(made, "example_inputs"):
        return LoadedModel(getattr(made, "name", type(made.model).__name__), made.model, tuple(made.example_inputs),
                           getattr(made, "target", None), getattr(made, "loss_fn", None),
                           tuple(leaf) + tuple(getattr(made, "leaf_modules", ())), None,
                           getattr(made, "example_kwargs", None))
    raise UsageError(f"{spec} returned {type(made).__name__}; it must return an nn.Module or an object "
                     f"with .model and .example_inputs")


def _target(text: str | None, inputs: tuple[Any, ...]) -> Any:
    import torch

    if text is None:
        return None
    parts = text.split(":")
    try:
        shape = tuple(int(d) for d in parts[0].split("x"))
    except ValueError:
        raise UsageError(f"--target {text!r}: a shape is dims joined by 'x', e.g. 8 or 8x10") from None
    dtype = getattr(torch, parts[1], None) if len(parts) > 1 else torch.int64
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"--target {text!r}: unknown dtype {parts[1]!r}")
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    high = int(parts[2]) if len(parts) > 2 else 2
    return torch.randint(0, high, shape, generator=gen, dtype=dtype)


def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", metavar="FILE", help="cluster TOML (or paper:A, paper:B, local:N): the planner "
                                                   "chooses stages and replicas")
    p.add_argument("--stages", type=int, help="split into this many stages of similar size instead of planning")
    p.add_argument("--schedule", default="flush",
                   help="gpipe, flush, 1f1b, 2bw, zb-h1; with --virtual-stages: interleaved-1f1b, looped-bfs, zb-v, "
                        "dualpipe-v; csv:PATH: a torch.distributed.pipelining schedule CSV (compute only); auto: the "
                        "fastest synchronous schedule and M, simulated (default: flush)")
    p.add_argument("--virtual-stages", type=int, default=None, metavar="V",
                   help="stages per rank, for interleaved-1f1b, looped-bfs, zb-v, dualpipe-v (--stages counts them all; "
                        "default: what the placement fixes, e.g. 2 for zb-v, --stages / workers when interleaved)")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per minibatch (default 4; "
                                                                  "with --schedule auto: chosen)")
    p.add_argument("--optimizer", default="torch.optim.SGD:lr=0.01",
                   help="CLASS[:KEY=VALUE,...], e.g. torch.optim.Adam:lr=0.001 (default SGD lr=0.01)")
    p.add_argument("--shard", default="auto", metavar="MODE[,MODE...]", help=SHARD_HELP)
    p.add_argument("--tensor-parallel", default="1", metavar="N", help=TENSOR_PARALLEL_HELP)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: autocast with fp32 master weights, bf16 boundary tensors, costs at the bf16 peak")
    add_staleness_args(p)


def add_clip_arg(p: argparse.ArgumentParser) -> None:
    """``--clip-grad-norm X`` for the commands that emit a program."""
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="clip gradients to global L2 norm X before each step (1f1b, 2bw: at each update, over every stage's gradients of it)")


def optimizer_factory(text: str) -> Any:
    from pdcompile.runtime.program import import_object

    cls_path, _, rest = text.partition(":")
    try:
        cls = import_object(cls_path)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"--optimizer {text!r}: can't import {cls_path!r} ({e})") from None
    kwargs = {}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise UsageError(f"--optimizer {text!r}: options are KEY=VALUE separated by commas")
        kwargs[k.strip()] = parse_literal(v.strip())
    return lambda params: cls(params, **kwargs)


def compile_from_args(args: argparse.Namespace) -> tuple[LoadedModel, Any]:
    from pdcompile.api import pdcompile

    m = load_model(args)
    # a factory's bundle may have .loss_fn and no .target: a model that computes its own loss needs none
    if m.loss_fn is None or (m.target is None and getattr(args, "inputs", None)):
        raise UsageError(f"{args.model}: training needs a target and a loss: give --target SHAPE[:DTYPE[:HIGH]] "
                         f"and --loss CLASS, or a factory returning .target and .loss_fn (a model that computes "
                         f"its own loss: .loss_fn alone, e.g. lambda out, t: out.loss)")
    cluster = None
    if args.cluster:
        cluster = resolve_cluster(args.cluster)
    pipe = pdcompile(m.model, cluster, example_inputs=m.example_inputs, example_kwargs=m.example_kwargs,
                     example_target=m.target,
                     loss_fn=m.loss_fn, optimizer=optimizer_factory(args.optimizer), schedule=args.schedule,
                     num_microbatches=args.microbatches, stages=args.stages, leaf_modules=m.leaf_modules,
                     precision=getattr(args, "precision", "fp32"), clip_grad_norm=getattr(args, "clip_grad_norm", None),
                     virtual_stages=getattr(args, "virtual_stages", None),
                     shard=parse_shard(getattr(args, "shard", "auto")),
                     staleness=getattr(args, "staleness", "none"), staleness_warmup=getattr(args, "staleness_warmup", 0.25),
                     staleness_sync=getattr(args, "staleness_sync", 0),
                     tensor_parallel=parse_tensor_parallel(getattr(args, "tensor_parallel", "1")))
    return m, pipe
