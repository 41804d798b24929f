"""The file index of a dataset: namespace paths and sizes, listed once from the manifest.

A million paths as a million Python strings would be copied into every forked DataLoader
worker page by page (each access writes a reference count) and pickled one by one for spawn.
Here they are two numpy arrays, one UTF-8 buffer and its offsets, plus one array of sizes:
forked workers share the pages and spawn pickles three buffers.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import index as as_index

import numpy as np

from gpufeed.client import Client
from gpufeed.errors import InvalidArgument
from gpufeed.prefetch import Read


class IndexOutOfRange(InvalidArgument, IndexError):
    """A sample index outside the dataset (an IndexError, as sequences raise)."""


def checked_index(i: int, n: int) -> int:
    """`i` as a plain int in [0, n), negative indexes counting from the end as in a list."""
    try:
        i = as_index(i)
    except TypeError:
        raise InvalidArgument(f"sample index {i!r}: expected an integer") from None
    if not -n <= i < n:
        raise IndexOutOfRange(f"sample index {i} is out of range for {n} files")
    return i + n if i < 0 else i


class PathTable(Sequence[str]):
    """Paths stored as one UTF-8 buffer and an offsets array; `table[i]` decodes one path."""

    def __init__(self, blob: np.ndarray, offsets: np.ndarray) -> None:
        self._blob = blob
        self._offsets = offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        i = checked_index(i, len(self))
        return self._blob[self._offsets[i] : self._offsets[i + 1]].tobytes().decode()

    def __iter__(self) -> Iterator[str]:
        return (self[i] for i in range(len(self)))


def _roots(paths_or_dir: str | Sequence[str]) -> list[str]:
    if isinstance(paths_or_dir, str):
        return [paths_or_dir]
    if isinstance(paths_or_dir, Sequence) and all(isinstance(p, str) for p in paths_or_dir):
        if not paths_or_dir:
            raise InvalidArgument("an empty list of paths: give a namespace directory or at least one file")
        return list(paths_or_dir)
    raise InvalidArgument(f"{paths_or_dir!r}: expected a namespace path or a list of them, e.g. '/data/train'")


@dataclass(frozen=True)
class FileIndex:
    """Every file under the given namespace paths, in manifest order (directories expand to the
    files below them, files stand for themselves)."""

    paths: PathTable
    sizes: np.ndarray

    @classmethod
    def build(cls, paths_or_dir: str | Sequence[str], client: Client) -> FileIndex:
        roots = _roots(paths_or_dir)
        blob = bytearray()
        offsets = array("q", [0])
        sizes = array("q")
        for root in roots:
            for item in client.walk(root):
                blob += item.path.encode()
                offsets.append(len(blob))
                sizes.append(item.size)
        if not sizes:
            raise InvalidArgument(f"{', '.join(roots)}: no files to read")
        table = PathTable(np.frombuffer(bytes(blob), dtype=np.uint8), np.frombuffer(offsets, dtype=np.int64))
        return cls(table, np.frombuffer(sizes, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.sizes)

    def read_of(self, i: int) -> Read:
        """The bytes sample `i` reads: its whole file."""
        i = checked_index(i, len(self.sizes))
        return Read(self.paths[i], 0, int(self.sizes[i]))
