"""Namespace paths to handles: an object pinned at the version its mount's manifest lists, and
where its blocks live in the node cache. What an open finds is remembered while its mount's
generation is current, so a read by path costs no manifest lookup."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gpufeed.blocks import object_blocks
from gpufeed.cache import openfiles
from gpufeed.cache.layout import BlockRef
from gpufeed.cache.openfiles import OpenBlocks
from gpufeed.client.connection import AgentClient, AgentUnavailable
from gpufeed.client.hit_reports import HitReporter, Tally
from gpufeed.meta import Mount
from gpufeed.mount_options import CachePolicy, is_writable, source_options
from gpufeed.namespace import Namespace
from gpufeed.paths import Resolved
from gpufeed.sources import ObjectInfo, Source

_K = TypeVar("_K")
_V = TypeVar("_V")

HANDLE_CACHE = 65536
"""Handles a client remembers (a few hundred bytes each)."""
CONTAINER_CACHE = 16384
"""Pack shards a client remembers the pinned version and blocks of."""


@dataclass(frozen=True, slots=True)
class ObjectHandle:
    """One object at one version: every read through a handle sees the same bytes.
    `blocks` is None when the mount does not cache (or no agent could be had).

    A pack member (a file stored as a range of a shard) is a window of its shard: `info` and
    `blocks` are the shard's, `member` is the file as listed, and the public reads translate
    the file's offsets to the shard's (`extent`), so everything below reads, caches and
    prefetches shard blocks."""

    path: str
    mount: Mount
    source: Source
    info: ObjectInfo
    """The object read from the store: the file, or the shard a pack member lies in."""
    tally: Tally
    """Its mount's hits and stalls in this process, reported to the agent with the hits."""
    blocks: BlockRef | None = None
    member: ObjectInfo | None = None
    chunk_sums: memoryview | None = None
    """The chunk sums the pack index lists for the shard (`info.sums_id` names them): what the
    agent checks its blocks against (sent per block, `ObjectWant.sums`) and reads straight
    from the store are checked against here."""

    @property
    def size(self) -> int:
        """The size of the file the path names."""
        return self.info.size if self.member is None else self.member.size

    @property
    def uploading(self) -> bool:
        """Whether this is a write of this node the manifest lists with its hash and no store
        version yet (`agent.writer`): its upload may not have landed, so only the agent, which
        holds the staged bytes, can read what the cache does not keep."""
        info = self.info
        return info.etag is None and info.content_hash is not None and self.member is None and is_writable(self.mount)

    @property
    def listed(self) -> ObjectInfo:
        """The file as the manifest lists it (its own size, mtime and content hash)."""
        return self.info if self.member is None else self.member

    def extent(self, start: int, end: int) -> tuple[int, int]:
        """Bytes [start, end) of the file as offsets in the object read: unchanged for a file
        of its own, clipped to the member and moved to its place in the shard for a member."""
        member = self.member
        if member is None:
            return start, end
        base = member.pack_offset or 0
        start = min(start, member.size)
        return base + start, base + max(start, min(end, member.size))


def _rememberable(mount: Mount, policy: CachePolicy, info: ObjectInfo, blocks: BlockRef | None) -> bool:
    """Whether what an open found stays true for the mount's generation: not on mounts that
    revalidate on open (--max-age) or are written (an entry changes, not the generation), nor
    while the cache that should hold the blocks is unknown."""
    return mount.max_age is None and not is_writable(mount) and (blocks is not None or not policy.enabled or info.size == 0)


