"""The block format: atomic publish, chunk checksums, truncation and corruption detection."""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import pytest

from gpufeed.blocks import (
    CHUNK,
    ChunkMismatch,
    CorruptBlock,
    ObjectBlocks,
    check_chunks,
    chunk_span,
    chunk_sums,
    header_length,
    listed_sums,
    mismatch,
    object_blocks,
    sums_id,
)
from gpufeed.cache import blockfile
from gpufeed.cache.layout import BlockRef
from gpufeed.cache.openfiles import DeletionCounter, OpenBlocks
from gpufeed.sources.base import ObjectInfo


def identity(size: int, block_size: int = 4 << 20, key: str = "key") -> ObjectBlocks:
    return object_blocks("file:///src", {}, ObjectInfo(key, size, 0.0, "v1"), block_size, True)


def ref(tmp_path: Path, size: int, verify: bool = True, block_size: int = 4 << 20) -> BlockRef:
    return BlockRef.of((tmp_path,), identity(size, block_size), verify, OpenBlocks(Path("/nonexistent"), 0))


def test_round_trip_any_range(tmp_path: Path) -> None:
    data = os.urandom(3 * CHUNK + 1000)
    r = ref(tmp_path, len(data))
    written = blockfile.publish(r.path(0), r.blocks.block(0), data)
    assert written == header_length(len(data)) + len(data) == Path(r.path(0)).stat().st_size
    for start, end in [(0, len(data)), (5, 17), (CHUNK - 1, CHUNK + 1), (2 * CHUNK, len(data)), (len(data) - 1, len(data))]:
        assert bytes(blockfile.read(r, 0, start, end)) == data[start:end]
    assert list((tmp_path / "tmp").iterdir()) == [], "no temp file left behind"


def test_names_depend_on_version_block_size_endpoint_version_checking_and_content_hash() -> None:
    names = {
        object_blocks("s3://b/p", {"endpoint": e}, ObjectInfo("k", 10, 0.0, v, h), b, c).oid
        for v in ("v1", "v2")
        for b in (1 << 20, 4 << 20)
        for c in (True, False)
        for e in ("http://a", "http://b")
        for h in (None, "sha256:" + "0" * 64)
    }
    # 8 (block size, checking, endpoint) x 3: two versions without a hash, and one name for the
    # hashed bytes whatever their version (a written object keeps its names when its upload adds the ETag)
    assert len(names) == 24, "blocks checked against a content hash never share names with unchecked ones"
    hashed = ObjectInfo("k", 10, 0.0, None, "sha256:" + "0" * 64)
    uploaded = ObjectInfo("k", 10, 5.0, "etag-from-the-store", "sha256:" + "0" * 64)
    assert object_blocks("s3://b/p", {}, hashed, 4096, True) == object_blocks("s3://b/p", {}, uploaded, 4096, True)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "verify=never"])
@pytest.mark.parametrize("held", [0, 10], ids=["opened", "held"])
def test_a_valid_block_of_another_object_under_a_blocks_name_is_corrupt(tmp_path: Path, verify: bool, held: int) -> None:
    """The header records the block's identity: a whole, checksummed block of another object (or
    another index) copied under this name is discarded like a flipped byte, verify=never too."""
    data = os.urandom(3 * CHUNK)
    DeletionCounter.create(tmp_path)
    mine = BlockRef.of((tmp_path,), identity(len(data)), verify, OpenBlocks(tmp_path, held))
    other = BlockRef.of((tmp_path,), identity(len(data), key="other"), verify, OpenBlocks(tmp_path, held))
    blockfile.publish(mine.path(0), other.blocks.block(0), data)
    with pytest.raises(CorruptBlock):
        blockfile.read(mine, 0, 0, 10)
    blockfile.publish(mine.path(0), mine.blocks.block(1), data)
    with pytest.raises(CorruptBlock):
        blockfile.read(mine, 0, CHUNK, CHUNK + 10)
    blockfile.publish(mine.path(0), mine.blocks.block(0), data)
    assert bytes(blockfile.read(mine, 0, 0, 10)) == data[:10]


