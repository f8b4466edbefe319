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
import gc
import itertools
import json
import logging
import math
import os
import resource
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.errors import CheckpointError, ScheduleError, UsageError
from pdcompile.runtime import allocator, checkpoint, comm, schedules, timing
from pdcompile.runtime.executor import (
    WEIGHT_PASSES,
    ActionError,
    Mailbox,
    RankExecutor,
    StageExecutor,
)
from pdcompile.runtime.schedules.actions import Kind
from pdcompile.runtime.schedules.spec import ScheduleSpec, agrees, default_split_backward
from pdcompile.runtime.schedules.transfers import check_transfers, several_per_rank
from pdcompile.runtime.weights import VersionedStore
from pdcompile.runtime.program import PRECISIONS, Program, build, import_object

log = logging.getLogger("pdcompile.runtime")


def parse_args(argv: list[str] | None, program: Program) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="train.py",
        description=f"Train {program.raw.get('model', 'the model')} as a {program.num_stages}-stage pipeline "
                    f"on {program.world_size} processes (launch with torchrun).",
        epilog=f"Example: torchrun --nproc-per-node={program.world_size} train.py --steps 10",
    )
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (minibatches) to train")
    compiled = compiled_schedule(program)
    p.add_argument("--schedule", default=compiled.name,
                   help=f"{', '.join(schedules.SCHEDULES)} (default: the compiled one, {compiled.name})")
    p.add_argument("--microbatches", type=int, default=compiled.num_microbatches,
                   help=f"microbatches per minibatch (default: the compiled {compiled.num_microbatches})")
    p.add_argument("--data", default=None, help="MODULE:FUNCTION yielding (inputs, target) minibatches")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in random data")
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
    p.add_argument("--save-final", default=None, help="folder for each rank's final weights")
    p.add_argument("--metrics", default=None, help="folder for each rank's metrics JSON")
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
    p.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction, default=None,
                   help="keep memory a step frees for the next one instead of returning it to the system "
                        "(glibc malloc thresholds, runtime/allocator.py; each step otherwise page-faults its "
                        "buffers in afresh). Default: on when training on CPU")
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

    at_least("--steps", args.steps, "optimizer steps to train; e.g. --steps 10")
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
    if virtual and (args.checkpoint_every or args.resume):
        raise UsageError("--checkpoint-every/--resume with virtual stages (several stages per rank): checkpoints "
                         "hold one stage per rank for now; drop the flag, or compile a schedule with a stage per rank")
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


def _data_source(program: Program, args: argparse.Namespace, batch_size: int) -> Iterator[Any]:
    spec = program.raw.get("data")
    if args.data:
        return iter(import_object(args.data)(batch_size))
    if spec:
        return iter(import_object(spec["factory"])(batch_size, **spec.get("kwargs", {})))
    return random_batches(program, batch_size, args.seed)


DETERMINISTIC_SOURCES = ("pdcompile.runtime.data:from_file", "pdcompile.zoo:batches")  # seeded, same on every rank


def local_targets(program: Program, args: argparse.Namespace) -> bool:
    """Whether the last stage reads targets from the data itself instead of receiving them (see
    ``--targets``): a message per microbatch saved, ~7% of a small GPT's step on this machine."""
    if args.targets != "auto":
        return args.targets == "local"
    spec = program.raw.get("data")
    return not args.data and (not spec or spec.get("factory") in DETERMINISTIC_SOURCES)


