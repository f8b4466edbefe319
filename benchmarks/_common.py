"""Shared pieces of the comparison benchmarks: models, compiling, launching workers, reading timings."""

from __future__ import annotations

import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdcompile.launcher import free_port, launch
from pdcompile.zoo import gpt, vgg
from pdcompile.zoo.losses import SequenceCrossEntropy

ROOT = Path(__file__).resolve().parent.parent  # the repository root (workers import benchmarks.*)


@dataclass(frozen=True)
class Bench:
    """One benchmark model: the module, one minibatch and its loss."""

    name: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor
    loss_fn: nn.Module


def bench_model(name: str, batch_size: int = 32, size: str = "bench", seed: int = 0) -> Bench:
    """GPT- or VGG-style model for timing: ``bench`` is big enough that a microbatch of 8 costs a few
    milliseconds of CPU (compute dominates launch noise); ``fc`` (VGG only) has VGG's parameter-heavy
    classifier; ``tiny`` is for smoke tests."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        cfg = (gpt.GPTConfig(vocab_size=256, seq_len=32, d_model=96, n_heads=4, n_layers=4) if size == "bench"
               else gpt.GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2))
        model: nn.Module = gpt.GPT(cfg)
        tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
        return Bench(name, model, (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous(), SequenceCrossEntropy())
    if name == "vgg":
        M = vgg.M
        cfg2 = {"bench": vgg.VGGConfig(layers=(16, 16, M, 32, 32, M, 64, 64, M), image_size=32, hidden=256,
                                       num_classes=10),
                # VGG's real shape: most parameters in the classifier (2.1M of 2.2M), small activations late
                "fc": vgg.VGGConfig(layers=(16, 16, M, 32, 32, M, 64, 64, M), image_size=32, hidden=1024,
                                    num_classes=10),
                }.get(size, vgg.VGGConfig(layers=(4, M, 8, M), image_size=8, hidden=16, num_classes=10))
        model = vgg.VGG(cfg2)
        x = torch.randn((batch_size, 3, cfg2.image_size, cfg2.image_size), generator=g)
        return Bench(name, model, (x,), torch.randint(0, 10, (batch_size,), generator=g), nn.CrossEntropyLoss())
    raise ValueError(f"unknown benchmark model {name!r} (gpt, vgg)")


def sgd(params: Any) -> torch.optim.Optimizer:
    """The optimizer every benchmark uses (plain SGD: no optimizer state to favour anyone)."""
    return torch.optim.SGD(params, lr=0.01)


def compile_bench(b: Bench, stages: int, schedule: str, num_microbatches: int, **kw: Any) -> Any:
    """``pdcompile`` the benchmark model with the benchmarks' optimizer."""
    from pdcompile.api import pdcompile

    return pdcompile(b.model, example_inputs=b.inputs, example_target=b.target, loss_fn=b.loss_fn,
                     optimizer=sgd, stages=stages, schedule=schedule, num_microbatches=num_microbatches, **kw)


def torchrun(module: str, nproc: int, args: Sequence[str], *, timeout: float = 300,
             env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``python -m module args`` under torchrun on 127.0.0.1 from the repository root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "--max-restarts=0", "--monitor-interval=0.5", "-m", module, *args]
    full = dict(os.environ)
    full.setdefault("OMP_NUM_THREADS", "1")
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full.update(env or {})
    try:
        p = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=timeout, env=full)
    except subprocess.TimeoutExpired as e:
        return 124, str(e.stdout or "") + str(e.stderr or "")
    return p.returncode, p.stdout + p.stderr


