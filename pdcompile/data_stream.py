"""``CompiledPipeline.run``'s data, streamed to the ranks it launches (docs/training-loop.md).

This process hosts a ``torch.distributed.TCPStore`` and puts each minibatch into it (``torch.save``
bytes under ``train/I``, or ``eval/P/I`` for validation pass P) a few ahead of the ranks; each rank
that reads data (``pdcompile.runtime.data:stream_train`` / ``stream_eval``, given as ``--data`` /
``--eval-data``) counts its read, and the minibatch is dropped once every reader has it. So the data
is never saved whole, and memory holds ``window`` minibatches at most, however long the run."""

from __future__ import annotations

import datetime
import io
import itertools
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pdcompile.errors import UsageError
from pdcompile.launcher import free_port
from pdcompile.runtime.data import batch_parts, stream_key


def _pair(batch: Any, what: str, keywords: Sequence[str] = ()) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``batch`` as the ranks read it: (inputs, target) on the CPU, keyword inputs flattened in the program's
    order (:func:`~pdcompile.runtime.data.batch_parts`)."""
    inputs, target = batch_parts(batch, keywords, f"run: {what}")
    return tuple(x.detach().cpu() for x in inputs), target.detach().cpu()


def sequence(data: Iterable[Any], count: int, per_pass: int | None,
             started: tuple[Any, Iterator[Any]] | None = None, what: str = "data") -> Iterator[Any]:
    """``count`` minibatches of ``data``: passes of ``per_pass`` each (a new ``iter(data)`` per pass), or
    one pass when ``per_pass`` is None. ``started``: the first pass's first minibatch and its iterator."""
    done = 0
    it: Iterator[Any] = itertools.chain([started[0]], started[1]) if started else iter(data)
    while done < count:
        take = count - done if per_pass is None else min(per_pass, count - done)
        got = 0
        for batch in itertools.islice(it, take):
            yield batch
            got += 1
        done += got
        if got < take:
            raise UsageError(f"run: the {what} ran out after {done} minibatches; {count} are needed")
        it = iter(data)


class Feeder:
    """The store and the threads that fill it; :meth:`close` stops them and says what they met."""

    def __init__(self, readers: int, window: int = 4, timeout: float = 600, keywords: Sequence[str] = ()) -> None:
        port = free_port()
        self.store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout))
        self.address = f"127.0.0.1:{port}"
        self.readers, self.window = readers, window
        self.keywords = tuple(keywords)  # the program's tensor keyword inputs, in its order
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.error: BaseException | None = None

    def feed(self, name: str, length: int, streams: Iterator[tuple[str, Iterator[Any]]]) -> None:
        """Serve ``streams`` (key prefix, minibatches) one after another; ``name/length`` tells the ranks how
        many minibatches one pass of ``name`` has."""
        self.store.set(f"{name}/length", str(length))
        t = threading.Thread(target=self._serve, args=(streams,), daemon=True, name=f"pdcompile-feed-{name}")
        t.start()
        self.threads.append(t)

    def _serve(self, streams: Iterator[tuple[str, Iterator[Any]]]) -> None:
        try:
            for prefix, batches in streams:
                sent: list[str] = []
                for i, batch in enumerate(batches):
                    if len(sent) >= self.window:
                        self._drop(sent.pop(0))
                    if self.stopping.is_set():
                        return
                    buf = io.BytesIO()
                    torch.save(_pair(batch, "data", self.keywords), buf)
                    key = stream_key(prefix, i)
                    self.store.set(key, buf.getvalue())  # type: ignore[arg-type]  # it takes bytes
                    sent.append(key)
                for key in sent:
                    self._drop(key)
        except BaseException as e:  # noqa: BLE001 - handed to the ranks (they stop) and to close()
            self.error = e
            self.store.set("error", f"{type(e).__name__}: {e}")

    def _drop(self, key: str) -> None:
        """Wait until every reader has read ``key``, then delete it."""
        while self.store.add(f"{key}/read", 0) < self.readers:
            if self.stopping.is_set():
                return
            time.sleep(0.002)
        self.store.delete_key(key)
        self.store.delete_key(f"{key}/read")

    def close(self) -> str | None:
        """Stop the threads; what the data raised (``Type: message``), or None."""
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=5)
        return None if self.error is None else f"{type(self.error).__name__}: {self.error}"
