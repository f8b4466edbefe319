"""This machine's link and collective constants (part of ``python -m pdcompile.calibrate``): the loopback
link's point-to-point fit, the runtime's all-reduce (``allreduce_flat``) fitted as fixed + bytes / rate, and the
same on ``cores + 1`` processes where ranks share the cores. Each probe is a torchrun of this module."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdcompile.machine_cache import COLLECTIVE_PROBE_TENSORS


def _torchrun_module(module: str, nproc: int, args: list[str], timeout: float) -> tuple[int, str]:
    import subprocess

    from pdcompile.launcher import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "--max-restarts=0", "--monitor-interval=0.5", "-m", module, *args]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        return 124, str(e.stdout or "") + str(e.stderr or "")
    return p.returncode, p.stdout + p.stderr


# gradients per all-reduce in the link probe's allreduce_flat samples (their flatten and copy back are in its fixed
# part: machine_cache takes them out where it charges them per tensor)
_GRAD_TENSORS = COLLECTIVE_PROBE_TENSORS


def _link_worker(out: str) -> None:
    """Under torchrun (2 processes, or more: the ping-pong between ranks 0 and 1 only): ping-pong, all-reduce
    of one buffer, and the runtime's own all-reduce of a stage's gradients (``allreduce_flat`` of
    :data:`_GRAD_TENSORS` tensors: flattened, reduced, copied back) at several sizes; rank 0 writes
    ``{"p2p": [[bytes, one-way s], ...], "allreduce": [[bytes, s], ...], "allreduce_flat": [...]}``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    from pdcompile.runtime.executor import allreduce_flat

    results: dict[str, list[tuple[int, float]]] = {"p2p": [], "allreduce": [], "allreduce_flat": []}
    for nbytes in (4 << 10, 64 << 10, 512 << 10, 4 << 20, 16 << 20):
        buf = torch.zeros(nbytes // 4)
        grads = [torch.zeros(nbytes // 4 // _GRAD_TENSORS) for _ in range(_GRAD_TENSORS)]
        p2p, ar, flat = [], [], []
        for i in range(25):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            dist.all_reduce(buf)
            t3 = time.perf_counter()
            dist.barrier()
            t4 = time.perf_counter()
            allreduce_flat(grads, None)  # the runtime's data-parallel all-reduce: flattened, reduced, copied back
            t5 = time.perf_counter()
            if i >= 5:
                p2p.append((t1 - t0) / 2)
                ar.append(t3 - t2)
                flat.append(t5 - t4)
        results["p2p"].append((nbytes, statistics.median(p2p)))
        results["allreduce"].append((nbytes, statistics.median(ar)))
        results["allreduce_flat"].append((nbytes, statistics.median(flat)))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_link_samples(nproc: int = 2) -> dict[str, list[tuple[int, float]]]:
    """``{"p2p": [(bytes, one-way s)], "allreduce": [(bytes, s)], "allreduce_flat": [(bytes, s)]}`` of gloo
    over loopback among ``nproc`` processes (the ping-pong between two of them): a send/recv ping-pong and
    all-reduces at 4 KiB - 16 MiB (torchrun of this module with ``--link-worker``), sorted by size."""
    out = Path(tempfile.mkdtemp(prefix="pdcompile-link-")) / "link.json"
    rc, log = _torchrun_module("pdcompile.calibrate_link", nproc, ["--link-worker", str(out)], timeout=180)
    if rc != 0:
        raise RuntimeError(f"the loopback measurement failed ({rc}):\n{log[-2000:]}")
    raw = json.loads(out.read_text())
    return {k: sorted((int(n), float(t)) for n, t in v) for k, v in raw.items()}


def fit_link(samples: dict[str, list[tuple[int, float]]]) -> tuple[float, float, float]:
    """(latency s, bandwidth bytes/s, all-reduce latency s) through the smallest and largest message."""
    from pdcompile.simulate import ring_allreduce_s

    (n0, t0), (n1, t1) = samples["p2p"][0], samples["p2p"][-1]
    bw = (n1 - n0) / max(t1 - t0, 1e-9)
    a0 = samples["allreduce"][0]
    return max(0.0, t0 - n0 / bw), bw, max(0.0, a0[1] - ring_allreduce_s(a0[0], 2, bw))


def fit_collective(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed s, bytes/s) of ``time = fixed + bytes / rate`` through ``samples`` of (bytes, s): the
    least-squares line in relative error (each sample weighted by ``1 / s``, so the small messages'
    fixed cost counts as much as the large ones' rate), its fixed part at least 0. Used for the runtime's
    all-reduce (``allreduce_flat``: gloo's collective plus the flatten and copy back), which costs far
    more than the point-to-point bandwidth says on loopback (a fixed ~0.5 ms, then ~0.6 GB/s)."""
    pts = [(float(n), float(t)) for n, t in samples if t > 0]
    if len(pts) < 2:
        raise ValueError(f"fit_collective needs 2 or more timed sizes, got {len(pts)}")
    # weighted normal equations of t = a + b n, weights 1 / t^2 (relative error)
    sw = sum(1 / t ** 2 for _, t in pts)
    sn = sum(n / t ** 2 for n, t in pts)
    snn = sum(n * n / t ** 2 for n, t in pts)
    st = sum(1 / t for _, t in pts)
    snt = sum(n / t for n, t in pts)
    det = sw * snn - sn * sn
    a, b = ((snn * st - sn * snt) / det, (sw * snt - sn * st) / det) if det > 0 else (-1.0, 0.0)
    if a < 0 or b <= 0:  # a line through the origin (fixed 0)
        a, b = 0.0, max(snt / snn if snn > 0 else 0.0, 1e-18)
    return float(a), float(1.0 / b)


#: hosts of at most this many cores also measure the all-reduce crowded (:func:`measure_crowded_collective`)
CROWDED_MAX_CORES = 8


def ring_normalized(fit: tuple[float, float], nproc: int) -> tuple[float, float]:
    """A fit ``(fixed, rate)`` of ``time = fixed + bytes / rate`` measured among ``nproc`` processes, as
    :func:`pdcompile.simulate.collective_s` reads one: its rate per byte of a ring's ``2 (n-1)/n`` share
    (``fixed + ring_allreduce_s(bytes, nproc, rate')`` gives the measured time back)."""
    fixed, rate = fit
    return fixed, rate * 2 * (nproc - 1) / nproc


def measure_crowded_collective(cores: int | None = None) -> tuple[float, float]:
    """The runtime's all-reduce (``allreduce_flat``) among ``cores + 1`` processes on this host's ``cores``
    (default: its own, ``cluster.host_cores``): more processes than cores, as a local cluster of more workers
    than cores runs it, where each ring turn waits for its process to get a core (3 processes on 2 cores:
    ~1-1.5 ms fixed against ~0.4 ms for 2); ``(fixed s, bytes/s of a ring's bytes)``, :func:`ring_normalized`.
    ``(0, 0)`` (not measured) on a host of more than :data:`CROWDED_MAX_CORES` cores."""
    from pdcompile.cluster import host_cores

    n = (cores or host_cores()) + 1
    if n - 1 > CROWDED_MAX_CORES:
        return 0.0, 0.0
    return ring_normalized(fit_collective(measure_link_samples(n)["allreduce_flat"]), n)


_WAKE_PERIOD_S = 2.5e-3  # the sender computes this long between messages
_WAKE_WORK_S = 1.2e-3  # the receiver computes this long on each message, then sleeps in its next receive
_WAKE_MESSAGES = 50  # messages per phase; phases alternate quiet and crowded, _WAKE_ROUNDS of each
_WAKE_ROUNDS = 8


def _spin(seconds: float) -> None:
    """Hold a core for ``seconds`` (a busy loop: a rank computing)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _wake_worker(out: str) -> None:
    """Under torchrun (``cores + 1`` processes): rank 0 computes (a busy loop) and every ``_WAKE_PERIOD_S`` sends
    rank 1, asleep in a blocking ``recv``, its clock; rank 1 takes how long after the send it returned, then
    computes ``_WAKE_WORK_S`` and sleeps in the next receive, as a pipeline stage does (a process that has had its
    share of a core before it slept waits longer, woken, for one held by others than one that only sleeps). Quiet
    phases: the other ranks sleep (a core is free for rank 1); crowded ones: they compute too, so rank 0 and
    they hold every core when rank 1 is woken, as a pipeline's ranks computing hold them when a message comes.
    Rank 1 writes ``{"quiet": [[s, ...] per round], "crowded": [[s, ...] per round]}``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    msg = torch.zeros(1, dtype=torch.float64)
    span = _WAKE_MESSAGES * _WAKE_PERIOD_S
    got: dict[str, list[list[float]]] = {"quiet": [], "crowded": []}
    for _ in range(_WAKE_ROUNDS):
        for phase in ("quiet", "crowded"):
            got[phase].append([])
            dist.barrier()
            if rank == 0:
                for _ in range(_WAKE_MESSAGES):
                    _spin(_WAKE_PERIOD_S)
                    msg[0] = time.perf_counter()
                    dist.send(msg, 1)
                _spin(_WAKE_PERIOD_S)
            elif rank == 1:
                for i in range(_WAKE_MESSAGES):
                    asleep = time.perf_counter()
                    dist.recv(msg, 0)
                    woke = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the host
                    if i >= 2 and asleep < float(msg[0]):  # in the receive before the send: woken by it
                        got[phase][-1].append(woke - float(msg[0]))
                    _spin(_WAKE_WORK_S)  # its stage's compute: it has had its share of a core when it sleeps
            elif phase == "crowded":
                _spin(span + 2 * _WAKE_PERIOD_S)
    if rank == 1:
        Path(out).write_text(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()


def measure_wake(cores: int | None = None) -> float:
    """How much later a process asleep in a blocking receive returns when the other processes hold every core
    than when a core is free: ``cores + 1`` processes on this host's ``cores`` (default its own), one computing
    and sending, one receiving, the rest computing or asleep (``_wake_worker``), the mean wake-up of each
    condition's messages, their difference (:func:`wake_of`: rounds whose quiet phase was not quiet left out; at
    least 0; seconds). What a rank of a local cluster of more
    workers than cores waits, woken by a message, for a core held by ranks computing
    (:func:`pdcompile.simulate.shared_cores` charges it at the chance every core is held). 0 (not measured) on a
    host of more than :data:`CROWDED_MAX_CORES` cores."""
    from pdcompile.cluster import host_cores

    n = (cores or host_cores()) + 1
    if n - 1 > CROWDED_MAX_CORES:
        return 0.0
    out = Path(tempfile.mkdtemp(prefix="pdcompile-wake-")) / "wake.json"
    rc, log = _torchrun_module("pdcompile.calibrate_link", n, ["--wake-worker", str(out)], timeout=180)
    if rc != 0:
        raise RuntimeError(f"the wake-up measurement failed ({rc}):\n{log[-2000:]}")
    raw = json.loads(out.read_text())
    return wake_of(raw["quiet"], raw["crowded"])


def wake_of(quiet: list[list[float]], crowded: list[list[float]]) -> float:
    """:func:`measure_wake`'s figure from its rounds' wake-ups (seconds per message, a list per round, quiet
    and crowded): the mean wake-up of the crowded phases less that of the quiet ones (an expectation: most
    wake-ups take tens of microseconds, a few a scheduler's slice), over the rounds whose quiet phase was quiet,
    its mean at most 3 x the rounds' median quiet mean (other work on the host, not the probe's, held the free
    core: the round says nothing); at least 0; 0 with no round holding both."""
    rounds = [(q, c) for q, c in zip(quiet, crowded) if q and c]
    if not rounds:
        return 0.0
    typical = statistics.median(statistics.mean(q) for q, _ in rounds)
    kept = [(q, c) for q, c in rounds if statistics.mean(q) <= 3 * typical]
    return max(0.0, statistics.mean(x for _, c in kept for x in c) - statistics.mean(x for q, _ in kept for x in q))


def measure_link() -> tuple[float, float, float]:
    """(latency s, bandwidth bytes/s, all-reduce latency s) of gloo over loopback between 2 processes."""
    return fit_link(measure_link_samples())


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="the link probe's worker (run by torchrun)")
    ap.add_argument("--link-worker")
    ap.add_argument("--wake-worker")
    args = ap.parse_args(argv)
    if args.wake_worker:
        _wake_worker(args.wake_worker)
    else:
        _link_worker(args.link_worker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