def refuse_sent_targets(spec: ScheduleSpec) -> None:
    """A :class:`UsageError` when the first stage cannot send every target to the last stage in an
    order NCCL pairs with the other transfers between their ranks. The check replays two steps
    under the executor's rule (without torch): with several stages on a rank, a step's targets
    travel as one block at its start (``schedules.transfers.TargetPosts``), which orders every
    built-in placement (interleaved 1F1B, looped BFS, the V shapes, torch's CSVs); it stays for a
    schedule, a CSV say, whose transfers on that pair of ranks cross from one step into the next."""
    if spec.virtual_stages == 1:
        return  # one stage per rank: every schedule passes (validate's rule 11 checks it with targets sent)
    ranks = spec.stage_ranks
    window = schedules.policy(spec.name).accumulation(spec.num_microbatches) if several_per_rank(ranks) else 1
    try:  # the executor's window (StageExecutor.target_window)
        check_transfers(spec.make(2), spec.replicas, targets=None, name=spec.name, placement=ranks,
                        target_step=window)
    except ScheduleError as e:
        raise UsageError(f"--targets send with {spec}: the targets from the first stage's rank to the last stage's "
                         f"cannot be ordered with the other transfers on that pair of ranks as NCCL needs ({e}). "
                         f"Fix: --targets local (the data source must give every rank the same minibatches, e.g. "
                         f"a seeded one)") from None


def random_batches(program: Program, batch_size: int, seed: int) -> Iterator[Any]:
    """Seeded random minibatches shaped like the plan's inputs and target."""
    g = torch.Generator().manual_seed(seed)
    b = program.raw["microbatch_size"]

    def draw(spec: Any) -> torch.Tensor:
        shape = (batch_size,) + tuple(spec.shape[1:]) if spec.shape and spec.shape[0] == b else spec.shape
        if spec.dtype.is_floating_point:
            return torch.randn(shape, generator=g, dtype=spec.dtype)
        hi = int(program.raw.get("data_high", 2))
        return torch.randint(0, hi, shape, generator=g, dtype=spec.dtype)

    while True:
        yield tuple(draw(s) for s in program.stages[0].inputs), draw(program.target)


def main(folder: Path, argv: list[str] | None = None) -> None:
    program = Program.load(folder)
    try:
        args = parse_args(argv, program)
        check_args(args, program)
        run_schedule(program, args, int(os.environ.get("RANK", 0)))
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
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group: NCCL binds this rank's communicators to its GPU
    timeout = datetime.timedelta(seconds=args.timeout)
    init_process_group(backend, timeout)
    # PDCOMPILE_NCCL_RULES=1: gloo runs point-to-point as NCCL does (the tests' check that no transfer order hangs)
    comm.configure(nccl_rules=backend == "gloo" and os.environ.get(comm.NCCL_RULES_ENV) == "1", timeout=args.timeout)
    if keep_freed_memory(args.keep_freed_memory, _device()):
        allocator.keep_freed_memory(True)
    try:
        code = Trainer(program, args, rank, timeout).train()
    except CheckpointError as e:
        print(f"train.py: rank {rank}: CheckpointError: {e}", file=sys.stderr, flush=True)
        # Every rank refuses together (checkpoint.agree), then leaves at once. Tearing gloo down here
        # while the peers do the same aborted about one run in ten ("terminate called without an
        # active exception", SIGABRT instead of the exit status 2 that says "bad input").
        _exit_now(2)
    except BaseException:
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()  # every rank passed the final barrier: a clean teardown
    sys.exit(code)


def _flush_output() -> None:
    """Flush this rank's log handlers and standard streams (before it ends abruptly)."""
    for h in logging.getLogger().handlers:
        h.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def _exit_now(code: int) -> None:
    """Flush what this rank wrote and end the process without running C++ teardown."""
    _flush_output()
    os._exit(code)


