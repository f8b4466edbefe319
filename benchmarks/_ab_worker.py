"""torchrun worker: pdcompile's runtime and ``torch.distributed.pipelining`` on the same stages, in
one launch, taking turns block by block.

    torchrun --nproc-per-node=S -m benchmarks._ab_worker --program DIR --ours flush --theirs 1f1b \
        --blocks 20 --block-steps 8 --out FILE.json

Each rank builds two copies of exactly the stage module our runtime builds (``stage_K.py`` +
``stage_K.pt`` of the emitted folder: the same split, the same weights). Ours is the emitted
``train.py``'s own :class:`~pdcompile.runtime.trainer.Trainer` (flags as train.py's, e.g. its
default split backward), run one segment of ``--block-steps`` minibatches at a time. Theirs
(:class:`TorchPipeline`) wraps the other copy in ``PipelineStage`` and steps torch's
``ScheduleGPipe`` or ``Schedule1F1B`` over the plan's number of microbatches. Blocks alternate
ours, theirs, theirs, ours, ... (who goes first alternates, so a trend in the machine's load favours
neither), every block starting at a barrier. Both sides read a random minibatch on the first and
last rank inside each timed step. GPT's tied embedding gets its gradient all-reduced between the
stages before the step on their side too (our runtime's ``TG``), so both do the same work.

Memory: the process keeps freed memory as ``train.py`` sets it up on CPU
(``runtime/allocator.py``); it is process-wide, so both sides get it. ``--theirs ours
--theirs-flags "..."`` instead pits our runtime against itself with other train.py flags (e.g.
``--no-split-backward``; not the allocator's, which only separate launches can compare).

Why one launch: on this shared 2-core machine the step time of one launch differs from the next by
±15% (process placement, other jobs), while blocks a second apart see the same machine; pairing
neighbouring blocks measures the ratio, not the launch. Rank 0 writes
``{"ours": [[block of rank 0], ...] per rank, "theirs": ...}`` (per-step seconds) to ``--out``, with
``"events"`` per rank (``--trace-blocks``: ours' actions in the traced blocks after the timed ones,
``(name, start, end)``) and the
``"schedule"`` ours ran (its ``ScheduleSpec`` JSON). ``--time-compute`` adds ``"compute"`` per rank:
each side's seconds in its stage modules' forward calls (``F``) and in autograd's engine (``B``,
every backward and gradient pass; ours' traced-graph split counted too) over its timed blocks but
the first (left out as the benchmarks leave it out: the process warming up, the graph split's
one-time check), so a gap between the sides' steps can be
split into compute and the rest (the timers cost both sides alike, so those blocks time a little
slower).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import logging
import os
import shlex
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import pipelining as tp
from torch.distributed.pipelining import PipelineStage

from pdcompile.runtime import allocator, devices, launch, timing, trainer
from pdcompile.runtime.program import Program, build


# torch's schedules by the name this worker takes; those taking a list of stages (several per rank)
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                   "looped-bfs": "ScheduleLoopedBFS", "interleaved-zb": "ScheduleInterleavedZeroBubble",
                   "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
SINGLE = ("gpipe", "1f1b")


class _Contiguous(torch.nn.Module):
    """A stage whose outputs are contiguous: torch's ``isend`` refuses a view (e.g. a transpose) that
    an emitted stage may return; ours copies such an output in its send too (``comm.post_send``)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *xs: torch.Tensor) -> Any:
        out = self.inner(*xs)
        return tuple(o.contiguous() for o in out) if isinstance(out, tuple) else out.contiguous()


