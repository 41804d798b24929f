"""The read path: namespace path → (mount, key, pinned version) → bytes.

Every reader (Python API, CLI, and later fsspec, PyTorch datasets, FUSE, warmup, the
benchmark) fetches bytes through `Client.read_range`; the node cache plugs in there.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass

from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument, ObjectChanged, ObjectMissing
from gpufeed.meta import Mount
from gpufeed.namespace import FileStat, Namespace
from gpufeed.sources import ObjectInfo, Source


@dataclass(frozen=True, slots=True)
class ObjectHandle:
    """One object at one version: every read through a handle sees the same bytes."""

    path: str
    mount: Mount
    source: Source
    info: ObjectInfo

    @property
    def size(self) -> int:
        return self.info.size


class Client:
    def __init__(self, settings: Settings | None = None, namespace: Namespace | None = None) -> None:
        self.namespace = namespace or Namespace(settings)

    def close(self) -> None:
        self.namespace.close()

    def handle(self, path: str) -> ObjectHandle:
        where, source, info = self.namespace.open_object(path)
        return ObjectHandle(f"{where.mount.path}/{where.key}", where.mount, source, info)

    def read_range(self, handle: ObjectHandle, start: int, end: int) -> memoryview:
        """Bytes [start, end) of the pinned version, clipped to the object's size."""
        end = min(end, handle.size)
        if end <= start:
            return memoryview(b"")
        expect = None if handle.mount.immutable else handle.info
        try:
            return handle.source.get_range(handle.info.key, start, end, expect)
        except ObjectMissing as exc:
            raise ObjectMissing(
                f"{handle.path}: deleted at the source since mount {handle.mount.path} was listed "
                f"({exc}); run 'gpufeed mount refresh {handle.mount.path}'"
            ) from exc
        except ObjectChanged as exc:
            raise ObjectChanged(
                f"{handle.path}: changed at the source since mount {handle.mount.path} was listed "
                f"({exc}); run 'gpufeed mount refresh {handle.mount.path}'"
            ) from exc

    def open(self, path: str) -> FeedFile:
        return FeedFile(self, self.handle(path))

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        if offset < 0 or (length is not None and length < 0):
            raise InvalidArgument(f"{path}: offset and length must be >= 0")
        handle = self.handle(path)
        end = handle.size if length is None else offset + length
        return bytes(self.read_range(handle, offset, end))

    def stat(self, path: str) -> FileStat:
        return self.namespace.stat(path)

    def ls(self, path: str) -> list[FileStat]:
        return self.namespace.ls(path)

    def walk(self, path: str) -> Iterator[FileStat]:
        return self.namespace.walk(path)


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
        target = memoryview(buffer).cast("B")
        data = self._client.read_range(self._handle, self._pos, self._pos + len(target))
        target[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        self._checkClosed()
        end = self.size if size is None or size < 0 else self._pos + size
        data = self._client.read_range(self._handle, self._pos, end)
        self._pos += len(data)
        return bytes(data)

    def readall(self) -> bytes:
        return self.read()
