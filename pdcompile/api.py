"""``pdcompile(model, cluster_spec, ...)``: the user's way in, as a function and as a decorator.

    pipe = pdcompile(model, cluster, example_inputs=(x,), loss_fn=torch.nn.CrossEntropyLoss(),
                     optimizer=lambda params: torch.optim.SGD(params, lr=0.1), schedule="flush")
    print(pipe.plan); pipe.dump_ir("ir/"); pipe.emit("out/")
    model.load_state_dict(pipe.run(batches, steps=5).state_dict())

The API checks the options and runs the pass list (:mod:`pdcompile.pipeline`); the result offers
the plan, explain, simulate, emit and run. ``example_inputs`` is one minibatch, split along dim 0
into microbatches; ``loss_fn(output, target)`` is traced into the last stage (``trace-loss``).
"""

from __future__ import annotations

import dataclasses

import functools
import inspect
import json
import math
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pdcompile import autoschedule, callables, init_source, machine_cache, passmanager
from pdcompile.cluster import ClusterSpec
from pdcompile.errors import PdcompileError, UncalibratedWarning, UsageError
from pdcompile.ir import Chain, CompileState, need
from pdcompile.passes import codegen
from pdcompile.passes.annotate_costs import AnnotateOptions
from pdcompile.passes.costs.roofline import contention
from pdcompile.passes.partition import PartitionOptions, balanced_bounds, planner_schedule
from pdcompile.passes.partition_dp import pipeline_plan, plan_from_assignment
from pdcompile.passes.planner import tensor
from pdcompile.passes.planner.options import PlanOptions
from pdcompile.passes.planner.sharding import check_option as check_shard
from pdcompile.passes.planner.sharding import describe as describe_shard
from pdcompile.passes.planner.sharding import untie as untie_shard
from pdcompile.passes.schedule import ScheduleOptions
from pdcompile.passes.split_stages import StageSplit
from pdcompile.passes.export_frontend import LossProbe
from pdcompile.passes.tensor_parallel import TensorParallelOptions, degrees_of
from pdcompile.passes.trace import TraceOptions
from pdcompile.passes.trace_loss import LossProgram, TracedLoss, TraceLossOptions, loss_program
from pdcompile.pipeline import PassOptions, passes
from pdcompile.plan import Plan, chooses_microbatches, layout_of, step_headline, step_objective
from pdcompile.runtime import staleness
from pdcompile.runtime.data import batch_parts, no_target
from pdcompile.runtime.tensor_parallel import RankLayout
from pdcompile.run_result import RunResult, aliases
from pdcompile.options import (  # noqa: F401 - SCHEDULE_NAMES, Options, check_keywords: the API's names too
    SCHEDULE_NAMES, Options, _check, _check_clipping, _default_optimizer, _from_csv, _with_virtual_stages,
    check_keywords, keywords_checked, optimizer_state_factor_of, option_names)


def step_costs(cluster: ClusterSpec | None,
               source: machine_cache.CostSource) -> tuple[machine_cache.ActionCost | None, float | None, str]:
    """The step costs charged besides the chain's (one channel: ``pdcompile()``'s compile, ``pdcompile plan``
    and ``pdcompile simulate`` read them here): on CPU workers the runtime's per-action cost
    (:func:`pdcompile.machine_cache.action_cost`: calibrated, or a built-in estimate; else None), with, on a
    local cluster where calibrated, the runtime's measured all-reduce (``ActionCost.collective``; on one of more
    workers than cores, ``roofline.contention``, the one measured so, ``ActionCost.crowded``, where calibrated); the
    optimizer step's calibrated bandwidth (:func:`pdcompile.machine_cache.update_bandwidth`) where the costs
    are this machine's (``source`` calibrated, or measured on a local cluster), else None (the device's
    analytic one) and why not."""
    cost = machine_cache.action_cost() if cluster is None or cluster.device.name == "cpu" else None
    if cost is not None and not machine_cache.is_local(cluster):
        cost = replace(cost, collective=None, wake=0.0)  # this host's all-reduce and wake-up: for a cluster on it only
    elif cost is not None and cost.crowded is not None and contention(cluster) > 1.0:
        cost = replace(cost, collective=cost.crowded)  # more workers than cores: the ring waits for cores
    ours = source.table is not None or (source.mode == "measured" and machine_cache.is_local(cluster))
    bw, problem = machine_cache.update_bandwidth() if ours else (None, "")
    return cost, bw, problem


def corun_of(cluster: ClusterSpec | None, source: machine_cache.CostSource) -> tuple[tuple[int, float], ...]:
    """This machine's co-running slowdowns (``OpCostTable.corun``, as (processes, factor) pairs) where they are
    charged: a cluster naming its host's cores (``local_cpu_cluster``) whose costs are this machine's
    calibration (``source.table``); else (). What ``PlanOptions.corun`` and ``simulate_plan(corun=)`` carry
    (one channel beside :func:`step_costs`'s: ``pdcompile()``, ``pdcompile plan`` and ``pdcompile simulate``),
    charged only while ranks compute side by side (:func:`pdcompile.simulate.shared_cores`), never on the
    chain (``annotate_costs.run``)."""
    table = source.table
    if table is None or not getattr(getattr(cluster, "device", None), "cores", None):
        return ()
    return tuple(sorted((int(n), float(f)) for n, f in table.corun.items()))


