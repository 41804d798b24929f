"""PyTorch datasets over namespace files: every sample is one file, read through the one read
path (`Client.read_range`) of the process asking, so DataLoader workers read cache hits with
an open+pread and send misses to the node agent."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import torch.utils.data

import gpufeed
from gpufeed.cache.blockfile import as_bytes
from gpufeed.errors import InvalidArgument
from gpufeed.integrations.torch.distributed import rank_and_world
from gpufeed.integrations.torch.index import FileIndex, PathTable, Roots, roots_of
from gpufeed.integrations.torch.labels import FolderLabels
from gpufeed.integrations.torch.order import Shard, non_negative_int, shard_order
from gpufeed.integrations.torch.prefetching import ProcessPrefetcher
from gpufeed.prefetch import Read
from gpufeed.shuffle import DEFAULT_WINDOW, Shuffle, shuffle_mode

T = TypeVar("T")


class FeedDataset(torch.utils.data.Dataset, Generic[T]):
    """Map-style: item i is the bytes of file i, or `transform(bytes)`; with `target`, the pair
    (item, `target(path)`). `target="folder"` labels each file by the folder it lies under one
    level below the root, as torchvision's ImageFolder does (`classes`, `class_to_idx`). The
    files are listed once, from the manifest, when the dataset is built; `paths` and `sizes`
    index them.

    A sample's bytes are handed to `transform` as the read returned them: a small file's bytes
    object itself, never a copy of it."""

    def __init__(
        self,
        paths_or_dir: Roots,
        transform: Callable[[bytes], T] | None = None,
        *,
        target: Callable[[str], Any] | Literal["folder"] | None = None,
    ) -> None:
        self.index = FileIndex.build(paths_or_dir, gpufeed.client())
        self.transform = transform
        if target == "folder":
            roots = roots_of(paths_or_dir)
            one_dir = isinstance(paths_or_dir, str | os.PathLike)
            target = FolderLabels(self.index.paths, roots[0], ()) if one_dir else FolderLabels(self.index.paths, None, roots)
        elif target is not None and not callable(target):
            raise InvalidArgument(f"target={target!r}: expected a function of the path, or 'folder'")
        self.target: Callable[[str], Any] | None = target

    @property
    def classes(self) -> list[str]:
        """With `target="folder"`: the class names, in label order."""
        return self.target.classes if isinstance(self.target, FolderLabels) else []

    @property
    def class_to_idx(self) -> dict[str, int]:
        return self.target.class_to_idx if isinstance(self.target, FolderLabels) else {}

    @property
    def paths(self) -> PathTable:
        return self.index.paths

    @property
    def sizes(self) -> np.ndarray:
        return self.index.sizes

    @property
    def blocks(self) -> np.ndarray:
        """Per sample, an id of the cache block its file starts in: equal for members of a
        packed mount that share a block, distinct otherwise. `shuffle="block"` groups by it."""
        return self.index.blocks

    def __len__(self) -> int:
        return len(self.index)

    def read_of(self, i: int) -> Read:
        """What reading sample `i` fetches: the prefetcher's view of this dataset."""
        return self.index.read_of(i)

    def read(self, i: int) -> bytes:
        """The bytes of file `i`, at the version the manifest lists."""
        return gpufeed.client().read(self.paths[i])

    def __getitem__(self, i: int) -> Any:
        path = self.paths[i]
        data = gpufeed.client().read(path)
        item = data if self.transform is None else self.transform(data)
        return item if self.target is None else (item, self.target(path))

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A DataLoader worker's whole batch (PyTorch calls this instead of one `__getitem__`
        per index): its cache misses are fetched together, not one round trip per sample."""
        paths = [self.paths[i] for i in indices]
        data = [as_bytes(piece) for piece in gpufeed.client().read_files(paths)]
        items: list[Any] = data if self.transform is None else [self.transform(item) for item in data]
        if self.target is None:
            return items
        target = self.target
        return [(item, target(path)) for item, path in zip(items, paths, strict=True)]


class FeedIterableDataset(torch.utils.data.IterableDataset, Generic[T]):
    """Streams the files, epoch by epoch, in index order or, with `shuffle`, in the order of
    `epoch_permutation(seed, epoch, n)`, which every rank computes alike. Rank r of W reads
    positions r, r+W, r+2W, ... of that order, split round-robin between its DataLoader workers.
    Every rank reads the same number of files, so DDP ranks run the same number of steps and
    none waits forever in a collective: without `drop_last` the order is padded by wrapping
    around to its first files, as DistributedSampler does; with it the tail that does not fill
    a round of W files is dropped. `len()` is this rank's share.

    Rank and world size are those of the process that starts the iteration: read when it
    begins, or, in a worker started by spawn or forkserver (where torch.distributed is not
    initialised), taken along when the DataLoader sends the dataset to its workers. With
    `prefetch`, each reader's upcoming files are fetched ahead. `transform` and `target` are
    FeedDataset's. `shuffle="block"` reads in the block-aware order (see FeedSampler), with
    `shuffle_window`."""

    def __init__(
        self,
        paths_or_dir: Roots,
        transform: Callable[[bytes], T] | None = None,
        *,
        target: Callable[[str], Any] | Literal["folder"] | None = None,
        shuffle: bool | str = False,
        seed: int = 0,
        drop_last: bool = False,
        prefetch: bool = True,
        shuffle_window: int = DEFAULT_WINDOW,
    ) -> None:
        self.shuffle: Shuffle = shuffle_mode(shuffle, shuffle_window)
        self.shuffle_window = shuffle_window
        self.files: FeedDataset[T] = FeedDataset(paths_or_dir, transform, target=target)
        self.seed = non_negative_int(seed, "seed")
        self.drop_last = bool(drop_last)
        self.prefetch = prefetch
        # Shared memory, so persistent DataLoader workers, which keep the copy of the dataset
        # they were sent at the first epoch, see the epoch set_epoch selects afterwards.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self._prefetcher = ProcessPrefetcher()
        self._ranks: tuple[int, int] | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads."""
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration reads; with `shuffle`, each epoch has its own order."""
        self._epoch.fill_(non_negative_int(epoch, "epoch"))

    def _rank_and_world(self) -> tuple[int, int]:
        return self._ranks or rank_and_world()

    def _shard(self) -> Shard:
        rank, world = self._rank_and_world()
        return Shard(len(self.files), 0, rank, world, self.drop_last)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ranks": self._rank_and_world()}

    def __len__(self) -> int:
        return self._shard().count

    def __iter__(self) -> Iterator[bytes | T]:
        shard = self._shard()
        worker = torch.utils.data.get_worker_info()
        worker_id, workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        order = shard_order(self.seed, self.epoch, shard, self.shuffle, self.shuffle_window, self.files.blocks)
        mine: Iterator[int] = iter(order[worker_id::workers].tolist())
        if self.prefetch:
            mine = self._prefetcher.ahead(mine, self.files.read_of)
        for i in mine:
            yield self.files[i]
