"""The ``trace-loss`` pass: the user's ``loss_fn(output, target)`` -> a GraphModule the last stage runs.

Any callable returning a scalar tensor (function, lambda, closure, ``functools.partial``,
``nn.Module``) is traced so the emitted program holds the loss as source (class ``Loss`` in the
last ``stage_K.py``, captured tensors in ``loss.pt``) rather than a pickle or an importable class
path. The loss runs as Python runs it: ``make_fx`` calls it once on the concrete example output,
presented as the model presents it (a tensor, a dict or tuple, or the model's ``ModelOutput`` holding
the one tensor the last stage returns, :class:`~pdcompile.passes.export_frontend.OutputView`), so
``hasattr``/``getattr``/``isinstance`` and indexing decide as in eager and the graph records the
tensor ops taken. A loss that syncs with the host there (``.item()``, ``if`` on a value) is traced
by torch.fx, then ``torch.export``, as before (a value read only for logging drops out). Refused with
:class:`UsageError` naming construct and fix: host syncs that reach the result, Python control flow
on tensor values, a non-scalar result, parameters that require grad, a trace that disagrees with
calling ``loss_fn`` on the example.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx

from pdcompile.errors import PdcompileError, UsageError
from pdcompile.ir import CompileState, TensorMeta, need
from pdcompile.passes.codegen import object_spec
from pdcompile.passes.export_frontend import OutputView
from pdcompile.passes.split_stages import follow_device
from pdcompile.passes.fx_frontend import host_syncs, user_frame

_HOST_SYNC_OPS = ("aten::_local_scalar_dense", "aten::item")
_FIX = ("write the loss with tensor operations only: no .item()/float()/.tolist(), no Python if/while on a "
        "tensor's value (use torch.where), nothing read from outside but constants")


class LossTraceError(UsageError):
    """Neither torch.fx nor torch.export can capture the loss (host syncs, control flow on values)."""


@dataclass(frozen=True)
class TracedLoss:
    """The loss as a GraphModule ``forward(output, target) -> scalar``, and the front end that traced it."""

    gm: fx.GraphModule
    frontend: str  # "fx" or "export"

    def __str__(self) -> str:
        return f"loss traced by {self.frontend}\n" + self.gm.code.strip()


class _LossWrapper(torch.nn.Module):
    """``(output, target) -> loss_fn(output, target)``, with ``output.<key>`` being ``output`` itself."""

    def __init__(self, fn: Callable[..., Any], key: str | None) -> None:
        super().__init__()
        self.fn = fn  # an nn.Module is registered (and traced through); a function is kept as is
        self.pd_key = key

    def forward(self, output: Any, target: Any) -> Any:
        if self.pd_key is not None:  # the model's out.logits is the tensor the last stage returns
            object.__setattr__(output, self.pd_key, output)
        return self.fn(output, target)


class _ThroughTracer(fx.Tracer):
    """fx.Tracer that traces through every module: the loss ends as functional code."""

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        return False


def loss_name(fn: Any) -> str:
    """A readable name of the loss for messages."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    inner = getattr(fn, "func", fn)  # functools.partial
    return getattr(inner, "__qualname__", None) or type(fn).__name__


def example_output(meta: Any, seed: int = 0, *, on_meta: bool = False) -> Any:
    """A tensor (or the structure of tensors) ``meta`` describes, with seeded random values
    (``on_meta``: on the meta device, without values)."""
    g = torch.Generator().manual_seed(seed)
    if isinstance(meta, TensorMeta):
        dtype = getattr(torch, meta.dtype.replace("torch.", ""))
        if on_meta:
            return torch.empty(meta.shape, dtype=dtype, device="meta")
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(meta.shape, generator=g).to(dtype)
        return torch.zeros(meta.shape, dtype=dtype)
    if isinstance(meta, dict):
        return {k: example_output(v, seed + i, on_meta=on_meta) for i, (k, v) in enumerate(meta.items())}
    if isinstance(meta, (tuple, list)):
        values = [example_output(v, seed + i, on_meta=on_meta) for i, v in enumerate(meta)]
        if hasattr(meta, "_fields"):  # a namedtuple keeps its type
            return type(meta)(*values)
        return tuple(values) if isinstance(meta, tuple) else values
    return meta


