"""The split backward at the graph level: a stage's backward graph cut into ``I`` and ``W``.

:class:`~pdcompile.runtime.weight_grads.WeightPass` splits at run time (walks of autograd's graph),
which costs more than an unsplit backward. :class:`GraphSplit` instead traces the stage once with
aot_autograd into a forward and a backward graph and cuts the backward graph's nodes in two: ``I``,
every ancestor of the input gradients, and ``W``, the rest the weight gradients need (with the
intermediates of ``I`` it uses handed over). A node that computes both kinds at once under an
``output_mask`` (``convolution_backward``, ``native_layer_norm_backward``) is made two nodes
first, one per half of the mask. Every node runs once, as in the unsplit backward, on the same
tensors: the gradients are the same bits. The first use checks that on example inputs
(:func:`graph_route` falls back to ``WeightPass`` where it is not so, or the route does not apply).
Buffers a forward writes (BatchNorm's running statistics) are returned by the forward graph and
written back, as the eager forward writes them.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from pdcompile.runtime.weight_grads import bitwise_check, same_grads

log = logging.getLogger("pdcompile.runtime")


class Unsupported(Exception):
    """The graph route does not apply to this stage; the message says why."""


@dataclass
class Record:
    """What a microbatch's forward through the graph leaves for its split backward."""

    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    node: Any = None  # the forward's autograd node (its saved tensors)


class _Stage(torch.autograd.Function):
    """The stage as one autograd node: forward runs the forward graph and saves what it returns for
    backward (saved-tensor hooks see them); backward runs ``I`` then ``W`` (an unsplit ``B`` through
    autograd, which accumulates into the parameters)."""

    @staticmethod
    def forward(ctx: Any, gs: GraphSplit, record: Record, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = gs.fw(*args)
        k = len(gs.written)  # the forward graph returns the written buffers' new values first
        new, user, saved = outs[:k], outs[k:k + gs.n_out], outs[k + gs.n_out:]
        for j, value in zip(gs.written, new):  # BatchNorm's running statistics, as eager writes them
            gs.buffers[j].copy_(value)
        ctx.gs = gs
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*[o for o, d in zip(user, gs.differentiable) if not d])
        record.node = ctx
        return tuple(user)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        gs: GraphSplit = ctx.gs
        tangents = gs.as_traced([g for g, d in zip(grads, gs.differentiable) if d])
        dinputs, work = gs.run_i([*ctx.saved_tensors, *tangents])
        out: list[Any] = [None] * gs.n_args
        for j, g in gs.grads_of(work).items():
            out[j] = g
        for j, g in zip(gs.input_slots, dinputs):
            out[gs.n_args - gs.n_inputs + j] = g
        return (None, None, *out)


def _split_masked(bw: fx.GraphModule, input_grads: list[fx.Node]) -> int:
    """Rewrite each node computing input and weight gradients together under an ``output_mask``
    into one node per half (the input's, the rest), where the rest is not needed for the input
    gradients. Returns how many were split."""
    needed = _ancestors(input_grads)
    count = 0
    for n in list(bw.graph.nodes):
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or schema.arguments[-1].name != "output_mask":
            continue
        mask = list(n.args[-1])
        rest = [u for u in n.users if u.target is operator.getitem and u.args[1] != 0]
        if not mask[0] or not any(mask[1:]) or n not in needed or any(u in needed for u in rest):
            continue
        with bw.graph.inserting_after(n):
            w = bw.graph.call_function(n.target, (*n.args[:-1], [False, *mask[1:]]), dict(n.kwargs))
        w.meta = dict(n.meta)
        n.args = (*n.args[:-1], [True] + [False] * (len(mask) - 1))
        for u in rest:
            u.replace_input_with(n, w)
        count += 1
    bw.recompile()
    return count


def _ancestors(nodes: Sequence[Any], stop: Sequence[fx.Node] = ()) -> set[fx.Node]:
    """``nodes`` and what they are computed from, not looking past ``stop``."""
    seen: set[fx.Node] = set()
    ends = set(stop)
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            if n not in ends:
                stack.extend(n.all_input_nodes)
    return seen


