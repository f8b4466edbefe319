"""The options of ``pdcompile(...)`` (:class:`Options`) and their checks before any pass runs: keywords,
virtual stages, clipping, the example's batch against the microbatching. Below :mod:`pdcompile.api`."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch

from pdcompile import autoschedule, callables, init_source
from pdcompile.cluster import ClusterSpec
from pdcompile.errors import UsageError
from pdcompile.examples import Example, check_example
from pdcompile.passes import codegen
from pdcompile.passes.partition import infer_virtual_stages
from pdcompile.passes.planner.sharding import check_option as check_shard
from pdcompile.runtime import schedules, staleness
from pdcompile.runtime.program import PRECISIONS
from pdcompile.runtime.schedules.spec import ScheduleSpec


SCHEDULE_NAMES = tuple(schedules.POLICIES)


@dataclass(frozen=True)
class Options:
    """Everything ``pdcompile`` was asked for, checked up front."""

    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]  # any (output, target) -> scalar; traced (trace-loss)
    optimizer: Callable[[Any], torch.optim.Optimizer]
    cluster: Any = None
    schedule: str = "flush"
    microbatch_size: int | None = None
    num_microbatches: int | None = None
    stages: int | Sequence[int] | None = None
    leaf_modules: tuple[Any, ...] = ()
    cost_mode: str = "auto"  # "auto", "calibrated", "analytic", "measured" (machine_cache.cost_source)
    solver: str = "dp"
    cost_model: str = "default"
    data: dict[str, Any] | Callable[[int], Any] | None = None  # the emitted program's data: a function of the
    # minibatch size (by name or by value: pdcompile/callables.py) or {"factory": "MODULE:FUNCTION", "kwargs": {...}}
    example_target: torch.Tensor | None = None  # None: the loss's target comes from run()'s data, or the model
    # computes its own loss (loss_fn=lambda out, t: out.loss) and needs none
    example_kwargs: dict[str, Any] | None = None  # forward()'s keyword inputs (one minibatch): tensors split along
    # dim 0 like example_inputs, other values constants of the compiled program
    symbolic_costs: bool = False  # fit costs as expressions of the microbatch size (slower)
    frontend: str = "auto"  # "fx" (symbolic_trace), "export" (torch.export), "auto": fx, else export
    output: str | int | None = None  # export front end: which model output (e.g. "logits")
    replicas: Sequence[int] | None = None  # replicas per stage (e.g. [2, 1]); default one each
    recompute: str = "auto"  # activation recomputation per stage: "none", "selective", "full", "auto" (the planner,
    # where memory needs it: none, selective, the fewest first layers (partial) or full, per stage)
    shard: str | Sequence[str] = "auto"  # replicas' state per replicated stage: "none", "optimizer" (ZeRO-1), "full"
    # (FSDP2), "auto" (the planner: the cheapest that fits), or one per stage (with stages=); planner/sharding.py
    precision: str = "fp32"  # "bf16": autocast, fp32 master weights, bf16 boundary tensors, bf16 costs
    clip_grad_norm: float | None = None  # global-norm gradient clipping before each step (1f1b/2bw: per update)
    virtual_stages: int | None = None  # stages per rank, for a schedule with virtual stages (interleaved-1f1b, ...);
    # None: inferred where the placement fixes it (zb-v, dualpipe-v: 2; interleaved: stages / workers), else 1
    lr_scheduler: Callable[[Any], Any] | None = None  # optimizer -> torch.optim.lr_scheduler, stepped after every
    # optimizer step on every stage (1f1b/2bw: every update); any function: by name or by value (pdcompile/callables.py)
    init_from: str | os.PathLike[str] | None = None  # a checkpoint each rank reads only its stage's tensors from
    # (HF folder, .safetensors, torch.save'd state_dict, DCP folder; runtime/sources.py); a meta model without it
    # is initialised fresh on the ranks by its modules' own initialisers
    staleness: str = "none"  # 1f1b/2bw's stale weights: "none", "lr" (PipeMare), "predict" (weight prediction),
    staleness_warmup: float = 0.25  # "auto" (predict where the optimizer has a rule); K of "lr", a fraction of the run
    staleness_sync: int = 0  # 1f1b/2bw: the first N minibatches run synchronously (each flushed: delay 0), then stale
    tensor_parallel: int | str | Sequence[int] = 1  # ranks each stage is split across (Megatron's linear pairs,
    # passes/tensor_parallel.py), one for every stage or one per stage; "auto": the planner (passes/planner/tensor.py)
    also_rate: tuple[tuple[tuple[int, int, tuple[int, ...]], ...], ...] = field(default=(), metadata={"internal": True})
    # plans the step search rates beside its own (PlanOptions.also_rate): the one chosen before re-planning at
    # another microbatch count (set by pdcompile, not an option)
    csv_text: str | None = field(default=None, metadata={"internal": True})  # schedule="csv:PATH": the torch
    # CSV's text (schedule becomes its registered name); set by pdcompile, not an option


def option_names() -> list[str]:
    """The keywords ``pdcompile()`` takes beyond its own parameters: :class:`Options`' fields (those
    marked ``internal`` are set by pdcompile itself)."""
    return [f.name for f in fields(Options) if not f.metadata.get("internal")]


def check_keywords(where: str, given: Iterable[str], valid: Iterable[str]) -> None:
    """A keyword not in ``valid`` is a :class:`UsageError` naming the closest valid one and all of them
    (instead of Python's ``TypeError: unexpected keyword argument``)."""
    names = sorted(set(valid))
    for k in given:
        if k not in names:
            close = difflib.get_close_matches(k, names, n=1)
            hint = f"did you mean {close[0]}=? " if close else ""
            raise UsageError(f"{where}: unknown option {k}=; {hint}valid options: {', '.join(names)}")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def keywords_checked(also: Callable[[], Iterable[str]] | None = None
                     ) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Decorate a function so that an unknown keyword is a :func:`check_keywords` error. The valid
    names are its signature's (less ``self``), plus ``also()`` where it takes ``**kw``: read at call
    time, so a parameter or option added later is valid with no list to update."""
    def wrap(f: Callable[_P, _R]) -> Callable[_P, _R]:
        params = inspect.signature(f).parameters.values()
        own = [p.name for p in params if p.name != "self"
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]

        @functools.wraps(f)
        def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if any(k not in own for k in kwargs):
                check_keywords(f.__name__, kwargs, [*own, *(also() if also is not None else ())])
            return f(*args, **kwargs)
        return checked
    return wrap


def _from_csv(opts: Options) -> Options:
    """``schedule="csv:PATH"``: torch.distributed.pipelining's compute-only schedule CSV, validated
    and registered (:func:`~pdcompile.runtime.schedules.torch_csv.register_csv`); its stages, stages
    per rank and microbatches per step become the options (given ones must agree)."""
    if not (isinstance(opts.schedule, str) and opts.schedule.startswith("csv:")):
        return opts
    from pdcompile.runtime.schedules import torch_csv

    path = Path(opts.schedule[len("csv:"):])
    if not path.is_file():
        raise UsageError(f"pdcompile: schedule={opts.schedule!r}: no file {path} (give csv:PATH of a torch "
                         f"schedule CSV, e.g. written by a torch schedule's _dump_csv(..., format='compute_only'))")
    text = path.read_text()
    name = torch_csv.register_csv(text)  # a ScheduleError names the broken rule and the cell
    S, R, m = torch_csv.csv_shape(text)
    for what, given, want in (("stages", opts.stages, S), ("num_microbatches", opts.num_microbatches, m)):
        if given is not None and given != want:
            raise UsageError(f"pdcompile: {what}={given}, but the CSV {path} has {want}; drop {what}=")
    return replace(opts, schedule=name, csv_text=text, stages=S, num_microbatches=m, virtual_stages=S // R)


def _with_virtual_stages(opts: Options) -> Options:
    """``virtual_stages=`` as given, else inferred from the schedule's placement, the stages and the
    cluster's workers (:func:`~pdcompile.passes.partition.infer_virtual_stages`)."""
    if opts.virtual_stages is not None:
        return opts
    workers = opts.cluster.num_workers if isinstance(opts.cluster, ClusterSpec) else None
    stages = opts.stages if opts.stages is None or isinstance(opts.stages, int) else None
    return replace(opts, virtual_stages=infer_virtual_stages(opts.schedule, stages, workers))


def _check_virtual(opts: Options) -> None:
    """``virtual_stages=v`` goes with a schedule that places several stages on a rank, ``stages=`` (all
    ``v p`` of them, a multiple of ``v``) and no replicas."""
    v = opts.virtual_stages
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise UsageError(f"pdcompile: virtual_stages must be a positive int, got {v!r}")
    virtual = opts.schedule in schedules.POLICIES and schedules.policy(opts.schedule).virtual_stages
    if not virtual:
        if v != 1:
            raise UsageError(f"pdcompile: virtual_stages={v} needs a schedule with several stages per rank "
                             f"({', '.join(schedules.VIRTUAL_SCHEDULES)}); schedule={opts.schedule!r} runs one")
        return
    if opts.replicas is not None and any(r != 1 for r in opts.replicas):
        raise UsageError(f"pdcompile: schedule={opts.schedule!r} runs one replica per stage; drop replicas=")
    if opts.stages is not None and (not isinstance(opts.stages, int) or opts.stages % v):
        raise UsageError(f"pdcompile: schedule={opts.schedule!r} with virtual_stages={v} needs stages= a multiple of "
                         f"{v} (v stages on each rank), got {opts.stages!r}")
    if opts.clip_grad_norm is not None:
        raise UsageError(f"pdcompile: clip_grad_norm= with schedule={opts.schedule!r}: a rank steps each of its "
                         f"stages at its own point of the step, so no one point sees every stage's gradients; "
                         f"drop clip_grad_norm= or use a schedule with a stage per rank")


def _check_clipping(spec: ScheduleSpec) -> None:
    """``clip_grad_norm=`` on the compiled schedule: every ``ST`` all-reduces the global norm over all
    ranks, so every stage's k-th update must hold the same microbatches and the schedule must not
    deadlock with ``ST`` a collective (:func:`~pdcompile.runtime.schedules.check_global_steps`; for
    1f1b that needs the same number of replicas on every stage). Virtual stages: :func:`_check_virtual`."""
    if schedules.policy(spec.name).virtual_stages:
        return
    try:
        schedules.check_global_steps(spec.name, spec.replicas, spec.num_microbatches, tied=spec.tied,
                                     vertical_sync=spec.vertical_sync, split_backward=spec.split_backward)
    except UsageError as e:
        raise UsageError(f"pdcompile: clip_grad_norm= with schedule={spec.name!r}: {e}; or drop clip_grad_norm=") from None


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def optimizer_state_factor_of(optimizer: Callable[[Any], torch.optim.Optimizer]) -> float:
    """Optimizer-state bytes per weight byte of the optimizer ``optimizer`` builds (the planner's
    memory model): built on one small parameter and stepped once, the bytes of its per-parameter
    state tensors (Adam's ``exp_avg`` and ``exp_avg_sq``: 2; SGD with momentum: 1; plain SGD: 0; a
    scalar ``step`` is not counted). One that cannot be built or stepped so: 1."""
    p = torch.nn.Parameter(torch.zeros(64))
    try:
        opt = optimizer([p])
        p.grad = torch.full_like(p, 1e-3)
        opt.step()
        state = opt.state.get(p, {})
    except Exception:  # noqa: BLE001 - a factory that wants its real parameters: the old default
        return 1.0
    nbytes = sum(t.numel() * t.element_size() for t in state.values()
                 if isinstance(t, torch.Tensor) and t.numel() == p.numel())
    return nbytes / (p.numel() * p.element_size())


def _check(model: Any, example_inputs: Any, opts: Options) -> tuple[Example, int, int]:
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"pdcompile: model must be a torch.nn.Module, got {type(model).__name__}")
    example = check_example(example_inputs, opts.example_kwargs)
    tensors = example.tensors
    if not callable(opts.loss_fn):
        raise UsageError(f"pdcompile: loss_fn must be callable as loss_fn(output, target) -> scalar tensor, "
                         f"got {type(opts.loss_fn).__name__}. Fix: pass a function, a lambda, "
                         f"functools.partial(F.cross_entropy, ...) or an nn.Module")
    if opts.example_target is not None and (not isinstance(opts.example_target, torch.Tensor)
                                            or opts.example_target.dim() == 0):
        raise UsageError("pdcompile: example_target must be a tensor with a batch dimension (one minibatch "
                         "of targets)")
    if opts.cost_mode == "measured" and (init_source.has_meta(model) or any(x.is_meta for x in tensors)):
        raise UsageError("pdcompile: the model (or an example input) is on the meta device, so its costs can't be "
                         "measured. Fix: cost_mode=\"analytic\", or plan from an imported profile (pdcompile plan "
                         "--profile FILE)")
    if opts.recompute not in ("none", "selective", "full", "auto"):
        raise UsageError(f"pdcompile: recompute must be 'none', 'selective', 'full' or 'auto', got {opts.recompute!r}")
    if opts.schedule not in (*schedules.POLICIES, autoschedule.AUTO):
        raise UsageError(f"pdcompile: schedule must be one of {SCHEDULE_NAMES}, 'auto' or 'csv:PATH' (a torch "
                         f"schedule CSV), got {opts.schedule!r}")
    _check_virtual(opts)
    if not isinstance(check_shard(opts.shard), str) and (not isinstance(opts.stages, int)
                                                          or len(opts.shard) != opts.stages):
        raise UsageError(f"pdcompile: shard={list(opts.shard)} gives a mode per stage, which needs stages= as many "
                         f"(got stages={opts.stages!r}); or give one mode (or 'auto') for all")
    spec = codegen.optimizer_spec(opts.optimizer).to_json()  # staleness: its mode and K, before any pass runs
    staleness.resolve(opts.staleness, False, spec["class"], spec.get("kwargs", {}))
    staleness.check_warmup(opts.staleness_warmup)
    staleness.check_sync(opts.staleness_sync)
    for what in ("lr_scheduler", "data"):  # a callable the ranks run: by name or by value, else refused here
        if getattr(opts, what) is not None and not isinstance(getattr(opts, what), dict):
            callables.check(getattr(opts, what), what)
    if isinstance(opts.cluster, ClusterSpec):  # t inside the innermost level, with stages= given too
        from pdcompile.passes.planner.tensor import check_fits

        asked = opts.tensor_parallel
        for t in sorted({asked} if isinstance(asked, int) else set(asked) if isinstance(asked, (list, tuple)) else set()):
            if isinstance(t, int) and not isinstance(t, bool):
                check_fits(t, opts.cluster)
    if opts.precision not in PRECISIONS:
        raise UsageError(f"pdcompile: precision must be one of {PRECISIONS}, got {opts.precision!r}")
    if opts.clip_grad_norm is not None:
        c = opts.clip_grad_norm
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not (math.isfinite(c) and c > 0):
            raise UsageError(f"pdcompile: clip_grad_norm must be a positive number, got {c!r}")
    if opts.stages is not None:
        n = opts.stages
        if not isinstance(n, int) or n < 1:
            raise UsageError(f"pdcompile: stages= must be a positive int, got {n!r}")
        if opts.replicas is not None and len(opts.replicas) != n:
            raise UsageError(f"pdcompile: replicas={list(opts.replicas)} names {len(opts.replicas)} stages, "
                             f"but stages={n}")
    batch = example.batch
    m, b = opts.num_microbatches, opts.microbatch_size
    if b is None and m is None:
        m = next(k for k in (4, 2, 1) if batch % k == 0)
    if b is None:
        assert m is not None
        if m < 1 or batch % m:
            raise UsageError(f"pdcompile: num_microbatches={m} must divide the example batch ({batch})")
        b = batch // m
    if m is None:
        if b < 1 or batch % b:
            raise UsageError(f"pdcompile: microbatch_size={b} must divide the example batch ({batch})")
        m = batch // b
    if b * m != batch:
        raise UsageError(f"pdcompile: microbatch_size ({b}) x num_microbatches ({m}) must equal the "
                         f"example batch ({batch})")
    return example, b, m
