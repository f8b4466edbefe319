"""The ``split-stages`` pass: one GraphModule per pipeline stage, with explicit inputs and outputs.

The only pass that rewrites the graph; the decision (node -> stage) comes from partition as data.
A value crosses boundaries one hop at a time (a residual that skips stages is passed through the
ones between, as the planner charges it); model inputs enter at stage 0, and a later stage that reads one
takes it from the data itself (``Stage.data_inputs``: nothing sent for it, e.g. the targets a model's
own loss reads, or an attention mask every layer reads); ``get_attr`` nodes are
copied into every stage that uses them: a parameter used by several stages (tied weights) lives in
each, its gradients summed across them (``TG``), recorded in ``StageSplit.tied``. Targets are
flattened to readable names (``features.0`` -> ``features_0``), mapped back by
``Stage.param_names``. Only tensors may cross a boundary, else :class:`UnsupportedModelError`.
A stage's code names no concrete device: tensors it creates (an exported graph's ``arange``, masks,
``.to(device=...)``) follow the device of its own parameters or inputs (:func:`follow_device`).
"""

from __future__ import annotations

import dataclasses
import keyword
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from pdcompile.errors import UnsupportedModelError
from pdcompile.ir import CompileState, TensorMeta, need


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: ``gm(*inputs)`` returns the tuple ``outputs`` (the last stage returns
    the model's output structure)."""

    index: int
    gm: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    input_meta: tuple[TensorMeta, ...]
    output_meta: tuple[TensorMeta, ...]
    nodes: tuple[str, ...]  # original node names computed here
    param_names: Mapping[str, str] = field(default_factory=dict)  # stage name -> model name
    is_last: bool = False
    # model inputs a later stage reads from the data itself (not received): ``gm(*inputs, *data_inputs)``
    data_inputs: tuple[str, ...] = ()
    data_meta: tuple[TensorMeta, ...] = ()

    def __str__(self) -> str:
        ins = ", ".join(f"{n}: {m}" for n, m in zip(self.inputs, self.input_meta))
        if self.data_inputs:
            ins += "; from the data: " + ", ".join(f"{n}: {m}" for n, m in zip(self.data_inputs, self.data_meta))
        outs = (", ".join(f"{n}: {m}" for n, m in zip(self.outputs, self.output_meta)) if not self.is_last
                else "model output " + ", ".join(str(m) for m in self.output_meta))
        return f"stage {self.index}\n  inputs:  {ins}\n  outputs: {outs}\n" + _indent(self.gm.code.strip(), 2)


@dataclass(frozen=True)
class StageSplit:
    stages: tuple[Stage, ...]
    tied: tuple[tuple[tuple[int, str], ...], ...]  # groups of (stage, stage param name), same model param

    def __str__(self) -> str:
        parts = [str(s) for s in self.stages]
        for group in self.tied:
            parts.append("tied: " + " == ".join(f"stage {s}.{n}" for s, n in group))
        return "\n".join(parts)

    def run(self, *inputs: Any) -> Any:
        """Run the stages in order in this process (the transparency check)."""
        values: tuple[Any, ...] = inputs
        given = dict(zip(self.stages[0].inputs, inputs))  # a later stage's data inputs
        for st in self.stages:
            out = st.gm(*values, *(given[n] for n in st.data_inputs))
            values = out if not st.is_last else (out,)
        return values[0]


def _indent(text: str, n: int) -> str:
    return "\n".join(" " * n + ln for ln in text.splitlines())


def _flat(target: str, used: dict[str, str]) -> str:
    name = target.replace(".", "_")
    if not name.isidentifier() or keyword.iskeyword(name):  # nn.Sequential's "0" -> "_0" (a Python name)
        name = f"_{name}"
    base, i = name, 1
    while name in used and used[name] != target:
        name, i = f"{base}_{i}", i + 1
    used[name] = target
    return name


def _check_assignment(gm: fx.GraphModule, stage_of: dict[str, int], num_stages: int) -> None:
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if node.name not in stage_of:
            raise UnsupportedModelError(f"split-stages: node {node.name!r} has no stage; the partition must cover every node")
        for user in node.users:
            if user.op != "output" and user.name in stage_of and stage_of[user.name] < stage_of[node.name]:
                raise UnsupportedModelError(
                    f"split-stages: node {user.name!r} (stage {stage_of[user.name]}) uses {node.name!r} "
                    f"(stage {stage_of[node.name]}): stages must be contiguous in a topological order"
                )
    used = sorted(set(stage_of.values()))
    if used != list(range(num_stages)):
        raise UnsupportedModelError(f"split-stages: stages must be 0..{num_stages - 1}, each non-empty (got {used})")


def boundary_values(gm: fx.GraphModule, stage_of: Mapping[str, int], num_stages: int) -> list[list[fx.Node]]:
    """For each boundary k (between stage k and k+1), the nodes live across it, in graph order. Model
    inputs cross none: a stage that reads one takes it from the data (:func:`data_inputs`)."""
    def stage(n: fx.Node) -> int:
        return 0 if n.op == "placeholder" else stage_of[n.name]

    live: list[list[fx.Node]] = [[] for _ in range(max(0, num_stages - 1))]
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "output", "placeholder"):
            continue
        consumers = [stage(u) for u in node.users if u.op != "output"]
        last_use = max(consumers, default=stage(node))
        if any(u.op == "output" for u in node.users):
            last_use = num_stages - 1
        for k in range(stage(node), last_use):
            live[k].append(node)
    return live