def trace_loss(loss_fn: Any, output: Any, target: torch.Tensor, *, output_key: str | None = None,
               view: OutputView | None = None, values: bool = True) -> TracedLoss:
    """Trace ``loss_fn`` applied to the last stage's ``output`` (an example value) and ``target``
    (one microbatch of targets) into a :class:`TracedLoss`, or raise :class:`UsageError` saying why.
    ``view`` (else ``output_key``) says how the model's output holds the tensor the last stage returns.
    On meta tensors, a failure that values would decide is raised (for a trace on values) where
    ``values``, else the symbolic front ends trace it (a model on meta: no values anywhere)."""
    name = loss_name(loss_fn)
    if not callable(loss_fn):
        raise UsageError(f"pdcompile: loss_fn must be a callable (output, target) -> scalar tensor, "
                         f"got {type(loss_fn).__name__}")
    if isinstance(loss_fn, torch.nn.Module):  # named as the user knows them, before tracing renames them
        _refuse_trainable([n for n, p in loss_fn.named_parameters() if p.requires_grad], name)
    key = output_key if output_key is not None and not hasattr(torch.Tensor, output_key) else None
    present = _presenter(view, output_key, output)
    try:
        traced = _concrete(loss_fn, present, output, target)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - a host sync or a failing Python check: the symbolic front ends say which
        if target.is_meta and values and _about_meta(e):
            raise  # a value read, or a tensor of another device: values decide (loss_program)
        traced = _symbolic(loss_fn, key, output, target, name)
    _check(traced, loss_fn, present, output, target, name)
    return traced


def _about_meta(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is the meta device's doing: a value read (``.item()``, ``bool``,
    ``.tolist()``) or a tensor on another device; torch's messages name the meta device."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if "meta" in str(cur).lower():
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _symbolic(loss_fn: Any, key: str | None, output: Any, target: torch.Tensor, name: str) -> TracedLoss:
    """The loss traced on proxies: torch.fx, else torch.export (a tensor output)."""
    try:
        return _fx(loss_fn, key, isinstance(output, torch.Tensor))
    except UsageError:
        raise
    except Exception as fx_error:  # noqa: BLE001 - try torch.export below, report both
        if not isinstance(output, torch.Tensor):
            raise LossTraceError(f"pdcompile: loss_fn {name} can't be traced: torch.fx: {_why(fx_error)}. "
                                 f"Fix: {_FIX}") from fx_error
        try:
            return _export(loss_fn, key, output, target)
        except UsageError:
            raise
        except Exception as ex_error:  # noqa: BLE001
            raise LossTraceError(f"pdcompile: loss_fn {name} can't be traced: torch.fx: {_why(fx_error)}; "
                                 f"torch.export: {_why(ex_error)}. Fix: {_FIX}") from ex_error


