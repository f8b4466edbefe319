"""Activation recomputation of one stage, in the mode plan.json names: none, full, selective, partial.

* ``full``: the stage's forward runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``;
  a microbatch in flight keeps its inputs and outputs only, its backward reruns the whole forward.
* ``selective`` (Korthikanti et al., 2022): the same checkpoint with a selective-checkpoint policy
  (:func:`selective_policy`): the outputs of the ops that multiply by weights (:func:`kept`: those
  ``torch.utils.flop_counter`` counts FLOPs for, mm, addmm, convolution, but not core attention's
  bmm and attention kernels) are cached (MUST_SAVE); every other op (core attention, activations,
  softmax, dropout, norms, views) is rebuilt at backward (PREFER_RECOMPUTE); random ops replay the
  same masks (checkpoint's preserved RNG state).
* ``partial``: the stage's first K compute nodes (:func:`compute_nodes`, in graph order; plan.json's
  ``recompute_nodes``) run under checkpoint as a *head* GraphModule, the rest as a *tail* that saves
  its activations as usual (:func:`split_stage`); backward rebuilds only the head's activations.

The runtime has only the emitted stage module (its forward printed by torch.fx): :func:`stage_graph`
traces it back (every submodule a leaf, as the compiler kept them), and plan.json's
``graph_signature`` (:func:`graph_signature`, written by the compiler from its own stage graph) must
match the traced graph's, or the stage is refused (:class:`RecomputeError`). Head and tail are built
with ``GraphModule(root=stage_module, ...)``: they share the stage's parameters under the same names,
so ``torch.func.functional_call`` runs them with a microbatch's weight version (weight stashing).

Only the standard library and torch here (torch.fx is torch): emitted programs import this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry

from pdcompile.runtime.memory import plain_tensor

MODES = ("none", "full", "selective", "partial")
COMPUTE_OPS = ("call_module", "call_function", "call_method")


class RecomputeError(RuntimeError):
    """plan.json's recomputation entry of a stage does not fit the stage module (names stage and fix)."""


# -- the stage graph and its compute nodes ---------------------------------------------------------


def compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes of ``graph`` that compute, in graph order: ``call_module`` nodes, and the
    ``call_function``/``call_method`` nodes that read (through earlier nodes) a stage input, a
    parameter or a buffer. Not counted: placeholders, ``get_attr``, the output, and computations of
    constants alone (an exported graph's ``arange``), which ``symbolic_trace`` of the emitted stage runs
    once while tracing and keeps as constants. plan.json's ``recompute_nodes: K`` names the first K."""
    live: set[fx.Node] = set()
    out = []
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            live.add(n)
        elif n.op == "call_module" or (n.op in COMPUTE_OPS and any(a in live for a in n.all_input_nodes)):
            live.add(n)
            out.append(n)
    return out


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t  # a submodule's (flat) name, or a method's name
    try:
        return fx.node._get_qualified_name(t)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a callable fx can't name: its module and name
        return f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', repr(t))}"


def graph_signature(graph: fx.Graph) -> str:
    """A short stable hash (16 hex digits) of the (op, target) sequence of ``graph``'s compute nodes:
    the compiler writes it beside ``recompute_nodes``; the runtime checks its own traced graph has it."""
    text = "\n".join(f"{n.op} {_target_name(n)}" for n in compute_nodes(graph))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _LeafTracer(fx.Tracer):
    """Every submodule of the stage is a leaf: the stage's forward calls only the leaves the compiler kept."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return True


def stage_graph(module: torch.nn.Module) -> fx.GraphModule:
    """The emitted stage module's fx graph, traced back (``symbolic_trace`` with every submodule a leaf)."""
    if isinstance(module, fx.GraphModule):
        return module
    graph = _LeafTracer().trace(module)
    return fx.GraphModule(module, graph, type(module).__name__)


# -- partial: head and tail ------------------------------------------------------------------------


@dataclass(frozen=True)
class PartialSplit:
    """A stage split after its first ``k`` compute nodes. ``head(*stage inputs)`` returns the tuple of
    head values the tail or the stage output uses; ``tail(*args)`` takes, in order, the stage inputs
    numbered ``tail_inputs`` and then the head's outputs, and returns what the stage returns."""

    k: int
    head: fx.GraphModule
    tail: fx.GraphModule
    tail_inputs: tuple[int, ...]  # positions of the stage inputs the tail reads
    # each half's parameter and buffer names -> the stage's name of the same tensor (a tied parameter has
    # one name in the stage's parameter dict, maybe another in a half)
    head_names: tuple[tuple[str, str], ...] = ()
    tail_names: tuple[tuple[str, str], ...] = ()

    def run(self, *inputs: Any) -> Any:
        """Head then tail, in this process (what the stage computes)."""
        mid = self.head(*inputs)
        return self.tail(*[inputs[i] for i in self.tail_inputs], *mid)


def split_stage(module: torch.nn.Module, k: int, gm: fx.GraphModule | None = None) -> PartialSplit:
    """``module``'s traced graph (``gm``, else :func:`stage_graph`) cut after its first ``k`` compute
    nodes (``1 <= k <`` their number). Both halves are ``GraphModule(root=module, ...)``: the same
    submodules and parameters, under the same qualified names."""
    gm = gm if gm is not None else stage_graph(module)
    comp = compute_nodes(gm.graph)
    if not 1 <= k < len(comp):
        raise RecomputeError(f"partial recomputation of the first {k} compute nodes: the stage has {len(comp)}; "
                             f"recompute_nodes must be in 1..{len(comp) - 1} (or use recompute 'full')")
    in_head = set(comp[:k])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # head values read after the head: by a tail node or by the output
    crossing = list(dict.fromkeys(a for n in gm.graph.nodes if n not in in_head
                                  for a in n.all_input_nodes if a in in_head))
    used_inputs = [p for p in placeholders if any(u not in in_head for u in p.users)]

    # the head: the stage's nodes up to its k-th compute node, but the constants (get_attr, computations
    # of constants alone) are copied into both halves, and dropped below where a half does not read them
    computing = set(comp)
    head = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n in in_head or (n.op != "output" and n not in computing):
            env[n] = head.node_copy(n, lambda a: env[a])
        if n is comp[k - 1]:
            break
    head.output(tuple(env[n] for n in crossing))
    tail = fx.Graph()
    tenv: dict[fx.Node, fx.Node] = {}
    for p in used_inputs:
        tenv[p] = tail.node_copy(p, lambda a: tenv[a])
    for n in crossing:
        tenv[n] = tail.placeholder(f"head_{n.name}")
    for n in gm.graph.nodes:
        if n.op != "placeholder" and n not in in_head:
            tenv[n] = tail.node_copy(n, lambda a: tenv[a])
    for g in (head, tail):
        computes = set(compute_nodes(g))
        for n in reversed(list(g.nodes)):  # constants this half does not read
            if n.op not in ("placeholder", "output") and not n.users and n not in computes:
                g.erase_node(n)
        g.lint()
    halves = (fx.GraphModule(module, head, f"{type(module).__name__}Head"),
              fx.GraphModule(module, tail, f"{type(module).__name__}Tail"))
    return PartialSplit(k, *halves, tuple(placeholders.index(p) for p in used_inputs),
                        *(_stage_names(module, h) for h in halves))


def _tensors(m: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from m.named_parameters(remove_duplicate=False)
    yield from m.named_buffers(remove_duplicate=False)


def _stage_names(stage: torch.nn.Module, half: torch.nn.Module) -> tuple[tuple[str, str], ...]:
    """(name in ``half``, the stage's first name of the same tensor) for every parameter and buffer of ``half``."""
    first: dict[int, str] = {}
    for n, t in _tensors(stage):
        first.setdefault(id(t), n)
    return tuple((n, first[id(t)]) for n, t in _tensors(half) if id(t) in first)


# -- selective: what is cached --------------------------------------------------------------------


def flop_counted(func: Any) -> bool:
    """Whether ``torch.utils.flop_counter`` counts FLOPs for the aten op ``func`` (an OpOverload)."""
    return getattr(func, "overloadpacket", func) in flop_registry


def kept(func: Any) -> bool:
    """Whether selective recomputation keeps the outputs of the aten op ``func``: the FLOP-counted ops
    that multiply by weights (mm, addmm, convolution: a Linear's or a conv's), not the batched
    matmuls and attention kernels of core attention (bmm, baddbmm, scaled-dot-product attention:
    activations by activations, sequence-squared sized, cheap per byte), which Korthikanti et al.
    rebuild with softmax and dropout."""
    if not flop_counted(func):
        return False
    name = str(getattr(func, "overloadpacket", func))
    return "bmm" not in name and "attention" not in name


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective recomputation: keep the outputs of the :func:`kept` ops, rebuild everything else."""
    return CheckpointPolicy.MUST_SAVE if kept(func) else CheckpointPolicy.PREFER_RECOMPUTE


class _SelectiveContexts:
    """``context_fn`` for one checkpointed forward; keeps the caching mode so that what it cached can
    be read (:meth:`cached`: the tensors a microbatch in flight keeps)."""

    def __init__(self) -> None:
        self.caching: Any = None

    def __call__(self) -> tuple[Any, Any]:
        fwd, rec = create_selective_checkpoint_contexts(selective_policy)
        if self.caching is None:  # the forward's; a rebuild makes new ones
            self.caching = fwd
        return fwd, rec

    def cached(self) -> list[torch.Tensor]:
        if self.caching is None:
            return []
        out: list[torch.Tensor] = []
        for per_call in self.caching.storage.values():
            for entry in per_call.values():
                leaves, _ = tree_flatten(entry)
                out += [w.val for w in leaves if isinstance(getattr(w, "val", None), torch.Tensor)]
        return out


class FlopOutputs(TorchDispatchMode):
    """Records the output tensors of the :func:`kept` ops run inside it (what selective caches);
    ``by_op`` as well notes every op's new output storages, FLOP-counted or not, in ``new_bytes``."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []
        self.seen: set[int] = set()
        self.new_bytes = {True: 0, False: 0}  # FLOP-counted or not -> bytes of the storages its ops made

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        flop = kept(func)
        # a DTensor (tensor parallelism) holds no storage of its own: its local tensor's
        ins = {plain_tensor(t).untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            if flop:
                self.outputs.append(t)
            st = plain_tensor(t).untyped_storage()
            ptr = st.data_ptr()
            if ptr not in ins and ptr not in self.seen:
                self.seen.add(ptr)
                self.new_bytes[flop] += st.nbytes()
        return out


# -- a stage's recomputation ----------------------------------------------------------------------

RunStage = Callable[..., Any]  # (params or None, *inputs) -> the stage's output


class StageRecompute:
    """How a stage recomputes (``mode`` of :data:`MODES` but ``"none"``): :meth:`forward` runs a
    microbatch's forward under it; :meth:`probe` names what a backward's rebuild brings back."""

    def __init__(self, mode: str, module: torch.nn.Module, split: PartialSplit | None = None) -> None:
        self.mode = mode
        self.module = module
        self.split = split

    @staticmethod
    def from_plan(entry: dict[str, Any], module: torch.nn.Module, stage: int) -> "StageRecompute | None":
        """The stage's plan.json entry read against its module (None: no recomputation). A partial
        entry's ``graph_signature`` must be the traced module's, else :class:`RecomputeError`."""
        mode = str(entry.get("recompute", "none"))
        if mode not in MODES:
            raise RecomputeError(f"stage {stage}: plan.json says recompute {mode!r}; use one of {', '.join(MODES)}")
        if mode == "none":
            return None
        if mode != "partial":
            return StageRecompute(mode, module)
        k, want = entry.get("recompute_nodes"), entry.get("graph_signature")
        if not isinstance(k, int) or k < 1 or not want:
            raise RecomputeError(f"stage {stage}: recompute 'partial' needs 'recompute_nodes' (an int >= 1) and "
                                 f"'graph_signature' in plan.json (got {k!r}, {want!r}); compile the program again")
        gm = stage_graph(module)
        got = graph_signature(gm.graph)
        if got != want:
            raise RecomputeError(
                f"stage {stage}: plan.json's graph_signature {want} is not that of the stage module's traced graph "
                f"({got}): its first {k} compute nodes would not be the ones the compiler chose. The stage file was "
                f"edited or comes from another compile; compile the program again (or set recompute 'full')")
        return StageRecompute(mode, module, split_stage(module, k, gm))

    def forward(self, run_stage: RunStage, params: dict[str, torch.Tensor] | None, inputs: Sequence[torch.Tensor],
                on_rebuild: Callable[[], None]) -> tuple[Any, list[torch.Tensor]]:
        """One microbatch's forward; returns (the stage's output, tensors the microbatch keeps beyond
        what autograd saves outside the checkpoint: the selective cache). ``on_rebuild`` is called when
        the backward starts rebuilding (a measuring point)."""
        calls = [0]

        def rebuilt(fn: RunStage) -> RunStage:
            def run(p: dict[str, torch.Tensor] | None, *xs: torch.Tensor) -> Any:
                calls[0] += 1
                if calls[0] == 1:
                    return fn(p, *xs)
                # a rebuild is not a forward: buffers it updates (BatchNorm's running statistics,
                # its batch count) get back the values the microbatch's own forward left
                with _disable_current_modes():  # outside selective's caching mode: not ops of the stage (the
                    on_rebuild()  # measure reads a DTensor gradient's local tensor: an op selective would count)
                    kept = {n: b.clone() for n, b in self.module.named_buffers()}
                try:  # (checkpoint may stop a rebuild early, by an exception, once it has what it needs)
                    return fn(p, *xs)
                finally:
                    with _disable_current_modes(), torch.no_grad():
                        for n, b in self.module.named_buffers():
                            b.copy_(kept[n])
            return run

        if self.mode == "full":
            return torch.utils.checkpoint.checkpoint(rebuilt(run_stage), params, *inputs, use_reentrant=False), []
        if self.mode == "selective":
            ctx = _SelectiveContexts()
            out = torch.utils.checkpoint.checkpoint(rebuilt(run_stage), params, *inputs, use_reentrant=False,
                                                    context_fn=ctx)
            return out, ctx.cached()
        assert self.split is not None
        split = self.split
        mid = torch.utils.checkpoint.checkpoint(rebuilt(lambda p, *xs: _call(split.head, split.head_names, p, xs)),
                                                params, *inputs, use_reentrant=False)
        tail_args = (*[inputs[i] for i in split.tail_inputs], *mid)
        return _call(split.tail, split.tail_names, params, tail_args), []

    def probe(self, run_stage: RunStage, params: dict[str, torch.Tensor] | None,
              inputs: Sequence[torch.Tensor]) -> set[int]:
        """Run, without checkpoint, the part of the forward a backward rebuilds (the stage, or its
        head): autograd's saved tensors in it are what the rebuild makes, but the storages returned
        (selective: the cached outputs of the FLOP-counted ops, not rebuilt)."""
        if self.mode == "partial":
            assert self.split is not None
            _call(self.split.head, self.split.head_names, params, tuple(inputs))
            return set()
        if self.mode == "selective":
            with FlopOutputs() as rec:
                run_stage(params, *inputs)
            return {plain_tensor(t).untyped_storage().data_ptr() for t in rec.outputs}
        run_stage(params, *inputs)
        return set()


def _call(gm: fx.GraphModule, names: Sequence[tuple[str, str]], params: dict[str, torch.Tensor] | None,
          args: Sequence[Any]) -> Any:
    """``gm(*args)``, with ``params`` (the stage's names: a weight version) in place of its own tensors."""
    if params is None:
        return gm(*args)
    return torch.func.functional_call(gm, {n: params[s] for n, s in names if s in params}, tuple(args))