def data_inputs(gm: fx.GraphModule, stage_of: Mapping[str, int], num_stages: int,
                rebuilt: set[fx.Node] = frozenset()) -> list[list[fx.Node]]:  # type: ignore[assignment]
    """For each stage, the model inputs (placeholders) it reads itself: stage 0 all of them (it reads the
    minibatch), a later stage those its nodes use, directly or through values it makes again
    (``rebuilt``; the model's output naming one: the last stage)."""
    uses: list[set[fx.Node]] = [set() for _ in range(num_stages)]
    for n in gm.graph.nodes:
        if n.op == "output":
            uses[num_stages - 1].update(n.all_input_nodes)
        elif n.op not in ("placeholder", "get_attr") and n not in rebuilt:
            uses[stage_of[n.name]].update(n.all_input_nodes)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: list[list[fx.Node]] = [list(placeholders)]
    for k in range(1, num_stages):
        stack, seen, reads = list(uses[k]), set(), set()
        while stack:
            a = stack.pop()
            if a in seen:
                continue
            seen.add(a)
            if a.op == "placeholder":
                reads.add(a)
            elif a in rebuilt:
                stack += a.all_input_nodes
        out.append([p for p in placeholders if p in reads])
    return out


def split_stages(gm: fx.GraphModule, assign: Mapping[str, int] | Callable[[fx.Node], int],
                 model: torch.nn.Module | None = None, *, rebuild: bool = True) -> StageSplit:
    """Split ``gm`` (annotated by propagate-shapes) into stages by ``assign`` (node name -> stage).

    ``model``: the original module, to name parameters as the user knows them (defaults to gm).
    ``rebuild``: values that depend only on positions (:func:`rebuildable`) are computed again in
    each stage that reads them instead of being sent to it.
    """
    nodes = list(gm.graph.nodes)
    stage_of = {n.name: (assign(n) if callable(assign) else assign[n.name])
                for n in nodes if n.op not in ("placeholder", "get_attr", "output")}
    num_stages = max(stage_of.values(), default=0) + 1
    _check_assignment(gm, stage_of, num_stages)
    rebuilt = rebuildable(gm, from_inputs=True) if rebuild else set()
    live = [[v for v in vals if v not in rebuilt] for vals in boundary_values(gm, stage_of, num_stages)]
    grad_nodes = nodes_needing_grad(gm)
    for k, vals in enumerate(live):
        for v in vals:
            if not isinstance(v.meta.get("pd.tensor"), TensorMeta):
                raise UnsupportedModelError(
                    f"split-stages: value {v.name!r} ({v.format_node()}) is live across the cut after stage {k} "
                    f"but is not a single tensor; only tensors can be sent between stages. Fix: move the cut, "
                    f"or compute the value from config constants instead of x.size()"
                )
    root, writers = storage_classes(gm)
    for k, vals in enumerate(live):
        for r, ws in writers.items():
            shared = [v for v in vals if root.get(v) is r]
            if len(shared) > 1 and any(stage_of[w.name] > k for w in ws):
                raise UnsupportedModelError(
                    f"split-stages: {', '.join(repr(v.name) for v in shared)} share one storage and are live across "
                    f"the cut after stage {k}, and {ws[-1].name!r} writes it in place later: sent, they would be "
                    f"separate tensors. Fix: move the cut (the planner avoids it), or write out of place")
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for n in placeholders:
        if not isinstance(n.meta.get("pd.tensor"), TensorMeta):
            raise UnsupportedModelError(
                f"split-stages: the model's input {n.name!r} has no tensor value (a parameter of forward that the "
                f"example inputs do not give is traced as an input). Fix: give it in example_inputs as a tensor, or "
                f"trace with the number of inputs given, so that it keeps its default")
    canonical = {id(p): name for name, p in (model or gm).named_parameters()}
    canonical.update({id(b): name for name, b in (model or gm).named_buffers()})

    stages = []
    owners: dict[int, list[tuple[int, str]]] = {}
    reads = data_inputs(gm, stage_of, num_stages, rebuilt)
    for k in range(num_stages):
        ins = placeholders if k == 0 else live[k - 1]
        data = reads[k] if k > 0 else []
        outs = live[k] if k < num_stages - 1 else []
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in [*ins, *data]:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
        if k > 0:  # a received activation is a leaf of autograd: one this stage writes in place is copied first
            for n in written_inputs(nodes, [*ins, *data], lambda n: n.op not in ("placeholder", "get_attr", "output")
                                    and stage_of[n.name] == k, gm):
                env[n] = _copy_of(g, env[n], aten=any(isinstance(m.target, torch._ops.OpOverload) for m in nodes))
        attrs: dict[str, Any] = {}
        used_names: dict[str, str] = {}
        param_names: dict[str, str] = {}

        def lookup(n: fx.Node) -> fx.Node:
            if n not in env and n.op == "get_attr":
                flat = _flat(str(n.target), used_names)
                attrs[flat] = _fetch(gm, str(n.target))
                env[n] = g.get_attr(flat)
                env[n].meta = dict(n.meta)
            elif n not in env and n in rebuilt:  # made again here, just before its first use
                env[n] = g.node_copy(n, lookup)
            return env[n]

        for n in nodes:
            if n.op in ("placeholder", "get_attr", "output") or stage_of[n.name] != k or n in rebuilt:
                continue
            if n.op == "call_module":
                flat = _flat(n.target, used_names)
                attrs[flat] = gm.get_submodule(n.target)
                new = g.node_copy(n, lookup)
                new.target = flat
            else:
                new = g.node_copy(n, lookup)
            env[n] = new
        if k == num_stages - 1:
            out_node = nodes[-1]
            g.output(fx.node.map_arg(out_node.args[0], lookup))
        else:
            g.output(tuple(env[n] for n in outs))
        anchor = next((a for a, v in attrs.items() if isinstance(v, torch.Tensor)), None)
        follow_device(g, anchor if anchor is not None else next((env[n] for n in ins), None))
        sgm = fx.GraphModule(attrs, g, f"Stage{k}")
        if k == num_stages - 1 and "pd.output_view" in gm.meta:  # how the loss sees the last output
            sgm.meta["pd.output_view"] = gm.meta["pd.output_view"]
        for name, t in list(sgm.named_parameters(remove_duplicate=False)) + list(sgm.named_buffers(remove_duplicate=False)):
            orig = canonical.get(id(t))
            if orig is not None:
                param_names[name] = orig
        for name, t in sgm.named_parameters():  # one entry per distinct tensor of this stage
            owners.setdefault(id(t), []).append((k, name))
        out_meta = tuple(n.meta["pd.tensor"] for n in outs) if outs else _flatten_meta(nodes[-1])
        stages.append(Stage(
            index=k, gm=sgm, inputs=tuple(n.name for n in ins), outputs=tuple(n.name for n in outs),
            input_meta=tuple(_grad_meta(n, grad_nodes) for n in ins),
            output_meta=tuple(_grad_meta(n, grad_nodes) for n in outs) if outs else out_meta,
            nodes=tuple(n.name for n in nodes if n.name in stage_of and stage_of[n.name] == k),
            param_names=param_names, is_last=(k == num_stages - 1),
            data_inputs=tuple(n.name for n in data), data_meta=tuple(_grad_meta(n, grad_nodes) for n in data),
        ))
    tied = tuple(tuple(v) for v in owners.values() if len({s for s, _ in v}) > 1)
    return StageSplit(tuple(stages), tied)


