"""Fused weight-gradient accumulation: a big weight's gradient is added straight into its ``.grad``.

From a step's second microbatch on, plain autograd makes each weight's whole gradient (``dy^T x`` of a
linear, the dense gradient of an embedding) and only then ``AccumulateGrad`` adds it into ``.grad``:
a transient the size of the weight, on top of the gradient it is added to (an LM head's or an
embedding's: the largest tensor of its stage). Here, as Megatron's ``gradient_accumulation_fusion``,
the backward of a linear writes ``.grad.addmm_(dy^T, x)`` and that of an embedding
``.grad.index_add_(0, ids, dy)``: no transient of the weight's size exists.

How: :func:`install` wraps a stage module's ``forward`` (an instance attribute: the class's code, which
``symbolic_trace`` reads, is untouched) so that, while it runs, a ``TorchFunctionMode`` sees every torch
call of the stage. Those that qualify run through :class:`_Linear` / :class:`_Embedding`, custom autograd
functions that return no gradient for the weight and accumulate it themselves. That serves both front
ends with no rewrite: torch.fx stages call ``nn.Linear``/``nn.Embedding`` (``F.linear``/``F.embedding``),
exported ones ``torch.ops.aten.linear``/``aten.embedding`` on the stage's parameters. A recomputing
backward (``torch.utils.checkpoint``) reruns the same wrapped forward. ``matmul``/``addmm`` on a
transposed weight (not a leaf) stay plain. The target is the weight object itself, kept on the node:
saved-tensor hooks (the memory meter's, checkpoint's) hand back aliases of what was saved. The mode
costs a Python call per torch call of a forward (microseconds); :func:`install` leaves a stage with no
qualifying weight untouched.

A call qualifies when its weight is a plain leaf tensor that requires grad (where ``AccumulateGrad``
would add into ``.grad`` anyway), floating, of at least ``min_bytes``, with grad mode on; for a linear,
the input of the weight's dtype and device and no autocast (its bf16 gradient would come out otherwise
than autograd's); for an embedding, no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``. Everything
else runs plain. Stashed weight versions (runtime/weights.py) name the live parameter their gradient
goes into (:func:`accumulate_into`), so the stashed clone never holds a ``.grad`` either.

A split backward (``B`` then ``W``: zero bubble, ``--split-backward``) walks the retained graph more than
once, and its ``W`` should do the weight work: by submodules (runtime/weight_grads.py) each fused node
adds its gradient once, its ``B`` records it (:class:`Deferred`: the node's output gradient and input,
as the weight pass holds anyway) and its ``W`` adds it (:meth:`FusedGrads.weight_pass`). Where it must
not run, the executor turns it off: a split through the traced graph (runtime/graph_split.py: the
forward runs aot_autograd's graph, not the module), and a stage sharded ``full`` (FSDP2 reduces from
``AccumulateGrad``'s hooks; :func:`install` returns None). The runtime
relies on no gradient hook otherwise: ``AR``, ``TG``, clipping and the memory meter read ``.grad`` after
the backward. Results equal autograd's to rounding (``addmm_`` adds inside the product), not bitwise, so
``auto`` (the default of ``train.py --grad-accumulation``) fuses only weights of ``AUTO_MIN_BYTES`` and
more, where the transient matters; ``fused`` every qualifying weight; ``autograd`` none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

GRAD_ACCUMULATIONS = ("auto", "fused", "autograd")
AUTO_MIN_BYTES = 4 << 20  # auto: weights whose gradient is at least 4 MiB (a 1024 x 1024 fp32 linear)

_INTO = "_pdcompile_grad_into"  # on a stashed weight version (a clone): the live parameter its gradient goes into


def accumulate_into(clone: torch.Tensor, param: torch.Tensor) -> None:
    """A fused backward through ``clone`` (a stashed weight version) accumulates into ``param.grad``,
    where the weight store would add the clone's gradient after the backward."""
    setattr(clone, _INTO, param)


