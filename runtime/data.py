"""Data for emitted programs: the first stage's source (``--data``, plan.json's factory, or seeded random
minibatches), read in epochs and in shares (:class:`Reader`: each input-stage replica reads only the
microbatches it runs), whether the last stage reads targets itself, minibatches streamed by
``CompiledPipeline.run`` (:class:`StoreStream`), and minibatches saved to a file (tests)."""

from __future__ import annotations

import argparse
import datetime
import io
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from pdcompile.errors import UsageError
from pdcompile.runtime.program import Program, load_callable

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def no_target(batch: int) -> torch.Tensor:
    """The target of a minibatch of ``batch`` samples for a model that computes its own loss (its forward
    takes the targets as inputs): nothing per sample, so it splits into microbatches, travels (no bytes) and
    is checked as any target."""
    return torch.empty((batch, 0))


def batch_parts(batch: Any, keywords: Sequence[str] = (), what: str = "--data"
                ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A minibatch as the first stage takes it: ``(inputs, target)``, the inputs positional then the tensors
    of the keyword inputs in ``keywords``' order (the compiled program's). ``batch`` is ``(inputs, target)``
    or ``(args, kwargs, target)``; inputs a tensor or a tuple of them; a target of None (the model computes
    its own loss) is :func:`no_target`."""
    try:
        if isinstance(batch, (tuple, list)) and len(batch) == 3:
            args, kwargs, target = batch
        else:
            args, target = batch
            kwargs = None
    except (TypeError, ValueError):
        raise UsageError(f"{what}: a minibatch must be (inputs, target) or (args, kwargs, target), got "
                         f"{type(batch).__name__}") from None
    args = (args,) if isinstance(args, torch.Tensor) else tuple(args)
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise UsageError(f"{what}: in (args, kwargs, target), kwargs must be a dict, got {type(kwargs).__name__}")
        extra = [k for k in kwargs if k not in keywords]
        missing = [k for k in keywords if k not in kwargs]
        if extra or missing:
            raise UsageError(f"{what}: the minibatch's keyword inputs are {sorted(kwargs)}, the program was compiled "
                             f"with the tensors {list(keywords)} (other example_kwargs are constants of the program): "
                             f"give exactly those")
        args = (*args, *(kwargs[k] for k in keywords))
    elif keywords and args and isinstance(args[-1], dict):
        raise UsageError(f"{what}: keyword inputs go in (args, kwargs, target) minibatches")
    if target is None:
        if not args:
            raise UsageError(f"{what}: a minibatch without inputs")
        target = no_target(int(args[0].shape[0]))
    if not isinstance(target, torch.Tensor) or target.dim() == 0:
        raise UsageError(f"{what}: each minibatch's target must be a tensor with a batch dimension (or None where "
                         f"the model computes its own loss)")
    return args, target


def check_inputs(inputs: Sequence[torch.Tensor], specs: Sequence[Any], what: str = "--data") -> None:
    """The guard of shapes the tracer took as constants: every input has the compiled sample shape (all but
    dim 0; a model's ``b, t = idx.size()`` and asserts on them were decided on the example)."""
    if len(inputs) != len(specs):
        raise UsageError(f"{what}: a minibatch has {len(inputs)} input tensor(s), the program was compiled for "
                         f"{len(specs)} ({', '.join(s.name for s in specs)})")
    for x, s in zip(inputs, specs):
        if tuple(x.shape[1:]) != tuple(s.shape[1:]):
            raise UsageError(f"{what}: input {s.name!r} has samples of shape {tuple(x.shape[1:])}, the program was "
                             f"compiled for {tuple(s.shape[1:])}: shapes are fixed by the example inputs; recompile "
                             f"with examples of this shape, or pad or crop the data")


def save_batches(batches: Iterable[Any], steps: int, path: str | Path, keywords: Sequence[str] = ()) -> int:
    """Save the first ``steps`` minibatches of ``batches`` ((inputs, target) pairs, inputs a tensor or a
    tuple of tensors, or (args, kwargs, target) with the tensor ``keywords`` of the program; :func:`batch_parts`)
    as one tensor file; returns the minibatch size."""
    tensors: dict[str, torch.Tensor] = {}
    it = iter(batches)
    size = None
    for i in range(steps):
        try:
            inputs, target = batch_parts(next(it), keywords)
        except StopIteration:
            raise ValueError(f"the data ran out after {i} minibatches; {steps} steps need {steps}") from None
        for j, x in enumerate(inputs):
            tensors[f"{i}.input.{j}"] = x.detach().cpu().contiguous()
        tensors[f"{i}.target"] = target.detach().cpu().contiguous()
        if size is None:
            size = int(target.shape[0])
        elif int(target.shape[0]) != size:
            raise ValueError(f"minibatch {i} has {target.shape[0]} samples, the first had {size}: "
                             f"every minibatch must have the same size (drop_last=True)")
    torch.save(tensors, path)
    return int(size or 0)


def from_file(batch_size: int, path: str) -> Iterator[Batch]:
    """Yield the minibatches saved by :func:`save_batches` (``batch_size`` is checked)."""
    tensors = torch.load(path, weights_only=True)
    i = 0
    while f"{i}.target" in tensors:
        n = sum(1 for k in tensors if k.startswith(f"{i}.input."))
        target = tensors[f"{i}.target"]
        if target.shape[0] != batch_size:
            raise ValueError(f"{path}: minibatch {i} has {target.shape[0]} samples, the plan needs {batch_size}")
        yield tuple(tensors[f"{i}.input.{j}"] for j in range(n)), target
        i += 1


def data_source(program: Program, args: argparse.Namespace, batch_size: int) -> Iterator[Any]:
    """The training data's minibatches, as one endless-or-finite iterator (no epochs, no shares)."""
    return iter(source(program, args, batch_size))


def source(program: Program, args: argparse.Namespace, batch_size: int, flag: str = "data") -> Any:
    """What the data hook returns, not yet iterated: ``--data`` (or ``--eval-data``, ``flag="eval_data"``)
    called with the minibatch size, else plan.json's factory, else seeded random minibatches."""
    path = getattr(args, flag, None)
    if path:
        return load_callable(path, program.folder)(batch_size)
    spec = program.raw.get("data")
    if flag == "data" and spec:
        return load_callable(spec["factory"], program.folder)(batch_size, **spec.get("kwargs", {}))
    return RandomBatches(program, batch_size, args.seed)


class RandomBatches:
    """Endless seeded random minibatches shaped like the plan's inputs (:func:`random_batches`)."""

    def __init__(self, program: Program, batch_size: int, seed: int) -> None:
        self.program, self.batch_size, self.seed = program, batch_size, seed

    def __iter__(self) -> Iterator[Any]:
        return random_batches(self.program, self.batch_size, self.seed)


def epoch_length(data: Any) -> int | None:
    """Full minibatches in one pass over ``data`` (a short last one is not counted: the pipeline's
    microbatches have fixed shapes), or None when ``data`` has no length (an endless generator)."""
    if isinstance(data, DataLoader) and data.batch_size is not None:
        try:
            return len(data.sampler) // data.batch_size  # type: ignore[arg-type]
        except TypeError:  # an IterableDataset
            return None
    try:
        return len(data)
    except TypeError:
        return None


def positions(stage_ranks: Sequence[Sequence[int]], rank: int, M: int) -> Callable[[int], tuple[int, ...]] | None:
    """Which microbatches (positions ``0..M-1``) of minibatch ``i`` this rank needs: those of the
    stages in ``stage_ranks`` (the data-reading stages it holds), microbatch ``k`` going to replica
    ``k % replicas`` of a stage (``StageExecutor.peer``). None: every one (no stage it reads for is replicated)."""
    shares = [(len(rs), list(rs).index(rank)) for rs in stage_ranks if rank in rs]
    if not shares or all(n == 1 for n, _ in shares):
        return None
    return lambda i: tuple(j for j in range(M) if any((i * M + j) % n == r for n, r in shares))


class _ShareSampler:
    """A DataLoader's batch sampler cut to this rank's share: of each minibatch's indices, only those
    of the microbatches at ``positions(i)``, so the loader fetches (and its workers load) nothing else.
    Each pass is seeded by its number: a shuffling sampler without a generator of its own draws its
    order from torch's global generator, which would differ between the ranks reading shares."""

    def __init__(self, inner: Iterable[list[int]], b: int, positions: Callable[[int], tuple[int, ...]],
                 length: int, seed: int) -> None:
        self.inner, self.b, self.positions, self.length, self.seed = inner, b, positions, length, seed
        self.first = 0  # the global index of the next pass's first minibatch
        self.passes = 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[list[int]]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 100_003 + self.passes)
            it = iter(self.inner)
            head = list(itertools.islice(it, 1))
        first, self.first, self.passes = self.first, self.first + self.length, self.passes + 1
        for n, idx in enumerate(itertools.islice(itertools.chain(head, it), self.length)):
            idx = list(idx)
            share = [x for j in self.positions(first + n) for x in idx[j * self.b:(j + 1) * self.b]]
            if share:  # none of this minibatch's microbatches is this rank's: Reader does not fetch it
                yield share


