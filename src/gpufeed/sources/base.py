"""The one small protocol every store implements: list, head, ranged get, and put for writers (pack)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpufeed.errors import InvalidArgument

_obstore_pid: int | None = None
"""The process that made this process's first obstore store, inherited across forks."""


def obstore_started() -> None:
    """Record that this process made an obstore store, whose runtime then runs in it."""
    global _obstore_pid
    if _obstore_pid is None:
        _obstore_pid = os.getpid()


def obstore_unusable() -> bool:
    """Whether this process was forked from one that used obstore: its runtime does not survive
    a fork, and a network call made here would never complete (measured with obstore 0.12, sync
    and async alike)."""
    return _obstore_pid is not None and _obstore_pid != os.getpid()


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """An object as the source reports it. `key` is relative to the source root, '/'-separated.

    `mtime` is seconds since the epoch (0.0 when the store does not say). `etag` is None when
    the store has none; then the version is derived from mtime and size. `content_hash` is a
    hash of the whole object the manifest vouches for (`"sha256:<hex>"`, `"md5:<hex>"`), from
    a checksums file or `gpufeed verify`; None when nothing but the store vouches for it.
    `pack_key`, `pack_offset`, `pack_length`: where the object's bytes lie inside a pack
    object of the same store (None when the object is stored on its own). `sums_id` names the
    chunk sums (xxh3-64 of each 256 KiB, `blocks.chunk_sums`) a gpufeed pack's index lists for
    one of its shards: their xxh3-128, which names the bytes as a content hash does. The sums
    themselves stay with the reader's handle, and a request carries those of the blocks it asks
    for (`ObjectWant.sums`); None when nothing lists them.
    """

    key: str
    size: int
    mtime: float
    etag: str | None = None
    content_hash: str | None = None
    pack_key: str | None = None
    pack_offset: int | None = None
    pack_length: int | None = None
    sums_id: str | None = None

    @property
    def version(self) -> str:
        return version_string(self.size, self.mtime, self.etag)


def same_version(a: ObjectInfo, b: ObjectInfo) -> bool:
    """Whether two records of one key describe the same bytes, as far as they can tell. One
    listed without a version (an HTTP `KEY SIZE` line) matches on size alone; one with only a
    modification time (an HTTP index listing) against one with an ETag too (a HEAD) compares
    the modification times."""
    if a.size != b.size:
        return False
    if not (a.etag or a.mtime > 0) or not (b.etag or b.mtime > 0):
        return True
    if a.etag and b.etag:
        return a.etag == b.etag
    return a.mtime == b.mtime


def version_string(size: int, mtime: float, etag: str | None) -> str:
    """The ETag when the store has one, else modification time (µs) and size."""
    return etag or f"{int(mtime * 1e6):x}-{size:x}"


class Source(Protocol):
    """A store rooted at one URL. Implementations raise `gpufeed.errors.SourceError` subclasses."""

    url: str
    """Canonical URL of the root; with the endpoint it identifies the source (cache keys)."""

    options: dict[str, str]
    """Options that rebuild this source in any process: what the environment supplied when it
    was built (an endpoint, a profile) is written out, and paths are absolute, so the agent and
    every client reach the same store."""

    local: bool
    """A directory on this machine: a synchronous read is a page-cache read, cheaper in the
    caller's thread than handed to another thread or kept in flight."""

    def list(self) -> Iterator[list[ObjectInfo]]:
        """Every object under the root, in batches, streamed so memory stays bounded; a listing
        that breaks off is resumed and retried, never repeating or dropping an object."""
        ...

    def head(self, key: str) -> ObjectInfo:
        """The object as the store reports it now; retried like every store call."""
        ...

    def get_range(
        self, key: str, start: int, end: int, expect: ObjectInfo | None = None, *, conditional: bool = True
    ) -> memoryview:
        """Bytes [start, end) of `key`, retried until they pass every check the source can make.

        `expect` is what the caller knows of the object (size, etag, content_hash): a read of the
        whole object is checked against its `content_hash` (and, on S3, against a plain MD5 ETag);
        a persistent mismatch raises ObjectCorrupted. A range of an object cannot be checked
        against a hash of the whole; only its length is. With `conditional` (the default) and an
        `expect`, the read is also pinned to that version: ObjectChanged unless the object still
        has it, so bytes of two versions never mix; immutable mounts pass `conditional=False`.
        """
        ...

    async def get_range_async(
        self, key: str, start: int, end: int, expect: ObjectInfo | None = None, *, conditional: bool = True
    ) -> memoryview:
        """`get_range` for the agent's event loop; the I/O runs without the GIL."""
        ...

    def put(self, key: str, data: bytes | bytearray | memoryview) -> ObjectInfo:
        """Write one whole object atomically (readers see the old object or the new one, never
        a part) and return it as the store now reports it; SourceError when the store refuses."""
        ...

    def delete(self, keys: Sequence[str]) -> None:
        """Delete objects; one already gone is no error; SourceError when the store refuses."""
        ...


def parse_bool(name: str, raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise InvalidArgument(f"option {name}={raw!r}: expected true or false")
