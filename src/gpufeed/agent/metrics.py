"""What the agent counts: hits, misses, bytes, repairs, evictions. One registry that every part
of the agent writes to and `Stats` reads; the Prometheus exporter (a later issue) reads it too."""

from __future__ import annotations

import time
from collections import Counter

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
"""Every counter, by name: `AgentInfo` carries each."""


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

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def store_latency(self, seconds: float) -> None:
        self.latency_s = 0.9 * self.latency_s + 0.1 * seconds

    def prefetch_time(self, seconds: float) -> None:
        self.prefetch_s = 0.9 * self.prefetch_s + 0.1 * seconds

    def counters(self) -> dict[str, int]:
        return {name: self.counts[name] for name in COUNTERS}
