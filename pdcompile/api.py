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

``loss_fn`` is any callable ``(output, target) -> scalar tensor`` (a function, a lambda, a closure,
``functools.partial(F.cross_entropy, label_smoothing=0.1)``, an nn.Module); it is traced into the
last stage's emitted source (:mod:`pdcompile.passes.trace_loss`). It may read ``out.logits`` of a
Hugging Face model's output. Tracing needs one target: ``example_target=``, ``emit(target=)``, or,
for ``run(data)``, the first minibatch of ``data``.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdcompile import passmanager
from pdcompile.errors import UsageError
from pdcompile.ir import CompileState
from pdcompile.passes import codegen
from pdcompile.passes.annotate_costs import DEVICE_SPECS, DeviceSpec, annotate_costs, format_costs, profile_from_graph
from pdcompile.passes.linearize import linearize, report
from pdcompile.passes.shapes import format_graph_with_shapes, propagate_shapes
from pdcompile.passes.split_stages import StageSplit, split_stages
from pdcompile.passes.export_frontend import trace_any
from pdcompile.passes.trace_loss import LossTraceError, TracedLoss, example_output, loss_name, trace_loss
from pdcompile.runtime import schedules

SCHEDULE_NAMES = tuple(schedules.SCHEDULES)  # gpipe, flush, 1f1b, 1f1b-rr, 2bw
# What the planner's memory model calls each schedule (GPipe keeps one weight version, like Flush).
_PLANNER_SCHEDULE = {"gpipe": "flush", "1f1b-rr": "1f1b"}


