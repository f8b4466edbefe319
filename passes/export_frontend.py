"""export-trace: nn.Module -> flat torch.fx.GraphModule of aten ops, through ``torch.export``.

The second front end of the trace pass, for models ``torch.fx.symbolic_trace`` can't trace
(Hugging Face ``transformers`` models: "co_varnames is too small", ``**kwargs`` plumbing, ...).
``torch.export.export(model, args, strict=False)`` runs the model once and records every aten op;
this pass turns that program into the same IR the fx front end produces, so propagate-shapes,
annotate-costs, linearize, split-stages and emit work on it unchanged. The rules of the graph it
returns (inputs, parameters, ops, output, state updates, what is rejected): :func:`export_trace`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind, TensorArgument

from pdcompile.errors import UnsupportedModelError, UsageError

DEFAULT_OUTPUT_KEYS = ("logits", "last_hidden_state")
_KEEP_META = ("stack_trace", "nn_module_stack", "torch_fn")
_ASSERT_OPS = {
    "aten::_assert_tensor_metadata", "aten::_assert_scalar", "aten::_assert_async",
    "aten::sym_constrain_range", "aten::sym_constrain_range_for_size", "aten::_functional_assert_async",
}


@dataclass(frozen=True)
class OutputView:
    """How the model's output holds the one tensor the graph returns: ``container`` (a ``ModelOutput``,
    dict, namedtuple or tuple) with that tensor at ``key`` (a key, or a position among ``length``).
    The loss is called with :meth:`present` of the tensor, so it reads the output as in eager."""

    container: type
    key: str | int
    length: int

    def present(self, tensor: torch.Tensor) -> Any:
        """The model's output structure holding ``tensor`` at ``key`` (other entries None or absent)."""
        c = self.container
        if isinstance(self.key, int):
            values = [tensor if i == self.key else None for i in range(self.length)]
            return c(*values) if hasattr(c, "_fields") else (list(values) if issubclass(c, list) else tuple(values))
        if dataclasses.is_dataclass(c):  # a transformers ModelOutput: the other fields default to None
            try:
                return c(**{self.key: tensor})
            except Exception:  # noqa: BLE001 - required fields: a mapping with only this key
                return {self.key: tensor}
        return {self.key: tensor} if c in (dict,) or not issubclass(c, dict) else c({self.key: tensor})


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs warnings and graph dumps while it captures; our errors say what matters."""
    loggers = [logging.getLogger(n) for n in ("torch", "torch._dynamo", "torch.export", "torch._export",
                                              "torch.fx.experimental.symbolic_shapes")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """torch.export without the Python stack trace of every op (``torch.fx.config.do_not_emit_stack_traces``):
    recording them is a fifth of the capture's time, and nothing reads them from an exported graph
    (the emitted code carries none; errors about the graph name nodes)."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _without_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    """A transformers model captured for training, without its KV cache: ``config.use_cache`` off
    for the capture only (training never reads the cache; exported, it is a DynamicCache output that
    no stage can send), and the user's config as it was afterwards."""
    configs: dict[int, Any] = {}
    for m in model.modules():
        cfg: Any = getattr(m, "config", None)
        if getattr(cfg, "use_cache", None) is True:
            configs[id(cfg)] = cfg
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def export_trace(model: torch.nn.Module, example_inputs: Sequence[Any] | torch.Tensor, *,
                 kwargs: Mapping[str, Any] | None = None, output: str | int | None = None,
                 loss_probe: LossProbe | None = None) -> fx.GraphModule:
    """Capture ``model(*example_inputs, **kwargs)`` with ``torch.export`` as a flat GraphModule.

    ``output`` picks the tensor the graph returns when the model returns a structure: a key of a
    mapping/``ModelOutput`` or a position in a tuple. Without it, the one entry ``loss_probe``'s loss
    reads (``out[1]``, ``out.loss``: a model that computes its own loss; :func:`loss_choice`), else
    ``"logits"``, else ``"last_hidden_state"``; a plain tensor is kept, anything else needs ``output=``. Raises
    :class:`UnsupportedModelError` naming the construct and the fix.

    The graph is rebuilt from ``ep.graph`` and its signature, not from ``ep.module()``, so no
    pytree plumbing or guard call survives. The model is captured in its current mode
    (``train()``: dropout is an ``aten.dropout`` node that draws its own masks in each stage).

    * Placeholders are the tensor inputs, ``args`` then the tensors of ``kwargs``, in order;
      non-tensor inputs (``None``, ints, bools) are baked into the graph.
    * Parameters and buffers are ``get_attr`` nodes on the model's qualified names, holding its own
      tensors: tied weights are one Parameter, so split-stages records them as tied. Tensor
      constants created inside ``forward`` become buffers named ``_pd_constant_<i>``.
    * Ops are ``call_function`` nodes on aten overloads (the training IR, not decomposed) and
      ``operator.getitem``. Runtime shape assertions are dropped, so the graph is specialised to
      the example's batch size (trace with one *microbatch*). Outputs not selected are removed.
    * ``node.meta`` keeps only plain data (no fake tensors under ``val``), so ``copy``,
      ``deepcopy`` and ``Graph.node_copy`` work; propagate-shapes writes real metadata afterwards.
      There are no leaf modules: export inlines every module down to aten ops.
    * State updates stay in-place aten ops on the model's buffers (``aten.batch_norm``'s running
      stats, ``aten.copy_``): not functionalised, and kept by dead-code elimination. Each stage
      holds its own copy of a buffer, so one updated in one stage and read in another drifts.
    * A transformers model is captured without its KV cache (``config.use_cache`` off while it runs,
      then restored).
    * Rejected, with the reason and the fix: outputs that write back state (a functionalised
      program), higher-order ops (``torch.cond``, ``torch.no_grad()`` inside ``forward``),
      script-object inputs.
    """
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    try:
        with _quiet_torch_logs(), _no_stack_traces(), _without_kv_cache(model):
            ep = torch.export.export(model, args, dict(kwargs or {}), strict=False)
    except Exception as e:  # noqa: BLE001 - reported with the cause
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UnsupportedModelError(
            f"export-trace: torch.export.export could not capture {type(model).__name__}: "
            f"{type(e).__name__}: {msg}. Fix: make forward() traceable by torch.export (no data-dependent "
            f"Python control flow){_binding_note(model, args)}"
        ) from e
    if output is None and loss_probe is not None:
        output = loss_choice(ep, loss_probe)
    return _flatten_program(model, ep, output)


