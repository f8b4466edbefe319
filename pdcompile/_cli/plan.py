"""``pdcompile plan``: choose stages, replicas and ranks for a profile (or a model) on a cluster."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pdcompile._cli._args import (SHARD_HELP, add_staleness_args, call_factory, factory_kwargs, parse_inputs,
                                  parse_shard, parse_tensor_parallel, resolve_cluster, staleness_of_plan)
from pdcompile.errors import UsageError
from pdcompile.passes.partition_dp import COST_MODELS, PlanOptions
from pdcompile.runtime.schedules import SCHEDULES

COST_MODES = ("auto", "measured", "calibrated", "analytic")  # machine_cache.COST_MODES (the parser needs no torch)

EXAMPLES = """\
Examples:
  pdcompile plan --profile pipedream:vgg16 --cluster paper:A
  pdcompile plan --profile graph.txt --cluster cluster.toml --cost-model paper --json
  pdcompile plan --profile gpt.json --cluster local:4 --solver ilp --schedule flush
  pdcompile plan --profile gpt.json --cluster cluster.toml --microbatch 4,8,16
  pdcompile plan --profile pipedream:vgg16 --cluster c.toml --schedule flush --microbatches 8 --choose-microbatches
  pdcompile plan mypkg.models:make_net --input 32x3x224x224 --cluster cluster.toml

--profile FILE is our profile JSON (pdcompile profile ... -o FILE), a PipeDream graph.txt, or
pipedream:NAME, one of PipeDream's fourteen published profiles shipped with pdcompile (alexnet,
vgg16, resnet50, gnmt, gnmt_large, ...; an unknown NAME lists them).
--cluster is a TOML file ([device] memory, [[levels]] count and bandwidth, innermost first),
paper:A (4 servers x 4 V100, 10 GB/s inside, 10 Gbit/s between), paper:B (2 x 8 V100,
300 GB/s NVLink, 25 Gbit/s) or local:N (N processes on this machine).
With --json, stdout is one JSON object: solver, cost_model, stages (layers [first, last],
replicas, ranks, ...), predicted (seconds_per_minibatch, samples_per_second,
data_parallel_samples_per_second, speedup_vs_data_parallel), planning_seconds.
Exit status: 0 ok, 2 bad input (one line on stderr; --debug for a traceback)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="choose stages, replicas and ranks for a profile on a cluster (PipeDream's planner)",
        description="Partition a model's layers into pipeline stages, choose how many workers replicate "
        "each stage and which ranks run what, so that the slowest stage or link is as fast as possible; "
        "print the plan with its predicted throughput and the speedup over data parallelism.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", metavar="MODULE:FACTORY",
                   help="a model to trace and profile here (instead of --profile)")
    p.add_argument("--profile", metavar="FILE", help="profile JSON, PipeDream graph.txt, or pipedream:NAME "
                   "(PipeDream's published profiles, e.g. pipedream:vgg16)")
    p.add_argument("--input", dest="inputs", metavar="SHAPE[,SHAPE]",
                   help="with MODULE:FACTORY: example input shapes, e.g. 32x3x224x224")
    p.add_argument("--arg", dest="factory_args", action="append", default=[], metavar="KEY=VALUE",
                   help="with MODULE:FACTORY: keyword argument for the factory (repeatable)")
    p.add_argument("--cluster", metavar="FILE", required=True,
                   help="cluster TOML, paper:A, paper:B or local:N")
    p.add_argument("--cost-mode", choices=COST_MODES, default="auto",
                   help="with MODULE:FACTORY: how each layer is costed, as pdcompile(cost_mode=) costs it (auto: "
                        "this machine's calibration on a local cluster where one is cached, else analytic; "
                        "docs/reading-a-plan.md)")
    add_planning_arguments(p)
    p.add_argument("--schedule", choices=tuple(SCHEDULES), default="1f1b",
                   help="what the memory model keeps per worker: the schedule's weight versions and in-flight "
                        "microbatches (1f1b: one version per in-flight minibatch; flush, gpipe, zb-h1: 1; 2bw: 2)")
    p.add_argument("--microbatch", metavar="B[,B...]",
                   help="plan at these microbatch sizes (from the profile's symbolic costs) and keep the best")
    p.add_argument("--microbatches", type=int, default=None, metavar="N",
                   help="microbatches per step (the minibatch is the profile's batch x N); flush, gpipe and zb-h1 "
                        "are then planned by their simulated step of N microbatches (default: 1)")
    p.add_argument("--choose-microbatches", action="store_true",
                   help="flush, gpipe, zb-h1: let the step search cut the same minibatch (batch x --microbatches) "
                        "into any count (a divisor of it), with the stages and copies of the pipeline")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=run)