def _shared_loader(loader: DataLoader[Any], b: int, positions: Callable[[int], tuple[int, ...]],
                   length: int, seed: int) -> DataLoader[Any] | None:
    """``loader`` fetching only this rank's share (:class:`_ShareSampler`), or None where it has no batch
    sampler to cut (an IterableDataset: then every minibatch is read and the share kept)."""
    if loader.batch_sampler is None or not hasattr(loader.dataset, "__getitem__"):
        return None
    return DataLoader(loader.dataset, batch_sampler=_ShareSampler(loader.batch_sampler, b, positions, length, seed),
                      num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
                      prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)


Local = tuple[int, tuple[int, ...], tuple[torch.Tensor, ...], torch.Tensor]


class Reader:
    """Minibatch after minibatch (numbered on across epochs) as one rank needs them: ``next()`` gives
    ``(i, positions, inputs, target)``, the inputs and target holding only the microbatches at
    ``positions`` (in that order, ``b`` samples each). Each epoch is a new pass over ``data``; a
    DataLoader is cut so that this rank fetches only its share (:class:`_ShareSampler`), any other
    iterable is read whole and its share kept. Nothing is read before it is asked for."""

    def __init__(self, data: Any, b: int, M: int, positions: Callable[[int], tuple[int, ...]] | None,
                 length: int | None, seed: int = 0, what: str = "--data", one_pass: bool = False,
                 keywords: Sequence[str] = ()) -> None:
        self.b, self.M, self.positions, self.length, self.what = b, M, positions, length, what
        self.keywords = tuple(keywords)  # the program's keyword inputs, in its order (batch_parts)
        self.one_pass = one_pass  # ``--steps``: the data runs out at the end of its first pass, as read whole
        self.data = data
        if isinstance(data, DataLoader) and positions is not None and length is not None:
            self.data = _shared_loader(data, b, positions, length, seed) or data
        self.shared = self.data is not data
        self.index = 0  # the next minibatch's global number
        self.epoch = 0
        self._it: Iterator[Any] | None = None
        self._in_epoch = 0

    def _next_raw(self, fetch: bool = True) -> Any:
        """The next minibatch of the pass (a new pass where one ends); ``fetch`` False: only count it (a
        shared loader yields nothing for a minibatch without microbatches of this rank's)."""
        if self._it is None or (self.length is not None and self._in_epoch == self.length):
            if self._it is not None and self.one_pass:
                raise UsageError(f"{self.what}: the data ran out after {self.index} minibatches; give --epochs "
                                 f"with data that has a length, or fewer --steps")
            if self._it is not None and isinstance(self.data, Iterator):
                raise UsageError(f"{self.what}: the data hook returned an iterator, which can be read only once, "
                                 f"and epoch {self.epoch + 2} needs another pass; return a DataLoader or a list")
            if self._it is not None:
                self.epoch += 1
            self._it, self._in_epoch = iter(self.data), 0
        if not fetch:
            self._in_epoch += 1
            return None
        try:
            batch = next(self._it)
        except StopIteration:
            raise UsageError(f"{self.what}: the data ran out after {self.index} minibatches"
                             + (f" ({self._in_epoch} of epoch {self.epoch + 1}, whose length said {self.length})"
                                if self.length is not None else "; give --epochs with data that has a length, "
                                "or fewer --steps")) from None
        self._in_epoch += 1
        return batch

    def __iter__(self) -> Iterator[Local]:
        return self

    def __next__(self) -> Local:
        i = self.index
        pos = tuple(range(self.M)) if self.positions is None else self.positions(i)
        if self.shared and not pos:  # a replica's turn skipped (fewer microbatches than replicas): nothing read
            self._next_raw(fetch=False)
            self.index += 1
            return i, pos, (), torch.empty(0)
        inputs, target = batch_parts(self._next_raw(), self.keywords, f"{self.what}: minibatch {i}")
        want = self.b * (len(pos) if self.shared else self.M)
        if int(target.shape[0]) != want:
            raise UsageError(f"{self.what}: minibatch {i} has {target.shape[0]} samples, the pipeline needs "
                             f"{self.b * self.M} ({self.M} microbatches of {self.b}); use drop_last=True")
        if not self.shared and self.positions is not None:  # read whole: keep this rank's microbatches
            def keep(x: torch.Tensor) -> torch.Tensor:
                parts = x.split(self.b)
                return torch.cat([parts[j] for j in pos]) if pos else x[:0]
            inputs, target = tuple(keep(x) for x in inputs), keep(target)
        self.index += 1
        return i, pos, inputs, target

    def skip(self, n: int) -> None:
        """Pass over ``n`` minibatches (a resumed run's consumed ones)."""
        for _ in range(n):
            next(self)