def step_cost_line(bandwidth: float, calibrated: bool, problem: str, cost: machine_cache.ActionCost | None) -> str:
    """One line: the step costs charged (:func:`step_costs`): the optimizer step's ``bandwidth`` and whence
    (``calibrated`` on this machine, else the device's analytic one and ``problem``), the per-action cost."""
    if calibrated:
        whence = "calibrated on this machine (step_rate x 5 bytes streamed per weight byte)"
    else:
        whence = "the device's analytic memory bandwidth x efficiency" + \
            (f"; not calibrated: {problem}" if problem else "")
    per = "no per-action cost" if cost is None else \
        f"the runtime's per-action cost ({'calibrated' if cost.calibrated else 'built-in estimate'}, " \
        f"{max((v for k, v in cost.seconds.items() if k in machine_cache.ACTION_KINDS), default=0.0) * 1e6:.0f} " \
        f"us at most)"
    if cost is not None and machine_cache.STEP_TENSOR_KEY in cost.seconds:
        per += (f"; per parameter tensor {cost.seconds[machine_cache.STEP_TENSOR_KEY] * 1e6:.1f} us in each optimizer "
                f"step and {cost.seconds.get(machine_cache.FLATTEN_TENSOR_KEY, 0.0) * 1e6:.1f} us in each all-reduce "
                f"(its flatten and copy back)")
    if cost is not None and cost.collective is not None:
        fixed, rate = cost.collective
        per += (f"; each all-reduce the runtime's own, calibrated on this host: {fixed * 1e3:.2f} ms + bytes / "
                f"{rate / 1e9:.3g} GB/s (2 processes; a ring's bytes for more)")
    return (f"step costs (the step search, simulate() and auto alike): each optimizer step and weight copy "
            f"streams at {bandwidth / 1e9:.3g} GB/s, {whence}; {per}")


