"""Where blocks live on disk, and what a reader knows of one object's blocks.

Blocks of one object live in one of the cache dirs, chosen by the object's hash, as
`<dir>/blocks/<oid[:2]>/<oid>-<index>`. What a block is and its header: `gpufeed.blocks`.
Writes wait for their upload in the primary dir's `staging/` (`agent.writer`).
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from gpufeed.blocks import CHUNK, BlockId, ObjectBlocks
from gpufeed.cache.openfiles import OpenBlocks

WRITER_FILE = re.compile(r"tmp-(\d+)-[0-9a-f]{16}")
"""What a writer names the staging file it fills: its pid (a dead writer's file is removed) and a random part."""


def staging_dir(primary: Path) -> Path:
    return primary / "staging"


def writer_file(primary: Path) -> Path:
    """A new staging file for a writer of this process to fill (`Commit` hands it to the agent)."""
    return staging_dir(primary) / f"tmp-{os.getpid()}-{secrets.token_hex(8)}"


def object_prefix(dirs: tuple[Path, ...], oid: str) -> str:
    """Path of an object's blocks without the index. A plain string: this is on every hit's path."""
    root = dirs[int(oid[:8], 16) % len(dirs)] if len(dirs) > 1 else dirs[0]
    return f"{root}/blocks/{oid[:2]}/{oid}-"


def block_path(dirs: tuple[Path, ...], block: BlockId) -> str:
    return f"{object_prefix(dirs, block.oid)}{block.index}"


@dataclass(frozen=True, slots=True)
class BlockRef:
    """Where one object's blocks live and how they are read, computed once per open file. The
    fields copied out of `blocks` are read on every hit: plain attributes cost less than properties."""

    blocks: ObjectBlocks
    prefix: str
    verify: bool
    files: OpenBlocks
    """The reading process's open block files of this cache."""
    oid: str
    block_size: int
    object_size: int
    small_header: bytes | None = None
    """For a verified object of one chunk (every small file): its block's header up to the
    checksum (identity and length), so a hit compares bytes instead of unpacking
    (`blockfile.read_one_chunk`)."""
    small_path: str = ""
    """With `small_header`: the path of the object's one block, made once, not on every hit."""
    small_name: str = ""
    """With `small_header`: the name its hits are reported by, made once too."""

    @classmethod
    def of(cls, dirs: tuple[Path, ...], blocks: ObjectBlocks, verify: bool, files: OpenBlocks) -> BlockRef:
        prefix = object_prefix(dirs, blocks.oid)
        fields = (blocks, prefix, verify, files, blocks.oid, blocks.block_size, blocks.size)
        if verify and 0 < blocks.size <= min(CHUNK, blocks.block_size):
            first = blocks.block(0)
            return cls(*fields, first.fixed_header(blocks.size), f"{prefix}0", first.name)
        return cls(*fields)

    def path(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def length(self, index: int) -> int:
        return self.blocks.length(index)