class NoParameters:
    """The optimizer of a stage without parameters (e.g. a pooling layer alone): torch's optimizers
    refuse an empty parameter list, and there is nothing to step."""

    param_groups: list[dict[str, Any]] = []
    state: dict[Any, dict[str, Any]] = {}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Trainer:
    """One rank's training run: :meth:`__init__` builds everything once (the stage module, its
    process groups, optimizer, data and executor); :meth:`segment` runs minibatches ``[first, end)``
    as one schedule (a segment ends at a flush point, where a checkpoint may follow); :meth:`train`
    is the whole run ``train.py`` makes. Benchmarks that alternate our runtime with another system
    in one process call :meth:`segment` directly (benchmarks/_ab_worker.py)."""

    def __init__(self, program: Program, args: argparse.Namespace, rank: int, timeout: datetime.timedelta) -> None:
        self.program, self.args, self.rank = program, args, rank
        self.specs = specs = program.stages_of_rank(rank)  # one, or several with virtual stages
        self.spec = spec = specs[0]
        torch.manual_seed(args.seed)
        modules = [program.build_stage(st.index).to(_device()) for st in specs]
        if _device().type == "cuda":
            torch.cuda.set_device(_device())
        for module in modules:
            module.train()
        # Groups: every rank creates every group, in the same order.
        replica_groups: dict[int, Any] = {}
        for st in program.stages:
            if len(st.ranks) > 1:
                g = dist.new_group(list(st.ranks), timeout=timeout)
                if rank in st.ranks:
                    replica_groups[st.index] = g
        tied_groups: dict[int, list[tuple[Any, ...]]] = {st.index: [] for st in specs}
        for group in program.raw.get("tied", []):
            # Every replica of every stage holding the parameter joins; after the replicas' all-reduce
            # each replica holds its stage's whole gradient, so each contributes 1/replicas of it.
            stages = sorted({s for s, _ in group})
            ranks = sorted({r for s in stages for r in program.stages[s].ranks})
            g = dist.new_group(ranks, timeout=timeout)
            for st in specs:
                mine = [n for s, n in group if s == st.index]
                if mine:
                    tied_groups[st.index].append((g, mine, 1.0 / len(st.ranks)))
        # global-norm clipping: one group over every rank; each stage's gradient is counted by its replica 0,
        # each tied parameter by the first stage holding it
        norm_group = dist.new_group(list(range(program.world_size)), timeout=timeout) \
            if args.clip_grad_norm is not None else None
        self.schedule = run_schedule(program, args, rank, say=True)
        self.M = M = args.microbatches
        local = local_targets(program, args) and program.num_stages > 1
        if not local and program.num_stages > 1:
            refuse_sent_targets(self.schedule)
        last = program.num_stages - 1
        reads_data = any(st.index == 0 or (local and st.index == last) for st in specs)
        self.data_iter = _data_source(program, args, program.raw["microbatch_size"] * M) if reads_data else None
        self.data_index = -1  # the last minibatch read from data_iter
        self._micro: Any = None  # that minibatch, cut into microbatches
        self.events: list[tuple[str, float, float]] = []
        mailbox = Mailbox()  # hand-overs between this rank's stages
        self.executors: list[StageExecutor] = []
        split_by = weight_pass(args.weight_pass, self.schedule, rank)  # the rank's, once for its stages
        for st, module in zip(specs, modules):
            params = [q for q in module.parameters()]
            optimizer: Any = build(program.raw["optimizer"], params) if params else NoParameters()
            sched_spec = program.raw.get("lr_scheduler")
            lr_scheduler = build(sched_spec, optimizer) if sched_spec and params else None
            norm_skip = frozenset(n for group in program.raw.get("tied", []) for s, n in group
                                  if s == st.index and s != min(t for t, _ in group))
            self.executors.append(StageExecutor(
                program, rank, module, optimizer, program.build_loss(_device()) if st.index == last else None,
                accumulation=schedules.policy(self.schedule.name).accumulation(M),
                data=self.data if reads_data else None, local_targets=local,
                replica_group=replica_groups.get(st.index), tied_groups=tied_groups[st.index],
                lr_scheduler=lr_scheduler, weight_store=VersionedStore(module),
                recorder=timing.recorder(self.events.append, _device()) if args.trace else None,
                measure_memory=args.metrics is not None,  # metrics report it; measuring costs a hook per saved tensor
                clock=(lambda: timing.now(_device())) if args.trace else time.perf_counter,
                device=_device(), fail_at=args.fail_at, precision=args.precision,
                clip_grad_norm=args.clip_grad_norm, norm_group=norm_group, norm_counts=rank == st.ranks[0],
                norm_skip=norm_skip, stage=st.index, mailbox=mailbox,
                weight_pass=split_by,
            ))
        self.executor = self.executors[0]  # the rank's first stage (checkpoints: one stage per rank)
        self.lr_scheduler = self.executor.lr_scheduler  # checkpoints and resume: one stage per rank
        self.rank_executor = RankExecutor(self.executors)
        self.replicas = [len(st.ranks) for st in program.stages]
        self.tied = bool(program.raw.get("tied"))
        self.resumed = _resume(program, args, rank, self.executor, self.lr_scheduler)
        self.start = self.resumed.step if self.resumed is not None else 0  # this run's first minibatch
        first_mb = self.start * M
        # --targets local: the first microbatch of each last-stage replica still has its target sent, to compare
        for ex in self.executors:
            ex.target_check = frozenset(range(first_mb, first_mb + len(program.stages[-1].ranks)))
        if self.resumed is not None and self.data_iter is not None:  # the data is deterministic: skip what was consumed
            for _ in range(self.resumed.data_consumed):
                next(self.data_iter)
            self.data_index = self.resumed.data_consumed - 1
        if self.data_iter is not None and args.steps > self.start:
            self.data(first_mb)  # the data source's start-up (imports, opening files) is not the first step's time
        self.step_times: list[float] = []
        self.ran = False  # a segment ran (the next starts from a flush, with fresh weight versions)
        self.promised_versions = 1  # metrics: the most weight versions the schedule keeps at once
        # 1F1B steps after every microbatch: log once per minibatch of M, as the other schedules do.
        self.log_every = schedules.policy(self.schedule.name).microbatches_per_log(M)

    def data(self, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Microbatch ``k``'s inputs and target (minibatch ``k // M`` is read when first asked for).
        Bound for a GPU, the minibatch is put in pinned memory (:func:`pinned`) once, its
        microbatches being views of it."""
        b = self.program.raw["microbatch_size"]
        idx = k // self.M
        while self.data_index < idx:
            inputs, target = next(self.data_iter)  # type: ignore[arg-type]  # only ranks that read data call this
            self.data_index += 1
            dev = _device()
            self._micro = ([pinned(x, dev).split(b) for x in inputs], pinned(target, dev).split(b))
        ins, tgt = self._micro
        j = k % self.M
        return tuple(x[j] for x in ins), tgt[j]

    def segment(self, first: int, end: int) -> list[float]:
        """Run minibatches ``[first, end)`` as one schedule, from a flush to a flush; their step times.

        The schedule comes step by step (:func:`schedules.rank_run`: memory and set-up time do not
        grow with the run), each step with the sends it lets go (``send_release``); the weight store
        reads the actions ``reach`` ahead of the one running."""
        args, rank, M, executor = self.args, self.rank, self.M, self.rank_executor
        run = self.schedule.rank_run(end - first, rank)
        if run.repeats == 0 and len(run) > 100_000:
            log.warning("the %s schedule of %d steps does not repeat step by step here: laid out whole (%d actions "
                        "in memory); please report it", args.schedule, end - first, len(run))
        if self.ran:  # the pipeline drained: weight versions start afresh
            for ex in self.executors:
                ex.weights = VersionedStore(ex.module)
        self.ran = True
        self.promised_versions = max(self.promised_versions, run.promised_versions)
        offset = first * M
        reading = (schedules.shift(a, offset) for a, _ in run)  # the weight store's read-ahead
        read, total = 0, len(run)

        def read_to(n: int) -> None:
            nonlocal read
            n = min(n, total)
            if n > read:
                acts = list(itertools.islice(reading, n - read))
                for ex in self.executors:
                    ex.weights.expect([a for a in acts if a.stage == ex.stage] if len(self.executors) > 1 else acts,
                                      more=n < total)
                read = n

        steps = _steps(run, offset, len(self.executors))
        executor.begin(offset)
        times: list[float] = []
        last = any(st.index == self.program.num_stages - 1 and rank == st.ranks[0] for st in self.specs)
        done = 0
        timer = timing.StepTimer(_device())
        chunk = next(steps, None)
        while chunk is not None:
            upcoming = next(steps, None)
            actions, release, posts = chunk
            _maybe_fail(args, rank, actions, M)
            read_to(done + len(actions) + run.reach + 1)
            timer.start()
            executor.run(actions, release=release, posts=posts)
            timer.stop()
            done += len(actions)
            if (len(self.step_times) + timer.pending) % self.log_every == 0 or upcoming is None:
                new = timer.collect()  # a logging point: on a GPU the step times are read here (timing.StepTimer)
                times += new
                self.step_times += new
                if executor.losses and last and len(self.step_times) % self.log_every == 0:
                    log.info("step %d (minibatches %d-%d) loss %.6f (%.3f s)", len(self.step_times), first + 1,
                             end, executor.losses[-1], times[-1])
            chunk = upcoming
        executor.wait_sends()
        return times

    def train(self) -> int:
        """The whole run: every segment between checkpoints, then the final weights, metrics and trace."""
        program, args, rank, executor = self.program, self.args, self.rank, self.executor
        # Everything built so far lives for the whole run: move it out of the cyclic collector's sight,
        # so a full collection during training doesn't walk torch's and the modules' objects (~10 ms).
        gc.collect()
        gc.freeze()
        # Start together: a rank that finished setting up first would otherwise count the others'
        # start-up (~0.1-1 s) in its first step's time.
        dist.barrier()
        t_run = timing.now(_device())
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            # One schedule per segment between checkpoints: a checkpoint falls on a flush point.
            for first, end in _segments(self.start, args.steps, args.checkpoint_every):
                self.segment(first, end)
                _maybe_checkpoint(program, args, rank, executor, self.lr_scheduler, end, self.data_index + 1)
        except ActionError as e:
            log.error("%s", e)
            raise
        dist.barrier()
        wall = timing.now(_device()) - t_run
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        if args.save_final:
            out = Path(args.save_final)
            out.mkdir(parents=True, exist_ok=True)
            for ex in self.executors:
                tensors = {n: t.detach().cpu() for n, t in ex.module.named_parameters()}
                tensors.update({n: t.detach().cpu() for n, t in ex.module.named_buffers()})
                torch.save(tensors, out / f"stage_{ex.stage}.rank_{rank}.pt")
        if args.metrics:
            out = Path(args.metrics)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank_{rank}.json").write_text(json.dumps({
                "rank": rank, "stage": self.spec.index, "stages": [ex.stage for ex in self.executors],
                "schedule": args.schedule, "steps": args.steps,
                "losses": self.rank_executor.losses, "step_times_s": self.step_times, "wall_s": wall,
                "weight_versions": max(ex.weights.peak_versions() for ex in self.executors),
                "sends_in_flight": self.rank_executor.peak_sends,
                "weight_versions_promised": self.promised_versions,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                # pages the run touched afresh (each a fault that zero-fills it): see runtime/allocator.py
                "page_faults_per_step": faults / max(1, args.steps - self.start),
                # the stage's peak bytes at its measuring points, by category (runtime/memory.py)
                "memory": executor.meter.report(),
                "memory_by_stage": {str(ex.stage): ex.meter.report() for ex in self.executors},
                # the allocator's own peak (CUDA): what the accounting and the planner's model are checked against
                "cuda_max_memory_allocated": (torch.cuda.max_memory_allocated(_device())
                                              if _device().type == "cuda" else None),
                "precision": args.precision, "p2p_bytes_sent": comm.sent_bytes(),
                "grad_norms": [float(n) for n in executor.grad_norms],  # unclipped, at each ST (--clip-grad-norm)
                # split backwards by how they were split (--weight-pass: the graph, or the submodules' fallback)
                "split_backwards": {k: sum(ex.split_counts[k] for ex in self.executors) for k in WEIGHT_PASSES},
            }, indent=1))
        if args.trace:
            out = Path(args.trace)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank_{rank}.events.json").write_text(json.dumps(
                # origin_s: this rank's start on the shared monotonic clock, so ranks can be aligned
                [{"rank": rank, "name": n, "start_s": s - t_run, "end_s": e - t_run, "origin_s": t_run}
                 for n, s, e in self.events]))
        return 0


_Chunk = tuple[list[schedules.Action], list[tuple[schedules.Action, ...]], list[tuple[schedules.Action, ...]]]


def _steps(run: schedules.RankRun, offset: int, stages: int = 1) -> Iterator[_Chunk]:
    """A run's actions cut after each optimizer step (for per-step timing and logging; a rank with
    ``stages`` virtual stages steps each, so after every ``stages``-th ``ST``), each with the sends
    released after it and the receives posted before it; microbatches shifted by ``offset``
    (:func:`schedules.shift`)."""
    seen = 0
    actions: list[schedules.Action] = []
    release: list[tuple[schedules.Action, ...]] = []
    posts: list[tuple[schedules.Action, ...]] = []
    for a, sends, recvs in run.steps():
        actions.append(schedules.shift(a, offset))
        release.append(tuple(schedules.shift(b, offset) for b in sends) if sends else ())
        posts.append(tuple(schedules.shift(b, offset) for b in recvs) if recvs else ())
        if a.kind is schedules.Kind.STEP:
            seen += 1
            if seen % stages == 0:
                yield actions, release, posts
                actions, release, posts = [], [], []
    if actions:
        yield actions, release, posts


def weight_pass(flag: str, schedule: ScheduleSpec, rank: int) -> str:
    """``--weight-pass`` for ``rank`` running ``schedule``: ``auto`` is the graph split where most of
    the rank's backwards in a step are split (zb-h1, zb-v, a torch CSV such as its interleaved zero
    bubble: every microbatch gains), the submodules' where a step splits only a few (flush's drain,
    DualPipeV's: the graph's one-time trace and import would take longer than they save but in very
    long runs)."""
    if flag != "auto":
        return flag
    kinds = Counter(a.kind for a, _ in schedule.rank_run(1, rank))
    return "graph" if 2 * kinds[Kind.WEIGHT_GRAD] > kinds[Kind.BACKWARD] else "submodules"


def split_backward(flag: bool | None, device: torch.device) -> bool:
    """``--split-backward`` for a plan.json without a compiled schedule (emitted before it had one):
    as given, else :func:`~pdcompile.runtime.schedules.spec.default_split_backward` for the
    processes of this machine."""
    if flag is not None:
        return flag
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    return default_split_backward(device.type, local, os.cpu_count() or 1)


def compiled_schedule(program: Program) -> ScheduleSpec:
    """The schedule the compiler wrote into plan.json (an older plan.json names only the policy)."""
    raw = program.raw.get("schedule", "flush")
    if isinstance(raw, dict):
        return ScheduleSpec.from_json(raw)
    return ScheduleSpec({"1f1b-rr": "1f1b"}.get(str(raw), str(raw)),
                        tuple(len(st.ranks) for st in program.stages), int(program.raw.get("num_microbatches", 1)),
                        tied=bool(program.raw.get("tied")), vertical_sync=bool(program.raw.get("vertical_sync")),
                        split_backward=True)


def run_schedule(program: Program, args: argparse.Namespace, rank: int, *, say: bool = False) -> ScheduleSpec:
    """The schedule this run executes: the compiled one, unless flags change it (``say``: log that
    once). The compiled one is checked against the action lists plan.json spells out for it: this
    runtime must rebuild exactly what the compiler printed."""
    compiled = compiled_schedule(program)
    raw = program.raw.get("schedule")
    sb = args.split_backward
    if sb is None:
        sb = compiled.split_backward if isinstance(raw, dict) else split_backward(None, _device())
    spec = ScheduleSpec(args.schedule, compiled.replicas, args.microbatches, compiled.tied, args.vertical_sync, sb,
                        compiled.virtual_stages, compiled.csv if args.schedule == compiled.name else None)
    if spec.stage_ranks != [list(st.ranks) for st in program.stages]:
        raise UsageError(f"--schedule {spec.name} places the stages on ranks {spec.stage_ranks}, but this program's "
                         f"stages are on {[list(st.ranks) for st in program.stages]}; re-emit the program for "
                         f"{spec.name}")
    if isinstance(raw, dict) and spec == compiled:
        if not agrees(spec, raw, rank):
            raise UsageError(f"plan.json: this runtime builds rank {rank}'s schedule ({spec}) differently from the "
                             f"compiler that wrote it; re-emit the program with this pdcompile")
    elif say and rank == 0 and isinstance(raw, dict):
        log.info("running %s, not the compiled %s (flags)", spec, compiled)
    return spec


def keep_freed_memory(flag: bool | None, device: torch.device) -> bool:
    """``--keep-freed-memory``'s default: on when the stages train on CPU (where every buffer lives
    in malloc's memory), off on GPU (host memory is small there) unless asked for."""
    return flag if flag is not None else device.type == "cpu"


