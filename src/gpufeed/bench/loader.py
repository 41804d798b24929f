"""A PyTorch-DataLoader-shaped reader: N worker processes, whole batches per worker,
`prefetch` batches in flight per worker, batches delivered in order.

As in PyTorch, batch b goes to worker b % N, and a new batch is handed out each time the
training loop takes one. Only batch numbers go to workers (each computes the epoch's
shuffle itself) and only counts and per-sample latencies come back, never sample bytes.
Workers persist across epochs (persistent_workers=True) and open their own reader, so no
connection or runtime crosses a fork.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from types import TracebackType
from typing import Any

import numpy as np

from gpufeed.bench.dataset import Dataset
from gpufeed.bench.modes import ReaderSpec
from gpufeed.errors import GpufeedError
from gpufeed.shuffle import epoch_permutation

RESULT_POLL = 1.0
STOP_TIMEOUT = 5.0


class LoaderError(GpufeedError):
    """A worker failed to read; the message is the worker's error."""


@dataclass(frozen=True)
class Batch:
    index: int
    samples: int
    source_bytes: int
    latencies: np.ndarray


@dataclass(frozen=True)
class _Failure:
    worker: int
    message: str


def _context() -> ForkServerContext | SpawnContext:
    """forkserver: workers fork from a clean server that imported this module once, so they
    start fast and inherit no threads or store clients from the benchmark process. Each
    child re-runs the main script (multiprocessing's main-module fixup); for the `gpufeed`
    command that imports the CLI, so the server preloads it too and the re-run is free. The
    reader and the store modules it reads through are preloaded as well: the CLI imports them
    only when a command reads, and a worker importing them in its first batch would count
    the import as that batch's read latency."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(
            ["gpufeed.bench.worker_signals", __name__, "gpufeed.cli.main", "gpufeed.client.reader",
             "gpufeed.sources.stores", "gpufeed.sources.http"]
        )
        return context
    return multiprocessing.get_context("spawn")


@contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends: one that arrived while multiprocessing was
    starting a worker left a child nobody knew to stop, holding the terminal's stderr. The
    Python handlers are swapped rather than the thread's signal mask: with other threads
    running, the kernel hands a blocked signal to one of them and the main thread still runs
    the handler inside the block."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers run in the main thread only: nothing can interrupt this one
        return
    arrived: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda signum, _frame: arrived.append(signum)) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if arrived:
            signal.raise_signal(arrived[0])


def _work(
    worker: int, spec: ReaderSpec, dataset: Dataset, batch: int, seed: int, tasks: Connection, results: Any
) -> None:
    """Worker main: read each assigned batch with one `read_batch`, as PyTorch's fetcher calls
    a dataset's `__getitems__`; a sample's latency is the batch's read time (its samples are
    read together, so each is ready when the batch is). `tasks` is the receiving end of a
    pipe whose only sending end is the parent's, so a parent that died, even by SIGKILL,
    ends the loop with EOF instead of leaving the worker waiting forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us (spawn; forkserver: worker_signals)
    try:
        reader = spec.open(dataset.max_record)
    except Exception as exc:  # reported to the parent, which raises it with context
        results.put(_Failure(worker, str(exc)))
        return
    order_epoch, order = -1, np.empty(0, dtype=np.int64)
    try:
        while (task := _next_task(tasks, results)) is not None:
            epoch, index = task
            if epoch != order_epoch:
                order_epoch, order = epoch, epoch_permutation(seed, epoch, dataset.samples)
            files, starts, ends = dataset.ranges(order[index * batch : (index + 1) * batch])
            reads = list(zip(files.tolist(), starts.tolist(), ends.tolist(), strict=True))
            source_before = reader.source_bytes
            began = time.perf_counter()
            got = reader.read_batch(reads)
            latencies = np.full(len(reads), time.perf_counter() - began)
            for (file, start, end), length in zip(reads, got, strict=True):
                if length != end - start:
                    raise LoaderError(f"{dataset.paths[file]}: read {length} of {end - start} bytes at offset {start}")
            results.put(Batch(index, len(files), reader.source_bytes - source_before, latencies))
    except Exception as exc:
        results.put(_Failure(worker, str(exc)))
    finally:
        reader.close()


