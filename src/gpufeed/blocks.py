"""What a block is: its identity, derived in one place, and the header that records it.

An object's bytes are cut into blocks of `block_size`. A block's identity is (source identity,
key, object version, block size, whether fetches check the version, index): every part of
gpufeed that names a block (the client's hits and misses, the agent's fetches, eviction and
pins, warmup, fsspec, the benchmark) derives it through `object_blocks`, so two paths can
never disagree on which bytes a name holds. A changed object has a new version, so new names:
an old version's bytes are never served for it.

A block file is a header, then the data. The header records the block's identity (the object
hash and the index), the data length and one xxh3-64 checksum per 256 KiB chunk. A reader
checks the identity against the name it opened, so a valid block of another object copied
under this name is as damaged as a flipped bit: discarded and fetched again. Per-chunk sums let
a 100 KB read verify 100 KB, not 4 MiB.

The same sums, taken over a whole object, are what a gpufeed pack's index lists for each shard
(`ObjectInfo.sums_id` names them): a block of a multiple of CHUNK starts on a chunk of its object, so
the sums the agent computes to write its header are the ones to compare with the index's, and
a shard's blocks are checked one by one, in the same pass, as they arrive.
"""

from __future__ import annotations

import functools
import itertools
import struct
from dataclasses import dataclass

import xxhash

from gpufeed.errors import ObjectCorrupted
from gpufeed.sources.base import ObjectInfo

MAGIC = b"GFB2"
CHUNK = 256 * 1024
_HEAD = struct.Struct("<4sIQII16sI")  # magic, header length, data length, chunk size, chunk count, object, index
SUM = struct.Struct("<Q")
HEAD_SIZE = _HEAD.size
SMALL_HEAD = HEAD_SIZE + SUM.size
"""Header length of a block of one chunk."""
MIN_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = 1 << 30
WHOLE_OBJECT_MAX = 1 << 30
"""Largest object with a content hash that is only ever read whole, so its bytes are checked
against the hash before any of them is cached or returned; a larger one is checked by length
and version only (README, "What gpufeed checks")."""


class CorruptBlock(Exception):
    """A block file whose header, identity or checksum does not match; it must be discarded and refetched."""


class ChunkMismatch(Exception):
    """Fetched bytes whose chunk sums are not the ones the object's listing vouches for: never published."""

    def __init__(self, chunk: int, got: int, listed: int) -> None:
        super().__init__(f"chunk {chunk}")
        self.chunk, self.got, self.listed = chunk, got, listed


def block_length(object_size: int, block_size: int, index: int) -> int:
    return max(0, min(block_size, object_size - index * block_size))


