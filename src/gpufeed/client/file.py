"""The file object over one object version: what `gpufeed.open` returns."""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING

from gpufeed import arguments
from gpufeed.cache import blockfile

if TYPE_CHECKING:
    from gpufeed.client.handles import ObjectHandle
    from gpufeed.client.reader import Client


class FeedFile(io.RawIOBase):
    """A read-only binary file over one object version. `read()` with no size fetches the rest
    in one request; `readinto` fills the caller's buffer without an intermediate bytes object."""

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