def add_planning_arguments(p: argparse._ActionsContainer) -> None:
    """The planner's flags besides ``--schedule``: ``pdcompile plan``'s, which ``pdcompile simulate`` takes
    too to plan a profile (read by :func:`plan_options` and :func:`plan_profile`, for both)."""
    p.add_argument("--solver", choices=("dp", "ilp"), default="dp",
                   help="dp (fast, exact) or ilp (CP-SAT, warm-started from the DP; proves the optimum)")
    p.add_argument("--cost-model", choices=COST_MODELS, default="default",
                   help="default: ours (memory, overlap of the weight all-reduce with the backward); paper: our "
                        "reading of SOSP'19 sec. 3.1 (a stage's time is the max of compute and weight sync); "
                        "pipedream: the released optimizer's formulas (a sum; dp only; no memory limit)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--memory-limit", dest="memory_limit", action="store_true", default=None,
                     help="enforce device memory (default: on for the default model, off for paper)")
    mem.add_argument("--no-memory-limit", dest="memory_limit", action="store_false")
    p.add_argument("--recompute", choices=("none", "selective", "full", "auto"), default=None,
                   help="activation recomputation per stage: never, every stage's cheap ops (selective), every "
                   "stage's forward (full), or where memory needs it: per stage none, selective, its fewest "
                   "first layers, or full (default: auto with dp, none with ilp)")
    p.add_argument("--shard", default="auto", metavar="MODE", help=SHARD_HELP.replace(
        ", or one per stage separated by commas (with --stages)", ""))
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--pool", dest="pool", action="store_true", default=None,
                      help="also plan the workers as one pool at the slowest link, so a stage may span servers "
                      "without nesting (the paper's 15-1 on 4 x 4); default: on with dp, off with ilp")
    pool.add_argument("--no-pool", dest="pool", action="store_false")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S", help="ilp: seconds (default 60)")
    add_staleness_args(p)
    p.add_argument("--tensor-parallel", default="1", metavar="N",
                   help="tensor parallelism's degree inside the innermost level, or auto (the planner chooses "
                   "1, 2, 4 or 8; 1 on CPU workers); a profile must say what splits (docs/tensor-parallel.md)")


def _profile(args: argparse.Namespace, cluster: Any = None) -> Any:
    """The profile to plan: ``--profile``'s, or MODULE:FACTORY's costed for ``cluster`` as ``pdcompile()``'s
    annotate-costs pass costs it (``--cost-mode``, :func:`cost_source`; the cluster's core contention)."""
    from pdcompile import profile as profile_mod

    if args.profile and args.model:
        raise UsageError("give either --profile FILE or MODULE:FACTORY, not both")
    if args.profile:
        if args.inputs or args.factory_args:
            raise UsageError("--input and --arg go with MODULE:FACTORY, not with --profile")
        return profile_mod.load(args.profile)  # a file or pipedream:NAME; a missing one names the fix
    if not args.model:
        raise UsageError("nothing to plan: give --profile FILE (profile JSON or PipeDream graph.txt) "
                         "or MODULE:FACTORY --input SHAPE")
    import torch

    from pdcompile.passes.annotate_costs import profile_model

    try:
        made = call_factory(args.model, args.factory_args)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory failed: say so in one line
        raise UsageError(f"{args.model}: calling the factory failed ({type(e).__name__}: {e})") from None
    kwargs = None
    if isinstance(made, torch.nn.Module):
        if not args.inputs:
            raise UsageError(f"{args.model} returned a module; give its inputs with --input SHAPE")
        model, inputs, leaf = made, parse_inputs(args.inputs), ()
    elif hasattr(made, "model") and hasattr(made, "example_inputs"):
        model = made.model
        inputs = parse_inputs(args.inputs) if args.inputs else tuple(made.example_inputs)
        leaf = tuple(getattr(made, "leaf_modules", ()))
        kwargs = factory_kwargs(made, args)
    else:
        raise UsageError(f"{args.model} returned {type(made).__name__}; it must return an nn.Module or an "
                         "object with .model and .example_inputs")
    from pdcompile.passes.costs.roofline import contention, device_spec_for

    source = cost_source(cluster, cost_mode=getattr(args, "cost_mode", "auto"))
    return profile_model(model, inputs, leaf_modules=leaf, mode=source.mode,
                         device_spec=device_spec_for(cluster).calibrated(source.table),
                         contention=contention(cluster),  # co-running: charged by the simulator (with_step_costs)
                         name=getattr(made, "name", None) or type(model).__name__, example_kwargs=kwargs,
                         loss_fn=getattr(made, "loss_fn", None) if kwargs else None)