_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "flatten", "unflatten", "squeeze",
                 "unsqueeze", "expand", "expand_as", "narrow", "select", "t", "unfold", "split", "chunk", "unbind",
                 "as_strided", "diagonal", "movedim", "swapaxes", "__getitem__", "getitem", "detach"}
_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                      "ilshift", "irshift", "imatmul", "setitem"}


def _writes_and_views(n: fx.Node, gm: fx.GraphModule, root: Mapping[fx.Node, fx.Node]) -> tuple[list[Any], list[Any]]:
    """The arguments ``n`` writes in place and those its output may be a view of (``root``: the storage of each
    value seen so far; an item of a tuple that is no view, ``topk``'s say, is a tensor of its own)."""
    t = n.target
    if t is operator.getitem and isinstance(n.args[0], fx.Node):
        source = n.args[0]
        own = not isinstance(source.meta.get("pd.tensor"), TensorMeta) and root.get(source) is source
        return [], ([] if own else [source])
    if isinstance(t, torch._ops.OpOverload):
        schema = t._schema
        writes: list[Any] = []
        views: list[Any] = []
        for i, a in enumerate(schema.arguments):
            value = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            if a.alias_info is not None:
                (writes if a.alias_info.is_write else views).append(value)
        return writes, views
    first = n.args[:1]
    if n.op == "call_module":
        return (list(first) if getattr(gm.get_submodule(str(t)), "inplace", False) else []), []
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    if n.op == "call_function" and getattr(t, "__module__", "") in ("_operator", "operator"):
        return (list(first) if name in _INPLACE_OPERATORS else []), (list(first) if name == "getitem" else [])
    if (name.endswith("_") and not name.endswith("__")) or n.kwargs.get("inplace") is True:  # x.add_, F.relu(x, inplace=True)
        return list(first), []
    if name in _VIEW_METHODS:
        return [], list(first)
    return [], []


