"""fsspec protocol `gpufeed://`: pandas, pyarrow and any fsspec user read through the one read path,
and write to writable mounts through the one write path (`client.writer`).

    import pandas
    pandas.read_parquet("gpufeed:///data/table.parquet")
    frame.to_parquet("gpufeed:///out/table.parquet")   # a mount added with --writable

Registered through the `fsspec.specs` entry point, so no import is needed before use.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fsspec import AbstractFileSystem

import gpufeed
from gpufeed.cache.blockfile import as_bytes
from gpufeed.client import Client, FeedFile, FeedWriter, ObjectHandle
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

    def modified(self, path: str) -> datetime:
        """The file's modification time at its store, as listed (UTC)."""
        return datetime.fromtimestamp(gpufeed.stat(self._strip_protocol(path)).mtime, UTC)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        client = gpufeed.client()
        handle = client.handle(self._strip_protocol(path))
        return as_bytes(client.read_range(handle, *_bounds(handle, start, end)))

    def cat_ranges(
        self, paths: list[str], starts: int | None | list[int | None], ends: int | None | list[int | None],
        max_gap: int | None = None, on_error: str = "return", **kwargs: Any,
    ) -> list[bytes | Exception]:
        """The ranges read as one batch (`Client.read_many`): the misses of all of them are
        fetched together, as a DataLoader batch's are, not one round trip to the store after
        another (fsspec's default, which reads them one by one). A range that fails is its own
        error (`on_error="return"`) or raises."""
        if max_gap is not None:
            raise NotImplementedError("max_gap")
        starts = starts if isinstance(starts, list) else [starts] * len(paths)
        ends = ends if isinstance(ends, list) else [ends] * len(paths)
        if len(starts) != len(paths) or len(ends) != len(paths):
            raise ValueError("cat_ranges: paths, starts and ends differ in length")
        client = gpufeed.client()
        out: list[bytes | Exception] = [b""] * len(paths)
        reads: list[tuple[ObjectHandle, int, int]] = []
        numbers: list[int] = []
        for n, (path, start, end) in enumerate(zip(paths, starts, ends, strict=True)):
            try:
                handle = client.handle(self._strip_protocol(path))
            except Exception as exc:
                if on_error != "return":
                    raise
                out[n] = exc
                continue
            reads.append((handle, *_bounds(handle, start, end)))
            numbers.append(n)
        for n, data in zip(numbers, _read_batch(client, reads, on_error), strict=True):
            out[n] = as_bytes(data) if isinstance(data, memoryview) else data
        return out

    def cat(self, path: str | list[str], recursive: bool = False, on_error: str = "raise", **kwargs: Any) -> Any:
        """fsspec's `cat`, its files read as one batch (`cat_ranges`)."""
        paths = self.expand_path(path, recursive=recursive)
        if len(paths) == 1 and not isinstance(path, list) and paths[0] == self._strip_protocol(path):
            return self.cat_file(paths[0])
        out = {}
        for name, data in zip(paths, self.cat_ranges(paths, None, None, on_error="return"), strict=True):
            if isinstance(data, Exception):
                if on_error == "raise":
                    raise data
                if on_error == "omit":
                    continue
            out[name] = data
        return out

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> FeedFile | FeedWriter:
        if mode not in ("rb", "wb"):
            raise InvalidArgument(f"gpufeed://{path}: mode {mode!r} is not supported (rb, or wb on a writable mount)")
        return gpufeed.client().open(self._strip_protocol(path), mode, sync=bool(kwargs.get("sync", False)))

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        gpufeed.write(self._strip_protocol(path), value)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        """A file's bytes under a new path. A directory, which a recursive copy names too, is
        nothing to copy: an object store's directories are those its keys imply."""
        if not self.isdir(path1):
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

    def rm(self, path: str | list[str], recursive: bool = False, maxdepth: int | None = None) -> None:
        """The files under `path` removed one by one (with `recursive`); each directory goes with
        its last file. Without `recursive`, a directory is refused, as `rm` refuses one."""
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        for one in reversed([p for p in paths if not recursive or not self.isdir(p)]):
            self.rm_file(one)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        pass

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        pass


def _bounds(handle: ObjectHandle, start: int | None, end: int | None) -> tuple[int, int]:
    """fsspec's range: None for either end of the file, negative offsets from its end."""
    start, end = start or 0, handle.size if end is None else end
    return (start + handle.size if start < 0 else start), (end + handle.size if end < 0 else end)


def _read_batch(client: Client, reads: list[tuple[ObjectHandle, int, int]], on_error: str) -> list[memoryview | Exception]:
    """`read_many`; when one read fails the batch, each read alone, for its own bytes or error."""
    try:
        return list(client.read_many(reads))
    except Exception:
        if on_error != "return":
            raise
    got: list[memoryview | Exception] = []
    for read in reads:
        try:
            got.append(client.read_range(*read))
        except Exception as exc:
            got.append(exc)
    return got