class Handles:
    """A client's opens: path → handle, with bounded memories of handles and of pack shards."""

    def __init__(self, namespace: Namespace, agent: AgentClient, hits: HitReporter, warn: Callable[[str, str], None]) -> None:
        self.namespace = namespace
        self.settings = namespace.settings
        self.agent = agent
        self.hits = hits
        self._warn = warn
        self._lock = threading.Lock()
        """Guards evictions from the bounded memories (lookups need no lock)."""
        self._handles: dict[str, ObjectHandle] = {}
        self._containers: dict[tuple[str, int, str], tuple[ObjectInfo, BlockRef | None, memoryview | None]] = {}
        self._mounts_seen: list[Mount] | None = None
        self._generation_of: dict[str, int] = {}
        self._files: OpenBlocks | None = None
        """The block files this process holds open between hits, once it knows the cache."""

    def get(self, path: str) -> ObjectHandle:
        """The object at `path` (see `Client.handle`)."""
        known = self.remembered(path)
        return known if known is not None else self._handle(path, *self.namespace.open_object(path))

    def remembered(self, path: str) -> ObjectHandle | None:
        """The handle an earlier open of `path` left, while its mount's generation is current."""
        known = self._handles.get(path)
        if known is not None and self.generations().get(known.mount.path) == known.mount.generation:
            return known
        return None

    def get_many(self, paths: Sequence[str]) -> list[ObjectHandle]:
        """`get` of each path; the ones not remembered are looked up together
        (`Namespace.open_objects`: a manifest query per directory, not per file)."""
        found = [self.remembered(path) for path in paths]
        missing = [n for n, handle in enumerate(found) if handle is None]
        if missing:
            for n, opened in zip(missing, self.namespace.open_objects([paths[n] for n in missing]), strict=True):
                found[n] = self._handle(paths[n], *opened)
        return found  # type: ignore[return-value]

    def _handle(self, path: str, where: Resolved, source: Source, info: ObjectInfo) -> ObjectHandle:
        """The handle of an object just opened, remembered where that stays true."""
        mount = where.mount
        policy = CachePolicy.of(mount, self.settings)
        member = sums = None
        if info.pack_key is not None:
            member, (info, blocks, sums) = info, self._container(where, info, policy)
        else:
            blocks = self._blocks(mount, info, policy)
        path = f"{mount.path}/{where.key}"
        handle = ObjectHandle(path, mount, source, info, self.hits.tally(mount.path), blocks, member, sums)
        if _rememberable(mount, policy, info, blocks):
            self._remember(self._handles, path, handle, HANDLE_CACHE)
        return handle

    def generations(self, *, fresh: bool = False) -> dict[str, int]:
        """Mount path → its current generation, as the namespace's mount table sees it."""
        mounts = self.namespace.mounts(fresh=fresh)
        if mounts is not self._mounts_seen:
            self._mounts_seen, self._generation_of = mounts, {m.path: m.generation for m in mounts}
        return self._generation_of

    def forget(self, path: str) -> None:
        with self._lock:
            self._handles.pop(path, None)

    def _remember(self, memory: dict[_K, _V], key: _K, value: _V, limit: int) -> None:
        """Keep `value` in one of the bounded memories, the oldest entry dropped when it is full."""
        with self._lock:
            if len(memory) >= limit:
                del memory[next(iter(memory))]
            memory[key] = value

    def _cache(self) -> tuple[tuple[Path, ...], OpenBlocks] | None:
        """The node cache's dirs and this process's open block files; None without an agent."""
        try:
            dirs, no_agent = self.agent.readable_dirs()
        except AgentUnavailable as exc:
            self._warn("agent", f"{exc}; reading without the cache")
            return None
        if no_agent is not None:
            self._warn("agent", f"{no_agent}; reading the blocks cached in {dirs[0]} without it, the rest from the store")
        if self._files is None:
            self._files = openfiles.for_cache(dirs[0], self.settings.open_blocks)
            self.hits.every_check = self._files.check
        return dirs, self._files

    def _blocks(self, mount: Mount, info: ObjectInfo, policy: CachePolicy) -> BlockRef | None:
        """Where the object's blocks live in the node cache; None when it is not cached."""
        if not policy.enabled or info.size <= 0 or (cache := self._cache()) is None:
            return None
        identity = object_blocks(mount.url, source_options(mount), info, policy.block_size, not mount.immutable)
        return BlockRef.of(cache[0], identity, policy.verify, cache[1])

    def _container(
        self, where: Resolved, member: ObjectInfo, policy: CachePolicy
    ) -> tuple[ObjectInfo, BlockRef | None, memoryview | None]:
        """A pack member's shard, as its mount's manifest pins it, its blocks and its listed chunk
        sums: looked up once per shard and mount generation, not once per member (a DataLoader
        worker that starts each epoch opens every member it reads, some 37 to a 4 MiB block of a shard)."""
        assert member.pack_key is not None
        mount = where.mount
        key = (mount.path, mount.generation, member.pack_key)
        known = self._containers.get(key)
        if known is None:
            info = self.namespace.container(where, member)
            sums = self.namespace.shard_sums(mount, member.pack_key) if info.sums_id else None
            known = (info, self._blocks(mount, info, policy), sums)
            if _rememberable(mount, policy, info, known[1]):
                self._remember(self._containers, key, known, CONTAINER_CACHE)
        return known
