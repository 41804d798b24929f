"""FeedSampler: the epoch's order, this rank's share of it, prefetch of what comes next, and a
resume state that counts what the training loop consumed.

The state is (epoch, global position): every sample before the position in the epoch's
permutation was consumed by some rank, none after it (see `order.py`). A DataLoader pulls
indices from its sampler well ahead of the training loop (prefetch_factor × workers batches),
so what the sampler handed out is not what was consumed: the loop side says what it consumed
through `mark_consumed`, which `FeedLoader` calls for every batch it hands out. State taken
from any rank stands for all of them, because DDP ranks step in lockstep. A sampler that
handed out indices but was never told about consumption refuses to give a state rather than
give a wrong one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.utils.data
import xxhash

from gpufeed.errors import InvalidArgument
from gpufeed.integrations.torch.distributed import rank_and_world
from gpufeed.integrations.torch.order import Shard, non_negative_int
from gpufeed.integrations.torch.prefetching import ProcessPrefetcher
from gpufeed.shuffle import BLOCK, DEFAULT_WINDOW, Shuffle, epoch_order, shuffle_mode

STATE_KEYS = ("epoch", "position", "seed", "shuffle", "size")


def _groups_of(dataset: Sized) -> np.ndarray:
    """The cache-block id of each sample, which the block-aware shuffle groups by."""
    groups = getattr(dataset, "blocks", None)
    if not isinstance(groups, np.ndarray) or groups.shape != (len(dataset),):
        raise InvalidArgument(
            f"FeedSampler(shuffle={BLOCK!r}) needs a dataset with `blocks`, one cache-block id per sample, "
            f"such as FeedDataset; {type(dataset).__name__} has none"
        )
    return groups


@dataclass
class _Run:
    """One pass over this rank's shard of an epoch."""

    epoch: int
    shard: Shard
    consumed: int = 0
    handed: int = 0


class FeedSampler(torch.utils.data.Sampler[int]):
    """Sample indices for this rank, epoch by epoch: the permutation is a pure function of
    (seed, epoch, len(dataset)); rank and world size are read when iteration starts. With
    `prefetch` (needs a dataset with `read_of`, such as FeedDataset), the files of upcoming
    indices are fetched into the node cache ahead of the reads.

    `shuffle=True` is an exact per-sample shuffle; `shuffle="block"` the block-aware one for
    packed mounts (`gpufeed.shuffle.block_permutation`, over the dataset's `blocks`): the
    cache blocks in a random order, each sample moved within `shuffle_window` blocks of it,
    so each block is fetched about once an epoch with a cache of a few blocks, for less
    randomness."""

    def __init__(
        self,
        dataset: Sized,
        shuffle: bool | str = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        prefetch: bool = True,
        shuffle_window: int = DEFAULT_WINDOW,
    ) -> None:
        if prefetch and not callable(getattr(dataset, "read_of", None)):
            raise InvalidArgument(
                f"FeedSampler(prefetch=True) needs a dataset with read_of(i), such as FeedDataset; "
                f"{type(dataset).__name__} has none: pass prefetch=False"
            )
        self.dataset = dataset
        self.size = len(dataset)
        self.shuffle: Shuffle = shuffle_mode(shuffle, shuffle_window)
        self.shuffle_window = shuffle_window
        self._groups = _groups_of(dataset) if self.shuffle == BLOCK else None
        self._layout = None if self._groups is None else xxhash.xxh3_64_hexdigest(np.ascontiguousarray(self._groups).tobytes())
        """A digest of which samples share a block: a block-aware order depends on it, so a
        state saved over another layout (the mount's block size changed, files added) is refused."""
        self.seed = non_negative_int(seed, "seed")
        self.drop_last = bool(drop_last)
        self.prefetch = prefetch
        self.epoch = 0
        self._resume = 0
        self._run: _Run | None = None
        self._tracked = False
        self._prefetcher = ProcessPrefetcher()

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration reads. A position loaded for this same epoch is
        kept; any other epoch starts at its beginning."""
        epoch = non_negative_int(epoch, "epoch")
        if epoch != self.epoch:
            self.epoch, self._resume = epoch, 0

    def mark_consumed(self, samples: int) -> None:
        """Tell the sampler the training loop consumed `samples` more of this rank's samples of
        the current iteration. FeedLoader calls it; call it yourself when you drive the sampler
        in another way (0 just declares that you will)."""
        samples = non_negative_int(samples, "consumed samples")
        self._tracked = True
        if self._run is not None:
            self._run.consumed = min(self._run.shard.count, self._run.consumed + samples)

    @property
    def position(self) -> int:
        """The global position in the current epoch's permutation up to which samples were consumed."""
        run = self._run
        if run is None or run.epoch != self.epoch:
            return self._resume
        if run.handed and not self._tracked:
            raise InvalidArgument(
                "FeedSampler cannot tell how far the training loop got: the DataLoader reads indices ahead "
                "of it; iterate through gpufeed.integrations.torch.FeedLoader, or call sampler.mark_consumed(n) per batch"
            )
        return run.shard.position_after(run.consumed)

    @property
    def _window(self) -> int | None:
        """The window the order depends on: none for an exact shuffle."""
        return self.shuffle_window if self.shuffle == BLOCK else None

    def state_dict(self) -> dict[str, Any]:
        """(epoch, position) and what the order depends on; `shuffle_window` only for a
        block-aware shuffle, so an exact one's state is what it was before there were two."""
        state = {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle, "size": self.size}
        return state if self._window is None else {**state, "shuffle_window": self._window, "block_layout": self._layout}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` says, with any world size or number of DataLoader workers: the
        next iteration of the state's epoch starts at its position."""
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise InvalidArgument(f"FeedSampler state lacks {', '.join(missing)}: not a FeedSampler.state_dict()")
        expected = (
            ("size", self.size), ("seed", self.seed), ("shuffle", self.shuffle), ("shuffle_window", self._window),
            ("block_layout", self._layout),
        )
        for key, mine in expected:
            if state.get(key) != mine:  # an exact shuffle's state has no shuffle_window or block_layout
                raise InvalidArgument(
                    f"FeedSampler state has {key}={state.get(key)!r} but this sampler has {key}={mine!r}: "
                    "resuming would read another order"
                )
        epoch = non_negative_int(state["epoch"], "epoch")
        position = non_negative_int(state["position"], "position")
        if position > self.size:
            raise InvalidArgument(f"FeedSampler state position {position} is past the epoch's {self.size} samples")
        self.epoch, self._resume, self._run = epoch, position, None

    def _next_shard(self) -> Shard:
        rank, world = rank_and_world()
        return Shard(self.size, self._resume, rank, world, self.drop_last)

    def __len__(self) -> int:
        run = self._run
        return run.shard.count if run is not None and run.epoch == self.epoch else self._next_shard().count

    def __iter__(self) -> Iterator[int]:
        shard = self._next_shard()
        self._resume = 0
        run = self._run = _Run(self.epoch, shard)
        order = epoch_order(self.seed, self.epoch, self.size, self.shuffle, self.shuffle_window, self._groups)
        return self._hand_out(run, order[shard.positions()].tolist())

    def _hand_out(self, run: _Run, indices: list[int]) -> Iterator[int]:
        items: Iterator[int] = iter(indices)
        if self.prefetch:
            items = self._prefetcher.ahead(items, self.dataset.read_of)  # type: ignore[attr-defined]
        for index in items:
            run.handed += 1
            yield index