class _Keyed(dict):  # type: ignore[type-arg]
    """A model output known only by its key: ``out.logits`` and ``out["logits"]`` are the tensor."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _presenter(view: OutputView | None, key: str | None, output: Any) -> Callable[[Any], Any]:
    """What the loss is called with for the last stage's ``output``: the model's own output structure."""
    if view is not None and isinstance(output, torch.Tensor):
        return view.present
    if key is not None and isinstance(output, torch.Tensor):
        return lambda t: _Keyed({key: t})
    return lambda out: out


def _concrete(loss_fn: Any, present: Callable[[Any], Any], output: Any, target: torch.Tensor) -> TracedLoss:
    """``loss_fn`` run once by ``make_fx`` on the real example: Python-level checks decide as in eager,
    the tensor ops are recorded. The graph takes ``(output, target)`` as the last stage hands them over."""
    fn = _private(loss_fn)

    def call(out: Any, tgt: torch.Tensor) -> torch.Tensor:
        got = fn(present(out), tgt)
        if not isinstance(got, torch.Tensor):
            raise UsageError(f"pdcompile: loss_fn {loss_name(loss_fn)} returns {type(got).__name__}; a pipeline "
                             f"needs a scalar floating-point tensor. Fix: return the loss tensor")
        return got

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = make_fx(call, tracing_mode="real", record_stack_traces=True)(output, target)
    return TracedLoss(_flat(_as_loss_graph(traced, output)), "make_fx")


def _as_loss_graph(traced: fx.GraphModule, output: Any) -> fx.GraphModule:
    """``traced`` (placeholders: the leaves of ``output``, then the target) as ``forward(output, target)``,
    each leaf read from ``output`` by its key path."""
    paths = [p for p, _ in pytree.tree_flatten_with_path(output)[0]]
    g = fx.Graph()
    out_ph, tgt_ph = g.placeholder("output"), g.placeholder("target")
    env: dict[fx.Node, fx.Node] = {}
    phs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(paths) + 1:  # pragma: no cover - make_fx flattens its inputs with pytree
        raise RuntimeError(f"make_fx gave {len(phs)} inputs for {len(paths)} output tensors and a target")
    for ph, path in zip(phs, paths):
        node = out_ph
        for k in path:
            if isinstance(k, pytree.SequenceKey):
                node = g.call_function(operator.getitem, (node, k.idx))
            elif isinstance(k, pytree.MappingKey):
                node = g.call_function(operator.getitem, (node, k.key))
            else:
                node = g.call_function(getattr, (node, str(getattr(k, "name"))))
        env[ph] = node
    env[phs[-1]] = tgt_ph
    for n in traced.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            flat = pytree.tree_leaves(n.args[0])
            g.output(env[flat[0]] if len(flat) == 1 else tuple(env[a] for a in flat))
            break
        env[n] = g.node_copy(n, lambda a: env[a])
    g.eliminate_dead_code()
    gm = fx.GraphModule(traced, g, "Loss")
    return gm


def _why(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    where = user_frame(e.__traceback__)
    return f"{type(e).__name__}: {msg}" + (f" (at {where})" if where else "")


def _private(loss_fn: Any) -> Any:
    """A copy of an nn.Module loss to trace: tracing runs its forward on proxies, and whatever it assigns
    (``self.last = loss.item()``) must not land on the user's module."""
    if not isinstance(loss_fn, torch.nn.Module):
        return loss_fn
    try:
        return copy.deepcopy(loss_fn)
    except Exception:  # noqa: BLE001 - an uncopyable module is traced as it is
        return loss_fn


def _fx(loss_fn: Any, key: str | None, tensor_output: bool) -> TracedLoss:
    wrapper = _LossWrapper(_private(loss_fn), key)
    tracer = _ThroughTracer()
    tracer.record_stack_traces = True
    graph = tracer.trace(wrapper)
    gm = fx.GraphModule(tracer.root, graph, "Loss")
    out_ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    for n in list(gm.graph.nodes):  # out["logits"]: the output itself, like out.logits
        if n.op != "call_function" or n.target not in (getattr, operator.getitem) or len(n.args) < 2 \
                or n.args[0] is not out_ph or not isinstance(n.args[1], str):
            continue
        field = n.args[1]
        if field == key:
            n.replace_all_uses_with(out_ph)
            gm.graph.erase_node(n)
        elif tensor_output and not hasattr(torch.Tensor, field):
            raise UsageError(
                f"pdcompile: loss_fn {loss_name(loss_fn)} reads output.{field} (or output[{field!r}]), but the "
                f"last stage returns only one tensor of the model's output"
                f"{f' (its {key!r})' if key else ''}. Fix: compute the loss from that tensor, or choose "
                f"another model output with output=")
    gm.graph.eliminate_dead_code()  # what the loss computes but never uses (a .item() kept for logging) goes
    syncs = host_syncs(gm)
    if syncs:
        found = "; ".join(f"{o.detail}{f' at {o.where}' if o.where else ''}" for o in syncs)
        raise LossTraceError(f"pdcompile: loss_fn {loss_name(loss_fn)} can't be traced: host sync: {found}. "
                             f"Fix: {_FIX}")
    return TracedLoss(_flat(gm), "fx")