class TorchPipeline:
    """One rank of ``torch.distributed.pipelining`` training fresh copies of an emitted program's
    stages on this rank (several with virtual stages, placed as plan.json says)."""

    def __init__(self, prog: Program, schedule: str) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.rank, self.world = rank, world
        specs = prog.stages_of_rank(rank)
        modules = [prog.build_stage(st.index) for st in specs]
        self.modules = modules  # the stage modules this rank trains (what --time-compute watches)
        self.n_micro = n_micro = int(prog.raw["num_microbatches"])
        self.b = int(prog.raw["microbatch_size"])
        stages = []
        for st, module in zip(specs, modules):
            module.train()
            # Static shapes from plan.json (shape inference at the first step is skipped).
            ins = tuple(torch.zeros(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad and t.dtype.is_floating_point)
                        for t in st.inputs)
            wrapped = _Contiguous(module)
            outs = wrapped(*ins)  # with autograd on: which outputs carry gradients back is read from these
            outs = outs if isinstance(outs, tuple) else (outs,)
            stages.append(PipelineStage(wrapped, st.index, prog.num_stages, torch.device("cpu"), input_args=ins,
                                        output_args=tuple(o.detach().requires_grad_(o.requires_grad) for o in outs)))
        loss_fn = prog.build_loss()  # every rank: a schedule without loss_fn runs no backward
        cls = getattr(tp, TORCH_SCHEDULES[schedule])
        if schedule in SINGLE:
            assert len(stages) == 1, f"{cls.__name__} runs one stage per rank"
            self.sched = cls(stages[0], n_micro, loss_fn=loss_fn)
        else:
            self.sched = cls(stages, n_micro, loss_fn=loss_fn)
        params = [q for m in modules for q in m.parameters()]
        self.opt = build(prog.raw["optimizer"], params) if params else trainer.NoParameters()
        # tied parameters: this rank's copies summed, then all-reduced over the group's ranks (our TG)
        self.tied: list[tuple[Any, list[torch.nn.Parameter]]] = []
        for group in prog.raw.get("tied", []):
            ranks = sorted({r for s, _ in group for r in prog.stages[s].ranks})
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            mine = [dict(m.named_parameters())[n] for s, n in group for st, m in zip(specs, modules) if s == st.index]
            if mine:
                self.tied.append((g, mine))
        self.first = any(st.index == 0 for st in specs)
        self.last = any(st.index == prog.num_stages - 1 for st in specs)
        self.gen = torch.Generator().manual_seed(0)
        self.inputs, self.target = prog.stages[0].inputs, prog.target

    def draw(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shape = (self.b * self.n_micro,) + tuple(shape[1:])
        if dtype.is_floating_point:
            return torch.randn(shape, generator=self.gen, dtype=dtype)
        return torch.randint(0, 2, shape, generator=self.gen, dtype=dtype)

    def step(self) -> float:
        """One minibatch (reading it, the pipeline, the tied all-reduce, the optimizer step); seconds."""
        t0 = time.perf_counter()
        # a step includes reading its minibatch, as in ours: the first stage reads the inputs and
        # (local targets) the last stage its own copy of the minibatch
        ends = self.first or self.last
        xs = tuple(self.draw(s.shape, s.dtype) for s in self.inputs) if ends else ()
        y = self.draw(self.target.shape, self.target.dtype) if ends else None
        self.opt.zero_grad(set_to_none=True)
        # return_outputs=False: ours keeps no outputs either (only the losses), so theirs need not
        # save and concatenate the last stage's outputs
        kw: dict[str, Any] = {"target": y, "losses": []} if self.last else {}
        self.sched.step(*(xs if self.first else ()), return_outputs=False, **kw)
        for g, prms in self.tied:
            grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in prms]
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if g is not None:
                dist.all_reduce(total, group=g)
            for q in prms:
                q.grad = total
        self.opt.step()
        return time.perf_counter() - t0


