"""The stage executor: runs one rank's list of schedule actions.

Each action's meaning, and how weight versions plug in: :class:`StageExecutor`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.runtime import comm
from pdcompile.runtime.memory import MemoryMeter, span_bytes
from pdcompile.runtime.program import Program, StageSpec
from pdcompile.runtime.recompute import StageRecompute
from pdcompile.runtime.schedules import Action, Kind
from pdcompile.runtime.schedules.transfers import TargetPosts, several_per_rank
from pdcompile.runtime.shard import FullShard, local
from pdcompile.runtime.staleness import LrCorrection
from pdcompile.runtime.fused_grads import Deferred, FusedGrads
from pdcompile.runtime.graph_split import GraphSplit, graph_route
from pdcompile.runtime.weight_grads import WeightPass

log = logging.getLogger("pdcompile.runtime")

WEIGHT_PASSES = ("graph", "submodules")  # how a split backward is split (StageExecutor's weight_pass)
DEFAULT_WEIGHT_PASS = "graph"


def allreduce_flat(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """Sum ``tensors`` across ``group`` in place with one collective per dtype (a flat bucket):
    one call per parameter costs a round trip each, which dominates small models."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for ts in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in ts:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n


class WeightStore:
    """Which weights a microbatch's forward/backward uses. The default: the live parameters."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def expect(self, actions: Sequence[Action], *, more: bool = False) -> None:
        """The rank's actions, read before they run (lets a store free versions early): all of them,
        or a long run's in parts (``more=True`` while more follow)."""

    def set_forward_version(self, version: int) -> None:
        """``WV``: forwards from now on use ``version`` (the default store has only the live one)."""
        if version != 0:
            raise RuntimeError(f"WV{version}: this weight store keeps one version only; use "
                               f"pdcompile.runtime.weights.VersionedStore for schedules with weight versions")

    def params_for_forward(self, microbatch: int) -> dict[str, torch.Tensor] | None:
        return None  # None: call the module as it is

    def after_backward(self, microbatch: int) -> None:
        pass

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def observe(self) -> None:
        """Called after every action: a chance to measure live versions."""

    def live_versions(self) -> int:
        return 1

    def peak_versions(self) -> int:
        """The most weight versions alive at once during the run (measured)."""
        return 1


@dataclass
class _Mb:
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    loss: torch.Tensor | None = None
    target: torch.Tensor | None = None
    recv_act: comm.Pending | _Handed | None = None
    recv_grad: comm.Pending | _Handed | None = None
    recv_target: comm.Pending | _Handed | None = None
    input_grads: list[torch.Tensor] | None = None  # computed by a split B (``W`` follows)
    relayed: dict[int, torch.Tensor] = field(default_factory=dict)  # model inputs relayed on (--targets send)


class Mailbox:
    """Hand-overs between stages on one rank (virtual stages): what ``SF``/``SB``/a target send
    puts here, the other stage's receive takes, in memory. Keys: ``("A"|"G", to_stage, mb)`` and
    ``("T", mb)``."""

    def __init__(self) -> None:
        self.items: dict[tuple[Any, ...], list[torch.Tensor]] = {}

    def put(self, key: tuple[Any, ...], tensors: list[torch.Tensor]) -> None:
        if key in self.items:
            raise RuntimeError(f"in-memory hand-over {key} sent twice")
        self.items[key] = tensors

    def take(self, key: tuple[Any, ...]) -> list[torch.Tensor]:
        try:
            return self.items.pop(key)
        except KeyError:
            raise RuntimeError(f"in-memory hand-over {key} received before it was sent (the schedule must run "
                               f"the sending stage's SF/SB first on this rank)") from None


@dataclass
class _Handed:
    """A receive from a stage on this rank: taken from the mailbox when waited for (a ``Pending``)."""

    mailbox: Mailbox
    key: tuple[Any, ...]
    tensors: list[torch.Tensor] = field(default_factory=list)

    def wait(self) -> list[torch.Tensor]:
        if not self.tensors:
            self.tensors = self.mailbox.take(self.key)
        return self.tensors


class ActionError(RuntimeError):
    """An action failed on a rank; names rank, stage and action."""


