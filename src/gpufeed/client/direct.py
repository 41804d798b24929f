"""Reads straight from a store, pinned to a handle's version and checked as the store and the
manifest allow: what a read falls back to when nothing can cache (the cache off or full, no
agent), what a sparse batch reads around the blocks it asked the agent for, and the one pass of
`gpufeed pack` and `gpufeed verify`.

A process forked from one that used obstore (a DataLoader worker of a script that mounted or
read a store) has the agent read its remote ranges for it: obstore's runtime does not survive
a fork (`sources.base.obstore_unusable`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gpufeed.aio import run_blocking
from gpufeed.blocks import CHUNK, WHOLE_OBJECT_MAX, ChunkMismatch, check_chunks, chunk_span, mismatch
from gpufeed.client.connection import AgentUnavailable
from gpufeed.client.handles import ObjectHandle
from gpufeed.errors import ObjectChanged, ObjectCorrupted, ObjectMissing
from gpufeed.paths import since_listed
from gpufeed.sources.base import obstore_unusable

DIRECT_CONCURRENCY = 64
"""Ranged GETs one batch keeps in flight when it reads from the source itself."""
MERGED_MAX = 4 << 20
"""The longest read of a shard's whole chunks that several ranges of one batch share."""

AgentRanges = Callable[[list[tuple[ObjectHandle, int, int]]], list[memoryview]]
"""Ranges the agent reads for this process (`AgentFetches.ranges`)."""


def explained(path: str, mount: str, exc: Exception) -> Exception:
    """Name the namespace path and the way out in a source error about one object."""
    if isinstance(exc, (ObjectMissing, ObjectChanged)):
        return type(exc)(since_listed(path, "deleted" if isinstance(exc, ObjectMissing) else "changed", mount, str(exc)))
    return exc


class DirectReads:
    def __init__(self, agent_ranges: AgentRanges | None = None, agent_max: int = 0) -> None:
        self.bytes = 0
        """Bytes this process read from sources itself, not through the agent."""
        self.agent_ranges = agent_ranges
        self.agent_max = agent_max
        """The longest range the agent reads for this process; a longer one is read here."""

    def many(self, ranges: dict[tuple[int, int], tuple[ObjectHandle, int, int]]) -> dict[tuple[int, int], memoryview]:
        """Source reads. A range of an object the manifest holds a content hash for is cut from
        one read of the whole object, which the source checks against the hash: its bytes are
        never handed out unchecked, whether the cache is off, full or evicted them early. A range
        of a pack's shard is cut from a read of the whole chunks it lies in, checked against the
        sums the pack index lists."""
        reads: dict[object, tuple[ObjectHandle, int, int]] = {}
        cuts: dict[tuple[int, int], tuple[object, int, int]] = {}
        shards: dict[tuple[str, str, str], list[tuple[int, int, tuple[int, int], ObjectHandle]]] = {}
        for key, (handle, start, end) in ranges.items():
            info = handle.info
            if info.content_hash and info.size <= WHOLE_OBJECT_MAX:
                whole = (handle.path, info.version)
                reads.setdefault(whole, (handle, 0, info.size))
                cuts[key] = (whole, start, end)
            elif handle.chunk_sums is not None and end > start:
                shards.setdefault((handle.mount.path, info.key, info.version), []).append((start, end, key, handle))
            else:
                reads[key] = (handle, start, end)
                cuts[key] = (key, 0, end - start)
        summed = [span for wanted in shards.values() for span in _chunk_spans(wanted, reads, cuts)]
        got = self._ranges(reads)
        for read in summed:
            handle, lo, hi = reads[read]
            assert handle.chunk_sums is not None
            try:
                check_chunks(handle.chunk_sums, lo, got[read])
            except ChunkMismatch:  # read once more, as the agent does: a flip in transit passes
                got[read] = self._ranges({read: (handle, lo, hi)})[read]
                try:
                    check_chunks(handle.chunk_sums, lo, got[read])
                except ChunkMismatch as exc:
                    # name a file that lies in the failing chunk, of those sharing the read
                    at = exc.chunk * CHUNK
                    hit = (ranges[k][0].path for k, (r, s, e) in cuts.items() if r == read and s < at + CHUNK and e > at)
                    raise ObjectCorrupted(f"{next(hit, handle.path)}: {mismatch(handle.info, lo, exc)}") from None
        return {key: got[read][lo:hi] for key, (read, lo, hi) in cuts.items()}

    def _ranges(self, ranges: dict[object, tuple[ObjectHandle, int, int]]) -> dict[object, memoryview]:
        """Source reads, up to DIRECT_CONCURRENCY in flight at once (one ranged GET each). A local
        directory's are read one after another in this thread: a page-cache `preadv` costs less
        than handing it to another thread or an event loop. The agent reads a write still
        uploading (from its staged bytes), and every remote range of a forked process."""
        got: dict[object, memoryview] = {}
        if self.agent_ranges is not None:
            forked = obstore_unusable()
            asked = [(key, r) for key, r in ranges.items() if r[0].uploading or (forked and not r[0].source.local)]
            try:
                got = self._from_agent(self.agent_ranges, asked) if asked else {}
            except AgentUnavailable:
                pass  # no agent to ask: the store from here is the only way left
        rest = [(key, r) for key, r in ranges.items() if key not in got]
        got.update((key, self._one(handle, start, end)) for key, (handle, start, end) in rest if handle.source.local)
        remote = [(key, r) for key, r in rest if not r[0].source.local]
        if len(remote) == 1:
            ((key, (handle, start, end)),) = remote
            got[key] = self._one(handle, start, end)
        elif remote:

            async def gather() -> list[memoryview]:
                slots = asyncio.Semaphore(DIRECT_CONCURRENCY)
                return await asyncio.gather(*(self._one_async(h, start, end, slots) for _, (h, start, end) in remote))

            got.update(zip((key for key, _ in remote), run_blocking(gather()), strict=True))
        return got

    def _from_agent(
        self, agent_ranges: AgentRanges, asked: list[tuple[object, tuple[ObjectHandle, int, int]]]
    ) -> dict[object, memoryview]:
        """The ranges read by the agent, each in pieces of at most `agent_max` bytes (a reply
        must fit one message) joined again."""
        pieces = [
            (key, handle, lo, min(end, lo + self.agent_max))
            for key, (handle, start, end) in asked
            for lo in range(start, max(end, start + 1), self.agent_max)
        ]
        parts = agent_ranges([(handle, lo, hi) for _, handle, lo, hi in pieces])
        joined: dict[object, list[memoryview]] = {}
        for (key, *_), data in zip(pieces, parts, strict=True):
            joined.setdefault(key, []).append(data)
        got = {}
        for key, (handle, start, end) in asked:
            split = joined[key]
            got[key] = _checked(handle, split[0] if len(split) == 1 else memoryview(b"".join(split)), start, max(start, end))
        return got

    def _one(self, handle: ObjectHandle, start: int, end: int) -> memoryview:
        if end <= start:
            return memoryview(b"")
        try:
            data = handle.source.get_range(handle.info.key, start, end, handle.info, conditional=not handle.mount.immutable)
        except (ObjectMissing, ObjectChanged) as exc:
            raise explained(handle.path, handle.mount.path, exc) from exc
        return self._counted(handle, data, start, end)

    async def _one_async(self, handle: ObjectHandle, start: int, end: int, slots: asyncio.Semaphore) -> memoryview:
        try:
            async with slots:
                data = await handle.source.get_range_async(
                    handle.info.key, start, end, handle.info, conditional=not handle.mount.immutable
                )
        except (ObjectMissing, ObjectChanged) as exc:
            raise explained(handle.path, handle.mount.path, exc) from exc
        return self._counted(handle, data, start, end)

    def _counted(self, handle: ObjectHandle, data: memoryview, start: int, end: int) -> memoryview:
        """A read of the store this process made itself: reported to the agent as a miss of its
        mount (`Served.direct`); what the agent reads for it, the agent counts."""
        self.bytes += len(data)
        handle.tally.direct += 1
        handle.tally.direct_bytes += len(data)
        return _checked(handle, data, start, end)


