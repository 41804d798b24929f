"""BlockId → published block file: where every block the node caches is fetched and checked.

A wanted block is looked for in order: on local disk (`CacheManager.present`), then in each
`BlockSource` of the chain — peers once the cluster exists, the store last, which always has
it. One fetch per block however many readers want it (single flight across every process on
the node). Nothing is published that was not checked first: the length always; the whole
object against its content hash or S3 MD5 ETag where the store or the manifest vouches for
one (the source checks whole-object reads, `sources.objstore`). A multi-block object whose
manifest holds a content hash is therefore fetched whole, checked, then published block by
block, so none of its blocks is ever cached unchecked. A pack's shard is checked block by block
against the chunk sums its index lists, as each block's header is made (`blocks.encode`).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Literal, Protocol, cast

import xxhash

from gpufeed import errors
from gpufeed.agent.manager import INLINE_PUBLISH, CacheManager
from gpufeed.agent.metrics import Metrics
from gpufeed.agent.sessions import Session, Sessions
from gpufeed.blocks import (
    SUM,
    WHOLE_OBJECT_MAX,
    BlockId,
    ChunkMismatch,
    ObjectBlocks,
    chunk_count,
    mismatch,
    object_blocks,
    sums_checked,
)
from gpufeed.config import Settings
from gpufeed.rpc.messages import Failure, Fetched, Group, ObjectWant, RangeBytes, RangeWant
from gpufeed.sources import Source, open_source

log = logging.getLogger("gpufeed.agent")

FETCH_CONCURRENCY = 64
PREFETCH_CONCURRENCY = 48
SOURCES_KEPT = 64
"""Stores (one per source and set of credentials) the agent keeps open, least recently used dropped."""
MAX_BLOCKS_PER_REQUEST = 65536
WHOLE_PART = 16 << 20
"""Range size a big object checked whole is read in, every range in flight at once."""

Status = Literal["ok", "uncached"]


@dataclass(frozen=True, slots=True)
class Job:
    """One wanted block of one object of a request."""

    number: int
    """The object's number in its request (across groups, in order): failures name it."""
    source: Source
    want: ObjectWant
    blocks: ObjectBlocks
    index: int
    mount: str = ""
    """The mount the reader named (`Group.mount`): misses are counted by it."""
    group: Group | None = None
    """The request's group, which a peer rebuilds the object's store from."""
    reads: int = 1
    """For a prefetch: how many of the job's coming reads need the block."""
    listed: bytes | None = None
    """The chunk sums the block must have (a pack's shard, `ObjectWant.sums`), or None."""

    @property
    def block(self) -> BlockId:
        return self.blocks.block(self.index)

    @property
    def verified_whole(self) -> bool:
        """Whether this object's blocks are cached only after the whole object matched its hash."""
        return bool(self.want.info.content_hash) and self.blocks.count > 1 and self.want.info.size <= WHOLE_OBJECT_MAX


class BlockSource(Protocol):
    """Somewhere a block's bytes can come from, after local disk."""

    async def read(self, job: Job, start: int, end: int) -> memoryview | None:
        """Bytes [start, end) of the job's object, checked as the source can; None when this
        source does not have them (a peer that never cached them)."""
        ...

    def only_blocks(self, job: Job) -> bool:
        """Whether this source would be asked for the job's object and answers whole blocks
        only (a peer): the fetcher then asks for the object block by block."""
        ...


class RangeSource(Protocol):
    """Somewhere any range of an object can come from ahead of the store, for the reads the
    cache does not keep (`Fetcher.read_ranges`): writes still uploading (`writer.StagedBlocks`)."""

    async def range(self, group: Group, want: ObjectWant, start: int, end: int) -> memoryview | None:
        ...


