"""emit: write the torchrun program: one readable Python module per stage, weights, plan.json, train.py.

From a :class:`~pdcompile.passes.split_stages.StageSplit` (one GraphModule per stage) it writes
``plan.json``, ``stage_K.py`` (``class StageK``, forward() printed by torch.fx's code generator;
the last stage's file also holds ``class Loss``), ``stage_K.pt`` (initial parameters and buffers,
loaded with ``weights_only=True``), ``loss.pt`` and ``train.py``; README.md "The emitted folder"
documents the layout. Nothing is generated from ``repr`` strings: leaf modules are rebuilt from
their class and constructor arguments, and checked, by :func:`object_spec`.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from pdcompile.callables import ForRanks, for_ranks
from pdcompile.errors import UnsupportedModelError
from pdcompile.ir import TensorMeta
from pdcompile.runtime.program import wire_dtype
from pdcompile.runtime.tensor_parallel import RankLayout
from pdcompile.passes.split_stages import StageSplit

_SKIP_ARGS = {"self", "device", "dtype", "mode"}


@dataclass(frozen=True)
class ObjectSpec:
    """A class path and keyword arguments: how an emitted program rebuilds a module/loss/optimizer."""

    cls: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"class": self.cls, "kwargs": dict(self.kwargs)}

    def source(self) -> str:
        args = ", ".join(f"{k}={_literal(v)}" for k, v in self.kwargs.items())
        return f"{self.cls}({args})"


def class_path(cls: type) -> str:
    """Importable dotted path of ``cls``; ``torch.nn.X`` for torch.nn built-ins."""
    for short in ("torch.nn", "torch.optim"):
        mod = eval(short, {"torch": torch})  # noqa: S307 - a fixed module path
        if getattr(mod, cls.__name__, None) is cls:
            return f"{short}.{cls.__name__}"
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise UnsupportedModelError(
            f"emit: class {cls.__qualname__} is defined in __main__ or inside a function, so the emitted "
            f"program can't import it. Fix: move it into an importable module"
        )
    return f"{cls.__module__}.{cls.__qualname__}"


def _literal(v: Any) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return f"float({str(v)!r})"
    return repr(v)


def _is_literal(v: Any) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, (tuple, list)):
        return all(_is_literal(x) for x in v)
    return False


def ctor_kwargs(m: Any) -> dict[str, Any]:
    """Constructor keyword arguments that rebuild ``m`` (read back from its attributes)."""
    if hasattr(m, "pd_ctor_kwargs"):
        return dict(m.pd_ctor_kwargs())
    cls = type(m)
    params: list[inspect.Parameter] = []
    for klass in cls.__mro__:
        if klass is object or "__init__" not in vars(klass):
            continue
        ps = list(inspect.signature(vars(klass)["__init__"]).parameters.values())
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ps):
            continue  # e.g. LSTM(*args, **kwargs): its base RNNBase names the arguments
        params = ps
        break
    out: dict[str, Any] = {}
    for p in params:
        if p.name in _SKIP_ARGS or p.name.startswith("_"):
            continue
        if not hasattr(m, p.name):
            if p.default is inspect.Parameter.empty:
                raise UnsupportedModelError(
                    f"emit: can't rebuild {cls.__name__}: constructor argument {p.name!r} is not stored on the "
                    f"instance. Fix: store it as self.{p.name}, or define pd_ctor_kwargs()"
                )
            continue
        v = getattr(m, p.name)
        if isinstance(v, torch.Tensor) or (v is None and p.name in ("bias", "weight") and
                                           isinstance(p.default, bool)):
            v = v is not None  # e.g. Linear(bias=True) stores a Parameter (or None) as .bias
        if isinstance(v, torch.Size):
            v = tuple(v)
        if not _is_literal(v):
            raise UnsupportedModelError(
                f"emit: can't rebuild {cls.__name__}: argument {p.name!r} = {type(v).__name__} is not a "
                f"literal. Fix: define pd_ctor_kwargs() on the class"
            )
        if p.default is not inspect.Parameter.empty and _same(v, p.default):
            continue
        out[p.name] = v
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _public_state(m: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(m).items()
            if not k.startswith("_") and _is_literal(v) and k != "training"}


def object_spec(m: Any) -> ObjectSpec:
    """ObjectSpec for a module or loss, verified by rebuilding it.

    The constructor arguments are read back from the instance (``inspect.signature`` of the class,
    attributes of the same names), or from its ``pd_ctor_kwargs() -> dict``. The rebuilt object
    must match the original (same repr, same public attributes, same parameter shapes) before
    anything is written; else :class:`UnsupportedModelError` names it."""
    spec = ObjectSpec(class_path(type(m)), ctor_kwargs(m))
    rebuilt = build_object(spec)
    same = repr(rebuilt) == repr(m) and _public_state(rebuilt) == _public_state(m)
    if same and isinstance(m, torch.nn.Module):
        a = {k: tuple(v.shape) for k, v in m.state_dict().items()}
        b = {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
        same = a == b
    if not same:
        raise UnsupportedModelError(
            f"emit: rebuilding {type(m).__name__} from {spec.source()} does not give the same module. "
            f"Fix: define pd_ctor_kwargs() on the class returning its constructor arguments"
        )
    return spec


def build_object(spec: ObjectSpec) -> Any:
    mod, _, name = spec.cls.rpartition(".")
    import importlib

    return getattr(importlib.import_module(mod), name)(**spec.kwargs)


def optimizer_spec(make_optimizer: Any) -> ObjectSpec:
    """Spec of the optimizer a factory builds (``lambda params: SGD(params, lr=0.1)``)."""
    probe = make_optimizer([torch.nn.Parameter(torch.zeros(1))])
    if not isinstance(probe, torch.optim.Optimizer):
        raise UnsupportedModelError("optimizer factory must return a torch.optim.Optimizer")
    cls = type(probe)
    accepted = inspect.signature(cls.__init__).parameters
    any_keyword = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    # only what the constructor takes: torch's AdamW keeps decoupled_weight_decay in its defaults, not its arguments
    kwargs = {k: v for k, v in probe.defaults.items() if _is_literal(v) and (any_keyword or k in accepted)}
    rebuilt = cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
    differ = [k for k, v in probe.defaults.items() if repr(rebuilt.defaults.get(k)) != repr(v)]
    if differ:
        raise UnsupportedModelError(
            f"optimizer: {cls.__name__} rebuilt from the settings plan.json can hold differs in {', '.join(differ)}. "
            f"Fix: give them as Python numbers, strings or tuples of them")
    own = sorted({k for g in probe.param_groups for k, v in g.items()
                  if k in probe.defaults and repr(v) != repr(probe.defaults[k])})
    if own:
        raise UnsupportedModelError(
            f"optimizer: a parameter group sets its own {', '.join(own)}, and the ranks build one group from "
            f"{cls.__name__}'s settings. Fix: give every parameter the same settings")
    return ObjectSpec(class_path(cls), kwargs)


def lr_scheduler_spec(make_scheduler: Any, make_optimizer: Any) -> ForRanks:
    """plan.json's ``lr_scheduler`` for a function from the optimizer to a ``torch.optim.lr_scheduler``: by
    name (``MODULE:FUNCTION``, or ``functools.partial`` of one with plain keyword arguments) or by value
    (a lambda, a closure, a function of ``__main__``: :mod:`pdcompile.callables`), checked by building it
    on a one-parameter optimizer of the user's kind."""
    from pdcompile.errors import UsageError

    made = for_ranks(make_scheduler, "lr_scheduler")
    probe = make_scheduler(make_optimizer([torch.nn.Parameter(torch.zeros(1))]))
    if isinstance(probe, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UsageError("lr_scheduler=: ReduceLROnPlateau steps on a metric, not once per optimizer step; use a "
                         "schedule of the step count (LambdaLR, OneCycleLR, SequentialLR, ...)")
    if not isinstance(probe, torch.optim.lr_scheduler.LRScheduler):
        raise UsageError(f"lr_scheduler= must return a torch.optim.lr_scheduler, got {type(probe).__name__}")
    return made


def recompute_entries(split: StageSplit, plan_stages: list[dict[str, Any]], head_members: Mapping[int, set[str]]) -> None:
    """Add to each partially recomputing stage of plan.json's ``plan.stages`` what the runtime needs
    (``runtime/recompute.py``): ``recompute_nodes``, the count of the stage graph's first compute
    nodes that make its head (up to the last node of its first ``recompute_layers`` layers, whose
    node names are ``head_members[stage]``), and the graph's ``graph_signature``."""
    from pdcompile.runtime.recompute import compute_nodes, graph_signature

    for d in plan_stages:
        if d.get("recompute") != "partial":
            continue
        k = int(d["index"])
        graph = split.stages[k].gm.graph
        nodes = compute_nodes(graph)
        marks = [i for i, n in enumerate(nodes) if n.name in head_members[k]]
        if not marks or marks[-1] + 1 >= len(nodes):
            raise UnsupportedModelError(
                f"emit: stage {k} recomputes its first {d.get('recompute_layers')} layers, but its graph has no "
                "compute node of theirs before its last one. Fix: compile with recompute='full' or 'none'")
        d["recompute_nodes"] = marks[-1] + 1
        d["graph_signature"] = graph_signature(graph)


def tensor_spec(meta: TensorMeta, precision: str = "fp32") -> dict[str, Any]:
    """A boundary tensor's spec in plan.json; ``wire_dtype``: what it is sent in (bf16 halves floating ones)."""
    dtype = meta.dtype.replace("torch.", "")
    wire = str(wire_dtype(getattr(torch, dtype), precision)).replace("torch.", "") if hasattr(torch, dtype) else dtype
    return {"shape": list(meta.shape), "dtype": dtype, "requires_grad": meta.requires_grad, "wire_dtype": wire}


_GLOBAL_IMPORTS = {
    "torch": "import torch",
    "inf": "from math import inf",
    "nan": "from math import nan",
    "NoneType": "NoneType = type(None)",
    "device": "from torch import device",
    "fx_pytree": "import torch.fx._pytree as fx_pytree",
    "pytree": "import torch.utils._pytree as pytree",
    "operator": "import operator",
    "math": "import math",
    "builtins": "import builtins",
}


def _module_parts(gm: fx.GraphModule, what: str) -> tuple[list[str], list[str], str]:
    """The imports, ``__init__`` lines and ``forward`` source that rebuild ``gm`` as a plain module."""
    code = gm.graph.python_code(root_module="self")
    src = code.src.strip("\n")
    imports = []
    for name, obj in code.globals.items():
        if name not in src.replace("def forward", ""):
            continue
        if name in _GLOBAL_IMPORTS:
            imports.append(_GLOBAL_IMPORTS[name])
        elif callable(obj) and getattr(obj, "__module__", None) and "<" not in getattr(obj, "__qualname__", "<"):
            imports.append(f"from {obj.__module__} import {obj.__qualname__} as {name}")
        else:
            raise UnsupportedModelError(f"emit: {what} code uses {name} = {obj!r}, which can't be imported")
    init = ["super().__init__()"]
    seen: dict[int, str] = {}
    for name, child in gm.named_children():
        init.append(f"self.{name} = {object_spec(child).source()}")
    for name, p in gm.named_parameters(recurse=False):
        init.append(f"self.{name} = torch.nn.Parameter(torch.empty({tuple(p.shape)}, dtype={p.dtype}), "
                    f"requires_grad={p.requires_grad})")
    for name, b in gm.named_buffers(recurse=False):
        init.append(f"self.register_buffer({name!r}, torch.empty({tuple(b.shape)}, dtype={b.dtype}))")
    for name, p in gm.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # parameters shared inside this module stay one tensor
            owner, attr = name.rsplit(".", 1) if "." in name else ("", name)
            init.append(f"self{'.' + owner if owner else ''}.{attr} = self.{seen[id(p)]}")
        else:
            seen[id(p)] = name
    return imports, init, src


def stage_source(split: StageSplit, k: int, model_name: str, loss: fx.GraphModule | None = None) -> str:
    """The Python source of ``stage_k.py``; with ``loss`` (the last stage's, traced by trace-loss) the
    file also defines ``class Loss``: ``Loss()(output, target)`` is the training loss."""
    st = split.stages[k]
    imports, init, src = _module_parts(st.gm, f"stage {k}")
    loss_src = ""
    if loss is not None:
        loss_imports, loss_init, loss_fwd = _module_parts(loss, "the loss")
        imports += loss_imports
        loss_src = ("\n\nclass Loss(torch.nn.Module):\n"
                    '    """The training loss, traced from loss_fn: forward(output of this stage, target)."""\n\n'
                    f"    def __init__(self) -> None:\n{textwrap.indent(chr(10).join(loss_init), ' ' * 8)}\n\n"
                    f"{textwrap.indent(loss_fwd, ' ' * 4)}\n")
    if "import torch" not in imports:
        imports.insert(0, "import torch")
    ins = ", ".join([*st.inputs, *(f"{n} (read from the data)" for n in st.data_inputs)])
    doc = (f'"""Stage {k} of {len(split.stages)} of {model_name}: computes {", ".join(st.nodes[:6])}'
           f'{", ..." if len(st.nodes) > 6 else ""}.\n\nGenerated by pdcompile from the torch.fx graph '
           f'of the stage. Inputs: {ins or "-"}. Outputs: {", ".join(st.outputs) or "the model output"}.'
           f'{" Loss: the training loss on that output." if loss is not None else ""}\n"""')
    body = textwrap.indent("\n".join(init), " " * 8)
    fwd = textwrap.indent(src, " " * 4)
    return (f"{doc}\n\n" + "\n".join(sorted(set(imports))) + "\n\n\n"
            f"class Stage{k}(torch.nn.Module):\n"
            f"    INPUTS = {tuple(st.inputs)!r}\n"
            + (f"    DATA_INPUTS = {tuple(st.data_inputs)!r}\n" if st.data_inputs else "") +
            f"    OUTPUTS = {tuple(st.outputs)!r}\n\n"
            f"    def __init__(self) -> None:\n{body}\n\n{fwd}\n" + loss_src)


TRAIN_PY = '''"""Train the pipeline described by plan.json with pdcompile's runtime.

    torchrun --nproc-per-node={world} train.py --steps 10
    python train.py --help
"""

from pathlib import Path

from pdcompile.runtime.launch import main

if __name__ == "__main__":
    main(Path(__file__).resolve().parent)
'''


def emit(split: StageSplit, out_dir: str | os.PathLike[str], *, program: Mapping[str, Any],
         model_name: str = "model", loss: fx.GraphModule | None = None,
         files: Mapping[str, bytes] | None = None) -> Path:
    """Write the program folder. ``program`` holds the plan.json fields that aren't derived from
    the split: schedule, microbatch_size, num_microbatches, loss, optimizer, data, target, plan,
    stage replicas/ranks (``stage_ranks``), world_size.

    ``loss``: the traced loss (``forward(output, target)``); it is written as ``class Loss`` into the
    last stage's file, its tensors into ``loss.pt``, and plan.json's ``"loss"`` points at both
    (``{"module", "class", "weights"}``, keeping ``program["loss"]``'s other keys). Without it
    ``program["loss"]`` is a class path (``{"class", "kwargs"}``) as before.

    ``files``: more files by name (the callables serialized by value, :mod:`pdcompile.callables`).

    Everything is written into a temporary sibling folder first and moved into ``out_dir`` only
    when complete, so a failure (a module that can't be rebuilt) leaves no half-written program."""
    final = Path(out_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    out = final.parent / f".{final.name}.emit-{os.getpid()}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    try:
        _emit_into(out, split, program, model_name, loss)
        for name, payload in (files or {}).items():
            (out / name).write_bytes(payload)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    if not final.exists():
        os.replace(out, final)
    else:  # an existing folder: replace our files in it, each one whole
        for f in out.iterdir():
            os.replace(f, final / f.name)
        out.rmdir()
    return final


def _emit_into(out: Path, split: StageSplit, program: Mapping[str, Any], model_name: str,
               loss: fx.GraphModule | None = None) -> None:
    """Write every file of the program into the (empty, temporary) folder ``out``."""
    stage_ranks = program.get("stage_ranks") or [[k] for k in range(len(split.stages))]
    precision = str(program.get("precision", "fp32"))
    planned = [dict(d) for d in dict(program.get("plan") or {}).get("stages", [])]  # the plan's stages, when given
    stages_json = []
    last = len(split.stages) - 1
    # each stage's tensor-parallel degree, and so each pipeline rank's block of processes (runtime/tensor_parallel.py)
    tp_stages = list(dict(program.get("tensor_parallel") or {}).get("stages") or [])
    degrees = [int(tp_stages[k].get("degree", 1)) if k < len(tp_stages) else 1 for k in range(len(split.stages))]
    ranks_layout = RankLayout.of(stage_ranks, degrees)
    loss_json: dict[str, Any] | None = None
    if loss is not None:
        tensors = {n: t.detach().cpu().clone() for n, t in loss.named_parameters()}
        tensors.update({n: b.detach().cpu().clone() for n, b in loss.named_buffers()})
        if tensors:
            torch.save(tensors, out / "loss.pt")
        loss_json = {**{k: v for k, v in dict(program.get("loss") or {}).items() if k not in ("class", "kwargs")},
                     "module": f"stage_{last}.py", "class": "Loss", "weights": "loss.pt" if tensors else None}
    for st in split.stages:
        k = st.index
        (out / f"stage_{k}.py").write_text(stage_source(split, k, model_name, loss if k == last else None))
        tensors = {n: t.detach() for n, t in st.gm.named_parameters()}
        tensors.update({n: b.detach() for n, b in st.gm.named_buffers()})
        weights: str | None = f"stage_{k}.pt"
        if any(t.is_meta for t in tensors.values()):  # no values: the ranks fill it from plan.json's init source
            if dict(program.get("init") or {}).get("source", "weights") == "weights":
                raise UnsupportedModelError(f"emit: stage {k} holds meta tensors and plan.json names no source "
                                            f"for them. Fix: emit through pdcompile(...).emit(), or init_from=PATH")
            weights = None
        else:
            torch.save({n: t.clone() for n, t in tensors.items()}, out / f"stage_{k}.pt")
        stages_json.append({
            "index": k, "module": f"stage_{k}.py", "class": f"Stage{k}", "weights": weights,
            "ranks": list(stage_ranks[k]), "replicas": len(stage_ranks[k]),
            **({"tensor_parallel": degrees[k], "processes": [ranks_layout.block(q) for q in stage_ranks[k]]}
               if max(degrees) > 1 else {}),
            # how the replicas hold the stage's state (docs/api.md shard=; runtime/shard.py runs it)
            "shard": str(planned[k].get("shard", "none")) if k < len(planned) else "none",
            "inputs": [dict(name=n, **tensor_spec(m, precision)) for n, m in zip(st.inputs, st.input_meta)],
            "outputs": [dict(name=n, **tensor_spec(m, precision)) for n, m in zip(st.outputs, st.output_meta)],
            # model inputs the stage reads from the data itself (forward's last arguments): "index" among stage 0's
            "data_inputs": [dict(name=n, index=split.stages[0].inputs.index(n), **tensor_spec(m, "fp32"))
                            for n, m in zip(st.data_inputs, st.data_meta)],
            "param_names": dict(st.param_names), "nodes": list(st.nodes),
        })
    doc = {
        "version": 1,
        "model": model_name,
        # a rank may hold several (virtual) stages; with tensor parallelism each rank is t processes
        "world_size": ranks_layout.world,
        "stages": stages_json,
        "tied": [[[s, n] for s, n in group] for group in split.tied],
        **{k: v for k, v in program.items() if k != "stage_ranks"},
    }
    if loss_json is not None:
        doc["loss"] = loss_json
    (out / "plan.json").write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    (out / "train.py").write_text(TRAIN_PY.format(world=doc["world_size"]))


def graph_module_source(gm: fx.GraphModule) -> str:
    return gm.code
