"""The ``tensor-parallel`` pass: which linear layers of each stage are split Megatron-style over the
stage's ``t`` tensor-parallel ranks, and the stage graph rewritten for the split.

A column-parallel linear (its output features split) feeds ops that work on its part alone (heads,
elementwise, softmax over keys) up to a row-parallel linear (its input features split), whose
output torch's ``RowwiseParallel`` all-reduces: attention (q/k/v column, o row) and the MLP
(up/gate column, down row). The pass finds these regions by following which dimension of each
value is split from every linear forward through the graph (:func:`_propagate`); a region with an
op it has no rule for, a parameter used inside it, or a split value leaving it other than through
a row linear stays whole, and the plan says why. A fused projection split into equal chunks
(GPT's ``c_attn`` into q, k, v) is split per chunk: the runtime interleaves its rows so that each
rank's contiguous block holds its share of every chunk (``fused``). What the split changes in the
graph is rewritten to the local sizes: head counts in views and reshapes, split sizes. An exported
graph's ``aten.linear`` on a weight attribute becomes a call of an ``nn.Linear`` holding the same
parameter, so ``parallelize_module`` can find it. The token embedding and, into a plain cross-entropy,
the LM head split by vocabulary (:func:`_vocab`, passes/vocab_parallel.py). docs/tensor-parallel.md is the
user's page.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from pdcompile.errors import UsageError
from pdcompile.ir import Chain, CompileState, TensorMeta, need
from pdcompile.passes.split_stages import Stage, StageSplit
from pdcompile.passes.tensor_parallel_plan import StageTP, TensorParallelOptions, TensorParallelPlan, degrees_of, rank_degrees

__all__ = ["StageTP", "TensorParallelOptions", "TensorParallelPlan", "chain_shares", "degrees_of", "format_tensor_parallel",
           "run", "split_stage"]

if TYPE_CHECKING:
    from pdcompile.passes.trace_loss import LossProgram


def run(state: CompileState, opts: TensorParallelOptions) -> CompileState:
    """Reads ``stages``; writes ``stages`` (graphs rewritten where split) and ``tensor_parallel``."""
    split = need(state.stages, "stages")
    n = len(split.stages)
    degrees: tuple[int, ...]
    if isinstance(opts.degrees, str):  # "auto": the planner's choice (passes/planner/tensor.py), each stage's
        degrees = tuple(st.tensor_parallel for st in need(state.plan, "plan").stages)
    else:
        degrees = (opts.degrees,) * n if isinstance(opts.degrees, int) else tuple(opts.degrees)
    if len(degrees) != n:
        raise UsageError(f"tensor_parallel={list(degrees)} names {len(degrees)} stages; the plan has {n}")
    if all(d == 1 for d in degrees):
        return state.replace(tensor_parallel=None)
    rank_degrees(need(state.stage_ranks, "stage_ranks"), degrees)
    tied = {(s, name) for group in split.tied for s, name in group}
    last = len(split.stages) - 1
    vocab = [_vocab(st.gm, t, state.loss if st.index == last else None, st.index == last) if t > 1 else ({}, {})
             for st, t in zip(split.stages, degrees)]
    for group in split.tied:  # a weight tied across stages splits only where every copy's layer splits alike
        split_params = [any(p == name for _, p in vocab[s][0].values()) for s, name in group]
        held = ", ".join(f"stage {s}'s {name}" for (s, name), ok in zip(group, split_params) if not ok) + \
            ", which stays whole"
        if len({degrees[s] for s, _ in group}) > 1:  # and at one degree (runtime/tensor_parallel.py's tied groups)
            split_params, held = [False] * len(group), "a copy in a stage of another degree (" + ", ".join(
                f"stage {s}: t={degrees[s]}" for s in sorted({s for s, _ in group})) + "): it stays whole"
        if not all(split_params):
            for s, name in group:
                for node, (_, p) in list(vocab[s][0].items()):
                    if p == name:
                        del vocab[s][0][node]
                        vocab[s][1][node] = f"{node}: its weight is tied to {held}"
    stages, plans = [], []
    for st, t in zip(split.stages, degrees):
        if t == 1:
            stages.append(st)
            plans.append(StageTP(1))
            continue
        new, tp = split_stage(st, t, {name for s, name in tied if s == st.index}, vocab[st.index])
        stages.append(new)
        plans.append(tp)
    return state.replace(stages=StageSplit(tuple(stages), split.tied), tensor_parallel=TensorParallelPlan(tuple(plans)))


def format_tensor_parallel(state: CompileState) -> str:
    tp = state.tensor_parallel
    return "tensor parallel: none (t=1 everywhere)" if tp is None else str(tp)


# --- the graph's linears ------------------------------------------------------------------------

_LINEAR_FNS: set[Any] = {torch._C._nn.linear, torch.nn.functional.linear, torch.ops.aten.linear.default}


def _linear_weight(gm: fx.GraphModule, node: fx.Node,
                   refs: Mapping[Any, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of a linear node: an ``nn.Linear`` call, or ``linear`` on weight attributes that
    nothing else reads (``refs``: get_attr nodes per target; another node of the same attribute, as a
    stage cut can leave, keeps the linear whole: its module would hold the weight the other reads whole)."""
    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        return (m.weight, m.bias) if type(m) is torch.nn.Linear else None
    if node.op == "call_function" and node.target in _LINEAR_FNS:
        args = list(node.args) + [node.kwargs.get("weight"), node.kwargs.get("bias")][len(node.args) - 1:]
        w = args[1] if len(args) > 1 else None
        b = args[2] if len(args) > 2 else None
        if not (isinstance(w, fx.Node) and w.op == "get_attr" and len(w.users) == 1):
            return None
        if b is not None and not (isinstance(b, fx.Node) and b.op == "get_attr" and len(b.users) == 1):
            return None
        if refs is not None and any(refs.get(a.target, 0) > 1 for a in (w, b) if isinstance(a, fx.Node)):
            return None
        weight = _attr(gm, w)
        bias = _attr(gm, b) if isinstance(b, fx.Node) else None
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
            return None
        return weight, bias
    return None


