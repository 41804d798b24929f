"""What the agent counts: hits, misses and bytes by tier and mount, requests, errors, retries,
store latency, prefetch lead, and what each connected reading process did. One registry that
every part of the agent writes to and `Stats`, `Usage` and the Prometheus exporter
(`agent.exporter`) read.

Counting is plain integer arithmetic on the agent's event loop (one thread, so no locks), once
per request or per batch where there is one (a hit report covers up to 512 hits); the
Prometheus text is built from these counts only when someone asks for it. So counting costs
what it cost before the exporter existed, and nothing on a reader's hit path.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter, defaultdict
from dataclasses import dataclass

from gpufeed.rpc.messages import Served

COUNTERS = (
    "hits",
    "misses",
    "bytes_fetched",
    "repairs",
    "evictions",
    "uncached",
    "prefetched",
    "prefetch_errors",
)
"""Every node-wide counter, by name: `AgentInfo` carries each."""

MOUNT_LABELS = 64
"""Distinct mount labels kept; later ones count as "other", so a reader naming made-up mounts
cannot grow the metrics without bound."""
OTHER = "other"
STORE_GET_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PREFETCH_LEAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Buckets:
    """A histogram counted in plain ints: Prometheus' cumulative buckets are made when read."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """(upper bound, observations at or below it) with "+Inf" last, as Prometheus wants."""
        out, total = [], 0
        for bound, count in zip([*map(repr, self.bounds), "+Inf"], self.counts, strict=True):
            total += count
            out.append((bound, float(total)))
        return out


@dataclass(slots=True)
class Reader:
    """One reading process (by pid) while it has connections."""

    connections: int = 0
    hits: int = 0
    hit_bytes: int = 0
    fetched_bytes: int = 0
    stall_s: float = 0.0


class Metrics:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.started = time.time()
        self.latency_s = 0.02
        """First-byte-to-last-byte time of a store GET, smoothed."""
        self.prefetch_s = 0.05
        """From a prefetch request's arrival to its block on disk (queueing behind other fetches
        and a busy CPU included), smoothed: prefetch windows are sized from it, so they grow
        when the agent falls behind, not only when the store is slow."""
        self.hits: Counter[tuple[str, str]] = Counter()
        """(mount, tier) → blocks readers read from the cache; tier "disk" today ("memory" later)."""
        self.hit_bytes: Counter[tuple[str, str]] = Counter()
        self.misses: Counter[tuple[str, str]] = Counter()
        """(mount, tier) → blocks fetched after a miss, by where from: "store", "peer" (another
        node of the cache cluster, `agent.peers`), or "direct" (reads a reader made of the store
        itself, past the cache: a mount with cache=off, a full cache, `verify`; they report them)."""
        self.miss_bytes: Counter[tuple[str, str]] = Counter()
        self.stall_s: defaultdict[str, float] = defaultdict(float)
        """mount → seconds readers' reads waited on misses (the agent or the store), all readers summed."""
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        """`gpufeed.errors` code → failures the agent answered a reader with."""
        self.store_get = Buckets(STORE_GET_BUCKETS)
        self.peer_get = Buckets(STORE_GET_BUCKETS)
        """A block read from a peer, request to last byte: apart from the store's, so a cluster's
        fast peer reads neither hide a slow store nor count as store GETs."""
        self.prefetch_lead = Buckets(PREFETCH_LEAD_BUCKETS)
        """Seconds from a prefetched block landing in the cache to its first read."""
        self.readers: dict[int, Reader] = {}
        self._mounts: set[str] = set()

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def prefetch_time(self, seconds: float) -> None:
        self.prefetch_s = 0.9 * self.prefetch_s + 0.1 * seconds

    def counters(self) -> dict[str, int]:
        counts = {name: self.counts[name] for name in COUNTERS}
        counts["misses"], counts["bytes_fetched"] = sum(self.misses.values()), sum(self.miss_bytes.values())
        counts["direct_bytes"] = sum(n for (_, tier), n in self.miss_bytes.items() if tier == "direct")
        return counts

    def mount(self, name: str) -> str:
        """The label for a mount: its namespace path, or "other" once MOUNT_LABELS are in use."""
        if name in self._mounts:
            return name
        if len(self._mounts) >= MOUNT_LABELS:
            return OTHER
        self._mounts.add(name)
        return name

    def fetched(self, mount: str, tier: str, size: int, seconds: float) -> None:
        """One block (or whole object) read after a miss from `tier`: "store" or "peer"."""
        key = (self.mount(mount), tier)
        self.misses[key] += 1
        self.miss_bytes[key] += size
        if tier == "peer":
            self.peer_get.observe(seconds)
            return
        self.store_get.observe(seconds)
        self.latency_s = 0.9 * self.latency_s + 0.1 * seconds

    def served(self, pid: int, served: list[Served]) -> None:
        """What a reading process reported of its hits and stalls, per mount."""
        reader = self.readers.get(pid)
        for item in served:
            mount = self.mount(item.mount)
            self.hits[(mount, "disk")] += item.hits
            self.hit_bytes[(mount, "disk")] += item.hit_bytes
            self.stall_s[mount] += item.stall_s
            if item.direct:
                self.misses[(mount, "direct")] += item.direct
                self.miss_bytes[(mount, "direct")] += item.direct_bytes
            if reader is not None:
                reader.hits += item.hits
                reader.hit_bytes += item.hit_bytes
                reader.stall_s += item.stall_s
                reader.fetched_bytes += item.direct_bytes

    def connected(self, pid: int) -> Reader:
        reader = self.readers.get(pid)
        if reader is None:
            reader = self.readers[pid] = Reader()
        reader.connections += 1
        return reader

    def disconnected(self, pid: int) -> None:
        reader = self.readers.get(pid)
        if reader is not None:
            reader.connections -= 1
            if reader.connections <= 0:
                del self.readers[pid]
