"""What ends a stage's step in the simulator (part of :mod:`pdcompile.simulate`, which re-exports it): its
gradients' all-reduce among its replicas (a ring at the link's bandwidth, or the runtime's own all-reduce as this
host's calibration fits it) and its optimizer step (bytes streamed), each with its cost per parameter tensor
(the optimizer's loop over tensors, the all-reduce's flatten and copy back: :func:`tensor_costs`), and the
tensors a stage holds (:func:`stage_param_tensors`). Plain numbers; the planner's bounds charge them too
(``pdcompile/plan.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdcompile.passes.costs.roofline import device_spec_for, optimizer_step_s, stream_bandwidth


def ring_allreduce_s(nbytes: float, replicas: int, bandwidth: float) -> float:
    """Ring all-reduce of ``nbytes`` among ``replicas`` workers: ``2 (r-1)/r * bytes / bandwidth``."""
    if replicas <= 1 or nbytes == 0:
        return 0.0
    return 2 * (replicas - 1) / replicas * nbytes / bandwidth


def collective_s(nbytes: float, replicas: int, bandwidth: float, latency_s: float = 0.0,
                 collective: tuple[float, float] | None = None, tensors: float = 0.0,
                 tensor_s: float = 0.0) -> float:
    """An all-reduce of ``nbytes`` among ``replicas`` ranks whose slowest link has ``bandwidth``: the ring
    (:func:`ring_allreduce_s`) plus ``latency_s``; or, with ``collective`` (fixed s, bytes/s: the runtime's
    own all-reduce between 2 processes on this host, ``python -m pdcompile.calibrate``), that fit with its
    bytes scaled as a ring scales them, plus the ring at ``bandwidth`` only where the link is slower than
    the host's own path (on one host a slower link is an emulated one, ``pdcompile.slowlink``, which adds
    its time to the real collective's). Either way plus ``tensor_s`` for each of its ``tensors`` gradients:
    the runtime's flatten of them into one buffer and copy of each back (``allreduce_flat``; the
    calibration's per-tensor cost, :func:`tensor_costs`)."""
    if replicas <= 1:
        return 0.0
    per = tensors * tensor_s
    if collective is None:
        return ring_allreduce_s(nbytes, replicas, bandwidth) + latency_s + per
    fixed, rate = collective
    host = fixed + ring_allreduce_s(nbytes, replicas, rate) + per
    return host + (ring_allreduce_s(nbytes, replicas, bandwidth) if bandwidth < rate else 0.0)


def tensor_costs(overhead_s: Mapping[str, float] | float, cluster: Any) -> tuple[Mapping[str, float] | float,
                                                                               float, float]:
    """``overhead_s`` (the per-action costs as :func:`simulate_plan` takes them) without its per-tensor
    entries, and the seconds per parameter tensor of the optimizer step and of the all-reduce's flatten and
    copy back they give (``machine_cache.STEP_TENSOR_KEY``, ``FLATTEN_TENSOR_KEY``: a calibration's,
    ``ActionCost.seconds``); where they give none, ``cluster``'s device kind's default
    (``roofline.TENSOR_STEP_S``, ``TENSOR_FLATTEN_S``: a few microseconds on CPU, 0 on GPUs, which step
    every tensor at once)."""
    from pdcompile.machine_cache import FLATTEN_TENSOR_KEY, STEP_TENSOR_KEY
    from pdcompile.passes.costs.roofline import TENSOR_FLATTEN_S, TENSOR_STEP_S

    dev = getattr(cluster, "device", None)
    kind = str(getattr(dev, "name", "cpu")).lower().split("-")[0]
    step_t, flat_t = TENSOR_STEP_S.get(kind, 0.0), TENSOR_FLATTEN_S.get(kind, 0.0)
    if isinstance(overhead_s, Mapping) and (STEP_TENSOR_KEY in overhead_s or FLATTEN_TENSOR_KEY in overhead_s):
        step_t = float(overhead_s.get(STEP_TENSOR_KEY, step_t))
        flat_t = float(overhead_s.get(FLATTEN_TENSOR_KEY, flat_t))
        overhead_s = {k: v for k, v in overhead_s.items() if k not in (STEP_TENSOR_KEY, FLATTEN_TENSOR_KEY)}
    return overhead_s, step_t, flat_t


def update_bandwidth_of(cluster: Any) -> float:
    """Bytes/s the optimizer step and weight copies stream on ``cluster``'s workers: the device's memory
    bandwidth x efficiency in the analytic model (``roofline.device_spec_for``, ``stream_bandwidth``)."""
    return stream_bandwidth(device_spec_for(cluster))


def stage_param_tensors(layers: Sequence[Any]) -> int:
    """The trainable parameter tensors a stage of ``layers`` holds, as its module's ``parameters()`` counts
    them: each layer's own (``ChainLayer.param_tensors``, tied ones aside) and each tied parameter its layers use
    once (``tied_params``: a stage holds its own copy of one, which its optimizer steps and its all-reduce sums)."""
    return sum(getattr(l, "param_tensors", 0) for l in layers) + \
        len({name for l in layers for name, _ in getattr(l, "tied_params", ())})


def stage_step_s(param_bytes: float, replicas: int, shard: str, optimizer_state_factor: float,
                 bandwidth: float, tensors: float = 0.0, tensor_s: float = 0.0) -> float:
    """A replica's optimizer step over a stage of ``param_bytes`` of weights in ``tensors`` parameter tensors
    (``tensor_s`` each, :func:`~pdcompile.passes.costs.roofline.optimizer_step_s`): all of them, or its
    ``1 / replicas`` share where the replicas shard their state (``shard`` other than ``"none"``: each
    updates its own shard, runtime/shard.py)."""
    sharded = shard != "none" and replicas > 1
    share = param_bytes / replicas if sharded else param_bytes
    return optimizer_step_s(share, optimizer_state_factor, bandwidth, tensors / replicas if sharded else tensors,
                            tensor_s)
