"""Prefetch sessions and the blocks they pin, and the hits readers report.

A session is one job's prefetch stream (a sampler's iteration). It announces the blocks it
will read with how many reads need each; a fetched block stays pinned (never evicted) until
that many reads are reported or the session ends, so a block whose samples are read over
several batches (a block-aware shuffle) is not evicted between them. A connection's sessions
end when it closes, so a killed trainer releases its pins.

Pinned blocks and those being prefetched share a budget (PIN_FRACTION of the cache): a
prefetch waits for room as the job reads, so a cache smaller than the prefetch window paces
the prefetch instead of being overrun by it. When the next prefetch finds no room and every
pinned block has been read at least once (a reader that announced reads it does not make),
or the oldest was never read in STALE_PIN_S (a reader that stopped), one is let go.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpufeed.agent.manager import CacheManager
from gpufeed.agent.metrics import Metrics

if TYPE_CHECKING:
    from gpufeed.agent.fetcher import Job

PIN_FRACTION = 0.5
"""Prefetch waits while pinned blocks and blocks being prefetched fill this much of the cache."""
ENDED_MEMORY = 4096
"""Cancelled sessions remembered, so a late prefetch of one is dropped."""
STALE_PIN_S = 60.0
"""A pinned block no read reached in this long is let go when a prefetch needs its room (a
reader that stopped before what it asked for; a job's lead is seconds)."""


@dataclass
class Session:
    name: str
    pin: bool = True
    """Whether its fetched blocks stay pinned until read. A reader's hints about blocks it read
    around do not pin: nothing promises those blocks will be read soon."""
    queued: int = 0
    """Its blocks queued or being fetched (`Fetcher.prefetch`)."""
    pinned: set[str] = field(default_factory=set)
    left: dict[str, int] = field(default_factory=dict)
    """Blocks it announced (`Sessions.announce`) → reads of them not reported yet."""
    cancelled: bool = False
    ahead_samples: int = 0
    """The job's lead in samples, as of its last prefetch request."""


class Sessions:
    def __init__(self, manager: CacheManager, metrics: Metrics) -> None:
        self.manager = manager
        self.metrics = metrics
        self.sessions: dict[str, Session] = {}
        self.pinned: dict[str, tuple[str, int, float]] = {}
        """Pinned block name → the session that pinned it, the bytes it counted, and when (the
        prefetch lead is measured from then to the block's first read)."""
        self.pinned_bytes = 0
        self.reserved_bytes = 0
        """Bytes of blocks being prefetched: counted before they land, so PREFETCH_CONCURRENCY
        fetches in flight cannot pin more than the budget."""
        self.announced: dict[str, Session] = {}
        """Block name → the session whose count of reads (`Session.left`) it is in."""
        self.touched: OrderedDict[str, None] = OrderedDict()
        """Announced blocks read at least once, in the order of their first read."""
        self._untouched_pins = 0
        """Pinned blocks not read yet."""
        self._waiting: collections.deque[tuple[asyncio.Future[bool], Session, int]] = collections.deque()
        """Prefetches waiting for room in the budget, in the order they were asked."""
        self._ended: OrderedDict[str, None] = OrderedDict()
        """Sessions cancelled lately: a prefetch that arrives after its cancel (sent by another
        thread of the reader) is dropped, not the start of a session nobody will end."""

    def open(self, name: str, pin: bool) -> tuple[Session, bool]:
        """The session called `name`, and whether this call created it (an ended session is
        handed out cancelled, so what it queues does nothing)."""
        session = self.sessions.get(name)
        if session is not None:
            return session, False
        if name in self._ended:
            return Session(name, pin, cancelled=True), False
        session = self.sessions[name] = Session(name, pin)
        return session, True

    def _fits(self, length: int) -> bool:
        """Whether `length` more bytes fit the budget; one block always does when nothing is
        pinned or in flight, so a cache smaller than two blocks still prefetches."""
        held = self.pinned_bytes + self.reserved_bytes
        return held == 0 or held + length <= PIN_FRACTION * self.manager.limit()

    async def reserve(self, session: Session, length: int) -> bool:
        """Wait until `length` bytes of prefetch fit the budget and count them; False when the
        session ended first. Whoever asked first is served first."""
        if session.cancelled:
            return False
        if not self._waiting and self._fits(length):
            self.reserved_bytes += length
            return True
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append((waiter, session, length))
        self._wake()
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.release(length)
            raise

    def release(self, length: int) -> None:
        """A reserved prefetch landed (and is pinned now) or failed."""
        self.reserved_bytes -= length
        self._wake()

    def _wake(self) -> None:
        """Hand the room there is to the waiting prefetches, in order; those of ended sessions
        are told so. With no room and every pinned block read at least once, the one read
        first is let go: the announced reads were not all made."""
        waiting = self._waiting
        while waiting:
            waiter, session, length = waiting[0]
            if not waiter.done() and not session.cancelled and not self._fits(length):
                if not self._release_stale():
                    return
                continue
            waiting.popleft()
            if waiter.done():
                continue
            if session.cancelled:
                waiter.set_result(False)
            else:
                self.reserved_bytes += length
                waiter.set_result(True)

    def _release_stale(self) -> bool:
        """Unpin the block pinned first if no read reached it in STALE_PIN_S; else the block
        read first, if every pinned block has been read at least once and no prefetch is in
        flight (one let go at a time, each once the one it made room for is read)."""
        oldest = next(iter(self.pinned), None)
        if oldest is None:
            return False
        if oldest not in self.touched and time.monotonic() - self.pinned[oldest][2] > STALE_PIN_S:
            self.unpin(oldest)
            return True
        if self._untouched_pins or self.reserved_bytes:
            return False
        for name in self.touched:
            if name in self.pinned:
                self.unpin(name)
                del self.touched[name]
                return True
        return False

    def announce(self, session: Session, jobs: list[Job]) -> list[Job]:
        """Count the reads a prefetch request announces; returns the jobs of blocks the session
        had not announced (or were read since), which are to be fetched. A block another session
        announced first adds to that session's count."""
        if not session.pin or session.cancelled:
            return jobs
        fresh = []
        for job in jobs:
            name = job.block.name
            owner = self.announced.get(name)
            if owner is None:
                self.announced[name] = session
                session.left[name] = job.reads
                fresh.append(job)
            else:
                owner.left[name] += job.reads
        return fresh

    def wanted(self, session: Session, name: str) -> bool:
        """Whether a queued prefetch is still worth fetching: its session goes on, and for a
        pinning one, the block still has reads to come and is not held for them yet."""
        return not session.cancelled and (not session.pin or (name in self.announced and name not in self.pinned))

    def _read(self, name: str, now: float) -> None:
        """One read of a block: counted against its announcement; the last one unpins it."""
        owner = self.announced.get(name)
        if owner is None:
            return
        if name not in self.touched:
            self.touched[name] = None
            pinned = self.pinned.get(name)
            if pinned is not None:
                self._untouched_pins -= 1
                self.metrics.prefetch_lead.observe(now - pinned[2])
        left = owner.left[name] - 1
        if left > 0:
            owner.left[name] = left
            if name not in self.pinned and (size := self.manager.sizes.get(name)) is not None and self._fits(size):
                self.pin(owner, name)  # read before its prefetch landed: kept for the reads to come
            return
        del owner.left[name], self.announced[name]
        self.unpin(name)
        del self.touched[name]

    def fetched_for_read(self, names: Iterable[str]) -> None:
        """Blocks a demand read took: its reader reads them now (and reports each piece it
        reads, `hits`), so one with reads still announced is kept for them if there is room."""
        for name in names:
            owner = self.announced.get(name)
            if owner is None or name in self.pinned or (size := self.manager.sizes.get(name)) is None or not self._fits(size):
                continue
            self.touched[name] = None
            self.pin(owner, name)

    def pin(self, session: Session, name: str) -> None:
        """Keep a block prefetched for `session` until its announced reads are reported."""
        if session.cancelled or not session.pin or name in self.pinned or name not in self.announced:
            return
        size = self.manager.sizes.get(name, 0)
        self.pinned[name] = (session.name, size, time.monotonic())
        session.pinned.add(name)
        self.pinned_bytes += size
        if name not in self.touched:
            self._untouched_pins += 1
        self.metrics.count("prefetched")

    def unpin(self, name: str) -> None:
        """Let a block go (the caller hands the room freed to waiting prefetches: `_wake`)."""
        pinned = self.pinned.pop(name, None)
        if pinned is not None:
            owner, size, _ = pinned
            self.pinned_bytes -= size
            if name not in self.touched:
                self._untouched_pins -= 1
            session = self.sessions.get(owner)
            if session is not None:
                session.pinned.discard(name)

    def cancel(self, name: str) -> None:
        """End a session: queued blocks are dropped (each task checks `cancelled` before it
        fetches; one already fetching finishes, since demand readers may be waiting on it),
        pinned ones released."""
        self._ended[name] = None
        while len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)
        session = self.sessions.pop(name, None)
        if session is None:
            return
        session.cancelled = True
        for block in list(session.pinned):
            self.unpin(block)
        for block in session.left:
            if self.announced.get(block) is session:
                del self.announced[block]
                self.touched.pop(block, None)
        session.left.clear()
        for waiter, owner, _ in self._waiting:
            if owner is session and not waiter.done():
                waiter.set_result(False)
        self._wake()

    def hits(self, names: str, read: str = "") -> None:
        """Blocks readers read from disk: hot for eviction, and read, so counted against their
        announcements (how long a prefetched block waited for its first read is the prefetch
        lead); and blocks read another way (`read`), only counted."""
        split = names.split()
        now = time.monotonic()
        access = self.manager.policy.access
        for name in split:
            access(name)
            self._read(name, now)
        for name in read.split():
            self._read(name, now)
        self.metrics.count("hits", len(split))
        self._wake()