def _export(loss_fn: Any, key: str | None, output: torch.Tensor, target: torch.Tensor) -> TracedLoss:
    from pdcompile.passes.export_frontend import export_trace

    try:
        gm = export_trace(_LossWrapper(_private(loss_fn), key), (output, target))
    except PdcompileError as e:
        cause = e.__cause__ if e.__cause__ is not None else e
        raise RuntimeError(_why(cause) if cause is not e else str(e).split(". Fix:")[0]) from cause
    for n in gm.graph.nodes:
        if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.name in _HOST_SYNC_OPS:
            raise LossTraceError(f"pdcompile: loss_fn {loss_name(loss_fn)} can't be traced: host sync "
                                 f"({n.target._schema.name}: .item() or float() of a tensor). Fix: {_FIX}")
    return TracedLoss(_flat(gm), "export")


def _flat(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose tensors are top-level attributes (``fn.weight`` -> ``fn_weight``), the
    form the emitted class declares them in."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    attrs: dict[str, Any] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj: Any = gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part)
            flat = str(n.target).replace(".", "_")
            while flat in attrs and attrs[flat] is not obj:
                flat += "_"
            attrs[flat] = obj
            env[n] = g.get_attr(flat)
        elif n.op == "call_module":  # pragma: no cover - the tracer traces through every module
            raise UsageError(f"pdcompile: loss_fn keeps module {n.target!r} whole; it can't be emitted")
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
        env[n].meta = {k: v for k, v in n.meta.items() if k in ("stack_trace",)}
        env[n].type = None  # the wrapper's annotations (Any) are not the emitted code's business
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    follow_device(g, placeholders[-1] if placeholders else None)  # what it creates goes where the target is
    return fx.GraphModule(attrs, g, "Loss")


def _check(traced: TracedLoss, loss_fn: Any, present: Callable[[Any], Any], output: Any, target: torch.Tensor,
           name: str) -> None:
    """The traced loss must train nothing of its own, return a scalar, and equal ``loss_fn`` on the example
    (an example on the meta device has no values to compare: only the rest is checked)."""
    _refuse_trainable([n for n, p in traced.gm.named_parameters() if p.requires_grad], name)
    dev = next((t.device for t in traced.gm.buffers()), torch.device("meta" if target.is_meta else "cpu"))
    out = _to(output, dev)
    tgt = target.to(dev)
    try:
        got = traced.gm(out, tgt)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"pdcompile: the traced loss_fn {name} fails on the example output and target: "
                         f"{_why(e)}. Fix: check the loss against the model's output and the target's shape") from e
    if not isinstance(got, torch.Tensor) or got.numel() != 1 or not got.is_floating_point():
        what = f"a tensor of shape {tuple(got.shape)}, {got.dtype}" if isinstance(got, torch.Tensor) \
            else type(got).__name__
        raise UsageError(f"pdcompile: loss_fn {name} returns {what}; a pipeline needs a scalar floating-point "
                         f"tensor. Fix: reduce it (reduction='mean', .mean() or .sum())")
    if got.is_meta:
        return
    try:
        view = present(_to(output, dev))
        with warnings.catch_warnings():  # out["logits"] on the plain tensor warns, then fails
            warnings.simplefilter("ignore")
            want = loss_fn(view, tgt)
    except Exception:  # noqa: BLE001 - e.g. out["logits"] on the plain tensor: the graph already says what it does
        return
    if isinstance(want, torch.Tensor) and want.numel() == 1:
        a, b = float(got.detach()), float(want.detach())
        if not (math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) or (math.isnan(a) and math.isnan(b))):
            raise UsageError(f"pdcompile: the traced loss_fn {name} gives {a} on the example, calling it gives {b}: "
                             f"it depends on something tracing can't see (global state, randomness). Fix: {_FIX}")