@pytest.mark.parametrize("offset", [0, 10, 24, 100, CHUNK + 50])
def test_a_flipped_byte_is_detected(tmp_path: Path, offset: int) -> None:
    data = os.urandom(2 * CHUNK)
    r = ref(tmp_path, len(data))
    blockfile.publish(r.path(0), r.blocks.block(0), data)
    with open(Path(r.path(0)), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    head = header_length(len(data))
    with pytest.raises(CorruptBlock):
        chunk_start = max(0, offset - head) // CHUNK * CHUNK
        blockfile.read(r, 0, chunk_start, chunk_start + 10)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("change", [-500, 16])
def test_a_block_of_the_wrong_size_is_detected_with_and_without_verify(tmp_path: Path, verify: bool, change: int) -> None:
    data = os.urandom(1000)
    r = ref(tmp_path, len(data), verify)
    blockfile.publish(r.path(0), r.blocks.block(0), data)
    os.truncate(Path(r.path(0)), header_length(len(data)) + len(data) + change)
    if verify and change > 0:  # the checksums prove the bytes asked for; trailing junk is harmless
        assert bytes(blockfile.read(r, 0, 0, 1000)) == data
        return
    with pytest.raises(CorruptBlock):
        blockfile.read(r, 0, 0, 1000)


def test_verify_never_skips_checksums(tmp_path: Path) -> None:
    data = b"a" * 1000
    r = ref(tmp_path, len(data), verify=False)
    blockfile.publish(r.path(0), r.blocks.block(0), data)
    with open(Path(r.path(0)), "r+b") as f:
        f.seek(header_length(1000) + 10)
        f.write(b"Z")
    assert bytes(blockfile.read(r, 0, 10, 11)) == b"Z", "the opt-out trusts the disk"


def test_missing_block_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        blockfile.read(ref(tmp_path, 10), 0, 0, 10)


def test_an_open_reader_survives_unlink(tmp_path: Path) -> None:
    data = os.urandom(5000)
    r = ref(tmp_path, len(data))
    blockfile.publish(r.path(0), r.blocks.block(0), data)
    fd = os.open(Path(r.path(0)), os.O_RDONLY)
    os.unlink(Path(r.path(0)))
    assert os.pread(fd, 5000, header_length(5000)) == data
    os.close(fd)


@pytest.mark.parametrize("held", [0, 10], ids=["not held", "held"])
def test_a_view_is_the_checked_bytes_where_they_lie(tmp_path: Path, held: int) -> None:
    """`view` hands out a piece of a block without a buffer of its own: from the mapping the
    process holds, or from one made for this read when the piece is big; a small piece of a
    file not held is read into a bytes of its own. Damage is found as `read` finds it."""
    data = os.urandom(2 * blockfile.MAP_FOR_ONE_READ + 1000)
    DeletionCounter.create(tmp_path)
    r = BlockRef.of((tmp_path,), identity(len(data)), True, OpenBlocks(tmp_path, held))
    blockfile.publish(r.path(0), r.blocks.block(0), data)
    blockfile.read(r, 0, 0, 10)  # a first read: a held file is held from its second one on
    big = blockfile.view(r, 0, 100, len(data) - 100)
    assert big == data[100:-100]
    assert isinstance(big.obj, mmap.mmap), "a big piece is a view of a mapping, held or made for this read"
    assert (r.path(0) in r.files.held) == bool(held)
    small = blockfile.view(r, 0, CHUNK + 5, CHUNK + 500)
    assert small == data[CHUNK + 5 : CHUNK + 500]
    assert isinstance(small.obj, mmap.mmap if held else bytes)
    del big, small
    head = header_length(len(data))
    with open(Path(r.path(0)), "r+b") as f:
        f.seek(head + 3 * CHUNK + 7)
        f.write(bytes([data[3 * CHUNK + 7] ^ 0xFF]))
    with pytest.raises(CorruptBlock):
        blockfile.view(r, 0, 0, len(data))
    assert bytes(blockfile.view(r, 0, 0, CHUNK)) == data[:CHUNK], "the chunks a view lies in are what is checked"


def test_whole_chunks_of_a_file_not_held_are_read_into_a_bytes_of_their_own(tmp_path: Path) -> None:
    """So `as_bytes` (`FeedFile.read`) hands them out without copying them again."""
    data = os.urandom(3 * CHUNK + 1000)
    r = ref(tmp_path, len(data))
    blockfile.publish(r.path(0), r.blocks.block(0), data)
    for start, end in [(0, 2 * CHUNK), (CHUNK, len(data)), (0, len(data))]:
        piece = blockfile.read(r, 0, start, end)
        assert piece == data[start:end]
        assert type(piece.obj) is bytes and piece.nbytes == len(piece.obj)
        assert blockfile.as_bytes(piece) is piece.obj


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "verify=never"])
@pytest.mark.parametrize("held", [0, 10], ids=["not held", "held"])
def test_a_read_into_a_target_checks_what_lands_there(tmp_path: Path, held: int, verify: bool) -> None:
    """With a caller's buffer, `read` copies the bytes there once (from the mapping, or by a
    pread straight into it for whole chunks of a file not held) and checks them as it checks
    its own; a damaged or truncated block is a CorruptBlock, never bytes in the buffer."""
    data = os.urandom(3 * CHUNK + 1000)
    DeletionCounter.create(tmp_path)
    r = BlockRef.of((tmp_path,), identity(len(data)), verify, OpenBlocks(tmp_path, held))
    blockfile.publish(r.path(0), r.blocks.block(0), data)
    for start, end in [(0, len(data)), (0, CHUNK), (CHUNK, 3 * CHUNK), (7, CHUNK + 9), (3 * CHUNK, len(data))]:
        target = memoryview(bytearray(end - start))
        assert blockfile.read(r, 0, start, end, target) is target
        assert target == data[start:end]
    head = header_length(len(data))
    if verify:
        with open(Path(r.path(0)), "r+b") as f:
            f.seek(head + CHUNK + 1)
            f.write(bytes([data[CHUNK + 1] ^ 0xFF]))
        with pytest.raises(CorruptBlock):
            blockfile.read(r, 0, CHUNK, 2 * CHUNK, memoryview(bytearray(CHUNK)))
    r.files.close()
    os.truncate(Path(r.path(0)), head + 2 * CHUNK)
    with pytest.raises(CorruptBlock):
        blockfile.read(r, 0, 2 * CHUNK, 3 * CHUNK, memoryview(bytearray(CHUNK)))


