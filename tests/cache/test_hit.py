"""The one-chunk hit path (every small object): one pread, then length, header and xxh3 checked;
any damage is a CorruptBlock, never wrong bytes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufeed.blocks import HEAD_SIZE, SMALL_HEAD, CorruptBlock, ObjectBlocks, object_blocks
from gpufeed.cache import blockfile
from gpufeed.cache.layout import BlockRef
from gpufeed.cache.openfiles import DeletionCounter, OpenBlocks
from gpufeed.sources.base import ObjectInfo


def identity(size: int, block_size: int = 4 << 20, key: str = "key") -> ObjectBlocks:
    return object_blocks("file:///src", {}, ObjectInfo(key, size, 0.0, "v1"), block_size, True)


def published(root: Path, data: bytes) -> BlockRef:
    r = BlockRef.of((root,), identity(len(data), 4 << 20), True, OpenBlocks(Path("/nonexistent"), 0))
    blockfile.publish(r.path(0), r.blocks.block(0), data)
    return r


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("size", [0, 1, 100_000, 256 * 1024])
def test_reads_any_range(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    r = published(tmp_path, data)
    whole = blockfile.read(r, 0, 0, size)
    assert isinstance(whole, memoryview) and whole == data
    if size > 10:
        assert bytes(blockfile.read(r, 0, 3, size - 7)) == data[3 : size - 7]


def test_missing_block_is_file_not_found(tmp_path: Path) -> None:
    r = BlockRef.of((tmp_path,), identity(10, 4 << 20), True, OpenBlocks(Path("/nonexistent"), 0))
    with pytest.raises(FileNotFoundError) as caught:
        blockfile.read(r, 0, 0, 10)
    assert caught.value.filename == r.path(0)


def test_a_read_error_is_an_os_error_not_a_corrupt_block(tmp_path: Path) -> None:
    r = BlockRef.of((tmp_path,), identity(10, 4 << 20), True, OpenBlocks(Path("/nonexistent"), 0))
    os.makedirs(r.path(0))
    with pytest.raises(IsADirectoryError):
        blockfile.read(r, 0, 0, 10)


DAMAGE: dict[str, Callable[[str, int], None]] = {
    "truncated": lambda path, size: os.truncate(path, SMALL_HEAD + size - 1),
    "only a header": lambda path, size: os.truncate(path, SMALL_HEAD),
    "flipped data byte": lambda path, size: flip(path, SMALL_HEAD + size // 2),
    "flipped last data byte": lambda path, size: flip(path, SMALL_HEAD + size - 1),
    "flipped checksum": lambda path, size: flip(path, HEAD_SIZE + 3),
    "wrong magic": lambda path, size: flip(path, 0),
    "wrong length in header": lambda path, size: flip(path, 8),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_is_a_corrupt_block(tmp_path: Path, damage: str) -> None:
    data = os.urandom(100_000)
    r = published(tmp_path, data)
    DAMAGE[damage](r.path(0), len(data))
    with pytest.raises(CorruptBlock):
        blockfile.read(r, 0, 0, 10)
    assert r.small_header is not None
    with pytest.raises(CorruptBlock):
        blockfile.read_one_chunk(r.files, r.small_path, r.object_size, r.small_header)


@pytest.mark.parametrize("size", [1, 100_000, 256 * 1024])
def test_a_small_object_is_read_whole_with_its_header_checked(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    r = published(tmp_path, data)
    assert r.small_header is not None
    assert blockfile.read_one_chunk(r.files, r.small_path, r.object_size, r.small_header) == data


def test_a_whole_small_object_is_handed_out_without_a_copy(tmp_path: Path) -> None:
    data = os.urandom(100_000)
    r = published(tmp_path, data)
    assert r.small_header is not None
    view = blockfile.read_one_chunk(r.files, r.small_path, r.object_size, r.small_header)
    whole = blockfile.as_bytes(view)
    assert whole == data and whole is view.obj
    part = blockfile.as_bytes(view[10:20])
    assert part == data[10:20] and part is not view.obj


def test_only_verified_one_chunk_objects_take_the_small_path(tmp_path: Path) -> None:
    none = OpenBlocks(Path("/nonexistent"), 0)
    assert BlockRef.of((tmp_path,), identity(256 * 1024 + 1), True, none).small_header is None
    assert BlockRef.of((tmp_path,), identity(1000), False, none).small_header is None
    assert BlockRef.of((tmp_path,), identity(5000, 4096), True, none).small_header is None


def test_a_valid_small_block_of_another_object_is_corrupt(tmp_path: Path) -> None:
    data = os.urandom(1000)
    r = published(tmp_path, data)
    other = identity(len(data), key="other")
    blockfile.publish(r.path(0), other.block(0), data)
    assert r.small_header is not None
    with pytest.raises(CorruptBlock):
        blockfile.read_one_chunk(r.files, r.small_path, r.object_size, r.small_header)


@pytest.mark.parametrize("size", [100_000, 600_000], ids=["one chunk", "three chunks"])
def test_a_read_that_missed_is_not_a_first_read(tmp_path: Path, size: int) -> None:
    """A cold read misses (maybe twice), the agent publishes, the read is served: that is one
    read, so the file is not mapped for it; a process that reads the file again holds it."""
    DeletionCounter.create(tmp_path)
    files = OpenBlocks(tmp_path, 10)
    data = os.urandom(size)
    r = BlockRef.of((tmp_path,), identity(size, 4 << 20), True, files)
    for _ in range(2):
        with pytest.raises(FileNotFoundError):
            blockfile.read(r, 0, 0, size)
    blockfile.publish(r.path(0), r.blocks.block(0), data)
    assert blockfile.read(r, 0, 0, size) == data and r.path(0) not in files.held
    assert blockfile.read(r, 0, 0, size) == data and r.path(0) in files.held


@pytest.mark.parametrize("size", [100_000, 600_000], ids=["one chunk", "three chunks"])
def test_a_held_file_found_damaged_gives_way_to_its_repair(tmp_path: Path, size: int) -> None:
    """A reader holding a block file that a repair has replaced since reads the replacement;
    one holding a file still damaged gets a CorruptBlock and holds it no more."""
    DeletionCounter.create(tmp_path)
    files = OpenBlocks(tmp_path, 10)
    data = os.urandom(size)
    r = BlockRef.of((tmp_path,), identity(size, 4 << 20), True, files)
    blockfile.publish(r.path(0), r.blocks.block(0), data)
    assert blockfile.read(r, 0, 0, size) == data and r.path(0) not in files.held, "held from its second read"
    assert blockfile.read(r, 0, 0, size) == data and r.path(0) in files.held
    flip(r.path(0), SMALL_HEAD + 5)  # the held file is damaged in place...
    blockfile.publish(r.path(0), r.blocks.block(0), data)  # ...and the agent's repair renamed a new one over it
    assert blockfile.read(r, 0, 0, size) == data
    flip(r.path(0), SMALL_HEAD + 5)
    with pytest.raises(CorruptBlock):
        blockfile.read(r, 0, 0, size)
    assert r.path(0) not in files.held
