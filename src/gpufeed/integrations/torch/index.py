"""The file index of a dataset: namespace paths and sizes, listed once from the manifest.

A million paths as a million Python strings would be copied into every forked DataLoader
worker page by page (each access writes a reference count) and pickled one by one for spawn.
Here they are two numpy arrays, one UTF-8 buffer and its offsets, plus one array of sizes:
forked workers share the pages and spawn pickles three buffers.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import index as as_index

import numpy as np

from gpufeed import arguments
from gpufeed.client import Client
from gpufeed.errors import InvalidArgument
from gpufeed.mount_options import CachePolicy
from gpufeed.paths import FileStat
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


Roots = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
"""A dataset's directory, or a list of its files and directories (`FeedDataset`)."""


def roots_of(paths_or_dir: Roots) -> list[str]:
    """A dataset's directory, or its list of files and directories, as namespace paths."""
    if isinstance(paths_or_dir, str | os.PathLike):
        return [arguments.path(paths_or_dir, "FeedDataset")]
    if isinstance(paths_or_dir, Sequence) and all(isinstance(p, str | os.PathLike) for p in paths_or_dir):
        if not paths_or_dir:
            raise InvalidArgument("an empty list of paths: give a namespace directory or at least one file")
        return [arguments.path(p, "FeedDataset") for p in paths_or_dir]
    raise InvalidArgument(f"{paths_or_dir!r}: expected a namespace path or a list of them, e.g. '/data/train'")


class _Blocks:
    """Dense ids of the cache blocks files start in, handed out as the listing goes: a pack
    member's id is its shard's block (members of one block share it, known from the manifest
    entry alone), any other file gets an id of its own."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self._ids: dict[tuple[str, str, int], int] = {}
        self._block_sizes: dict[str, int] = {}
        self._next = 0

    def of(self, item: FileStat) -> int:
        info = item.info
        if info is None or info.pack_key is None:
            self._next += 1
            return self._next - 1
        mount = item.path[: len(item.path) - len(info.key) - 1]
        block_size = self._block_sizes.get(mount) or self._block_size(mount)
        key = (mount, info.pack_key, (info.pack_offset or 0) // block_size)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = self._next
            self._next += 1
        return found

    def of_members(self, mount: str, shards: list[str], shard_of: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """`of` for a run of a packed mount's members (shard numbers, offsets in the shard), the
        ids handed out in the order their blocks first appear, as `of` would one by one."""
        block_size = self._block_sizes.get(mount) or self._block_size(mount)
        keys = shard_of * (1 << 40) + offsets // block_size
        unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        ids = np.empty(len(unique), dtype=np.int64)
        for u in np.argsort(first, kind="stable").tolist():
            key = (mount, shards[int(unique[u]) >> 40], int(unique[u]) & ((1 << 40) - 1))
            found = self._ids.get(key)
            if found is None:
                found = self._ids[key] = self._next
                self._next += 1
            ids[u] = found
        return ids[inverse.reshape(-1)]

    def _block_size(self, mount: str) -> int:
        where = self._client.namespace.resolve(mount)
        if where is None:
            raise InvalidArgument(f"{mount}: pack member outside every mount")
        size = self._block_sizes[mount] = CachePolicy.of(where.mount, self._client.settings).block_size
        return size


@dataclass(frozen=True)
class FileIndex:
    """Every file under the given namespace paths, in manifest order (directories expand to the
    files below them, files stand for themselves). `blocks[i]` names the cache block file i
    starts in (see `_Blocks`), which the block-aware shuffle groups samples by."""

    paths: PathTable
    sizes: np.ndarray
    blocks: np.ndarray

    @classmethod
    def build(cls, paths_or_dir: Roots, client: Client) -> FileIndex:
        roots = roots_of(paths_or_dir)
        blobs: list[bytes] = []
        ends: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        blocks: list[np.ndarray] = []
        block_of = _Blocks(client)
        done = 0
        for root in roots:
            packed = client.namespace.member_files(root)
            if packed is not None:  # a pack's directory: its member table's columns, no object per file
                mount, members, files = packed
                blob, root_ends, root_sizes, shard_of, offsets = members.columns(files, f"{mount.path}/".encode())
                blocks.append(block_of.of_members(mount.path, members.shards, shard_of, offsets))
            else:
                paths, lengths, listed, ids = bytearray(), array("q"), array("q"), array("q")
                for item in client.walk(root):
                    encoded = item.path.encode()
                    paths += encoded
                    lengths.append(len(encoded))
                    listed.append(item.size)
                    ids.append(block_of.of(item))
                blob, root_sizes = bytes(paths), np.frombuffer(listed, dtype=np.int64)
                root_ends = np.cumsum(np.frombuffer(lengths, dtype=np.int64))
                blocks.append(np.frombuffer(ids, dtype=np.int64))
            blobs.append(blob)
            ends.append(root_ends + done)
            sizes.append(root_sizes)
            done += len(blob)
        if not sum(map(len, sizes)):
            raise InvalidArgument(f"{', '.join(roots)}: no files to read")
        offsets_all = np.concatenate([np.zeros(1, dtype=np.int64), *ends])
        paths_all = PathTable(np.frombuffer(b"".join(blobs), dtype=np.uint8), offsets_all)
        return cls(paths_all, np.concatenate(sizes), np.concatenate(blocks))

    def __len__(self) -> int:
        return len(self.sizes)

    def read_of(self, i: int) -> Read:
        """The bytes sample `i` reads: its whole file."""
        i = checked_index(i, len(self.sizes))
        return Read(self.paths[i], 0, int(self.sizes[i]))
