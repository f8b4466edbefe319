"""The torch.fx front end of the ``trace`` pass: nn.Module -> torch.fx.GraphModule, with a leaf-module
policy and full diagnostics.

Modules from ``torch.nn`` (but its containers) and those the user names (by class or qualified name)
stay whole as ``call_module`` nodes; everything else is traced through. When fx fails, a diagnostic
tracer continues past data-dependent ``if``/``while`` and iteration over tensors, then traces each
submodule on its own, so one :class:`UnsupportedModelError` lists every offending construct (with
host syncs such as ``.item()``), each with its module path, source line and fix. The pass
(:mod:`.trace`) picks between this front end and ``torch.export`` (:mod:`.export_frontend`); both
sit below it, and trace-loss reads :func:`host_syncs` and :func:`user_frame` from here.
"""

from __future__ import annotations

import inspect
import linecache
import os
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from pdcompile.errors import UnsupportedModelError

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
_HOST_SYNC_METHODS = {"item": "`.item()`", "tolist": "`.tolist()`", "numpy": "`.numpy()`"}
_FX_DIR = os.path.dirname(fx.__file__)
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True)
class Offence:
    """One construct that prevents tracing or splitting."""

    kind: str  # "data-dependent control flow", "iteration over a tensor", "host sync", "untraceable"
    module: str  # qualified module path ("" = the root model)
    where: str  # "file.py:42: `source line`" or ""
    detail: str
    fix: str

    def __str__(self) -> str:
        mod = self.module or "<root>"
        loc = f" at {self.where}" if self.where else ""
        return f"{self.kind} in module {mod!r}{loc}: {self.detail}. Fix: {self.fix}"


def is_builtin_leaf(m: torch.nn.Module) -> bool:
    """torch.nn built-in modules (not containers) are kept whole."""
    return type(m).__module__.startswith("torch.nn") and not isinstance(m, _CONTAINERS)


class ShapedProxy(fx.Proxy):
    """A model input whose shape the example fixed: ``size()``, ``shape``, ``dim()`` and ``ndim`` are Python
    values, so ``b, t = idx.size()`` and ``assert t <= block_size`` decide as in eager (the emitted program
    checks every minibatch's inputs against these shapes: runtime/data.py ``check_inputs``)."""

    def _pd_shape(self) -> torch.Size:
        return torch.Size(self.node.meta["pd.example_shape"])

    def size(self, dim: int | None = None) -> Any:
        shape = self._pd_shape()
        return shape if dim is None else shape[dim]

    @property
    def shape(self) -> torch.Size:
        return self._pd_shape()

    def dim(self) -> int:
        return len(self._pd_shape())

    @property
    def ndim(self) -> int:
        return len(self._pd_shape())


class PdTracer(fx.Tracer):
    """fx.Tracer with our leaf policy. ``diagnose=True`` records control flow and keeps going.
    ``example_shapes``: the model inputs' shapes, in order, taken as constants (:class:`ShapedProxy`)."""

    def __init__(self, leaf_modules: Sequence[type | str] = (), diagnose: bool = False,
                 example_shapes: Sequence[Sequence[int]] | None = None) -> None:
        super().__init__()
        self.example_shapes = list(example_shapes) if example_shapes is not None else None
        self._inputs_seen = 0
        self.leaf_types = tuple(t for t in leaf_modules if isinstance(t, type))
        self.leaf_names = {t for t in leaf_modules if isinstance(t, str)}
        self.extra_leaf_names: set[str] = set()
        self.diagnose = diagnose
        self.offences: list[Offence] = []
        self.seen_branches: set[str] = set()
        self.record_stack_traces = True
        # a buffer read in forward is a graph value: `self.num_batches_tracked.add_(1)` (timm's BatchNormAct2d) is
        # recorded, not run once on the real buffer while tracing and lost from the graph and the stages' weights
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or module_qualified_name in self.extra_leaf_names:
            return True
        if self.leaf_types and isinstance(m, self.leaf_types):
            return True
        return is_builtin_leaf(m)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        if node.op == "placeholder" and self.example_shapes is not None:
            i, self._inputs_seen = self._inputs_seen, self._inputs_seen + 1
            if i < len(self.example_shapes):
                node.meta["pd.example_shape"] = tuple(self.example_shapes[i])
                return ShapedProxy(node, self)
        return super().proxy(node)

    # fx calls these when a Proxy meets Python control flow.
    def to_bool(self, obj: fx.Proxy) -> bool:
        if not self.diagnose:
            return super().to_bool(obj)
        where = user_frame()
        seen = where in self.seen_branches
        self.seen_branches.add(where)
        if not seen:
            self._record("data-dependent control flow", "a Python `if`/`while`/`assert` on a tensor's value",
                         "compute both branches and select with torch.where, move the decision out of "
                         "forward(), or mark the module as a leaf (leaf_modules=[...])")
        return not seen  # a `while` on a tensor: enter its body once, then leave the loop

    def iter(self, obj: fx.Proxy) -> Iterator:
        if not self.diagnose:
            return super().iter(obj)
        self._record("iteration over a tensor", "a Python loop over a tensor (its length is data)",
                     "loop over a fixed count from the model's config, or mark the module as a leaf")
        return iter(())

    def _record(self, kind: str, detail: str, fix: str) -> None:
        self.offences.append(Offence(kind, self.scope.module_path, user_frame(), detail, fix))


