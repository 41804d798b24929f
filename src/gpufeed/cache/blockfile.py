"""Reading and publishing block files.

Readers (any process) only ever open published files: the agent writes a block to a temp file
in the same cache dir and renames it into place, so a partial block is never visible. A reader
that opened a block keeps valid bytes even if the agent unlinks it afterwards, which is what
lets readers hold block files open between hits (`openfiles`).
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

from xxhash import xxh3_64_intdigest

from gpufeed.cache.layout import CHUNK, HEAD_SIZE, SMALL_HEAD, SUM, BlockRef, CorruptBlock, encode, small_header, verify
from gpufeed.cache.openfiles import OpenBlocks


def read_one_chunk(files: OpenBlocks, path: str, length: int, header: bytes) -> memoryview:
    """The data of a verified one-chunk block: a pread of the header and one of the data from
    the held file, then length, header and checksum compared. Every small file's hit runs
    this, so it is flat. The data gets a bytes object of its own (`as_bytes` hands it out
    without a copy): the second pread costs less than copying 100 KB out of one read."""
    held = files.held.get(path) or files.open(path)
    head = os.pread(held.fd, SMALL_HEAD, 0)
    data = os.pread(held.fd, length, SMALL_HEAD)
    if (
        len(data) != length
        or len(head) != SMALL_HEAD
        or not head.startswith(header)
        or xxh3_64_intdigest(data) != SUM.unpack_from(head, HEAD_SIZE)[0]
    ):
        files.forget(path)
        raise CorruptBlock("header, length or checksum does not match")
    return memoryview(data)


def as_bytes(view: memoryview) -> bytes:
    """`view` as bytes, without a copy when it is a whole bytes object (every small file)."""
    whole = view.obj
    return whole if type(whole) is bytes and len(whole) == view.nbytes else bytes(view)


def read(ref: BlockRef, index: int, start: int, end: int) -> memoryview:
    """Bytes [start, end) of block `index` (offsets within the block). Raises FileNotFoundError
    on a miss and CorruptBlock when the file is damaged; with `ref.verify` the chunks read are
    checked against their checksums. This is the cache hit path: one or two preads from the
    held file, so it is written with few calls."""
    length = ref.object_size - index * ref.block_size
    if length > ref.block_size:
        length = ref.block_size
    path = f"{ref.prefix}{index}"
    if length <= CHUNK and ref.verify:  # one chunk (every small object): two preads, no chunk arithmetic
        return read_one_chunk(ref.files, path, length, small_header(length))[start:end]
    head = HEAD_SIZE + 8 * (-(-length // CHUNK) or 1)
    held = ref.files.held.get(path) or ref.files.open(path)
    fd = held.fd
    if not ref.verify:  # trust the bytes, not the length: a block of another size is damaged
        if os.fstat(fd).st_size != head + length:
            ref.files.forget(path)
            raise CorruptBlock("wrong size")
        return memoryview(os.pread(fd, end - start, head + start))
    first = start // CHUNK
    lo = first * CHUNK
    hi = -(-end // CHUNK) * CHUNK
    if hi > length:
        hi = length
    scratch = 2 * (end - start) < hi - lo
    if lo == 0:
        raw = _pread(fd, head + hi, 0, scratch)
        header, chunks = raw[:head], raw[head:]
    else:
        header, chunks = memoryview(os.pread(fd, head, 0)), _pread(fd, hi - lo, head + lo, scratch)
    try:
        if len(chunks) != hi - lo:
            raise CorruptBlock("truncated")
        verify(header, length, chunks, first)
    except CorruptBlock:
        ref.files.forget(path)
        raise
    wanted = chunks[start - lo : end - lo]
    return memoryview(bytes(wanted)) if scratch else wanted


_scratch = threading.local()


def _pread(fd: int, size: int, offset: int, scratch: bool) -> memoryview:
    """`size` bytes at `offset`, short at the end of the file. With `scratch` they land in this
    thread's reusable buffer: a read that verifies a 256 KiB chunk to return 115 KB of it
    would otherwise get a fresh allocation that size every time, which malloc maps and the
    kernel zeroes and faults in page by page, at a cost above the copy out."""
    if not scratch:
        return memoryview(os.pread(fd, size, offset))
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or len(buffer) < size:
        buffer = _scratch.buffer = memoryview(bytearray(size))
    return buffer[: os.preadv(fd, [buffer[:size]], offset)]


def publish(path: Path, data: memoryview | bytes) -> int:
    """Atomically place a block file; returns the bytes it occupies. Raises OSError (ENOSPC…)."""
    header, view = encode(data)
    tmp_dir = path.parent.parent.parent / "tmp"
    tmp = tmp_dir / f"{path.name}.{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:
        tmp_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            written = os.writev(fd, [header, view])
            if written != len(header) + len(view):
                raise OSError(f"short write to {tmp}")
        finally:
            os.close(fd)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written
