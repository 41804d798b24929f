"""Sampler-aware prefetch: the job knows the exact order it will read samples in, so the blocks
of the next window of reads are fetched by the node agent before they are asked for.

    prefetcher = Prefetcher(client)
    for index in prefetcher.ahead(sampler_indices, lambda i: Read(paths[i], 0, sizes[i])):
        ...  # by the time `index` is read, its blocks are (usually) on local disk

`ahead` yields the items unchanged and in order. A background thread resolves the upcoming
reads and sends them to the agent in batches, in order of need; the window is bounded in
bytes and sized from the measured consume rate times the source latency. Reads already
consumed are released (their blocks may be evicted again); closing the prefetcher or ending
the iteration cancels what was not fetched yet. PyTorch datasets, `gpufeed warmup` and
`gpufeed bench --mode cached` all use this one mechanism.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from gpufeed.client import Client, ObjectHandle
from gpufeed.errors import GpufeedError

T = TypeVar("T")

MIN_WINDOW_BYTES = 16 << 20
MAX_WINDOW_BYTES = 512 << 20
DEFAULT_LATENCY_S = 0.05
SAFETY = 4.0
BATCH_BLOCKS = 256
RECENT_BLOCKS = 65536
RECENT_HANDLES = 4096
RESOLVE_BATCH = 64
"""Items taken from the order at a time, their files' handles looked up together."""


@dataclass(frozen=True, slots=True)
class Read:
    """Bytes [start, end) of the file at namespace path `path` (end=None: to the end)."""

    path: str
    start: int = 0
    end: int | None = None


class Prefetcher:
    def __init__(self, client: Client, *, min_bytes: int = MIN_WINDOW_BYTES, max_bytes: int = MAX_WINDOW_BYTES) -> None:
        self.client = client
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._handles: collections.OrderedDict[str, ObjectHandle] = collections.OrderedDict()
        self._queue: queue.Queue[tuple[list[tuple[ObjectHandle, list[int]]], int] | None] = queue.Queue()
        """Batches of wanted blocks, each with the samples asked for ahead of the consumer then."""
        self._thread: threading.Thread | None = None
        self._session = f"{id(self):x}-{time.monotonic_ns():x}"
        self.latency_s = DEFAULT_LATENCY_S
        self.errors = 0
        self.requests = 0
        """Prefetch requests sent to the agent."""

    def window_bytes(self, rate_bytes_s: float) -> int:
        """How far ahead to fetch: what the job consumes while a fetch is in flight, with room
        for bursts, within [min_bytes, max_bytes]."""
        return int(min(self.max_bytes, max(self.min_bytes, SAFETY * rate_bytes_s * self.latency_s)))

    def _resolved(self, items: list[T], read_of: Callable[[T], Read | None]) -> list[tuple[T, Read | None, ObjectHandle | None]]:
        """Each item with its read and the handle of the read's file, the handles this
        prefetcher does not remember looked up together (`Client.handle_many`). Handles of
        recent paths only: samples sharing a file reuse one, and a million-file epoch does not
        keep a million handles."""
        reads = [read_of(item) for item in items]
        unknown = list(dict.fromkeys(r.path for r in reads if r is not None and r.path not in self._handles))
        for path, handle in zip(unknown, self.client.handle_many(unknown) if unknown else [], strict=True):
            self._handles[path] = handle
        while len(self._handles) > max(RECENT_HANDLES, len(unknown)):
            self._handles.popitem(last=False)
        return [(item, read, None if read is None else self._handles[read.path]) for item, read in zip(items, reads, strict=True)]

    def _blocks(self, read: Read, handle: ObjectHandle) -> tuple[list[int], int]:
        end = handle.size if read.end is None else min(read.end, handle.size)
        if handle.blocks is None or end <= read.start:
            return [], 0
        start, end = handle.extent(read.start, end)  # a pack member's blocks are its shard's
        size = handle.blocks.block_size
        return list(range(start // size, (end - 1) // size + 1)), end - start

    def _sender(self) -> None:
        """Background thread: send the wanted blocks to the agent, in order. What was queued
        while the last request was out goes as one request (a loader that takes a batch of
        indices at once tops the window up sample by sample: a request each would cost the agent
        a round trip per sample). Blocks already on disk are not asked for again: a warm epoch
        costs a stat per block here instead of an agent round trip per block."""
        while (queued := self._queue.get()) is not None:
            batch, ahead = queued
            count = sum(len(blocks) for _, blocks in batch)
            while count < BATCH_BLOCKS:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    return  # closed: its prefetch is cancelled, nothing more is sent
                batch, ahead = batch + more[0], more[1]
                count += sum(len(blocks) for _, blocks in more[0])
            missing = [(handle, absent) for handle, blocks in batch if (absent := _not_on_disk(handle, blocks))]
            if not missing:
                continue
            try:
                self.requests += 1
                reply = self.client.prefetch(missing, self._session, ahead_samples=ahead)
                self.latency_s = max(0.001, reply.latency_s)
            except GpufeedError:
                self.errors += 1  # a prefetch is a hint: the read itself will fetch or fail

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._sender, name="gpufeed-prefetch", daemon=True)
            self._thread.start()

    def ahead(self, items: Iterable[T], read_of: Callable[[T], Read | None]) -> Iterator[T]:
        """Yield `items` in order while the blocks of the upcoming window are fetched ahead."""
        self._start()
        source = iter(items)
        window: collections.deque[tuple[T, int]] = collections.deque()
        pending: collections.deque[tuple[T, Read | None, ObjectHandle | None]] = collections.deque()
        """Items taken from `items` with their handles, not yet in the window."""
        window_bytes = 0
        consumed_bytes = 0
        started = time.monotonic()
        exhausted = False
        sent: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        try:
            while True:
                rate = consumed_bytes / max(1e-3, time.monotonic() - started)
                target = self.window_bytes(rate)
                batch: list[tuple[ObjectHandle, list[int]]] = []
                batch_blocks = 0
                while not exhausted and (window_bytes < target or not window):
                    if not pending:
                        pending.extend(self._resolved(list(itertools.islice(source, RESOLVE_BATCH)), read_of))
                        if not pending:
                            exhausted = True
                            break
                    item, read, handle = pending.popleft()
                    size = 0
                    if read is not None and handle is not None:
                        blocks, size = self._blocks(read, handle)
                        ref = handle.blocks
                        fresh = [b for b in blocks if (ref.oid, b) not in sent] if ref else []
                        if ref and fresh:  # samples sharing a block ask for it once (within recent memory)
                            for block in fresh:
                                sent[(ref.oid, block)] = None
                            while len(sent) > RECENT_BLOCKS:
                                sent.popitem(last=False)
                            batch.append((handle, fresh))
                            batch_blocks += len(fresh)
                    window.append((item, size))
                    window_bytes += size
                    if batch_blocks >= BATCH_BLOCKS:
                        self._queue.put((batch, len(window)))
                        batch, batch_blocks = [], 0
                if batch:
                    self._queue.put((batch, len(window)))
                if not window:
                    return
                item, size = window.popleft()
                window_bytes -= size
                consumed_bytes += size
                yield item
        finally:
            self.client.cancel_prefetch(self._session)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        self.client.cancel_prefetch(self._session)


def _not_on_disk(handle: ObjectHandle, blocks: list[int]) -> list[int]:
    ref = handle.blocks
    return [block for block in blocks if ref is not None and not os.path.exists(ref.path(block))]