class Deferred:
    """A split backward's fused weight gradients: its ``B`` (while ``open``) records each one here
    instead of adding it; its ``W`` adds them (:meth:`FusedGrads.weight_pass`)."""

    def __init__(self) -> None:
        self.items: list[Callable[[], None]] = []
        self.open = True


def _add_into(weight: torch.Tensor, make: Callable[[], torch.Tensor], add: Callable[[torch.Tensor], Any]) -> None:
    """Accumulate into the ``.grad`` of ``weight`` (or of the parameter it stands for): the first
    gradient is made (``make``: as autograd would, the new tensor becomes ``.grad``), later ones are
    added in place (``add``)."""
    target = getattr(weight, _INTO, weight)
    with torch.no_grad():
        if target.grad is None:
            target.grad = make()
        else:
            add(target.grad)


def _accumulate(ctx: Any, make: Callable[[], torch.Tensor], add: Callable[[torch.Tensor], Any]) -> None:
    """A fused node's weight gradient, once per node (a split backward walks a retained graph more than
    once: ``B`` to the inputs, ``W`` to the weights, the weight pass's first check a third time): added
    now, or recorded for ``W`` when ``B`` of a split backward runs it."""
    if ctx.done:
        return
    ctx.done = True
    deferred = ctx.deferred
    if deferred is not None and deferred.open:
        deferred.items.append(lambda: _add_into(ctx.weight, make, add))
    else:
        _add_into(ctx.weight, make, add)


