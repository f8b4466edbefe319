"""This rank's device: the ``--device`` choice (and the backend that follows it), pinned host
memory for data bound for a GPU, and the allocator default per device."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pdcompile.errors import UsageError


def keep_freed_memory(flag: bool | None, device: torch.device) -> bool:
    """``--keep-freed-memory``'s default: on when the stages train on CPU (where every buffer lives
    in malloc's memory), off on GPU (host memory is small there) unless asked for."""
    return flag if flag is not None else device.type == "cpu"


def malloc_mode(mode: str | None, keep: bool | None, device: torch.device) -> str:
    """``--malloc``'s mode (runtime/allocator.py ``MODES``): as given; else ``--keep-freed-memory``'s
    older spelling (``keep``, or ``glibc`` for ``--no-keep-freed-memory``); else ``keep`` on CPU and
    ``glibc`` on GPU (:func:`keep_freed_memory`). Both flags given and disagreeing: a UsageError."""
    if mode is not None and keep is not None and (mode == "keep") != keep:
        raise UsageError(f"--malloc {mode} and --{'' if keep else 'no-'}keep-freed-memory disagree: "
                         f"give only --malloc")
    if mode is not None:
        return mode
    return "keep" if keep_freed_memory(keep, device) else "glibc"


DEVICE_FLAGS = ("auto", "cpu", "cuda")


def choose_device(flag: str, cuda_available: bool, device_count: int, local_rank: int,
                  local_world_size: int) -> tuple[torch.device, str]:
    """``--device`` -> (this rank's device, process-group backend); the backend follows the device:
    NCCL for a GPU, gloo for the CPU. ``auto`` takes the GPUs when CUDA is available. NCCL refuses
    two ranks on one GPU, so a node needs a GPU per local rank; with fewer the job stops with the
    cause and the fix rather than failing later inside NCCL. Pure (counts given), for unit tests."""
    if flag not in DEVICE_FLAGS:
        raise UsageError(f"--device {flag!r}: use one of {', '.join(DEVICE_FLAGS)}")
    if flag == "cpu" or (flag == "auto" and not cuda_available):
        return torch.device("cpu"), "gloo"
    if not cuda_available:
        raise UsageError("--device cuda, but CUDA is not available here (torch.cuda.is_available() is False). "
                         "Fix: run on a GPU machine with a CUDA build of torch, or pass --device cpu")
    if device_count < local_world_size or not 0 <= local_rank < device_count:
        raise UsageError(f"this node has {device_count} GPU(s) for {local_world_size} local ranks (this is "
                         f"LOCAL_RANK {local_rank}): NCCL needs one GPU per rank. Fix: start at most {device_count} "
                         f"processes per node (torchrun --nproc-per-node, with a plan for that many), or pass "
                         f"--device cpu to train on the CPU with gloo")
    return torch.device("cuda", local_rank), "nccl"


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in page-locked host memory when it is bound for a GPU (so its copy there can be
    ``non_blocking``: asynchronous, without a staging copy); as it is otherwise."""
    if device.type != "cuda" or t.device.type != "cpu" or t.is_pinned():
        return t
    return t.pin_memory()


def rank_device() -> torch.device:
    """This rank's device: its GPU (``LOCAL_RANK``) under nccl, else the CPU (the backend follows
    the device, :func:`choose_device`)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
