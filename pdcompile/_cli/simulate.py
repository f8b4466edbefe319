"""``pdcompile simulate PLAN_OR_PROFILE``: predict a pipeline step, action by action, and draw it."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from pdcompile._cli._args import staleness_of_plan
from pdcompile._cli.plan import (add_planning_arguments, cost_source, plan_options, plan_profile, resolve_cluster,
                                 with_step_costs)
from pdcompile.passes.planner.options import PlanOptions
from pdcompile.errors import UsageError

EXAMPLES = """\
Examples:
  pdcompile simulate pipedream:vgg16 --cluster paper:A --schedule 1f1b
  pdcompile simulate net.json --cluster cluster.toml --microbatches 8 --trace trace.json --png step.png
  pdcompile simulate plan.json --schedule flush --json
  pdcompile simulate out/plan.json --measured out/trace --png compare.png

PLAN_OR_PROFILE is a plan (Plan.to_json(), or an emitted program's plan.json, whose schedule and
microbatches become the defaults) or a profile (our JSON, a PipeDream graph.txt, or pipedream:NAME,
one of PipeDream's published profiles shipped with pdcompile), which is planned for --cluster first.
A plan alone carries per-stage totals, not the forward/backward split: give
--profile to simulate it from the layer costs, else forward:backward is taken as 1:2.
--cluster is a TOML file, or paper:A / paper:B (the PipeDream paper's clusters), or local:N.
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate", help="predict a schedule's step time, bubble and memory; write its timeline",
        description="Replay the schedule of a plan with the cost model: every forward, backward, transfer, "
                    "all-reduce and optimizer step on every rank. Prints step time, throughput, bubble and "
                    "per-stage utilization; writes a Chrome/Perfetto trace and a PNG timeline.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="PLAN_OR_PROFILE", help="plan JSON, program plan.json, or profile")
    p.add_argument("--cluster", metavar="FILE", help="cluster TOML, paper:A, paper:B or local:N "
                                                     "(needed to plan a profile)")
    p.add_argument("--schedule", default=None, help="gpipe, flush, 1f1b, 2bw (default: the plan's, else 1f1b)")
    p.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="microbatches per step (default: the program's, else 8)")
    p.add_argument("--steps", type=int, default=1, help="steps to lay out (default 1)")
    p.add_argument("--profile", metavar="FILE", help="with a plan: the profile it was made from (layer costs)")
    plan_flags = p.add_argument_group("planning a profile", "as pdcompile plan plans it, for --schedule's memory")
    add_planning_arguments(plan_flags)
    p.add_argument("--no-overlap", action="store_true", help="senders wait for their transfers to finish")
    p.add_argument("--trace", metavar="OUT.json", help="write the predicted timeline as a Chrome/Perfetto trace")
    p.add_argument("--png", metavar="OUT.png", help="write the timeline as a PNG (measured below, with --measured)")
    p.add_argument("--measured", metavar="DIR", help="a run's train.py --trace folder, drawn under the prediction")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    p.set_defaults(func=run)


def _is_program_plan(data: Any) -> bool:
    """Whether ``data`` is an emitted program's plan.json (passes/codegen.py): the plan it was compiled from
    under ``"plan"``, beside the program's ``world_size`` and ``stages`` (each with its ranks)."""
    return (isinstance(data, dict) and isinstance(data.get("plan"), dict) and "world_size" in data
            and isinstance(data.get("stages"), list))


def _read_source(path: Path) -> tuple[str, Any, dict[str, Any]]:
    """("plan", Plan, program fields) or ("profile", Profile, {})."""
    from pdcompile.plan import PLAN_FORMAT, Plan
    from pdcompile.profile import PIPEDREAM_PREFIX, load

    if str(path).startswith(PIPEDREAM_PREFIX):
        return "profile", load(str(path)), {}
    if not path.is_file():
        raise UsageError(f"{path}: no such file; give a plan JSON (pdcompile plan --json, Plan.to_json()) "
                         f"or a profile (pdcompile profile -o, or a PipeDream graph.txt)")
    text = path.read_text()
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        if _is_program_plan(data):
            return "plan", Plan.from_dict(data["plan"]), data  # an emitted program's plan.json
        if isinstance(data, dict) and (data.get("format") == PLAN_FORMAT or ("stages" in data and "predicted" in data)):
            return "plan", Plan.from_dict(data), {}
    return "profile", load(path), {}


def _simulate_plan_alone(plan: Any, schedule: str, m: int, steps: int, overlap: bool) -> Any:
    """Simulate from the plan's own per-stage totals (no layer costs): forward:backward = 1:2,
    each boundary's ``send_s`` split evenly between activations and gradients, and an all-reduce
    of ``comm_s x replicas`` per step (``comm_s`` is per minibatch)."""
    from pdcompile.simulate import INPUT_GRAD_SHARE, WEIGHT_GRAD_SHARE, simulate_schedule

    fwd, bwd, send, ar = [], [], [], []
    for st in plan.stages:
        c = st.compute_s * st.replicas  # one replica's forward+backward of one microbatch
        if not math.isfinite(c):
            raise UsageError(f"the plan's stage {st.index} has no finite compute time; give --profile")
        fwd.append(c / 3)
        bwd.append(2 * c / 3)
        send.append(st.send_s / 2)
        ar.append(st.comm_s * st.replicas)
    return simulate_schedule(schedule, [st.replicas for st in plan.stages], m, num_steps=steps,
                             forward_s=fwd, backward_s=bwd, allreduce_s=ar, overlap_comm=overlap,
                             input_grad_s=[b * INPUT_GRAD_SHARE for b in bwd],
                             weight_grad_s=[b * WEIGHT_GRAD_SHARE for b in bwd],
                             send_s=lambda sa, sb, ra, rb: send[min(sa, sb)],
                             microbatch_size=plan.microbatch_size)


def _charged(plan: Any, chain: Any, cluster: Any, options: Any) -> dict[str, Any]:
    """simulate_plan's keywords for what the step search and ``pdcompile()``'s simulate() charge besides the
    chain's costs: the optimizer's state, the step costs ``options`` carry (:func:`with_step_costs`), the
    split backwards the schedule pass decides on the cluster, the all-reduce of weights tied across stages."""
    import os

    from pdcompile.plan import tied_of
    from pdcompile.runtime.schedules.spec import default_split_backward
    from pdcompile.simulate import update_bandwidth_of

    workers = len({r for st in plan.stages for r in st.ranks})  # as the schedule pass decides (passes/schedule.py)
    split = len(plan.stages) > 1 and default_split_backward("cpu" if cluster.device.name == "cpu" else "gpu",
                                                            workers, os.cpu_count() or 1)
    tied_bytes, tied_stages = tied_of(plan, chain)  # weights shared across stages, all-reduced every step
    return dict(optimizer_state_factor=options.optimizer_state_factor, overhead_s=options.overhead_s,
                tied_bytes=tied_bytes, tied_stages=tied_stages, collective=options.collective, corun=options.corun, wake_s=options.wake_s,
                update_bandwidth=options.update_bandwidth if options.update_bandwidth is not None
                else update_bandwidth_of(cluster), split_backward=split)


def predict(args: argparse.Namespace) -> tuple[Any, Any, str, int, list[str]]:
    """(SimResult, Plan, schedule, microbatches, notes) for the command's arguments."""
    from pdcompile.passes.linearize import linearize
    from pdcompile.profile import load, optimizer_state_factor
    from pdcompile.simulate import simulate_plan

    kind, obj, program = _read_source(Path(args.source))
    compiled = program.get("schedule")
    if isinstance(compiled, dict):  # plan.json carries the schedule as compiled (runtime/schedules/spec.py)
        compiled = compiled.get("policy")
    schedule = args.schedule or compiled or (obj.schedule if kind == "plan" else "1f1b")
    m = args.microbatches or program.get("num_microbatches") or 8
    if m < 1 or args.steps < 1:
        raise UsageError("--microbatches and --steps must be at least 1")
    overlap = not args.no_overlap
    notes: list[str] = []
    cluster = resolve_cluster(args.cluster) if args.cluster else None
    if kind == "profile":
        if cluster is None:
            raise UsageError(f"{args.source} is a profile: it must be planned for a cluster first; "
                             f"give --cluster FILE.toml (or paper:A, paper:B, local:N)")
        # planned as pdcompile plan plans it with these flags, under the schedule the partition pass plans for
        import dataclasses

        from pdcompile.passes.partition import planned_schedule
        from pdcompile.plan import step_objective

        # the step costs pdcompile() charges (pdcompile.api.step_costs), in the plan's search and its replay
        options, line = with_step_costs(plan_options(args, obj.optimizer, planned_schedule(schedule)), cluster,
                                        cost_source(cluster, obj))
        if step_objective(options.schedule):  # the step search plans the step simulated: M microbatches of the
            # profile's batch, as pdcompile plan --microbatches M plans it (and pdcompile() its count)
            options = dataclasses.replace(options, num_microbatches=m, microbatches_known=True)
        plan = plan_profile(args, obj, cluster, options, step_costs=line)
        notes.append(f"planned {Path(args.source).name} for the cluster: configuration {plan.configuration}")
        chain = linearize(obj)
        res = simulate_plan(plan, chain, cluster, schedule, m, num_steps=args.steps, overlap_comm=overlap,
                            **_charged(plan, chain, cluster, options))
        return res, plan, schedule, m, [*notes, line]
    plan = obj
    if args.profile:
        if cluster is None:
            raise UsageError("--profile needs --cluster (the bandwidths between the plan's ranks)")
        if cluster.num_workers < plan.workers_used:
            raise UsageError(f"the plan uses {plan.workers_used} workers; --cluster has {cluster.num_workers}")
        prof = load(args.profile)
        chain = linearize(prof)
        if plan.stages[-1].last >= len(chain):
            raise UsageError(f"the plan covers layers up to {plan.stages[-1].last}, the profile's chain has "
                             f"{len(chain)}: give the profile the plan was made from")
        options, line = with_step_costs(PlanOptions(optimizer_state_factor=optimizer_state_factor(prof.optimizer)),
                                        cluster, cost_source(cluster, prof))
        res = simulate_plan(plan, chain, cluster, schedule, m, num_steps=args.steps, overlap_comm=overlap,
                            **_charged(plan, chain, cluster, options))
        notes.append(line)
    else:
        res = _simulate_plan_alone(plan, schedule, m, args.steps, overlap)
        notes.append("simulated from the plan's per-stage totals (forward:backward taken as 1:2); "
                     "give --profile for the layer costs")
    return res, plan, schedule, m, notes


def run(args: argparse.Namespace) -> int:
    res, plan, schedule, m, notes = predict(args)
    corr = None
    if getattr(args, "staleness", "none") != "none":  # each stage's delay under the simulated schedule
        kind, obj, program = _read_source(Path(args.source))
        opt = program.get("optimizer") or {}
        corr = staleness_of_plan(args, schedule, [st.replicas for st in plan.stages],
                                 obj.optimizer if kind == "profile" else str(opt.get("class", "sgd")), opt.get("kwargs"))
    meta = {"source": str(args.source), "schedule": schedule, "num_microbatches": m,
            "configuration": plan.configuration, "predicted_step_time_s": float(res.step_time_s)}
    if args.trace:
        from pdcompile.timeline import write_chrome_trace

        write_chrome_trace(res.events, args.trace, process_name="pdcompile simulate (predicted)", metadata=meta)
    measured = None
    if args.measured:
        from pdcompile.trace_convert import read_runtime_events

        measured = read_runtime_events(args.measured)
    if args.png:
        from pdcompile.timeline import plot_timeline

        plot_timeline(res.events, measured, args.png,
                      title=f"{Path(args.source).name}: {schedule}, {m} microbatches, "
                            f"configuration {plan.configuration}")
    if args.json:
        print(json.dumps({
            **meta, "makespan_s": float(res.makespan_s), "throughput": float(res.throughput),
            "bubble_fraction": float(res.bubble_fraction), "num_steps": res.num_steps,
            "utilization": {str(r): float(u) for r, u in res.utilization.items()},
            "peak_in_flight": res.peak_in_flight, "peak_weight_versions": res.peak_weight_versions,
            "peak_memory_bytes": [float(x) for x in res.peak_memory_bytes] if res.peak_memory_bytes else None,
            "trace": args.trace, "png": args.png, "notes": notes, **({"staleness": corr} if corr else {}),
        }, indent=1))
        return 0
    for n in notes:
        print(f"note: {n}")
    print(f"{schedule}, {m} microbatches, configuration {plan.configuration}")
    print(res.summary())
    if corr is not None:
        from pdcompile.runtime.staleness import describe

        print("\n".join(describe(corr["mode"], corr["delays"], corr["warmup"], corr["sync"])))
    for label, path in (("trace", args.trace), ("timeline", args.png)):
        if path:
            print(f"wrote {label} {path}")
    return 0