def writes_in_place(n: fx.Node, gm: fx.GraphModule) -> list[Any]:
    """The arguments ``n`` writes in place (annotate-costs clones them before each measured call)."""
    return _writes_and_views(n, gm, {})[0]


def written_inputs(nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], in_stage: Callable[[fx.Node], bool],
                   gm: fx.GraphModule) -> list[fx.Node]:
    """The ``inputs`` that a node of the stage (``in_stage``) writes in place, itself or through a view of it
    (``aten.add_``, ``relu_``, ``x += y``, ``nn.ReLU(inplace=True)``, ``x[:, 0] = ...``). Received by a
    stage they are autograd leaves, which no op may write; and the stage must leave its input as it came
    (a recomputed forward reads it again)."""
    root: dict[fx.Node, fx.Node] = {n: n for n in inputs}
    written: list[fx.Node] = []
    for n in nodes:
        if not in_stage(n):
            continue
        writes, views = _writes_and_views(n, gm, root)
        for w in _flat_nodes(writes):
            if w in root and root[w] not in written:
                written.append(root[w])
        for a in _flat_nodes(views + writes):  # a view, or an in-place op's result: the same storage
            if a in root:
                root[n] = root[a]
    return [n for n in inputs if n in written]


def storage_classes(gm: fx.GraphModule) -> tuple[dict[fx.Node, fx.Node], dict[fx.Node, list[fx.Node]]]:
    """Each value's storage (the node that made it: a view or an in-place op's result shares its argument's),
    and per storage the nodes that write it in place. Model inputs and activations only: a buffer a stage
    updates is that stage's own copy."""
    root: dict[fx.Node, fx.Node] = {}
    writers: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "output"):
            continue
        root[n] = n
        if n.op == "placeholder":
            continue
        writes, views = _writes_and_views(n, gm, root)
        shared = [a for a in _flat_nodes(views + writes) if a in root]
        if shared:
            root[n] = root[shared[0]]
        for a in _flat_nodes(writes):
            if a in root:
                writers.setdefault(root[a], []).append(n)
    return root, writers