DEVICE_FLAGS = ("auto", "cpu", "cuda")


def choose_device(flag: str, cuda_available: bool, device_count: int, local_rank: int,
                  local_world_size: int) -> tuple[torch.device, str]:
    """``--device`` -> (this rank's device, process-group backend); the backend follows the device:
    NCCL for a GPU, gloo for the CPU. ``auto`` takes the GPUs when CUDA is available. NCCL refuses
    two ranks on one GPU, so a node needs a GPU per local rank; with fewer the job stops with the
    cause and the fix rather than failing later inside NCCL. Pure (counts given), for unit tests."""
    if flag not in DEVICE_FLAGS:
        raise UsageError(f"--device {flag!r}: use one of {', '.join(DEVICE_FLAGS)}")
    if flag == "cpu" or (flag == "auto" and not cuda_available):
        return torch.device("cpu"), "gloo"
    if not cuda_available:
        raise UsageError("--device cuda, but CUDA is not available here (torch.cuda.is_available() is False). "
                         "Fix: run on a GPU machine with a CUDA build of torch, or pass --device cpu")
    if device_count < local_world_size or not 0 <= local_rank < device_count:
        raise UsageError(f"this node has {device_count} GPU(s) for {local_world_size} local ranks (this is "
                         f"LOCAL_RANK {local_rank}): NCCL needs one GPU per rank. Fix: start at most {device_count} "
                         f"processes per node (torchrun --nproc-per-node, with a plan for that many), or pass "
                         f"--device cpu to train on the CPU with gloo")
    return torch.device("cuda", local_rank), "nccl"


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in page-locked host memory when it is bound for a GPU (so its copy there can be
    ``non_blocking``: asynchronous, without a staging copy); as it is otherwise."""
    if device.type != "cuda" or t.device.type != "cpu" or t.is_pinned():
        return t
    return t.pin_memory()


def _device() -> torch.device:
    """This rank's device: its GPU (``LOCAL_RANK``) under nccl, else the CPU (the backend follows
    the device, :func:`choose_device`)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


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