def chunk_count(data_length: int) -> int:
    return max(1, -(-data_length // CHUNK))


def header_length(data_length: int) -> int:
    return HEAD_SIZE + SUM.size * chunk_count(data_length)


@dataclass(frozen=True, slots=True)
class BlockId:
    """One block: `oid` names its object at one version and block size, `index` the block."""

    oid: str
    index: int

    @property
    def name(self) -> str:
        """What the agent's index, eviction, pins and hit reports call the block (and its file)."""
        return f"{self.oid}-{self.index}"

    @classmethod
    def parse(cls, name: str) -> BlockId:
        oid, _, index = name.rpartition("-")
        return cls(oid, int(index))

    def fixed_header(self, data_length: int) -> bytes:
        """The header up to the checksums: what a block file of this identity and length must start with."""
        return _HEAD.pack(MAGIC, header_length(data_length), data_length, CHUNK, chunk_count(data_length),
                          bytes.fromhex(self.oid), self.index)


@dataclass(frozen=True, slots=True)
class ObjectBlocks:
    """The blocks of one object version: the only place a block's identity is derived."""

    oid: str
    size: int
    block_size: int

    @property
    def count(self) -> int:
        return -(-self.size // self.block_size)

    def block(self, index: int) -> BlockId:
        return BlockId(self.oid, index)

    def length(self, index: int) -> int:
        return block_length(self.size, self.block_size, index)

    def span(self, start: int, end: int) -> range:
        """Indexes of the blocks that bytes [start, end) lie in."""
        end = min(end, self.size)
        return range(start // self.block_size, (end - 1) // self.block_size + 1) if end > start else range(0)


def overlap(block_size: int, index: int, lo: int, hi: int) -> int:
    """Bytes of [lo, hi) in block `index`."""
    return max(0, min(hi, (index + 1) * block_size) - max(lo, index * block_size))


def source_identity(url: str, options: dict[str, str]) -> str:
    """What names a source in block identities: its URL and, for S3-compatible stores, the endpoint."""
    return f"{url}|{options.get('endpoint', '')}"


def object_blocks(url: str, options: dict[str, str], info: ObjectInfo, block_size: int, checked: bool) -> ObjectBlocks:
    """The blocks of `info`'s version of an object of the source at `url` with source `options`.
    `checked`: whether fetches verify the version at the source; blocks fetched without the
    check (immutable mounts) may hold a newer version's bytes, so they get names of their own.
    Blocks of an object the manifest holds a content hash for are cached only after the whole
    object matched it, so they too get names of their own: a block cached unchecked (by a mount
    without the hash) is never served as a checked one. The hash names those bytes exactly, so it
    stands for the version: an object written through gpufeed keeps its blocks' names when its
    upload adds the store's ETag to the manifest. Chunk sums (a pack's shard) name the bytes the
    same way, when the blocks are cut where chunks start (`sums_checked`)."""
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block size {block_size} is outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
    mark = "" if checked else "\0unchecked"
    if info.content_hash:
        bytes_named = f"#{info.content_hash}"
    elif sums_checked(info, block_size):
        bytes_named = f"#chunks:{info.sums_id}"
    else:
        bytes_named = info.version
    identity = f"{source_identity(url, options)}\0{info.key}\0{bytes_named}\0{block_size}{mark}"
    return ObjectBlocks(xxhash.xxh3_128_hexdigest(identity.encode()), info.size, block_size)


@functools.lru_cache(maxsize=65536)
def expected_header(oid: str, index: int, length: int) -> bytes:
    """`BlockId(oid, index).fixed_header(length)`, remembered: every hit of a multi-chunk block
    compares its header with it, and building it costs more than the lookup."""
    return BlockId(oid, index).fixed_header(length)


def chunk_sums(data: memoryview | bytes) -> bytes:
    """xxh3-64 of each CHUNK of `data` (the last one short), little-endian: a block header's
    sums, and a pack index's for a shard."""
    view = memoryview(data).cast("B")
    n = -(-len(view) // CHUNK)
    return struct.pack(f"<{n}Q", *(xxhash.xxh3_64_intdigest(view[i * CHUNK : (i + 1) * CHUNK]) for i in range(n)))


def sums_length(size: int) -> int:
    """Bytes of the chunk sums of an object of `size` bytes."""
    return SUM.size * -(-size // CHUNK)


def sums_id(sums: bytes | memoryview) -> str:
    """What names a shard's listed chunk sums (`ObjectInfo.sums_id`)."""
    return xxhash.xxh3_128_hexdigest(sums)


def sums_checked(info: ObjectInfo, block_size: int) -> bool:
    """Whether the object's blocks of `block_size` are checked against its listed chunk sums:
    only blocks cut where chunks start are (the default 4 MiB is 16 chunks), and only where no
    content hash checks the whole object instead (it names the blocks, and is the stronger check)."""
    return info.sums_id is not None and not info.content_hash and block_size % CHUNK == 0


def listed_sums(sums: bytes | memoryview, start: int, length: int) -> bytes:
    """Of an object's listed sums, those of the chunks of bytes [start, start + length), `start` on a chunk."""
    first = start // CHUNK
    return bytes(sums[SUM.size * first : SUM.size * (first + chunk_count(length))])


def chunk_span(size: int, start: int, end: int) -> tuple[int, int]:
    """[start, end) of an object of `size` bytes widened to whole chunks: the least a read
    straight from the store can check against listed chunk sums."""
    return start - start % CHUNK, min(size, -(-end // CHUNK) * CHUNK)


def mismatch(info: ObjectInfo, start: int, exc: ChunkMismatch) -> ObjectCorrupted:
    """The one line a chunk of `info` that kept failing its listed sum ends a read with."""
    at = start + exc.chunk * CHUNK
    return ObjectCorrupted(
        f"{info.key}: bytes [{at}, {min(at + CHUNK, info.size)}) hash to xxh3:{exc.got:016x}, its pack index "
        f"lists xxh3:{exc.listed:016x} (the shard was damaged or replaced since it was packed)"
    )


def compare_sums(got: bytes, listed: bytes) -> None:
    """Raise ChunkMismatch at the first chunk whose sum in `got` differs from `listed`."""
    if got == listed:
        return
    ours, theirs = (struct.unpack(f"<{len(sums) // SUM.size}Q", sums) for sums in (got, listed))
    for chunk, (a, b) in enumerate(itertools.zip_longest(ours, theirs, fillvalue=0)):
        if a != b:
            raise ChunkMismatch(chunk, a, b)


def check_chunks(sums: bytes | memoryview, start: int, data: memoryview | bytes) -> None:
    """Check bytes read from `start` (`chunk_span`'s) against the object's listed chunk sums;
    ChunkMismatch at the first chunk that differs."""
    compare_sums(chunk_sums(data), listed_sums(sums, start, len(data)))


def encode(block: BlockId, data: memoryview | bytes, listed: bytes | None = None) -> tuple[bytes, memoryview]:
    """Header for `data` as block `block`; the caller writes header then data. With `listed`
    (the object's listed sums of the block's chunks), data whose sums differ raises ChunkMismatch."""
    view = memoryview(data).cast("B")
    sums = chunk_sums(view) or SUM.pack(xxhash.xxh3_64_intdigest(b""))  # an empty block has one (empty) chunk
    if listed is not None:
        compare_sums(sums, listed)
    return block.fixed_header(len(view)) + sums, view


def verify(header: memoryview, expected: bytes, chunks: memoryview, first_chunk: int) -> None:
    """Check the header against `expected` (`BlockId.fixed_header`) and `chunks` (starting at chunk
    `first_chunk`, ending on a chunk boundary or at the end of the data) against their sums."""
    if header[:HEAD_SIZE] != expected:
        raise CorruptBlock("header does not match the block's identity or length")
    for i in range(0, max(len(chunks), 1), CHUNK):
        index = first_chunk + i // CHUNK
        if xxhash.xxh3_64_intdigest(chunks[i : i + CHUNK]) != SUM.unpack_from(header, HEAD_SIZE + SUM.size * index)[0]:
            raise CorruptBlock(f"checksum mismatch in chunk {index}")