def run_ours(program: Path, nproc: int, steps: int, schedule: str | None = None, extra: Sequence[str] = (),
             timeout: float = 300, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Launch the emitted ``program`` for ``steps`` minibatches; return each rank's metrics JSON."""
    metrics = Path(tempfile.mkdtemp(prefix="pd-bench-metrics-"))
    args = ["--steps", str(steps), "--metrics", str(metrics), "--timeout", "120", *extra]
    if schedule:
        args += ["--schedule", schedule]
    rc, log = launch(program, nproc, args, timeout=timeout, env=env)
    if rc != 0:
        raise RuntimeError(f"pdcompile run of {program} failed ({rc}):\n{log[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(metrics.glob("rank_*.json"))]


def ab_launch(program: Path, ours: str, theirs: str, *, blocks: int, block_steps: int,
              flags: tuple[str, ...] = (), theirs_flags: str = "", trace_blocks: int = 0,
              timeout: float = 400) -> dict[str, Any]:
    """One launch of ``benchmarks._ab_worker`` on ``program``: ours (train.py ``flags``) and theirs
    (torch's schedule ``theirs``, or ``"ours"`` with ``theirs_flags`` added) take turns for
    ``blocks`` blocks each, then ``trace_blocks`` more of ours traced (untimed); the worker's JSON."""
    out = Path(tempfile.mkdtemp(prefix="pd-bench-ab-")) / "times.json"
    nproc = int(json.loads((program / "plan.json").read_text())["world_size"])
    rc, log = torchrun("benchmarks._ab_worker", nproc,
                       ["--program", str(program), "--ours", ours, "--theirs", theirs, "--blocks", str(blocks),
                        "--block-steps", str(block_steps), "--out", str(out), "--watchdog", str(timeout - 10),
                        "--trace-blocks", str(trace_blocks),
                        *([f"--theirs-flags={theirs_flags}"] if theirs_flags else []), *flags],
                       timeout=timeout)
    if rc != 0:
        raise RuntimeError(f"benchmarks._ab_worker failed ({rc}):\n{log}")
    return dict(json.loads(out.read_text()))


def ab_blocks(got: dict[str, Any], side: str, warmup: int) -> list[list[float]]:
    """Per block of ``side`` (``"ours"``/``"theirs"``) of an :func:`ab_launch`, the slowest rank's
    step times with the block's first ``warmup`` steps dropped."""
    ranks = got[side]
    return [step_times([per_rank[i] for per_rank in ranks], warmup) for i in range(len(ranks[0]))]


def run_pair(program: Path, ours: str, theirs: str, *, blocks: int, block_steps: int, warmup: int,
             flags: tuple[str, ...] = (), theirs_flags: str = "",
             timeout: float = 400) -> tuple[list[list[float]], list[list[float]]]:
    """:func:`ab_launch`'s step times per block: (ours, theirs), block ``i`` of each side run next to
    each other."""
    got = ab_launch(program, ours, theirs, blocks=blocks, block_steps=block_steps, flags=flags,
                    theirs_flags=theirs_flags, timeout=timeout)
    return ab_blocks(got, "ours", warmup), ab_blocks(got, "theirs", warmup)


def action_times(events: Sequence[Sequence[Sequence[Any]]]) -> dict[tuple[int, str], float]:
    """``{(stage, kind): median seconds}`` of a traced run's compute actions (``events``: per rank,
    ``(name, start, end)``): kinds F, B (unsplit), I (a B whose W follows), W and ST. Waits (RF/RB),
    sends and the rest are left out."""
    took: dict[tuple[int, str], list[float]] = {}
    for rank_events in events:
        names = [str(n) for n, _, _ in rank_events]
        split = {n.replace("W", "B") for n in names if re.fullmatch(r"\d+W\d+", n)}
        for n, t0, t1 in rank_events:
            m = re.fullmatch(r"(\d+)(F|B|W|ST)\d*", str(n))
            if m:
                kind = "I" if m.group(2) == "B" and n in split else m.group(2)
                took.setdefault((int(m.group(1)), kind), []).append(float(t1) - float(t0))
    return {k: median(v) for k, v in took.items()}


def compute_bound(schedule: dict[str, Any], took: dict[tuple[int, str], float], steps: int = 4) -> float:
    """Seconds per step of ``schedule`` (a ``ScheduleSpec``'s JSON) replayed with what its actions took
    in a traced run (``took``: :func:`action_times`, the median per stage and kind) and nothing else:
    no transfer time, no waits but the schedule's own, no overhead between actions. No runtime runs
    this schedule faster on these actions' times."""
    from pdcompile.runtime.schedules.spec import ScheduleSpec
    from pdcompile.simulate import simulate_schedule

    spec = ScheduleSpec.from_json(schedule)
    stages = 1 + max(s for s, _ in took)

    def per_stage(kind: str, fallback: str = "") -> list[float]:
        """The median per stage of ``kind`` (else of ``fallback``; 0 where the stage has neither)."""
        return [took.get((s, kind), took.get((s, fallback), 0.0)) for s in range(stages)]

    sim = simulate_schedule(spec.name, spec.replicas, spec.num_microbatches, num_steps=steps,
                            vertical_sync=spec.vertical_sync, tied=False, split_backward=spec.split_backward,
                            virtual_stages=spec.virtual_stages, forward_s=per_stage("F"),
                            backward_s=per_stage("B", "I"), input_grad_s=per_stage("I", "B"),
                            weight_grad_s=per_stage("W"), step_s=per_stage("ST"))
    return float(sim.step_time_s)


def step_times(ranks: Sequence[Sequence[float]], warmup: int, per_step: int = 1) -> list[float]:
    """Per-step times from per-rank lists: ``per_step`` consecutive entries form one step (1F1B
    records one entry per microbatch-minibatch), the slowest rank counts, the first ``warmup``
    steps are dropped."""
    out = []
    n = min(len(r) for r in ranks) // per_step
    for i in range(warmup, n):
        out.append(max(sum(r[i * per_step:(i + 1) * per_step]) for r in ranks))
    return out


def median(xs: Sequence[float]) -> float:
    """Median, NaN for no data."""
    return statistics.median(xs) if xs else math.nan


def bootstrap_median(values: Sequence[float], level: float = 0.9, resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap ``level`` interval of the median of ``values`` (resampled with replacement, seeded):
    how far this machine's noise leaves a median of paired ratios uncertain."""
    vs = list(values)
    if len(vs) < 2:
        return (median(vs), median(vs))
    rng = random.Random(0)
    meds = sorted(median(rng.choices(vs, k=len(vs))) for _ in range(resamples))
    return meds[int((1 - level) / 2 * resamples)], meds[int((1 + level) / 2 * resamples) - 1]


def load_note() -> str:
    """The machine's load averages, for the table's caption (other jobs share these cores)."""
    a, b, c = os.getloadavg()
    return f"load average {a:.1f} / {b:.1f} / {c:.1f} (1/5/15 min) on {os.cpu_count()} cores"


def ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def finish_worker(times: Sequence[float], out: str | os.PathLike[str]) -> None:
    """End a benchmark worker: gather every rank's step times, rank 0 writes them to ``out`` as
    ``{"step_times_s": [[rank 0 times], ...]}``, then leave the process group."""
    import torch.distributed as dist

    gathered: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, list(times))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"step_times_s": gathered}))
    dist.barrier()
    dist.destroy_process_group()