class CompiledPipeline:
    """The result of ``pdcompile``: plan, IR after every pass, emit and run."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...], opts: Options,
                 dump_dir: str | os.PathLike[str] | None = None) -> None:
        self.model = model
        # schedule="auto": compiled with flush first (its own step search, as schedule="flush" compiles), then
        # with the schedule and M the simulator picks where that compiles faster
        opts = _with_virtual_stages(_from_csv(opts))
        auto = opts.schedule == autoschedule.AUTO
        self.schedule_choice: tuple[list[autoschedule.Candidate], autoschedule.Candidate, list[str]] | None = None
        # schedule="auto" on CPU workers: the runtime's per-action cost it charged (calibrated or built-in)
        self.action_cost: machine_cache.ActionCost | None = None
        # the optimizer step's calibrated bandwidth (bytes/s) where charged, else None and why not (_step_costs)
        self.update_bandwidth: float | None = None
        self.update_bandwidth_problem = ""
        self.state: CompileState  # written by _compile
        choose = chooses_microbatches(opts.cluster, "flush" if auto else opts.schedule, opts.num_microbatches,
                                      opts.microbatch_size, opts.stages)
        self._compile(model, example_inputs, replace(opts, schedule="flush") if auto else opts, dump_dir, choose)
        if auto:
            self._choose_schedule(model, example_inputs, opts, dump_dir)
        self._losses: dict[tuple[tuple[int, ...], str], LossProgram] = {}
        if self.state.loss is not None and opts.example_target is not None:
            self._losses[_target_key(self._micro_target(opts.example_target))] = self.state.loss

    def _compile(self, model: torch.nn.Module, example_inputs: Any, opts: Options,
                 dump_dir: str | os.PathLike[str] | None, choose_microbatches: bool = False) -> None:
        self.options = opts
        self.example, self.microbatch_size, self.num_microbatches = _check(model, example_inputs, opts)
        self.example_inputs, self.example_kwargs = self.example.args, self.example.kwargs
        # a model on meta: the passes see the inputs' shapes on meta too
        micro = self.example.micro(self.microbatch_size, meta=init_source.has_meta(model))
        self.cost_source = machine_cache.cost_source(opts.cost_mode, machine_cache.is_local(opts.cluster))
        # the co-running slowdowns the step search, simulate() and auto charge (corun_of; the chain carries none)
        self.corun = corun_of(opts.cluster, self.cost_source)
        self._step_costs(opts.cluster)
        state = CompileState(model=model, example_inputs=micro.args, example_kwargs=micro.kwargs or None)
        # the passes run the model's forward in training mode (shapes, costs), which writes buffers such as
        # BatchNorm's running statistics: put them back, for the user's model and the stages (the same tensors)
        kept = [(b, b.clone()) for b in model.buffers()]
        try:
            self.state, self.records = passmanager.run_passes(passes(self._pass_options(choose_microbatches)), state,
                                                              dump_dir)
        finally:
            with torch.no_grad():
                for b, v in kept:
                    b.copy_(v)
        if self.split.tied:  # FSDP2 cannot shard a parameter whose gradient is summed across stages
            self.state = self.state.replace(plan=untie_shard(self.plan, {s for g in self.split.tied for s, _ in g},
                                                             opts.shard))
        if opts.clip_grad_norm is not None:
            _check_clipping(need(self.state.schedule_spec, "schedule_spec"))
        if choose_microbatches and self.plan.num_microbatches != self.num_microbatches:  # again, at the M it chose
            self._compile(model, example_inputs, replace(opts, num_microbatches=self.plan.num_microbatches,
                                                         also_rate=(layout_of(self.plan),)), dump_dir)
            return
        try:  # the plan's headline is simulate() of the compiled program: one number (docs/reading-a-plan.md)
            head = step_headline(opts.schedule, self.num_microbatches, self.microbatch_size)
            self.state = self.state.replace(plan=self.plan.with_step(float(self.simulate().step_time_s),
                                                                     self.num_microbatches, head))
        except PdcompileError:  # one the simulator cannot replay keeps the planner's figure (its table says so)
            pass

    def _step_costs(self, cluster: ClusterSpec | None) -> None:
        """What the step search, :meth:`simulate` and ``schedule="auto"`` all charge besides the chain's costs
        (``PlanOptions.update_bandwidth`` and ``action_overhead_s``, one channel): on CPU workers the runtime's
        per-action cost (:func:`pdcompile.machine_cache.action_cost`: calibrated, or a built-in estimate), and
        where the costs are this machine's (cost_mode calibrated, or measured on a local cluster) the
        optimizer step's calibrated bandwidth (:func:`pdcompile.machine_cache.update_bandwidth`), else the
        device's analytic one (``update_bandwidth`` None: :func:`pdcompile.simulate.update_bandwidth_of`)."""
        cost, self.update_bandwidth, self.update_bandwidth_problem = step_costs(cluster, self.cost_source)
        if self.action_cost is None:
            self.action_cost = cost

    def _step_cost_line(self) -> str:
        """explain()'s line on what the step search, simulate() and auto charged besides the chain's costs."""
        return step_cost_line(self._update_bandwidth(self.cluster), self.update_bandwidth is not None,
                              self.update_bandwidth_problem, self.action_cost)

    def _update_bandwidth(self, cluster: ClusterSpec) -> float:
        """Bytes/s the optimizer step streams on ``cluster`` as charged: calibrated, else the device's."""
        from pdcompile.simulate import update_bandwidth_of

        return self.update_bandwidth if self.update_bandwidth is not None else update_bandwidth_of(cluster)

    def _choose_schedule(self, model: torch.nn.Module, example_inputs: Any, asked: Options,
                         dump_dir: str | os.PathLike[str] | None) -> None:
        """``schedule="auto"``: simulate the candidates on the plan (:mod:`pdcompile.autoschedule`),
        recompile with the best when it is not the flush compiled first. M stays as given, if given."""
        split = need(self.state.schedule_spec, "schedule_spec").split_backward  # the schedule pass's decision
        pays = autoschedule.split_every_backward_pays(self.cluster.device.name, split)
        names = autoschedule.auto_schedules(pays)
        virtual = autoschedule.auto_schedules(pays, virtual=True) \
            if autoschedule.virtual_stages_pay(self.cluster.device.name) else []
        skipped = [f"not considered: {n} (it splits backwards: on CPU workers that costs more than the bubble it "
                   f"fills, see split_every_backward_pays)" for n in autoschedule.auto_schedules(True) if n not in names]
        skipped += [f"not considered: {n} (several stages per rank: on CPU workers their transfers are slower than "
                    f"the simulator predicts, see virtual_stages_pay)"
                    for n in autoschedule.auto_schedules(True, virtual=True) if n not in virtual]
        batch = self.batch_size
        fixed = self.num_microbatches if asked.num_microbatches is not None or asked.microbatch_size is not None \
            else None
        tied_bytes, tied_stages = self._tied()
        cost = self.action_cost  # read by _compile (_step_costs), as the step search and simulate() charge it
        overhead = cost.seconds if cost is not None else 0.0
        collective = cost.collective if cost is not None else None
        wake = cost.wake if cost is not None else 0.0
        # the user's optimizer state, as the plan and simulate() count it (Adam 2, plain SGD 0 bytes per weight byte)
        factor = optimizer_state_factor_of(asked.optimizer)
        counts = autoschedule.microbatch_counts(batch, fixed)
        if fixed is None:  # every replica of a stage takes an equal share of every minibatch (with fewer
            # microbatches than replicas, a replica idles whole steps, and the input stage's reader of a
            # DataLoader fails on a minibatch with nothing for its rank: runtime/data.py)
            counts = [m for m in counts if all(m % st.replicas == 0 for st in self.plan.stages)] or counts
        t = max(st.tensor_parallel for st in self.plan.stages)
        tchain, tcluster = self._tensor_view(self.plan)  # a plan with tensor parallelism is simulated as planned
        cands = autoschedule.candidates(self.plan, tchain, tcluster, batch, names, counts,
                                        recompute=asked.recompute, split_backward=split, tied_bytes=tied_bytes,
                                        tied_stages=tied_stages, overhead_s=overhead, optimizer_state_factor=factor,
                                        update_bandwidth=self._update_bandwidth(tcluster), collective=collective,
                                        corun=self.corun, wake_s=wake)
        ranks = len({r for st in self.plan.stages for r in st.ranks})
        if (asked.replicas is None or all(r == 1 for r in asked.replicas)) and asked.clip_grad_norm is None \
                and t == 1:  # (virtual stages are given stages=, where the planner does not choose t)
            # virtual stages on the plan's ranks, one replica per stage: the tie (if any) joins the first and last
            # (not with clipping: a rank steps its stages at different points, see _check_virtual)
            for v in autoschedule.VIRTUAL_STAGES:
                cands += autoschedule.virtual_candidates(
                    self.wire_chain, self.cluster, ranks, batch, virtual, counts, vs=(v,), split_backward=split,
                    tied_bytes=tied_bytes, tied_stages=[0, v * ranks - 1] if tied_bytes else [],
                    overhead_s=overhead, optimizer_state_factor=factor,
                    update_bandwidth=self._update_bandwidth(self.cluster), collective=collective,
                    corun=self.corun, wake_s=wake)
        # the flush program compiled first is a candidate as it is: its headline, simulate() of it
        flush_step = self.plan.seconds_per_minibatch
        cands = [dataclasses.replace(c, step_s=flush_step) if (c.schedule, c.num_microbatches, c.virtual_stages) ==
                 ("flush", self.num_microbatches, 1) else c for c in cands]
        chosen = autoschedule.best(cands)
        self.schedule_choice = (cands, chosen, [*_action_cost_notes(cost, self.cluster, fixed is None), *skipped])
        flush_compiled = dict(self.__dict__)  # kept where the chosen one, compiled, is predicted slower
        if chosen.virtual_stages > 1:
            ranks_v = chosen.virtual_stages * ranks
            self._compile(model, example_inputs, replace(asked, schedule=chosen.schedule, microbatch_size=None,
                                                         num_microbatches=chosen.num_microbatches,
                                                         virtual_stages=chosen.virtual_stages, stages=ranks_v,
                                                         replicas=None), dump_dir)
        elif (chosen.schedule, chosen.num_microbatches) != (self.options.schedule, self.num_microbatches):
            # planned again at its count, the plan the candidates were rated on is rated there too
            self._compile(model, example_inputs, replace(asked, schedule=chosen.schedule, microbatch_size=None,
                                                         num_microbatches=chosen.num_microbatches,
                                                         also_rate=(layout_of(self.plan),)), dump_dir)
            # planned again at the new microbatch size, a stage may have more replicas than the count allows
            reps = math.lcm(*(st.replicas for st in self.plan.stages))
            more = [m for m in autoschedule.microbatch_counts(batch) if m > chosen.num_microbatches and m % reps == 0] \
                if fixed is None else []
            if self.num_microbatches % reps and more:
                self.schedule_choice[2].insert(0, f"note: planned again at {chosen.num_microbatches} microbatches, "
                                                  f"a stage has {reps} replicas: compiled with {more[0]}, so each "
                                                  f"replica takes a share of every minibatch")
                self._compile(model, example_inputs, replace(asked, schedule=chosen.schedule, microbatch_size=None,
                                                             num_microbatches=more[0]), dump_dir)
        else:
            self.options = replace(asked, schedule=chosen.schedule)
        if self.plan.seconds_per_minibatch > flush_step * (1 + 1e-9):  # planned again, it lost to flush's own plan
            note = (f"note: {chosen.schedule} with {chosen.num_microbatches} microbatches compiled to "
                    f"{self.plan.seconds_per_minibatch:.4g} s per minibatch, slower than flush's own plan "
                    f"({flush_step:.4g} s): flush kept")
            self.__dict__.update(flush_compiled)  # its options too: flush at the count its search chose
            self.schedule_choice[2].insert(0, note)

    def _tied(self) -> tuple[float, list[int]]:
        """Bytes of the parameters tied across stages, and those stages."""
        tied_bytes, tied_stages = 0.0, set[int]()
        for group in self.split.tied:
            st, name = group[0]
            p = dict(self.split.stages[st].gm.named_parameters())[name]
            tied_bytes += p.numel() * p.element_size()
            tied_stages.update(s for s, _ in group)
        return tied_bytes, sorted(tied_stages)

    def _pass_options(self, choose_microbatches: bool = False) -> PassOptions:
        """The checked options, as each pass's options."""
        opts = self.options
        stages = opts.stages if isinstance(opts.stages, int) else None
        assert opts.virtual_stages is not None, "inferred in __init__ (_with_virtual_stages)"
        target = opts.example_target
        return PassOptions(
            trace=TraceOptions(tuple(opts.leaf_modules), opts.frontend, opts.output,
                               LossProbe(opts.loss_fn, self._micro_target(target) if target is not None else None)),
            annotate=AnnotateOptions(self.microbatch_size, self.cost_source.mode, opts.cluster, opts.symbolic_costs,
                                     opts.precision, self.cost_source.table),
            partition=PartitionOptions(
                PlanOptions(cost_model=opts.cost_model, schedule=opts.schedule, num_microbatches=self.num_microbatches,
                            recompute=opts.recompute, shard=check_shard(opts.shard),
                            optimizer_state_factor=optimizer_state_factor_of(opts.optimizer),
                            choose_microbatches=choose_microbatches, update_bandwidth=self.update_bandwidth,
                            also_rate=opts.also_rate,
                            action_overhead_s=tuple(sorted(self.action_cost.seconds.items()))
                            if self.action_cost is not None else (),
                            collective=self.action_cost.collective if self.action_cost is not None else None,
                            corun=self.corun, wake_s=self.action_cost.wake if self.action_cost is not None else 0.0,
                            tensor_parallel=opts.tensor_parallel if stages is None and isinstance(
                                opts.tensor_parallel, (int, str)) else 1),
                stages, tuple(opts.replicas) if opts.replicas is not None else None, opts.cluster, opts.solver,
                precision=opts.precision, virtual_stages=opts.virtual_stages,
                loss=TraceLossOptions(opts.loss_fn, self._micro_target(target)) if target is not None else None,
                degrees=self._given_degrees(stages)),
            schedule=ScheduleOptions(opts.schedule, self.num_microbatches, virtual_stages=opts.virtual_stages,
                                     csv=opts.csv_text),
            loss=TraceLossOptions(opts.loss_fn, self._micro_target(target)) if target is not None else None,
            tensor_parallel=TensorParallelOptions(degrees_of(opts.tensor_parallel, stages)),
        )

    def _given_degrees(self, stages: int | None) -> tuple[int, ...] | None:
        """With ``stages=``, each stage's ``tensor_parallel=`` degree, which the partition pass charges per stage
        (without, the planner plans one: ``PlanOptions.tensor_parallel``)."""
        given = degrees_of(self.options.tensor_parallel, stages)
        if stages is None or isinstance(given, str):
            return None
        return (given,) * stages if isinstance(given, int) else tuple(given)

    def _tensor_view(self, plan: Plan) -> tuple[Chain, ClusterSpec]:
        """The chain and cluster ``plan`` was planned on, which its simulation replays: a plan the planner chose
        a degree for is one of ``t``-worker groups (``tensor.view``); a given split has each stage's layers at
        its own degree on the cluster's workers as pipeline ranks (``tensor.stages_at``)."""
        if not isinstance(self.options.stages, int):  # (as _pass_options reads it)
            return tensor.plan_view(self.wire_chain, self.cluster, plan.stages)  # one degree: tensor.view
        return tensor.stages_at(self.wire_chain, [(st.first, st.last, st.tensor_parallel) for st in plan.stages],
                                self.cluster.levels[0].bandwidth), self.cluster

    def _micro_target(self, target: torch.Tensor) -> torch.Tensor:
        return target[: self.microbatch_size]

    def loss(self, target: torch.Tensor | None = None) -> TracedLoss | None:
        """The traced loss for targets like ``target`` (one minibatch; default example_target)."""
        return self._loss_for(self._target_or_error(target)).traced

    def _loss_for(self, target: torch.Tensor) -> LossProgram:
        """The loss program for one minibatch ``target`` (traced once per target shape and dtype)."""
        micro = self._micro_target(target)
        key = _target_key(micro)
        if key not in self._losses:
            last = need(self.state.stages, "stages").stages[-1].gm
            self._losses[key] = loss_program(self.options.loss_fn, last, micro, self.state.output_key,
                                             values=not init_source.has_meta(self.model))
        return self._losses[key]

    @property
    def keywords(self) -> tuple[str, ...]:
        """The keyword inputs that are tensors, in the order the first stage takes them after the positional
        ones (a minibatch's ``(args, kwargs, target)`` is read in this order)."""
        return self.example.keywords

    @property
    def batch_size(self) -> int:
        """Samples per minibatch: the example's along dim 0."""
        return self.example.batch

    def _target_or_error(self, target: torch.Tensor | None) -> torch.Tensor:
        target = target if target is not None else self.options.example_target
        if target is None:  # a model that computes its own loss needs no target: an empty one per sample
            try:
                traced = self._loss_for(no_target(self.batch_size)).traced
            except UsageError:
                traced = None
            if traced is not None and not any(n.users for n in traced.gm.graph.nodes if n.op == "placeholder"
                                               and n.name == "target"):
                return no_target(self.batch_size)
        if target is None:
            raise UsageError("pdcompile: the last stage must know the target's shape: pass example_target= "
                             "(one minibatch of targets) to pdcompile, or target= to emit(); run(data) reads it "
                             "from the data")
        if not isinstance(target, torch.Tensor) or target.dim() == 0:
            raise UsageError("pdcompile: the target must be a tensor with a batch dimension (one minibatch)")
        return target

    # results ----------------------------------------------------------------------------------
    @property
    def split(self) -> StageSplit:
        return need(self.state.stages, "stages")

    @property
    def plan(self) -> Plan:
        return need(self.state.plan, "plan")

    @property
    def world_size(self) -> int:
        tp = self.state.tensor_parallel  # each pipeline rank is its stage's t processes; virtual: a rank runs several
        stage_ranks = need(self.state.stage_ranks, "stage_ranks")
        return RankLayout.of(stage_ranks, tp.degrees if tp is not None else [1] * len(stage_ranks)).world

    @property
    def cluster(self) -> ClusterSpec:
        return need(self.state.cluster, "cluster")

    @property
    def wire_chain(self) -> Chain:
        """The chain with the boundary bytes this precision sends (what the planner planned with)."""
        return need(self.state.chain, "chain").on_the_wire(self.options.precision)

    @keywords_checked()
    def simulate(self, num_microbatches: int | None = None, schedule: str | None = None,
                 num_steps: int = 1) -> Any:
        """The predicted timeline of the compiled program (:class:`pdcompile.simulate.SimResult`), as
        ``schedule="auto"`` rates it: the plan with its stages per rank, its split backwards and the
        optimizer's state; on CPU workers every action also costs the runtime's per-action time
        (:func:`pdcompile.machine_cache.action_cost`: calibrated, or a built-in estimate).
        ``num_microbatches``, ``schedule``: another count or schedule on the same plan."""
        return self._simulate_plan(self.plan, schedule or self.options.schedule,
                                   num_microbatches or self.num_microbatches, num_steps, self.options.virtual_stages or 1)

    def _simulate_plan(self, plan: Plan, schedule: str, m: int, num_steps: int = 1, virtual_stages: int = 1) -> Any:
        """``plan`` (of this compile's chain) simulated as :meth:`simulate` simulates the compiled one."""
        from pdcompile.simulate import simulate_plan

        tied_bytes, tied_stages = self._tied()
        cost = self.action_cost  # the figures the step search charged (_step_costs)
        chain, cluster = self._tensor_view(plan)
        return simulate_plan(plan, chain, cluster, schedule, m, num_steps=num_steps,
                             tied_bytes=tied_bytes, tied_stages=tied_stages, virtual_stages=virtual_stages,
                             optimizer_state_factor=optimizer_state_factor_of(self.options.optimizer),
                             split_backward=need(self.state.schedule_spec, "schedule_spec").split_backward,
                             overhead_s=cost.seconds if cost is not None else 0.0,
                             collective=cost.collective if cost is not None else None, corun=self.corun,
                             wake_s=cost.wake if cost is not None else 0.0,
                             update_bandwidth=self._update_bandwidth(cluster))

    def alternatives(self) -> list[tuple[str, Plan]]:
        """Other configurations on the same cluster, each as a Plan: pure data parallelism and
        straight pipelines of every depth (balanced by compute), for comparison with the choice."""
        chain, cluster = self.wire_chain, self.cluster
        sched = planner_schedule(self.options.schedule)
        # rated as the plan: the user's optimizer state in each stage's memory (no limit: in its notes)
        factor = optimizer_state_factor_of(self.options.optimizer)
        n = cluster.num_workers
        out: list[tuple[str, Plan]] = []
        try:
            out.append((f"data parallel x{n}", plan_from_assignment(
                chain, cluster, [(0, len(chain) - 1, n, tuple(range(n)))], schedule=sched, memory_limit=False,
                optimizer_state_factor=factor)))
        except Exception:  # noqa: BLE001 - a configuration the evaluator can't express is skipped
            pass
        for k in sorted({2, 3, 4, min(n, len(chain))}):
            if 2 <= k <= min(n, len(chain)):
                try:
                    out.append((f"straight pipeline of {k}", pipeline_plan(
                        chain, balanced_bounds(chain, k), cluster, schedule=sched, memory_limit=False,
                        optimizer_state_factor=factor)))
                except Exception:  # noqa: BLE001
                    pass
        return out

    def explain(self) -> str:
        """Why this plan: the plan table, its bottleneck, and what the alternatives would take (simulated)."""
        plan, best, sched = self.plan, self.plan.seconds_per_minibatch, self.options.schedule
        how = f"minimises the slowest stage or link; here that is {plan.bottleneck}"
        if step_objective(sched) and self.options.stages is None:
            how = f"chose the stages, replicas and microbatch count whose simulated {sched} step is shortest ({how})"
        lines = [str(plan), "", f"why: the planner ({plan.solver}, cost model {plan.cost_model}) {how}.",
                 *self.cost_source.explain(self.cluster, self.options.precision), self._step_cost_line(),
                 "alternatives on the same cluster (simulated as the plan's headline):"]
        for name, alt in self.alternatives():
            try:  # a stage per rank: virtual stages' alternatives under flush
                t = float(self._simulate_plan(alt, sched if (self.options.virtual_stages or 1) == 1 else "flush",
                                              self.num_microbatches).step_time_s)
            except Exception:  # noqa: BLE001 - a configuration the schedule can't run (too few microbatches): skipped
                continue
            note = "" if not alt.notes else f"  ({'; '.join(alt.notes)})"
            lines.append(f"  {name:<26} {t:.4g} s per minibatch  ({t / best:.2f}x the chosen plan's time){note}")
        lines += describe_shard(plan, self.options.shard)
        corr = self.staleness_entry()  # each stage's delay where the schedule has one, or a correction was asked
        if corr["asked"] != "none" or any(corr["delays"]):
            lines += ["", *staleness.describe(corr["mode"], corr["delays"], corr["warmup"], corr["sync"])]
        lines += [f"note: {c.note}" for c in self._rank_callables().values() if c.note is not None]
        if self.state.tensor_parallel is not None:  # what each stage splits, and what it leaves whole
            degrees = self.state.tensor_parallel.degrees
            how = f"tensor_parallel='auto': {'a degree per stage' if len(set(degrees)) > 1 else 'one degree'}, the " \
                  f"plan's stage lines say why" if self.options.tensor_parallel == "auto" \
                else f"degrees {list(degrees)} per stage, {self.world_size} processes" if len(set(degrees)) > 1 \
                else f"t={degrees[0]} for every stage"
            lines += ["", f"tensor parallelism ({how}; each pipeline rank is its stage's t processes; the plan's times "
                      f"are one such process's, docs/tensor-parallel.md):", str(self.state.tensor_parallel)]
        if self.schedule_choice is not None:
            lines += ["", autoschedule.format_choice(*self.schedule_choice)]
        return "\n".join(lines)

    def dump_ir(self, folder: str | os.PathLike[str]) -> Path:
        """Write ``NN_<pass>.txt`` for every pass that ran."""
        for i, r in enumerate(self.records):
            passmanager.write_dump(folder, i, r.name, r.seconds, r.dump)
        return Path(folder)

    def _rank_callables(self, data: Any = None) -> dict[str, callables.ForRanks]:
        """The options' callables the ranks run (lr_scheduler, data), each by name or by value."""
        out: dict[str, callables.ForRanks] = {}
        if self.options.lr_scheduler is not None:
            out["lr_scheduler"] = codegen.lr_scheduler_spec(self.options.lr_scheduler, self.options.optimizer)
        data = data if data is not None else self.options.data
        if data is not None and not isinstance(data, dict):
            out["data"] = callables.for_ranks(data, "data")
        return out

    def program_fields(self, data: dict[str, Any] | Callable[[int], Any] | None = None,
                       target: torch.Tensor | None = None,
                       init_from: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """plan.json fields beyond the split: schedule, microbatching, loss, optimizer, data, target, and
        where the ranks' weights come from (``init``: :mod:`pdcompile.init_source`)."""
        return self._program(data, target, init_from)[0]

    def _program(self, data: dict[str, Any] | Callable[[int], Any] | None, target: torch.Tensor | None,
                 init_from: str | os.PathLike[str] | None) -> tuple[dict[str, Any], dict[str, bytes]]:
        """:meth:`program_fields`, and the files of the callables serialized by value, by name."""
        made = self._rank_callables(data)
        files = {c.factory: c.payload for c in made.values() if c.payload is not None}
        data = data if data is not None else self.options.data
        target = self._target_or_error(target)
        t = self._micro_target(target)
        plan = json.loads(self.plan.to_json())
        layers = need(self.state.chain, "chain").layers
        codegen.recompute_entries(self.split, plan["stages"], {
            s.index: {m for l in layers[s.first:s.first + s.recompute_layers] for m in (l.members or (l.name,))}
            for s in self.plan.stages})
        return {
            "schedule": need(self.state.schedule_spec, "schedule_spec").to_json(),
            "microbatch_size": self.microbatch_size,
            "num_microbatches": self.num_microbatches,
            "loss": self._loss_for(target).entry,
            "optimizer": codegen.optimizer_spec(self.options.optimizer).to_json(),
            "target": {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""), "requires_grad": False},
            "input_keywords": list(self.keywords),
            "data": made["data"].spec() if "data" in made else data,
            "stage_ranks": [list(r) for r in need(self.state.stage_ranks, "stage_ranks")],
            "plan": plan,
            "precision": self.options.precision,
            "clip_grad_norm": self.options.clip_grad_norm,
            "lr_scheduler": made["lr_scheduler"].spec() if "lr_scheduler" in made else None,
            "init": init_source.init_entry(self.model, self.split, init_from if init_from is not None
                                           else self.options.init_from),
            # each stage's split over its tensor ranks (runtime/tensor_parallel.py); None: t = 1
            # ("degree": the largest; each stage's in its entry)
            "tensor_parallel": {"degree": max(tp.degrees), **tp.to_json()} if (tp := self.state.tensor_parallel) else None,
            "staleness": self.staleness_entry(),
        }, files

    def staleness_entry(self) -> dict[str, Any]:
        """plan.json's ``staleness``: the correction applied and each stage's delay from the compiled schedule."""
        return staleness.plan_entry(self.options.staleness, self.options.staleness_warmup,
                                    need(self.state.schedule_spec, "schedule_spec"),
                                    codegen.optimizer_spec(self.options.optimizer).to_json(),
                                    [st.shard != "none" and st.replicas > 1 for st in self.plan.stages],
                                    self.options.staleness_sync)

    @keywords_checked()
    def emit(self, folder: str | os.PathLike[str], *, data: dict[str, Any] | Callable[[int], Any] | None = None,
             target: torch.Tensor | None = None, init_from: str | os.PathLike[str] | None = None) -> Path:
        """Write the torchrun program (stage modules, weights, plan.json, train.py) into ``folder``.
        ``data``: the program's data when train.py is given no ``--data`` (default: ``pdcompile(data=)``);
        ``init_from``: a checkpoint the ranks read their stages from (default: ``pdcompile(init_from=)``);
        a meta model writes no weights (docs/big-models.md)."""
        fields, files = self._program(data, target, init_from)  # a callable the ranks can't get: refused here
        traced = self._loss_for(self._target_or_error(target)).traced
        return codegen.emit(self.split, folder, program=fields, model_name=type(self.model).__name__,
                            loss=traced.gm if traced is not None else None, files=files)

    @keywords_checked()
    def run(self, data: Iterable[Any], steps: int | None = None, *, epochs: int | None = None,
            eval_data: Iterable[Any] | None = None, eval_every: int | str = 0, eval_steps: int | None = None,
            eval_metric: str | Callable[[Any, torch.Tensor], Any] | None = None,
            out: str | os.PathLike[str] | None = None, timeout: float = 600, progress: bool = False,
            extra_args: Sequence[str] = (), init_from: str | os.PathLike[str] | None = None) -> "RunResult":
        """Emit, then train ``steps`` minibatches (or ``epochs`` passes) of ``data`` through torchrun on
        this machine (docs/training-loop.md).

        ``data``: a DataLoader or any iterable of ``(inputs, target)`` or ``(args, kwargs, target)`` minibatches
        (a None target: the model computes its own loss) of the size the
        pipeline was compiled for, streamed to the ranks as they train (:mod:`pdcompile.data_stream`:
        a few minibatches ahead, nothing saved); ``epochs`` needs ``len(data)``. The target's shape and
        dtype come from the first minibatch (no example_target= needed). ``eval_data``: validation
        minibatches, run forward only through the pipeline after every ``eval_every`` steps (``"epoch"``:
        every epoch; 0: at the end only), ``eval_steps`` of them (default ``len(eval_data)``); ``eval_metric``: "accuracy", or a
        function ``(output, target) -> number`` (a lambda too: :mod:`pdcompile.callables`). Results: :attr:`RunResult.metrics`
        (``eval``) and ``metrics/metrics.jsonl``. ``init_from``: a checkpoint the ranks start from, as
        in :meth:`emit`. For runs over many machines, emit and launch ``train.py`` with torchrun yourself
        (``--data MODULE:FUNCTION``: each rank reads its own share).
        """
        from pdcompile.data_stream import Feeder, sequence
        from pdcompile.launcher import check_train_args, launch
        from pdcompile.runtime.data import STREAM_ENV, epoch_length
        from pdcompile.runtime.loop import cuts

        if (steps is None) == (epochs is None):
            raise UsageError("run: give steps= (minibatches) or epochs= (passes over the data), one of them")
        count = steps if steps is not None else epochs
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise UsageError(f"run: {'steps' if steps is not None else 'epochs'} must be an integer >= 1")
        per_epoch = epoch_length(data) if epochs is not None else None
        if epochs is not None and not per_epoch:
            raise UsageError("run: epochs= needs data with a length (a DataLoader, a list) of at least one full "
                             "minibatch; give steps= instead")
        total = steps if steps is not None else count * (per_epoch or 0)
        metric = None if eval_metric is None or isinstance(eval_metric, str) else \
            callables.for_ranks(eval_metric, "eval_metric", keywords=False)  # by name or by value, else refused
        metric_flag = ["--eval-metric", metric.factory] if metric is not None else \
            ["--eval-metric", eval_metric] if isinstance(eval_metric, str) else []
        eval_len = None
        if eval_data is not None:
            eval_len = eval_steps or epoch_length(eval_data)
            if not eval_len:
                raise UsageError("run: eval_data has no length; give eval_steps= (minibatches per evaluation)")
        folder = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="pdcompile-run-"))
        folder.mkdir(parents=True, exist_ok=True)
        it = iter(data)
        head = next(it, None)
        if head is None:
            raise UsageError("run: the data yields no minibatch")
        first: list[torch.Tensor] = []
        next(_noting_first_target([head], first, self.keywords))
        size, want = int(first[0].shape[0]), self.microbatch_size * self.num_microbatches
        if size != want:
            raise UsageError(f"run: minibatches have {size} samples, the pipeline was compiled for {want} "
                             f"({self.num_microbatches} x {self.microbatch_size}); recompile or rebatch")
        prog = self.emit(folder / "program", target=self._data_target(first[0]), init_from=init_from)
        if metric is not None and metric.payload is not None:  # beside plan.json, where the ranks look first
            (prog / metric.factory).write_bytes(metric.payload)
        ranks = json.loads((prog / "plan.json").read_text())["stages"]
        # every rank reads the same streamed minibatches: by default the last stage, and each stage that reads
        # model inputs, read theirs themselves (--targets local; nothing sent on for them)
        chosen = [b for a, b in zip(extra_args, list(extra_args)[1:]) if a == "--targets"] + \
            [a.split("=", 1)[1] for a in extra_args if a.startswith("--targets=")]
        local = chosen[-1] == "local" if chosen else True
        readers = {r for i, st in enumerate(ranks) if i == 0 or (local and (i == len(ranks) - 1 or st.get("data_inputs")))
                   for r in st["ranks"]}  # the ranks that read the data (runtime/trainer.py's readers)
        feeder = Feeder(len(readers), timeout=timeout,
                        keywords=self.keywords)
        args = ["--steps", str(steps)] if steps is not None else ["--epochs", str(epochs)]
        args += ["--data", "pdcompile.runtime.data:stream_train"] + ([] if chosen else ["--targets", "local"])
        try:
            feeder.feed("train", per_epoch or total, iter([("train", sequence(data, total, per_epoch, (head, it)))]))
            if eval_data is not None and eval_len:
                passes = len(cuts(0, total, (per_epoch or 0) if eval_every == "epoch" else int(eval_every)))
                feeder.feed("eval", eval_len, ((f"eval/{p}", sequence(eval_data, eval_len, None, what="eval_data"))
                                               for p in range(passes if eval_every else 1)))
                args += ["--eval-data", "pdcompile.runtime.data:stream_eval", "--eval-every", str(eval_every),
                         *metric_flag]
            on_line = (lambda line: print(line, flush=True)) if progress else None
            args += ["--save-final", str(folder / "final"), "--metrics", str(folder / "metrics"), *extra_args]
            check_train_args(prog, args, self.world_size)  # extra_args train.py refuses: a UsageError, not a launch
            rc, log = launch(prog, self.world_size, args, timeout=timeout, on_line=on_line,
                             env={STREAM_ENV: feeder.address})
        finally:
            failed = feeder.close()  # the feeding threads stopped; what the data raised, if anything
        (folder / "train.log").write_text(log)
        if failed is not None:  # the data's own failure is the cause: say it first
            raise UsageError(f"run: reading the data failed: {failed}; log in {folder / 'train.log'}")
        if rc != 0:
            raise RuntimeError(f"run: training failed with exit status {rc}; log in {folder / 'train.log'}:\n"
                               + log[-2000:])
        return RunResult(folder, prog, aliases(self.model))

    def _data_target(self, target: torch.Tensor) -> torch.Tensor:
        """The first minibatch's target, checked against example_target= when that was given too."""
        given = self.options.example_target
        if given is not None and _target_key(self._micro_target(given)) != _target_key(self._micro_target(target)):
            g, t = self._micro_target(given), self._micro_target(target)
            raise UsageError(f"run: the data's targets are {t.dtype} {tuple(t.shape)} per microbatch, but "
                             f"example_target= is {g.dtype} {tuple(g.shape)}; drop example_target= (run reads "
                             f"the target from the data) or make them agree")
        return target