def _attr(gm: fx.GraphModule, node: fx.Node) -> Any:
    obj: Any = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj


def _meta(node: Any) -> TensorMeta | None:
    m = node.meta.get("pd.tensor") if isinstance(node, fx.Node) else None
    return m if isinstance(m, TensorMeta) else None


def _shape(node: Any) -> tuple[int, ...]:
    m = _meta(node)
    if m is None:
        raise _Refuse(f"{getattr(node, 'name', node)}: no recorded shape")
    return m.shape


def _ndim(node: Any) -> int | None:
    m = _meta(node)
    return None if m is None else len(m.shape)


class _Refuse(Exception):
    """A region can't be split here (the message says why); its linears stay whole."""


# --- the rules: which dimension of an op's output is split, given its inputs' ---------------------

_ELEMENTWISE_NAMES = {
    "add", "sub", "mul", "div", "truediv", "neg", "silu", "gelu", "relu", "tanh", "sigmoid", "dropout",
    "contiguous", "to", "float", "type_as", "clone", "alias", "masked_fill", "where", "exp", "pow", "rsqrt",
    "square", "sqrt", "cos", "sin", "softplus", "leaky_relu", "elu", "mish", "hardswish", "abs", "erf",
}
_ACTIVATION_MODULES = (torch.nn.GELU, torch.nn.SiLU, torch.nn.ReLU, torch.nn.Tanh, torch.nn.Sigmoid,
                       torch.nn.Dropout, torch.nn.Identity, torch.nn.LeakyReLU, torch.nn.Mish, torch.nn.ELU)


def _op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", str(t)).lstrip("_").rstrip("_")


