"""The read path: namespace path → (mount, key, pinned version) → blocks → cache hit or agent fetch.

Every reader (Python API, CLI, fsspec, and later PyTorch datasets, FUSE, warmup, the
benchmark) fetches bytes through `Client.read_range`. A hit is an open+pread of a published
block file in this process, with no round trip; misses go to the node agent in one batched
request; when the agent cannot cache (disk full, no agent) the bytes come from the source.
"""

from __future__ import annotations

import io
import logging
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

from gpufeed.agent.client import AgentClient, AgentUnavailable, HitReporter
from gpufeed.agent.protocol import error_from
from gpufeed.cache import blockfile
from gpufeed.cache.layout import BlockRef, CorruptBlock, object_id
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument, ObjectChanged, ObjectMissing
from gpufeed.meta import Mount
from gpufeed.namespace import CachePolicy, FileStat, Namespace, source_identity, source_options
from gpufeed.sources import ObjectInfo, Source
from gpufeed.sources.stores import caller_credentials

log = logging.getLogger("gpufeed")

WARM_BATCH = 1024



@dataclass(frozen=True, slots=True)
class ObjectHandle:
    """One object at one version: every read through a handle sees the same bytes.
    `blocks` is None when the mount does not cache (or no agent could be had)."""

    path: str
    mount: Mount
    source: Source
    info: ObjectInfo
    blocks: BlockRef | None = None

    @property
    def size(self) -> int:
        return self.info.size


