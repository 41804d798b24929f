"""The pack index: where each member's bytes lie (shard, offset, length), its mtime and sha256,
and each shard's chunk sums (xxh3-64 per 256 KiB), which every block read of a shard is checked
against: a damaged or replaced shard fails its read instead of serving wrong bytes.

Columnar, msgpack-encoded (msgspec): paths are one list of strings, every number column one
little-endian numpy buffer, so a 1,000,000-member index decodes in well under a second and
its columns are numpy views, not a million Python objects. It holds no timestamps of its own:
packing the same input with the same settings writes the same bytes, so a resumed pack can be
compared with an uninterrupted one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np
import xxhash

from gpufeed.blocks import sums_length
from gpufeed.errors import PackError

VERSION = 3
"""2: chunk sums. 3: the index checks itself (SUMMED). Versions 1 and 2 are still read; a
version 1 index's shard blocks are not checked, and neither index is."""
MAGIC = b"GFPACK\x00\x01"
"""What a version 1 or 2 index starts with: the msgpack follows."""
SUMMED = b"GFPACK\x00\x03"
"""What a version 3 index starts with: the xxh3-128 of the msgpack that follows it, then the
msgpack. The chunk sums vouch for the shards' bytes; this vouches for where members lie in them,
so a flipped bit in an offset, a length or a path fails the mount instead of serving another
member's bytes."""


DIGEST = 16
"""Bytes of the xxh3-128 after SUMMED."""


class Index(msgspec.Struct, frozen=True):
    """One pack. `digest` names its input and settings: a pack with the same digest is this one."""

    version: int
    digest: str
    block_size: int
    shards: list[str]
    shard_sizes: list[int]
    paths: list[str]
    shard: bytes
    offset: bytes
    length: bytes
    mtime: bytes
    sha256: bytes
    chunk_sums: bytes = b""
    """Every shard's `blocks.chunk_sums`, in shard order (empty in version 1)."""

    @property
    def shard_of(self) -> np.ndarray:
        return np.frombuffer(self.shard, dtype="<u4")

    @property
    def offsets(self) -> np.ndarray:
        return np.frombuffer(self.offset, dtype="<u8")

    @property
    def lengths(self) -> np.ndarray:
        return np.frombuffer(self.length, dtype="<u8")

    @property
    def mtimes(self) -> np.ndarray:
        return np.frombuffer(self.mtime, dtype="<f8")

    def members(self) -> Iterator[Member]:
        shard_of, offsets, lengths, mtimes = (a.tolist() for a in (self.shard_of, self.offsets, self.lengths, self.mtimes))
        digests = self.sha256
        for n, path in enumerate(self.paths):
            yield Member(
                path, self.shards[shard_of[n]], offsets[n], lengths[n], mtimes[n], digests[32 * n : 32 * n + 32].hex()
            )


@dataclass(frozen=True, slots=True)
class Member:
    """One packed file: its path relative to the packed directory and where its bytes are."""

    path: str
    shard: str
    offset: int
    length: int
    mtime: float
    sha256: str


Row = tuple[str, int, int, int, float, bytes]


def build(digest: str, block_size: int, shards: list[tuple[str, int]], members: list[Row], chunk_sums: bytes) -> Index:
    """An index of `members` (path, shard number, offset, length, mtime, sha256 digest), in
    order, and the shards' chunk sums."""
    return Index(
        VERSION,
        digest,
        block_size,
        [key for key, _ in shards],
        [size for _, size in shards],
        [m[0] for m in members],
        np.array([m[1] for m in members], dtype="<u4").tobytes(),
        np.array([m[2] for m in members], dtype="<u8").tobytes(),
        np.array([m[3] for m in members], dtype="<u8").tobytes(),
        np.array([m[4] for m in members], dtype="<f8").tobytes(),
        b"".join(m[5] for m in members),
        chunk_sums,
    )


def encode(index: Index) -> bytes:
    payload = msgspec.msgpack.encode(index)
    return SUMMED + xxhash.xxh3_128_digest(payload) + payload


def decode(data: bytes | memoryview, where: str) -> Index:
    """The index in `data`, checked column by column; PackError naming `where` when it is not one."""

    def corrupt(why: str) -> PackError:
        return PackError(f"{where}: corrupt pack index ({why}); run 'gpufeed pack' again")

    view = memoryview(data)
    magic = bytes(view[: len(MAGIC)])
    if magic == SUMMED:
        stated, payload = bytes(view[len(SUMMED) : len(SUMMED) + DIGEST]), view[len(SUMMED) + DIGEST :]
        if xxhash.xxh3_128_digest(payload) != stated:
            raise corrupt("its checksum does not match: it was damaged after it was written")
    elif magic == MAGIC:
        payload = view[len(MAGIC) :]
    else:
        raise corrupt("not a gpufeed pack index")
    try:
        index = msgspec.msgpack.decode(payload, type=Index)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise corrupt(str(exc)) from None
    if magic == MAGIC and index.version >= 3:  # a version that carries a checksum, without it
        raise corrupt(f"a version {index.version} index without its checksum")
    if not 1 <= index.version <= VERSION:
        raise PackError(f"{where}: pack index version {index.version}; this gpufeed reads versions 1 to {VERSION}")
    n = len(index.paths)
    widths = {"shard": 4, "offset": 8, "length": 8, "mtime": 8, "sha256": 32}
    for column, width in widths.items():
        if len(getattr(index, column)) != width * n:
            raise corrupt(f"column {column} holds {len(getattr(index, column))} bytes for {n} members")
    if len(index.shard_sizes) != len(index.shards):
        raise corrupt("shard sizes do not match shards")
    summed = sum(map(sums_length, index.shard_sizes)) if index.version >= 2 else 0
    if len(index.chunk_sums) != summed:
        raise corrupt(f"{len(index.chunk_sums)} bytes of chunk sums for shards that need {summed}")
    if n:
        shard_of = index.shard_of
        if int(shard_of.max()) >= len(index.shards):
            raise corrupt("a member names a shard the index does not list")
        ends = index.offsets + index.lengths
        if np.any(ends > np.asarray(index.shard_sizes, dtype="<u8")[shard_of]):
            raise corrupt("a member ends past its shard")
    return index


def digest_of(parts: Iterator[bytes]) -> str:
    """sha256 over length-prefixed parts: what names a plan (its inputs and settings)."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.hexdigest()
