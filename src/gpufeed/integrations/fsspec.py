"""fsspec protocol `gpufeed://`: pandas, pyarrow and any fsspec user read through the one read path,
and write to writable mounts through the one write path (`client.writer`).

    import pandas
    pandas.read_parquet("gpufeed:///data/table.parquet")
    frame.to_parquet("gpufeed:///out/table.parquet")   # a mount added with --writable

Registered through the `fsspec.specs` entry point, so no import is needed before use.
"""

from __future__ import annotations

from typing import Any

from fsspec import AbstractFileSystem

import gpufeed
from gpufeed.cache.blockfile import as_bytes
from gpufeed.client import FeedFile, FeedWriter
from gpufeed.errors import InvalidArgument
from gpufeed.paths import FileStat


def _info(item: FileStat) -> dict[str, Any]:
    return {
        "name": item.path,
        "size": item.size,
        "type": "directory" if item.is_dir else "file",
        "mtime": item.mtime,
        "version": item.version,
    }


class GpufeedFileSystem(AbstractFileSystem):
    """The gpufeed namespace; listings come from the manifest. Directories are implied by the
    files in them (object stores have none), so `mkdir` has nothing to do."""

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

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> FeedFile | FeedWriter:
        if mode not in ("rb", "wb"):
            raise InvalidArgument(f"gpufeed://{path}: mode {mode!r} is not supported (rb, or wb on a writable mount)")
        return gpufeed.client().open(self._strip_protocol(path), mode, sync=bool(kwargs.get("sync", False)))

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        gpufeed.write(self._strip_protocol(path), value)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        gpufeed.write(self._strip_protocol(path2), self.cat_file(path1))

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None, **kwargs: Any) -> None:
        """A file's bytes under a new path (object stores have no rename: a copy, then a delete)."""
        if recursive or self.isdir(path1):
            super().mv(path1, path2, recursive=True, maxdepth=maxdepth, **kwargs)
            return
        self.cp_file(path1, path2)
        self.rm_file(path1)

    def rm_file(self, path: str) -> None:
        gpufeed.remove(self._strip_protocol(path))

    def _rm(self, path: str) -> None:
        self.rm_file(path)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        pass

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        pass