def shared_storage_cuts(gm: fx.GraphModule, order: Sequence[str]) -> set[int]:
    """Cuts ``i`` (after ``order[i]``) across which two values of one storage are live while a later node writes
    it in place: sent, they arrive as two tensors, and the write would reach only one of them."""
    root, writers = storage_classes(gm)
    pos = {name: i for i, name in enumerate(order)}
    blocked: set[int] = set()
    for r, ws in writers.items():
        members = [n for n in root if root[n] is r]
        last_write = max((pos[w.name] for w in ws if w.name in pos), default=-1)
        if len(members) < 2 or last_write < 0:
            continue
        spans = []
        for m in members:
            start = pos.get(m.name, -1)
            end = len(order) - 1 if any(u.op == "output" for u in m.users) else \
                max((pos[u.name] for u in m.users if u.name in pos), default=start)
            spans.append((start, end))
        for c in range(last_write):
            if sum(1 for a, b in spans if a <= c < b) >= 2:
                blocked.add(c)
    return blocked


def _flat_nodes(values: Sequence[Any]) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(list(values), out.append)
    return out


def _copy_of(g: fx.Graph, value: fx.Node, aten: bool) -> fx.Node:
    """``value.clone()`` (an aten op in an exported graph), carrying its metadata."""
    if aten:
        node = g.call_function(torch.ops.aten.clone.default, (value,))
    else:
        node = g.call_method("clone", (value,))
    node.meta = dict(value.meta)
    return node


_HEAVY = ("mm", "conv", "linear", "matmul", "einsum", "attention", "lstm", "gru", "rnn")
_RANDOM = ("rand", "dropout", "bernoulli", "normal", "multinomial", "uniform", "exponential", "poisson")


def _cheap_pure(n: fx.Node) -> bool:
    """An op that gives the same value each time it runs, writes nothing, and costs about what its
    output's bytes cost to move (no matrix products or convolutions)."""
    if n.op not in ("call_function", "call_method"):
        return False
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        if t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags:
            return False
        name = t._schema.name.split("::")[-1]
    else:
        name = t if isinstance(t, str) else getattr(t, "__name__", "")
        if n.op == "call_method" and name.endswith("_") and not name.endswith("__"):
            return False  # in place
    return not any(h in name for h in _HEAVY + _RANDOM)


def rebuildable(gm: fx.GraphModule, from_inputs: bool = False) -> set[fx.Node]:
    """The compute nodes whose value depends on no model input and no trainable parameter, only on
    constants and buffers nothing writes (an exported graph's position ids, causal masks, rotary
    tables), through cheap pure ops: a stage reading one computes it again, bitwise the same, rather
    than receive it with every microbatch. ``from_inputs``: model inputs count as such constants too
    (a stage reads them from the data: ``targets.view(-1)``, an attention mask expanded)."""
    mutated: set[str] = set()
    for n in gm.graph.nodes:
        writes = isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        if writes or (n.op == "call_method" and str(n.target).endswith("_") and not str(n.target).endswith("__")):
            stack, seen = list(n.all_input_nodes), set()
            while stack:
                a = stack.pop()
                if a in seen:
                    continue
                seen.add(a)
                if a.op == "get_attr":
                    mutated.add(str(a.target))
                stack += a.all_input_nodes
    free: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" and from_inputs:
            free.add(n)
        elif n.op == "get_attr":
            obj = _fetch(gm, str(n.target))
            if isinstance(obj, torch.Tensor) and not obj.requires_grad and str(n.target) not in mutated:
                free.add(n)
        elif _cheap_pure(n) and all(a in free for a in n.all_input_nodes):
            free.add(n)
    return {n for n in free if n.op not in ("get_attr", "placeholder")}


def _names_device(value: Any) -> bool:
    found = []
    fx.node.map_aggregate(value, lambda a: found.append(a) if isinstance(a, torch.device) else a)
    return bool(found)


def follow_device(graph: fx.Graph, anchor: str | fx.Node | None) -> None:
    """Replace every concrete ``torch.device`` in ``graph``'s node arguments by the device of
    ``anchor`` (a parameter/buffer name, read by a new ``get_attr``, or a placeholder), read once
    before its first use: the code then runs wherever its module and inputs are (CPU, GPU, meta)."""
    users = [n for n in graph.nodes if _names_device(n.args) or _names_device(n.kwargs)]
    if not users or anchor is None:
        return
    with graph.inserting_before(users[0]):
        source = graph.get_attr(anchor) if isinstance(anchor, str) else anchor
        device = graph.create_node("call_function", getattr, (source, "device"), name="stage_device")

    def swap(a: Any) -> Any:
        return device if isinstance(a, torch.device) else a

    for n in users:
        n.args = fx.node.map_aggregate(n.args, swap)
        n.kwargs = fx.node.map_aggregate(n.kwargs, swap)


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _flatten_meta(out_node: fx.Node) -> tuple[TensorMeta, ...]:
    metas: list[Any] = []  # the TensorMeta of every output node, in order

    def note(n: fx.Node) -> fx.Node:
        metas.append(n.meta.get("pd.tensor"))
        return n

    fx.node.map_arg(out_node.args[0], note)
    return tuple(metas)