@dataclass(frozen=True)
class LossProbe:
    """The user's ``loss_fn`` and one microbatch of targets (None: not known yet), to find which entry of
    the model's output the loss reads (:func:`loss_choice`)."""

    loss_fn: Any
    target: torch.Tensor | None = None


def loss_choice(ep: torch.export.ExportedProgram, probe: LossProbe) -> str | int | None:
    """The key (or position) of the one output entry ``probe.loss_fn`` reads, run on meta tensors shaped
    like the model's outputs, presented in its own output type: the entry it returns itself (``out[1]``,
    ``out.loss``), else the only one a torch function reads. None where the model returns one tensor,
    where the loss reads several entries or none, or fails on the probe (the default choice then holds)."""
    spec = ep.call_spec.out_spec
    if spec is None or spec.is_leaf():
        return None
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    flat = list(out_node.args[0])  # type: ignore[arg-type]  # an output node's args[0] is a sequence
    leaves: list[Any] = []
    for a in flat:
        val = a.meta.get("val") if isinstance(a, fx.Node) else a
        leaves.append(torch.empty(val.shape, dtype=val.dtype, device="meta") if isinstance(val, torch.Tensor) else val)
    try:
        structure = pytree.tree_unflatten(leaves, spec)
        paths = [p for p, _ in pytree.tree_flatten_with_path(structure)[0]]
    except Exception:  # noqa: BLE001 - an output type pytree can't rebuild: the default choice
        return None
    tensors = {id(t): i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
    target = probe.target.to("meta") if probe.target is not None else torch.empty((0, 0), device="meta")
    read: set[int] = set()
    try:
        with _Reads(tensors, read), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = probe.loss_fn(structure, target)
    except Exception:  # noqa: BLE001 - the loss needs real values or another target: the default choice
        return None
    chosen = {tensors[id(got)]} if id(got) in tensors else read
    if len(chosen) != 1:
        return None
    path = paths[next(iter(chosen))]
    if len(path) != 1:
        return None
    key = path[0]
    if isinstance(key, pytree.SequenceKey):
        return key.idx
    if isinstance(key, pytree.MappingKey):
        return key.key if isinstance(key.key, (str, int)) else None
    return str(getattr(key, "name", "")) or None


class _Reads(torch.overrides.TorchFunctionMode):
    """Notes which of the tensors ``tensors`` (id -> position) a torch function reads."""

    def __init__(self, tensors: Mapping[int, int], read: set[int]) -> None:
        super().__init__()
        self.tensors, self.read = tensors, read

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for a in pytree.tree_leaves((args, kwargs or {})):
            if id(a) in self.tensors:
                self.read.add(self.tensors[id(a)])
        return func(*args, **(kwargs or {}))


def _binding_note(model: torch.nn.Module, args: tuple[Any, ...]) -> str:
    """With several inputs, the forward() parameters they landed on: a tensor given positionally may reach a
    parameter that is not the one meant (GPT-2's second is ``past_key_values``, not ``attention_mask``)."""
    if len(args) < 2:
        return ""
    try:
        names = list(inspect.signature(model.forward).bind_partial(*args).arguments)
    except (TypeError, ValueError):
        return ""
    return (f"; the example inputs are passed positionally, as {type(model).__name__}.forward("
            f"{', '.join(names)}): if one is meant for another parameter, give it by name in "
            f"example_kwargs={{'NAME': tensor}}")


def _flatten_program(model: torch.nn.Module, ep: torch.export.ExportedProgram,
                     output: str | int | None) -> fx.GraphModule:
    """Rebuild ``ep.graph`` with get_attr nodes for the lifted parameters/buffers/constants."""
    name = type(model).__name__
    sig = ep.graph_signature
    problems = [f"{s.kind.name.lower()} {s.target!r}" for s in sig.output_specs
                if s.kind not in (OutputKind.USER_OUTPUT,)]
    if problems:
        raise UnsupportedModelError(
            f"export-trace: {name}.forward mutates state ({', '.join(problems)}); a pipeline stage can't "
            f"write back into the model. Fix: update the state in place (buffer.copy_(...)), call model.eval(), "
            f"or use frontend='fx' with the module kept whole (leaf_modules=[...])"
        )
    g = fx.Graph()
    attrs: dict[str, torch.Tensor] = {}
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sig.input_specs):
        raise UnsupportedModelError(f"export-trace: {name}: {len(placeholders)} graph inputs but "
                                    f"{len(sig.input_specs)} input specs; torch.export changed its format")
    # Model inputs first (in order), then the weights as get_attr nodes.
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind is InputKind.USER_INPUT:
            if isinstance(spec.arg, ConstantArgument):
                env[node] = spec.arg.value
            elif isinstance(spec.arg, TensorArgument):
                env[node] = g.placeholder(node.name)
                env[node].meta = _clean_meta(node.meta)
            else:
                raise UnsupportedModelError(
                    f"export-trace: input {node.name!r} of {name} is a {type(spec.arg).__name__}; only tensors "
                    f"and constants can be model inputs. Fix: pass tensors (shapes fixed by the example)")
    n_const = 0
    for node, spec in zip(placeholders, sig.input_specs):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            assert spec.target is not None
            attrs[spec.target] = _model_tensor(model, ep, spec.target)
            env[node] = g.get_attr(spec.target)
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            assert spec.target is not None
            target = f"_pd_constant_{n_const}"
            n_const += 1
            attrs[target] = ep.constants[spec.target].detach().clone()
            env[node] = g.get_attr(target)
        elif spec.kind is not InputKind.USER_INPUT:
            raise UnsupportedModelError(
                f"export-trace: {name} takes a {spec.kind.name.lower()} input {node.name!r} (a script object or "
                f"token); pipelines need plain tensors. Fix: use frontend='fx' and keep that module whole")
    out_node: fx.Node | None = None
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            out_node = node
            break
        if node.op == "get_attr" or (node.op == "call_function" and
                                     isinstance(node.target, torch._ops.HigherOrderOperator)):
            raise UnsupportedModelError(
                f"export-trace: {name} contains a higher-order op ({node.format_node()}); its body is a "
                f"nested graph that can't be split. Fix: remove torch.no_grad()/autocast/torch.cond regions "
                f"from forward(), or use frontend='fx' and keep that module whole (leaf_modules=[...])")
        if node.op != "call_function":
            raise UnsupportedModelError(f"export-trace: unexpected {node.op} node {node.name!r} in {name}'s "
                                        f"exported graph; torch.export changed its format")
        if _is_assertion(node):
            continue
        new = g.node_copy(node, lambda a: env[a])
        new.meta = _clean_meta(node.meta)
        env[node] = new
    assert out_node is not None
    flat_outs = list(out_node.args[0])  # type: ignore[arg-type]  # an output node's args[0] is a sequence
    chosen = flat_outs[_output_index(ep.call_spec.out_spec, output, name)]
    if not isinstance(chosen, fx.Node) or chosen not in env or not isinstance(env[chosen], fx.Node):
        raise UnsupportedModelError(f"export-trace: the selected output of {name} is not a computed tensor "
                                    f"({chosen!r}). Fix: choose another with output=")
    g.output(env[chosen])
    g.eliminate_dead_code()
    g.lint()
    gm = fx.GraphModule(attrs, g, name)
    # The key the model's output structure names the tensor by ("logits"), so a loss written
    # against the model's own output (``out.logits``) can be traced onto the tensor the last stage returns.
    gm.meta["pd.output_key"] = _output_key(ep.call_spec.out_spec, output)
    gm.meta["pd.output_view"] = _output_view(ep.call_spec.out_spec, output, name)
    return gm


