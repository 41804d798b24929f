"""Block naming and the on-disk block format. Pure functions shared by readers and the agent.

A block's name hashes (source identity, object key, object version, block size), so a changed
object can never be served from an old version's blocks. A block file is a small header —
magic, data length, chunk size and one xxh3-64 checksum per 256 KiB chunk — followed by the
data. Per-chunk checksums let a reader verify only the chunks it reads: a 100 KB read checks
100 KB, not the whole 4 MiB block.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from gpufeed.cache.openfiles import OpenBlocks

MAGIC = b"GFB1"
CHUNK = 256 * 1024
_HEAD = struct.Struct("<4sIQII")  # magic, header length, data length, chunk size, chunk count
SUM = struct.Struct("<Q")
HEAD_SIZE = _HEAD.size
SMALL_HEAD = HEAD_SIZE + SUM.size
"""Header length of a block of one chunk."""
MIN_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = 1 << 30


class CorruptBlock(Exception):
    """A block file whose header or checksum does not match; it must be discarded and refetched."""


def object_id(source_id: str, key: str, version: str, block_size: int, checked: bool) -> str:
    """`checked`: whether fetches verify the version at the source. Blocks fetched without the
    check (immutable mounts) may hold a newer version's bytes, so they get names of their own."""
    mark = "" if checked else "\0unchecked"
    return xxhash.xxh3_128_hexdigest(f"{source_id}\0{key}\0{version}\0{block_size}{mark}".encode())


def block_length(object_size: int, block_size: int, index: int) -> int:
    return max(0, min(block_size, object_size - index * block_size))


def object_prefix(dirs: tuple[Path, ...], oid: str) -> str:
    """Path of an object's blocks without the index. Blocks of one object live in one of the
    cache dirs, chosen by the object's hash. A plain string: this is on every hit's path."""
    root = dirs[int(oid[:8], 16) % len(dirs)] if len(dirs) > 1 else dirs[0]
    return f"{root}/blocks/{oid[:2]}/{oid}-"


def block_name(oid: str, index: int) -> str:
    """What the agent's eviction and pins call a block, and hit reports name it by."""
    return f"{oid}-{index}"


def block_path(dirs: tuple[Path, ...], oid: str, index: int) -> Path:
    return Path(f"{object_prefix(dirs, oid)}{index}")


def header_length(data_length: int) -> int:
    return HEAD_SIZE + 8 * chunk_count(data_length)


@functools.lru_cache(maxsize=4096)
def small_header(data_length: int) -> bytes:
    """The fixed part of a one-chunk block's header: a hit compares bytes instead of unpacking."""
    return _HEAD.pack(MAGIC, SMALL_HEAD, data_length, CHUNK, 1)


def chunk_count(data_length: int) -> int:
    return max(1, -(-data_length // CHUNK))


def encode(data: memoryview | bytes) -> tuple[bytes, memoryview]:
    """Header for `data`; the caller writes header then data."""
    view = memoryview(data).cast("B")
    n = chunk_count(len(view))
    sums = [xxhash.xxh3_64_intdigest(view[i * CHUNK : (i + 1) * CHUNK]) for i in range(n)]
    header = _HEAD.pack(MAGIC, header_length(len(view)), len(view), CHUNK, n) + struct.pack(f"<{n}Q", *sums)
    return header, view


def verify(header: memoryview, data_length: int, chunks: memoryview, first_chunk: int) -> None:
    """Check the header against the expected length and `chunks` (starting at chunk
    `first_chunk`, ending on a chunk boundary or at the end of the data) against their sums."""
    if len(header) < HEAD_SIZE:
        raise CorruptBlock("truncated header")
    magic, length, stored_length, chunk, n = _HEAD.unpack_from(header)
    if magic != MAGIC or stored_length != data_length or chunk != CHUNK or length != len(header):
        raise CorruptBlock("header does not match")
    if len(chunks) <= CHUNK:
        if xxhash.xxh3_64_intdigest(chunks) != SUM.unpack_from(header, HEAD_SIZE + 8 * first_chunk)[0]:
            raise CorruptBlock(f"checksum mismatch in chunk {first_chunk}")
        return
    for i in range(0, len(chunks), CHUNK):
        index = first_chunk + i // CHUNK
        if xxhash.xxh3_64_intdigest(chunks[i : i + CHUNK]) != SUM.unpack_from(header, HEAD_SIZE + 8 * index)[0]:
            raise CorruptBlock(f"checksum mismatch in chunk {index}")


@dataclass(frozen=True, slots=True)
class BlockRef:
    """Where one object's blocks live, computed once per open file."""

    oid: str
    prefix: str
    block_size: int
    object_size: int
    verify: bool
    files: OpenBlocks
    """The reading process's open block files of this cache."""
    small_header: bytes | None = None
    """For a verified object of one chunk (every small file): the fixed part of its block's
    header, so a hit compares bytes instead of unpacking (`blockfile.read_one_chunk`)."""
    small_path: str = ""
    """With `small_header`: the path of the object's one block, made once, not on every hit."""
    small_name: str = ""
    """With `small_header`: the name its hits are reported by, `{oid}-0`, made once too."""

    @classmethod
    def of(cls, dirs: tuple[Path, ...], oid: str, block_size: int, object_size: int, verify: bool, files: OpenBlocks) -> BlockRef:
        prefix = object_prefix(dirs, oid)
        if verify and 0 < object_size <= min(CHUNK, block_size):
            small = small_header(object_size), f"{prefix}0", block_name(oid, 0)
            return cls(oid, prefix, block_size, object_size, verify, files, *small)
        return cls(oid, prefix, block_size, object_size, verify, files)

    def path(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def length(self, index: int) -> int:
        return block_length(self.object_size, self.block_size, index)