DETERMINISTIC_SOURCES = ("pdcompile.runtime.data:from_file", "pdcompile.zoo:batches")  # seeded, same on every rank


def local_targets(program: Program, args: argparse.Namespace) -> bool:
    """Whether the last stage reads targets from the data itself instead of receiving them (see
    ``--targets``): a message per microbatch saved, ~7% of a small GPT's step on this machine."""
    if args.targets != "auto":
        return args.targets == "local"
    spec = program.raw.get("data")
    return not args.data and (not spec or spec.get("factory") in DETERMINISTIC_SOURCES)


def random_batches(program: Program, batch_size: int, seed: int) -> Iterator[Any]:
    """Seeded random minibatches shaped like the plan's inputs and target."""
    g = torch.Generator().manual_seed(seed)
    b = program.raw["microbatch_size"]

    def draw(spec: Any) -> torch.Tensor:
        shape = (batch_size,) + tuple(spec.shape[1:]) if spec.shape and spec.shape[0] == b else spec.shape
        if spec.dtype.is_floating_point:
            return torch.randn(shape, generator=g, dtype=spec.dtype)
        hi = int(program.raw.get("data_high", 2))
        return torch.randint(0, hi, shape, generator=g, dtype=spec.dtype)

    while True:
        yield tuple(draw(s) for s in program.stages[0].inputs), draw(program.target)


