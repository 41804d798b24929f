"""fsspec protocol `gpufeed://`: pandas, pyarrow and any fsspec user read through the one read path.

    import pandas
    pandas.read_parquet("gpufeed:///data/table.parquet")

Registered through the `fsspec.specs` entry point, so no import is needed before use.
"""

from __future__ import annotations

from typing import Any

from fsspec import AbstractFileSystem

import gpufeed
from gpufeed.cache.blockfile import as_bytes
from gpufeed.client import FeedFile
from gpufeed.errors import InvalidArgument
from gpufeed.namespace import FileStat


def _info(item: FileStat) -> dict[str, Any]:
    return {
        "name": item.path,
        "size": item.size,
        "type": "directory" if item.is_dir else "file",
        "mtime": item.mtime,
        "version": item.version,
    }


class GpufeedFileSystem(AbstractFileSystem):
    """Read-only view of the gpufeed namespace; listings come from the manifest."""

    protocol = "gpufeed"
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path: str | list[str]) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = path.removeprefix("gpufeed://")
        return "/" + path.lstrip("/").rstrip("/")

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        entries = [_info(item) for item in gpufeed.ls(self._strip_protocol(path))]
        return entries if detail else [e["name"] for e in entries]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return _info(gpufeed.stat(self._strip_protocol(path)))

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        path = self._strip_protocol(path)
        client = gpufeed.client()
        handle = client.handle(path)
        start, end = start or 0, handle.size if end is None else end
        if start < 0 or end < 0:  # fsspec allows offsets from the end
            start, end = (start + handle.size if start < 0 else start), (end + handle.size if end < 0 else end)
        return as_bytes(client.read_range(handle, start, end))

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> FeedFile:
        if mode != "rb":
            raise InvalidArgument(f"gpufeed://{path}: the namespace is read-only (mode {mode!r})")
        return gpufeed.open(self._strip_protocol(path))