def _cut(bw: fx.GraphModule, given: list[fx.Node], outputs: list[Any]) -> fx.GraphModule:
    """The part of ``bw`` computing ``outputs`` from ``given`` (placeholders or handed-over nodes)."""
    g = fx.Graph()
    env = {n: g.placeholder(n.name) for n in given}
    needed = _ancestors(outputs, given)
    for n in bw.graph.nodes:
        if n in needed and n not in env and n.op not in ("placeholder", "output"):
            env[n] = g.node_copy(n, env.__getitem__)
    g.output([env[o] if isinstance(o, fx.Node) else o for o in outputs])
    return fx.GraphModule(bw, g)


class GraphSplit:
    """One stage's forward and backward graphs, the backward cut into ``I`` and ``W``; the interface
    of :class:`~pdcompile.runtime.weight_grads.WeightPass` plus :meth:`forward` (a split microbatch's
    forward must run through the graph). Built from the stage and example inputs (shapes, dtypes and
    ``requires_grad`` of its real inputs); raises :class:`Unsupported` where the route does not apply."""

    walks_whole_graph = False  # its W runs the weight part of the backward graph only (WeightPass's may not)

    def __init__(self, module: nn.Module, example_inputs: Sequence[torch.Tensor]) -> None:
        from torch._functorch.aot_autograd import aot_function, make_boxed_func
        from torch._functorch.partitioners import default_partition

        self.module = module
        self.trusted: bool | None = None
        self.mismatch: str | None = None  # what :meth:`check` found different (None: nothing)
        self.names = [n for n, _ in module.named_parameters()]
        self.buffer_names = [n for n, _ in module.named_buffers()]
        self.params = list(module.parameters())  # what the graphs take, in their order (as WeightPass, once)
        self.buffers = list(module.buffers())
        self.signature = [(t.shape, t.dtype, t.requires_grad) for t in example_inputs]
        self.written = _written_buffers(module, example_inputs)  # indices into :attr:`buffers`
        graphs: dict[str, fx.GraphModule] = {}
        spec: list[Any] = []

        def keep(name: str) -> Any:
            def compiler(gm: fx.GraphModule, _example: Any) -> Any:
                graphs[name] = gm
                return make_boxed_func(gm)
            return compiler

        n_p, n_b = len(self.names), len(self.buffer_names)

        def f(*args: torch.Tensor) -> list[torch.Tensor]:
            state = {**dict(zip(self.names, args[:n_p])), **dict(zip(self.buffer_names, args[n_p:n_p + n_b]))}
            flat, tree = pytree.tree_flatten(torch.func.functional_call(module, state, tuple(args[n_p + n_b:])))
            spec[:] = [tree]
            return flat

        args = [*(p.detach().requires_grad_(p.requires_grad) for p in self.params),
                *(b.detach().clone() for b in self.buffers), *example_inputs]  # tracing writes copies
        try:
            with _forked_rng(args):
                outs = aot_function(f, keep("fw"), keep("bw"), partition_fn=default_partition)(*args)
                diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
                wrt = [a for a in args if a.requires_grad]
                if diff and wrt:
                    torch.autograd.grad(diff, wrt, [torch.ones_like(o) for o in diff], allow_unused=True)
        except Exception as e:  # noqa: BLE001 - any failure to trace means: the eager route
            raise Unsupported(f"aot_autograd could not trace the stage ({type(e).__name__}: {e})") from e
        if "fw" not in graphs:
            raise Unsupported("aot_autograd made no forward graph")
        if not diff or not wrt or "bw" not in graphs:
            raise Unsupported("nothing of the stage needs a gradient")
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise Unsupported("the stage returns values that are not tensors")
        self.fw, bw, self.tree = graphs["fw"], graphs["bw"], spec[0]
        self.n_out = len(outs)
        self.differentiable = [o.requires_grad for o in outs]
        holders = [n for n in bw.graph.nodes if n.op == "placeholder"]
        tangents = holders[len(holders) - sum(self.differentiable):]
        if len(tangents) != sum(self.differentiable) or not all(n.name.startswith("tangents") for n in tangents):
            raise Unsupported("the backward graph's tangents do not match the stage's differentiable outputs")
        self.tangent_strides = [tuple(n.meta["val"].stride()) for n in tangents]
        n_fw = len(next(n for n in self.fw.graph.nodes if n.op == "output").args[0])
        extra = n_fw - self.n_out - (len(holders) - len(tangents))  # besides the outputs and saved tensors
        if extra != len(self.written):
            raise Unsupported(f"the forward graph returns {extra} "
                              f"values besides the outputs and saved tensors; its forward writes "
                              f"{len(self.written)} buffers")
        grads = list(next(n for n in bw.graph.nodes if n.op == "output").args[0])
        if len(grads) != len(args):
            raise Unsupported("the backward graph does not give one gradient per forward input")
        self.masked_split = _split_masked(bw, grads[n_p + n_b:])
        self.input_slots = [j for j, g in enumerate(grads[n_p + n_b:]) if isinstance(g, fx.Node)]
        in_grads = [grads[n_p + n_b + j] for j in self.input_slots]
        self.param_slots = [j for j, g in enumerate(grads[:n_p]) if isinstance(g, fx.Node)]
        w_grads = [grads[j] for j in self.param_slots]
        in_i = _ancestors(in_grads)
        in_w = _ancestors(w_grads) - in_i

        def to_w(n: fx.Node) -> bool:  # computed in I, read by W
            return n in in_i and (n in w_grads or any(u in in_w for u in n.users))

        handed = [n for n in bw.graph.nodes if n.op != "placeholder" and to_w(n)]
        self.i_args = [j for j, n in enumerate(holders) if n in in_i]
        self.w_args = [j for j, n in enumerate(holders) if n in in_w or to_w(n)]
        self.n_args = len(args)
        self.n_inputs = len(example_inputs)
        self.i_graph = _cut(bw, [holders[j] for j in self.i_args], in_grads + handed)
        self.w_graph = _cut(bw, [holders[j] for j in self.w_args] + handed, w_grads)

    # F -----------------------------------------------------------------------------------------
    def fits(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether ``inputs`` are shaped as the traced ones (the graphs are specialised to them)."""
        return [(t.shape, t.dtype, t.requires_grad) for t in inputs] == self.signature

    def capture(self) -> tuple[list[Any], Record]:
        """A record for the next :meth:`forward` (no hooks: the graph holds what ``W`` needs)."""
        return [], Record()

    def forward(self, record: Record, inputs: Sequence[torch.Tensor]) -> Any:
        """The stage's forward through the forward graph, on the live parameters and buffers."""
        outs = _Stage.apply(self, record, *self.params, *self.buffers, *inputs)
        record.inputs, record.outputs = list(inputs), list(outs)
        return pytree.tree_unflatten(list(outs), self.tree)

    # B -----------------------------------------------------------------------------------------
    def input_grads(self, roots: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor] | None,
                    inputs: Sequence[torch.Tensor], notes: Record) -> tuple[list[torch.Tensor], Any]:
        """Run ``I``: the gradients of ``inputs`` (of the stage's inputs); and what ``W`` needs."""
        diff = [o for o, d in zip(notes.outputs, self.differentiable) if d]
        # the outputs' gradients: the seeds where the roots are outputs, else (last stage: a loss of them) autograd's
        seeded = {id(r): g for r, g in zip(roots, seeds or ())}
        if seeds is not None and all(id(r) in {id(o) for o in diff} for r in roots):
            got: Sequence[torch.Tensor | None] = [seeded.get(id(o)) for o in diff]
        else:
            got = torch.autograd.grad(list(roots), diff, seeds, allow_unused=True)
        tangents = self.as_traced([g if g is not None else torch.zeros_like(o) for g, o in zip(got, diff)])
        got_in, work = self.run_i([*notes.node.saved_tensors, *tangents])
        by_slot = dict(zip(self.input_slots, got_in))
        slot = {id(t): j for j, t in enumerate(notes.inputs)}
        dinputs = [by_slot.get(slot.get(id(t), -1)) for t in inputs]
        return [g if g is not None else torch.zeros_like(t) for g, t in zip(dinputs, inputs)], work

    def as_traced(self, tangents: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The outputs' gradients laid out as the backward graph was traced for (its views assume it)."""
        out = []
        for g, stride in zip(tangents, self.tangent_strides):
            if g.stride() != stride:
                g = torch.empty_strided(g.shape, stride, dtype=g.dtype, device=g.device).copy_(g)
            out.append(g)
        return out

    def run_i(self, env: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
        """``I`` on the backward graph's inputs (saved tensors, then tangents): the input gradients
        of :attr:`input_slots`, and ``W``'s inputs."""
        with torch.no_grad():
            out = self.i_graph(*[env[j] for j in self.i_args])
        n = len(self.input_slots)
        return list(out[:n]), ([env[j] for j in self.w_args], list(out[n:]))

    # W -----------------------------------------------------------------------------------------
    def grads_of(self, work: Any) -> dict[int, torch.Tensor]:
        """Run ``W``: each parameter's gradient, by its index in :attr:`params`."""
        args, handed = work
        with torch.no_grad():
            return dict(zip(self.param_slots, self.w_graph(*args, *handed)))

    def weight_grads(self, work: Any) -> None:
        """Accumulate the weight gradients into ``.grad``, as an unsplit backward would."""
        grads = self.grads_of(work)
        for j, p in enumerate(self.params):
            g = grads.get(j)
            if g is None:
                continue
            if p.grad is None:
                p.grad = g if g.stride() == p.stride() else g.contiguous()
            else:
                p.grad.add_(g)

    # the check -----------------------------------------------------------------------------------
    def check(self, example_inputs: Sequence[torch.Tensor]) -> bool:
        """Outputs, input gradients and weight gradients through the graphs against an eager forward and
        an unsplit backward, on ``example_inputs`` with the same random state (restored after):
        bitwise where :func:`~pdcompile.runtime.weight_grads.bitwise_check` allows, else
        :func:`~pdcompile.runtime.weight_grads.same_grads`. Sets and returns :attr:`trusted`."""
        params = self.params
        exact = bitwise_check(params[0].device if params else torch.device("cpu"))
        wrt_in = [t for t in example_inputs if t.requires_grad]
        wrt_p: list[torch.Tensor] = [p for p in params if p.requires_grad]
        written = [self.buffers[j] for j in self.written]
        kept = [b.clone() for b in written]
        with _forked_rng([*params, *example_inputs]) as state:
            flat_e = pytree.tree_leaves(self.module(*example_inputs))
            buffers_e = [b.clone() for b in written]
            gen = torch.Generator().manual_seed(0)
            diff_e = [o for o in flat_e if isinstance(o, torch.Tensor) and o.requires_grad]
            seeds = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in diff_e]
            eager = torch.autograd.grad(diff_e, wrt_in + wrt_p, seeds, allow_unused=True)
            _copy(written, kept)
            state.restore()
            record = self.capture()[1]
            flat_g = pytree.tree_leaves(self.forward(record, example_inputs))
            diff_g = [o for o, d in zip(flat_g, self.differentiable) if d]
            dins, work = self.input_grads(diff_g, seeds, wrt_in, record)
            by_index = self.grads_of(work)
            buffers_g = [b.clone() for b in written]
            _copy(written, kept)  # the check leaves the running statistics as they were
        index = {id(p): j for j, p in enumerate(params)}
        got = [*dins, *(by_index.get(index[id(p)]) for p in wrt_p)]
        want = [w if w is not None or i >= len(wrt_in) else torch.zeros_like(wrt_in[i]) for i, w in enumerate(eager)]

        def same(a: Any, b: Any) -> bool:
            if a is None or b is None:
                return a is None and b is None
            return same_grads(a, b, exact or not a.is_floating_point())

        names = {id(p): n for n, p in zip(self.names, params)}
        parts = [("outputs", len(flat_e) == len(flat_g) and all(same(a, b) for a, b in zip(flat_e, flat_g))),
                 ("input gradients", all(same(a, b) for a, b in zip(want[:len(wrt_in)], got[:len(wrt_in)])))]
        parts += [(f"the gradient of {names[id(p)]}", same(a, b))
                  for p, a, b in zip(wrt_p, want[len(wrt_in):], got[len(wrt_in):])]
        parts += [(f"the buffer {self.buffer_names[j]} after the forward", same(a, b))
                  for j, a, b in zip(self.written, buffers_e, buffers_g)]
        self.mismatch = next((what for what, ok in parts if not ok), None)
        self.trusted = self.mismatch is None
        return self.trusted


class _forked_rng:
    """``torch.random.fork_rng`` over the devices of ``tensors``, with :meth:`restore` to replay the
    random state inside (the check runs eager and graph forwards on the same masks)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.cuda = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})

    def __enter__(self) -> _forked_rng:
        self.fork = torch.random.fork_rng(devices=self.cuda)
        self.fork.__enter__()
        self.cpu = torch.get_rng_state()
        self.gpu = [torch.cuda.get_rng_state(d) for d in self.cuda]
        return self

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, s in zip(self.cuda, self.gpu):
            torch.cuda.set_rng_state(s, d)

    def __exit__(self, *exc: Any) -> None:
        self.fork.__exit__(*exc)


def _copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for d, v in zip(dst, src):
            d.copy_(v)


def _written_buffers(module: nn.Module, example_inputs: Sequence[torch.Tensor]) -> list[int]:
    """Indices (in ``module.buffers()``) of the buffers a forward writes (BatchNorm's running
    statistics in training): the forward graph returns their new values, which
    :class:`_Stage` writes back. The buffers and random state are left as they were; a forward
    that fails on the examples raises :class:`Unsupported`."""
    buffers = list(module.buffers())
    before = [b._version for b in buffers]
    kept = [b.clone() for b in buffers]
    try:
        with torch.no_grad(), _forked_rng([*buffers, *example_inputs]):
            module(*example_inputs)
        # in-place kernels (batch_norm's running statistics) write without a version bump: compare values too
        written = [j for j, (b, v, k) in enumerate(zip(buffers, before, kept)) if b._version > v or not torch.equal(b, k)]
    except Exception as e:  # noqa: BLE001 - the eager forward fails on the examples: no route to check
        raise Unsupported(f"the stage's forward failed on example inputs ({type(e).__name__}: {e})") from e
    finally:
        _copy(buffers, kept)
    return written


def example_inputs(specs: Sequence[Any], device: torch.device | str) -> list[torch.Tensor]:
    """Inputs shaped like a stage's (``TensorSpec``s): floating ones random, others zeros (valid indices)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for s in specs:
        t = (torch.randn(s.shape, generator=gen, dtype=s.dtype) if s.dtype.is_floating_point
             else torch.zeros(s.shape, dtype=s.dtype))
        out.append(t.to(device).requires_grad_(bool(s.requires_grad)))
    return out


def graph_route(module: nn.Module, specs: Sequence[Any], device: torch.device | str, *,
                precision: str = "fp32", stage: int = 0) -> GraphSplit | None:
    """The stage's :class:`GraphSplit`, traced and checked; None (and one log line saying why) where
    the graph route does not apply and ``WeightPass`` splits its backwards instead."""
    why = None
    if precision != "fp32":
        why = f"precision {precision} runs the stage under autocast, which the traced graphs do not replay"
    else:
        try:
            examples = example_inputs(specs, device)
            gs = GraphSplit(module, examples)
        except Unsupported as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - a graph this code cannot cut: the eager route, never a failed run
            why = f"its graphs could not be cut ({type(e).__name__}: {e})"
        else:
            try:
                trusted = gs.check(examples)
            except Exception as e:  # noqa: BLE001 - a check that cannot run is a failed one
                trusted, why = False, f"the check against eager failed ({type(e).__name__}: {e})"
            if trusted:
                return gs
            why = why or f"its graphs' {gs.mismatch} differ from an eager forward and unsplit backward's"
    log.info("stage %d: split backwards by submodules (WeightPass), not the graph: %s", stage, why)
    return None