class _Linear(torch.autograd.Function):
    """``F.linear(x, weight, bias)``; the backward adds ``dy^T x`` into ``weight.grad`` (``addmm_``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                deferred: Deferred | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)  # values, as F.linear saves them (saved-tensor hooks may alias them)
        ctx.weight, ctx.deferred, ctx.done = weight, deferred, False  # the tensor itself: its .grad is the target
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        x, w = ctx.saved_tensors
        dx = dy.matmul(w) if ctx.needs_input_grad[0] else None
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        _accumulate(ctx, lambda: dy2.t().mm(x2), lambda g: g.addmm_(dy2.t(), x2))
        return dx, None, dy2.sum(0) if ctx.needs_input_grad[2] else None, None


class _Embedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)``; the backward adds ``dy`` into the rows of
    ``weight.grad`` it read (``index_add_``), none into ``padding_idx``'s."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int,
                deferred: Deferred | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        # the graph holds the weight anyway (its AccumulateGrad)
        ctx.weight, ctx.padding_idx, ctx.deferred, ctx.done = weight, padding_idx, deferred, False
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[None, None, None, None]:
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        idx, g = ids.reshape(-1), dy.reshape(-1, dy.shape[-1]).to(weight.dtype)
        if ctx.padding_idx >= 0:
            g = g * (idx != ctx.padding_idx).unsqueeze(1).to(g.dtype)
        _accumulate(ctx, lambda: torch.zeros_like(weight).index_add_(0, idx, g), lambda t: t.index_add_(0, idx, g))
        return None, None, None, None


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


_LINEARS = {F.linear, torch.ops.aten.linear.default}
_EMBEDDINGS_ATEN = {torch.embedding, torch.ops.aten.embedding.default}  # (weight, ids, padding_idx=-1, ...)


class FusedGrads:
    """One stage module's fused accumulation (:func:`install`): ``active`` says whether the next
    forwards fuse (off for a split through the traced graph), ``deferred`` where their split backward's
    ``B`` records the fused gradients (:meth:`defer`); ``counts`` counts
    the weight calls that did, by kind (``linear``, ``embedding``); weights under ``min_bytes`` run plain."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.active = True
        self.deferred: Deferred | None = None  # the next forwards' split backward (B records, W adds)
        self.counts: dict[str, int] = {"linear": 0, "embedding": 0}

    def qualifies(self, w: Any) -> bool:
        return (type(w) in (torch.Tensor, torch.nn.Parameter) and w.is_leaf and w.requires_grad
                and w.is_floating_point() and w.numel() * w.element_size() >= self.min_bytes)

    def linear(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        x, w, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
        if not (self.qualifies(w) and w.dim() == 2 and isinstance(x, torch.Tensor) and x.dim() >= 1
                and x.dtype == w.dtype and x.device == w.device
                and (b is None or isinstance(b, torch.Tensor) and b.dtype == w.dtype)
                and not torch.is_autocast_enabled(w.device.type)):
            return None
        self.counts["linear"] += 1
        return _Linear.apply(x, w, b, self.deferred)  # type: ignore[no-any-return]

    def embedding(self, w: Any, ids: Any, padding_idx: int | None, plain_options: bool) -> torch.Tensor | None:
        if not (plain_options and self.qualifies(w) and w.dim() == 2 and isinstance(ids, torch.Tensor)):
            return None
        pad = -1 if padding_idx is None else padding_idx + (w.shape[0] if padding_idx < 0 else 0)
        self.counts["embedding"] += 1
        return _Embedding.apply(w, ids, pad, self.deferred)  # type: ignore[no-any-return]

    def defer(self) -> Deferred:
        """The next forward's backward is split: its ``B`` records the fused weight gradients, its ``W``
        adds them (set ``deferred`` to None again for a backward that adds them at once)."""
        self.deferred = Deferred()
        return self.deferred

    @staticmethod
    def weight_pass(deferred: Deferred) -> None:
        """``W`` of a split backward: add what its ``B`` recorded; later walks add their own at once."""
        deferred.open = False
        for add in deferred.items:
            add()
        deferred.items.clear()


class _Mode(TorchFunctionMode):
    """Routes a stage forward's qualifying linear and embedding calls through the fused functions."""

    def __init__(self, fg: FusedGrads) -> None:
        super().__init__()
        self.fg = fg

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = None
        if torch.is_grad_enabled():
            if func in _LINEARS:
                out = self.fg.linear(args, kwargs)
            elif func is F.embedding:  # (ids, weight, padding_idx=None, max_norm=None, norm_type, scale, sparse)
                plain = (_arg(args, kwargs, 3, "max_norm") is None and not _arg(args, kwargs, 5, "scale_grad_by_freq")
                         and not _arg(args, kwargs, 6, "sparse"))
                out = self.fg.embedding(_arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 0, "input"),
                                        _arg(args, kwargs, 2, "padding_idx"), plain)
            elif func in _EMBEDDINGS_ATEN:  # (weight, ids, padding_idx=-1, scale_grad_by_freq, sparse)
                pad = _arg(args, kwargs, 2, "padding_idx", -1)
                plain = not _arg(args, kwargs, 3, "scale_grad_by_freq") and not _arg(args, kwargs, 4, "sparse")
                out = self.fg.embedding(_arg(args, kwargs, 0, "weight"), _arg(args, kwargs, 1, "indices"),
                                        None if pad < 0 else pad, plain)
        return func(*args, **kwargs) if out is None else out


def install(module: torch.nn.Module, mode: str, *, sharded: bool = False) -> FusedGrads | None:
    """Fuse ``module``'s weight-gradient accumulation (``mode``: one of :data:`GRAD_ACCUMULATIONS`).
    None, and the module untouched, under ``autograd``, for a stage sharded ``full``, or when no
    parameter is big enough to qualify."""
    if mode not in GRAD_ACCUMULATIONS:
        raise ValueError(f"grad accumulation must be one of {GRAD_ACCUMULATIONS}, got {mode!r}")
    if mode == "autograd" or sharded:
        return None
    fg = FusedGrads(AUTO_MIN_BYTES if mode == "auto" else 0)
    if not any(fg.qualifies(p) for p in module.parameters()):
        return None
    forward = module.forward

    def fused_forward(*args: Any, **kwargs: Any) -> Any:
        if not fg.active or not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        with _Mode(fg):
            return forward(*args, **kwargs)

    module.forward = fused_forward  # type: ignore[method-assign]
    return fg
