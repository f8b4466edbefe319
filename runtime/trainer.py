"""One rank's training run (``train.py``'s work once flags are read and the process group is up):
the stage modules, their process groups, optimizers, data and executors built once; segments of
minibatches run as one schedule each; final weights, metrics and trace written."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import itertools
import json
import logging
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.errors import UsageError
from pdcompile.runtime import comm, devices, faults, fused_grads, loop, resume, schedules, shard, staleness, tensor_parallel, timing
from pdcompile.runtime.data import Reader, check_inputs, epoch_length, local_targets, positions, source
from pdcompile.runtime.evaluate import Evaluator, metric_of
from pdcompile.runtime.executor import WEIGHT_PASSES, ActionError, Mailbox, RankExecutor, StageExecutor
from pdcompile.runtime.logs import RunLog, minibatch_sums, tokens_per_sample
from pdcompile.runtime.program import Program, build
from pdcompile.runtime.run_schedule import refuse_sent_targets, run_schedule, weight_pass
from pdcompile.runtime.schedules.spec import stage_delays
from pdcompile.runtime.weights import VersionedStore

log = logging.getLogger("pdcompile.runtime")


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
        # with tensor parallelism (runtime/tensor_parallel.py) ``rank`` is this process's; the plan's
        # stages and schedule name pipeline ranks, each t processes: from here on ``rank`` is the pipeline rank
        self.tp = tp = tensor_parallel.rank_of(program.raw, rank)
        self.loss_scope = contextlib.ExitStack()  # loss-parallel, where this rank's last stage splits its LM head
        rank = tp.logical
        self.program, self.args, self.rank = program, args, rank
        self.specs = specs = program.stages_of_rank(rank)  # one, or several with virtual stages
        self.spec = spec = specs[0]
        torch.manual_seed(args.seed)
        if devices.rank_device().type == "cuda":
            torch.cuda.set_device(devices.rank_device())
        # the linears the compiler split, over this process's tensor group (before any optimizer): applied as
        # the stage is built, so that from a checkpoint or a fresh start each process fills only its shards
        # (every process makes the meshes' groups, also one of a stage left whole where another stage splits)
        mesh = tensor_parallel.tensor_mesh(program.raw, devices.rank_device().type, timeout) \
            if tensor_parallel.degree(program.raw) > 1 else None
        # each rank builds only its stages, from the program's source (runtime/sources.py: stage_K.pt, fresh, init_from)
        modules = [program.build_stage(st.index, devices.rank_device(), getattr(args, "init_from", None),
                                       seed=args.seed, split=tensor_parallel.Split(
                                           tensor_parallel.stage_entry(program.raw, st.index), mesh)
                                       if mesh is not None and tp.degree > 1 else None).to(devices.rank_device())
                   for st in specs]
        for module in modules:
            module.train()
        # Groups: every rank creates every group, in the same order; with tensor parallelism one per tensor index
        # (runtime/tensor_parallel.py RankLayout), of the processes this process is one of
        lay = tensor_parallel.rank_layout(program.raw)
        me = lay.process(rank, tp.index)
        replica_groups: dict[int, Any] = {}
        for st in program.stages:
            if len(st.ranks) > 1:
                g = tensor_parallel.make_group(lay.groups(st.ranks), me, timeout)
                if rank in st.ranks:
                    replica_groups[st.index] = g
        tied_groups: dict[int, list[tuple[Any, ...]]] = {st.index: [] for st in specs}
        for group in program.raw.get("tied", []):
            # Every replica of every stage holding the parameter joins; after the replicas' all-reduce
            # each replica holds its stage's whole gradient, so each contributes 1/replicas of it.
            stages = sorted({s for s, _ in group})
            # With degrees differing between the stages the weight is whole on each (passes/tensor_parallel.py), and
            # a rank's processes may share one group: each then adds its share of the rank's gradient.
            ranks = sorted({r for s in stages for r in program.stages[s].ranks})
            g = tensor_parallel.make_group(lay.tied_groups(ranks), me, timeout)
            for st in specs:
                mine = [n for s, n in group if s == st.index]
                if mine:
                    tied_groups[st.index].append((g, mine, 1.0 / (len(st.ranks) * lay.tied_share(rank, tp.index,
                                                                                                 ranks))))
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
        # with local targets, the last stage and every stage that reads model inputs read the data themselves
        readers_of = [st.index for st in program.stages
                      if st.index == 0 or (local and (st.index == last or program.reads_data(st.index)))]
        reads_data = any(st.index in readers_of for st in specs)
        # the data in epochs and shares (runtime/data.py): this rank reads the microbatches its stages run
        b = program.raw["microbatch_size"]
        readers = [program.stages[s].ranks for s in readers_of]
        self.positions = positions(readers, rank, M)
        train_data = source(program, args, b * M) if reads_data else None
        self.per_epoch = loop.agree(epoch_length(train_data) if reads_data else None, devices.rank_device()) \
            if args.epochs is not None else None
        if args.epochs is not None:
            if not self.per_epoch:
                raise UsageError("--epochs needs data with a length (a DataLoader, a list) of at least one full "
                                 "minibatch; this data has none: use --steps N")
            args.steps = args.epochs * self.per_epoch
            if args.eval_every == "epoch":
                args.eval_every = self.per_epoch
        length, one_pass = self.per_epoch, False
        if length is None and reads_data and self.positions is not None:  # --steps: still only this rank's share
            length, one_pass = epoch_length(train_data), True
        self.data_iter = Reader(train_data, b, M, self.positions, length, args.seed, one_pass=one_pass,
                                keywords=program.keywords) \
            if reads_data else None
        self.data_index = -1  # the last minibatch read from data_iter
        self._micro: Any = None  # that minibatch, cut into microbatches
        self.events: list[tuple[str, float, float]] = []
        mailbox = Mailbox()  # hand-overs between this rank's stages
        self.executors: list[StageExecutor] = []
        split_by = weight_pass(args.weight_pass, self.schedule, rank)  # the rank's, once for its stages
        # each stage's replicas sharded as plan.json says (runtime/shard.py): FSDP2 before the optimizer is built
        self.shard_modes = [shard.effective(m, len(st.ranks)) for m, st in zip(shard.stage_modes(program.raw),
                                                                                program.stages)]
        # staleness (runtime/staleness.py): each stage's delay read off the schedule this run executes
        corr = program.raw.get("staleness") or {}
        self.staleness_mode = str(corr.get("mode", "none"))
        self.sync = int(corr.get("sync", 0))  # the minibatches run synchronously first (each its own segment)
        self.delays = stage_delays(self.schedule, ranks=(rank,)) if self.staleness_mode != "none" else \
            {st.index: 0 for st in specs}
        self.predictors: dict[int, staleness.Predictor | None] = {}
        for st, module in zip(specs, modules):
            mode = self.shard_modes[st.index]
            full = shard.FullShard(module, replica_groups[st.index], devices.rank_device()) if mode == "full" else None
            # --grad-accumulation: big weights' gradients added straight into .grad (runtime/fused_grads.py)
            fused = fused_grads.install(module, getattr(args, "grad_accumulation", "auto"),
                                        sharded=full is not None or tp.degree > 1)
            params = [q for q in module.parameters()]
            optimizer: Any = (shard.zero1(program.raw["optimizer"], params, replica_groups[st.index])
                              if mode == "optimizer" else build(program.raw["optimizer"], params)) \
                if params else NoParameters()
            lr_fix, self.predictors[st.index] = staleness.of_stage(
                self.staleness_mode, self.delays[st.index], optimizer, dict(module.named_parameters()),
                program.raw["optimizer"], warmup=float(corr.get("warmup", staleness.DEFAULT_WARMUP)),
                total=args.steps, micro=M, sharded=mode != "none" and len(st.ranks) > 1, sync=self.sync)
            sched_spec = loop.scheduler_spec(args, program.raw)  # --lr-scheduler, else plan.json's
            lr_scheduler = loop.build_scheduler(sched_spec, optimizer, program.folder) if params else None
            norm_skip = frozenset(n for group in program.raw.get("tied", []) for s, n in group
                                  if s == st.index and s != min(t for t, _ in group))
            if tp.index > 0:  # a whole parameter's gradient is the same on every tensor index: counted on index 0
                norm_skip |= tensor_parallel.whole_parameters(module)
            self.executors.append(StageExecutor(
                program, rank, module, optimizer, self._loss(st.index) if st.index == last else None,
                accumulation=schedules.policy(self.schedule.name).accumulation(M),
                data=self.data if reads_data else None, local_targets=local,
                replica_group=None if full else replica_groups.get(st.index), tied_groups=tied_groups[st.index],
                lr_scheduler=lr_scheduler, weight_store=VersionedStore(module, self.predictors[st.index]),
                recorder=timing.recorder(self.events.append, devices.rank_device()) if args.trace else None,
                # metrics report it; measuring costs a hook per saved tensor, so a timed run turns it off
                measure_memory=(args.metrics is not None if getattr(args, "memory_meter", None) is None
                                else args.memory_meter),
                clock=(lambda: timing.now(devices.rank_device())) if args.trace else time.perf_counter,
                device=devices.rank_device(), fail_at=args.fail_at, precision=args.precision,
                clip_grad_norm=args.clip_grad_norm, norm_group=norm_group,
                norm_counts=rank == st.ranks[0] or full is not None,  # full: each replica counts its shard
                norm_skip=norm_skip, stage=st.index, mailbox=mailbox,
                weight_pass=split_by, sharded=full, fused=fused, staleness_lr=lr_fix,
            ))
        self.executor = self.executors[0]  # the rank's first stage (metrics, losses)
        self.lr_scheduler = self.executor.lr_scheduler  # the first stage's (checkpoints save every stage's)
        self.rank_executor = RankExecutor(self.executors)
        self.replicas = [len(st.ranks) for st in program.stages]
        self.tied = bool(program.raw.get("tied"))
        self.resumed = resume.resume(program, args, rank, self.executors)
        self.start = self.resumed.step if self.resumed is not None else 0  # this run's first minibatch
        first_mb = self.start * M
        for ex in self.executors:  # predict+lr predicts with the rate of the stage's last step: the one before the resume
            if ex.staleness_lr is not None and first_mb:
                ex.staleness_lr.applied(first_mb - 1)
        # --targets local: the first microbatch of each last-stage replica still has its target sent, to compare
        for ex in self.executors:
            ex.target_check = frozenset(range(first_mb, first_mb + len(program.stages[-1].ranks)))
        if self.resumed is not None and self.data_iter is not None:  # the data is deterministic: skip what was consumed
            self.data_iter.skip(self.resumed.data_consumed)
            self.data_index = self.resumed.data_consumed - 1
        if self.data_iter is not None and args.steps > self.start:
            self._read(self.start)  # the data source's start-up (imports, opening files) is not the first step's time
        self.step_times: list[float] = []
        self.ran = False  # a segment ran (the next starts from a flush, with fresh weight versions)
        self.promised_versions = 1  # metrics: the most weight versions the schedule keeps at once
        self.reports = tp.index == 0 and any(st.index == last and rank == st.ranks[0] for st in specs)  # logs, metrics.jsonl, TensorBoard
        # every replica of the last stage computes the losses of its own microbatches (k % r): each logging
        # point sums each logged minibatch's over the replicas (:meth:`_minibatch_losses`)
        self.holds_last = any(st.index == last for st in specs)
        self._last_group = replica_groups.get(last)  # None: one replica, or not the last stage
        self._losses_read = 0  # how many of the rank's losses were taken into _unlogged
        self._unlogged: dict[int, float] = {}  # microbatch -> loss, of minibatches not logged yet
        self.runlog = RunLog(args, self.reports, total=args.steps, start=self.start, per_epoch=self.per_epoch,
                             samples_per_step=b * M, tokens=tokens_per_sample(program.stages[0].inputs),
                             device=devices.rank_device())
        self.evaluator = self._evaluator(replica_groups.get(last))
        self.eval_results: list[dict[str, Any]] = []

    def data(self, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Microbatch ``k``'s inputs and target (minibatch ``k // M`` is read when first asked for).
        Bound for a GPU, the minibatch is put in pinned memory (:func:`pinned`) once, its
        microbatches being views of it."""
        idx = k // self.M
        self._read(idx)
        where, ins, tgt = self._micro
        if k % self.M not in where:
            raise RuntimeError(f"rank {self.rank} did not read microbatch {k} (not in its share of minibatch {idx})")
        j = where[k % self.M]
        return tuple(x[j] for x in ins), tgt[j]

    def _read(self, idx: int) -> None:
        """Read up to minibatch ``idx`` (this rank's share of it, in pinned memory for a GPU)."""
        b = self.program.raw["microbatch_size"]
        while self.data_index < idx:  # only ranks that read data call this
            _, pos, inputs, target = next(self.data_iter)  # type: ignore[arg-type]
            if inputs:  # none: a PipeDream 1F1B replica's turn without a share, or a reader of targets only
                check_inputs(inputs, self.program.stages[0].inputs)
            self.data_index += 1
            dev = devices.rank_device()
            self._micro = ({j: n for n, j in enumerate(pos)}, [devices.pinned(x, dev).split(b) for x in inputs],
                           devices.pinned(target, dev).split(b))

    def _evaluator(self, last_group: Any) -> Evaluator | None:
        """Validation (``--eval-data``, runtime/evaluate.py): its length agreed by every rank; the last
        stage reads its targets only with ``--targets local`` (else the first stage sends them)."""
        args, program, M = self.args, self.program, self.M
        if not args.eval_data:
            return None
        last = program.num_stages - 1
        local = args.targets == "local"
        readers_of = [st.index for st in program.stages
                      if st.index == 0 or (local and (st.index == last or program.reads_data(st.index)))]
        self._eval_positions = positions([program.stages[s].ranks for s in readers_of], self.rank, M)
        self._eval_reads = any(st.index in readers_of for st in self.specs)
        b = program.raw["microbatch_size"]
        self._eval_data = source(program, args, b * M, "eval_data") if self._eval_reads else None
        n = loop.agree(epoch_length(self._eval_data) if self._eval_reads else None, devices.rank_device())
        steps = args.eval_steps if n is None else min(n, args.eval_steps or n)
        if not steps:
            raise UsageError("--eval-data has no length (an endless iterable) and no full minibatch: give "
                             "--eval-steps N, or return a DataLoader or list")
        self._eval_passes = 0
        return Evaluator(program, self.rank, self.executors, steps, M, metric_of(args.eval_metric, program.folder), local, last_group)

    def evaluate(self, step: int) -> dict[str, float] | None:
        """Run one validation pass after step ``step`` (at a flush point); its results on the reporting rank."""
        assert self.evaluator is not None
        reader = Reader(self._eval_data, self.program.raw["microbatch_size"], self.M, self._eval_positions,
                        self.evaluator.steps, self.args.seed + self._eval_passes, "--eval-data",
                        keywords=self.program.keywords) \
            if self._eval_reads else None
        self._eval_passes += 1
        out = self.evaluator.run(reader)
        if out is not None:
            self.eval_results.append({"step": step, **out})
            self.runlog.eval(step, out)
        return out

    def segment(self, first: int, end: int) -> list[float]:
        """Run minibatches ``[first, end)`` as one schedule, from a flush to a flush; their step times.

        The schedule comes step by step (:func:`schedules.rank_run`: memory and set-up time do not
        grow with the run), each step with the sends it lets go (``send_release``); the weight store
        reads the actions ``reach`` ahead of the one running."""
        args, rank, M, executor = self.args, self.rank, self.M, self.rank_executor
        # a segment starting mid-rotation (first * M not a multiple of a stage's replicas) continues it
        offset = first * M
        run = self.schedule.rank_run(end - first, schedules.segment_rank(rank, offset, self.schedule.stage_ranks))
        if run.repeats == 0 and len(run) > 100_000:
            log.warning("the %s schedule of %d steps does not repeat step by step here: laid out whole (%d actions "
                        "in memory); please report it", args.schedule, end - first, len(run))
        warm = first < self.sync  # a synchronous start's minibatch: its forwards use the newest weights, unpredicted
        if self.ran or warm:  # the pipeline drained: weight versions start afresh
            for ex in self.executors:
                ex.weights = VersionedStore(ex.module, None if warm else self.predictors[ex.stage])
        self.ran = True
        self.promised_versions = max(self.promised_versions, run.promised_versions)
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

        steps = steps_of(run, offset, len(self.executors))
        executor.begin(offset)
        times: list[float] = []
        done = 0
        # logged once per minibatch (1F1B: M / r updates of a replica each, Policy.minibatches_done)
        policy, replicas, shown, taken = schedules.policy(self.schedule.name), self.replicas[self.specs[0].index], 0, 0
        timer = timing.StepTimer(devices.rank_device())
        chunk = next(steps, None)
        lr = self._lr()
        while chunk is not None:
            upcoming = next(steps, None)
            actions, release, posts = chunk
            faults.maybe_fail(args, rank, actions, M)
            read_to(done + len(actions) + run.reach + 1)
            timer.start()
            executor.run(actions, release=release, posts=posts)
            timer.stop()
            done += len(actions)
            taken += 1
            complete = end - first if upcoming is None else policy.minibatches_done(taken, M, replicas, end - first)
            if complete > shown or upcoming is None:
                new = timer.collect()  # a logging point: on a GPU the step times are read here (timing.StepTimer)
                times += new
                self.step_times += new
                if self.holds_last and complete > shown:  # minibatches done: a log step each, sharing these steps' time
                    means = self._minibatch_losses(first + shown, first + complete)
                    for step, loss in zip(range(first + shown + 1, first + complete + 1), means):
                        self.runlog.step(step, loss, lr, sum(new) / (complete - shown))
                    lr = self._lr()
                shown = complete
            chunk = upcoming
        executor.wait_sends()
        return times

    def _minibatch_losses(self, first: int, end: int) -> list[float | None]:
        """The mean loss of each of minibatches ``[first, end)`` (0-based) over its ``M`` microbatches,
        called by every replica of the last stage at the same logging point: microbatch ``k`` ran on
        replica ``k % r``, so a replica holds some of a minibatch's losses, or none (``M < r``, or a
        segment starting mid-rotation); one all-reduce of (sum, count) per minibatch over the replicas
        (a collective of the replica group after the step's actions, which end with that group's
        gradient all-reduce and the optimizer step; none with one replica). Losses of later
        microbatches (a forward before the step that closes its round) wait for their minibatch's point."""
        losses, mbs = self.rank_executor.losses, self.rank_executor.loss_microbatches
        self._unlogged.update(zip(mbs[self._losses_read:], losses[self._losses_read:]))
        self._losses_read = len(losses)
        total, count = minibatch_sums(self._unlogged, first, end, self.M)
        if self._last_group is not None:
            sums = torch.tensor([total, count], dtype=torch.float64, device=devices.rank_device())
            dist.all_reduce(sums, group=self._last_group)
            total, count = sums.tolist()
        return [t / n if n else None for t, n in zip(total, count)]

    def _lr(self) -> float | None:
        """The learning rate the rank's last stage steps with next (its first parameter group's)."""
        groups = self.executors[-1].optimizer.param_groups
        return float(groups[0]["lr"]) if groups else None

    def _loss(self, stage: int) -> Any:
        """The last stage's loss; on logits split by vocabulary, run loss-parallel (runtime/tensor_parallel.py),
        with torch's ``loss_parallel`` held open until :meth:`train` ends."""
        loss = self.program.build_loss(devices.rank_device())
        if not tensor_parallel.has_vocab_head(tensor_parallel.stage_entry(self.program.raw, stage)):
            return loss
        self.loss_scope.enter_context(tensor_parallel.loss_parallel_scope())
        return tensor_parallel.VocabParallelLoss(loss)

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
        t_run = timing.now(devices.rank_device())
        self.runlog.start_clock()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        sched0 = timing.sched_totals()
        try:
            # One schedule per segment between checkpoints and evaluations: each falls on a flush point.
            for first, end in loop.cuts(self.start, args.steps, args.checkpoint_every, args.eval_every,
                                        extra=staleness.sync_cuts(self.start, args.steps, self.sync)):
                self.segment(first, end)
                if self.evaluator is not None and (end == args.steps or (args.eval_every and end % args.eval_every == 0)):
                    self.evaluate(end)
                resume.maybe_checkpoint(program, args, rank, self.executors, end, self.data_index + 1)
        except ActionError as e:
            log.error("%s", e)
            raise
        finally:
            self.runlog.close()
            self.loss_scope.close()
        dist.barrier()
        wall = timing.now(devices.rank_device()) - t_run
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        sched = [b - a for a, b in zip(sched0, timing.sched_totals())]
        if args.save_final:
            out = Path(args.save_final)
            out.mkdir(parents=True, exist_ok=True)
            for ex in self.executors:  # whole tensors (a full stage's replicas, a stage's tensor ranks gather theirs together)
                whole = tensor_parallel.full_state(ex.module, tensor_parallel.stage_entry(program.raw, ex.stage))
                if self.tp.index == 0:
                    torch.save(whole, out / f"stage_{ex.stage}.rank_{rank}.pt")
                else:  # its copy of the whole parameters: the same as index 0's (tests compare them)
                    kept = tensor_parallel.whole_parameters(ex.module)
                    torch.save({n: t for n, t in whole.items() if n in kept},
                               out / f"stage_{ex.stage}.rank_{rank}.tensor_{self.tp.index}.pt")
        if self.tp.index > 0:  # metrics and trace: the pipeline rank's, written by its tensor index 0
            return 0
        if args.metrics:
            out = Path(args.metrics)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank_{rank}.json").write_text(json.dumps({
                "rank": rank, "stage": self.spec.index, "stages": [ex.stage for ex in self.executors],
                "schedule": args.schedule, "steps": args.steps,
                # this rank's last-stage losses, and their microbatches (a replica's: k % r; logs.last_stage_losses)
                "losses": self.rank_executor.losses, "loss_microbatches": self.rank_executor.loss_microbatches,
                "step_times_s": self.step_times, "wall_s": wall,
                "weight_versions": max(ex.weights.peak_versions() for ex in self.executors),
                "sends_in_flight": self.rank_executor.peak_sends,
                "weight_versions_promised": self.promised_versions,
                # the training loop's scheduling, every thread of the process: seconds on a core, seconds
                # runnable but waiting for one (another process held it), times put on a core (timing.sched_totals)
                "sched": dict(zip(("run_s", "wait_s", "slices"), sched)),
                # the cores this rank may run on (train.py --pin-cores)
                "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                # pages the run touched afresh (each a fault that zero-fills it): see runtime/allocator.py
                "page_faults_per_step": faults / max(1, args.steps - self.start),
                # the stage's peak bytes at its measuring points, by category (runtime/memory.py)
                "memory": executor.meter.report(),
                "memory_by_stage": {str(ex.stage): ex.meter.report() for ex in self.executors},
                # tensor parallelism: each split parameter's shape on this process (index 0), per stage
                "tensor_parallel_shards": {str(ex.stage): tensor_parallel.shard_shapes(ex.module)
                                           for ex in self.executors} if self.tp.degree > 1 else None,
                # the allocator's own peak (CUDA): what the accounting and the planner's model are checked against
                "cuda_max_memory_allocated": (torch.cuda.max_memory_allocated(devices.rank_device())
                                              if devices.rank_device().type == "cuda" else None),
                "precision": args.precision, "p2p_bytes_sent": comm.sent_bytes(),
                "grad_norms": [float(n) for n in executor.grad_norms],  # unclipped, at each ST (--clip-grad-norm)
                # the training loop (runtime/loop.py): passes over the data, and each evaluation (reporting rank)
                "epochs": args.epochs, "steps_per_epoch": self.per_epoch, "eval": self.eval_results,
                # split backwards by how they were split (--weight-pass: the graph, or the submodules' fallback)
                "split_backwards": {k: sum(ex.split_counts[k] for ex in self.executors) for k in WEIGHT_PASSES},
                # weight calls whose gradient was added straight into .grad (--grad-accumulation), by kind
                "fused_grads": {k: sum(ex.fused.counts[k] for ex in self.executors if ex.fused is not None)
                                for k in ("linear", "embedding")},
                # staleness=: each stage's delay (from the schedule run), what it applied, the rates of its steps
                "staleness": {str(ex.stage): {
                    "delay": self.delays[ex.stage],
                    "applies": "nothing" if ex.staleness_lr is None and self.predictors[ex.stage] is None
                    else self.staleness_mode,
                    "lrs": ex.staleness_lr.used if ex.staleness_lr is not None else None} for ex in self.executors},
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


def steps_of(run: schedules.RankRun, offset: int, stages: int = 1) -> Iterator[_Chunk]:
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