class ComputeTimer:
    """Seconds spent in forward calls of chosen modules and in autograd's engine, charged to the side
    (``"ours"``/``"theirs"``) whose block runs (``side``; None: not counted)."""

    def __init__(self) -> None:
        self.side: str | None = None
        self.took: dict[str, dict[str, float]] = {"ours": {"F": 0.0, "B": 0.0}, "theirs": {"F": 0.0, "B": 0.0}}
        self._t0: list[float] = []
        import torch.autograd as ag

        self._engine = ag._engine_run_backward  # what backward() and grad() both call
        ag._engine_run_backward = self._timing(self._engine, "B")  # type: ignore[attr-defined]
        # ours' split at the graph level runs its forward and its W outside module calls and the engine
        from pdcompile.runtime.graph_split import GraphSplit

        self._graph = {name: getattr(GraphSplit, name) for name in ("forward", "weight_grads")}
        for name, kind in (("forward", "F"), ("weight_grads", "B")):
            setattr(GraphSplit, name, self._timing(self._graph[name], kind))
        self._hooks: list[Any] = []

    def close(self) -> None:
        """Put autograd's engine call and the graph split back, and remove the module hooks."""
        import torch.autograd as ag
        from pdcompile.runtime.graph_split import GraphSplit

        ag._engine_run_backward = self._engine  # type: ignore[attr-defined]
        for name, fn in self._graph.items():
            setattr(GraphSplit, name, fn)
        for h in self._hooks:
            h.remove()

    def _timing(self, fn: Any, kind: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.side is not None:
                    self.took[self.side][kind] += time.perf_counter() - t0
        return timed

    def watch(self, module: torch.nn.Module) -> None:
        """Time ``module``'s forward calls (hooks around the call)."""
        self._hooks.append(module.register_forward_pre_hook(lambda m, a: self._t0.append(time.perf_counter())))

        def post(m: Any, a: Any, out: Any) -> None:
            dt = time.perf_counter() - self._t0.pop()
            if self.side is not None:
                self.took[self.side]["F"] += dt

        self._hooks.append(module.register_forward_hook(post))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--program", required=True)
    p.add_argument("--ours", default="flush", help="our schedule (train.py --schedule)")
    p.add_argument("--theirs", choices=(*TORCH_SCHEDULES, "ours"), default="1f1b",
                   help="torch's schedule, or 'ours': our runtime again, with --theirs-flags added to train.py's")
    p.add_argument("--theirs-flags", default="", help="with --theirs ours: train.py flags of that side")
    p.add_argument("--blocks", type=int, default=20, help="blocks per side")
    p.add_argument("--block-steps", type=int, default=8, help="minibatches per block")
    p.add_argument("--out", required=True)
    p.add_argument("--trace-blocks", type=int, default=0,
                   help="after the timed blocks, ours runs this many more traced (untimed): what each action took")
    p.add_argument("--time-compute", action="store_true",
                   help="time each side's stage forwards and autograd engine calls (JSON key 'compute')")
    p.add_argument("--watchdog", type=float, default=280, help="dump stacks and exit after this many seconds")
    args, ours_flags = p.parse_known_args()
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)
    prog = Program.load(args.program)
    total = (args.blocks + args.trace_blocks) * args.block_steps
    rank = dist.get_rank()

    def make_trainer(flags: list[str]) -> trainer.Trainer:
        return trainer.Trainer(prog, launch.parse_args(["--schedule", args.ours, "--steps", str(total), *flags], prog),
                              rank, timeout)

    ours = make_trainer(ours_flags)
    # process-wide, so both sides run with train.py's setting (set once: glibc's default adapts its
    # thresholds as a process runs, which setting them back by hand would not restore)
    allocator.set_mode(devices.malloc_mode(ours.args.malloc, ours.args.keep_freed_memory, torch.device("cpu")))
    if args.theirs == "ours":
        other = make_trainer(ours_flags + shlex.split(args.theirs_flags))
    else:
        theirs = TorchPipeline(prog, args.theirs)
    timer = ComputeTimer() if args.time_compute else None
    if timer is not None:
        for ex in ours.executors:
            timer.watch(ex.module)
        if args.theirs != "ours":
            for module in theirs.modules:
                timer.watch(module)
    gc.collect()
    gc.freeze()  # as train.py does: what was built lives for the whole run
    times: dict[str, list[list[float]]] = {"ours": [], "theirs": []}
    done = {"ours": 0, "theirs": 0}
    for i in range(args.blocks):
        for who in (("ours", "theirs") if i % 2 == 0 else ("theirs", "ours")):
            dist.barrier()
            if timer is not None:
                timer.side = who if i > 0 else None
            if who == "ours" or args.theirs == "ours":
                t = ours if who == "ours" else other
                times[who].append(t.segment(done[who], done[who] + args.block_steps))
                done[who] += args.block_steps
            else:
                times[who].append([theirs.step() for _ in range(args.block_steps)])
    if timer is not None:
        timer.side = None
    if args.trace_blocks:  # the same, warmed-up Trainer from here on records its actions as --trace does
        for ex in ours.executors:
            ex.recorder = timing.recorder(ours.events.append, "cpu")
        dist.barrier()
        ours.segment(done["ours"], done["ours"] + args.trace_blocks * args.block_steps)
    events = list(ours.events)
    gathered: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, {**times, "events": events, "compute": timer.took if timer is not None else None})
    if rank == 0:
        Path(args.out).write_text(json.dumps({**{k: [g[k] for g in gathered]
                                                 for k in ("ours", "theirs", "events", "compute")},
                                              "schedule": ours.schedule.to_json()}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