class StoreBlocks:
    """The object store itself: the last source in the chain, and the one that always answers.
    Its FETCH_CONCURRENCY slots bound reads of the store only: a read waiting on a peer holds
    none, or two nodes whose slots all wait on each other would stall until a timeout."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.slots = asyncio.Semaphore(FETCH_CONCURRENCY)

    def only_blocks(self, job: Job) -> bool:
        return False

    async def read(self, job: Job, start: int, end: int) -> memoryview:
        return await self.range(job.source, job.want, job.mount, start, end)

    async def range(self, source: Source, want: ObjectWant, mount: str, start: int, end: int) -> memoryview:
        """Bytes [start, end) of the object, in a slot, counted as a miss of `mount`."""
        async with self.slots:
            began = time.monotonic()
            data = await source.get_range_async(want.info.key, start, end, want.info, conditional=want.check)
        self.metrics.fetched(mount, "store", len(data), time.monotonic() - began)
        if len(data) != end - start:  # the object shrank or grew: never publish a short block
            raise errors.ObjectChanged(f"{want.info.key}: the source returned {len(data)} bytes for [{start}, {end})")
        return data


class Fetcher:
    def __init__(self, settings: Settings, manager: CacheManager, sessions: Sessions, metrics: Metrics) -> None:
        self.settings = settings
        self.manager = manager
        self.sessions = sessions
        self.metrics = metrics
        self.store = StoreBlocks(metrics)
        self.chain: list[BlockSource] = [self.store]
        self.ranges: list[RangeSource] = []
        """Asked before the store for `read_ranges`."""
        self.inflight: dict[str, asyncio.Future[Status]] = {}
        """Block (or, for objects fetched whole, object) name → the fetch every other wanter joins."""
        self.busy: set[str] = set()
        """Blocks of objects being fetched whole: eviction leaves them alone while their siblings
        are published, so an object is not evicted by its own arrival."""
        self._sources: dict[str, Source] = {}
        self._prefetches: collections.deque[tuple[Session, Job, float]] = collections.deque()
        """Blocks prefetch sessions asked for and no prefetcher took yet, in the order asked."""
        self._prefetchers: set[asyncio.Task[None]] = set()

    def source(self, group: Group) -> Source:
        """The store for a group; its credentials are the reader's (keyed by a hash, never kept in clear)."""
        spec = group.source
        secrets = group.credentials.values
        key = xxhash.xxh3_128_hexdigest(repr((spec.url, sorted(spec.options.items()), sorted(secrets.items()))).encode())
        source = self._sources.pop(key, None)
        if source is None:
            source = open_source(spec.url, {**spec.options, **secrets}, self.settings)
            while len(self._sources) >= SOURCES_KEPT:  # rotated credentials must not pile up stores
                self._sources.pop(next(iter(self._sources)))
        self._sources[key] = source  # most recently used last
        return source

    def jobs(self, groups: list[Group]) -> list[Job]:
        """Every block a request names, after checking it. Identities are derived here, never
        taken from a reader, from what the reader says of the object: its version, content hash
        or chunk sums' hash (`sums_id`, which the agent cannot check against the sums of the few
        blocks it is sent; readers are this user's processes or token-holding peers)."""
        jobs: list[Job] = []
        number = 0
        for group in groups:
            source = self.source(group)
            for want in group.objects:
                info = want.info
                try:
                    blocks = object_blocks(group.source.url, group.source.options, info, want.block_size, want.check)
                except ValueError as exc:
                    raise errors.InvalidArgument(str(exc)) from None
                if any(not 0 <= i < blocks.count for i in want.blocks):
                    raise errors.InvalidArgument(f"a block index is outside {info.key} ({info.size} bytes)")
                if want.reads and (len(want.reads) != len(want.blocks) or min(want.reads) < 1):
                    raise errors.InvalidArgument(f"{info.key}: expected a count of reads >= 1 for each block asked for")
                reads = zip(want.blocks, want.reads or [1] * len(want.blocks), _listed(want, blocks), strict=True)
                jobs.extend(Job(number, source, want, blocks, index, group.mount, group, n, sums) for index, n, sums in reads)
                number += 1
                if len(jobs) > MAX_BLOCKS_PER_REQUEST:
                    raise errors.InvalidArgument(f"more than {MAX_BLOCKS_PER_REQUEST} blocks in one request")
        return jobs

    async def fetch(self, groups: list[Group]) -> Fetched:
        """Demand reads: reply once every block is published, known uncached, or failed. Their
        reader reads the blocks now, so those a prefetch announced more reads of are kept."""
        jobs = self.jobs(groups)
        reply = await self.fetch_jobs(jobs)
        self.sessions.fetched_for_read(job.block.name for job in jobs)
        return reply

    async def fetch_jobs(self, jobs: list[Job]) -> Fetched:
        reply = Fetched([], [], 0)

        async def one(job: Job) -> None:
            try:
                status, got = await self.ensure(job, job.index in job.want.repair)
            except errors.GpufeedError as exc:
                reply.failures.append(Failure(exc.code, str(exc), job.number))
                self.metrics.errors[exc.code] += 1
                return
            except Exception as exc:  # one block's bug or I/O error fails that read, not its neighbours
                log.exception("block %d of %s", job.index, job.want.info.key)
                reply.failures.append(Failure(errors.SourceError.code, f"agent: {exc}", job.number))
                self.metrics.errors[errors.SourceError.code] += 1
                return
            reply.fetched += got
            if status == "uncached":
                reply.uncached.append((job.number, job.index))

        await asyncio.gather(*(one(job) for job in jobs))
        return reply

    async def ensure(self, job: Job, repair: bool = False) -> tuple[Status, int]:
        """Make the job's block present; returns its status and the bytes this call fetched from
        a source. 'uncached': the cache cannot hold it and the reader reads the source itself. A
        call that joins another's fetch fetched nothing."""
        block = job.block
        name = block.name
        flight = job.blocks.oid if job.verified_whole else name
        if repair and flight not in self.inflight:
            log.warning(  # a disk that flips bits or truncates files shows here first
                "block %d of %s was damaged on disk (%s): discarded and fetched again",
                job.index, job.want.info.key, self.manager.path(block),
            )
            self.sessions.unpin(name)
            self.manager.discard(block)
        elif self.manager.present(block):
            return "ok", 0
        pending = self.inflight.get(flight)
        if pending is not None:
            try:
                status = await asyncio.shield(pending)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                return await self.ensure(job, repair)  # its fetcher's reader went away: fetch it here
            if status == "ok" and not self.manager.present(block):  # its publish failed (disk full)
                status = "uncached"
            return status, 0
        length = job.blocks.length(job.index)
        if not self.manager.can_hold(length if not job.verified_whole else job.want.info.size):
            self.metrics.count("uncached")
            return "uncached", 0
        future: asyncio.Future[Status] = asyncio.get_running_loop().create_future()
        self.inflight[flight] = future
        try:
            if job.verified_whole:
                result, fetched = await self._whole(job), job.want.info.size
            else:
                result, fetched = await self._one(job), length
            future.set_result(result)
            return result, fetched
        except asyncio.CancelledError:
            future.cancel()  # its waiters fetch the block themselves
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # a waiter re-raises it; nobody waiting is fine too
            raise
        finally:
            del self.inflight[flight]

    async def _read(self, job: Job, start: int, end: int) -> memoryview:
        for source in self.chain:
            data = await source.read(job, start, end)
            if data is not None:
                return data
        raise errors.SourceError(f"{job.want.info.key}: no source had bytes [{start}, {end})")

    async def _one(self, job: Job) -> Status:
        """Fetch and publish one block; one whose chunks fail their listed sums is read once more,
        then reported (a byte flipped in transit passes the second time, a damaged shard fails)."""
        start = job.index * job.blocks.block_size
        try:
            return await self._fetch_and_publish(job, start)
        except ChunkMismatch:
            log.warning("block %d of %s failed its listed chunk sums: reading it again", job.index, job.want.info.key)
        try:
            return await self._fetch_and_publish(job, start)
        except ChunkMismatch as exc:
            raise mismatch(job.want.info, start, exc) from None

    async def _fetch_and_publish(self, job: Job, start: int) -> Status:
        data = await self._read(job, start, start + job.blocks.length(job.index))
        return "ok" if await self._publish(job.block, data, self._copy(job), job.listed) else "uncached"

    def _copy(self, job: Job) -> bool:
        """Whether the job's block is kept as a copy: its mount says `copies=owner-only` and
        another cluster node owns it."""
        return job.group is not None and job.group.owner_only and any(source.only_blocks(job) for source in self.chain)

    async def _publish(self, block: BlockId, data: memoryview, copy: bool = False, listed: bytes | None = None) -> bool:
        """Publish to the end even when the fetch that read `data` is cancelled (its reader went
        away): a block file is written and counted in the cache, or neither. A small block is
        written without a suspension (`INLINE_PUBLISH`), where no cancellation can land, so it
        needs no shielding task."""
        if len(data) <= INLINE_PUBLISH:
            return await self.manager.publish(block, data, copy, listed)
        return await asyncio.shield(self.manager.publish(block, data, copy, listed))

    async def _whole(self, job: Job) -> Status:
        """Fetch the object whole and check it against its content hash, then publish every
        block of it not yet present."""
        data = await self._whole_bytes(job)
        size = job.blocks.block_size
        copy = self._copy(job)
        status: Status = "ok"
        names = {job.blocks.block(index).name for index in range(job.blocks.count)}
        self.busy |= names
        try:
            for index in range(job.blocks.count):
                block = job.blocks.block(index)
                if index != job.index and self.manager.present(block):
                    continue
                if not await self._publish(block, data[index * size : (index + 1) * size], copy):
                    status = "uncached" if index == job.index else status
        finally:
            self.busy -= names
        return status

    async def _whole_bytes(self, job: Job) -> memoryview:
        """A small object in one read, which the source checks against the content hash; a big
        one (a checkpoint's file) in WHOLE_PART ranges all in flight, as one GET stream over a
        long link is slow, each conditional on the listed version; an object a peer owns block
        by block, as peers pass whole blocks. Parts are hashed here once assembled, so a peer's
        bytes are checked end to end as the store's are. A mismatch is read again once, then
        reported."""
        info = job.want.info
        assert info.content_hash is not None
        if any(source.only_blocks(job) for source in self.chain):
            step = job.blocks.block_size
        elif info.size <= 2 * WHOLE_PART:
            return await self._read(job, 0, info.size)
        else:
            step = WHOLE_PART
        algorithm, _, wanted = info.content_hash.partition(":")
        got = ""
        for _ in range(2):
            buffer = bytearray(info.size)

            async def part(start: int, buffer: bytearray = buffer) -> None:
                end = min(start + step, info.size)
                buffer[start:end] = await self._read(job, start, end)

            await asyncio.gather(*(part(start) for start in range(0, info.size, step)))
            got = await asyncio.to_thread(_hexdigest, algorithm, buffer)
            if got == wanted.lower():
                return memoryview(buffer)
        raise errors.ObjectCorrupted(
            f"{info.key}: the bytes read hash to {algorithm}:{got}, the manifest says {info.content_hash}"
        )

    async def read_ranges(self, groups: list[Group], wanted: list[RangeWant]) -> RangeBytes:
        """Ranges read from the store as blocks are (`StoreBlocks.range`), or from a write still
        uploading (`ranges`), and handed back uncached (`ReadRanges`)."""
        objects = [(self.source(group), group, want) for group in groups for want in group.objects]
        parts: list[bytes | memoryview] = [b""] * len(wanted)
        failures: list[Failure] = []

        async def one(n: int, asked: RangeWant) -> None:
            if not 0 <= asked.object < len(objects):
                raise errors.InvalidArgument(f"range {n} names object {asked.object} of {len(objects)}")
            source, group, want = objects[asked.object]
            if not 0 <= asked.start <= asked.end <= want.info.size:
                where = f"{want.info.key}: range [{asked.start}, {asked.end})"
                raise errors.InvalidArgument(f"{where} outside its {want.info.size} bytes")
            try:
                for staged in self.ranges:
                    if (data := await staged.range(group, want, asked.start, asked.end)) is not None:
                        parts[n] = data
                        return
                parts[n] = await self.store.range(source, want, group.mount, asked.start, asked.end)
            except errors.GpufeedError as exc:
                failures.append(Failure(exc.code, str(exc), asked.object))
                self.metrics.errors[exc.code] += 1

        await asyncio.gather(*(one(n, asked) for n, asked in enumerate(wanted)))
        return RangeBytes(cast("list[bytes]", parts), failures)  # msgspec sends a memoryview as bytes, uncopied

    def prefetch(self, session: Session, jobs: list[Job]) -> None:
        """Queue blocks a job will read soon, fetched in the order asked by at most
        PREFETCH_CONCURRENCY prefetchers, so demand reads keep their slots. A few long-lived
        prefetchers, not a task per block: a block then costs no task, and no wait in a
        semaphore's queue behind thousands of others."""
        asked = time.monotonic()
        self._prefetches.extend((session, job, asked) for job in jobs)
        session.queued += len(jobs)
        while len(self._prefetchers) < min(PREFETCH_CONCURRENCY, len(self._prefetches)):
            self._prefetchers.add(asyncio.create_task(self._prefetcher()))

    async def _prefetcher(self) -> None:
        """Fetch queued blocks until none is left. It leaves the set of prefetchers in the same
        step as it finds the queue empty: one that had finished but was still counted (a done
        callback runs a step later) would leave blocks queued a moment later with no prefetcher."""
        try:
            while self._prefetches:
                session, job, asked = self._prefetches.popleft()
                try:
                    await self._prefetch_one(session, job, asked)
                finally:
                    session.queued -= 1
        finally:
            task = asyncio.current_task()
            assert task is not None
            self._prefetchers.discard(task)

    async def _prefetch_one(self, session: Session, job: Job, asked: float) -> None:
        """Fetch one block for a session and pin it, once the pin budget has room for it
        (`Sessions.reserve`); a hint for blocks read around (an unpinning session) needs none.
        The block is pinned before its reservation goes, so the budget is never overrun."""
        length = job.blocks.length(job.index)
        if not self.sessions.wanted(session, job.block.name):
            return
        if session.pin and not await self.sessions.reserve(session, length):
            return
        status: Status = "uncached"
        try:
            status, fetched = await self.ensure(job)
            if fetched:
                self.metrics.prefetch_time(time.monotonic() - asked)
        except Exception as exc:  # a hint that failed: the demand read will fetch or report
            self.metrics.count("prefetch_errors")
            log.debug("prefetch of block %d of %s failed: %s", job.index, job.want.info.key, exc)
        finally:
            if status == "ok":
                self.sessions.pin(session, job.block.name)
            if session.pin:
                self.sessions.release(length)


def _listed(want: ObjectWant, blocks: ObjectBlocks) -> list[bytes | None]:
    """The listed chunk sums of each wanted block (`ObjectWant.sums`, cut block by block); None
    each where the object's blocks are not checked against any."""
    if not sums_checked(want.info, want.block_size):
        return [None] * len(want.blocks)
    sizes = [SUM.size * chunk_count(blocks.length(index)) for index in want.blocks]
    if sum(sizes) != len(want.sums):
        raise errors.InvalidArgument(f"{want.info.key}: {len(want.sums)} bytes of chunk sums for blocks that need {sum(sizes)}")
    ends = list(itertools.accumulate(sizes))
    return [want.sums[end - size : end] for size, end in zip(sizes, ends, strict=True)]


def _hexdigest(algorithm: str, data: bytearray) -> str:
    return hashlib.new(algorithm.lower(), data).hexdigest()
