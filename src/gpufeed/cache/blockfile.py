"""Reading and publishing block files.

Readers (any process) only ever open published files: the agent writes a block to a temp file
in the same cache dir and renames it into place, so a partial block is never visible. A reader
that opened a block keeps valid bytes even if the agent unlinks it afterwards, which is what
lets readers hold block files open between hits (`openfiles`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import threading

from xxhash import xxh3_64_intdigest

from gpufeed.blocks import CHUNK, HEAD_SIZE, SMALL_HEAD, SUM, BlockId, CorruptBlock, encode, expected_header, verify
from gpufeed.cache.layout import BlockRef
from gpufeed.cache.openfiles import Held, OpenBlocks


def read_one_chunk(files: OpenBlocks, path: str, length: int, header: bytes) -> memoryview:
    """The data of a verified one-chunk block, with its length, header and checksum compared.
    Every small file's hit runs this, so it is flat. A held file's data is copied out of its
    mapping and the copy verified, so what is handed out is what was checked. Either way the
    data is a bytes object of its own (`as_bytes` hands it out without another copy)."""
    held = files.held.get(path)
    opened = held is None
    if held is None:
        held = files.open(path)
        if held is None:
            unheld = _one_chunk_unheld(_open_unheld(files, path), length, header)
            files.read_unheld(path)
            return unheld
    mapped = held.mapped
    # the size first: touching a mapping past the end of a file shrunk since would fault
    good = len(mapped) == SMALL_HEAD + length and held.map.size() == len(mapped)
    if good and held.checksum is None and mapped[:HEAD_SIZE] == header:
        held.checksum = SUM.unpack_from(mapped, HEAD_SIZE)[0]  # the file never changes
    if good:
        data = bytes(mapped[SMALL_HEAD:])
        good = xxh3_64_intdigest(data) == held.checksum
    if not good:
        files.forget(path)
        if not opened:  # a repair may have replaced the damaged file since: read the one there
            return read_one_chunk(files, path, length, header)
        raise CorruptBlock("header, length or checksum does not match")
    return memoryview(data)


def _open_unheld(files: OpenBlocks, path: str) -> int:
    """A descriptor for a read of a block file this process does not hold. A miss makes
    `files` look at the agent's deletion count: blocks may have been deleted, and the held ones
    keep their space until let go."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        files.check()
        raise


def _one_chunk_unheld(fd: int, length: int, header: bytes) -> memoryview:
    """A one-chunk block this process does not hold, open at `fd`: a pread of the header and
    one of the data (a copy of its own, so `as_bytes` needs none), then the close."""
    try:
        head = os.pread(fd, SMALL_HEAD, 0)
        data = os.pread(fd, length, SMALL_HEAD)
    finally:
        os.close(fd)
    if (
        len(data) != length
        or len(head) != SMALL_HEAD
        or not head.startswith(header)
        or xxh3_64_intdigest(data) != SUM.unpack_from(head, HEAD_SIZE)[0]
    ):
        raise CorruptBlock("header, length or checksum does not match")
    return memoryview(data)


def as_bytes(view: memoryview) -> bytes:
    """`view` as bytes, without a copy when it is a whole bytes object (every small file)."""
    whole = view.obj
    return whole if type(whole) is bytes and len(whole) == view.nbytes else bytes(view)