def _refuse_trainable(trainable: list[str], name: str) -> None:
    if trainable:
        raise UsageError(f"pdcompile: loss_fn {name} has trainable parameters {trainable}; the pipeline trains "
                         f"only the model's. Fix: make them part of the model, or requires_grad_(False)")


def _to(value: Any, dev: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dev)
    if isinstance(value, dict):
        return {k: _to(v, dev) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, dev) for v in value)
    return copy.copy(value)


@dataclass(frozen=True)
class LossProgram:
    """The loss the last stage runs: ``traced``, and its ``plan.json`` entry. ``traced`` is None for an
    nn.Module loss neither front end captures but whose class rebuilds it (named by class path)."""

    traced: TracedLoss | None
    entry: dict[str, Any]

    def __str__(self) -> str:
        if self.traced is not None:
            return str(self.traced)
        return f"loss by class path (not traced): {json.dumps(self.entry)}"


def loss_program(loss_fn: Any, last_stage: fx.GraphModule, target: torch.Tensor,
                 output_key: str | None, *, values: bool = True) -> LossProgram:
    """``loss_fn`` traced on what ``last_stage`` returns (presented as its ``meta["pd.output_view"]`` says)
    and one microbatch ``target``.

    A target on the meta device (a model compiled without data) is traced on meta tensors first (a
    Llama-3's logits need no 2 GiB of values; :func:`trace_loss` on meta tensors); where anything
    fails there, as before: on random values of the output and zeros of the target on the CPU, which
    decides and reports. ``values=False`` (a model on meta, whatever device the target is on): only
    on meta tensors, never on values (32 x 4096 x 128256 logits are 16 GiB); what the meta trace
    cannot decide, torch.fx and torch.export decide on proxies."""
    meta = fx.node.map_aggregate(last_stage.graph.output_node().args[0],
                                 lambda a: a.meta.get("pd.tensor") if isinstance(a, fx.Node) else a)
    view = last_stage.meta.get("pd.output_view")
    if target.is_meta or not values:
        on_meta = target if target.is_meta else torch.empty(target.shape, dtype=target.dtype, device="meta")
        try:
            traced = trace_loss(loss_fn, example_output(meta, on_meta=True), on_meta, output_key=output_key,
                                view=view, values=values)
            return LossProgram(traced, {"traced": traced.frontend, "from": loss_name(loss_fn)})
        except LossTraceError as e:
            if not values:
                return _by_class_path(loss_fn, e)
        except Exception:  # noqa: BLE001 - decided, and reported, on values below
            if not values:
                raise
        target = torch.zeros(target.shape, dtype=target.dtype)
    try:
        traced = trace_loss(loss_fn, example_output(meta), target, output_key=output_key, view=view)
    except LossTraceError as e:
        return _by_class_path(loss_fn, e)
    return LossProgram(traced, {"traced": traced.frontend, "from": loss_name(loss_fn)})


def _by_class_path(loss_fn: Any, e: LossTraceError) -> LossProgram:
    """An nn.Module loss neither front end captures, named by its class path (rebuilt by the ranks);
    else ``e``, which says what to fix."""
    if not isinstance(loss_fn, torch.nn.Module):
        raise e
    try:
        return LossProgram(None, {**object_spec(loss_fn).to_json(), "traced": None, "why": str(e)})
    except Exception:  # noqa: BLE001 - neither way: the tracing error says what to fix
        raise e from None


@dataclass(frozen=True)
class TraceLossOptions:
    loss_fn: Any  # (output, target) -> scalar tensor
    target: torch.Tensor  # one microbatch of targets


def run(state: CompileState, opts: TraceLossOptions) -> CompileState:
    """Reads the last stage of ``stages`` and ``output_key``; writes ``loss``."""
    last = need(state.stages, "stages").stages[-1].gm
    on_meta = any(t.is_meta for t in itertools.chain(state.model.parameters(), state.model.buffers()))
    return state.replace(loss=loss_program(opts.loss_fn, last, opts.target, state.output_key, values=not on_meta))