def test_a_block_is_published_only_when_its_chunks_match_the_listed_sums(tmp_path: Path) -> None:
    """A shard's block is checked against the chunk sums its pack index lists, with the sums its
    header is made of: a block cut where chunks start is published; one chunk off is refused
    before anything is written."""
    shard = os.urandom(5 * CHUNK + 1000)
    sums = chunk_sums(shard)
    info = ObjectInfo("shards/s0", len(shard), 0.0, "v1", sums_id=sums_id(sums))
    blocks = object_blocks("file:///src", {}, info, 2 * CHUNK, True)
    r = BlockRef.of((tmp_path,), blocks, True, OpenBlocks(Path("/nonexistent"), 0))
    for index in range(blocks.count):
        start = index * blocks.block_size
        data = shard[start : start + blocks.length(index)]
        blockfile.publish(r.path(index), blocks.block(index), data, listed_sums(sums, start, len(data)))
        assert bytes(blockfile.read(r, index, 0, len(data))) == data
    damaged = bytearray(shard[2 * CHUNK : 4 * CHUNK])
    damaged[CHUNK + 7] ^= 1
    os.unlink(r.path(1))
    with pytest.raises(ChunkMismatch) as caught:
        blockfile.publish(r.path(1), blocks.block(1), damaged, listed_sums(sums, 2 * CHUNK, len(damaged)))
    assert caught.value.chunk == 1 and caught.value.got != caught.value.listed
    assert not Path(r.path(1)).exists() and list((tmp_path / "tmp").iterdir()) == [], "nothing written"
    with pytest.raises(ChunkMismatch) as caught:
        check_chunks(sums, 2 * CHUNK, damaged)
    line = str(mismatch(info, 2 * CHUNK, caught.value))
    assert re.match(r"shards/s0: bytes \[786432, 1048576\) hash to xxh3:\w{16}, its pack index lists xxh3:\w{16}", line)


def test_chunk_sums_name_blocks_only_where_blocks_start_on_chunks() -> None:
    """Checked blocks get names of their own, as a content hash gives: a block cached unchecked
    (a version 1 index, a plain mount of the shard) is never served as a checked one; a block
    size that is not a multiple of a chunk cannot be checked, so it keeps the version's names."""
    plain = ObjectInfo("s0", 10 * CHUNK, 0.0, "v1")
    summed = ObjectInfo("s0", 10 * CHUNK, 0.0, "v1", sums_id=sums_id(bytes(80)))
    other = ObjectInfo("s0", 10 * CHUNK, 0.0, "v1", sums_id=sums_id(bytes(72) + b"\1" * 8))

    def oid(info: ObjectInfo, block_size: int) -> str:
        return object_blocks("file:///src", {}, info, block_size, True).oid

    assert len({oid(plain, 4 << 20), oid(summed, 4 << 20), oid(other, 4 << 20)}) == 3
    assert oid(summed, CHUNK + 4096) == oid(plain, CHUNK + 4096)
    assert chunk_span(10 * CHUNK, CHUNK + 5, CHUNK + 9) == (CHUNK, 2 * CHUNK)
    assert chunk_span(10 * CHUNK - 7, 9 * CHUNK + 1, 10 * CHUNK - 7) == (9 * CHUNK, 10 * CHUNK - 7)
