"""What a client asks the node agent for: blocks to publish while it waits (a batch's misses, a
warmup), blocks to fetch soon (prefetch, and the blocks a sparse batch reads around), and,
for a process that cannot reach a store itself, ranges read for it uncached."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from gpufeed.blocks import listed_sums, sums_checked
from gpufeed.client.connection import AgentClient, AgentUnavailable
from gpufeed.client.direct import explained
from gpufeed.client.handles import ObjectHandle
from gpufeed.errors import ObjectChanged, ObjectMissing, from_code
from gpufeed.mount_options import owner_only, source_options
from gpufeed.rpc.messages import (
    Cancel,
    Credentials,
    Done,
    Failure,
    Fetch,
    Fetched,
    Group,
    ObjectWant,
    Prefetch,
    Queued,
    RangeBytes,
    RangeWant,
    ReadRanges,
    SourceSpec,
)
from gpufeed.sources.credentials import caller_credentials

FETCH_BATCH = 4096
"""Blocks in one agent fetch request; a bigger batch is sent in several."""
RANGES_BYTES = 32 << 20
"""Bytes one `ReadRanges` request asks for at most (its reply must stay under the codec's
MAX_MESSAGE); a bigger batch is sent in several."""


class AgentFetches:
    def __init__(self, agent: AgentClient, warn: Callable[[str, str], None]) -> None:
        self.agent = agent
        self._warn = warn
        self.bytes = 0
        """Bytes the agent read from sources for this client's requests (a block another process
        had already asked for is not counted)."""

    def prefetch(
        self,
        wanted: list[tuple[ObjectHandle, list[int]]],
        session: str,
        *,
        pin: bool = True,
        ahead_samples: int = 0,
        reads: list[list[int]] | None = None,
    ) -> Queued:
        """Ask the agent to fetch these blocks soon, for prefetch `session`; returns at once.
        With `pin`, fetched blocks are not evicted until read (`reads`: for each entry of
        `wanted`, how many reads need each of its blocks; one each without it) or until the
        session ends. Raises AgentUnavailable; see gpufeed.prefetch for the window that calls this."""
        counts = reads if reads is not None else [[] for _ in wanted]
        kept = [(handle, blocks, n) for (handle, blocks), n in zip(wanted, counts, strict=True) if handle.blocks is not None]
        groups, _ = self._groups([(handle, blocks, []) for handle, blocks, _ in kept], [n for *_, n in kept])
        return self.agent.request(Prefetch(session, groups, pin, ahead_samples), Queued)

    def cancel(self, session: str) -> None:
        """Drop what prefetch `session` still has queued."""
        try:
            self.agent.request(Cancel(session), Done, start=False)
        except AgentUnavailable:
            pass  # no agent, nothing queued

    def fetch(self, wanted: list[tuple[ObjectHandle, list[int], list[int]]]) -> set[tuple[str, int]]:
        """Ask the agent to publish these blocks (of one or many objects) and wait, FETCH_BATCH
        blocks a request; returns the (object id, block) pairs it could not cache."""
        uncached: set[tuple[str, int]] = set()
        request: list[tuple[ObjectHandle, list[int], list[int]]] = []
        count = 0
        for handle, blocks, repair in wanted:
            for first in range(0, len(blocks), FETCH_BATCH):
                part = blocks[first : first + FETCH_BATCH]
                if count + len(part) > FETCH_BATCH:
                    uncached |= self.once(request)[0]
                    request, count = [], 0
                request.append((handle, part, [i for i in repair if i in part]))
                count += len(part)
        return uncached | self.once(request)[0] if request else uncached

    def once(
        self, wanted: list[tuple[ObjectHandle, list[int], list[int]]], *, at_owners: bool = False
    ) -> tuple[set[tuple[str, int]], int]:
        """One Fetch request: the (object id, block) pairs not cached, and the bytes the agent
        (or, `at_owners`, the cluster's owners) read from stores for it."""
        groups, order = self._groups(wanted)
        try:
            reply = self.agent.request(Fetch(groups, at_owners), Fetched)
        except AgentUnavailable as exc:
            if at_owners:
                raise
            self._warn("agent", f"{exc}; reading without the cache")
            return {(handle.blocks.oid, index) for handle, blocks, _ in wanted for index in blocks}, 0  # type: ignore[union-attr]
        self.bytes += reply.fetched
        if reply.failures:
            _raise(reply.failures[0], order)
        uncached = {(order[number].blocks.oid, index) for number, index in reply.uncached}  # type: ignore[union-attr]
        if uncached:
            self._warn("uncached", f"the cache in {self.agent.primary} cannot hold more blocks; reading uncached")
        return uncached, reply.fetched

    def ranges(self, reads: list[tuple[ObjectHandle, int, int]]) -> list[memoryview]:
        """Bytes [start, end) of each handle's object, read by the agent from the store and handed
        back uncached (`ReadRanges`), pinned and checked as this process would read them. Each
        range is at most RANGES_BYTES. Raises AgentUnavailable, or a failed range's error naming
        its file."""
        out: list[memoryview] = []
        batch: list[tuple[ObjectHandle, int, int]] = []
        size = 0
        for read in reads:
            if batch and size + read[2] - read[1] > RANGES_BYTES:
                out += self._ranges_once(batch)
                batch, size = [], 0
            batch.append(read)
            size += read[2] - read[1]
        return out + self._ranges_once(batch) if batch else out

    def _ranges_once(self, reads: list[tuple[ObjectHandle, int, int]]) -> list[memoryview]:
        handles = list({id(handle): handle for handle, _, _ in reads}.values())
        groups, order = self._groups([(handle, [], []) for handle in handles])
        number = {id(handle): n for n, handle in enumerate(order)}
        wanted = [RangeWant(number[id(handle)], start, end) for handle, start, end in reads]
        reply = self.agent.request(ReadRanges(groups, wanted), RangeBytes)
        if reply.failures:
            _raise(reply.failures[0], order)
        self.bytes += sum(len(part) for part in reply.parts)
        return [memoryview(part) for part in reply.parts]

    @staticmethod
    def _groups(
        wanted: list[tuple[ObjectHandle, list[int], list[int]]], reads: list[list[int]] | None = None
    ) -> tuple[list[Group], list[ObjectHandle]]:
        """Agent request groups: per source, the objects and which of their blocks to fetch
        (and which to repair, and for a prefetch how many reads need each); and the objects in
        the order the agent numbers them."""
        groups: dict[tuple[str, str, str], tuple[Group, list[ObjectHandle]]] = {}
        for n, (handle, blocks, repair) in enumerate(wanted):
            info, mount = handle.info, handle.mount
            options = source_options(mount)
            key = (mount.url, repr(sorted(options.items())), mount.path)
            if key not in groups:
                credentials = Credentials(caller_credentials(mount.url, options))
                groups[key] = (Group(SourceSpec(mount.url, options), [], credentials, mount.path, owner_only(mount)), [])
            group, members = groups[key]
            members.append(handle)
            block_size = handle.blocks.block_size if handle.blocks is not None else 0  # none: ranges only
            counts = reads[n] if reads else []
            group.objects.append(ObjectWant(info, not mount.immutable, block_size, blocks, repair, counts, _sums(handle, blocks)))
        return [group for group, _ in groups.values()], [h for _, members in groups.values() for h in members]


def _sums(handle: ObjectHandle, blocks: list[int]) -> bytes:
    """The listed chunk sums of each of a pack shard's wanted blocks (`ObjectWant.sums`)."""
    ref = handle.blocks
    if handle.chunk_sums is None or ref is None or not sums_checked(handle.info, ref.block_size):
        return b""
    return b"".join(listed_sums(handle.chunk_sums, index * ref.block_size, ref.length(index)) for index in blocks)


def _raise(failure: Failure, order: list[ObjectHandle]) -> NoReturn:
    """The agent's failure as the error a reader gets, naming the file of the object it is about."""
    error = from_code(failure.code, failure.message)
    if failure.object is None:
        raise error
    handle = order[failure.object]
    if isinstance(error, (ObjectMissing, ObjectChanged)):
        raise explained(handle.path, handle.mount.path, error)
    raise type(error)(f"{handle.path}: {error}")