def cost_source(cluster: Any, prof: Any = None, cost_mode: str = "auto") -> Any:
    """Where the costs planned come from (:class:`~pdcompile.machine_cache.CostSource`): a profile file's
    (``prof``), measured or analytic as it says; a model's, ``cost_mode`` (``--cost-mode``) resolved as
    ``pdcompile()`` resolves it (:func:`pdcompile.machine_cache.cost_source`)."""
    from pdcompile import machine_cache

    if prof is not None:
        mode = "measured" if prof.mode == "measured" else "analytic"
        return machine_cache.CostSource("profile", mode, None, f"the profile's ({prof.mode}, {prof.device})")
    return machine_cache.cost_source(cost_mode, machine_cache.is_local(cluster))


def with_step_costs(options: PlanOptions, cluster: Any, source: Any) -> tuple[PlanOptions, str]:
    """``options`` charging the step costs ``pdcompile()`` charges (:func:`pdcompile.api.step_costs`: the
    runtime's per-action cost on CPU workers, the calibrated optimizer step where the costs are this
    machine's; :func:`pdcompile.api.corun_of`: the co-running slowdown on a calibrated local cluster), and the
    line that says which."""
    import dataclasses

    from pdcompile.api import corun_of, step_cost_line, step_costs
    from pdcompile.passes.costs.roofline import contention
    from pdcompile.simulate import update_bandwidth_of

    cost, bw, problem = step_costs(cluster, source)
    options = dataclasses.replace(options, update_bandwidth=bw, action_overhead_s=tuple(sorted(cost.seconds.items()))
                                  if cost is not None else (), collective=cost.collective if cost is not None else None,
                                  corun=corun_of(cluster, source), wake_s=cost.wake if cost is not None else 0.0)
    line = step_cost_line(bw if bw is not None else update_bandwidth_of(cluster), bw is not None, problem, cost)
    if options.corun:  # where the calibrated co-running slowdown is charged (one place: the simulator)
        line += (f"; side by side: compute x{', x'.join(f'{f:.2f} with {n}' for n, f in options.corun)} computing at "
                 f"once, charged only while ranks compute together (simulate.shared_cores), not in the chain's costs")
    if options.wake_s and contention(cluster) > 1.0:  # more workers than cores: a woken rank waits for a core
        line += (f"; a rank woken by a message waits {options.wake_s * 1e3:.2f} ms for a core x the chance the others "
                 f"hold every core (calibrated; simulate.shared_cores)")
    return options, line


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--microbatch {text!r}: give sizes separated by commas, e.g. 4,8,16") from None
    if not sizes or any(b <= 0 for b in sizes):
        raise UsageError(f"--microbatch {text!r}: sizes must be positive integers")
    return sizes


def run(args: argparse.Namespace) -> int:
    result = plan_for(args)
    corr = staleness_of_plan(args, args.schedule, [st.replicas for st in result.stages], _profile_optimizer(args))
    if args.json:
        print(json.dumps({**result.to_dict(), **({"staleness": corr} if corr is not None else {})}))
    else:
        print(result.table())
        if corr is not None:
            from pdcompile.runtime.staleness import describe

            print("\n".join(describe(corr["mode"], corr["delays"], corr["warmup"], corr["sync"])))
    return 0


def _profile_optimizer(args: argparse.Namespace) -> str:
    """The optimizer the plan's profile was made for (``--staleness`` resolves against it)."""
    return _profile(args).optimizer if getattr(args, "staleness", "none") != "none" else "sgd"


