"""The read path: namespace path → (mount, key, pinned version) → blocks → cache hit or agent fetch.

Every reader (Python API, CLI, fsspec, and later PyTorch datasets, FUSE, warmup, the
benchmark) fetches bytes through `Client.read_range`. A hit reads a published block file in
this process (held open and mapped between hits: `cache.openfiles`), with no round trip;
misses go to the node agent in one batched request; when the agent cannot cache (disk full,
no agent) the bytes come from the source.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from gpufeed import arguments, coverage
from gpufeed.blocks import CorruptBlock, overlap
from gpufeed.cache import blockfile
from gpufeed.client import plan
from gpufeed.client.connection import AgentClient
from gpufeed.client.direct import DirectReads, explained
from gpufeed.client.fetches import RANGES_BYTES, AgentFetches
from gpufeed.client.file import FeedFile
from gpufeed.client.handles import Handles, ObjectHandle
from gpufeed.client.hit_reports import HitReporter
from gpufeed.client.read_around import ReadAround
from gpufeed.client.writer import FeedWriter
from gpufeed.config import Settings
from gpufeed.errors import GpufeedError, InvalidArgument, ObjectChanged, ObjectMissing, WriteError
from gpufeed.mount_options import CachePolicy, source_options
from gpufeed.namespace import Namespace
from gpufeed.paths import FileStat
from gpufeed.rpc.messages import (
    Credentials,
    Done,
    Remove,
    SourceSpec,
    Sync,
    Synced,
)
from gpufeed.sources.credentials import caller_credentials
from gpufeed.sources.local import LocalSource

log = logging.getLogger("gpufeed")
T = TypeVar("T")

WARM_STEP = 64
"""Blocks a warmup asks for at once: its progress moves every 256 MiB of a big object (4 MiB blocks)."""


def _warner() -> Callable[[str, str], None]:
    """A client's warn-once, for it and its parts. Not a bound method: a part holding the client
    would make a reference cycle, and a dropped client must close its block files at once, not
    at the next garbage collection."""
    warned: set[str] = set()

    def warn_once(topic: str, message: str) -> None:
        if topic not in warned:
            warned.add(topic)
            log.warning("gpufeed: warning: %s", message)  # recognisable under logging's last resort too

    return warn_once


class Client:
    def __init__(self, settings: Settings | None = None, namespace: Namespace | None = None) -> None:
        self.namespace = namespace or Namespace(settings)
        self.settings = self.namespace.settings
        self.agent = AgentClient(self.settings)
        self.hits = HitReporter(self.agent)
        # multiprocessing's finalizers run when a DataLoader worker exits (atexit does not run
        # there), so the hits a worker served reach the agent's counts and its eviction
        multiprocessing.util.Finalize(self, self.hits.flush, exitpriority=10)
        self._warn_once = _warner()
        self._session = f"reads-{os.getpid()}-{id(self):x}"
        self.handles = Handles(self.namespace, self.agent, self.hits, self._warn_once)
        self.fetches = AgentFetches(self.agent, self._warn_once)
        self.direct = DirectReads(self.fetches.ranges, RANGES_BYTES)
        self.read_around = ReadAround()

    @property
    def source_bytes(self) -> int:
        """Bytes this client caused to be read from sources: its direct reads and the blocks
        the agent fetched for it (a block another process had already asked for is not counted)."""
        return self.fetches.bytes + self.direct.bytes

    @property
    def direct_bytes(self) -> int:
        """Of those, the bytes this process read from sources itself, not through the agent."""
        return self.direct.bytes

    def close(self) -> None:
        self.hits.close()
        self.agent.close()
        self.namespace.close()

    def handle(self, path: str) -> ObjectHandle:
        """The object at `path`, pinned to the version its mount's manifest lists. Handles are
        remembered while their mount's generation is current (as the namespace's mount table
        sees it, so a refresh elsewhere shows within MOUNTS_TTL_S): a read by path then costs
        no manifest lookup. Mounts with --max-age revalidate on open and are not remembered, nor
        are writable mounts' (a write in another process changes an entry, not the generation)."""
        return self.handles.get(path)

    def handle_many(self, paths: Sequence[str]) -> list[ObjectHandle]:
        """`handle` of each path, the ones not remembered looked up a directory at a time: what a
        batch of samples, or a prefetch window, costs the manifest."""
        return self.handles.get_many(paths)

    def read_range(self, handle: ObjectHandle, start: int, end: int) -> memoryview:
        """Bytes [start, end) of the pinned version, clipped to the object's size. A range over
        several blocks is assembled in one buffer, each cached block copied into it once."""
        if handle.member is not None:
            start, end = handle.extent(start, end)
        data = self._hit(handle, start, end)
        if data is not None:
            return data
        ref = handle.blocks
        end = min(end, handle.info.size)
        if ref is not None and start < end and start // ref.block_size != (end - 1) // ref.block_size:
            pieces = self._hit_pieces(handle, start, end)
            if pieces:
                at = start + sum(len(piece) for piece in pieces)
                if at < end:
                    pieces.append(self._read_misses([(handle, at, end)])[0])
                return memoryview(b"".join(pieces))
        return self._read_misses([(handle, start, end)])[0]

    def read_into(self, handle: ObjectHandle, start: int, target: memoryview) -> int:
        """`read_range` into the caller's buffer; returns the bytes read. Cached blocks are
        copied straight into `target` (a checkpoint's tensor: no assembled buffer in between);
        from the first block not on disk on, the rest is fetched and copied in."""
        end = min(start + len(target), handle.size)
        if end <= start:
            return 0
        lo, hi = handle.extent(start, end)
        at = lo + sum(len(piece) for piece in self._hit_pieces(handle, lo, hi, target))
        if at < hi:
            rest = self._read_misses([(handle, at, hi)])[0]
            target[at - lo : at - lo + len(rest)] = rest
            at += len(rest)
        return at - lo

    def _hit_pieces(self, handle: ObjectHandle, start: int, end: int, target: memoryview | None = None) -> list[memoryview]:
        """The blocks of [start, end) (offsets in the blocks' object) that are on disk, in
        order up to the first that is not, counted as hits: copied into `target` (a caller's
        buffer, filled from its start), or else as views for the caller to copy once
        (`blockfile.view`)."""
        ref = handle.blocks
        if ref is None:
            return []
        size = ref.block_size
        pieces: list[memoryview] = []
        at = start
        while at < end:
            index = at // size
            stop = min(end, (index + 1) * size)
            base = index * size
            try:
                if target is None:
                    pieces.append(blockfile.view(ref, index, at - base, stop - base))
                else:
                    pieces.append(blockfile.read(ref, index, at - base, stop - base, target[at - start : stop - start]))
            except (FileNotFoundError, CorruptBlock):  # a damaged one is repaired by the miss path
                break
            handle.tally.hits += 1
            self.hits.record(f"{ref.oid}-{index}")  # BlockId.name, as `_hit` records it
            at = stop
        handle.tally.hit_bytes += at - start
        return pieces

    def read_many(self, reads: Sequence[tuple[ObjectHandle, int, int]]) -> list[memoryview]:
        """`read_range` for a batch (a DataLoader batch, say): hits are read here and the
        batch's misses are fetched together, so a batch waits about one fetch, not one per
        sample."""
        if any(handle.member is not None for handle, _, _ in reads):
            reads = [(handle, *handle.extent(start, end)) for handle, start, end in reads]
        hit = self._hit
        out = [hit(handle, start, end) for handle, start, end in reads]
        missed = [n for n, data in enumerate(out) if data is None]
        if missed:
            for n, data in zip(missed, self._read_misses([reads[n] for n in missed]), strict=True):
                out[n] = data
        return out  # type: ignore[return-value]

    def _hit(self, handle: ObjectHandle, start: int, end: int) -> memoryview | None:
        """The common case, a cache hit inside one block: no lists, no dicts. None otherwise."""
        ref = handle.blocks
        if ref is None:
            return None
        if ref.small_header is not None and start == 0 and end >= ref.object_size:
            try:
                data = blockfile.read_one_chunk(ref.files, ref.small_path, ref.object_size, ref.small_header)
            except (FileNotFoundError, CorruptBlock):
                return None
            hits = self.hits
            hits.names.append(ref.small_name)  # HitReporter.record, without a call on every hit
            tally = handle.tally
            tally.hits += 1
            tally.hit_bytes += ref.object_size
            if len(hits.names) >= hits.due:
                hits.check()
            return data
        if end > ref.object_size or start >= end:
            return None
        size = ref.block_size
        first = start // size
        if (end - 1) // size != first:
            return None
        base = first * size
        try:
            data = blockfile.read(ref, first, start - base, end - base)
        except (FileNotFoundError, CorruptBlock):
            return None
        tally = handle.tally
        tally.hits += 1
        tally.hit_bytes += end - start
        self.hits.record(f"{ref.oid}-{first}")  # BlockId.name, without building one on every hit
        return data

    def _read_misses(self, reads: Sequence[tuple[ObjectHandle, int, int]]) -> list[memoryview]:
        """Each read split at block bounds; pieces on disk are read, the rest fetched at once:
        by the agent in one request, or, for a sparse batch (see `plan.SPARSE_FACTOR`), straight
        from the source while the agent caches the blocks for later reads."""
        pieces: dict[tuple[int, int], memoryview] = {}
        absent: dict[tuple[int, int], tuple[int, int]] = {}  # (read, block) -> object range
        blocks: dict[str, tuple[ObjectHandle, dict[int, None], list[int]]] = {}
        joined: set[int] = set()  # reads over several blocks
        for n, (handle, start, end) in enumerate(reads):
            end = min(end, handle.info.size)
            ref = handle.blocks
            if ref is None:
                if end > start:
                    absent[(n, 0)] = (start, end)
                continue
            size = ref.block_size
            if end > start and start // size != (end - 1) // size:
                joined.add(n)
            read = blockfile.view if n in joined else blockfile.read  # pieces joined are copied once, by the join
            for index, lo, hi in plan.pieces(ref.blocks, start, end):
                try:
                    pieces[(n, index)] = read(ref, index, lo - index * size, hi - index * size)
                    handle.tally.hits += 1
                    handle.tally.hit_bytes += hi - lo
                    self.hits.record(ref.blocks.block(index).name)
                    continue
                except FileNotFoundError:
                    repair = False
                except CorruptBlock:
                    repair = True
                absent[(n, index)] = (lo, hi)
                _, wanted, repairs = blocks.setdefault(ref.oid, (handle, {}, []))
                wanted[index] = None
                if repair:
                    repairs.append(index)
        waiting_on = [reads[n][0].tally for n, _ in absent]  # one per missing piece: they share the wait
        self.hits.read.extend(f"{ref.oid}-{i}" for n, i in absent if (ref := reads[n][0].blocks) is not None)  # BlockId.name
        started = time.monotonic()
        if blocks:
            around = self.read_around.blocks(reads, absent, blocks)
            if around:  # the agent caches them for later reads; this batch does not wait for them
                self._hint([(blocks[oid][0], [index], []) for oid, index in around])
            waiting = []
            for oid, (handle, wanted, repairs) in blocks.items():
                if rest := [index for index in wanted if (oid, index) not in around]:
                    waiting.append((handle, rest, repairs))
            if waiting:
                uncached = self.fetches.fetch(waiting)
                for (n, index), (lo, hi) in list(absent.items()):
                    ref = reads[n][0].blocks
                    if ref is None or (ref.oid, index) in uncached or (ref.oid, index) in around:
                        continue
                    base = index * ref.block_size
                    try:
                        read = blockfile.view if n in joined else blockfile.read
                        pieces[(n, index)] = read(ref, index, lo - base, hi - base)
                        del absent[(n, index)]
                    except (FileNotFoundError, CorruptBlock):
                        pass  # evicted already (quota smaller than the working set): read through
        if absent:
            pieces.update(self.direct.many({key: (reads[key[0]][0], lo, hi) for key, (lo, hi) in absent.items()}))
        if waiting_on:
            self.hits.stalled(waiting_on, time.monotonic() - started)
        return [self._joined(pieces, n, handle, start, end) for n, (handle, start, end) in enumerate(reads)]

    @staticmethod
    def _joined(pieces: dict[tuple[int, int], memoryview], n: int, handle: ObjectHandle, start: int, end: int) -> memoryview:
        end = min(end, handle.info.size)
        if end <= start:
            return memoryview(b"")
        if handle.blocks is None:
            return pieces[(n, 0)]
        return plan.join([pieces[(n, index)] for index in handle.blocks.blocks.span(start, end)])

    def read_uncached(self, reads: Sequence[tuple[ObjectHandle, int, int]]) -> list[memoryview]:
        """Bytes straight from the store, never from the cache, pinned to each handle's version
        and checked as the store and the manifest allow: what `gpufeed verify` hashes when it
        records what the store holds."""
        ranges = {}
        for n, (handle, start, end) in enumerate(reads):
            start, end = handle.extent(start, end)
            ranges[(n, 0)] = (handle, start, min(end, handle.info.size))
        got = self.direct.many({key: r for key, r in ranges.items() if r[2] > r[1]})
        return [got.get((n, 0), memoryview(b"")) for n in range(len(reads))]

    def read_once(self, paths: Sequence[str]) -> list[memoryview]:
        """Whole files for one pass over a dataset (`gpufeed pack`): a file cached in one block is
        read from the cache, the rest straight from the store (`read_uncached`: pinned and checked
        the same way) without caching them, so the pass neither waits for the cache to be
        written nor evicts what the node's jobs read."""
        handles = self.handle_many(paths)
        out = [self._hit(handle, *handle.extent(0, handle.size)) for handle in handles]
        missed = [n for n, data in enumerate(out) if data is None]
        if missed:
            got = self.read_uncached([(handles[n], 0, handles[n].size) for n in missed])
            for n, data in zip(missed, got, strict=True):
                out[n] = data
        return out  # type: ignore[return-value]

    def read_once_into(self, paths: Sequence[str], targets: Sequence[memoryview]) -> list[int]:
        """`read_once` into the caller's buffers, one per path; returns each file's size and
        reads only the files whose size is their buffer's (the caller names a mismatch). A file
        of a local directory is read straight into its buffer by one `preadv`, pinned to the
        manifest's version and checked as `read_uncached` reads it, with no handle (its cache
        blocks are never read); the others are copied in from `read_once`."""
        sizes: list[int] = []
        rest: list[int] = []
        opened = self.namespace.open_objects(paths)
        for n, ((where, source, info), target) in enumerate(zip(opened, targets, strict=True)):
            sizes.append(info.size if info.pack_key is None else info.pack_length or 0)
            if sizes[-1] != len(target) or sizes[-1] == 0:
                continue
            if not isinstance(source, LocalSource) or info.pack_key is not None:
                rest.append(n)
                continue
            try:
                source.get_range_into(info.key, 0, target, info, conditional=not where.mount.immutable)
            except (ObjectMissing, ObjectChanged) as exc:
                raise explained(f"{where.mount.path}/{where.key}", where.mount.path, exc) from exc
            self.direct.bytes += len(target)
        for n, data in zip(rest, self.read_once([paths[n] for n in rest]), strict=True):
            targets[n][:] = data
        return sizes

    def _hint(self, wanted: list[tuple[ObjectHandle, list[int], list[int]]]) -> None:
        """Have the agent cache blocks this client reads around; nobody waits for them."""
        try:
            self.fetches.prefetch([(handle, blocks) for handle, blocks, _ in wanted], self._session, pin=False)
        except GpufeedError:
            pass  # a hint: the next read of these blocks fetches them itself

    def cancel_prefetch(self, session: str) -> None:
        self.fetches.cancel(session)

    def warm(self, handle: ObjectHandle, fetched: Callable[[int], None] | None = None, *, at_owners: bool = False) -> int:
        """Make every block of `handle` present in the node cache without reading it; returns
        the bytes of it the cache did not take (no agent, a full cache), which reads will fetch
        from the store. `fetched` hears the bytes of every WARM_STEP blocks done, so a big
        object shows progress and a stopped warmup knows what it cached. `at_owners` (a cluster
        warmup): each block is cached by its owner in the cache cluster instead, all owners at
        once. What the store sent for it is in `source_bytes` (whole blocks, which a pack's
        members share)."""
        ref = handle.blocks
        if ref is None:  # no agent (its warning said so), or a mount not cached (cache=off): nothing to warm
            return handle.size if handle.size and CachePolicy.of(handle.mount, self.settings).enabled else 0
        lo, hi = handle.extent(0, handle.size)
        span = ref.blocks.span(lo, hi)
        missing = list(span) if at_owners else [i for i in span if not os.path.exists(ref.path(i))]
        left = 0
        for first in range(0, len(missing), WARM_STEP):
            part = missing[first : first + WARM_STEP]
            uncached, _ = self.fetches.once([(handle, part, [])], at_owners=at_owners)
            sizes = {i: overlap(ref.block_size, i, lo, hi) for i in part}
            left += sum(size for i, size in sizes.items() if (ref.oid, i) in uncached)
            if fetched is not None:
                fetched(sum(sizes.values()))
        return left

    def cached_bytes(self, path: str) -> Iterator[tuple[FileStat, int]]:
        """(file, bytes of it present in the cache) for every file under `path`; reads no data."""
        return coverage.cached_bytes(self.namespace, self.settings, self.agent.readable_dirs()[0], path)

    def open(self, path: str | os.PathLike[str], mode: str = "rb", *, sync: bool = False) -> FeedFile | FeedWriter:
        """`rb`: a seekable read-only file. `wb`: a new version of `path` in a writable mount,
        committed on close (write-back; `sync=True` waits for the upload: `client.writer`)."""
        if arguments.mode(mode, "open") == "wb":
            return FeedWriter(self, arguments.path(path, "open"), sync=sync)
        return FeedFile(self, self.handle(arguments.path(path, "open")))

    def write(self, path: str | os.PathLike[str], data: bytes | bytearray | memoryview, *, sync: bool = False) -> None:
        """`path`'s new bytes, whole (`open(path, "wb")` for a file written piece by piece)."""
        with FeedWriter(self, arguments.path(path, "write"), sync=sync) as f:
            f.write(data)

    def sync(self, path: str | os.PathLike[str] = "/", since: float = 0.0) -> int:
        """Wait until every write under `path` this node committed is in its store; returns how
        many uploads were waited for. Uploads that keep failing (since `since`, wall-clock;
        0: now) raise WriteError naming them (they stay staged and are retried)."""
        path = arguments.path(path, "sync")
        self.namespace.resolve(path)  # PathNotFound for a path no mount holds: nothing would be waited for
        since = since or time.time()
        synced = self.agent.request(Sync(path, since), Synced)
        while synced.pending and not synced.failures:  # the agent answers before this request times out
            synced = self.agent.request(Sync(path, since), Synced)
        if synced.failures:
            first = synced.failures[0]
            more = f" (and {len(synced.failures) - 1} more)" if len(synced.failures) > 1 else ""
            raise WriteError(f"upload not done, still retried: {first.message}{more}")
        return synced.uploads

    def remove(self, path: str | os.PathLike[str]) -> None:
        """Delete a file of a writable mount from its store and the manifest."""
        where = self.namespace.writable_target(arguments.path(path, "remove"))
        self.stat(f"{where.mount.path}/{where.key}")  # PathNotFound for a path the manifest does not hold
        mount = where.mount
        options = source_options(mount)
        credentials = Credentials(caller_credentials(mount.url, options))
        self.agent.request(Remove(SourceSpec(mount.url, options), mount.path, where.key, credentials), Done)
        self.forget(f"{mount.path}/{where.key}")

    def forget(self, path: str) -> None:
        """Drop what this process remembers of `path` (it was written or removed here)."""
        self.handles.forget(path)

    def read(self, path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> bytes:
        path = arguments.path(path, "read")
        offset = arguments.integer(offset, "offset", "read")
        if length is not None:
            length = arguments.integer(length, "length", "read")
        if offset < 0 or (length is not None and length < 0):
            raise InvalidArgument(f"{path}: offset and length must be >= 0")

        def attempt() -> bytes:
            handle = self.handle(path)
            end = handle.size if length is None else offset + length
            return blockfile.as_bytes(self.read_range(handle, offset, end))

        return self._current(attempt)

    def read_files(self, paths: Sequence[str]) -> list[memoryview]:
        """Whole files by namespace path, as one batch (`read_many`)."""

        def attempt() -> list[memoryview]:
            handles = self.handle_many(paths)
            return self.read_many([(handle, 0, handle.size) for handle in handles])

        return self._current(attempt)

    def _current(self, attempt: Callable[[], T]) -> T:
        """Run a read by path; if the source changed and a refresh (maybe in another process)
        switched a mount since this client last read the mount table, run it once more on the
        new generation instead of failing on a remembered handle."""
        seen = self.handles.generations()
        try:
            return attempt()
        except (ObjectChanged, ObjectMissing):
            if self.handles.generations(fresh=True) == seen:
                raise
            return attempt()

    def stat(self, path: str | os.PathLike[str]) -> FileStat:
        return self.namespace.stat(arguments.path(path, "stat"))

    def stat_opened(self, path: str) -> FileStat | None:
        """`stat` of a file this client opened (itself, or its prefetch or warmup), from the
        handle, without a manifest query; None for any other path. As current as the handle:
        a refresh elsewhere shows within MOUNTS_TTL_S (as it does to reads by path), which suits
        the FUSE daemon's getattr, whose answers the kernel keeps for longer anyway."""
        known = self.handles.remembered(path)
        return None if known is None else FileStat(known.path, False, known.listed)

    def ls(self, path: str | os.PathLike[str]) -> list[FileStat]:
        return self.namespace.ls(arguments.path(path, "ls"))

    def walk(self, path: str | os.PathLike[str]) -> Iterator[FileStat]:
        return self.namespace.walk(arguments.path(path, "walk"))