def user_frame(tb: Any = None) -> str:
    """The innermost stack frame outside torch and pdcompile's passes, as 'file:line: `src`'."""
    frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack()
    here = os.path.dirname(__file__)
    for fr in reversed(frames):
        fn = fr.filename
        if fn.startswith(_TORCH_DIR) or fn.startswith(here) or fn.startswith("<"):
            continue
        src = (fr.line or linecache.getline(fn, fr.lineno or 0)).strip()
        return f"{os.path.basename(fn)}:{fr.lineno}: `{src}`"
    return ""


def _classify(exc: BaseException) -> tuple[str, str, str]:
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "'len' is not supported" in msg or "has no len" in msg:
        return ("iteration over a tensor", "`len()` of a tensor (its length is data) — " + msg,
                "use a fixed length from the model's config, or mark the module as a leaf")
    if "control flow" in msg:
        return ("data-dependent control flow", msg,
                "compute both branches and select with torch.where, or mark the module as a leaf")
    return ("untraceable", f"{type(exc).__name__}: {msg}",
            "mark the module as a leaf (leaf_modules=[...]) or rewrite the construct with tensor ops")


def host_syncs(gm: fx.GraphModule, prefix: str = "") -> list[Offence]:
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target in _HOST_SYNC_METHODS:
            where = ""
            st = node.meta.get("stack_trace") or ""
            lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip()]
            for i in range(len(lines) - 1, -1, -1):
                if lines[i].startswith("File ") and _TORCH_DIR not in lines[i]:
                    parts = lines[i].split('"')
                    fname = os.path.basename(parts[1]) if len(parts) > 1 else "?"
                    lineno = lines[i].split("line ")[-1].split(",")[0]
                    src = lines[i + 1] if i + 1 < len(lines) else ""
                    where = f"{fname}:{lineno}: `{src}`"
                    break
            scope = node.meta.get("nn_module_stack") or {}
            module = next(reversed(scope.values()))[0] if scope else prefix
            out.append(Offence("host sync", module, where,
                               f"{_HOST_SYNC_METHODS[node.target]} turns a tensor into a Python value",
                               "keep the value as a tensor (drop .item()), or mark the module as a leaf"))
    return out


def diagnose(model: torch.nn.Module, leaf_modules: Sequence[type | str] = (),
             bound: dict[str, Any] | None = None,
             example_shapes: Sequence[Sequence[int]] | None = None) -> list[Offence]:
    """Every construct that stops ``model`` from being traced and split (empty list: traceable); ``bound``:
    forward's parameters held at these values (:func:`defaults_after`)."""
    offences: list[Offence] = []
    tracer = PdTracer(leaf_modules, diagnose=True, example_shapes=example_shapes)
    try:
        graph = tracer.trace(model, concrete_args=bound or None)
        offences += tracer.offences
        offences += host_syncs(fx.GraphModule(tracer.root, graph))
        if not offences:
            return []
    except Exception:  # noqa: BLE001 - a hard failure: look module by module below
        offences += tracer.offences
    # Trace every non-leaf module on its own, children kept whole, to find the rest.
    for name, sub in model.named_modules():
        probe = PdTracer(leaf_modules, diagnose=True)
        if probe.is_leaf_module(sub, name) or isinstance(sub, _CONTAINERS):
            continue
        probe.extra_leaf_names = {n for n, _ in sub.named_children()}
        probe.leaf_names = probe.leaf_names | probe.extra_leaf_names
        try:
            g = probe.trace(sub)
            found = probe.offences + host_syncs(fx.GraphModule(probe.root, g), name)
        except Exception as e:  # noqa: BLE001
            kind, detail, fix = _classify(e)
            found = probe.offences + [Offence(kind, name, user_frame(e.__traceback__), detail, fix)]
        for o in found:
            o = Offence(o.kind, name, o.where, o.detail, o.fix)
            if o not in offences:
                offences.append(o)
    # Findings from the whole-model pass may repeat per-module ones under the root's name.
    unique: dict[tuple[str, str, str], Offence] = {}
    for o in offences:
        key = (o.kind, o.where, o.detail)
        if key not in unique or (o.module and not unique[key].module):
            unique[key] = o
    return list(unique.values())