def _inject_fault(args: argparse.Namespace, rank: int, where: str) -> None:
    """SIGKILL (or hang) this rank; only on torchrun's first attempt, so a restarted job can finish."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    log.warning("fault injection: rank %d %s %s", rank, "hangs" if args.fail_mode == "hang" else "is killed", where)
    _flush_output()
    if args.fail_mode == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def _maybe_fail(args: argparse.Namespace, rank: int, chunk: list[schedules.Action], M: int) -> None:
    """--fail-at-step K: fault before the first action chunk that touches minibatch K (1-based)."""
    if args.fail_at_step is None or args.fail_while_checkpointing or rank != args.fail_rank:
        return
    if any(a.microbatch is not None and a.kind is not schedules.Kind.WEIGHT_VERSION
           and a.microbatch // M == args.fail_at_step - 1 for a in chunk):
        _inject_fault(args, rank, f"at step {args.fail_at_step}")


def _segments(start: int, steps: int, every: int) -> list[tuple[int, int]]:
    """[first, end) minibatch ranges run as one schedule each; a checkpoint may follow each one."""
    cuts = {start, steps} | ({s for s in range(every, steps, every) if s > start} if every > 0 else set())
    bounds = sorted(c for c in cuts if c >= start)
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def _stage_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    tensors = {n: t.detach() for n, t in module.named_parameters()}
    tensors.update({n: t.detach() for n, t in module.named_buffers()})
    return tensors


def _resume(program: Program, args: argparse.Namespace, rank: int, executor: StageExecutor,
            lr_scheduler: Any) -> checkpoint.RankState | None:
    """--resume: verify and load this rank's part of a checkpoint into the module, optimizer, LR
    scheduler, weight store and RNG; every rank must resume the same step, or all refuse."""
    if args.checkpoint_every and not args.checkpoint_dir:
        raise CheckpointError("--checkpoint-every needs --checkpoint-dir DIR (a folder every rank can see)")
    if args.resume is None:
        if args.checkpoint_dir and checkpoint.latest(args.checkpoint_dir) is not None:
            raise CheckpointError(f"{args.checkpoint_dir} already holds checkpoints of a run. Fix: pass --resume "
                                  f"to continue it, or use an empty --checkpoint-dir")
        return None
    if args.resume == "auto":
        if not args.checkpoint_dir:
            raise CheckpointError("--resume needs --checkpoint-dir DIR (or --resume STEP_DIR)")
        folder = checkpoint.latest(args.checkpoint_dir)
    else:
        folder = Path(args.resume)
    step = -1
    error: CheckpointError | None = None
    try:
        step = int(checkpoint.read_manifest(folder)["step"]) if folder is not None else -1
    except CheckpointError as e:
        error = e
    lo, hi = checkpoint.agree(step, _device())
    if error is None and lo != hi:
        error = CheckpointError(f"ranks see different newest checkpoints (steps {lo} to {hi}) in "
                                f"{args.checkpoint_dir}. Fix: put --checkpoint-dir on a filesystem every rank shares")
    state = None
    if error is None and folder is not None:
        try:
            weights, state = checkpoint.load_rank(folder, program.raw, executor.stage, rank)
            checkpoint.restore_module(executor.module, weights, str(folder))
        except CheckpointError as e:
            error = e
    _, failed = checkpoint.agree(int(error is not None), _device())
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{folder}: another rank refused this checkpoint (its log says why)")
    if state is None:
        log.info("no checkpoint in %s yet: starting afresh", args.checkpoint_dir)
        return None
    executor.optimizer.load_state_dict(state.optimizer)
    if lr_scheduler is not None and state.lr_scheduler is not None:
        lr_scheduler.load_state_dict(state.lr_scheduler)
    checkpoint.set_rng_state(state.rng)
    log.info("resumed from %s: step %d, %d minibatches consumed", folder, state.step, state.data_consumed)
    return state


def _maybe_checkpoint(program: Program, args: argparse.Namespace, rank: int, executor: StageExecutor,
                      lr_scheduler: Any, step: int, data_consumed: int) -> None:
    """Checkpoint after ``step`` minibatches if it is a multiple of --checkpoint-every (a flush point)."""
    if not args.checkpoint_every or step % args.checkpoint_every:
        return
    state = checkpoint.RankState(
        step=step, next_microbatch=step * args.microbatches, data_consumed=data_consumed,
        optimizer=executor.optimizer.state_dict(),
        lr_scheduler=lr_scheduler.state_dict() if lr_scheduler is not None else None,
        weight_store=None,  # at a flush point every weight version but the live one is gone (checkpoint.py)
        rng=checkpoint.rng_state())
    hook = None
    if args.fail_while_checkpointing and args.fail_at_step == step and rank == args.fail_rank:
        def hook() -> None:
            _inject_fault(args, rank, f"while writing the checkpoint of step {step}")
    t0 = time.perf_counter()
    folder = checkpoint.save(args.checkpoint_dir, program.raw, rank, _stage_tensors(executor.module), state,
                             keep=args.keep_checkpoints, device=_device(), before_manifest=hook)
    if rank == 0:
        log.info("checkpoint %s (%.3f s)", folder, time.perf_counter() - t0)


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