def _next_task(tasks: Connection, results: Any) -> tuple[int, int] | None:
    try:
        return tasks.recv()
    except EOFError:  # the parent is gone: nobody will read what is still queued for it
        results.cancel_join_thread()
        return None


class DataLoader:
    def __init__(
        self,
        spec: ReaderSpec,
        dataset: Dataset,
        *,
        batch: int,
        workers: int,
        prefetch: int,
        seed: int,
        ahead: Callable[[np.ndarray], Iterator[object]] | None = None,
    ) -> None:
        self.spec = spec
        self.ahead = ahead
        self.dataset = dataset
        self.batch = batch
        self.workers = workers
        self.prefetch = prefetch
        self.seed = seed
        self.batches_per_epoch = math.ceil(dataset.samples / batch)
        self._processes: list[Any] = []
        self._tasks: list[tuple[Connection, Connection]] = []
        """Each worker's task pipe, (receiving, sending) end: the parent holds the receiving end
        too, so a batch sent to a worker that has failed waits in the pipe instead of raising,
        and the worker's own report of the failure is what the training loop sees."""
        self._results: Any = None

    def __enter__(self) -> DataLoader:
        context = _context()
        self._results = context.Queue()
        try:
            for worker in range(self.workers):
                receiver, tasks = context.Pipe(duplex=False)
                process = context.Process(
                    target=_work,
                    args=(worker, self.spec, self.dataset, self.batch, self.seed, receiver, self._results),
                    name=f"gpufeed-bench-worker-{worker}",
                    daemon=True,
                )
                with _interrupts_deferred():  # a worker started is a worker close() can stop
                    process.start()
                    self._tasks.append((receiver, tasks))
                    self._processes.append(process)
        except BaseException:
            self.close(graceful=False)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(graceful=exc is None)

    def close(self, *, graceful: bool = True) -> None:
        """Stop the workers: after their current task when `graceful`, else at once (an error
        or Ctrl-C should not wait for batches nobody will take)."""
        if graceful:
            for (_, tasks), process in zip(self._tasks, self._processes, strict=True):
                if process.is_alive():
                    tasks.send(None)
        deadline = time.monotonic() + (STOP_TIMEOUT if graceful else 0.0)
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for ends in self._tasks:
            for end in ends:
                end.close()
        if self._results is not None:
            self._results.close()
            self._results.cancel_join_thread()
        self._processes, self._tasks = [], []

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """The epoch's batches in order; `prefetch` x `workers` are requested ahead. With
        `ahead`, its iterator over the epoch's order advances as batches go to workers."""
        total = self.batches_per_epoch
        watcher = self.ahead(epoch_permutation(self.seed, epoch, self.dataset.samples)) if self.ahead else None

        def send(index: int) -> None:
            if watcher is not None:
                for _ in islice(watcher, self.batch):
                    pass
            self._tasks[index % self.workers][1].send((epoch, index))

        try:
            sent = 0
            while sent < min(total, self.prefetch * self.workers):
                send(sent)
                sent += 1
            ready: dict[int, Batch] = {}
            for wanted in range(total):
                while wanted not in ready:
                    got = self._receive()
                    ready[got.index] = got
                if sent < total:
                    send(sent)
                    sent += 1
                yield ready.pop(wanted)
        finally:
            if watcher is not None:
                watcher.close()  # type: ignore[attr-defined]

    def _receive(self) -> Batch:
        while True:
            try:
                got = self._results.get(timeout=RESULT_POLL)
            except queue.Empty:
                dead = [p for p in self._processes if not p.is_alive()]
                if dead:
                    raise LoaderError(f"bench worker {dead[0].name} exited with code {dead[0].exitcode}") from None
                continue
            if isinstance(got, _Failure):
                raise LoaderError(f"bench worker {got.worker}: {got.message}")
            return got