# --- Llama shapes and one configuration per process (bench_big_model, bench_init_from) ----------------------------

LLAMA_SHAPES: dict[str, dict[str, Any]] = {  # transformers' LlamaConfig fields
    # the published models
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "llama-3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
                        rope_theta=500000.0),
    # bench_big_model's ranks part: 16 layers, so 16 stages of one layer each and the ends
    "llama-16-layers": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                            num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048),
    # bench_init_from: 322M parameters
    "llama-300m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
                       num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512),
    # --quick
    "tiny": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64),
    "tiny-16-layers": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=16,
                           num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64),
}


def llama_config(name: str) -> Any:
    """transformers' ``LlamaConfig`` of shape ``name`` (:data:`LLAMA_SHAPES`), without a KV cache."""
    import transformers

    return transformers.LlamaConfig(use_cache=False, **LLAMA_SHAPES[name])


def peak_rss_mib() -> float:
    """This process's peak resident set (``ru_maxrss``; Linux counts KiB): Python, torch and all."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(script: str, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """``python script --child JSON(cfg)`` in a process of its own; the dict it printed last (a JSON line),
    with ``wall_s``; or ``{"error": ..., "wall_s": ...}`` when it failed or ran past ``timeout``."""
    import time

    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, script, "--child", json.dumps(cfg)], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"not finished in {timeout:.0f} s", "wall_s": time.perf_counter() - t0}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {p.returncode}: {tail[:160]}", "wall_s": time.perf_counter() - t0}
    return {**json.loads(lines[-1]), "wall_s": time.perf_counter() - t0}
