"""A reading process's reports to its node agent: which blocks it read (eviction sees what is
hot), and per mount its hits, hit bytes, stalls and direct reads (metrics cover every reader).
Batched on the hit path, sent one-way with later reads, and by a thread once reads stop."""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable

from gpufeed.client.connection import AgentClient, AgentUnavailable
from gpufeed.rpc.messages import Done, Hits, Served

HIT_REPORT_BATCH = 128
HIT_REPORT_INTERVAL_S = 0.25
HIT_CHECK_EVERY = 32
IDLE_REPORT_S = 1.0
"""How often hits left unreported are sent once a reader's reads stop coming (a paused training
loop, an idle FUSE daemon): reports otherwise ride on the reads themselves."""


def _nothing() -> None:
    pass


class Tally:
    """What this process's reads of one mount did since the last report (`Served`); the hit
    path adds to it directly (two integer additions, no call)."""

    __slots__ = ("hits", "hit_bytes", "stall_s", "direct", "direct_bytes")

    def __init__(self) -> None:
        self.hits = 0
        self.hit_bytes = 0
        self.stall_s = 0.0
        self.direct = 0
        self.direct_bytes = 0


class HitReporter:
    """Collects the blocks a process read from disk and tells the agent in batches, so eviction
    knows what is hot without a round trip per hit, and, per mount, the hits, their bytes and
    the time reads waited on misses, so the agent's metrics cover every reading process. Never
    starts an agent just to report.

    The hit path appends to `names` itself and calls `check` once `len(names)` reaches `due`:
    a C call and a comparison per hit, no Python call (`record` does the same for colder
    paths)."""

    def __init__(self, agent: AgentClient) -> None:
        self.agent = agent
        self.every_check: Callable[[], None] = _nothing
        """Runs every HIT_CHECK_EVERY hits: housekeeping a reader wants done often, but not on
        every hit (letting go of deleted block files)."""
        self.names: list[str] = []
        """Blocks read since the last report, by `BlockId.name` (strings: no tuple for
        the collector)."""
        self.read: list[str] = []
        """Blocks read since the last report that were not on disk when asked for (`Hits.read`)."""
        self.due = HIT_CHECK_EVERY
        self.tallies: dict[str, Tally] = {}
        """Mount path → its tally; handles hold theirs (`ObjectHandle.tally`)."""
        self._sent = time.monotonic()
        self._lock = threading.Lock()
        self._waited = threading.Lock()
        """Held by a report that waits for the agent's reply: a waited flush then knows that one
        sent by the idle thread has been counted too."""
        self._watched_in = 0
        """The process whose thread sends idle reports (`_watch`): a forked child starts its own."""
        self._closed = False
        _REPORTERS.add(self)

    def tally(self, mount: str) -> Tally:
        """The tally of `mount`, which a handle holds; a process's first also starts its idle
        reports (`_watch`), so a reader of a few files, or of a mount with cache=off, is heard."""
        found = self.tallies.get(mount)
        if found is None:
            with self._lock:
                found = self.tallies.setdefault(mount, Tally())
        if self._watched_in != os.getpid():
            self._watch()
        return found

    def record(self, block: str) -> None:
        self.names.append(block)
        if len(self.names) >= self.due:
            self.check()

    def stalled(self, waiting: list[Tally], seconds: float) -> None:
        """Reads waited `seconds` on misses, shared by the mounts of the missing pieces (one
        tally per piece). Reported with the next batch, or now when the last report is old (a
        process that only misses calls no `check`)."""
        share = seconds / len(waiting)
        for tally in waiting:
            tally.stall_s += share
        if time.monotonic() - self._sent > HIT_REPORT_INTERVAL_S:
            self.flush(wait=False)

    def _served(self) -> list[Served]:
        """The tallies' figures since the last report, and zeroed (under the lock)."""
        served = []
        for mount, tally in self.tallies.items():
            if tally.hits or tally.stall_s or tally.direct:
                served.append(Served(mount, tally.hits, tally.hit_bytes, tally.stall_s, tally.direct, tally.direct_bytes))
                tally.hits -= served[-1].hits
                tally.hit_bytes -= served[-1].hit_bytes
                tally.stall_s -= served[-1].stall_s
                tally.direct -= served[-1].direct
                tally.direct_bytes -= served[-1].direct_bytes
        return served

    def check(self) -> None:
        """Every HIT_CHECK_EVERY hits: send them when the batch is full or the last report is old."""
        self.every_check()
        if self._watched_in != os.getpid():
            self._watch()
        if len(self.names) >= HIT_REPORT_BATCH or time.monotonic() - self._sent > HIT_REPORT_INTERVAL_S:
            self.flush(wait=False)
        else:
            self.due = len(self.names) + HIT_CHECK_EVERY

    def _watch(self) -> None:
        """Start this process's thread that sends what an idle reader leaves unreported. It
        holds the reporter weakly and ends with it, or when it is closed."""
        self._watched_in = os.getpid()
        threading.Thread(target=_report_when_idle, args=(weakref.ref(self),), name="gpufeed-hit-reports", daemon=True).start()

    def report_if_idle(self) -> None:
        if time.monotonic() - self._sent > IDLE_REPORT_S and (
            self.names or self.read or any(t.hits or t.stall_s or t.direct for t in list(self.tallies.values()))
        ):
            self.flush()

    def close(self) -> None:
        """Report what is pending, and stop the idle reports."""
        self._closed = True
        self.flush()

    def flush(self, *, wait: bool = True) -> None:
        """Report the pending hits. The read path does not wait for the agent to take them
        (`wait=False`, a one-way message); `wait` makes them count before anything else asks."""
        if not wait:
            self._send(wait=False)
            return
        with self._waited:
            self._send(wait=True)

    def _send(self, *, wait: bool) -> None:
        with self._lock:
            batch = self.names.copy()
            del self.names[: len(batch)]  # names other threads appended meanwhile stay
            read = self.read.copy()
            del self.read[: len(read)]
            served = self._served()
            self._sent = time.monotonic()
            self.due = len(self.names) + HIT_CHECK_EVERY
        if batch or served or read:
            names = " ".join(batch)  # one string: cheap to encode
            others = " ".join(read)
            try:
                if wait:
                    self.agent.request(Hits(names, reply=True, served=served, read=others), Done, start=False)
                else:
                    self.agent.notify(Hits(names, served=served, read=others))
            except AgentUnavailable:
                pass  # only eviction hints and counts are lost


_REPORTERS: weakref.WeakSet[HitReporter] = weakref.WeakSet()


def _report_when_idle(reporter_ref: weakref.ref[HitReporter]) -> None:
    while True:
        time.sleep(IDLE_REPORT_S)
        reporter = reporter_ref()
        if reporter is None or reporter._closed:
            return
        reporter.report_if_idle()
        del reporter


def _after_fork_in_child() -> None:
    """A thread of the parent may have held a reporter's lock as it forked; it does not exist in
    the child, which would wait on that lock for ever."""
    for reporter in list(_REPORTERS):
        reporter._lock, reporter._waited = threading.Lock(), threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