def _output_view(spec: Any, output: str | int | None, name: str) -> OutputView | None:
    """The :class:`OutputView` of the selected tensor; None when the model returns that tensor alone."""
    if spec.is_leaf():
        return None
    _output_index(spec, output, name)  # checks the choice
    children = _children(spec)
    keys = _keys(spec) or []
    if isinstance(output, int):
        index = output % len(children)
    else:
        index = keys.index(output if output is not None else next(k for k in DEFAULT_OUTPUT_KEYS if k in keys))
    key: str | int = keys[index] if keys and not hasattr(spec.type, "_fields") else index
    return OutputView(spec.type, key, len(children))


def _output_key(spec: Any, output: str | int | None) -> str | None:
    """The key (of a mapping / ``ModelOutput`` output) of the selected tensor; None for a tensor or a position."""
    if spec.is_leaf() or isinstance(output, int):
        return None
    keys = _keys(spec)
    if isinstance(output, str):
        return output
    found = next((k for k in DEFAULT_OUTPUT_KEYS if keys and k in keys), None)
    return found if isinstance(found, str) else None


def _model_tensor(model: torch.nn.Module, ep: torch.export.ExportedProgram, target: str) -> torch.Tensor:
    """The model's own Parameter/buffer object at ``target`` (so tied weights stay one object)."""
    obj: Any = model
    try:
        for part in target.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        obj = ep.state_dict.get(target, ep.constants.get(target))
    if not isinstance(obj, torch.Tensor):
        raise UnsupportedModelError(f"export-trace: {target!r} is not a tensor of {type(model).__name__}")
    return obj


