"""PyTorch datasets over namespace files: every sample is one file, read through the one read
path (`Client.read_range`) of the process asking, so DataLoader workers read cache hits with
an open+pread and send misses to the node agent."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch.utils.data

import gpufeed
from gpufeed.prefetch import Read
from gpufeed.torch.distributed import rank_and_world
from gpufeed.torch.index import FileIndex, PathTable
from gpufeed.torch.prefetching import ProcessPrefetcher

T = TypeVar("T")


class FeedDataset(torch.utils.data.Dataset, Generic[T]):
    """Map-style: item i is the bytes of file i, or `transform(bytes)`. The files are listed once,
    from the manifest, when the dataset is built; `paths` and `sizes` index them."""

    def __init__(self, paths_or_dir: str | Sequence[str], transform: Callable[[bytes], T] | None = None) -> None:
        self.index = FileIndex.build(paths_or_dir, gpufeed.client())
        self.transform = transform

    @property
    def paths(self) -> PathTable:
        return self.index.paths

    @property
    def sizes(self) -> np.ndarray:
        return self.index.sizes

    def __len__(self) -> int:
        return len(self.index)

    def read_of(self, i: int) -> Read:
        """What reading sample `i` fetches: the prefetcher's view of this dataset."""
        return self.index.read_of(i)

    def read(self, i: int) -> bytes:
        """The bytes of file `i`, at the version the manifest lists."""
        client = gpufeed.client()
        handle = client.handle(self.paths[i])
        return bytes(client.read_range(handle, 0, handle.size))

    def __getitem__(self, i: int) -> bytes | T:
        data = self.read(i)
        return data if self.transform is None else self.transform(data)


class FeedIterableDataset(torch.utils.data.IterableDataset, Generic[T]):
    """Streams the files in index order. Rank r of W reads files r, r+W, r+2W, ..., split
    round-robin between its DataLoader workers. Rank and world size are those of the process
    that starts the iteration: read when it begins, or, in a worker started by spawn or
    forkserver (where torch.distributed is not initialised), taken along when the DataLoader
    sends the dataset to its workers. Together the readers read every file once; with
    `prefetch`, each reader's upcoming files are fetched ahead. `len()` is this rank's share."""

    def __init__(
        self, paths_or_dir: str | Sequence[str], transform: Callable[[bytes], T] | None = None, *, prefetch: bool = True
    ) -> None:
        self.files: FeedDataset[T] = FeedDataset(paths_or_dir, transform)
        self.prefetch = prefetch
        self._prefetcher = ProcessPrefetcher()
        self._ranks: tuple[int, int] | None = None

    def _rank_and_world(self) -> tuple[int, int]:
        return self._ranks or rank_and_world()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ranks": self._rank_and_world()}

    def __len__(self) -> int:
        rank, world = self._rank_and_world()
        return len(range(rank, len(self.files), world))

    def __iter__(self) -> Iterator[bytes | T]:
        rank, world = self._rank_and_world()
        worker = torch.utils.data.get_worker_info()
        worker_id, workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        mine: Iterator[int] = iter(range(rank + world * worker_id, len(self.files), world * workers))
        if self.prefetch:
            mine = self._prefetcher.ahead(mine, self.files.read_of)
        for i in mine:
            yield self.files[i]
