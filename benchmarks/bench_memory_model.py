"""Benchmark: the planner's predicted peak memory per stage against what each stage measured in a run.

A GPT (``pdcompile.zoo.gpt``) and the zoo's small VGG (``pdcompile.zoo.get("vgg")``) are each
compiled into a 2-stage pipeline under each recomputation mode (``none``, ``selective``, ``partial``: the
split compiled without recomputation planned again under the largest of ``PARTIAL_FACTORS`` x a
stage's memory at which ``recompute="auto"`` checkpoints a stage's fewest first layers that fit;
``full``), and trained through
torchrun (gloo, CPU) under every schedule. The prediction is
the partitioner's stage memory (weights x versions, gradients, optimizer state, saved activations
per microbatch in flight from annotate-costs' saved-tensor hooks, inputs and outputs); the
measurement is the stage's own accounting (runtime/memory.py) in the metrics JSON.

Usage: python benchmarks/bench_memory_model.py [--steps 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

from benchmarks._results import write_section  # noqa: E402
from pdcompile.api import pdcompile  # noqa: E402
from pdcompile.launcher import launch  # noqa: E402
from pdcompile.passes.partition_dp import PlanModel, PlanOptions, plan_from_assignment  # noqa: E402
from pdcompile.simulate import simulate_plan  # noqa: E402
from pdcompile.zoo import get, gpt, vgg  # noqa: E402

CFG = dict(vocab_size=2048, seq_len=64, d_model=128, n_heads=4, n_layers=4)
SCHEDULES = ("gpipe", "flush", "1f1b", "2bw")
# schedules with several stages per rank, by the placement they are compiled for (4 stages on 2 ranks)
VIRTUAL = {"interleaved-1f1b": ("interleaved-1f1b", "looped-bfs"), "zb-v": ("zb-v", "dualpipe-v")}
V = 2
MODES = ("none", "selective", "partial", "full")
# the modes the virtual-stage rows run (4 stages on 2 ranks, compiled per placement)
VIRTUAL_MODES = ("none", "full")


def _mib(x: float) -> str:
    return f"{x / 2**20:.3f}"


def _parts(meas: dict) -> str:
    """The parts at the peak, then the error with posted receive buffers (not in the model) left out."""
    return " | ".join(_mib(meas[k]) for k in ("weights", "gradients", "optimizer_state", "activations", "recompute",
                                              "receive_buffers"))


def _err_np(pred: float, meas: dict) -> str:
    """The error against the measured peak less its posted receive buffers (the model leaves them out)."""
    return f"{(pred / (meas['total'] - meas['receive_buffers']) - 1) * 100:+.1f}%"


def _predict(pipe, name: str, M: int, mode: str):  # type: ignore[no-untyped-def]
    """Per stage (in flight, predicted bytes) of ``pipe``'s program run under schedule ``name``:
    the planner's stage memory for that schedule at each stage's own recomputation (the program's:
    for partial, its compiled head, which the runtime runs whatever the schedule)."""
    chain, cluster = pipe.state.chain, pipe.state.cluster
    assign = [(s.first, s.last, s.replicas, s.ranks) for s in pipe.plan.stages]
    plan = plan_from_assignment(chain, cluster, assign, schedule=name, memory_limit=False, num_microbatches=M,
                                recompute="none" if mode == "partial" else mode)
    if mode != "partial":
        return [(st.in_flight, st.memory_bytes) for st in plan.stages]
    model = PlanModel(chain, cluster, PlanOptions(schedule=name, memory_limit=False, num_microbatches=M, recompute="auto"))
    return [(st.in_flight, model.memory_at(st.first, st.last, st.in_flight, st.weight_versions, own.recompute,
                                           head=own.recompute_layers))
            for st, own in zip(plan.stages, pipe.plan.stages)]


def _compile(model_name: str, cfg, batch: int, M: int, x, y, **kw):  # type: ignore[no-untyped-def]
    """The 2-stage pipeline of ``model_name`` (compiled for flush) and its data hook."""
    if model_name == "gpt":
        torch.manual_seed(0)
        model, inputs, target, loss_fn = gpt.GPT(cfg), (x,), y, gpt.SequenceCrossEntropy()
        leaf: tuple[type[torch.nn.Module], ...] = ()
        data = {"factory": "benchmarks.bench_runtime_memory:batches", "kwargs": CFG}
    else:
        z = get("vgg", batch_size=batch, seed=0)
        model, inputs, target, loss_fn, leaf = z.model, z.example_inputs, z.target, z.loss_fn, z.leaf_modules
        data = {"factory": "pdcompile.zoo:batches", "kwargs": {"name": "vgg"}}
    pipe = pdcompile(model, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), stages=2,
                     schedule="flush", num_microbatches=M, leaf_modules=leaf, **kw)
    return pipe, data, (model, inputs, target, loss_fn, leaf)


def _run(prog: Path, nproc: int, name: str, steps: int, out: Path, env: dict[str, str]) -> list[dict]:
    rc, log = launch(prog, nproc, ["--schedule", name, "--steps", str(steps), "--metrics", str(out),
                                   "--timeout", "120"], timeout=600, env=env)
    if rc != 0:
        raise SystemExit(f"{prog.name} {name} failed (exit {rc}):\n{log[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]


PARTIAL_FACTORS = (0.95, 0.9, 0.85, 0.8, 0.7, 0.6)  # memory limits tried for partial, x a stage's memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--new-only", action="store_true", help="only the zb-h1 and virtual-stage rows; print, don't write")
    ap.add_argument("--models", default="gpt,vgg")
    ap.add_argument("--modes", default=",".join(MODES), help="recomputation modes, of " + ",".join(MODES)
                    + " (partial needs none before it); print, don't write unless all")
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="schedules of the 2-stage table")
    args = ap.parse_args()
    modes = tuple(args.modes.split(","))
    schedules = tuple(args.schedules.split(","))
    if "partial" in modes and "none" not in modes[:modes.index("partial")]:
        raise SystemExit("--modes: partial plans the split compiled with none: list none before it")
    everything = modes == MODES and schedules == SCHEDULES and args.models == "gpt,vgg"
    load_start = os.getloadavg()[0]
    cfg = gpt.GPTConfig(**CFG)
    M = args.microbatches
    batch = M * args.microbatch_size
    (x,), y = gpt.make_batch(cfg, torch.device("cpu"), 0, batch)
    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows, new_rows = [], []
    skipped: set[str] = set()
    worst = worst_new = worst_rank = 0.0
    errs: dict[tuple[str, str], list[float]] = {}
    outside: list[str] = []
    partial_factor: dict[str, str] = {}
    no_partial: dict[str, list[str]] = {}  # model -> what the planner chose instead at the smallest limit
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models.split(","):
            free = None  # the pipeline compiled without recomputation: partial plans its split again
            for recompute in modes:
                if recompute == "partial":
                    assert free is not None, "partial needs the 'none' pipeline first (MODES order)"
                    # the largest limit under the largest stage (of these factors) where a stage recomputes partially
                    limits = sorted(((f * st.memory_bytes, f, st.index) for st in free.plan.stages
                                     for f in PARTIAL_FACTORS), reverse=True)
                    for limit, factor, limited in limits:
                        pipe, data, (model, inputs, target, loss_fn, leaf) = _compile(
                            model_name, cfg, batch, M, x, y, recompute="auto", cluster=free.cluster.with_memory(limit))
                        if any(st.recompute == "partial" for st in pipe.plan.stages):
                            break
                    else:  # every head needs more than no recomputation or than all of the stage here
                        no_partial[model_name] = [st.recompute_text for st in pipe.plan.stages]
                        continue
                    partial_factor[model_name] = f"{factor} x stage {limited}'s"
                    got_split = [(st.first, st.last) for st in pipe.plan.stages]
                    want_split = [(st.first, st.last) for st in free.plan.stages]
                    if got_split != want_split:
                        raise SystemExit(f"{model_name} partial: recompute='auto' under {limit:.0f} bytes changed the "
                                         f"split ({want_split} -> {got_split}); the comparison needs the same stages")
                else:
                    pipe, data, (model, inputs, target, loss_fn, leaf) = _compile(
                        model_name, cfg, batch, M, x, y, recompute=recompute)
                    if recompute == "none":
                        free = pipe
                texts = [st.recompute_text for st in pipe.plan.stages]
                prog = pipe.emit(Path(tmp) / f"prog_{model_name}_{recompute}", data=data)
                for name in () if args.new_only else schedules:
                    pred_by_stage = _predict(pipe, name, M, recompute)
                    out = Path(tmp) / f"m_{model_name}_{recompute}_{name}"
                    for m in _run(prog, pipe.world_size, name, args.steps, out, env):
                        s, meas = m["stage"], m["memory"]
                        k, pred = pred_by_stage[s]
                        err = pred / meas["total"] - 1
                        worst = max(worst, abs(err))
                        errs.setdefault((recompute, name), []).append(abs(err))
                        if abs(err) > 0.10:
                            outside.append(f"{model_name} {name} {recompute} stage {s} {err * 100:+.1f}%")
                        rows.append(f"| {model_name} | {name} | {recompute} | {s} | {texts[s]} | {k} | "
                                    f"{_mib(pred)} | {_mib(meas['total'])} | {err * 100:+.1f}% | "
                                    f"{_err_np(pred, meas)} | {_parts(meas)} |")
                        print(rows[-1], flush=True)
                # ZB-H1 on the same 2-stage program: the planner's memory for it, as above
                pred_by_stage = _predict(pipe, "zb-h1", M, recompute)
                for m in _run(prog, pipe.world_size, "zb-h1", args.steps, Path(tmp) / f"m_{model_name}_{recompute}_zbh1",
                              env):
                    s, meas = m["stage"], m["memory"]
                    k, pred = pred_by_stage[s]
                    err = pred / meas["total"] - 1
                    worst_new = max(worst_new, abs(err))
                    shown = recompute if texts[s] == recompute else f"{recompute}: {texts[s]}"
                    new_rows.append(f"| {model_name} | zb-h1 | {shown} | stage {s} (rank {s}) | "
                                    f"{k} | {_mib(pred)} | {_mib(meas['total'])} | "
                                    f"{err * 100:+.1f}% | {_err_np(pred, meas)} | {_parts(meas)} |")
                    print(new_rows[-1], flush=True)
                if recompute not in VIRTUAL_MODES:
                    continue
                # 4 stages on 2 ranks, compiled for each placement; the prediction is simulate_plan's
                # per-stage memory (the planner's stage memory at the simulated in-flight counts), a
                # rank's the sum of its stages'
                for placed, names in VIRTUAL.items():
                    if model_name == "gpt":
                        torch.manual_seed(0)
                        model = gpt.GPT(cfg)
                    else:
                        model = get("vgg", batch_size=batch, seed=0).model
                    vpipe = pdcompile(model, example_inputs=inputs, example_target=target, loss_fn=loss_fn,
                                      optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), stages=2 * V,
                                      virtual_stages=V, schedule=placed, num_microbatches=M, recompute=recompute,
                                      leaf_modules=leaf)
                    vprog = vpipe.emit(Path(tmp) / f"prog_{model_name}_{recompute}_{placed}", data=data)
                    for name in names:
                        sim = simulate_plan(vpipe.plan, vpipe.state.chain, vpipe.state.cluster, name, M,
                                            virtual_stages=V)
                        got = _run(vprog, vpipe.world_size, name, args.steps,
                                   Path(tmp) / f"m_{model_name}_{recompute}_{name}", env)
                        for m in got:
                            r, by = m["rank"], m["memory_by_stage"]
                            for key in sorted(by, key=int):
                                s, meas = int(key), by[key]
                                pred = sim.peak_memory_bytes[s]
                                err = pred / meas["total"] - 1
                                worst_new = max(worst_new, abs(err))
                                new_rows.append(f"| {model_name} | {name} | {recompute} | stage {s} (rank {r}) | "
                                                f"{sim.peak_in_flight[s]} | {_mib(pred)} | {_mib(meas['total'])} | "
                                                f"{err * 100:+.1f}% | {_err_np(pred, meas)} | {_parts(meas)} |")
                                print(new_rows[-1], flush=True)
                            pred = sum(sim.peak_memory_bytes[int(k)] for k in by)
                            summed = {k: sum(v[k] for v in by.values()) for k in next(iter(by.values()))}
                            err = pred / summed["total"] - 1
                            worst_rank = max(worst_rank, abs(err))
                            new_rows.append(f"| {model_name} | {name} | {recompute} | **rank {r}** (stages "
                                            f"{', '.join(sorted(by, key=int))}) | | {_mib(pred)} | "
                                            f"{_mib(summed['total'])} | {err * 100:+.1f}% | {_err_np(pred, summed)} | "
                                            f"{_parts(summed)} |")
                            print(new_rows[-1], flush=True)
    load = os.getloadavg()[0]

    def within(mode: str) -> str:
        per = [(name, errs.get((mode, name), [])) for name in schedules]
        n = sum(sum(e <= 0.10 for e in v) for _, v in per)
        return (f"{mode} {n}/{sum(len(v) for _, v in per)} ("
                + ", ".join(f"{name} {sum(e <= 0.10 for e in v)}/{len(v)}" for name, v in per) + ")")

    lines = [
        f"GPT {CFG} and the zoo's small VGG ({vgg.CONFIGS['small']}), 2 stages, {M} microbatches of "
        f"{args.microbatch_size}, SGD with momentum, {args.steps} steps, "
        f"gloo on CPU; load average {load_start:.2f} at the start, {load:.2f} at the end (bytes do not depend on "
        f"load). Each model is compiled once per recomputation mode (for flush) and that program runs every "
        f"schedule: `none`, `selective`, `full` as `recompute=` says; `partial`: the split compiled with `none` "
        f"planned again with `recompute=\"auto\"` on its cluster `.with_memory(f x a stage's memory)`, "
        f"the largest such limit (f in {PARTIAL_FACTORS}) where a stage recomputes partially (here "
        f"{', '.join(f'{m}: {f}' for m, f in partial_factor.items())}"
        + "".join(f"; {m}: none, at every such limit the planner recomputes {', '.join(chosen)} instead, every "
                  f"head of its stages needing more than no recomputation or than the whole stage (the inputs kept, "
                  f"the rebuilt microbatch's tail still counted, what the tail re-saves)"
                  for m, chosen in no_partial.items())
        + f"), so the stages that do not fit "
        f"checkpoint their fewest first layers (column 'stage "
        f"recomputes'). Predicted: the partitioner's stage memory "
        f"for that schedule at the stage's own recomputation (`PlanModel.memory_at` with the program's head for "
        f"partial); measured: the stage's peak at its measuring points (runtime/memory.py), parts at that peak, "
        f"MiB; 'error, posted receives left out': against the measured peak less its posted receive buffers, "
        f"which the model does not count.",
        "",
        "| model | schedule | recompute | stage | stage recomputes | in flight | predicted | measured | error "
        "| error, posted receives left out | weights | grads | opt state | activations | rebuilt | posted receives |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "", f"Largest error: {worst * 100:.1f}%. Within 10% per mode: "
        + "; ".join(within(mode) for mode in modes) + "."
        + (f" Outside: {'; '.join(outside)}." if outside else ""), "",
        "What is counted: the first stage's data are views of the minibatch; the prediction (annotate-costs "
        "runs on a microbatch with its own storage) and the measurement (the bytes a view spans) charge each "
        "microbatch in flight its own bytes, not the minibatch's storage, which the data path holds for the "
        "step in every schedule and neither counts. With recomputation the first stage keeps its data inputs "
        "(its first layer's saved input bytes in the chain). What the model leaves out: posted receive "
        "buffers (the column above: the gradients a stage has posted receives for); they are most of the "
        "remaining under-prediction of stage 0 with recomputation, where its other parts are small.",
        "",
        "Partial (the planner's `_partial_term`; bytes exact from the metrics JSON, deterministic): at the moment "
        "a backward rebuilds the head, the model charges (1) the tail's weight gradients, which its backward "
        "made just before; (2) the rebuilt microbatch's tail beside its head, as the stage's meter counts it "
        "(autograd has freed those saved tensors by then, so both count more than the allocator holds); (3) "
        "what a tail's first layer saves that a head layer saved first (annotate-costs' `resaved_bytes`, e.g. a "
        "conv's input an in-place ReLU saved; as a bound, the most any later layer re-saves).",
        "",
        f"The schedules with split backwards or several stages per rank: zb-h1 on the same 2-stage programs, "
        f"every mode (predicted: the planner's stage memory for zb-h1, as above); with `none` and `full` only "
        f"(the modes these rows ran before selective and partial existed), interleaved-1f1b and looped-bfs (stage s on rank "
        f"s % 2) and zb-v and dualpipe-v (a V: stage s on rank min(s, 3-s)) on {2 * V} stages of the same models "
        f"on 2 ranks, compiled once per placement (predicted: `simulate_plan(..., virtual_stages={V})`'s per-stage "
        f"memory, the planner's stage memory at the simulated in-flight count). Measured: each stage's own "
        f"meter (`memory_by_stage`); a rank's row is the sum of its stages' peaks on both sides (an upper "
        f"bound of the rank's peak where its stages peak at different moments).",
        "",
        "| model | schedule | recompute | stage / rank | in flight | predicted | measured | error "
        "| error, posted receives left out | weights | grads | opt state | activations | rebuilt | posted receives |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *new_rows, "", f"Largest error per stage: {worst_new * 100:.1f}%; per rank: {worst_rank * 100:.1f}%."
        + (f" Not run: {'; '.join(sorted(skipped))}." if skipped else ""),
        "",
        "What the model does here: a stage's weight gradients exist from its first backward (B, or W when "
        "split) to its ST, which frees them, so a stage that runs every forward before its first backward "
        "(looped BFS; interleaved 1F1B's and a V's first stage) peaks without them "
        "(`SimResult.peak_in_flight_with_grads`); before that change these stages were over-predicted by one "
        "gradient copy (GPT interleaved stage 0 +22.9%, looped BFS up to +22.9%). What it leaves out, as above: "
        "posted receive buffers, which weigh more with 4 stages on 2 ranks (every boundary but a V's turn "
        "crosses ranks, and the small VGG's stages hold a few KiB each): the column 'posted receives left "
        "out' shows the rest. A recomputing stage is also modelled at its rebuilds while it holds "
        "gradients (`SimResult.peak_in_flight_at_rebuild`: looped BFS and a V run a stage's later "
        "backwards back to back, each rebuilding a microbatch beside the gradients); before that term GPT's "
        "full-recomputation rows on 2 stages per rank were under-predicted by up to 19.5% (looped BFS stage 2; "
        "interleaved and V stage 0 -12.2%), now by at most 10.6%, 1.1% with posted receives counted. The "
        "largest errors left are the small VGG's stages of 0.03-0.13 MiB, where posted receives (the "
        "column beside) and other buffers of a few KiB weigh 10-28%.",
    ]
    if everything and not args.new_only:
        write_section("Memory model: predicted vs measured per stage (bench_memory_model)", "\n".join(lines))
    print("\n".join(lines[-20:]))


if __name__ == "__main__":
    main()