@dataclass
class _Region:
    """What one propagation found: sharded dim per node, the rewrites, and each value's component."""

    dim: dict[Any, int] = dataclasses.field(default_factory=dict)  # fx nodes (Any: graph arguments index it)
    parent: dict[fx.Node, fx.Node] = dataclasses.field(default_factory=dict)
    roles: dict[fx.Node, str] = dataclasses.field(default_factory=dict)
    chunks: dict[Any, int] = dataclasses.field(default_factory=dict)  # column linear -> fused chunks
    rewrites: list[tuple[fx.Node, Callable[[], None], str]] = dataclasses.field(default_factory=list)
    sizes: list[tuple[fx.Node, int, str]] = dataclasses.field(default_factory=list)  # sizes t must divide
    failed: dict[fx.Node, str] = dataclasses.field(default_factory=dict)  # component root -> why

    def find(self, n: fx.Node) -> fx.Node:
        while self.parent.get(n, n) is not n:
            n = self.parent[n]
        return n

    def union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[rb] = ra
            if rb in self.failed:
                self.failed.setdefault(ra, self.failed.pop(rb))

    def fail(self, n: fx.Node, why: str) -> None:
        self.failed.setdefault(self.find(n), why)


def _size_args(node: fx.Node) -> tuple[list[Any], Callable[[list[Any]], None]]:
    """A view/reshape/expand node's sizes and a setter that writes new ones back."""
    args: list[Any] = list(node.args)
    if len(args) == 2 and isinstance(args[1], (list, tuple)):
        as_tuple = isinstance(args[1], tuple)

        def set_list(sizes: list[Any]) -> None:
            node.args = (args[0], tuple(sizes) if as_tuple else list(sizes))
        return list(args[1]), set_list
    if "size" in node.kwargs or "shape" in node.kwargs:
        key = "size" if "size" in node.kwargs else "shape"
        given: Any = node.kwargs[key]

        def set_kw(sizes: list[Any]) -> None:
            node.kwargs = {**node.kwargs, key: tuple(sizes) if isinstance(given, tuple) else list(sizes)}
        return list(given), set_kw

    def set_var(sizes: list[Any]) -> None:
        node.args = (args[0], *sizes)
    return args[1:], set_var


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Dims of shapes ``a`` and ``b`` (same element count) in the smallest groups of equal products."""
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            out.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            out.append(([], [j]))
            j += 1
            continue
        if i >= len(a) or j >= len(b):
            raise _Refuse("shapes do not match")
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(a):
                    raise _Refuse("shapes do not match")
                gi.append(i)
                pa *= a[i]
                i += 1
            else:
                if j >= len(b):
                    raise _Refuse("shapes do not match")
                gj.append(j)
                pb *= b[j]
                j += 1
        out.append((gi, gj))
    return out


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _rule(gm: fx.GraphModule, node: fx.Node, r: _Region, t: int, columns: set[fx.Node]) -> int | None:
    """The split dimension of ``node``'s output (None: not a tensor that is split), given its inputs'
    in ``r.dim``; the rewrites it needs are added to ``r.rewrites``. Raises :class:`_Refuse`."""
    name = _op_name(gm, node)
    ins = [a for a in node.all_input_nodes if a in r.dim]
    out_nd = _ndim(node)
    if node.op == "call_function" and node.target is operator.getitem:
        src, idx = node.args[0], node.args[1]
        if isinstance(idx, int) and isinstance(src, fx.Node) and _meta(src) is None:  # an item of a split
            return r.dim[src]
        raise _Refuse(f"indexing {node.name} of a split value")
    if name in ("split", "chunk", "split_with_sizes"):
        return _split(node, r, t, columns)
    if out_nd is None:
        raise _Refuse(f"{node.name} ({name}) makes no single tensor of a split value")
    x: Any = node.args[0] if node.args else None
    if name in ("view", "reshape", "_unsafe_view", "view_copy"):
        return _reshape(node, r, t)
    if name in ("transpose", "swapaxes"):
        d, nd = r.dim[x], out_nd
        a, b = _norm(int(_arg(node, 1, "dim0")), nd), _norm(int(_arg(node, 2, "dim1")), nd)
        return b if d == a else a if d == b else d
    if name == "permute":
        dims: Any = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        order = [_norm(int(v), out_nd) for v in dims]
        return order.index(r.dim[x])
    if name in ("unsqueeze",):
        d = _norm(int(_arg(node, 1, "dim")), out_nd)
        return r.dim[x] + (1 if d <= r.dim[x] else 0)
    if name in ("softmax", "log_softmax", "_softmax", "_log_softmax"):
        d = _norm(int(_arg(node, 1, "dim")), out_nd)
        if d == r.dim[x]:
            raise _Refuse(f"{node.name} normalises over the split dimension")
        return r.dim[x]
    if name == "slice":
        d = _norm(int(_arg(node, 1, "dim", 0)), out_nd)
        if d == r.dim[x]:
            raise _Refuse(f"{node.name} slices the split dimension")
        return r.dim[x]
    if name == "cat":
        parts: Any = node.args[0]
        d = _norm(int(_arg(node, 1, "dim", 0)), out_nd)
        found = {r.dim.get(p) for p in parts}
        if len(found) != 1 or d in found or None in found:
            raise _Refuse(f"{node.name} concatenates split and whole values, or along the split dimension")
        return int(found.pop() or 0)
    if name in ("matmul", "bmm"):
        lhs: Any = node.args[0]
        rhs: Any = node.args[1]
        if not (lhs in r.dim and rhs in r.dim and r.dim[lhs] == r.dim[rhs] and _ndim(lhs) == _ndim(rhs) == out_nd
                and r.dim[lhs] < out_nd - 2):
            raise _Refuse(f"{node.name} multiplies along the split dimension")
        return r.dim[lhs]
    if name in ("scaled_dot_product_attention",):
        q, k, v = node.args[:3]
        if not (q in r.dim and k in r.dim and v in r.dim and r.dim[q] == r.dim[k] == r.dim[v] < out_nd - 2):
            raise _Refuse(f"{node.name}: attention with whole keys or values (grouped heads?)")
        if node.kwargs.get("enable_gqa"):
            raise _Refuse(f"{node.name}: grouped-query attention")
        _broadcast_ok(gm, node, r.dim[q], [a for a in node.all_input_nodes if a not in (q, k, v)])
        return r.dim[q]
    if name == "expand":
        d = r.dim[x]
        in_nd = _ndim(x)
        assert in_nd is not None
        od = d + out_nd - in_nd
        sizes, put = _size_args(node)
        full = _shape(x)[d]
        if sizes[od] not in (-1, full):
            raise _Refuse(f"{node.name} expands the split dimension")
        if sizes[od] == full:
            sizes[od] = full // t
            r.rewrites.append((node, functools.partial(put, sizes), f"{node.name}: size {full} -> {full // t}"))
        return od
    if name in _ELEMENTWISE_NAMES or (node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)),
                                                                            _ACTIVATION_MODULES)):
        aligned = {r.dim[a] + out_nd - (_ndim(a) or 0) for a in ins}
        if len(aligned) != 1:
            raise _Refuse(f"{node.name} ({name}) combines values split along different dimensions")
        d = aligned.pop()
        _broadcast_ok(gm, node, d, [a for a in node.all_input_nodes if a not in r.dim])
        return d
    raise _Refuse(f"{node.name} ({name}): no rule for this op on a split value")


def _broadcast_ok(gm: fx.GraphModule, node: fx.Node, d: int, whole: Sequence[fx.Node]) -> None:
    """Whole operands of an op on a split value must be size 1 (or absent) along the split dimension,
    and no parameter: its gradient would be each rank's part of it."""
    out_nd = _ndim(node) or 0
    for a in whole:
        if a.op == "get_attr" and isinstance(_attr(gm, a), torch.nn.Parameter):
            raise _Refuse(f"{node.name} uses the parameter {a.target} on a split value")
        m = _meta(a)
        if m is None:
            continue
        k = d - (out_nd - len(m.shape))
        if 0 <= k < len(m.shape) and m.shape[k] != 1:
            raise _Refuse(f"{node.name} combines a split value with the whole {a.name} along the split dimension")


