"""Prefetch sessions and the blocks they pin, and the hits readers report.

A session is one job's prefetch stream (a sampler's iteration). Its fetched blocks stay pinned
(never evicted) until a reader reports a hit on them or the session ends; a connection's
sessions end when it closes, so a killed trainer releases its pins.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from gpufeed.agent.manager import CacheManager
from gpufeed.agent.metrics import Metrics

PIN_FRACTION = 0.5
"""Prefetch stops while pinned blocks fill this much of the cache."""
ENDED_MEMORY = 4096
"""Cancelled sessions remembered, so a late prefetch of one is dropped."""


@dataclass
class Session:
    name: str
    pin: bool = True
    """Whether its fetched blocks stay pinned until read. A reader's hints about blocks it read
    around do not pin: nothing promises those blocks will be read soon."""
    queued: int = 0
    """Its blocks queued or being fetched (`Fetcher.prefetch`)."""
    pinned: set[str] = field(default_factory=set)
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

    def room_to_pin(self) -> bool:
        return self.pinned_bytes <= PIN_FRACTION * self.manager.limit()

    def pin(self, session: Session, name: str) -> None:
        if session.pin and not session.cancelled and name not in self.pinned:
            size = self.manager.sizes.get(name, 0)
            self.pinned[name] = (session.name, size, time.monotonic())
            session.pinned.add(name)
            self.pinned_bytes += size
            self.metrics.count("prefetched")

    def unpin(self, name: str) -> None:
        pinned = self.pinned.pop(name, None)
        if pinned is not None:
            owner, size, _ = pinned
            self.pinned_bytes -= size
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

    def hits(self, names: str) -> None:
        """Blocks readers read from disk: hot for eviction, and read, so no longer pinned (how
        long a prefetched block waited for its first read is the prefetch lead)."""
        split = names.split()
        now = time.monotonic()
        for name in split:
            self.manager.policy.access(name)
            pinned = self.pinned.get(name)
            if pinned is not None:
                self.metrics.prefetch_lead.observe(now - pinned[2])
                self.unpin(name)
        self.metrics.count("hits", len(split))
