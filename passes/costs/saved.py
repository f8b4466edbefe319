"""What autograd saves for backward, per node: saved-tensor hooks over one forward
(:class:`SavedRecorder`), read four ways: saved bytes with the parts received and sent
(:func:`saved_from`), bytes an earlier node saved first (:func:`resaved_from`), and what stays saved
and is rebuilt under selective recomputation (:func:`selective_from`)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from pdcompile.passes.costs.nodes import flat_tensors
from pdcompile.runtime.recompute import FlopOutputs

def _storage(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class SavedRecorder(fx.Interpreter):
    """Runs the graph with autograd on, noting per node the storages its ops save for backward
    (``torch.autograd.graph.saved_tensors_hooks``) and the storages of its outputs."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.saved: dict[fx.Node, dict[int, int]] = {}
        # selective recomputation: storages of the outputs of its FLOP-counted ops, and the bytes of the
        # new storages its FLOP-counted and its other ops made
        self.cached: dict[fx.Node, dict[int, int]] = {}
        self.made: dict[fx.Node, tuple[int, int]] = {}
        self.produced: dict[int, fx.Node] = {}  # storage -> the node whose output it is (latest)
        self.keep: list[Any] = []  # every value stays alive, so no storage is reused during the run
        self.static: set[int] = {_storage(t)[0] for t in [*gm.parameters(), *gm.buffers()]}

    def run_node(self, n: fx.Node) -> Any:
        mine: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr, nbytes = _storage(t)
            mine[ptr] = nbytes
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopOutputs() as flops:
            result = super().run_node(n)
        self.saved[n] = mine
        self.cached[n] = dict(_storage(t) for t in flops.outputs)
        self.made[n] = (flops.new_bytes[True], flops.new_bytes[False])
        for t in flat_tensors(result):
            if n.op == "get_attr":
                self.static.add(_storage(t)[0])
            else:
                self.produced.setdefault(_storage(t)[0], n)
        self.keep.append(result)
        return result


def record_saved(gm: fx.GraphModule, inputs: Sequence[Any]) -> SavedRecorder:
    """One forward with autograd on under :class:`SavedRecorder` (every value kept: ``keep.clear()`` after)."""
    # an example microbatch cut from a larger batch is a view of the batch's storage: give each input
    # its own storage, so that what it saves is a microbatch's bytes, not its batch's
    inputs = [x.detach().clone(memory_format=torch.contiguous_format).requires_grad_(x.requires_grad)
              if isinstance(x, torch.Tensor) and x.untyped_storage().nbytes() > x.numel() * x.element_size() else x
              for x in inputs]
    rec = SavedRecorder(gm)
    with torch.enable_grad():
        rec.run(*inputs)
    return rec


def saved_from(rec: SavedRecorder, gm: fx.GraphModule) -> dict[fx.Node, tuple[int, int, int]]:
    seen: set[int] = set(rec.static)
    out: dict[fx.Node, tuple[int, int, int]] = {}
    for n in gm.graph.nodes:
        total = from_before = own = 0
        for ptr, nbytes in rec.saved.get(n, {}).items():
            if ptr in seen:
                continue
            seen.add(ptr)
            total += nbytes
            if rec.produced.get(ptr) is n:
                own += nbytes
            else:
                from_before += nbytes
        out[n] = (total, from_before, own)
    return out


def resaved_from(rec: SavedRecorder, gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Per node, the bytes of what it saves that an earlier node saved first (a conv saving the
    output an in-place ReLU saved): counted at that first saver, so a stage whose first layers are
    rebuilt (partial recomputation) keeps them for its tail all the same."""
    seen: set[int] = set(rec.static)
    out: dict[fx.Node, int] = {}
    for n in gm.graph.nodes:
        mine = rec.saved.get(n, {})
        out[n] = sum(nbytes for ptr, nbytes in mine.items() if ptr in seen and ptr not in rec.static)
        seen.update(mine)
    return out


def selective_from(rec: SavedRecorder, gm: fx.GraphModule) -> dict[fx.Node, tuple[int, float, int]]:
    every_cached = {ptr for c in rec.cached.values() for ptr in c}
    seen: set[int] = set()
    saved_seen: set[int] = set(rec.static)
    out: dict[fx.Node, tuple[int, float, int]] = {}
    for n in gm.graph.nodes:
        cached = 0
        for ptr, nbytes in rec.cached.get(n, {}).items():
            if ptr not in seen:
                seen.add(ptr)
                cached += nbytes
        rebuilt = 0  # of what it saves (each storage at its first saver, as saved_bytes), what is not cached
        for ptr, nbytes in rec.saved.get(n, {}).items():
            if ptr not in saved_seen:
                saved_seen.add(ptr)
                rebuilt += 0 if ptr in every_cached else nbytes
        flop_made, other_made = rec.made.get(n, (0, 0))
        if not rec.cached.get(n):
            share = 1.0  # no FLOP-counted op: the whole node is rebuilt
        else:
            share = other_made / (flop_made + other_made) if flop_made + other_made else 0.0
        out[n] = (cached, share, rebuilt)
    return out


def saved_tensor_bytes(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, tuple[int, int, int]]:
    """Per node: (bytes autograd saves for backward, of them those whose storage an earlier node or
    input produced, of the node's own output storages those it saves itself).

    Measured with saved-tensor hooks during one forward with autograd on. Each storage counts once,
    at the first node that saves it (views and in-place ops share their base's storage); parameters
    and buffers are not activations and are left out. A stage ``i..j`` keeps ``sum saved`` per
    microbatch; its first node's ``saved_input_bytes`` are (part of) what it receives and its last
    node's ``saved_output_bytes`` (part of) what it sends."""
    rec = record_saved(gm, inputs)
    out = saved_from(rec, gm)
    rec.keep.clear()
    return out


def resaved_tensor_bytes(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, int]:
    """Per node: the bytes of what it saves that an earlier node saved first (:func:`resaved_from`)."""
    rec = record_saved(gm, inputs)
    out = resaved_from(rec, gm)
    rec.keep.clear()
    return out


def selective_bytes(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[fx.Node, tuple[int, float, int]]:
    """Per node, under selective recomputation (:mod:`pdcompile.runtime.recompute`): (bytes that stay
    saved per microbatch: the storages of the outputs of its ops ``torch.utils.flop_counter`` counts,
    each storage once, at its first node, what the checkpoint's cache keeps; the share of its forward
    time rebuilt at backward; the bytes of its ``saved_bytes`` a backward rebuilds: those not cached).
    The share: 1 for a node without a FLOP-counted op; else the bytes of the new storages its other
    ops make over those all its ops make (0 for a Linear or a convolution, whose other ops are views):
    ``selective_recompute_s = forward_s x share``. A cached output autograd does not save (a matmul
    feeding a scaling, a projection feeding a residual add) stays in flight but is not rebuilt, so the
    rebuilt bytes are not ``saved_bytes - selective_saved_bytes``."""
    rec = record_saved(gm, inputs)
    out = selective_from(rec, gm)
    rec.keep.clear()
    return out