def _reshape(node: fx.Node, r: _Region, t: int) -> int:
    x: Any = node.args[0]
    a, b = _shape(x), _shape(node)
    d = r.dim[x]
    for gi, gj in _groups(a, b):
        if d in gi:
            if gi[0] != d or not gj:
                raise _Refuse(f"{node.name} reshapes the split dimension into a strided layout")
            o = gj[0]
            r.sizes.append((node, b[o], "heads (or features)"))
            sizes, put = _size_args(node)
            if o < len(sizes) and isinstance(sizes[o], fx.Node):
                raise _Refuse(f"{node.name}: the split dimension's size is computed ({sizes[o].name})")
            if sizes[o] != -1:
                old = sizes[o]
                sizes[o] = b[o] // t
                r.rewrites.append((node, functools.partial(put, sizes), f"{node.name}: size {old} -> {b[o] // t}"))
            return o
    raise _Refuse(f"{node.name}: reshape not understood")


def _split(node: fx.Node, r: _Region, t: int, columns: set[fx.Node]) -> int:
    x: Any = node.args[0]
    d = r.dim[x]
    nd = _ndim(x) or 0
    owner: Any = node.graph.owning_module
    name = str(node.target) if node.op == "call_method" else _op_name(owner, node)
    dim = _norm(int(_arg(node, 2, "dim", 0)), nd)
    if dim != d:
        return d
    full = _shape(x)[d]
    if x not in columns or len(x.users) != 1:
        raise _Refuse(f"{node.name} splits the split dimension of a value that is no column linear's output alone")
    arg = _arg(node, 1, "chunks" if name == "chunk" else "split_size")
    if name == "chunk":
        k = int(arg)
    elif isinstance(arg, int) and full % arg == 0:
        k = full // arg
        new = arg // t
        r.sizes.append((node, arg, "features of each part"))

        def put(n: fx.Node = node, v: int = new) -> None:
            n.args = (n.args[0], v) + tuple(n.args[2:]) if len(n.args) > 1 else n.args
            if "split_size" in n.kwargs or "split_size_or_sections" in n.kwargs:
                key = "split_size" if "split_size" in n.kwargs else "split_size_or_sections"
                n.kwargs = {**n.kwargs, key: v}
        r.rewrites.append((node, put, f"{node.name}: split size {arg} -> {new}"))
    else:
        raise _Refuse(f"{node.name} splits a column linear's output into unequal parts")
    r.sizes.append((node, full // k, "features of each part"))
    r.chunks[x] = k
    return d


def _propagate(gm: fx.GraphModule, linears: Mapping[fx.Node, Any], exclude: set[fx.Node], t: int) -> _Region:
    """One pass forward over the graph: every linear not in ``exclude`` whose input is whole is a column
    linear; a linear whose input is split along its features is a row linear; every other node on a
    split value follows its rule. Components that fail are recorded with why."""
    r = _Region()
    columns: set[fx.Node] = set()
    for node in gm.graph.nodes:
        ins = [a for a in node.all_input_nodes if a in r.dim]
        if node in linears and node not in exclude:
            x = node.args[0]
            if not ins:
                w, _ = linears[node]
                r.roles[node] = "col"
                columns.add(node)
                r.dim[node] = (_ndim(node) or 1) - 1
                r.sizes.append((node, int(w.shape[0]), "output features"))
                continue
            for a in ins:
                r.union(a, node)
            if ins == [x] and r.dim[x] == (_ndim(x) or 0) - 1:
                r.roles[node] = "row"
            else:
                r.fail(node, f"{node.name} takes a split value other than as its input features")
            continue
        if not ins:
            continue
        for a in ins[1:]:
            r.union(ins[0], a)
        r.union(ins[0], node)
        if node.op == "output":
            r.fail(node, "its output leaves the stage (an LM head splits by vocabulary only in the last stage, "
                        "into a plain cross-entropy)")
            continue
        if node in linears:
            r.fail(node, f"{node.name} takes a split value but is itself left whole")
            continue
        try:
            d = _rule(gm, node, r, t, columns)
        except _Refuse as e:
            r.fail(node, str(e))
            continue
        if d is not None:
            r.dim[node] = d
    return r


def _regions(gm: fx.GraphModule, t: int, tied: set[str],
             vocab: Collection[str] = ()) -> tuple[_Region, set[fx.Node], dict[fx.Node, Any], dict[fx.Node, str]]:
    """The split regions of ``gm`` at degree ``t``: the propagation's record, the regions split (no failure,
    a row linear), the linears, and what stays whole and why (``vocab``: nodes split by vocabulary instead,
    left out; an embedding's reason is :func:`_vocab`'s)."""
    linears: dict[fx.Node, Any] = {}
    whole: dict[fx.Node, str] = {}
    names = {id(p): n for n, p in gm.named_parameters(remove_duplicate=False)}
    uses = collections.Counter(id(p) for _, p in gm.named_parameters(remove_duplicate=False))
    shared = {n for n, p in gm.named_parameters(remove_duplicate=False) if uses[id(p)] > 1}
    refs = collections.Counter(n.target for n in gm.graph.nodes if n.op == "get_attr")
    for node in gm.graph.nodes:
        if node.name in vocab:
            continue
        wb = _linear_weight(gm, node, refs)
        if wb is None:
            if _linear_weight(gm, node) is not None:
                whole[node] = f"{node.name}: its weight is read by another node of the stage too"
            continue
        pname = names.get(id(wb[0]), "")
        if pname in tied or pname in shared:
            whole[node] = f"{node.name}: its weight is tied to another layer's"
            continue
        linears[node] = wb
    exclude: set[fx.Node] = set()
    while True:  # each round leaves the column linears of the regions that failed whole
        r = _propagate(gm, linears, exclude, t)
        more = {n for n, role in r.roles.items() if role == "col" and r.find(n) in r.failed}
        for n in more:
            whole[n] = f"{n.name}: {r.failed[r.find(n)]}"
        if not more:
            break
        exclude |= more
    # the regions split: no failure, and at least one row linear
    rows_of = {r.find(n) for n, role in r.roles.items() if role == "row"} - set(r.failed)
    for node, role in list(r.roles.items()):
        if r.find(node) not in rows_of:
            del r.roles[node]
            if role == "col":
                whole[node] = f"{node.name}: its output reaches no row linear"
    for node in linears:
        if node not in r.roles and node not in whole:
            whole[node] = f"{node.name}: no column linear feeds it, and its output reaches no row linear"
    return r, rows_of, linears, whole


def _vocab(gm: fx.GraphModule, t: int, loss: LossProgram | None,
           last: bool) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """What of ``gm`` splits by vocabulary at degree ``t`` (passes/vocab_parallel.py): node name -> (``"embedding"``
    or ``"head"``, its weight's name) of the token embeddings (indices a stage input) and, in the last stage
    with a plain cross-entropy ``loss``, the LM head (the linear the stage returns); and node name -> why of
    those left whole. A weight one of them shares with another layer of the stage splits only with it."""
    from pdcompile.passes import vocab_parallel as vp

    refs = collections.Counter(n.target for n in gm.graph.nodes if n.op == "get_attr")
    split: dict[str, tuple[str, str]] = {}
    whole: dict[str, str] = {}

    def weight_name(node: fx.Node) -> str:  # the weight's name as the module that holds it calls it
        if node.op == "call_module":
            return f"{node.target}.weight"
        w = node.args[0] if _op_name(gm, node) == "embedding" else node.args[1]
        return str(w.target) if isinstance(w, fx.Node) else ""

    def vocab_ok(node: fx.Node, w: torch.Tensor) -> bool:
        if w.shape[0] % t:
            whole[node.name] = (f"{node.name}: its vocabulary of {w.shape[0]} does not divide by t={t} (stays whole; "
                                f"to split it, pad the vocabulary to a multiple of {t}, as Megatron does)")
            return False
        return True

    for node in gm.graph.nodes:
        if _op_name(gm, node) not in ("embedding", "Embedding"):
            continue
        w, why = vp.embedding_weight(gm, node, refs)
        ids = node.args[0] if node.op == "call_module" else node.args[1]
        if w is None:
            whole[node.name] = why
        elif not (isinstance(ids, fx.Node) and ids.op == "placeholder"):
            whole[node.name] = f"{node.name}: position embeddings stay whole (its indices are no input of the stage)"
        elif vocab_ok(node, w):
            split[node.name] = ("embedding", weight_name(node))
    out: Any = gm.graph.output_node().args[0]
    if last and isinstance(out, fx.Node):
        wb = _linear_weight(gm, out, refs)
        out_meta = _meta(out)
        shape = out_meta.shape if out_meta is not None else ()
        if wb is not None and len(out.users) == 1 and shape and shape[-1] == wb[0].shape[0]:
            loss_why = vp.cross_entropy_why(loss, len(shape), int(shape[-1]))
            if loss_why is not None:
                shown = weight_name(out).removesuffix(".weight").removesuffix("_weight") or out.name
                whole[out.name] = f"{shown}: the LM head stays whole: {loss_why}"
            elif vocab_ok(out, wb[0]):
                split[out.name] = ("head", weight_name(out))
    params = dict(gm.named_parameters(remove_duplicate=False))
    owners: dict[int, set[str]] = collections.defaultdict(set)
    for n, p in params.items():
        owners[id(p)].add(n)
    changed = True
    while changed:  # until no split layer shares its weight with a layer left whole
        changed = False
        splitting = {p for _, p in split.values()}
        for node, (_, pname) in list(split.items()):
            others = owners[id(params[pname])] - splitting if pname in params else set()
            if pname not in params or others:
                del split[node]
                whole[node] = f"{node}: its weight is tied to {', '.join(sorted(others)) or 'a layer'}, which stays whole"
                changed = True
    return split, whole


def chain_shares(gm: fx.GraphModule, chain: Chain, loss: LossProgram | None = None) -> Chain:
    """``chain`` (one layer per node of ``gm``, the whole model's graph) with what Megatron's layout splits
    (the ``tp_*`` fields the planner charges, ``passes/planner/tensor.py``): a column or row linear's compute
    and parameters, and the compute of the ops between them (attention's core: heads split); what is saved
    on a split value (a row linear's input, the ops between; a column linear saves its whole input); a row
    linear's output all-reduced; every degree must divide the gcd of the split sizes. The token embedding and,
    with a plain cross-entropy ``loss`` (the model's own, traced on its output), the LM head split by vocabulary
    (:func:`_vocab`) where every degree tried (up to 8) divides the vocabulary: their compute and parameters,
    the embedding's output all-reduced in the forward, the head's input gradient in the backward. The rest
    stays whole."""
    vocab, _ = _vocab(gm, 8, loss, True)
    r, rows_of, _, _ = _regions(gm, 1, set(), vocab)
    role: dict[str, str] = {n: kind for n, (kind, _) in vocab.items()}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr") or r.find(node) not in rows_of:
            continue
        if node in r.roles:
            role[node.name] = r.roles[node]
        elif node in r.dim:
            role[node.name] = "inside"
    div = 0
    for node, size, _ in r.sizes:
        if r.find(node) in rows_of:
            div = math.gcd(div, int(size))
    heads = {n.name: n for n in gm.graph.nodes if role.get(n.name) == "head"}
    layers = []
    for l in chain.layers:
        members = l.members or (l.name,)
        kinds = [role.get(m) for m in members]
        if not any(kinds):
            layers.append(l)
            continue
        frac = sum(1 for k in kinds if k) / len(kinds)  # merged layers: an even share per member
        rows = sum(1 for k in kinds if k == "row")
        saved = sum(1 for k in kinds if k in ("row", "inside")) / len(kinds)
        # the vocabulary split's one all-reduce each (charged half each way, as a pair's two are): the embedding's
        # output in the forward, the head's input gradient (its output's bytes x features / vocabulary) in the backward
        extra = 0.0
        for m, k in zip(members, kinds):
            if k == "embedding":
                extra += l.output_bytes / 2
            elif k == "head":
                shape = _shape(heads[m])
                x = _shape(heads[m].args[0])
                extra += l.output_bytes * x[-1] / shape[-1] / 2
        vocab_ars = sum(1 for k in kinds if k in ("embedding", "head"))
        layers.append(dataclasses.replace(
            l, tp_share=frac, tp_param_share=frac if l.param_bytes else 0.0, tp_saved_share=saved,
            tp_allreduce_bytes=(l.output_bytes if rows else 0.0) + extra, tp_allreduces=rows + vocab_ars,
            tp_divisor=div))
    return dataclasses.replace(chain, layers=tuple(layers))


def split_stage(st: Stage, t: int, tied: set[str],
                vocab: tuple[Mapping[str, tuple[str, str]], Mapping[str, str]] = ({}, {})) -> tuple[Stage, StageTP]:
    """``st`` with its splittable linear pairs split ``t`` ways, and the embeddings and LM head ``vocab`` names
    (:func:`_vocab`: node -> kind, and node -> why whole) split by vocabulary: the rewritten stage and its
    :class:`StageTP`."""
    from pdcompile.passes import vocab_parallel as vp

    gm = fx.GraphModule(st.gm, copy.deepcopy(st.gm.graph))
    gm.meta.update(st.gm.meta)  # the output's view (pd.output_view), which the loss reads
    r, rows_of, linears, whole = _regions(gm, t, tied, vocab[0])
    whole = {n: w for n, w in whole.items() if n.name not in vocab[1]}
    for node, size, what in r.sizes:
        if r.find(node) in rows_of and size % t:
            raise UsageError(f"tensor_parallel={t} does not divide the {size} {what} of {node.name} (stage "
                             f"{st.index}); give a degree that divides the head count and the hidden sizes")
    rewritten = []
    for node, put, text in r.rewrites:
        if r.find(node) in rows_of:
            put()
            rewritten.append(text)
    modules: dict[fx.Node, str] = {}
    param_names = dict(st.param_names)
    for node in list(gm.graph.nodes):
        if node not in r.roles:
            continue
        modules[node] = _as_module(gm, node, linears[node], param_names)
    embeddings: list[str] = []
    head = None
    refs = collections.Counter(n.target for n in gm.graph.nodes if n.op == "get_attr")
    for node in list(gm.graph.nodes):
        kind = vocab[0].get(node.name, ("", ""))[0]
        if kind == "embedding":
            embeddings.append(vp.as_embedding(gm, node, param_names))
        elif kind == "head":
            wb = _linear_weight(gm, node, refs)
            assert wb is not None, node.name
            head = _as_module(gm, node, wb, param_names)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    cols = tuple(modules[n] for n, role in r.roles.items() if role == "col")
    rows = tuple(modules[n] for n, role in r.roles.items() if role == "row")
    fused = tuple((modules[n], k) for n, k in r.chunks.items() if n in modules and k > 1)
    tp = StageTP(t, cols, rows, fused, tuple(sorted([*whole.values(), *vocab[1].values()])), tuple(rewritten),
                 tuple(embeddings), head)
    return dataclasses.replace(st, gm=gm, param_names=param_names), tp


def _as_module(gm: fx.GraphModule, node: fx.Node, wb: tuple[torch.Tensor, torch.Tensor | None],
               param_names: dict[str, str]) -> str:
    """The module name of a linear node; an ``aten.linear`` on weight attributes becomes a call of a new
    ``nn.Linear`` holding the same parameters (``param_names`` follows the new names)."""
    from pdcompile.passes import vocab_parallel as vp

    if node.op == "call_module":
        return str(node.target)
    w_node = node.args[1] if len(node.args) > 1 else node.kwargs["weight"]
    b_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    assert isinstance(w_node, fx.Node)
    name = vp.free_module_name(gm, str(w_node.target), "_linear")
    weight, bias = wb
    lin: Any = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    lin.weight = weight
    if bias is not None:
        lin.bias = bias
    gm.add_submodule(name, lin)
    for old, new in ((w_node, "weight"), (b_node, "bias")):
        if isinstance(old, fx.Node):
            param_names[f"{name}.{new}"] = param_names.pop(str(old.target), str(old.target))
    with gm.graph.inserting_before(node):
        call = gm.graph.call_module(name, (node.args[0],))
    call.meta = dict(node.meta)
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    for old in (w_node, b_node):
        if isinstance(old, fx.Node) and not old.users:
            gm.graph.erase_node(old)
            target = str(old.target)
            if "." not in target and hasattr(gm, target):
                delattr(gm, target)
    return name
