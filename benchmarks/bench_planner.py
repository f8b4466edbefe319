"""Benchmark: the planner on all fourteen PipeDream profiles — planning time, chosen configuration,
predicted speedup over data parallelism, and DP/ILP agreement.

Clusters: (a) the paper's Cluster A, 4 servers x 4 V100 at 10 GB/s inside and 10 Gbit/s between;
(b) Cluster B, 2 servers x 8 V100 at 300 GB/s (NVLink) and 25 Gbit/s; (c) 128 servers x 8 V100
like B's servers (1024 workers). Both cost models (``paper``: the paper's formulas, no memory
limit; ``default``: ours, with the 16 GiB memory limit). Targets (issue 4): every profile on (a)
and (b) in under 1 s, on (c) in under 10 s, on this 2-core machine.

The ILP (CP-SAT, warm-started from the DP plan, which only bounds and seeds its search) runs on
(a) and (b) for the profiles of at most ``--ilp-max-layers`` (70) layers, with a time limit and one
search worker; "agree" means it proved optimal a plan with the DP's time (relative 1e-6).

Scale (issue 17): every profile on 8 x 2048 = 16,384 workers (``paper_cluster("B", servers=2048)``)
under ``default`` with the memory limit and ``recompute="auto"`` (the DP chooses recomputation per
stage), and under ``paper``; target under 60 s each. Growth: GNMT-16 and VGG-16 on 8 x 256 .. 8 x 2048
(workers x2 -> time x?). Peak memory: tracemalloc's peak during a second, untimed plan (numpy's arrays included).

As the command line plans (issue 29 item 6): every profile with ``pdcompile plan --json``'s defaults
(cost model ``default``, ``recompute="auto"``, pooled workers on) on A, B and 8 x 128 = 1024 workers,
``planning_seconds`` as the plan reports it; targets under 0.1 s on A and B, under 2 s on 8 x 128;
growth per doubling of workers (8 x 16 .. 8 x 128). ``--check-plans``: every plan (those, and
``paper``'s) compared with the plans chosen before the planner's split and speed work
(``benchmarks/planner_plans.json``, sha256 of each plan's JSON): they must be identical.

Usage: python benchmarks/bench_planner.py [--quick] [--no-ilp] [--ilp-time-limit S] [--no-scale]
       [--no-cli] [--check-plans] [--only-cli] [--versus BEFORE[:AFTER]]

``--versus BEFORE[:AFTER]``: the command line's defaults planned by the package at git revision
BEFORE and at AFTER (default: the working tree), each in its own worker process, asked alternately
so that both see the same load: CPU seconds and whether the plans are identical.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._results import write_section  # noqa: E402
from pdcompile.cluster import ClusterSpec, paper_cluster  # noqa: E402
from pdcompile.errors import PdcompileError  # noqa: E402
from pdcompile.passes.linearize import linearize  # noqa: E402
from pdcompile.passes.partition_dp import partition_dp  # noqa: E402
from pdcompile.ir import Chain  # noqa: E402
from pdcompile.plan import Plan  # noqa: E402
from pdcompile.profile import load, pipedream_profiles  # noqa: E402

CLUSTERS: dict[str, tuple[ClusterSpec, float]] = {
    "A (4x4)": (paper_cluster("A"), 1.0),
    "B (8x2)": (paper_cluster("B"), 1.0),
    "C (8x128)": (paper_cluster("B", servers=128), 10.0),
}
MODELS = ("paper", "default")


def _config(plan: Plan) -> str:
    c = plan.configuration
    return c if len(c) <= 40 else c[:37] + "..."


def run(quick: bool, ilp: bool, ilp_limit: float, ilp_max_layers: int) -> tuple[str, bool]:
    names = pipedream_profiles()
    if quick:
        names = [n for n in names if n in ("alexnet", "vgg16", "resnet50", "gnmt")]
    chains = {n: linearize(load(f"pipedream:{n}")) for n in names}
    rows = []
    ilp_rows = []
    all_ok = True
    summary: dict[tuple[str, str], list[float]] = {}
    for cname, (cluster, target) in CLUSTERS.items():
        for name in names:
            chain = chains[name]
            for cm in MODELS:
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    p = partition_dp(chain, cluster, cost_model=cm)
                    err = None
                except PdcompileError as e:  # e.g. nothing fits in memory
                    p, err = None, str(e).split(";")[0]
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                print(f"{cname} {name} {cm}: {wall:.3f} s {p.configuration if p else 'infeasible'}",
                      file=sys.stderr, flush=True)
                ok = wall < target
                all_ok &= ok
                summary.setdefault((cname, cm), []).append(wall)
                if p is None:
                    rows.append(f"| {cname} | {name} | {len(chain)} | {cm} | {wall:.3f} | {cpu:.3f} | "
                                f"{'yes' if ok else '**no**'} | infeasible: {err} | - | - |")
                    continue
                exact = "" if p.optimal else " (memory bound safe, not proven)"
                rows.append(
                    f"| {cname} | {name} | {len(chain)} | {cm} | {wall:.3f} | {cpu:.3f} | "
                    f"{'yes' if ok else '**no**'} | {_config(p)}{exact} | {p.workers_used} | "
                    f"{p.speedup_vs_data_parallel:.2f}x"
                    f"{' (DP does not fit)' if any('data parallelism does not fit' in n for n in p.notes) else ''} |"
                )
                if ilp and cname != "C (8x128)" and len(chain) <= ilp_max_layers:
                    from pdcompile.passes.partition_ilp import partition_ilp

                    t1 = time.perf_counter()
                    q = partition_ilp(chain, cluster, cost_model=cm, time_limit_s=ilp_limit, hint=p, workers=1)
                    tq = time.perf_counter() - t1
                    same = math.isclose(q.seconds_per_minibatch, p.seconds_per_minibatch, rel_tol=1e-6)
                    better = q.seconds_per_minibatch < p.seconds_per_minibatch * (1 - 1e-6)
                    gap = "unknown: no solution of its own yet" if math.isnan(q.gap) else f"{q.gap * 100:.2g}%"
                    verdict = ("agree (proven optimal)" if q.optimal and same else
                               "**ILP better**" if better else
                               f"not proven in {ilp_limit:g} s (gap {gap}); no better plan found")
                    ilp_rows.append(f"| {cname} | {name} | {len(chain)} | {cm} | {tq:.2f} | {q.configuration} | "
                                    f"{verdict} |")
                    all_ok &= not better
    lines = [
        "Planner (`partition_dp`) on PipeDream's fourteen profiles (`pipedream:NAME`, shipped in `pdcompile/profiles/pipedream/`; linearized "
        "with `passes/linearize.py`; no coarsening: every chain is planned at full length). "
        "Wall and CPU seconds per plan; target: under 1 s on A and B, under 10 s on C. "
        "Speedup: predicted samples/s over pure data parallelism on all workers under the same cost model "
        "(under `default`, a plan below 1x is marked where data parallelism itself would not fit the memory "
        "limit: the plan's note says so, and the baseline is then one that cannot run). Configuration: workers per stage, PipeDream's notation. Memory limit: 16 GiB per "
        "V100 under `default`, none under `paper`.",
        "",
        "| cluster | profile | layers | model | wall s | CPU s | on target | configuration | workers | speedup |",
        "|---|---|---:|---|---:|---:|---|---|---:|---:|",
        *rows,
        "",
        "Slowest plan per cluster and model (wall seconds):",
        "",
        "| cluster | model | slowest | median |",
        "|---|---|---:|---:|",
    ]
    for (cname, cm), ts in summary.items():
        ts = sorted(ts)
        lines.append(f"| {cname} | {cm} | {ts[-1]:.3f} | {ts[len(ts) // 2]:.3f} |")
    if ilp:
        lines += [
            "",
            f"ILP (`partition_ilp`, CP-SAT with one search worker, warm-started from the DP plan, time limit "
            f"{ilp_limit:g} s) on the "
            f"profiles of at most {ilp_max_layers} layers, clusters A and B:",
            "",
            "| cluster | profile | layers | model | ILP s | ILP configuration | DP vs ILP |",
            "|---|---|---:|---|---:|---|---|",
            *ilp_rows,
        ]
    return "\n".join(lines), all_ok


SCALE_SERVERS = 2048
SCALE_TARGET_S = 60.0
GROWTH = (256, 512, 1024, 2048)
SCALE_MODELS: tuple[tuple[str, dict], ...] = (("default", {"recompute": "auto"}), ("paper", {}))


def _timed(chain: Chain, cluster: ClusterSpec, cm: str, kw: dict) -> tuple[float, float, float, Plan | str]:
    """(wall s, CPU s, peak MiB, plan or the error's first clause) of one plan: timed alone, then
    planned again under tracemalloc for the peak (tracing numpy's allocations slows them down)."""
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        p: Plan | str = partition_dp(chain, cluster, cost_model=cm, **kw)
    except PdcompileError as e:
        p = str(e).split(";")[0]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tracemalloc.start()
    try:
        partition_dp(chain, cluster, cost_model=cm, **kw)
    except PdcompileError:
        pass
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return wall, cpu, peak, p


def scale(quick: bool) -> tuple[str, bool]:
    """Every profile on 8 x 2048, and the growth of two of them over 8 x 256 .. 8 x 2048."""
    names = pipedream_profiles()
    if quick:
        names = [n for n in names if n in ("vgg16", "gnmt")]
    chains = {n: linearize(load(f"pipedream:{n}")) for n in names}
    ok_all = True
    rows = []
    big = paper_cluster("B", servers=SCALE_SERVERS)
    for name in names:
        for cm, kw in SCALE_MODELS:
            wall, cpu, peak, p = _timed(chains[name], big, cm, kw)
            ok = wall < SCALE_TARGET_S
            ok_all &= ok
            print(f"8x{SCALE_SERVERS} {name} {cm}: {wall:.2f} s", file=sys.stderr, flush=True)
            if isinstance(p, str):
                what, extra = f"infeasible: {p}", "- | -"
            else:
                rc = sum(s.recompute == "full" for s in p.stages)
                what = _config(p) + ("" if p.optimal else " (not proven optimal)")
                extra = f"{p.workers_used} | {rc}"
            opts = cm + "".join(f", {k}={v}" for k, v in kw.items())
            rows.append(f"| {name} | {len(chains[name])} | {opts} | {wall:.2f} | {cpu:.2f} | {peak:.1f} | "
                        f"{'yes' if ok else '**no**'} | {what} | {extra} |")
    growth = []
    for name in [n for n in ("gnmt", "vgg16") if n in chains]:
        for cm, kw in SCALE_MODELS:
            prev = None
            for servers in GROWTH:
                wall, cpu, peak, _p = _timed(chains[name], paper_cluster("B", servers=servers), cm, kw)
                ratio = "" if prev is None else f"{wall / prev:.2f}"
                prev = wall
                opts = cm + "".join(f", {k}={v}" for k, v in kw.items())
                growth.append(f"| {name} | {opts} | 8 x {servers} | {8 * servers} | {wall:.2f} | {cpu:.2f} | "
                              f"{peak:.1f} | {ratio} |")
    lines = [
        f"Scale: every profile on 8 x {SCALE_SERVERS} = {8 * SCALE_SERVERS:,} workers (Cluster B's servers, "
        "`paper_cluster(\"B\", servers=2048)`); `default` with the 16 GiB memory limit and `recompute=\"auto\"` "
        "(recomputation chosen per stage), and `paper`. Target: under "
        f"{SCALE_TARGET_S:g} s each. Peak: tracemalloc's peak during the plan (numpy's arrays included; "
        "measured on a second, untimed plan, as tracing slows numpy's allocations). Recomputing: stages the plan recomputes. Every plan is "
        "the exact search's: the top level searches by breakpoints, which `tests/test_partition_search.py` "
        "holds equal (time, stages, ranks) to the unpruned search over every (replicas, downstream) pair.",
        "",
        "| profile | layers | model | wall s | CPU s | peak MiB | on target | configuration | workers | recomputing |",
        "|---|---:|---|---:|---:|---:|---|---|---:|---:|",
        *rows,
        "",
        "Growth (workers x2 -> wall time x ratio):",
        "",
        "| profile | model | cluster | workers | wall s | CPU s | peak MiB | x previous |",
        "|---|---|---|---:|---:|---:|---:|---:|",
        *growth,
    ]
    return "\n".join(lines), ok_all


CLI_CLUSTERS: dict[str, tuple[ClusterSpec, float]] = {
    "A": (paper_cluster("A"), 0.1),
    "B": (paper_cluster("B"), 0.1),
    "C8x128": (paper_cluster("B", servers=128), 2.0),
}
CLI_GROWTH = (16, 32, 64, 128)
PLANS_FILE = Path(__file__).resolve().parent / "planner_plans.json"


@functools.cache
def _cli_args(cm: str) -> argparse.Namespace:
    """``pdcompile plan --cost-model cm``'s arguments, its defaults read from the command's own parser
    (the profile and cluster named here are placeholders: the caller plans its own)."""
    from pdcompile.cli import build_parser

    return build_parser().parse_args(["plan", "--profile", "pipedream:NAME", "--cluster", "paper:A", "--cost-model", cm])


def _cli_plan(prof: Any, chain: Chain, cluster: ClusterSpec, cm: str) -> Plan | str:
    """``pdcompile plan --json``'s plan (its defaults, dp solver: the command's own planning options,
    ``pdcompile/_cli/plan.py`` ``plan_options``), or the error's first clause."""
    from pdcompile._cli.plan import plan_options
    from pdcompile.plan import plan as make_plan

    try:
        return make_plan(chain, cluster, plan_options(_cli_args(cm), prof.optimizer), solver="dp")
    except PdcompileError as e:
        return str(e).split(";")[0]


def _fingerprint(p: Plan) -> str:
    d = p.to_dict()
    d.pop("planning_seconds")
    for st in d["stages"]:  # the stored plans predate shard= (issue 26): an unsharded stage reads as they do
        if st.get("shard") == "none":
            st.pop("shard")
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def cli(quick: bool, check: bool) -> tuple[str, bool]:
    """Every profile as ``pdcompile plan --json`` plans it, on A, B and 8 x 128; growth per doubling."""
    names = pipedream_profiles()
    if quick:
        names = [n for n in names if n in ("alexnet", "vgg16", "resnet50", "gnmt")]
    ref = json.loads(PLANS_FILE.read_text())["plans"] if check else {}
    for cm in ("default", "paper"):
        _cli_args(cm)  # the command's parser built before any plan is timed
    ok_all, rows, growth = True, [], []
    same = differ = 0
    for name in names:
        prof = load(f"pipedream:{name}")
        chain = linearize(prof)
        for cname, (cluster, target) in CLI_CLUSTERS.items():
            for cm in ("default", "paper") if check else ("default",):
                c0 = time.process_time()
                p = _cli_plan(prof, chain, cluster, cm)
                cpu = time.process_time() - c0
                secs = p.planning_seconds if isinstance(p, Plan) else math.nan
                key = f"{name}|{cname}|{cm}"
                verdict = ""
                if check and key in ref:
                    want = ref[key].get("sha256")
                    ok_same = (want is None and isinstance(p, str)) or (isinstance(p, Plan) and _fingerprint(p) == want)
                    same += ok_same
                    differ += not ok_same
                    verdict = "same" if ok_same else "**differs**"
                print(f"cli {key}: {secs:.3f} s {verdict}", file=sys.stderr, flush=True)
                if cm != "default":
                    continue
                ok = secs < target
                ok_all &= ok
                what = p.configuration if isinstance(p, Plan) else f"infeasible: {p}"
                pooled = isinstance(p, Plan) and any(n.startswith("pooled") for n in p.notes)
                rows.append(f"| {name} | {len(chain)} | {cname} | {secs:.3f} | {cpu:.3f} | {'yes' if ok else '**no**'} | "
                            f"{what}{' (pooled)' if pooled else ''} | {verdict or '-'} |")
    for name in [n for n in ("gnmt", "nasnetalarge") if n in names]:
        prof = load(f"pipedream:{name}")
        chain = linearize(prof)
        prev = None
        for servers in CLI_GROWTH:
            p = _cli_plan(prof, chain, paper_cluster("B", servers=servers), "default")
            secs = p.planning_seconds if isinstance(p, Plan) else math.nan
            ratio = "" if prev is None else f"{secs / prev:.2f}"
            prev = secs
            growth.append(f"| {name} | 8 x {servers} | {8 * servers} | {secs:.3f} | {ratio} |")
    lines = [
        "As the command line plans (`pdcompile plan --profile pipedream:NAME --cluster C --json`: cost model "
        "`default` with the 16 GiB memory limit, `recompute=\"auto\"`, pooled workers on): `planning_seconds` "
        "as the plan reports it, and CPU seconds. Targets: under 0.1 s on A and B, under 2 s on 8 x 128 "
        "(Cluster B's servers, 1024 workers)."
        + (f" Plans compared with those chosen before the split and speed work (`benchmarks/planner_plans.json`, "
           f"`default` and `paper` on each cluster): {same} identical, {differ} different." if check else ""),
        "",
        "| profile | layers | cluster | planning s | CPU s | on target | configuration | plan as before |",
        "|---|---:|---|---:|---:|---|---|---|",
        *rows,
        "",
        "Growth per doubling of workers (the same defaults):",
        "",
        "| profile | cluster | workers | planning s | x previous |",
        "|---|---|---:|---:|---:|",
        *growth,
    ]
    return "\n".join(lines), ok_all and differ == 0


_WORKER = r"""
import json, sys, time
root = sys.argv[1]
if root:  # the tree at a revision, laid out as it installs; the editable install's finder set aside
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
    sys.path.insert(0, root)
from pdcompile.cluster import paper_cluster
from pdcompile.passes.linearize import linearize
from pdcompile.passes.partition_dp import partition_dp
from pdcompile.profile import load, optimizer_state_factor
for line in sys.stdin:
    name, servers = line.split()
    prof = load(f"pipedream:{name}")
    chain = linearize(prof)
    cluster = paper_cluster(servers) if servers in ("A", "B") else paper_cluster("B", servers=int(servers))
    cpu = float("inf")
    for _ in range(3 if servers in ("A", "B") else 1):  # the least of three where a plan is quick
        c0 = time.process_time()
        plan = partition_dp(chain, cluster, cost_model="default", recompute="auto", pool=True,
                            optimizer_state_factor=optimizer_state_factor(prof.optimizer))
        cpu = min(cpu, time.process_time() - c0)
    d = plan.to_dict()
    d.pop("planning_seconds")
    print(json.dumps({"cpu": cpu, "plan": d}), flush=True)
"""


def _common(a: Any, b: Any) -> tuple[Any, Any]:
    """``a`` and ``b`` with the dict keys only one of them has dropped (at every depth): a field a
    later revision adds to the Plan does not make the same plan differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) & set(b))
        pairs = [_common(a[k], b[k]) for k in keys]
        return {k: x for k, (x, _) in zip(keys, pairs)}, {k: y for k, (_, y) in zip(keys, pairs)}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = [_common(x, y) for x, y in zip(a, b)]
        return [x for x, _ in pairs], [y for _, y in pairs]
    return a, b


def versus(revs: str, quick: bool) -> tuple[str, bool]:
    """The command line's defaults planned by the whole package at git revision ``BEFORE`` and at
    ``AFTER`` (``BEFORE:AFTER``; no ``AFTER``: the working tree), one worker process each, asked
    alternately (the same load for both; who goes first alternates too): CPU seconds, ratio, and
    whether the plans are identical."""
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parent.parent
    before, _, after = revs.partition(":")
    names = pipedream_profiles()
    if quick:
        names = [n for n in names if n in ("alexnet", "vgg16", "resnet50", "gnmt")]
    rows, same_all = [], True
    with tempfile.TemporaryDirectory() as tmp:
        workers = []
        for k, rev in enumerate((before, after)):
            tree = ""
            if rev:  # the tree at rev as it installs: pdcompile/, passes/ and runtime/ inside it (setup.cfg)
                src = Path(tmp) / f"tree{k}"
                src.mkdir()
                archive = subprocess.run(["git", "archive", rev], cwd=root, capture_output=True, check=True).stdout
                subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
                for sub in ("passes", "runtime"):
                    (src / sub).rename(src / "pdcompile" / sub)
                tree = str(src)
            workers.append(subprocess.Popen([sys.executable, "-c", _WORKER, tree], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True, cwd=tmp))

        def ask(w: subprocess.Popen, name: str, servers: str) -> dict:
            assert w.stdin and w.stdout
            w.stdin.write(f"{name} {servers}\n")
            w.stdin.flush()
            return json.loads(w.stdout.readline())

        for w in workers:  # warm up: imports and numpy's first calls
            ask(w, "alexnet", "A")
        turn = 0
        for name in names:
            for cname, servers in (("A", "A"), ("B", "B"), ("C8x128", "128")):
                order = (0, 1) if turn % 2 == 0 else (1, 0)
                turn += 1
                got: dict[int, dict] = {}
                for k in order:
                    got[k] = ask(workers[k], name, servers)
                a, b = _common(got[0]["plan"], got[1]["plan"])
                same = a == b
                same_all &= same
                cpu = (got[0]["cpu"], got[1]["cpu"])
                print(f"versus {name} {cname}: {cpu[0]:.3f} -> {cpu[1]:.3f} s {'same' if same else 'DIFFERS'}",
                      file=sys.stderr, flush=True)
                rows.append(f"| {name} | {cname} | {cpu[0]:.3f} | {cpu[1]:.3f} | {cpu[0] / max(cpu[1], 1e-9):.1f}x | "
                            f"{'yes' if same else '**no**'} |")
        for w in workers:
            assert w.stdin
            w.stdin.close()
            w.wait(timeout=60)
    lines = [
        f"Before and after, alternately (the same load for both): the package at `{before}` and "
        f"{f'at `{after}`' if after else 'as now'}, each in its own process, with the command line's defaults "
        "(`default`, `recompute=\"auto\"`, pool on); CPU seconds per plan (on A and B the least of three).",
        "",
        "| profile | cluster | before CPU s | after CPU s | faster | same plan |",
        "|---|---|---:|---:|---:|---|",
        *rows,
    ]
    return "\n".join(lines), same_all


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="four profiles only")
    ap.add_argument("--no-ilp", action="store_true", help="skip the ILP cross-check")
    ap.add_argument("--ilp-time-limit", type=float, default=10.0)
    ap.add_argument("--ilp-max-layers", type=int, default=70)
    ap.add_argument("--no-write", action="store_true", help="print only; don't touch RESULTS.md")
    ap.add_argument("--no-scale", action="store_true", help="skip the 8 x 2048 scale measurement")
    ap.add_argument("--no-cli", action="store_true", help="skip the command line's defaults on A, B, 8 x 128")
    ap.add_argument("--check-plans", action="store_true",
                    help="compare every plan with benchmarks/planner_plans.json (the plans chosen before)")
    ap.add_argument("--only-cli", action="store_true", help="the command line's section only")
    ap.add_argument("--versus", metavar="BEFORE[:AFTER]",
                    help="only: the command line's defaults planned by the package at git BEFORE and at AFTER "
                         "(default: the working tree), alternately")
    args = ap.parse_args()
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    if args.versus:
        body, ok = versus(args.versus, args.quick)
    elif args.only_cli:
        body, ok = cli(args.quick, args.check_plans)
    else:
        body, ok = run(args.quick, not args.no_ilp, args.ilp_time_limit, args.ilp_max_layers)
        if not args.no_cli:
            cbody, cok = cli(args.quick, args.check_plans)
            body += "\n\n" + cbody
            ok &= cok
    if not args.no_scale and not args.only_cli and not args.versus:
        sbody, sok = scale(args.quick)
        body += "\n\n" + sbody
        ok &= sok
    load_after = os.getloadavg()
    body += (f"\n\nLoad average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
             f"after: {', '.join(f'{x:.2f}' for x in load_after)}.")
    body += f"\n\nWhole benchmark: {time.perf_counter() - t0:.0f} s. All targets met: {'yes' if ok else 'no'}."
    print(body)
    if not args.no_write and not args.quick and not args.only_cli and not args.versus:
        write_section("Planner (bench_planner)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