@dataclass(frozen=True)
class Options:
    """Everything ``pdcompile`` was asked for, checked up front."""

    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]  # any (output, target) -> scalar; traced (trace-loss)
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
    frontend: str = "auto"  # "fx" (symbolic_trace), "export" (torch.export), "auto": fx, else export
    output: str | int | None = None  # export front end: which model output (e.g. "logits")
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
    if not callable(opts.loss_fn):
        raise UsageError(f"pdcompile: loss_fn must be callable as loss_fn(output, target) -> scalar tensor, "
                         f"got {type(opts.loss_fn).__name__}. Fix: pass a function, a lambda, "
                         f"functools.partial(F.cross_entropy, ...) or an nn.Module")
    if opts.example_target is not None and (not isinstance(opts.example_target, torch.Tensor)
                                            or opts.example_target.dim() == 0):
        raise UsageError("pdcompile: example_target must be a tensor with a batch dimension (one minibatch "
                         "of targets)")
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
        self._losses: dict[tuple[tuple[int, ...], str], tuple[TracedLoss | None, dict[str, Any]]] = {}
        if "loss" in self.state.extra:
            t = self._micro_target(opts.example_target)
            self._losses[_target_key(t)] = self.state.extra["loss"]

    # passes -----------------------------------------------------------------------------------
    def _passes(self) -> list[passmanager.Pass]:
        opts = self.options
        return [
            passmanager.Pass("trace", self._trace,
                             lambda s: s.gm.code.strip() + "\n\n" + str(s.gm.graph)),
            passmanager.Pass("propagate-shapes", lambda s: s.replace(gm=propagate_shapes(s.gm, s.example_inputs)),
                             lambda s: format_graph_with_shapes(s.gm)),
            passmanager.Pass("annotate-costs", self._annotate, lambda s: format_costs(s.gm)),
            passmanager.Pass("linearize", self._linearize, lambda s: report(s.chain) + "\n" + str(s.chain)),
            passmanager.Pass("partition", self._partition, lambda s: _fmt_partition(s)),
            passmanager.Pass("split-stages", self._split, lambda s: str(s.stages)),
            passmanager.Pass("schedule", self._schedule, lambda s: schedules.format_grid(s.schedule, compute_only=False)),
        ] + ([passmanager.Pass("trace-loss", self._trace_loss, lambda s: _fmt_loss(s.extra["loss"]))]
             if opts.example_target is not None else [])

    def _trace_loss(self, s: CompileState) -> CompileState:
        """Trace loss_fn on the last stage's output and one microbatch of targets (see trace_loss)."""
        micro = self._micro_target(self.options.example_target)
        return s.replace(extra={**s.extra, "loss": self._loss_program(s, micro)})

    def _loss_program(self, s: CompileState, target: torch.Tensor) -> tuple[TracedLoss | None, dict[str, Any]]:
        """(the traced loss, its plan.json entry). An nn.Module loss neither fx nor export can capture
        (a .item() for logging) but whose class rebuilds it is named by class path, as before losses
        were traced: (None, {"class", "kwargs", ...})."""
        loss_fn = self.options.loss_fn
        last = s.stages.stages[-1]
        out_node = last.gm.graph.output_node()
        meta = _output_meta(out_node.args[0])
        try:
            traced = trace_loss(loss_fn, example_output(meta), target, output_key=s.extra.get("output_key"))
        except LossTraceError as e:
            if not isinstance(loss_fn, torch.nn.Module):
                raise
            try:
                return None, {**codegen.object_spec(loss_fn).to_json(), "traced": None, "why": str(e)}
            except Exception:  # noqa: BLE001 - neither way: the tracing error says what to fix
                raise e from None
        return traced, {"traced": traced.frontend, "from": loss_name(loss_fn)}

    def _micro_target(self, target: torch.Tensor) -> torch.Tensor:
        return target[: self.microbatch_size]

    def loss(self, target: torch.Tensor | None = None) -> TracedLoss | None:
        """The traced loss for targets like ``target`` (one minibatch; default example_target)."""
        return self._loss_for(self._target_or_error(target))[0]

    def _loss_for(self, target: torch.Tensor) -> tuple[TracedLoss | None, dict[str, Any]]:
        micro = self._micro_target(target)
        key = _target_key(micro)
        if key not in self._losses:
            self._losses[key] = self._loss_program(self.state, micro)
        return self._losses[key]

    def _target_or_error(self, target: torch.Tensor | None) -> torch.Tensor:
        target = target if target is not None else self.options.example_target
        if target is None:
            raise UsageError("pdcompile: the last stage must know the target's shape: pass example_target= "
                             "(one minibatch of targets) to pdcompile, or target= to emit(); run(data) reads it "
                             "from the data")
        if not isinstance(target, torch.Tensor) or target.dim() == 0:
            raise UsageError("pdcompile: the target must be a tensor with a batch dimension (one minibatch)")
        return target

    def _trace(self, s: CompileState) -> CompileState:
        opts = self.options
        gm = trace_any(s.model, s.example_inputs, opts.leaf_modules, opts.frontend, output=opts.output)
        # the key of the model's output structure the graph returns ("logits"): the loss may read out.logits
        return s.replace(gm=gm, extra={**s.extra, "output_key": gm.meta.get("pd.output_key")})

    def _annotate(self, s: CompileState) -> CompileState:
        opts = self.options
        spec = device_spec_for(opts.cluster)
        gm = annotate_costs(s.gm, s.example_inputs, mode=opts.cost_mode, device_spec=spec, progress=False,
                            symbolic=opts.symbolic_costs)
        profile = profile_from_graph(gm, batch_size=self.microbatch_size, device=spec.name,
                                     name=type(s.model).__name__)
        return s.replace(gm=gm, profile=profile)

    def _linearize(self, s: CompileState) -> CompileState:
        import dataclasses
        import math

        from pdcompile.passes.split_stages import blocked_cuts

        chain = linearize(s.profile)
        order = [m for layer in chain.layers for m in (layer.members or (layer.name,))]
        blocked = blocked_cuts(s.gm, order)
        if blocked:  # only single tensors may cross a stage boundary
            pos, cuts = 0, list(chain.cut_bytes)
            for i, layer in enumerate(chain.layers[:-1]):
                pos += len(layer.members or (layer.name,))
                if pos - 1 in blocked:
                    cuts[i] = math.inf
            chain = dataclasses.replace(chain, cut_bytes=tuple(cuts))
        return s.replace(chain=chain)

    def _partition(self, s: CompileState) -> CompileState:
        """Choose the plan: the planner on the cluster, or ``stages=S`` balanced by compute time."""
        from pdcompile import plan as plan_mod
        from pdcompile.cluster import local_cpu_cluster
        from pdcompile.passes.partition_dp import pipeline_plan

        opts = self.options
        chain = s.chain
        planner_schedule = _PLANNER_SCHEDULE.get(opts.schedule, opts.schedule)
        if opts.stages is not None:
            n = opts.stages
            if not isinstance(n, int) or n < 1:
                raise UsageError(f"pdcompile: stages= must be a positive int, got {n!r}")
            reps = list(opts.replicas) if opts.replicas is not None else [1] * n
            if len(reps) != n:
                raise UsageError(f"pdcompile: replicas={reps} names {len(reps)} stages, but stages={n}")
            cluster = opts.cluster if opts.cluster is not None and opts.cluster.num_workers >= sum(reps) \
                else local_cpu_cluster(sum(reps))
            if opts.replicas is None:
                plan = pipeline_plan(chain, balanced_bounds(chain, n), cluster, schedule=planner_schedule,
                                     memory_limit=False)
            else:  # the same balanced split, stage k on ranks schedules.stage_ranks(replicas)[k]
                from pdcompile.passes.partition_dp import plan_from_assignment

                bounds = [0, *balanced_bounds(chain, n), len(chain)]
                assignment = [(a, b - 1, len(r), tuple(r))
                              for (a, b), r in zip(zip(bounds, bounds[1:]), schedules.stage_ranks(reps))]
                plan = plan_from_assignment(chain, cluster, assignment, schedule=planner_schedule,
                                            memory_limit=False)
        else:
            cluster = opts.cluster if opts.cluster is not None else local_cpu_cluster(2)
            plan = plan_mod.plan(chain, cluster, solver=opts.solver, cost_model=opts.cost_model,
                                 schedule=planner_schedule)
        assignment = {}
        for st in plan.stages:
            for name in st.members:
                assignment[name] = st.index
        stage_ranks = [list(st.ranks) for st in plan.stages]
        return s.replace(plan=plan, extra={**s.extra, "assignment": assignment, "stage_ranks": stage_ranks,
                                           "cluster": cluster})

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

    @property
    def cluster(self) -> Any:
        return self.state.extra["cluster"]

    def simulate(self, num_microbatches: int | None = None, schedule: str | None = None,
                 num_steps: int = 1) -> Any:
        """The predicted timeline of the plan (:class:`pdcompile.simulate.SimResult`)."""
        from pdcompile.simulate import simulate_plan

        tied_bytes, tied_stages = 0.0, set()
        for group in self.split.tied:
            st, name = group[0]
            p = dict(self.split.stages[st].gm.named_parameters())[name]
            tied_bytes += p.numel() * p.element_size()
            tied_stages.update(s for s, _ in group)
        return simulate_plan(self.plan, self.state.chain, self.cluster, schedule or self.options.schedule,
                             num_microbatches or self.num_microbatches, num_steps=num_steps,
                             tied_bytes=tied_bytes, tied_stages=sorted(tied_stages))

    def alternatives(self) -> list[tuple[str, Any]]:
        """Other configurations on the same cluster, each as a Plan: pure data parallelism and
        straight pipelines of every depth (balanced by compute), for comparison with the choice."""
        from pdcompile.passes.partition_dp import pipeline_plan, plan_from_assignment

        chain, cluster = self.state.chain, self.cluster
        sched = _PLANNER_SCHEDULE.get(self.options.schedule, self.options.schedule)
        n = cluster.num_workers
        out: list[tuple[str, Any]] = []
        try:
            out.append((f"data parallel x{n}", plan_from_assignment(
                chain, cluster, [(0, len(chain) - 1, n, tuple(range(n)))], schedule=sched, memory_limit=False)))
        except Exception:  # noqa: BLE001 - a configuration the evaluator can't express is skipped
            pass
        for k in sorted({2, 3, 4, min(n, len(chain))}):
            if 2 <= k <= min(n, len(chain)):
                try:
                    out.append((f"straight pipeline of {k}", pipeline_plan(
                        chain, balanced_bounds(chain, k), cluster, schedule=sched, memory_limit=False)))
                except Exception:  # noqa: BLE001
                    pass
        return out

    def explain(self) -> str:
        """Why this plan: the plan table, its bottleneck, and what the alternatives would take."""
        plan = self.plan
        best = plan.seconds_per_minibatch
        lines = [str(plan), "", f"why: the planner ({plan.solver}, cost model {plan.cost_model}) minimises the "
                 f"slowest stage or link; here that is {plan.bottleneck}.", "alternatives on the same cluster:"]
        for name, alt in self.alternatives():
            t = alt.seconds_per_minibatch
            note = "" if not alt.notes else f"  ({'; '.join(alt.notes)})"
            lines.append(f"  {name:<26} {t:.4g} s per minibatch  ({t / best:.2f}x the chosen plan's time){note}")
        return "\n".join(lines)

    def dump_ir(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``NN_<pass>.txt`` for every pass that ran."""
        for i, r in enumerate(self.records):
            passmanager.write_dump(folder, i, r.name, r.seconds, r.dump)
        return Path(folder)

    def program_fields(self, data: dict[str, Any] | None = None,
                       target: torch.Tensor | None = None) -> dict[str, Any]:
        """plan.json fields beyond the split: schedule, microbatching, loss, optimizer, data, target."""
        target = self._target_or_error(target)
        t = self._micro_target(target)
        return {
            "schedule": self.options.schedule,
            "microbatch_size": self.microbatch_size,
            "num_microbatches": self.num_microbatches,
            "loss": self._loss_for(target)[1],
            "optimizer": codegen.optimizer_spec(self.options.optimizer).to_json(),
            "target": {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "requires_grad": False},
            "data": data if data is not None else self.options.data,
            "stage_ranks": self.state.extra["stage_ranks"],
            "plan": json.loads(self.plan.to_json()) if self.plan is not None else None,
        }

    def emit(self, folder: str | os.PathLike[str], *, data: dict[str, Any] | None = None,
             target: torch.Tensor | None = None) -> Path:
        """Write the torchrun program (stage modules, weights, plan.json, train.py) into ``folder``."""
        fields = self.program_fields(data, target)
        traced = self._loss_for(self._target_or_error(target))[0]
        return codegen.emit(self.split, folder, program=fields, model_name=type(self.model).__name__,
                            loss=traced.gm if traced is not None else None)


    def run(self, data: Iterable[Any], steps: int, *, out: str | os.PathLike[str] | None = None,
            timeout: float = 600, progress: bool = False, extra_args: Sequence[str] = ()) -> "RunResult":
        """Emit, then train ``steps`` minibatches of ``data`` through torchrun on this machine.

        ``data``: a DataLoader or any iterable of ``(inputs, target)`` minibatches of the size the
        pipeline was compiled for. They are saved next to the program and read by the first stage.
        The target's shape and dtype come from the first minibatch (no example_target= needed).
        """
        from pdcompile.launcher import launch
        from pdcompile.runtime.data import save_batches

        if steps < 1:
            raise UsageError("run: steps must be at least 1")
        folder = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="pdcompile-run-"))
        folder.mkdir(parents=True, exist_ok=True)
        first: list[torch.Tensor] = []
        size = save_batches(_noting_first_target(data, first), steps, folder / "data.pt")
        want = self.microbatch_size * self.num_microbatches
        if size != want:
            raise UsageError(f"run: minibatches have {size} samples, the pipeline was compiled for {want} "
                             f"({self.num_microbatches} x {self.microbatch_size}); recompile or rebatch")
        prog = self.emit(folder / "program", data={"factory": "pdcompile.runtime.data:from_file",
                                                   "kwargs": {"path": str((folder / "data.pt").resolve())}},
                         target=self._data_target(first[0]))
        on_line = (lambda line: print(line, flush=True)) if progress else None
        rc, log = launch(prog, self.world_size, ["--steps", str(steps), "--save-final", str(folder / "final"),
                                                 "--metrics", str(folder / "metrics"), *extra_args],
                         timeout=timeout, on_line=on_line)
        (folder / "train.log").write_text(log)
        if rc != 0:
            raise RuntimeError(f"run: training failed with exit status {rc}; log in {folder / 'train.log'}:\n"
                               + log[-2000:])
        return RunResult(folder, prog, _aliases(self.model))

    def _data_target(self, target: torch.Tensor) -> torch.Tensor:
        """The first minibatch's target, checked against example_target= when that was given too."""
        given = self.options.example_target
        if given is not None and _target_key(self._micro_target(given)) != _target_key(self._micro_target(target)):
            g, t = self._micro_target(given), self._micro_target(target)
            raise UsageError(f"run: the data's targets are {t.dtype} {tuple(t.shape)} per microbatch, but "
                             f"example_target= is {g.dtype} {tuple(g.shape)}; drop example_target= (run reads "
                             f"the target from the data) or make them agree")
        return target


def _noting_first_target(data: Iterable[Any], first: list[torch.Tensor]) -> Iterator[Any]:
    """``data``'s minibatches, appending the first one's target to ``first`` as it passes."""
    for batch in data:
        if not first:
            try:
                _, target = batch
            except (TypeError, ValueError):
                raise UsageError("run: data must yield (inputs, target) pairs") from None
            if not isinstance(target, torch.Tensor) or target.dim() == 0:
                raise UsageError("run: each minibatch's target must be a tensor with a batch dimension")
            first.append(target)
        yield batch


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


def device_spec_for(cluster: Any) -> DeviceSpec:
    """Analytic costs for the cluster's device: its peak FLOP/s and memory bandwidth when the
    cluster gives them, a preset of the same name (v100, a100, h100, h200), else this CPU."""
    dev = getattr(cluster, "device", None)
    if dev is None:
        return DEVICE_SPECS["cpu"]
    key = dev.name.lower().split("-")[0]
    base = DEVICE_SPECS.get(key, DEVICE_SPECS["cpu"])
    if dev.peak_flops:
        return DeviceSpec(dev.name, dev.peak_flops, dev.memory_bandwidth or base.mem_bandwidth)
    return base


def _output_meta(arg: Any) -> Any:
    """The ``pd.tensor`` metas of a graph's output argument, in its structure (tuple, dict, one tensor)."""
    import torch.fx as fx

    return fx.node.map_aggregate(arg, lambda a: a.meta.get("pd.tensor") if isinstance(a, fx.Node) else a)


def _target_key(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    return tuple(t.shape), str(t.dtype)


def _fmt_loss(loss: tuple[TracedLoss | None, dict[str, Any]]) -> str:
    traced, entry = loss
    return str(traced) if traced is not None else f"loss by class path (not traced): {json.dumps(entry)}"


def _fmt_partition(s: CompileState) -> str:
    a = s.extra["assignment"]
    lines = [str(s.plan), "", "node -> stage:"]
    lines += [f"  {name}: {k}" for name, k in a.items()]
    return "\n".join(lines)


def balanced_bounds(chain: Any, num_stages: int) -> list[int]:
    """First chain positions of stages 1..S-1 minimising the slowest stage's compute time, cutting
    only where the chain allows (finite cut bytes); ties go to the narrowest widest cut."""
    import math

    n = len(chain)
    if num_stages > n:
        raise UsageError(f"pdcompile: {num_stages} stages but the model has only {n} layers")
    cost = [layer.compute_s for layer in chain.layers]
    pre = [0.0]
    for c in cost:
        pre.append(pre[-1] + c)
    ok = [True] + [math.isfinite(c) for c in chain.cut_bytes]  # ok[i]: may a stage start at i?
    inf = (math.inf, math.inf)
    # best[k][i]: (slowest stage, widest cut) splitting layers[:i] into k stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    back = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf or not ok[j]:
                    continue
                cut = chain.cut_bytes[j - 1] if j > 0 else 0.0
                cand = (max(best[k - 1][j][0], pre[i] - pre[j]), max(best[k - 1][j][1], cut))
                if cand < best[k][i]:
                    best[k][i], back[k][i] = cand, j
    if best[num_stages][n] == inf:
        raise UsageError(f"pdcompile: no way to cut the model into {num_stages} stages where only tensors "
                         f"cross the cuts; use fewer stages")
    bounds, i = [], n
    for k in range(num_stages, 0, -1):
        i = back[k][i]
        bounds.append(i)
    return sorted(b for b in bounds if b > 0)


def pdcompile(model: Any = None, cluster: Any = None, *, example_inputs: Any = None,
              loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
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