def _is_assertion(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.name in _ASSERT_OPS \
        and not node.users


def _clean_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Only plain, copyable metadata (fake tensors and symbolic shapes are dropped)."""
    out: dict[str, Any] = {}
    for k in _KEEP_META:
        if k in meta:
            v = meta[k]
            out[k] = dict(v) if isinstance(v, dict) else v
    return out


def _output_index(spec: Any, output: str | int | None, model_name: str) -> int:
    """Position, among the flattened outputs described by pytree ``spec``, of the chosen tensor."""
    if spec.is_leaf():
        if output is not None:
            raise UsageError(f"export-trace: {model_name} returns a single tensor; drop output={output!r}")
        return 0
    children = _children(spec)
    keys = _keys(spec) or []
    if output is None:
        found = next((k for k in DEFAULT_OUTPUT_KEYS if k in keys), None)
        if found is None:
            raise UnsupportedModelError(
                f"export-trace: {model_name} returns a {spec.type.__name__} with {len(children)} entries "
                f"{keys or ''}; a pipeline's last stage returns one tensor. Fix: pass output=KEY or "
                f"output=INDEX to choose it")
        pos = keys.index(found)
    elif isinstance(output, str):
        if not keys or output not in keys:
            raise UsageError(f"export-trace: output={output!r}: {model_name}'s output has keys {keys or 'none'}")
        pos = keys.index(output)
    else:
        if not -len(children) <= output < len(children):
            raise UsageError(f"export-trace: output={output}: {model_name} returns {len(children)} entries")
        pos = output % len(children)
    if not children[pos].is_leaf():
        raise UnsupportedModelError(
            f"export-trace: output {output if output is not None else keys[pos]!r} of {model_name} is a "
            f"{children[pos].type.__name__}, not a tensor. Fix: choose a tensor with output=")
    return sum(c.num_leaves for c in children[:pos])


def _children(spec: Any) -> list[Any]:
    """The child specs of a pytree node (``children()`` on newer torch, ``children_specs`` before)."""
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def _keys(spec: Any) -> list[Any] | None:
    """The keys of a dict-like pytree node (dict, ``ModelOutput``) or namedtuple, else None."""
    ctx = spec.context
    if isinstance(ctx, (list, tuple)) and len(ctx) == len(_children(spec)):
        return list(ctx)
    fields = getattr(spec.type, "_fields", None)
    return list(fields) if fields is not None else None
