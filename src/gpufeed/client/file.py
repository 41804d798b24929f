"""The file object over one object version: what `gpufeed.open` returns."""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING

from gpufeed import arguments
from gpufeed.blocks import CHUNK
from gpufeed.cache import blockfile

if TYPE_CHECKING:
    from gpufeed.client.handles import ObjectHandle
    from gpufeed.client.reader import Client


class FeedFile(io.BufferedReader):
    """What `gpufeed.open(path)` returns: a read-only binary file over one object version,
    buffered as Python's own `open(path, "rb")` is, so lines, `tarfile`'s headers or `pickle`'s
    small reads cost a copy from the buffer, not a read of the cache each. The buffer is one
    checksum chunk (a raw read checks whole chunks anyway), or one block where blocks are
    smaller, so filling it never fetches more than the block read from; a read at least that
    big goes straight into the caller's buffer (`RawFeedFile.readinto`), and `read()` fetches
    the rest in one request. Every byte is of the version the file opened, buffered or not;
    `raw` is the unbuffered file, whose every read goes to the read path."""

    def __init__(self, client: Client, handle: ObjectHandle) -> None:
        blocks = handle.blocks
        super().__init__(RawFeedFile(client, handle), buffer_size=CHUNK if blocks is None else min(CHUNK, blocks.block_size))
        self.handle = handle

    @property
    def size(self) -> int:
        return self.handle.size


class RawFeedFile(io.RawIOBase):
    """The unbuffered file under `FeedFile`: every read goes to the read path. `readinto`
    fills the caller's buffer without an intermediate bytes object."""

    def __init__(self, client: Client, handle: ObjectHandle) -> None:
        super().__init__()
        self._client = client
        self._handle = handle
        self._pos = 0
        self.name = handle.path

    @property
    def size(self) -> int:
        return self._handle.size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        self._checkClosed()
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._checkClosed()
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}.get(whence)
        if base is None:
            raise ValueError(f"invalid whence {whence}")
        if base + offset < 0:
            raise ValueError(f"{self.name}: negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        self._checkClosed()
        done = self._client.read_into(self._handle, self._pos, memoryview(buffer).cast("B"))
        self._pos += done
        return done

    def read(self, size: int | None = -1) -> bytes:
        self._checkClosed()
        if size is not None and type(size) is not int:
            size = arguments.integer(size, "size", "read")
        end = self.size if size is None or size < 0 else self._pos + size
        data = self._client.read_range(self._handle, self._pos, end)
        self._pos += len(data)
        return blockfile.as_bytes(data)

    def readall(self) -> bytes:
        return self.read()
