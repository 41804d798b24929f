"""Reading around: which missing blocks a sparse batch of reads takes straight from the
source (the bytes it wants, not the blocks) while the agent caches the blocks for later reads
(`plan.SPARSE_FACTOR`), within a byte budget. A DataLoader worker forked from a process that
used obstore reads around too: the agent reads its ranges (`client.direct`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpufeed.blocks import chunk_span
from gpufeed.client import plan

if TYPE_CHECKING:
    from gpufeed.client.handles import ObjectHandle

READ_AROUND_SHARE = 0.02
"""The most a process reads around, as a share of the bytes of the blocks it has had the agent
fetch. A range read around is fetched twice (once more in its block), so with this budget a cold
epoch takes at most 1.02x the bytes it reads from the store; a sparse batch past it waits for its
blocks. Measured with `gpufeed demo --quick` (records in big files, a store 20 ms and 400 Mbit/s
away): reading around every missing block for two seconds, as before, took 1.66x the bytes and
ran the cold epoch at 703 samples/s, against 1.00x and 883 samples/s with no reading around;
with no bandwidth cap, 1.41x and 1,089 against 1.00x and 1,041."""
COUNTED_MEMORY = 65536
"""Blocks a client remembers having counted into the budget (each counts once)."""


class ReadAround:
    """The bytes one client has read around, and the bytes of the blocks it had fetched."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counted: dict[tuple[str, int], None] = {}
        self.fetched_bytes = 0
        """Bytes of the distinct blocks this client found missing and had the agent fetch."""
        self.around_bytes = 0
        """Bytes this client read around blocks."""

    def blocks(
        self,
        reads: Sequence[tuple[ObjectHandle, int, int]],
        absent: dict[tuple[int, int], tuple[int, int]],
        blocks: dict[str, tuple[ObjectHandle, dict[int, None], list[int]]],
    ) -> set[tuple[str, int]]:
        """The missing blocks (object id, index) whose pieces this batch reads straight from the
        source; the caller asks the agent to cache them and waits for the rest. Empty unless
        the batch is sparse and its bytes fit the budget (READ_AROUND_SHARE)."""
        missing = {(oid, index): handle for oid, (handle, wanted, _) in blocks.items() for index in wanted}
        fresh = {
            (oid, index)
            for oid, (handle, wanted, repairs) in blocks.items()
            for index in wanted
            if index not in repairs and handle.info.content_hash is None  # such blocks are cached only once checked whole
        }
        block_bytes = sum(_length(missing[key], key[1]) for key in fresh)
        wanted_bytes = sum(
            _read_bytes(reads[n][0], *span) for (n, index), span in absent.items()
            if (ref := reads[n][0].blocks) and (ref.oid, index) in fresh
        )
        with self._lock:
            for key, handle in missing.items():
                if key not in self._counted:
                    self._counted[key] = None
                    self.fetched_bytes += _length(handle, key[1])
            while len(self._counted) > COUNTED_MEMORY:
                del self._counted[next(iter(self._counted))]
            if not plan.is_sparse(len(fresh), block_bytes, wanted_bytes):
                return set()
            if self.around_bytes + wanted_bytes > READ_AROUND_SHARE * self.fetched_bytes:
                return set()
            self.around_bytes += wanted_bytes
        return fresh


def _read_bytes(handle: ObjectHandle, start: int, end: int) -> int:
    """Bytes a read around of [start, end) takes: a shard's ranges are read as the whole chunks
    their listed sums check."""
    lo, hi = (start, end) if handle.chunk_sums is None else chunk_span(handle.info.size, start, end)
    return hi - lo


def _length(handle: ObjectHandle, index: int) -> int:
    ref = handle.blocks
    assert ref is not None
    return ref.length(index)