def _noting_first_target(data: Iterable[Any], first: list[torch.Tensor], keywords: Sequence[str] = ()
                         ) -> Iterator[Any]:
    """``data``'s minibatches, appending the first one's target to ``first`` as it passes
    (:func:`~pdcompile.runtime.data.batch_parts`: a None target is the empty one of a model's own loss)."""
    for batch in data:
        if not first:
            first.append(batch_parts(batch, keywords, "run: data")[1])
        yield batch


def _action_cost_notes(cost: machine_cache.ActionCost | None, cluster: ClusterSpec, chose_m: bool) -> list[str]:
    """explain()'s line on the per-action cost ``schedule="auto"`` charged (:func:`pdcompile.machine_cache.action_cost`,
    read from the cache, never measured here: compiling launches nothing); not calibrated for this runtime
    while it chose the microbatch count, also an :class:`UncalibratedWarning`."""
    if cost is None:
        return [f"note: no per-action cost charged: {machine_cache.CALIBRATE_COMMAND} measures this machine's CPU "
                f"runtime, not {cluster.device.name} workers'"]
    if cost.calibrated:
        return []
    line = cost.warning(chose_m)
    if chose_m:
        warnings.warn(line, UncalibratedWarning, stacklevel=_outside_pdcompile())
    return [f"warning: {line}"]


def _outside_pdcompile() -> int:
    """The ``stacklevel`` of the innermost caller outside the pdcompile package (a warning names the user's line)."""
    here = str(Path(__file__).resolve().parent)
    frame, level = inspect.currentframe(), 0
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(here):
        frame, level = frame.f_back, level + 1
    return max(level, 1)


def _target_key(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    return tuple(t.shape), str(t.dtype)


@keywords_checked(also=option_names)
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
