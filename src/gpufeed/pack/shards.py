"""Writing shards: one task per shard, run in this process, in a pool of local processes, or as
Ray tasks on an existing cluster.

Why processes: a shard's work per member is Python (resolve, read, hash, copy), so threads of
one process take turns on one core; packing 100,000 files of 10 KB took 18 s with one thread
and 21 s with two, 9.5 s with two processes. A process costs a second or two to start (it
imports gpufeed and the caller's main module), about what 15,000 small files cost, so a pack
of fewer files runs its shards on threads of this process, where big files' reads and hashing
leave the GIL anyway (3,000 JPEGs of 113 KB: 1.4 s on two threads, 3.5 s on two processes).

A task carries only names (member paths, the destination's URL and options): each process
reads through its own `gpufeed.client()` (the node's cache and agent, pinned and checked like
any read) and writes to its own handle on the destination store.
"""

from __future__ import annotations

import hashlib
import mmap
import multiprocessing
import os
import queue
import select
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import gpufeed
from gpufeed.blocks import chunk_sums, sums_length
from gpufeed.errors import InvalidArgument, PackError
from gpufeed.sources import open_source

READ_BATCH_BYTES = 64 << 20
READ_BATCH_FILES = 1024
PROGRESS_EVERY_S = 0.2
PROCESSES_FROM_FILES = 20_000
"""A pack of at least this many files runs its shards in processes; a smaller one on threads."""

Progress = Callable[[int, int], None]
"""Hears files and bytes just done (a delta)."""


@dataclass(frozen=True)
class ShardTask:
    """One shard to write: its members' namespace paths, sizes and offsets in shard order."""

    key: str
    size: int
    paths: list[str]
    sizes: list[int]
    offsets: list[int]
    dest_url: str
    dest_options: dict[str, str]


SUMS_SUFFIX = ".sums"


def sums_key(shard_key: str) -> str:
    """Where a shard's sums are stored (`sums_size`), written after the shard: a rerun keeps a
    shard only when they are there."""
    return f"{shard_key}{SUMS_SUFFIX}"


def sums_size(members: int, shard_size: int) -> int:
    """Bytes of a shard's sums: 32 of sha256 per member, in shard order, then its chunk sums
    (`blocks.chunk_sums`: 8 bytes per 256 KiB of the shard), which readers check blocks against."""
    return 32 * members + sums_length(shard_size)


def _batches(task: ShardTask) -> Iterator[range]:
    start = size = 0
    for n, length in enumerate(task.sizes):
        size += length
        if size >= READ_BATCH_BYTES or n + 1 - start >= READ_BATCH_FILES:
            yield range(start, n + 1)
            start, size = n + 1, 0
    if start < len(task.sizes):
        yield range(start, len(task.sizes))


class ShardBuffers:
    """Shard-sized buffers handed from one shard to the next. A fresh anonymous map is zero and
    is faulted in page by page as members land (a quarter of a small-file pack's time here);
    a reused one is only overwritten, the gaps between its members zeroed. They are unmapped
    when the pool is dropped, so nothing outlives the pack."""

    def __init__(self) -> None:
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()

    @contextmanager
    def lend(self, size: int) -> Iterator[tuple[mmap.mmap, bool]]:
        """(buffer of at least `size` bytes, whether it is fresh, all zero), given back after."""
        try:
            buffer, fresh = self._free.get_nowait(), False
        except queue.Empty:
            buffer, fresh = None, True
        if buffer is None or len(buffer) < size:
            buffer, fresh = mmap.mmap(-1, max(size, 1)), True
        try:
            yield buffer, fresh
        finally:
            self._free.put(buffer)


def _zero_gaps(shard: memoryview, task: ShardTask) -> None:
    """Zero what no member covers (alignment padding, the tail) in a reused buffer."""
    at = 0
    for offset, size in sorted(zip(task.offsets, task.sizes, strict=True)):
        if offset > at:
            shard[at:offset] = bytes(offset - at)
        at = max(at, offset + size)
    if at < len(shard):
        shard[at:] = bytes(len(shard) - at)


def write_shard(task: ShardTask, progress: Progress | None = None, buffers: ShardBuffers | None = None) -> bytes:
    """Read the shard's members into their places in it (batched, through the read path), hash
    them and the shard's chunks, PUT the shard and then its sums (`sums_size`); returns the sums."""
    with (buffers or ShardBuffers()).lend(task.size) as (buffer, fresh):
        return _write(task, memoryview(buffer)[: task.size], fresh, progress)


def _write(task: ShardTask, shard: memoryview, fresh: bool, progress: Progress | None) -> bytes:
    client = gpufeed.client()
    dest = open_source(task.dest_url, task.dest_options, client.settings)
    if not fresh:
        _zero_gaps(shard, task)
    sums: list[bytes] = []
    for batch in _batches(task):
        targets = [shard[task.offsets[n] : task.offsets[n] + task.sizes[n]] for n in batch]
        sizes = client.read_once_into([task.paths[n] for n in batch], targets)
        for n, size, target in zip(batch, sizes, targets, strict=True):
            if size != task.sizes[n]:
                listed = f"it is {size} bytes, the manifest lists {task.sizes[n]}"
                raise PackError(f"{task.paths[n]}: {listed}; run 'gpufeed mount refresh'")
            sums.append(hashlib.sha256(target).digest())
        if progress is not None:
            progress(len(batch), sum(task.sizes[n] for n in batch))
    dest.put(task.key, shard)
    all_sums = b"".join(sums) + chunk_sums(shard)
    dest.put(sums_key(task.key), all_sums)
    return all_sums


