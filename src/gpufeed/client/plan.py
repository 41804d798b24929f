"""Pure planning of reads: which block pieces a byte range needs, whether a batch is sparse,
and how pieces join. No I/O, so every rule here is tested on numbers alone."""

from __future__ import annotations

from collections.abc import Sequence

from gpufeed.blocks import ObjectBlocks

SPARSE_FACTOR = 4
"""A batch of reads missing several blocks that hold at least this many times the bytes it wants
(random samples from big record files: 100 KB from each of 50 different 4 MiB blocks) reads
those bytes from the source, all at once, and leaves the blocks to the agent: waiting for
the blocks would move the whole 200 MB first."""


def pieces(blocks: ObjectBlocks, start: int, end: int) -> list[tuple[int, int, int]]:
    """(block index, start, end) in object offsets for each block that bytes [start, end) touch,
    clipped to the object."""
    end = min(end, blocks.size)
    size = blocks.block_size
    return [(index, max(start, index * size), min(end, (index + 1) * size)) for index in blocks.span(start, end)]


def is_sparse(missing_blocks: int, block_bytes: int, wanted_bytes: int) -> bool:
    """Whether a batch should read its bytes around the blocks it misses instead of waiting for them."""
    return missing_blocks >= 2 and block_bytes >= SPARSE_FACTOR * wanted_bytes


def join(parts: Sequence[memoryview]) -> memoryview:
    """One view of consecutive pieces; a single piece is handed out as it is, without a copy,
    and several are copied once into a bytes of their own (which `as_bytes` hands out as it is)."""
    if len(parts) == 1:
        return parts[0]
    return memoryview(b"".join(parts))