def defaults_after(model: torch.nn.Module, inputs: int | None) -> dict[str, Any]:
    """``forward``'s parameters after its first ``inputs`` positional ones that have a default, at it:
    constants to the tracer (a proxy for ``attn_mask=None`` would take ``if attn_mask is not None``'s
    branch, and would be a stage input with no value). ``None``: no count known, nothing bound."""
    if inputs is None:
        return {}
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params[inputs:]
            if p.default is not p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _drop_bound(graph: fx.Graph, bound: dict[str, Any], inputs: int) -> None:
    """Remove the placeholders fx keeps for ``concrete_args`` (those after the first ``inputs``, named after a
    bound parameter) and the checks of their values it adds: the values are the defaults, never given."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][inputs:]
    dead: set[fx.Node] = set()
    todo = [n for n in placeholders if str(n.target).rsplit("_", 1)[0] in bound]
    while todo:
        n = todo.pop()
        if n not in dead:
            dead.add(n)
            todo.extend(n.users)
    for n in reversed(list(graph.nodes)):
        if n in dead:
            graph.erase_node(n)


def trace(model: torch.nn.Module, leaf_modules: Sequence[type | str] = (), *,
          explain: bool = True, inputs: int | None = None,
          example_shapes: Sequence[Sequence[int]] | None = None) -> fx.GraphModule:
    """Trace ``model`` into a GraphModule or raise UnsupportedModelError listing every problem.

    ``example_shapes`` (the model inputs' shapes, in order): where the model can't be traced with
    symbolic shapes, it is traced again with its inputs' shapes as constants (:class:`ShapedProxy`: a
    ``b, t = idx.size()`` and an ``assert`` on them), the graph then fixed to those shapes.
    ``explain=False`` raises as soon as the model is found untraceable, without :func:`diagnose`'s
    module-by-module search for every problem (seconds on a Hugging Face model): what ``trace_any``
    does when another front end may still capture the model, so the list is only made for an error.
    ``inputs``: how many positional inputs the model is given; later parameters keep their defaults
    (:func:`defaults_after`)."""
    bound = defaults_after(model, inputs)
    gm = _try_trace(model, leaf_modules, None, bound, inputs)
    shapes = None
    if (gm is None or host_syncs(gm)) and example_shapes is not None:
        shaped = _try_trace(model, leaf_modules, example_shapes, bound, inputs)
        if shaped is not None and not host_syncs(shaped):
            gm, shapes = shaped, example_shapes
        elif gm is None:
            gm, shapes = shaped, example_shapes
    offences = host_syncs(gm) if gm is not None else []
    if not explain and (gm is None or offences):
        raise UnsupportedModelError(f"{type(model).__name__} can't be traced by torch.fx")
    if gm is None:
        offences = diagnose(model, leaf_modules, bound, example_shapes)
    elif offences:
        offences = diagnose(model, leaf_modules, bound, shapes) or offences
    if offences:
        raise UnsupportedModelError(format_offences(type(model).__name__, offences))
    if gm is None:  # traced, but forward takes inputs the example does not give (a **kwargs)
        raise UnsupportedModelError(f"{type(model).__name__}: forward takes more inputs than the example gives "
                                    f"({inputs}); give them in example_inputs or example_kwargs, or use "
                                    f"frontend='export'")
    return gm


def _try_trace(model: torch.nn.Module, leaf_modules: Sequence[type | str],
               example_shapes: Sequence[Sequence[int]] | None, bound: dict[str, Any],
               inputs: int | None) -> fx.GraphModule | None:
    """``model`` traced by :class:`PdTracer` (``bound``: parameters held at their defaults), or None where fx fails."""
    tracer = PdTracer(leaf_modules, example_shapes=example_shapes)
    try:
        graph = tracer.trace(model, concrete_args=bound or None)
        _drop_bound(graph, bound, inputs or 0)
        if inputs is not None and len([n for n in graph.nodes if n.op == "placeholder"]) > inputs:
            return None  # forward takes more than the example gives (a ``**kwargs``): not this front end's to guess
        return fx.GraphModule(tracer.root, graph, model.__class__.__name__)
    except Exception:  # noqa: BLE001
        return None


def format_offences(model_name: str, offences: Sequence[Offence]) -> str:
    lines = [f"{model_name} can't be traced into a pipeline: {len(offences)} construct(s) found"]
    lines += [f"  {i}. {o}" for i, o in enumerate(offences, 1)]
    return "\n".join(lines)