# --- minibatches streamed from the process that called CompiledPipeline.run -------------------------

STREAM_ENV = "PDCOMPILE_STREAM"  # HOST:PORT of the caller's TCPStore (pdcompile/data_stream.py)


def stream_key(name: str, i: int) -> str:
    """The store key of minibatch ``i`` of stream ``name`` (``train``, or ``eval/P`` for pass P)."""
    return f"{name}/{i}"


class StoreStream:
    """Minibatches that ``CompiledPipeline.run`` puts, a few ahead, into a ``torch.distributed.TCPStore``
    it hosts: ``name`` ``train`` (one sequence over every epoch: each pass yields the next ``len``) or
    ``eval`` (pass P reads ``eval/P/0..``). Each minibatch read is counted in the store (``KEY/read``),
    so the caller drops it once every reading rank has it: no file holds the data, no rank holds more
    than the minibatch it trains on."""

    def __init__(self, name: str, timeout: float = 600) -> None:
        address = os.environ.get(STREAM_ENV)
        if not address:
            raise UsageError(f"pdcompile.runtime.data:stream_{name} reads minibatches CompiledPipeline.run streams "
                             f"({STREAM_ENV} is not set): use it only through run(), or give --data MODULE:FUNCTION")
        host, _, port = address.rpartition(":")
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
        self.name, self.timeout = name, timeout
        self.length = int(self.store.get(f"{name}/length"))
        self.next = 0  # train: the next minibatch of the sequence
        self.passes = 0  # eval: passes begun

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Any]:
        if self.name == "train":
            first, self.next = self.next, self.next + self.length
            keys = [stream_key("train", first + n) for n in range(self.length)]
        else:
            self.passes += 1
            keys = [stream_key(f"eval/{self.passes - 1}", n) for n in range(self.length)]
        for key in keys:
            yield self._get(key)

    def _get(self, key: str) -> Any:
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while not self.store.check([key]):  # polled: the store's own wait logs a warning at each timeout
            if self.store.check(["error"]):
                raise UsageError(f"run(): the data failed in the calling process: {self.store.get('error').decode()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"run(): minibatch {key} did not arrive within {self.timeout:g} s")
            time.sleep(pause)
            pause = min(0.01, pause * 2)
        batch = torch.load(io.BytesIO(self.store.get(key)), weights_only=True)
        self.store.add(f"{key}/read", 1)
        return batch


def stream_train(batch_size: int) -> StoreStream:
    """``--data`` of a run started by ``CompiledPipeline.run``: the caller's training minibatches."""
    return StoreStream("train")


def stream_eval(batch_size: int) -> StoreStream:
    """``--eval-data`` of a run started by ``CompiledPipeline.run``: the caller's validation minibatches."""
    return StoreStream("eval")
