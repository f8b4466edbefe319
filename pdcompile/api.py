"""``pdcompile(model, cluster_spec, ...)``: the user's way in, as a function and as a decorator.

    pipe = pdcompile(model, ClusterSpec.from_toml("cluster.toml"), example_inputs=(x,),
                     loss_fn=torch.nn.CrossEntropyLoss(),
                     optimizer=lambda params: torch.optim.SGD(params, lr=0.1), schedule="flush")
    print(pipe.plan)          # the plan
    pipe.dump_ir("ir/")       # the IR after every pass
    pipe.emit("out/")         # the torchrun program
    result = pipe.run(batches, steps=5)
    model.load_state_dict(result.state_dict())

``example_inputs`` is one *minibatch*; it is split along dim 0 into ``num_microbatches``
microbatches of ``microbatch_size`` samples.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdcompile import passmanager
from pdcompile.errors import UsageError
from pdcompile.ir import CompileState
from pdcompile.passes import codegen
from pdcompile.passes.annotate_costs import DEVICE_SPECS, annotate_costs, format_costs, profile_from_graph
from pdcompile.passes.linearize import linearize, report
from pdcompile.passes.shapes import format_graph_with_shapes, propagate_shapes
from pdcompile.passes.split_stages import StageSplit, even_assignment, split_stages
from pdcompile.passes.trace import trace
from pdcompile.runtime import schedules

SCHEDULE_NAMES = ("gpipe", "flush", "1f1b", "2bw")


@dataclass(frozen=True)
class Options:
    """Everything ``pdcompile`` was asked for, checked up front."""

    loss_fn: torch.nn.Module
    optimizer: Callable[[Any], torch.optim.Optimizer]
    cluster: Any = None
    schedule: str = "flush"
    microbatch_size: int | None = None
    num_microbatches: int | None = None
    stages: int | Sequence[int] | None = None
    leaf_modules: tuple[Any, ...] = ()
    cost_mode: str = "analytic"
    solver: str = "dp"
    cost_model: str = "default"
    data: dict[str, Any] | None = None
    example_target: torch.Tensor | None = None
    symbolic_costs: bool = False  # fit costs as expressions of the microbatch size (slower)
    replicas: Sequence[int] | None = None  # replicas per stage (e.g. [2, 1]); default one each


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def _check(model: Any, example_inputs: Any, opts: Options) -> tuple[tuple[torch.Tensor, ...], int, int]:
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"pdcompile: model must be a torch.nn.Module, got {type(model).__name__}")
    if example_inputs is None:
        raise UsageError("pdcompile: example_inputs=(x, ...) is required (one minibatch of model inputs)")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    if not all(isinstance(x, torch.Tensor) and x.dim() > 0 for x in example_inputs):
        raise UsageError("pdcompile: example_inputs must be tensors with a batch dimension (dim 0)")
    if not isinstance(opts.loss_fn, torch.nn.Module):
        raise UsageError("pdcompile: loss_fn must be an nn.Module such as torch.nn.CrossEntropyLoss() "
                         "(the emitted program rebuilds it from its class)")
    if opts.schedule not in SCHEDULE_NAMES:
        raise UsageError(f"pdcompile: schedule must be one of {SCHEDULE_NAMES}, got {opts.schedule!r}")
    batch = example_inputs[0].shape[0]
    if any(x.shape[0] != batch for x in example_inputs):
        raise UsageError("pdcompile: every example input needs the same batch size along dim 0")
    m, b = opts.num_microbatches, opts.microbatch_size
    if b is None and m is None:
        m = next(k for k in (4, 2, 1) if batch % k == 0)
    if b is None:
        assert m is not None
        if m < 1 or batch % m:
            raise UsageError(f"pdcompile: num_microbatches={m} must divide the example batch ({batch})")
        b = batch // m
    if m is None:
        if b < 1 or batch % b:
            raise UsageError(f"pdcompile: microbatch_size={b} must divide the example batch ({batch})")
        m = batch // b
    if b * m != batch:
        raise UsageError(f"pdcompile: microbatch_size ({b}) x num_microbatches ({m}) must equal the "
                         f"example batch ({batch})")
    return example_inputs, b, m


class CompiledPipeline:
    """The result of ``pdcompile``: plan, IR after every pass, emit and run."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], opts: Options,
                 dump_dir: str | os.PathLike[str] | None = None) -> None:
        self.model = model
        self.options = opts
        self.example_inputs, self.microbatch_size, self.num_microbatches = _check(model, example_inputs, opts)
        micro = tuple(x[: self.microbatch_size] for x in self.example_inputs)
        state = CompileState(model=model, example_inputs=micro)
        self.state, self.records = passmanager.run_passes(self._passes(), state, dump_dir)

    # passes -----------------------------------------------------------------------------------
    def _passes(self) -> list[passmanager.Pass]:
        opts = self.options
        return [
            passmanager.Pass("trace", lambda s: s.replace(gm=trace(s.model, opts.leaf_modules)),
                             lambda s: s.gm.code.strip() + "\n\n" + str(s.gm.graph)),
            passmanager.Pass("propagate-shapes", lambda s: s.replace(gm=propagate_shapes(s.gm, s.example_inputs)),
                             lambda s: format_graph_with_shapes(s.gm)),
            passmanager.Pass("annotate-costs", self._annotate, lambda s: format_costs(s.gm)),
            passmanager.Pass("linearize", self._linearize, lambda s: report(s.chain) + "\n" + str(s.chain)),
            passmanager.Pass("partition", self._partition, lambda s: _fmt_partition(s)),
            passmanager.Pass("split-stages", self._split, lambda s: str(s.stages)),
            passmanager.Pass("schedule", self._schedule, lambda s: schedules.format_grid(s.schedule, compute_only=False)),
        ]

    def _annotate(self, s: CompileState) -> CompileState:
        opts = self.options
        spec = getattr(getattr(opts.cluster, "device", None), "name", None) if opts.cluster is not None else None
        spec = spec.lower() if isinstance(spec, str) and spec.lower() in DEVICE_SPECS else None
        gm = annotate_costs(s.gm, s.example_inputs, mode=opts.cost_mode, device_spec=spec, progress=False,
                            symbolic=opts.symbolic_costs)
        profile = profile_from_graph(gm, batch_size=self.microbatch_size, device=spec or "cpu",
                                     name=type(s.model).__name__)
        return s.replace(gm=gm, profile=profile)

    def _linearize(self, s: CompileState) -> CompileState:
        return s.replace(chain=linearize(s.profile))

    def _partition(self, s: CompileState) -> CompileState:
        n = self.options.stages
        if n is None:
            n = self.options.cluster.num_workers if self.options.cluster is not None else 2
        if isinstance(n, int):
            assignment = even_assignment(s.gm, n)
        else:
            raise UsageError("pdcompile: stages= must be an int")
        reps = self.options.replicas
        if reps is not None and len(reps) != n:
            raise UsageError(f"pdcompile: replicas={list(reps)} names {len(reps)} stages, but stages={n}")
        ranks = schedules.stage_ranks(reps) if reps is not None else [[k] for k in range(n)]
        return s.replace(extra={**s.extra, "assignment": assignment, "stage_ranks": ranks})

    def _split(self, s: CompileState) -> CompileState:
        return s.replace(stages=split_stages(s.gm, s.extra["assignment"], s.model))

    def _schedule(self, s: CompileState) -> CompileState:
        replicas = [len(r) for r in s.extra["stage_ranks"]]
        tied = bool(s.stages.tied)
        name = self.options.schedule
        if hasattr(schedules, "make_schedule"):
            sched = schedules.make_schedule(name, replicas, self.num_microbatches, tied=tied)
        else:  # pragma: no cover
            sched = getattr(schedules, name)(len(replicas), self.num_microbatches, tied=tied)
        return s.replace(schedule=sched)

    # results ----------------------------------------------------------------------------------
    @property
    def split(self) -> StageSplit:
        return self.state.stages

    @property
    def plan(self) -> Any:
        return self.state.plan

    @property
    def world_size(self) -> int:
        return sum(len(r) for r in self.state.extra["stage_ranks"])

    def dump_ir(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``NN_<pass>.txt`` for every pass that ran."""
        for i, r in enumerate(self.records):
            passmanager.write_dump(folder, i, r.name, r.seconds, r.dump)
        return Path(folder)

    def program_fields(self, data: dict[str, Any] | None = None,
                       target: torch.Tensor | None = None) -> dict[str, Any]:
        """plan.json fields beyond the split: schedule, microbatching, loss, optimizer, data, target."""
        target = target if target is not None else self.options.example_target
        if target is None:
            raise UsageError("pdcompile: the last stage must know the target's shape: pass example_target= "
                             "(one minibatch of targets) to pdcompile, or target= to emit()")
        t = target[: self.microbatch_size]
        return {
            "schedule": self.options.schedule,
            "microbatch_size": self.microbatch_size,
            "num_microbatches": self.num_microbatches,
            "loss": codegen.object_spec(self.options.loss_fn).to_json(),
            "optimizer": codegen.optimizer_spec(self.options.optimizer).to_json(),
            "target": {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "requires_grad": False},
            "data": data if data is not None else self.options.data,
            "stage_ranks": self.state.extra["stage_ranks"],
            "plan": json.loads(self.plan.to_json()) if self.plan is not None else None,
        }

    def emit(self, folder: str | os.PathLike[str], *, data: dict[str, Any] | None = None,
             target: torch.Tensor | None = None) -> Path:
        """Write the torchrun program (stage modules, weights, plan.json, train.py) into ``folder``."""
        return codegen.emit(self.split, folder, program=self.program_fields(data, target),
                            model_name=type(self.model).__name__)


    def run(self, data: Iterable[Any], steps: int, *, out: str | os.PathLike[str] | None = None,
            timeout: float = 600, progress: bool = False, extra_args: Sequence[str] = ()) -> "RunResult":
        """Emit, then train ``steps`` minibatches of ``data`` through torchrun on this machine.

        ``data``: a DataLoader or any iterable of ``(inputs, target)`` minibatches of the size the
        pipeline was compiled for. They are saved next to the program and read by the first stage.
        """
        from pdcompile.launcher import launch
        from pdcompile.runtime.data import save_batches

        if steps < 1:
            raise UsageError("run: steps must be at least 1")
        folder = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="pdcompile-run-"))
        folder.mkdir(parents=True, exist_ok=True)
        size = save_batches(data, steps, folder / "data.pt")
        want = self.microbatch_size * self.num_microbatches
        if size != want:
            raise UsageError(f"run: minibatches have {size} samples, the pipeline was compiled for {want} "
                             f"({self.num_microbatches} x {self.microbatch_size}); recompile or rebatch")
        prog = self.emit(folder / "program", data={"factory": "pdcompile.runtime.data:from_file",
                                                   "kwargs": {"path": str((folder / "data.pt").resolve())}})
        on_line = (lambda line: print(line, flush=True)) if progress else None
        rc, log = launch(prog, self.world_size, ["--steps", str(steps), "--save-final", str(folder / "final"),
                                                 "--metrics", str(folder / "metrics"), *extra_args],
                         timeout=timeout, on_line=on_line)
        (folder / "train.log").write_text(log)
        if rc != 0:
            raise RuntimeError(f"run: training failed with exit status {rc}; log in {folder / 'train.log'}:\n"
                               + log[-2000:])
        return RunResult(folder, prog, _aliases(self.model))


def _aliases(model: torch.nn.Module) -> dict[str, str]:
    """state_dict key -> the canonical name of the same tensor (tied parameters share one)."""
    canonical = {id(t): n for n, t in model.named_parameters()}
    canonical.update({id(t): n for n, t in model.named_buffers()})
    return {k: canonical.get(id(v), k) for k, v in model.state_dict(keep_vars=True).items()}


@dataclass(frozen=True)
class RunResult:
    """What ``CompiledPipeline.run`` leaves: the folder, metrics, and the trained weights."""

    folder: Path
    program: Path
    aliases: dict[str, str]

    @property
    def metrics(self) -> dict[str, Any]:
        """Loss per step (last stage), per-rank step times and wall time."""
        ranks = [json.loads(p.read_text()) for p in sorted((self.folder / "metrics").glob("rank_*.json"))]
        last = max(ranks, key=lambda r: r["stage"])
        return {"losses": last["losses"], "step_times_s": {r["rank"]: r["step_times_s"] for r in ranks},
                "wall_s": max(r["wall_s"] for r in ranks), "ranks": ranks}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights under the original model's names: ``model.load_state_dict(...)``."""
        from pdcompile.merge import merge_weights

        merged = merge_weights(self.program, self.folder / "final")
        return {k: merged[c] for k, c in self.aliases.items() if c in merged}


def _fmt_partition(s: CompileState) -> str:
    a = s.extra["assignment"]
    lines = [f"stage ranks: {s.extra['stage_ranks']}"]
    lines += [f"{name}: stage {k}" for name, k in a.items()]
    return "\n".join(lines)


def pdcompile(model: Any = None, cluster: Any = None, *, example_inputs: Any = None,
              loss_fn: torch.nn.Module | None = None,
              optimizer: Callable[[Any], torch.optim.Optimizer] | None = None, schedule: str = "flush",
              microbatch_size: int | None = None, num_microbatches: int | None = None,
              stages: int | None = None, leaf_modules: Sequence[Any] = (), dump_dir: str | None = None,
              **kw: Any) -> Any:
    """Compile ``model`` into a pipeline for ``cluster``; or, without a model, a decorator."""
    if loss_fn is None:
        raise UsageError("pdcompile: loss_fn= is required (e.g. torch.nn.CrossEntropyLoss())")
    opts = Options(loss_fn=loss_fn, optimizer=optimizer or _default_optimizer, cluster=cluster,
                   schedule=schedule, microbatch_size=microbatch_size, num_microbatches=num_microbatches,
                   stages=stages, leaf_modules=tuple(leaf_modules), **kw)
    if isinstance(model, torch.nn.Module):
        return CompiledPipeline(model, example_inputs, opts, dump_dir)
    if model is not None and not callable(model):
        raise UsageError(f"pdcompile: expected an nn.Module, got {type(model).__name__}")

    def decorate(factory: Any) -> Any:
        @functools.wraps(factory, updated=())
        def build(*args: Any, **kwargs: Any) -> CompiledPipeline:
            return CompiledPipeline(factory(*args, **kwargs), example_inputs, opts, dump_dir)
        return build

    return decorate(model) if model is not None else decorate