def _chunk_spans(
    wanted: list[tuple[int, int, tuple[int, int], ObjectHandle]],
    reads: dict[object, tuple[ObjectHandle, int, int]],
    cuts: dict[tuple[int, int], tuple[object, int, int]],
) -> list[object]:
    """Reads of whole chunks of one shard covering the ranges `wanted` (start, end, key, handle),
    added to `reads` and `cuts`: ranges whose chunks overlap or touch share one read of at most
    MERGED_MAX bytes (forty 100 KB members in a row are one read of 4 MiB, not forty of 256 to 512
    KiB), or of a longer range's chunks that hold them. Returns the reads made."""
    made: list[object] = []
    span: tuple[int, int] | None = None
    members: list[tuple[int, int, tuple[int, int]]] = []

    def close() -> None:
        if span is not None:
            handle = wanted[0][3]
            read = (handle.mount.path, handle.info.key, handle.info.version, *span)
            reads[read] = (handle, *span)
            made.append(read)
            cuts.update((key, (read, start - span[0], end - span[0])) for start, end, key in members)

    for start, end, key, handle in sorted(wanted, key=lambda w: w[0]):
        lo, hi = chunk_span(handle.info.size, start, end)
        if span is not None and lo <= span[1] and (hi <= span[1] or hi - span[0] <= MERGED_MAX):
            span = (span[0], max(hi, span[1]))
        else:
            close()
            span, members = (lo, hi), []
        members.append((start, end, key))
    close()
    return made


def _checked(handle: ObjectHandle, data: memoryview, start: int, end: int) -> memoryview:
    """A short read (an immutable mount's object that shrank) is an error, never a piece padded
    with zeros."""
    if len(data) != end - start:
        short = ObjectChanged(f"read {len(data)} of {end - start} bytes at offset {start}")
        raise explained(handle.path, handle.mount.path, short)
    return data