def run(tasks: Sequence[ShardTask], *, workers: int, progress: Progress, ray_address: str | None = None) -> list[bytes]:
    """Every task's sums, in task order: on Ray when `ray_address` is given, else `workers`
    at a time on this machine (processes for many files, threads of this process for few)."""
    if workers < 1:
        raise InvalidArgument(f"--workers {workers}: must be at least 1")
    if ray_address is not None:
        return _on_ray(tasks, ray_address, progress)
    buffers = ShardBuffers()
    if workers == 1 or len(tasks) <= 1:
        return [write_shard(task, progress, buffers) for task in tasks]
    workers = min(workers, len(tasks))
    if sum(len(task.paths) for task in tasks) < PROCESSES_FROM_FILES:
        with ThreadPoolExecutor(workers, thread_name_prefix="gpufeed-pack") as pool:
            return list(pool.map(lambda task: write_shard(task, progress, buffers), tasks))
    return _in_processes(tasks, workers, progress)


_progress_queue: Any = None


def _start_worker(environment: dict[str, str], progress: Any, packer: int) -> None:
    """A pool process sees the namespace, agent and stores of the process that started the pack,
    whatever environment the start method gave it, and ends with that process."""
    global _progress_queue
    os.environ.clear()
    os.environ.update(environment)
    _progress_queue = progress
    _end_with(packer)


def _end_with(pid: int) -> None:
    """Exit when process `pid` does. A pack killed (SIGTERM from a scheduler or `timeout`,
    kill -9) otherwise left its pool processes waiting for tasks for ever, holding its caller's
    output open (a CI step that waits for it hung) and the namespace's database."""
    pidfd_open = getattr(os, "pidfd_open", None)  # Linux only
    if pidfd_open is None:
        return
    try:
        watched = pidfd_open(pid)
    except ProcessLookupError:  # gone already
        os._exit(1)
    except OSError:  # a kernel before 5.3, or a sandbox that forbids it: no watch
        return

    def watch() -> None:
        select.select([watched], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="gpufeed-pack-parent", daemon=True).start()


_process_buffers = ShardBuffers()


def _pooled_shard(task: ShardTask) -> bytes:
    return write_shard(task, lambda files, size: _progress_queue.put((files, size)), _process_buffers)


def _in_processes(tasks: Sequence[ShardTask], workers: int, progress: Progress) -> list[bytes]:
    """Forkserver children (spawn where there is none): nothing of this process's threads, agent
    connection or open database is inherited."""
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    done: Any = context.Queue()
    stop = threading.Event()

    def relay() -> None:
        while not stop.is_set():
            try:
                progress(*done.get(timeout=PROGRESS_EVERY_S))
            except queue.Empty:
                continue

    listener = threading.Thread(target=relay, name="gpufeed-pack-progress", daemon=True)
    listener.start()
    try:
        environment = dict(os.environ)
        starting = (environment, done, os.getpid())
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=starting) as pool:
            futures = [pool.submit(_pooled_shard, task) for task in tasks]
            try:
                return [future.result() for future in futures]
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    finally:
        stop.set()
        listener.join()
        while not done.empty():
            progress(*done.get_nowait())
        done.close()


def _on_ray(tasks: Sequence[ShardTask], address: str, progress: Progress) -> list[bytes]:
    """One Ray task per shard on the cluster at `address`. Each task runs where Ray places it
    and reads through that node's gpufeed agent; the namespace's metadata must be one every node
    reaches (GPUFEED_META pointing at Redis), and the tasks see this process's GPUFEED_* and
    store credential variables."""
    try:
        import ray
    except ImportError:
        raise InvalidArgument("--ray needs Ray: pip install 'gpufeed[pool]'") from None
    from gpufeed.pool.client import reachable

    if address != "auto" and not address.startswith("ray://"):
        reachable(address, "--ray")
    environment = {k: v for k, v in os.environ.items() if k.startswith(("GPUFEED_", "AWS_", "GOOGLE_", "AZURE_"))}
    joined = not ray.is_initialized()
    if joined:
        try:
            ray.init(address=address, runtime_env={"env_vars": environment}, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise InvalidArgument(f"--ray {address}: cannot join the Ray cluster ({str(exc).splitlines()[0]})") from None
    try:
        return _ray_tasks(ray, tasks, progress)
    finally:
        if joined:
            ray.shutdown()


def _ray_tasks(ray: Any, tasks: Sequence[ShardTask], progress: Progress) -> list[bytes]:
    remote = ray.remote(num_cpus=1, max_retries=2)(write_shard)
    pending = {remote.remote(task): n for n, task in enumerate(tasks)}
    results: list[bytes] = [b""] * len(tasks)
    waiting = list(pending)
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1)
        for ref in ready:
            n = pending[ref]
            try:
                results[n] = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                raise exc.as_instanceof_cause() from None
            progress(len(tasks[n].paths), sum(tasks[n].sizes))
    return results