class Client:
    def __init__(self, settings: Settings | None = None, namespace: Namespace | None = None) -> None:
        self.namespace = namespace or Namespace(settings)
        self.settings = self.namespace.settings
        self.agent = AgentClient(self.settings)
        self.source_bytes = 0
        """Bytes this client caused to be read from sources: its direct reads and the blocks
        the agent fetched for it (a block another process had already asked for is not counted)."""
        self.hits = HitReporter(self.agent)
        weakref.finalize(self, self.hits.flush)
        self._warned: set[str] = set()

    def close(self) -> None:
        self.hits.flush()
        self.agent.close()
        self.namespace.close()

    def _warn_once(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            log.warning("gpufeed: warning: %s", message)

    def _cache_dirs(self) -> tuple | None:
        try:
            return self.agent.dirs
        except AgentUnavailable as exc:
            self._warn_once("agent", f"{exc}; reading without the cache")
            return None

    def handle(self, path: str) -> ObjectHandle:
        where, source, info = self.namespace.open_object(path)
        mount = where.mount
        policy = CachePolicy.of(mount, self.settings)
        blocks = None
        if policy.enabled and info.size > 0 and (dirs := self._cache_dirs()) is not None:
            oid = object_id(source_identity(mount.url, mount.options), info.key, info.version, policy.block_size, not mount.immutable)
            blocks = BlockRef.of(dirs, oid, policy.block_size, info.size, policy.verify)
        return ObjectHandle(f"{mount.path}/{where.key}", mount, source, info, blocks)

    def _explain(self, handle: ObjectHandle, exc: Exception) -> Exception:
        """Name the namespace path and the way out in a source error about one object."""
        if isinstance(exc, (ObjectMissing, ObjectChanged)):
            what = "deleted" if isinstance(exc, ObjectMissing) else "changed"
            return type(exc)(
                f"{handle.path}: {what} at the source since mount {handle.mount.path} was listed "
                f"({exc}); run 'gpufeed mount refresh {handle.mount.path}'"
            )
        return exc

    def _direct(self, handle: ObjectHandle, start: int, end: int) -> memoryview:
        if end <= start:
            return memoryview(b"")
        expect = None if handle.mount.immutable else handle.info
        try:
            data = handle.source.get_range(handle.info.key, start, end, expect)
        except (ObjectMissing, ObjectChanged) as exc:
            raise self._explain(handle, exc) from exc
        self.source_bytes += len(data)
        return data

    def read_range(self, handle: ObjectHandle, start: int, end: int) -> memoryview:
        """Bytes [start, end) of the pinned version, clipped to the object's size."""
        ref = handle.blocks
        if ref is None:
            return self._direct(handle, start, min(end, handle.info.size))
        if end > ref.object_size:
            end = ref.object_size
        if end <= start:
            return memoryview(b"")
        size = ref.block_size
        first = start // size
        if (end - 1) // size == first:  # the common case, a hit inside one block: no lists, no dicts
            base = first * size
            try:
                data = blockfile.read(ref, first, start - base, end - base)
            except (FileNotFoundError, CorruptBlock):
                return self._read_blocks(handle, ref, start, end, first, first)
            self.hits.record(ref.oid, first)
            return data
        return self._read_blocks(handle, ref, start, end, first, (end - 1) // size)

    def _read_blocks(self, handle: ObjectHandle, ref: BlockRef, start: int, end: int, first: int, last: int) -> memoryview:
        size = ref.block_size
        pieces: dict[int, memoryview] = {}
        missing: list[int] = []
        repair: list[int] = []
        for index in range(first, last + 1):
            lo, hi = max(start, index * size) - index * size, min(end, (index + 1) * size) - index * size
            try:
                pieces[index] = blockfile.read(ref, index, lo, hi)
            except FileNotFoundError:
                missing.append(index)
            except CorruptBlock:
                missing.append(index)
                repair.append(index)
        for index in pieces:
            self.hits.record(ref.oid, index)
        if missing:
            uncached = self._fetch(handle, missing, repair)
            for index in missing:
                lo, hi = max(start, index * size) - index * size, min(end, (index + 1) * size) - index * size
                if index not in uncached:
                    try:
                        pieces[index] = blockfile.read(ref, index, lo, hi)
                        continue
                    except (FileNotFoundError, CorruptBlock):
                        pass  # evicted already (quota smaller than the working set): read through
                pieces[index] = self._direct(handle, index * size + lo, index * size + hi)
        if first == last:
            return pieces[first]
        out = bytearray(end - start)
        position = 0
        for index in range(first, last + 1):
            piece = pieces[index]
            out[position : position + len(piece)] = piece
            position += len(piece)
        return memoryview(out)

    @staticmethod
    def _groups(wanted: list[tuple[ObjectHandle, list[int], list[int]]]) -> list[dict]:
        """Agent request groups: per source, the objects and which of their blocks to fetch
        (and which to repair). Objects keep their order across groups."""
        groups: dict[tuple[str, str], dict] = {}
        for handle, blocks, repair in wanted:
            info, mount = handle.info, handle.mount
            assert handle.blocks is not None
            options = source_options(mount)
            group = groups.setdefault(
                (mount.url, repr(sorted(options.items()))),
                {"source": {"url": mount.url, "options": {**options, **caller_credentials(mount.url, options)}}, "objects": []},
            )
            group["objects"].append(
                {
                    "key": info.key,
                    "size": info.size,
                    "mtime": info.mtime,
                    "etag": info.etag,
                    "check": not mount.immutable,
                    "block_size": handle.blocks.block_size,
                    "blocks": blocks,
                    "repair": repair,
                }
            )
        return list(groups.values())

    def prefetch(self, wanted: list[tuple[ObjectHandle, list[int]]], session: str) -> dict:
        """Ask the agent to fetch these blocks soon, for prefetch `session`; returns at once.
        Raises AgentUnavailable; see gpufeed.prefetch for the window that calls this."""
        groups = self._groups([(handle, blocks, []) for handle, blocks in wanted if handle.blocks is not None])
        return self.agent.request({"op": "prefetch", "session": session, "groups": groups})

    def cancel_prefetch(self, session: str) -> None:
        try:
            self.agent.request({"op": "cancel", "session": session}, start=False)
        except AgentUnavailable:
            pass  # no agent, nothing queued

    def _fetch(self, handle: ObjectHandle, blocks: list[int], repair: list[int]) -> set[int]:
        """Ask the agent to publish `blocks`; returns those it could not cache."""
        message = {"op": "fetch", "groups": self._groups([(handle, blocks, repair)])}
        try:
            reply = self.agent.request(message)
        except AgentUnavailable as exc:
            self._warn_once("agent", f"{exc}; reading without the cache")
            return set(blocks)
        self.source_bytes += reply.get("fetched", 0)
        if reply.get("errors"):
            raise self._explain(handle, error_from(reply["errors"][0]))
        uncached = {index for _, index in reply.get("uncached", ())}
        if uncached:
            self._warn_once("uncached", f"the cache in {self.agent.primary} cannot hold more blocks; reading uncached")
        return uncached

    def warm(self, handle: ObjectHandle) -> int:
        """Make every block of `handle` present in the node cache without reading it (one
        agent request per WARM_BATCH missing blocks); returns the bytes that were cached already."""
        ref = handle.blocks
        if ref is None:
            return 0
        count = -(-handle.size // ref.block_size)
        missing = [i for i in range(count) if not os.path.exists(ref.path(i))]
        for first in range(0, len(missing), WARM_BATCH):
            self._fetch(handle, missing[first : first + WARM_BATCH], [])
        return handle.size - sum(ref.length(i) for i in missing)

    def cached_bytes(self, path: str) -> Iterator[tuple[FileStat, int]]:
        """(file, bytes of it present in the cache) for every file under `path`; reads no data."""
        dirs = self.agent.dirs
        for item in self.namespace.walk(path):
            where = self.namespace.resolve(item.path)
            assert where is not None and item.version is not None
            policy = CachePolicy.of(where.mount, self.settings)
            if not policy.enabled:
                yield item, 0
                continue
            identity = source_identity(where.mount.url, where.mount.options)
            oid = object_id(identity, where.key, item.version, policy.block_size, not where.mount.immutable)
            ref = BlockRef.of(dirs, oid, policy.block_size, item.size, False)
            count = -(-item.size // policy.block_size)
            yield item, sum(ref.length(i) for i in range(count) if os.path.exists(ref.path(i)))

    def open(self, path: str) -> FeedFile:
        return FeedFile(self, self.handle(path))

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if offset < 0 or (length is not None and length < 0):
            raise InvalidArgument(f"{path}: offset and length must be >= 0")
        handle = self.handle(path)
        end = handle.size if length is None else offset + length
        return bytes(self.read_range(handle, offset, end))

    def stat(self, path: str) -> FileStat:
        return self.namespace.stat(path)

    def ls(self, path: str) -> list[FileStat]:
        return self.namespace.ls(path)

    def walk(self, path: str) -> Iterator[FileStat]:
        return self.namespace.walk(path)


class FeedFile(io.RawIOBase):
    """A read-only binary file over one object version. `read()` with no size fetches the rest
    in one request; `readinto` fills the caller's buffer without an intermediate bytes object."""

    def __init__(self, client: Client, handle: ObjectHandle) -> None:
        super().__init__()
        self._client = client
        self._handle = handle
        self._pos = 0
        self.name = handle.path

    @property
    def size(self) -> int:
        return self._handle.size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        self._checkClosed()
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._checkClosed()
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence}")
        if base + offset < 0:
            raise ValueError(f"{self.name}: negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        self._checkClosed()
        target = memoryview(buffer).cast("B")
        data = self._client.read_range(self._handle, self._pos, self._pos + len(target))
        target[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        self._checkClosed()
        end = self.size if size is None or size < 0 else self._pos + size
        data = self._client.read_range(self._handle, self._pos, end)
        self._pos += len(data)
        return bytes(data)

    def readall(self) -> bytes:
        return self.read()