class StageExecutor:
    """One executor per rank. It owns the stage module, the optimizer and the per-microbatch state
    (inputs received, outputs computed, gradients), and interprets each Action:

    * ``RF``/``RB``: receives for a microbatch's activations / output gradients (from the
      neighbouring stage's replica that handles that microbatch, ``k % replicas``), posted where the
      run's transfer plan says (``run``'s ``posts``; runtime/transfers.py), so that both sides of every
      pair of ranks issue their transfers in the same order, as NCCL requires;
    * ``F``: run the stage (first stage: on data; last stage: also the loss, scaled by
      ``1/accumulation``); ``SF`` sends the outputs downstream;
    * ``B``: backpropagate (last stage from the loss, others from the received gradients);
      ``SB`` sends the input gradients upstream; when a ``W`` of the same microbatch follows in the
      actions, ``B`` computes only the input gradients (keeping the autograd graph) and ``W`` the
      weight gradients, so ``SB`` goes out a weight-gradient pass sooner (the drain's split backward;
      zero bubble splits every backward, on stage 0 too, where ``B`` computes the activations' gradients).
      How (``weight_pass``): ``"graph"`` runs such a microbatch's forward and backward through the
      stage's traced graphs, the backward cut into ``I`` and ``W`` (runtime/graph_split.py), where
      that applies; ``"submodules"`` (and the fallback) splits by submodules (runtime/weight_grads.py);
    * ``AR``: all-reduce (sum) gradients among the stage's replicas; ``TG``: sum gradients of
      parameters tied across stages; ``ST``: optimizer step (and LR scheduler), then zero grads;
      ``WV``: later forwards use another weight version (told to the weight store).

    Weight versions (PipeDream's stashing, 2BW) plug in through :class:`WeightStore`: it hands the
    executor the parameter tensors each forward should use (``torch.func.functional_call``) and is
    told when backward and step happen. The default store trains the live parameters (synchronous
    schedules).
    """

    def __init__(self, program: Program, rank: int, module: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor] | None,
                 *, accumulation: int, data: Callable[[int], tuple[Sequence[torch.Tensor], torch.Tensor]] | None,
                 replica_group: Any = None, tied_groups: Sequence[tuple[Any, ...]] = (),
                 lr_scheduler: Any = None, weight_store: WeightStore | None = None,
                 local_targets: bool = False, target_check: Sequence[int] = (0,),
                 recorder: Callable[[str, float, float], None] | None = None,
                 device: torch.device | str = "cpu", fail_at: str | None = None,
                 clock: Callable[[], float] = time.perf_counter, precision: str = "fp32",
                 clip_grad_norm: float | None = None, norm_group: Any = None, norm_counts: bool = True,
                 measure_memory: bool = True,
                 norm_skip: frozenset[str] = frozenset(), stage: int | None = None,
                 mailbox: Mailbox | None = None, weight_pass: str = DEFAULT_WEIGHT_PASS,
                 sharded: FullShard | None = None, fused: FusedGrads | None = None,
                 staleness_lr: LrCorrection | None = None) -> None:
        self.program = program
        self.rank = rank
        # stage: which of the rank's stages this executor runs (virtual stages: one executor each,
        # sharing the rank's mailbox for the hand-overs between them; :class:`RankExecutor`)
        self.spec: StageSpec = program.stage_of_rank(rank) if stage is None else program.stages[stage]
        self.mailbox = mailbox if mailbox is not None else Mailbox()
        self.stage = self.spec.index
        self.is_first = self.stage == 0
        self.is_last = self.stage == program.num_stages - 1
        self.module = module
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.accumulation = accumulation
        self.data = data
        self.replica_group = replica_group
        self.tied_groups = tied_groups
        self.lr_scheduler = lr_scheduler
        self.weights = weight_store or WeightStore(module)
        self.recorder = recorder
        self.clock = clock  # what the recorder's times come from (on a GPU: after the device caught up)
        self.device = torch.device(device)
        self.fail_at = fail_at  # "RANK:ACTION", e.g. "1:1B3": raise there (tests the no-hang path)
        # local_targets: the last stage takes targets from its own copy of the data (``data``); the
        # targets of the microbatches in ``target_check`` (the run's first one per last-stage
        # replica) are still sent by the first stage and compared (see _local_target)
        self.local_targets = local_targets and not (self.is_first and self.is_last)
        # the model inputs a later stage reads (plan.json's data_inputs): from its own copy of the data
        # with local targets; else relayed from stage 0 after the activations (relay_in: what arrives here,
        # relay_out: what this stage passes on)
        self.local_data = local_targets
        self.relay_in = program.relayed(self.stage) if not local_targets else ()
        self.relay_out = program.relayed(self.stage + 1) if not local_targets and not self.is_last else ()
        self.target_check = frozenset(target_check)
        self.mbs: dict[int, _Mb] = {}
        # sends in flight, by the action that posted them; waited for once the schedule says their
        # receiver has taken them (``run``'s ``release``: schedules.send_release), the rest at the end
        self.sends: dict[Action, list[Any]] = {}
        self.peak_sends = 0  # the most sends in flight at once (metrics: bounded by the schedule, not the run)
        self._losses: list[float] = []
        self._pending_losses: list[torch.Tensor] = []  # on the device: read at logging points, not per microbatch
        self.loss_microbatches: list[int] = []  # the microbatch of each loss, in the same order
        self._compute_start: float | None = None
        # the targets' window (TargetPosts): with several stages on a rank, a step (accumulation = M there,
        # synchronous schedules); the first stage sends a step's targets at its first F of it, the last
        # stage's rank posts them at its first RF of it (one stage per rank: T k with F k, posted by RF k)
        self.target_window = self.accumulation if several_per_rank([st.ranks for st in program.stages]) else 1
        self._targets = TargetPosts(0, 1)  # the last stage: the targets to post
        self._target_sends = TargetPosts(0, 1)  # the first stage: the targets to send (window > 1)
        # the executor of this rank's last stage, if it holds it: any stage's RF k on the rank first posts
        # the targets TargetPosts gives (up to k, or the step's), before its own receive
        self.targets_by: StageExecutor | None = self if self.is_last else None
        self.begin(0)
        self._split: set[int] = set()  # microbatches whose B is split (a W follows in the actions)
        self._weight_pass: dict[int, Any] = {}  # microbatch -> (its weight pass, what its W needs)
        self._notes: dict[int, Any] = {}  # microbatch -> (its weight pass, what it noted in its forward)
        self._wpass = WeightPass(module)
        # weight_pass "graph": split backwards run the stage's traced backward graph cut into I and W
        # (runtime/graph_split.py), built at the first split forward; None once it does not apply
        if weight_pass not in WEIGHT_PASSES:
            raise ValueError(f"weight_pass must be one of {WEIGHT_PASSES}, got {weight_pass!r}")
        self.weight_pass = weight_pass
        self._graph: GraphSplit | None = None
        self._graph_skipped = False  # a split microbatch went by submodules (said once)
        self.split_counts: Counter[str] = Counter()  # split backwards by weight pass (metrics)
        # activation recomputation, as planned for this stage (runtime/recompute.py): "full" checkpoints the
        # stage's forward, "selective" keeps only its FLOP-counted ops' outputs, "partial" checkpoints its head
        plan_stages = program.raw.get("plan", {}).get("stages", [])
        self.recomputer = StageRecompute.from_plan(plan_stages[self.stage] if self.stage < len(plan_stages) else {},
                                                   module, self.stage)
        self.recompute = self.recomputer is not None
        # the stage's own accounting (metrics "memory"); off, it costs nothing
        self.meter = MemoryMeter(module, optimizer, enabled=measure_memory)
        # mixed precision: "bf16" runs forward and loss under autocast (the parameters and the optimizer
        # stay fp32) and sends floating boundary tensors as bf16 (TensorSpec.wire)
        self.precision = precision
        # global-norm clipping at every ST: the sum of squares of the gradients this rank counts (norm_counts:
        # replica 0 of its stage; norm_skip: tied copies another stage counts) is all-reduced over norm_group
        # (every rank), then every gradient is scaled as clip_grad_norm_ does. 1F1B and 2BW step the stages at
        # different times: the k-th ST of every rank meets in that all-reduce (the k-th update of every stage,
        # schedules.check_global_steps: the same microbatches, and no deadlock with ST a collective)
        self.clip_grad_norm = clip_grad_norm
        self.norm_group = norm_group
        self.norm_counts = norm_counts
        self.norm_skip = norm_skip
        self.grad_norms: list[torch.Tensor] = []  # the unclipped global norm at each ST (metrics)
        # shard "full" (runtime/shard.py): FSDP2 reduces at the replica's last backward of a step, never split
        self.sharded = sharded
        self.meter.sharded = sharded is not None
        # fused weight-gradient accumulation (runtime/fused_grads.py); a split backward's, by microbatch
        self.fused = fused
        self._deferred: dict[int, Deferred] = {}
        # staleness="lr" (runtime/staleness.py): PipeMare's rate at each ST, by the last microbatch backwarded
        self.staleness_lr = staleness_lr
        self.last_backward = -1

    def begin(self, first_microbatch: int) -> None:
        """A run of the schedule starts at ``first_microbatch`` (its targets are posted in order from there)."""
        sent = self.target_check if self.local_targets else None
        for stage, attr in ((-1, "_targets"), (0, "_target_sends")):
            reps = self.program.stages[stage].ranks
            if self.rank in reps:
                j = reps.index(self.rank)
                first = first_microbatch + (j - first_microbatch) % len(reps)
                setattr(self, attr, TargetPosts(first, len(reps), sent, self.target_window))

    @property
    def losses(self) -> list[float]:
        """The last stage's loss of every microbatch so far (reading them waits for the device)."""
        if self._pending_losses:
            self._losses.extend(torch.stack(self._pending_losses).tolist())
            self._pending_losses = []
        return self._losses

    # peers -----------------------------------------------------------------------------------
    def peer(self, stage: int, microbatch: int) -> int:
        ranks = self.program.stages[stage].ranks
        return ranks[microbatch % len(ranks)]

    # actions ---------------------------------------------------------------------------------
    def run(self, actions: Sequence[Action], release: Sequence[Sequence[Action]] | None = None,
            posts: Sequence[Sequence[Action]] | None = None) -> None:
        """Run ``actions`` in order. ``posts[i]``: the receives (``RF``/``RB`` actions, usually later
        ones) to post before ``actions[i]`` (:func:`~pdcompile.runtime.transfers.transfer_plan`);
        without it each ``RF``/``RB`` posts its own receive. ``release[i]``: the earlier actions whose
        sends are taken by their receivers once ``actions[i]`` is done
        (:func:`~pdcompile.runtime.schedules.send_release`); they are waited for then (it returns at
        once), the others by :meth:`wait_sends`. With a recorder, each action is recorded as ``(name,
        start, end)``; when a forward or backward first waits for its received tensors, the wait is
        recorded as the receive (``1RF3``/``1RB3``) and the action from the end of the wait, so a
        trace shows compute and waiting apart."""
        actions = list(actions)
        self.prepare(actions)
        for i, a in enumerate(actions):
            self.execute(a, posts[i] if posts is not None else (), release[i] if release is not None else ())

    def prepare(self, actions: Sequence[Action]) -> None:
        """Read the actions about to run: which of this stage's backwards are split (a ``W`` follows)."""
        self._split = {a.mb for a in actions if a.kind is Kind.WEIGHT_GRAD and a.stage == self.stage}
        if self.sharded is not None:  # FSDP2's hooks reduce in the backward: B does it all, W nothing
            self._split = set()
            self.sharded.prepare(actions, self.stage)

    def execute(self, a: Action, posts: Sequence[Action] = (), release: Sequence[Action] = ()) -> None:
        """One action of :meth:`run`, with the receives posted before it and the sends released after it."""
        self._compute_start = None
        try:
            if posts:
                self.post_receives(posts)
            start = self.clock()
            if self.fail_at is not None and self.fail_at == f"{self.rank}:{a}":
                raise RuntimeError("injected failure (--fail-at)")
            getattr(self, "_" + a.kind.name.lower())(a)
            if release:
                self.release_sends(release)
            self.weights.observe()
        except ActionError:
            raise
        except Exception as e:  # noqa: BLE001 - name rank, stage and action, keep the cause
            raise ActionError(f"rank {self.rank} (stage {self.stage}) failed in action {a}: "
                              f"{type(e).__name__}: {e}") from e
        if self.recorder is not None:
            self.recorder(str(a), self._compute_start or start, self.clock())

    def post_receives(self, receives: Sequence[Action]) -> None:
        """Post receives ahead of their ``RF``/``RB`` (which then find them posted), so their data can
        land while this rank computes: gloo receives only into posted buffers, and on NCCL a pair's
        transfers run in the order posted, which the plan makes the same on both sides."""
        for b in receives:
            t0 = self.clock()
            (self._recv_act if b.kind is Kind.RECV_ACT else self._recv_grad)(b)
            if self.recorder is not None:
                self.recorder(str(b), t0, self.clock())

    def _wait(self, pending: comm.Pending | _Handed, a: Action, kind: str) -> list[torch.Tensor]:
        """Wait for a receive inside ``a``; record the wait as the receive (see :meth:`run`)."""
        t0 = self.clock()
        tensors = pending.wait()
        if self.recorder is not None:
            self._compute_start = self.clock()
            self.recorder(f"{a.stage}{kind}{a.mb}", t0, self._compute_start)
        return tensors

    def _send(self, a: Action, tensors: list[torch.Tensor], dst: int, key: tuple[Any, ...]) -> None:
        """Send for action ``a``: over the network, or into the mailbox when ``dst`` is this rank."""
        if dst == self.rank:
            self.mailbox.put(key, tensors)
        else:
            self._posted(a, comm.post_send(tensors, dst))

    def _recv(self, buffers: list[torch.Tensor], src: int, key: tuple[Any, ...]) -> comm.Pending | _Handed:
        """Post a receive: over the network, or from the mailbox when ``src`` is this rank."""
        if src == self.rank:
            return _Handed(self.mailbox, key)
        return comm.post_recv(buffers, src)

    def _data(self, k: int) -> tuple[Sequence[torch.Tensor], torch.Tensor]:
        if self.data is None:
            raise RuntimeError(f"rank {self.rank} reads no data, but its schedule needs microbatch {k}'s")
        return self.data(k)

    def _loss(self, out: Any, target: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is None:
            raise RuntimeError(f"rank {self.rank} runs the last stage without a loss function")
        return self.loss_fn(out, target)

    def _mb(self, k: int) -> _Mb:
        return self.mbs.setdefault(k, _Mb())

    def _recv_act(self, a: Action) -> None:
        st = self._mb(a.mb)
        if st.recv_act is not None:
            return  # posted ahead (run's posts)
        owner = self.targets_by
        if owner is not None:  # the targets up to this microbatch first, in the order the first stage sends them
            for k in owner._targets.upto(a.mb):
                owner._mb(k).recv_target = owner._recv([self.program.target.empty(self.device)], self.peer(0, k),
                                                       ("T", k))
        bufs = [t.empty_wire(self.precision, self.device) for t in self.spec.inputs] + \
            [self.program.stages[0].inputs[j].empty(self.device) for j in self.relay_in]
        st.recv_act = self._recv(bufs, self.peer(self.stage - 1, a.mb), ("A", self.stage, a.mb))

    def _forward(self, a: Action) -> None:
        k = a.mb
        st = self._mb(k)
        if self.is_first:
            inputs, target = self._data(k)
            st.inputs = [x.to(self.device, non_blocking=True) for x in inputs]
            st.relayed = {j: st.inputs[j] for j in self.relay_out}
            target = target.to(self.device, non_blocking=True)
            self.meter.data([*st.inputs, target])
            if self.is_last:
                st.target = target
            elif self.target_window > 1:  # the step's targets at its first F (each released with its own F)
                for j in self._target_sends.upto(k):
                    t = target if j == k else self._data(j)[1].to(self.device, non_blocking=True)
                    self._send(Action(0, Kind.FORWARD, j), [t], self.peer(self.program.num_stages - 1, j), ("T", j))
            elif not self.local_targets or k in self.target_check:  # before the activations (SF k)
                self._send(a, [target], self.peer(self.program.num_stages - 1, k), ("T", k))
        else:
            if st.recv_act is None:
                raise RuntimeError(f"forward of microbatch {k} before its activations were received (missing RF)")
            received = self._wait(st.recv_act, a, "RF")
            n = len(self.spec.inputs)
            st.inputs = [t.to(spec.dtype) for t, spec in zip(received[:n], self.spec.inputs)]
            for t, spec in zip(st.inputs, self.spec.inputs):
                t.requires_grad_(spec.requires_grad)
            st.relayed = dict(zip(self.relay_in, received[n:]))  # after the activations (--targets send)
            if self.spec.data:  # the model inputs it reads: forward's last arguments
                st.inputs += self._data_inputs(k, st)
        params = self.weights.params_for_forward(k)
        handles: list[Any] = []
        if self.recompute:
            self._split.discard(k)  # its graph is rebuilt inside B: B is not split into B and W
            if self.meter.enabled and not self.meter.recompute_bytes:
                self._probe_recompute(k, st.inputs, params)
        if k in self._split and self._split_route(params, st.inputs).walks_whole_graph:
            self._split.discard(k)  # its W would walk the whole graph again (WeightPass): B runs whole, W nothing
        if self.fused is not None:  # split: off for the traced graph's backward, B records and W adds for the submodules'
            self.fused.active = k not in self._split
            self.fused.deferred = None
        if k in self._split:  # W follows: note what the weight pass needs
            route = self._split_route(params, st.inputs)
            handles, notes = route.capture()
            self._notes[k] = (route, notes)
            if self.fused is not None and not isinstance(route, GraphSplit):
                self.fused.active = True
                self._deferred[k] = self.fused.defer()
        try:
            kept: list[torch.Tensor] = []  # beyond autograd's saved tensors: the selective cache
            with self.meter.saving(k, params.values() if params else ()), self._autocast():
                if self.recomputer is not None:
                    out, kept = self.recomputer.forward(self._run_stage, params, st.inputs,
                                                        lambda: self._measure(rebuilding=True))
                elif isinstance(self._notes.get(k, (None,))[0], GraphSplit):  # through the traced graph
                    route, notes = self._notes[k]
                    out = route.forward(notes, st.inputs)
                else:
                    out = self._run_stage(params, *st.inputs)
        finally:
            for h in handles:
                h.remove()
        self.meter.add(k, kept)
        if self.is_last:
            if st.target is None and self.local_targets:
                st.target = self._local_target(k, st)
            if st.target is None:
                if st.recv_target is None:
                    raise RuntimeError(f"forward of microbatch {k} before its target's receive was posted")
                st.target = st.recv_target.wait()[0]
            with self.meter.saving(k), self._autocast():  # what the loss saves counts with the microbatch
                loss = self._loss(out, st.target)
            self._pending_losses.append(loss.detach())
            self.loss_microbatches.append(k)
            st.loss = loss / self.accumulation
            st.outputs = []
        else:
            st.outputs = list(out)
        self.meter.add(k, [*st.inputs, *st.outputs])
        self._measure()

    def _split_route(self, params: dict[str, torch.Tensor] | None,
                     inputs: Sequence[torch.Tensor]) -> WeightPass | GraphSplit:
        """What splits a microbatch's backward: the graph (``weight_pass="graph"``, where it applies:
        :func:`~pdcompile.runtime.graph_split.graph_route`), else the submodules' weight pass."""
        if self.weight_pass != "graph":
            return self._wpass
        if self._graph is None:
            self._graph = graph_route(self.module, self.spec.args, self.device, precision=self.precision,
                                      stage=self.stage)
            if self._graph is None:
                self.weight_pass = "submodules"
                return self._wpass
        assert self._graph is not None
        if params is not None or not self._graph.fits(inputs):
            if not self._graph_skipped:
                self._graph_skipped = True
                log.info("stage %d: a split backward by submodules (WeightPass), not the graph: %s", self.stage,
                         "its forward uses a stashed weight version" if params is not None
                         else "its inputs are not shaped as the traced ones")
            return self._wpass
        return self._graph

    def _autocast(self) -> torch.autocast:
        """Autocast to bf16 under ``precision="bf16"`` (a no-op context otherwise)."""
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def _run_stage(self, params: dict[str, torch.Tensor] | None, *inputs: torch.Tensor) -> Any:
        if params is None:
            return self.module(*inputs)
        return torch.func.functional_call(self.module, params, tuple(inputs))

    def _probe_recompute(self, k: int, inputs: Sequence[torch.Tensor], params: dict[str, torch.Tensor] | None) -> None:
        """Measure once what a backward with recomputation rebuilds: one forward's saved tensors of the
        part it reruns (the stage, or partial's head), less what selective caches (the random state and
        the buffers are restored, so training is unchanged)."""
        assert self.recomputer is not None
        buffers = {n: b.clone() for n, b in self.module.named_buffers()}
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            with self.meter.saving(-1, params.values() if params else ()) as probe, self._autocast():
                cached = self.recomputer.probe(self._run_stage, params, inputs)
            self.meter.recompute_bytes = sum(n for p, n in span_bytes([probe]).items() if p not in cached)
        self.meter.activations.pop(-1, None)
        with torch.no_grad():
            for n, b in self.module.named_buffers():
                b.copy_(buffers[n])

    def _measure(self, rebuilding: bool = False) -> None:
        """A measuring point of the stage's memory (:class:`~pdcompile.runtime.memory.MemoryMeter`)."""
        live = [j for j, m in self.mbs.items() if m.outputs or m.loss is not None]
        posted = [t for m in self.mbs.values() for p in (m.recv_grad, None if m.inputs else m.recv_act)
                  if p is not None for t in p.tensors]
        self.meter.measure(live, posted, self.weights.live_versions(), rebuilding)

    def _local_target(self, k: int, st: _Mb) -> torch.Tensor:
        """Microbatch ``k``'s target from this rank's copy of the data. Those in ``target_check`` are
        also received from the first stage and compared: a data source that gives ranks different
        minibatches would otherwise train on wrong targets, silently."""
        _, target = self._data(k)
        target = target.to(self.device, non_blocking=True)
        if k in self.target_check:
            sent = st.recv_target.wait()[0]  # type: ignore[union-attr]  # posted for every checked microbatch
            if sent.shape != target.shape or not torch.equal(sent, target):
                raise RuntimeError(
                    f"--targets local: the target of microbatch {k} read here differs from the one the first stage "
                    f"read: the data source does not give every rank the same minibatches (unseeded shuffling?). "
                    f"Seed it, or run with --targets send")
        return target

    def _data_inputs(self, k: int, st: _Mb) -> list[torch.Tensor]:
        """Microbatch ``k``'s model inputs this (later) stage reads: from its own copy of the data, or as
        relayed to it from stage 0 (``relay_in``)."""
        if self.local_data:
            inputs = self._data(k)[0]
            return [inputs[j].to(self.device, non_blocking=True) for j, _ in self.spec.data]
        return [st.relayed[j] for j, _ in self.spec.data]

    def _send_act(self, a: Action) -> None:
        st = self.mbs[a.mb]
        outs = [o.detach().to(spec.wire(self.precision)) for o, spec in zip(st.outputs, self.spec.outputs)]
        outs += [st.relayed[j] for j in self.relay_out]  # model inputs later stages read (--targets send)
        st.relayed = {}
        self._send(a, outs, self.peer(self.stage + 1, a.mb), ("A", self.stage + 1, a.mb))

    def _recv_grad(self, a: Action) -> None:
        st = self._mb(a.mb)
        if st.recv_grad is not None:
            return  # posted ahead (run's posts)
        bufs = [t.empty_wire(self.precision, self.device) for t in self.spec.outputs if t.requires_grad]
        st.recv_grad = self._recv(bufs, self.peer(self.stage + 1, a.mb), ("G", self.stage, a.mb))

    def _backward(self, a: Action) -> None:
        st = self.mbs[a.mb]
        if self.is_last:
            roots: list[torch.Tensor] = [st.loss]  # type: ignore[list-item]  # the last stage set the loss in its forward
            seeds: list[torch.Tensor] | None = None
        else:
            if st.recv_grad is None:
                raise RuntimeError(f"backward of microbatch {a.mb} before its gradients were received (missing RB)")
            grads = self._wait(st.recv_grad, a, "RB")
            outs = [o for o, spec in zip(st.outputs, self.spec.outputs) if spec.requires_grad]
            pairs = [(o, g.to(o.dtype)) for o, g in zip(outs, grads) if o.requires_grad]
            roots, seeds = [o for o, _ in pairs], [g for _, g in pairs]
        ins = [t for t, spec in zip(st.inputs, self.spec.inputs) if spec.requires_grad]
        route, notes = self._notes.pop(a.mb, (self._wpass, {}))
        if a.mb in self._split and roots:
            # input gradients only, for SB to send now (on stage 0, none: the activations' gradients
            # down to its first layer); what W's weight gradients need stays
            st.input_grads, work = route.input_grads(roots, seeds, ins, notes)
            self.split_counts["graph" if isinstance(route, GraphSplit) else "submodules"] += 1
            self._weight_pass[a.mb] = (route, work)
        elif roots:
            if self.sharded is not None:
                self.sharded.before_backward(a.mb)
            torch.autograd.backward(roots, seeds)
        st.outputs, st.loss = [], None  # free the graph (and the weight version it holds)
        if self.sharded is not None:  # full: the gathered copy and unsharded gradients, before the reduce-scatter
            self._measure()
        self.weights.after_backward(a.mb)
        self.last_backward = max(self.last_backward, a.mb)
        if self.is_first:
            self.mbs.pop(a.mb, None)

    def _send_grad(self, a: Action) -> None:
        st = self.mbs.pop(a.mb)
        grads = st.input_grads if st.input_grads is not None else \
            [(t.grad if t.grad is not None else torch.zeros_like(t))
             for t, spec in zip(st.inputs, self.spec.inputs) if spec.requires_grad]
        wires = [spec.wire(self.precision) for spec in self.spec.inputs if spec.requires_grad]
        grads = [g.to(w) for g, w in zip(grads, wires)]
        self._send(a, grads, self.peer(self.stage - 1, a.mb), ("G", self.stage - 1, a.mb))

    def _weight_grad(self, a: Action) -> None:
        """``W``: the weight gradients of a split ``B``, accumulated into ``.grad`` as an unsplit
        backward would (:class:`~pdcompile.runtime.weight_grads.WeightPass`, or the graph's ``W``:
        :class:`~pdcompile.runtime.graph_split.GraphSplit`); then what it held is freed."""
        held = self._weight_pass.pop(a.mb, None)
        deferred = self._deferred.pop(a.mb, None)
        if held is not None:  # None: the B was not split (nothing needed a gradient)
            route, work = held
            if deferred is not None:  # the fused weight gradients its B recorded (runtime/fused_grads.py)
                FusedGrads.weight_pass(deferred)
            route.weight_grads(work)

    def _allreduce(self, a: Action) -> None:
        if self.replica_group is None:
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # a tensor-parallel stage's split gradients: each replica's shard, summed with its peers' of the same index
        allreduce_flat([local(p.grad) for p in params if p.grad is not None], self.replica_group)

    def tied_grads(self) -> list[tuple[Any, torch.Tensor, float]]:
        """(process group, gradient, the share this copy contributes) of each tied parameter of the
        stage, a zero gradient made where backward left none."""
        params = dict(self.module.named_parameters())
        out = []
        for group, names, *scale in self.tied_groups:
            for n in names:
                p = params[n]
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                out.append((group, p.grad, scale[0] if scale else 1.0))
        return out

    def _tied_grads(self, a: Action) -> None:
        for group, grad, share in self.tied_grads():
            if share != 1.0:
                grad.mul_(share)
            dist.all_reduce(local(grad), group=group)  # a weight split by vocabulary: its shard with the peer's

    def _weight_version(self, a: Action) -> None:
        self.weights.set_forward_version(a.wv)

    def _step(self, a: Action) -> None:
        self._measure()  # gradients of the whole update, and the optimizer state
        if self.clip_grad_norm is not None:
            self._clip()
        self.weights.before_step()
        if self.staleness_lr is not None:
            self.staleness_lr.step(self.optimizer, self.last_backward)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.weights.after_step()

    def _clip(self) -> None:
        """Scale every gradient by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` the global L2 norm over
        every stage's gradients (after AR and TG: each stage's once, each tied parameter once), as
        ``torch.nn.utils.clip_grad_norm_`` does in one process. Every rank calls it at each ST, in order:
        the k-th call of every rank is the k-th update of every stage, which in 1F1B and 2BW the ranks
        reach at different times (the gradient being applied, of the same microbatches on every stage;
        with weight stashing each taken at its own stashed version), so the all-reduce is where they meet."""
        grads = {n: p.grad for n, p in self.module.named_parameters() if p.grad is not None}
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.norm_counts:
            for n, g in grads.items():
                if n not in self.norm_skip:  # a full stage's DTensor: this replica's shard
                    sq = sq + torch.linalg.vector_norm(local(g), dtype=torch.float32) ** 2
        dist.all_reduce(sq, group=self.norm_group)
        norm = sq.sqrt()
        self.grad_norms.append(norm.detach())
        coef = torch.clamp(float(self.clip_grad_norm or 0.0) / (norm + 1e-6), max=1.0)
        for g in grads.values():
            local(g).mul_(coef.to(g.dtype))

    def _posted(self, a: Action, works: list[Any]) -> None:
        self.sends.setdefault(a, []).extend(works)
        self.peak_sends = max(self.peak_sends, sum(map(len, self.sends.values())))

    def release_sends(self, done: Sequence[Action]) -> None:
        """Wait for the sends of ``done``, whose receivers have taken them (the schedule proves it, so
        this returns at once). A send's buffer lives until its wait; on gloo nothing tells completion
        without waiting (``is_completed`` stays false), and waiting for a send whose receive is not
        posted yet blocks — possibly forever, if the peer posts it after a collective this rank is
        in — so sends are never waited for anywhere else but here and at the end."""
        for b in done:
            for w in self.sends.pop(b, ()):
                w.wait()

    def wait_sends(self) -> None:
        for works in self.sends.values():
            for w in works:
                w.wait()
        self.sends = {}


class RankExecutor:
    """A rank's executors, one per stage it holds (one, unless stages are virtual): runs the rank's
    action list, each action by its stage's executor; hand-overs between them stay in memory
    (:class:`Mailbox`)."""

    def __init__(self, executors: Sequence[StageExecutor]) -> None:
        self.executors = list(executors)
        self.by_stage = {ex.stage: ex for ex in self.executors}
        owner = next((ex for ex in self.executors if ex.is_last), None)
        for ex in self.executors:
            ex.targets_by = owner
        self._tied_seen = 0  # TG actions so far: the rank sums tied gradients at the first of each step's

    def run(self, actions: Sequence[Action], release: Sequence[Sequence[Action]] | None = None,
            posts: Sequence[Sequence[Action]] | None = None) -> None:
        """:meth:`StageExecutor.run` over the rank's stages: receives posted, and sends released,
        by the executor of their own stage."""
        actions = list(actions)
        for ex in self.executors:
            ex.prepare(actions)
        for i, a in enumerate(actions):
            for b in posts[i] if posts is not None else ():
                self.by_stage[b.stage].post_receives((b,))
            done = list(release[i]) if release is not None else []
            own = [b for b in done if b.stage == a.stage]  # released inside the action, as one stage does
            if a.kind is Kind.TIED_GRADS and len(self.executors) > 1:
                self._tied_grads(a)
                own = []
            else:
                self.by_stage[a.stage].execute(a, (), own)
            for b in done:
                if b not in own:
                    self.by_stage[b.stage].release_sends((b,))

    def begin(self, first_microbatch: int) -> None:
        for ex in self.executors:
            ex.begin(first_microbatch)

    def wait_sends(self) -> None:
        for ex in self.executors:
            ex.wait_sends()

    @property
    def losses(self) -> list[float]:
        """The last stage's losses (from the executor holding it; empty on other ranks)."""
        last = [ex for ex in self.executors if ex.is_last]
        return last[0].losses if last else []

    @property
    def loss_microbatches(self) -> list[int]:
        """The microbatch of each of :attr:`losses`, in the same order."""
        last = [ex for ex in self.executors if ex.is_last]
        return last[0].loss_microbatches if last else []

    @property
    def peak_sends(self) -> int:
        return sum(ex.peak_sends for ex in self.executors)

    def _tied_grads(self, a: Action) -> None:
        """``TG`` on a rank with several stages: each stage ends its step with ``TG ST`` (the tied
        schedules put the rank's updates together), so at the first ``TG`` of a step every stage's
        gradients are complete. Then, per group of tied parameters, the rank's copies (a rank may
        hold both ends of a tie) are summed here and all-reduced once over the group's ranks."""
        first = self._tied_seen % len(self.executors) == 0
        self._tied_seen += 1
        if not first:
            return
        ex0 = self.by_stage[a.stage]
        start = ex0.clock()
        try:
            groups: dict[int, tuple[Any, list[tuple[torch.Tensor, float]]]] = {}
            for ex in self.executors:
                for group, grad, share in ex.tied_grads():
                    groups.setdefault(id(group), (group, []))[1].append((grad, share))
            for group, grads in groups.values():
                total = grads[0][0] * grads[0][1]
                for grad, share in grads[1:]:
                    total = total + grad * share
                dist.all_reduce(total, group=group)
                for grad, _ in grads:
                    grad.copy_(total)
        except Exception as e:  # noqa: BLE001 - name rank and action, keep the cause
            raise ActionError(f"rank {self.executors[0].rank} failed in action {a}: {type(e).__name__}: {e}") from e
        if ex0.recorder is not None:  # traced as a stage's own TG is (the wait for the peers included)
            ex0.recorder(str(a), start, ex0.clock())