def even_assignment(gm: fx.GraphModule, num_stages: int) -> dict[str, int]:
    """A simple legal assignment for tests and fallbacks: split compute nodes into ``num_stages``
    runs of (nearly) equal length in graph order, moving each cut forward past any position where
    a non-tensor value would be live."""
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    if num_stages > len(compute):
        raise UnsupportedModelError(f"split-stages: {num_stages} stages but only {len(compute)} nodes")
    legal = legal_cuts(gm)
    cuts: list[int] = []
    for k in range(1, num_stages):
        want = max(k * len(compute) // num_stages, (cuts[-1] + 1) if cuts else 1)
        c = next((i for i in range(want, len(compute)) if i in legal), None)
        if c is None:
            c = next((i for i in range(want - 1, (cuts[-1] if cuts else 0), -1) if i in legal), None)
        if c is None:
            raise UnsupportedModelError(f"split-stages: no legal cut for stage {k} of {num_stages}")
        cuts.append(c)
    assignment = {}
    for i, n in enumerate(compute):
        assignment[n.name] = sum(1 for c in cuts if i >= c)
    return assignment


def legal_cuts(gm: fx.GraphModule) -> set[int]:
    """Positions i (cut before the i-th compute node in graph order) where only tensors are live."""
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    pos = {n: i for i, n in enumerate(compute)}
    bad: set[int] = set()
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "output") or isinstance(n.meta.get("pd.tensor"), TensorMeta):
            continue
        start = pos.get(n, -1) + 1
        end = max((pos[u] for u in n.users if u in pos), default=start)
        bad.update(range(start, end + 1))
    bad.update(c + 1 for c in shared_storage_cuts(gm, [n.name for n in compute]))
    return {i for i in range(1, len(compute)) if i not in bad}


def nodes_needing_grad(gm: fx.GraphModule) -> set[str]:
    """Names of nodes whose value depends on a trainable parameter (model inputs don't), through values
    autograd follows: an integer tensor (``topk``'s indices, a router's expert ids) requires no grad, nor
    what is made from it."""
    needs: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj = _fetch(gm, n.target)
            if isinstance(obj, torch.Tensor) and obj.requires_grad:
                needs.add(n.name)
        elif n.op in ("call_module", "call_function", "call_method"):
            meta = n.meta.get("pd.tensor")
            if isinstance(meta, TensorMeta) and not meta.requires_grad:  # not floating point
                continue
            if n.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(n.target).parameters()):
                needs.add(n.name)
            elif any(a.name in needs for a in n.all_input_nodes):
                needs.add(n.name)
    return needs


def _grad_meta(n: fx.Node, grad_nodes: set[str]) -> TensorMeta:
    meta: Any = n.meta.get("pd.tensor")
    if isinstance(meta, TensorMeta):
        return dataclasses.replace(meta, requires_grad=meta.requires_grad and n.name in grad_nodes)
    return meta


def blocked_cuts(gm: fx.GraphModule, order: Sequence[str]) -> set[int]:
    """Cuts ``i`` (after ``order[i]``, a topological order of the compute nodes) across which a value
    that is not a single tensor (a Python int, a tuple such as an LSTM's output) is live."""
    pos = {name: i for i, name in enumerate(order)}
    blocked: set[int] = set()
    for n in gm.graph.nodes:
        if n.op in ("get_attr", "output", "placeholder") or isinstance(n.meta.get("pd.tensor"), TensorMeta):
            continue
        start = pos.get(n.name)
        if start is None:
            continue
        end = max((pos[u.name] for u in n.users if u.name in pos), default=start)
        if any(u.op == "output" for u in n.users):
            end = len(order) - 1
        blocked.update(range(start, end))
    return blocked | shared_storage_cuts(gm, order)


def run(state: CompileState) -> CompileState:
    """Reads ``gm``, ``assignment`` and ``model``; writes ``stages``."""
    return state.replace(stages=split_stages(need(state.gm, "gm"), need(state.assignment, "assignment"),
                                             state.model))
