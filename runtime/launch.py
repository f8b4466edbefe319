"""The emitted program's entry point: ``torchrun --nproc-per-node=N train.py [flags]``.

Each rank reads plan.json, builds its stage module from ``stage_K.py`` and ``stage_K.pt``, joins
the process groups it belongs to (one default group, one per replicated stage, one per group of
tied parameters), and runs its schedule's actions step by step. Every process group and every
transfer is bounded by ``--timeout``: a dead or stuck peer makes the job fail instead of hang.
The first stage reads ``--data MODULE:FUNCTION`` (or plan.json's ``data``, else seeded random
data). Checkpoints (``--checkpoint-dir``; format in runtime/checkpoint.py) fall on flush points;
under ``torchrun --max-restarts=K --resume`` a restarted job continues from the newest complete one.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import sys
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.errors import PdcompileError, UsageError
from pdcompile.runtime import allocator, comm, devices, faults, schedules, shard, sources, tensor_parallel
from pdcompile.runtime import loop
from pdcompile.runtime.devices import DEVICE_FLAGS, choose_device, malloc_mode
from pdcompile.runtime.executor import WEIGHT_PASSES
from pdcompile.runtime.fused_grads import AUTO_MIN_BYTES, GRAD_ACCUMULATIONS
from pdcompile.runtime.program import PRECISIONS, Program
from pdcompile.runtime.run_schedule import compiled_schedule, run_schedule
from pdcompile.runtime.trainer import Trainer

log = logging.getLogger("pdcompile.runtime")


def parse_args(argv: list[str] | None, program: Program) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train.py",
        description=f"Train {program.raw.get('model', 'the model')} as a {program.num_stages}-stage pipeline "
                    f"on {program.world_size} processes (launch with torchrun).",
        epilog=f"Example: torchrun --nproc-per-node={program.world_size} train.py --steps 10",
    )
    p.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps (minibatches) to train (default {loop.DEFAULT_STEPS}; or --epochs)")
    compiled = compiled_schedule(program)
    p.add_argument("--schedule", default=compiled.name,
                   help=f"{', '.join(schedules.SCHEDULES)} (default: the compiled one, {compiled.name})")
    p.add_argument("--microbatches", type=int, default=compiled.num_microbatches,
                   help=f"microbatches per minibatch (default: the compiled {compiled.num_microbatches})")
    p.add_argument("--data", default=None, help="MODULE:FUNCTION yielding (inputs, target) or (args, kwargs, target) minibatches")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the built-in random data and of a fresh initialisation (a meta model without a checkpoint)")
    init_default = program.init.get("path") or f"the compiled source, {program.init.get('source', 'weights')}"
    p.add_argument("--init-from", default=program.init.get("path"), metavar="PATH",
                   help="start from this checkpoint, each rank reading only its stage's tensors: a Hugging Face "
                        "model folder, a .safetensors file, a torch.save'd state_dict or a torch.distributed."
                        f"checkpoint folder (default: {init_default})")
    p.add_argument("--targets", choices=("auto", "send", "local"), default="auto",
                   help="where the last stage gets each microbatch's target: 'send' (the first stage sends it), "
                        "'local' (the last stage reads the same data itself: the data source must give every "
                        "rank the same minibatches; checked on the first one), 'auto' (local for the built-in "
                        "random data and data saved by CompiledPipeline.run, send for --data / plan.json factories)")
    p.add_argument("--timeout", type=float, default=float(os.environ.get("PDCOMPILE_TIMEOUT", 120)),
                   help="seconds before a stuck peer fails the job")
    p.add_argument("--device", choices=DEVICE_FLAGS, default="auto",
                   help="auto: each rank on its GPU (cuda:LOCAL_RANK, NCCL) when CUDA is available, else the CPU "
                        "(gloo); cuda: require the GPUs; cpu: the CPU and gloo even on a GPU machine")
    p.add_argument("--pin-cores", choices=PIN_MODES, default="auto",
                   help="CPU ranks (gloo) only: 'auto' gives each local rank its own share of the cores this job "
                        "may use (local rank r of n on cores r*c/n .. (r+1)*c/n - 1, os.sched_setaffinity, every "
                        "thread of the process), where the node has at least a core per local rank and two or more "
                        "ranks: two ranks then never take turns on one core while another idles, and launches "
                        "measure alike; with fewer cores than ranks (or one rank) nothing is pinned. 'off': "
                        "where the kernel places them (e.g. beside other pinned jobs on this machine)")
    p.add_argument("--save-final", default=None, help="folder for each rank's final weights")
    p.add_argument("--metrics", default=None, help="folder for each rank's metrics JSON")
    p.add_argument("--memory-meter", action=argparse.BooleanOptionalAction, default=None,
                   help="measure each stage's memory (a hook per saved tensor: time a run without it); "
                        "default: on with --metrics, whose 'memory' it fills")
    p.add_argument("--trace", default=None, help="folder for each rank's action timeline (Chrome trace events)")
    p.add_argument("--vertical-sync", action=argparse.BooleanOptionalAction, default=compiled.vertical_sync,
                   help="1f1b: every stage uses the weight version the input stage had when a minibatch entered")
    p.add_argument("--split-backward", action=argparse.BooleanOptionalAction, default=None,
                   help="gpipe/flush: every stage but the first computes its last backward of a step as input "
                        "gradients first (sent at once), weight gradients after (W), so the drain finishes sooner. "
                        "Default: as compiled (on, except for CPU workers sharing cores: there the weight pass "
                        "waits for a core that the stage before needs)")
    p.add_argument("--weight-pass", choices=("auto", *WEIGHT_PASSES), default="auto",
                   help="how a split backward splits: 'graph' traces the stage once (aot_autograd) and cuts its "
                        "backward graph into input-gradient and weight-gradient parts, checked against eager on first "
                        "use (bitwise on CPU); 'submodules' walks autograd's graph to each parameter-owning "
                        "submodule's output, then per submodule. 'graph' falls back to 'submodules' (logged) where it "
                        "does not apply: bf16, a failed trace or check. Default 'auto': "
                        "graph where most of the rank's backwards in a step are split (zb-h1, zb-v, torch's interleaved "
                        "zero bubble as CSV), submodules for the few splits of gpipe/flush/dualpipe-v (the one-time "
                        "trace costs more than they save)")
    p.add_argument("--grad-accumulation", choices=GRAD_ACCUMULATIONS, default="auto",
                   help="how a weight's gradients of a step's microbatches are summed: 'fused' adds a linear's or "
                        "an embedding's gradient straight into .grad in its backward (addmm_, index_add_: no "
                        "weight-sized transient; equal to autograd's to rounding), 'autograd' lets autograd make "
                        "each whole gradient and add it. Default 'auto': fused for weights of "
                        f"{AUTO_MIN_BYTES >> 20} MiB and more. A backward split through the traced graph (--weight-pass "
                        "graph) and a stage sharded full use autograd")
    p.add_argument("--malloc", choices=allocator.MODES, default=None,
                   help="glibc malloc's thresholds (runtime/allocator.py): 'keep' reuses what a step frees in the "
                        "next without page faults, but a block freed below live ones stays resident, so the peak "
                        "RSS can exceed the live tensors' peak; 'release' unmaps every block of 128 KiB and up "
                        "when it is freed: the RSS follows the live tensors, each step faults its large buffers "
                        "in afresh; 'glibc': its adaptive defaults. Default: keep on CPU, glibc on GPU")
    p.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=None,
                   help="the older spelling of --malloc: keep when on, glibc when off")
    p.add_argument("--precision", choices=PRECISIONS, default=program.precision,
                   help=f"bf16: autocast each stage's forward and the loss to bfloat16 (fp32 master weights, the "
                        f"optimizer steps fp32 parameters) and send floating boundary tensors as bf16 (half the "
                        f"bytes); fp32: neither (default: the compiled {program.precision})")
    p.add_argument("--clip-grad-norm", type=float, default=program.clip_grad_norm, metavar="X",
                   help="scale all gradients so their global L2 norm over every stage and replica is at most X, "
                        "before each optimizer step, as torch.nn.utils.clip_grad_norm_ (1f1b, 2bw: at each "
                        "update, over every stage's gradients of that update; default: the compiled "
                        f"{program.clip_grad_norm})")
    p.add_argument("--fail-at", default=None, metavar="RANK:ACTION",
                   help="raise in this rank's action (e.g. 1:1B3): tests that a failing rank ends the job")
    p.add_argument("--log-level", default="INFO")
    loop.add_flags(p)  # --epochs, --lr-scheduler, --eval-*, --log-every, --tensorboard (runtime/loop.py)
    add_reliability_flags(p)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, program: Program, world: int | None = None) -> None:
    """Refuse flags that cannot train (``--steps -3`` would train nothing and exit 0) and a process
    count the plan was not made for, before anything starts: a :class:`UsageError` naming the flag
    and the fix. ``world``: the number of processes (default: ``WORLD_SIZE``, 1 without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world

    def at_least(flag: str, value: Any, what: str, least: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UsageError(f"{flag} {value!r}: must be an integer >= {least} ({what})")

    loop.check(args, program.folder)  # --steps or --epochs, and the loop's other flags
    at_least("--microbatches", args.microbatches, "microbatches per minibatch; e.g. --microbatches 4")
    at_least("--checkpoint-every", args.checkpoint_every, "minibatches between checkpoints; 0: never", least=0)
    at_least("--keep-checkpoints", args.keep_checkpoints, "complete checkpoints kept")
    if args.schedule not in schedules.POLICIES:
        raise UsageError(f"--schedule {args.schedule!r}: unknown schedule; use one of {', '.join(schedules.POLICIES)}")
    compiled = compiled_schedule(program)
    virtual = compiled.virtual_stages > 1
    if schedules.policy(args.schedule).virtual_stages != virtual:
        kind = "several stages per rank" if virtual else "one stage per rank"
        fits = [n for n, p in schedules.POLICIES.items() if p.virtual_stages == virtual]
        raise UsageError(f"--schedule {args.schedule}: this program was compiled with {kind} "
                         f"({compiled.virtual_stages} per rank), which {args.schedule} does not run; use one of "
                         f"{', '.join(fits)}, or re-emit the program for {args.schedule}")
    if args.precision not in PRECISIONS:
        raise UsageError(f"--precision {args.precision!r}: use one of {', '.join(PRECISIONS)}")
    if args.clip_grad_norm is not None:
        if not (math.isfinite(args.clip_grad_norm) and args.clip_grad_norm > 0):
            raise UsageError(f"--clip-grad-norm {args.clip_grad_norm!r}: must be a positive number; e.g. --clip-grad-norm 1.0")
        if not virtual:
            # every ST all-reduces the norm over all ranks: the k-th update of every stage must be one
            # update of the whole model, and the schedule must not deadlock with ST a collective
            sb = args.split_backward if args.split_backward is not None else compiled.split_backward
            try:
                schedules.check_global_steps(args.schedule, compiled.replicas, args.microbatches, tied=compiled.tied,
                                             vertical_sync=args.vertical_sync, split_backward=sb)
            except UsageError as e:
                raise UsageError(f"--clip-grad-norm with --schedule {args.schedule}: {e}; or drop "
                                 f"--clip-grad-norm") from None
    if args.clip_grad_norm is not None and virtual:
        raise UsageError("--clip-grad-norm with virtual stages (several stages per rank): a rank steps each of its "
                         "stages at its own point of the step, so no one point sees every stage's gradients; drop "
                         "--clip-grad-norm, or compile a schedule with a stage per rank")
    if not (isinstance(args.timeout, (int, float)) and math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(f"--timeout {args.timeout!r}: must be a positive number of seconds; e.g. --timeout 120")
    malloc_mode(args.malloc, args.keep_freed_memory, torch.device("cpu"))  # both spellings, disagreeing
    if tensor_parallel.degree(program.raw) > 1 and args.split_backward:
        raise UsageError("--split-backward with tensor parallelism: a split backward of a stage split across "
                         "processes is not built yet; drop --split-backward")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise UsageError("--checkpoint-every needs --checkpoint-dir DIR (a folder every rank can see)")
    if args.resume == "auto" and not args.checkpoint_dir:
        raise UsageError("--resume needs --checkpoint-dir DIR (or --resume STEP_DIR)")
    if args.fail_at_step is not None:
        at_least("--fail-at-step", args.fail_at_step, "the 1-based step a fault is injected at")
    if not 0 <= args.fail_rank < program.world_size:
        raise UsageError(f"--fail-rank {args.fail_rank}: the plan has ranks 0..{program.world_size - 1}")
    if not isinstance(logging.getLevelName(args.log_level), int):  # what logging.basicConfig accepts
        raise UsageError(f"--log-level {args.log_level!r}: use DEBUG, INFO, WARNING or ERROR")
    if world != program.world_size:
        raise UsageError(f"plan.json needs {program.world_size} processes, this job has {world}: run "
                         f"torchrun --nproc-per-node={program.world_size} train.py (or re-plan for {world})")


def main(folder: Path, argv: list[str] | None = None) -> None:
    program = Program.load(folder)
    try:
        args = parse_args(argv, program)
        check_args(args, program)
        sources.check_init_from(args.init_from)
        spec = run_schedule(program, args, tensor_parallel.rank_of(program.raw, int(os.environ.get("RANK", 0))).logical)
        shard.refuse(shard.stage_modes(program.raw), [len(st.ranks) for st in program.stages], schedule=spec.name,
                     version_lag=schedules.policy(spec.name).version_lag,
                     tied={int(s) for group in program.raw.get("tied", []) for s, _ in group},
                     microbatches=args.microbatches)
    except UsageError as e:  # the same answer on every rank: say it once
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    logging.basicConfig(level=args.log_level, format="%(asctime)s rank%(rank)s %(levelname)s %(message)s")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    old_factory = logging.getLogRecordFactory()

    def factory(*a: Any, **k: Any) -> logging.LogRecord:
        rec = old_factory(*a, **k)
        rec.rank = rank
        return rec

    logging.setLogRecordFactory(factory)
    flag = "cpu" if args.device == "auto" and os.environ.get("PDCOMPILE_BACKEND") == "gloo" else args.device
    try:
        device, backend = choose_device(flag, torch.cuda.is_available(), torch.cuda.device_count(),
                                        int(os.environ.get("LOCAL_RANK", 0)),
                                        int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except UsageError as e:  # the same answer on every rank of a node: said once per node
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    if device.type == "cpu" and args.pin_cores == "auto":  # before the group: gloo's threads inherit it
        pin_cores(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group: NCCL binds this rank's communicators to its GPU
    timeout = datetime.timedelta(seconds=args.timeout)
    init_process_group(backend, timeout)
    # PDCOMPILE_NCCL_RULES=1: gloo runs point-to-point as NCCL does (the tests' check that no transfer order hangs)
    comm.configure(nccl_rules=backend == "gloo" and os.environ.get(comm.NCCL_RULES_ENV) == "1", timeout=args.timeout,
                   route=tensor_parallel.route(program.raw, rank))  # a pipeline rank's processes
    allocator.set_mode(malloc_mode(args.malloc, args.keep_freed_memory, devices.rank_device()))
    try:
        code = Trainer(program, args, rank, timeout).train()
    except PdcompileError as e:  # a checkpoint refused, a stage no source can fill (runtime/sources.py)
        print(f"train.py: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        # Every rank refuses together (checkpoint.agree), then leaves at once. Tearing gloo down here
        # while the peers do the same aborted about one run in ten ("terminate called without an
        # active exception", SIGABRT instead of the exit status 2 that says "bad input").
        exit_now(2)
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()  # every rank passed the final barrier: a clean teardown
    sys.exit(code)


PIN_MODES = ("auto", "off")


def core_share(local_rank: int, local_world: int, cores: Sequence[int]) -> list[int] | None:
    """The cores local rank ``local_rank`` of ``local_world`` is pinned to out of ``cores`` (those the job may
    use): an equal, contiguous share each, in the cores' order (rank r of n on c cores: ``r*c//n`` ..
    ``(r+1)*c//n - 1``); None (leave it to the kernel) for one rank, or fewer cores than ranks, where a
    pinned rank could only wait for a core that another rank holds. Pure, for unit tests."""
    cores = sorted(cores)
    if local_world < 2 or len(cores) < local_world or not 0 <= local_rank < local_world:
        return None
    c = len(cores)
    return cores[local_rank * c // local_world:(local_rank + 1) * c // local_world]


def pin_cores(local_rank: int, local_world: int) -> list[int] | None:
    """Pin this process (every thread it has, and so every thread it starts) to :func:`core_share` of the cores
    it may use now; the cores, or None where nothing was pinned (the share is None, or the kernel refused)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    share = core_share(local_rank, local_world, sorted(os.sched_getaffinity(0)))
    if share is None:
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            os.sched_setaffinity(tid, share)
    except OSError as e:  # a container that forbids it: run unpinned
        log.debug("--pin-cores: not pinned (%s)", e)
        return None
    return share


def exit_now(code: int) -> None:
    """Flush what this rank wrote and end the process without running C++ teardown."""
    faults.flush_output()
    os._exit(code)


# --- checkpoints, resume and fault injection (formats and checks: runtime/checkpoint.py) --------

def add_reliability_flags(p: argparse.ArgumentParser) -> None:
    """Flags for checkpoints, resuming and fault injection (used by tests of fault tolerance)."""
    g = p.add_argument_group("checkpoints and faults")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="folder of checkpoints, one every rank can see (a step_NNNNNNNN folder per checkpoint)")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="checkpoint after every N minibatches (steps); 0: never. 1f1b/2bw drain the pipeline there")
    g.add_argument("--keep-checkpoints", type=int, default=2, metavar="K", help="complete checkpoints to keep")
    g.add_argument("--resume", nargs="?", const="auto", default=None, metavar="STEP_DIR",
                   help="resume from the newest complete checkpoint in --checkpoint-dir (start afresh if there "
                        "is none; use under torchrun --max-restarts), or from the given step folder")
    g.add_argument("--fail-at-step", type=int, default=None, metavar="K",
                   help="fault injection (tests): at the start of step K (1-based), on torchrun's first attempt only")
    g.add_argument("--fail-rank", type=int, default=0, metavar="R", help="the rank --fail-at-step hits")
    g.add_argument("--fail-mode", choices=("kill", "hang"), default="kill",
                   help="kill: SIGKILL the rank; hang: the rank stops responding (sleeps forever)")
    g.add_argument("--fail-while-checkpointing", action="store_true",
                   help="inject the fault in the checkpoint after step K: after every rank's files are written, "
                        "before the manifest")


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group`` whose store keys are namespaced by torchrun's restart count.

    torchrun's static rendezvous (``--master-addr/--master-port``) keeps one agent-hosted TCPStore
    across restarts, and torch's ``env://`` handler adds no per-attempt prefix, so a restarted gloo
    group reads the dead attempt's peer addresses and fails ("connectFullMesh ... Connection
    refused"). With the agent's store we connect to it ourselves under ``pdcompile/attempt_N``.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"pdcompile/attempt_{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)