def read(ref: BlockRef, index: int, start: int, end: int, target: memoryview | None = None) -> memoryview:
    """Bytes [start, end) of block `index` (offsets within the block). Raises FileNotFoundError
    on a miss and CorruptBlock when the file is damaged; with `ref.verify` the chunks read are
    checked against their checksums. This is the cache hit path, so it is written with few
    calls. With a `target` (end - start bytes, a caller's buffer) the bytes are copied there
    once, from the mapping or by a pread straight into it, and `target` is returned."""
    length = ref.object_size - index * ref.block_size
    if length > ref.block_size:
        length = ref.block_size
    path = f"{ref.prefix}{index}"
    if length <= CHUNK and ref.verify:  # one chunk (every small object): two preads, no chunk arithmetic
        data = read_one_chunk(ref.files, path, length, expected_header(ref.oid, index, length))[start:end]
        if target is None:
            return data
        target[:] = data
        return target
    head = HEAD_SIZE + 8 * (-(-length // CHUNK) or 1)
    checked = _mapped(ref, index, path, head, length, start, end, map_unheld=False)
    if checked is None:
        return _read_unheld(ref, index, path, head, length, start, end, target)
    if target is None:
        return memoryview(bytes(checked))
    target[:] = checked
    return target


def _read_unheld(
    ref: BlockRef, index: int, path: str, head: int, length: int, start: int, end: int, target: memoryview | None
) -> memoryview:
    """A block file this process does not hold: opened, read (`_read_unmapped`), closed; its
    next read holds it, if there is room."""
    files = ref.files
    fd = _open_unheld(files, path)
    try:
        data = _read_unmapped(fd, ref, index, head, length, start, end, target)
    finally:
        os.close(fd)
    files.read_unheld(path)
    return data


def _mapped(
    ref: BlockRef, index: int, path: str, head: int, length: int, start: int, end: int, *, map_unheld: bool
) -> memoryview | None:
    """Bytes [start, end) of the block as a checked view of its mapping: the one this process
    holds, or with `map_unheld` one made for this read; None when it holds none and makes none
    (the caller preads the file). A held file found damaged is let go and the one on disk read
    again: a repair may have replaced it since."""
    files = ref.files
    held = files.held.get(path)
    opened = held is None
    if held is None:
        held = files.open(path)
        if held is None:
            if not map_unheld:
                return None
            fd = _open_unheld(files, path)
            try:
                held = Held(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
            except ValueError:  # an empty file cannot be mapped
                raise CorruptBlock("empty") from None
            finally:
                os.close(fd)
            files.read_unheld(path)
    try:
        return _checked(held, ref, index, head, length, start, end)
    except CorruptBlock:
        files.forget(path)
        if not opened:
            return _mapped(ref, index, path, head, length, start, end, map_unheld=map_unheld)
        raise


def _checked(held: Held, ref: BlockRef, index: int, head: int, length: int, start: int, end: int) -> memoryview:
    """Bytes [start, end) of a mapped block as a view of its mapping, once its size, header
    and (with `ref.verify`) the chunks they lie in have been checked there (hashing a whole
    256 KiB chunk where it lies costs less than copying it)."""
    mapped = held.mapped
    if len(mapped) != head + length or held.map.size() != len(mapped):  # before touching it
        raise CorruptBlock("wrong size")
    expected = expected_header(ref.oid, index, length)
    if ref.verify:
        first = start // CHUNK
        lo, hi = first * CHUNK, min(length, -(-end // CHUNK) * CHUNK)
        verify(mapped[:head], expected, mapped[head + lo : head + hi], first)
    elif mapped[:HEAD_SIZE] != expected:  # verify=never trusts the bytes, not which block they are
        raise CorruptBlock("header does not match the block's identity or length")
    return mapped[head + start : head + end]


MAP_FOR_ONE_READ = 1 << 20
"""A piece of a block this process does not hold is mapped for `view` from this size on; a
smaller one costs less read into a buffer of its own."""


def view(ref: BlockRef, index: int, start: int, end: int) -> memoryview:
    """Bytes [start, end) of block `index`, checked as `read` checks them, as a view of the
    file's mapping: the one this process holds, or one made for this read. For a read over
    several blocks (a whole shard, a checkpoint's tensor), which copies each view into its
    one result buffer: each byte is copied once, from the page cache, with no buffer per
    block in between (a fresh one is mapped and faulted in page by page, which costs more
    than the copy). Drop the view once copied: it keeps the mapping. A small piece of a file
    not held is read into a buffer of its own, as `read` reads it."""
    length = min(ref.object_size - index * ref.block_size, ref.block_size)
    head = HEAD_SIZE + 8 * (-(-length // CHUNK) or 1)
    path = f"{ref.prefix}{index}"
    checked = _mapped(ref, index, path, head, length, start, end, map_unheld=end - start >= MAP_FOR_ONE_READ)
    return checked if checked is not None else _read_unheld(ref, index, path, head, length, start, end, None)


def _read_unmapped(
    fd: int, ref: BlockRef, index: int, head: int, length: int, start: int, end: int, target: memoryview | None
) -> memoryview:
    """Bytes [start, end) of a block file not held, open at `fd`: whole chunks (and, with a
    `target`, any bytes verify=never trusts) are read straight into a bytes of their own or
    into `target`; a piece of a chunk lands in this thread's scratch buffer first."""
    expected = expected_header(ref.oid, index, length)
    if not ref.verify:  # trust the bytes, not their length or which block they are
        if os.fstat(fd).st_size != head + length or os.pread(fd, HEAD_SIZE, 0) != expected:
            raise CorruptBlock("header does not match the block's identity or length")
        return _pread_exact(fd, end - start, head + start, target)
    first = start // CHUNK
    lo = first * CHUNK
    hi = -(-end // CHUNK) * CHUNK
    if hi > length:
        hi = length
    if start == lo and end == hi:  # whole chunks: checked where they land (`as_bytes` hands a bytes out as it is)
        header = memoryview(os.pread(fd, head, 0))
        data = _pread_exact(fd, hi - lo, head + lo, target)
        verify(header, expected, data, first)
        return data
    scratch = target is not None or 2 * (end - start) < hi - lo
    if lo == 0:
        raw = _pread(fd, head + hi, 0, scratch)
        header, chunks = raw[:head], raw[head:]
    else:
        header, chunks = memoryview(os.pread(fd, head, 0)), _pread(fd, hi - lo, head + lo, scratch)
    if len(chunks) != hi - lo:
        raise CorruptBlock("truncated")
    verify(header, expected, chunks, first)
    wanted = chunks[start - lo : end - lo]
    if target is not None:
        target[:] = wanted
        return target
    return memoryview(bytes(wanted)) if scratch else wanted


def _pread_exact(fd: int, size: int, offset: int, target: memoryview | None) -> memoryview:
    """`size` bytes at `offset`, into `target` or a bytes of their own; CorruptBlock if the file
    ends before them."""
    if target is None:
        data = memoryview(os.pread(fd, size, offset))
        got = len(data)
    else:
        data = target
        got = os.preadv(fd, [target], offset)
    if got != size:
        raise CorruptBlock("truncated")
    return data


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


def publish(path: str, block: BlockId, data: memoryview | bytes, listed: bytes | None = None) -> int:
    """Atomically place a block file at `path` (`layout.block_path`); returns the bytes it
    occupies. Raises OSError (ENOSPC…), or ChunkMismatch before writing anything when `listed`
    (the chunk sums the object's listing vouches for) disagrees with the data. Only the agent
    publishes, one per cache dir (its lock), so a counter names temp files uniquely; a crashed
    agent's are removed at the next start."""
    header, view = encode(block, data, listed)
    blocks_dir, _, name = path.rpartition("/")
    tmp_dir = f"{blocks_dir.rpartition('/')[0].rpartition('/')[0]}/tmp"
    tmp = f"{tmp_dir}/{name}.{next(_temp_numbers)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileNotFoundError:
        os.makedirs(tmp_dir, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            written = os.writev(fd, [header, view])
            if written != len(header) + len(view):  # a regular file is written short only when the disk is full
                raise OSError(errno.ENOSPC, f"short write ({written} of {len(header) + len(view)} bytes)", tmp)
        finally:
            os.close(fd)
        try:
            os.rename(tmp, path)
        except FileNotFoundError:  # the first block of its prefix: make the dir once, not per publish
            os.makedirs(blocks_dir, exist_ok=True)
            os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return written


_temp_numbers = itertools.count()