def plan_options(args: argparse.Namespace, optimizer: str, schedule: str | None = None) -> PlanOptions:
    """The :class:`~pdcompile.plan.PlanOptions` ``pdcompile plan ARGS`` plans with, for a profile of a
    model trained with ``optimizer`` (its state's bytes) under ``schedule`` (default ``args.schedule``):
    the one list the command, ``pdcompile simulate`` (a profile) and the planner benchmark
    (``benchmarks/bench_planner.py``, which checks the command's plans) read."""
    from pdcompile.profile import optimizer_state_factor

    tp = parse_tensor_parallel(getattr(args, "tensor_parallel", "1"))
    if not isinstance(tp, (int, str)):
        raise UsageError(f"--tensor-parallel {args.tensor_parallel}: pdcompile plan chooses the stages, so give one "
                         f"degree (or auto) for every stage")
    shard = parse_shard(args.shard)
    if not isinstance(shard, str):
        raise UsageError(f"--shard {args.shard!r}: pdcompile plan chooses the stages, so give one mode (or auto) "
                         f"for every replicated stage")
    dp = args.solver == "dp"
    return PlanOptions(
        cost_model=args.cost_model,
        schedule=args.schedule if schedule is None else schedule,
        memory_limit=args.memory_limit,
        optimizer_state_factor=optimizer_state_factor(optimizer),
        recompute=args.recompute or ("auto" if dp else "none"),
        # pooled workers: the DP's, except under the released optimizer's model, whose stages nest
        pool=(dp and args.cost_model != "pipedream") if args.pool is None else args.pool,
        # the step's microbatch count is not known here: full is not refused for too few (the ILP plans
        # unsharded, and the mode asked is set on its plan: with_shard)
        shard=shard, microbatches_known=False, tensor_parallel=tp,
    )


def plan_for(args: argparse.Namespace) -> Any:
    """The plan ``pdcompile plan ARGS`` prints (``pdcompile demo`` shows the same)."""
    import dataclasses

    from pdcompile.plan import step_objective

    m, choose = getattr(args, "microbatches", None), getattr(args, "choose_microbatches", False)
    if m is not None and m < 1:
        raise UsageError(f"--microbatches {m}: give a positive count of microbatches per step")
    if choose and not step_objective(args.schedule):
        raise UsageError(f"--choose-microbatches: only flush, gpipe and zb-h1 are planned by their step "
                         f"(got --schedule {args.schedule}); give --microbatches N instead")
    if choose and args.microbatch:
        raise UsageError("--choose-microbatches chooses the count for the profile's batch: not with --microbatch")
    cluster = resolve_cluster(args.cluster)
    prof = _profile(args, cluster)
    # the step costs pdcompile() charges on this cluster (one channel, pdcompile.api.step_costs)
    source = cost_source(cluster, prof if args.profile else None, getattr(args, "cost_mode", "auto"))
    options, line = with_step_costs(plan_options(args, prof.optimizer), cluster, source)
    if m is not None or choose:  # the step's count is known (or chosen): it caps what a replica holds
        options = dataclasses.replace(options, num_microbatches=m or 1, microbatches_known=True,
                                      choose_microbatches=choose)
    return plan_profile(args, prof, cluster, options, _sizes(args.microbatch) if args.microbatch else None, line)


def plan_profile(args: argparse.Namespace, prof: Any, cluster: Any, options: PlanOptions,
                 sizes: list[int] | None = None, step_costs: str = "") -> Any:
    """The plan of profile ``prof`` on ``cluster`` under ``options`` (:func:`plan_options`) with the solver
    ``args`` name (the ILP within ``--time-limit``, warm-started from the DP, a shard mode asked set on its
    plan), at the best of the microbatch ``sizes`` if given: ``pdcompile plan``'s and ``pdcompile
    simulate``'s (a profile) planning, one way. ``step_costs``: the line :func:`with_step_costs` gives, a note
    of a plan chosen by its simulated step (which charges them)."""
    import dataclasses

    from pdcompile.passes.linearize import linearize
    from pdcompile.plan import plan as make_plan
    from pdcompile.plan import step_objective

    if args.time_limit <= 0:
        raise UsageError(f"--time-limit must be positive (got {args.time_limit})")
    extra: dict[str, Any] = {} if args.solver == "dp" else dict(time_limit_s=args.time_limit, hint="dp")
    if sizes:
        result = make_plan(lambda b: linearize(prof.at_batch_size(b)), cluster, options, solver=args.solver,
                           microbatch_sizes=sizes, **extra)
    else:
        result = make_plan(linearize(prof), cluster, options, solver=args.solver, **extra)
    if args.solver == "ilp":  # the ILP plans unsharded: a mode asked is set on its plan
        from pdcompile.passes.partition import with_shard

        result = with_shard(result, options)
    if step_costs and step_objective(options.schedule):
        result = dataclasses.replace(result, notes=(*result.notes, step_costs))
    return result
