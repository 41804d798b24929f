"""Sampler-aware prefetch: the job knows the exact order it will read samples in, so the blocks
of the next window of reads are fetched by the node agent before they are asked for.

    prefetcher = Prefetcher(client)
    for index in prefetcher.ahead(sampler_indices, lambda i: Read(paths[i], 0, sizes[i])):
        ...  # by the time `index` is read, its blocks are (usually) on local disk

`ahead` yields the items unchanged and in order. A background thread resolves the upcoming
reads and sends them to the agent in batches, in order of need; the window is bounded in
bytes and sized from the measured consume rate times the source latency. Each block is asked
for once, with how many reads of the window need it; later samples of it in the window add
to that count, so the agent keeps a block until all of them are read (a block-aware shuffle
reads a block's samples over several batches), then it may be evicted again. Closing the
prefetcher or ending the iteration cancels what was not fetched yet. PyTorch datasets,
`gpufeed warmup` and `gpufeed bench --mode cached` all use this one mechanism.
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
RATE_SPAN_S = 0.5
"""The shortest time a consume rate is measured over. A DataLoader takes prefetch_factor x
workers batches of indices at once when an epoch starts: over the few milliseconds that takes,
that burst would read as gigabytes a second and stretch the window to the whole epoch."""
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


@dataclass(slots=True)
class Wanted:
    """A block the window needs: its file's handle, and how many of the window's reads need it."""

    handle: ObjectHandle
    reads: int


@dataclass(frozen=True, slots=True)
class Batch:
    """Blocks one iteration's window wants, and the samples it had asked for ahead of its
    consumer then."""

    session: str
    blocks: dict[tuple[str, int], Wanted]
    ahead: int


class Prefetcher:
    def __init__(self, client: Client, *, min_bytes: int = MIN_WINDOW_BYTES, max_bytes: int = MAX_WINDOW_BYTES) -> None:
        self.client = client
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self._handles: collections.OrderedDict[str, ObjectHandle] = collections.OrderedDict()
        self._queue: queue.Queue[Batch | None] = queue.Queue()
        self._asked: collections.OrderedDict[tuple[str, int], bool] = collections.OrderedDict()
        """Blocks the sender met lately in its current session: True where it asked the agent
        for them (later reads of them are added to the count), False where they were on disk
        already."""
        self._thread: threading.Thread | None = None
        self._session = ""
        """The agent's session of the current iteration: each `ahead` starts its own, as the
        end of one cancels its session at the agent for good."""
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
        a round trip per sample). A block met for the first time that is on disk already is not
        asked for, nor are later reads of it: a warm epoch costs a stat per block here instead
        of an agent round trip per block."""
        session = ""
        held: Batch | None = None
        while (queued := held or self._queue.get()) is not None:
            held = None
            if queued.session != session:
                session = queued.session
                self._asked.clear()
            batch, ahead = queued.blocks, queued.ahead
            while len(batch) < BATCH_BLOCKS:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    return  # closed: its prefetch is cancelled, nothing more is sent
                if more.session != session:
                    held = more
                    break
                for key, wanted in more.blocks.items():
                    if key in batch:
                        batch[key].reads += wanted.reads
                    else:
                        batch[key] = wanted
                ahead = more.ahead
            missing: list[tuple[ObjectHandle, list[int]]] = []
            reads: list[list[int]] = []
            for (oid, block), wanted in batch.items():  # in order of need, which the agent keeps
                asked = self._asked.get((oid, block))
                if asked is None:
                    asked = self._asked[(oid, block)] = _not_on_disk(wanted.handle, block)
                    while len(self._asked) > RECENT_BLOCKS:
                        self._asked.popitem(last=False)
                if not asked:
                    continue
                if missing and missing[-1][0] is wanted.handle:  # blocks of one object in a row share an entry
                    missing[-1][1].append(block)
                    reads[-1].append(wanted.reads)
                else:
                    missing.append((wanted.handle, [block]))
                    reads.append([wanted.reads])
            if not missing:
                continue
            try:
                self.requests += 1
                reply = self.client.fetches.prefetch(missing, session, ahead_samples=ahead, reads=reads)
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
        session = self._session = f"{id(self):x}-{time.monotonic_ns():x}"
        source = iter(items)
        window: collections.deque[tuple[T, int]] = collections.deque()
        pending: collections.deque[tuple[T, Read | None, ObjectHandle | None]] = collections.deque()
        """Items taken from `items` with their handles, not yet in the window."""
        window_bytes = 0
        consumed_bytes = 0
        started = time.monotonic()
        exhausted = False
        try:
            while True:
                rate = consumed_bytes / max(RATE_SPAN_S, time.monotonic() - started)
                target = self.window_bytes(rate)
                batch: dict[tuple[str, int], Wanted] = {}
                while not exhausted and (window_bytes < target or not window):
                    if not pending:
                        pending.extend(self._resolved(list(itertools.islice(source, RESOLVE_BATCH)), read_of))
                        if not pending:
                            exhausted = True
                            break
                    item, read, handle = pending.popleft()
                    size = 0
                    if read is not None and handle is not None and (ref := handle.blocks) is not None:
                        blocks, size = self._blocks(read, handle)
                        for block in blocks:
                            wanted = batch.get((ref.oid, block))
                            if wanted is None:
                                batch[(ref.oid, block)] = Wanted(handle, 1)
                            else:
                                wanted.reads += 1
                    window.append((item, size))
                    window_bytes += size
                    if len(batch) >= BATCH_BLOCKS:
                        self._queue.put(Batch(session, batch, len(window)))
                        batch = {}
                if batch:
                    self._queue.put(Batch(session, batch, len(window)))
                if not window:
                    return
                item, size = window.popleft()
                window_bytes -= size
                consumed_bytes += size
                yield item
        finally:
            self.client.cancel_prefetch(session)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
        if self._session:
            self.client.cancel_prefetch(self._session)


def _not_on_disk(handle: ObjectHandle, block: int) -> bool:
    ref = handle.blocks
    return ref is not None and not os.path.exists(ref.path(block))
