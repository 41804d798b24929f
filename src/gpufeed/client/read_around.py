"""Reading around: which missing blocks a sparse batch of reads takes straight from the
source (the bytes it wants, not the blocks) while the agent caches the blocks for later reads
(`plan.SPARSE_FACTOR`), and for how long a process keeps doing so for one block. A DataLoader
worker forked from a process that used obstore reads around too: the agent reads its ranges
(`client.direct`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpufeed.client import plan

if TYPE_CHECKING:
    from gpufeed.client.handles import ObjectHandle

READ_AROUND_S = 2.0
"""How long a process reads around a block it asked the agent to cache. A block still missing
later is queued behind others because the store's bandwidth is short: reading ranges around
it would take that bandwidth from the blocks, and the cache would never warm."""
READ_AROUND_MEMORY = 65536
"""Blocks a client remembers having read around."""

class ReadAround:
    """The blocks one client has read around, and since when."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        """Guards evictions from the memory (lookups need no lock)."""
        self._since: dict[tuple[str, int], float] = {}

    def blocks(
        self,
        reads: Sequence[tuple[ObjectHandle, int, int]],
        absent: dict[tuple[int, int], tuple[int, int]],
        blocks: dict[str, tuple[ObjectHandle, dict[int, None], list[int]]],
    ) -> set[tuple[str, int]]:
        """The missing blocks (object id, index) whose pieces this batch reads straight from the
        source; the caller asks the agent to cache them and waits for the rest. A block is read
        around for READ_AROUND_S after this process first did so; later reads of it wait for
        the agent."""
        now = time.monotonic()
        since = self._since
        fresh = {
            (oid, index)
            for oid, (_, wanted, repairs) in blocks.items()
            for index in wanted
            if now - since.get((oid, index), now) < READ_AROUND_S
            and index not in repairs
            and blocks[oid][0].info.content_hash is None  # its blocks are cached only once the whole object is checked
        }
        block_bytes = 0
        for oid, index in fresh:
            ref = blocks[oid][0].blocks
            assert ref is not None
            block_bytes += ref.length(index)
        wanted_bytes = sum(
            hi - lo for (n, index), (lo, hi) in absent.items() if (ref := reads[n][0].blocks) and (ref.oid, index) in fresh
        )
        if not plan.is_sparse(len(fresh), block_bytes, wanted_bytes):
            return set()
        with self._lock:
            for key in fresh:
                since.setdefault(key, now)
            while len(since) > READ_AROUND_MEMORY:
                del since[next(iter(since))]
        return fresh
