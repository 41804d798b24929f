"""The epoch's sample order and each rank's share of it, as pure functions of their inputs.

A position indexes the epoch's permutation. Rank r of W takes positions start+r, start+r+W,
start+r+2W, ... so once every rank has consumed k samples, exactly the prefix [0, start+k·W)
of the permutation is done. That one number, the global position, is the whole resume state,
and a run with any other world size continues from it without repeating or skipping a sample.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpufeed.errors import InvalidArgument
from gpufeed.shuffle import Shuffle, epoch_order, epoch_permutation

__all__ = ["Shard", "epoch_permutation", "non_negative_int", "shard_order"]


def non_negative_int(value: Any, what: str) -> int:
    """Seeds, epochs and positions come from user code and checkpoints: integers, numpy's too
    (as DistributedSampler takes them), nothing else."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InvalidArgument(f"{what} {value!r}: expected an integer >= 0")
    return int(value)


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `world`'s part of an epoch of `n` samples continued from global position
    `start`. Without `drop_last` every rank reads ceil(rest/world) samples, the last ones padded
    from the start of the rest, as DistributedSampler does, so ranks step in lockstep; with it the
    tail that does not fill a round of `world` samples is dropped."""

    n: int
    start: int
    rank: int
    world: int
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise InvalidArgument(f"rank {self.rank} of world size {self.world}: need world size >= 1 and 0 <= rank < world size")
        if not 0 <= self.start <= self.n:
            raise InvalidArgument(f"position {self.start} is outside an epoch of {self.n} samples")

    @property
    def count(self) -> int:
        """How many samples this rank reads."""
        rest = self.n - self.start
        return rest // self.world if self.drop_last else -(-rest // self.world)

    @property
    def end(self) -> int:
        """The global position once every rank has read its `count`."""
        return self.start + self.count * self.world if self.drop_last else self.n

    def positions(self) -> np.ndarray:
        """The permutation positions this rank reads, in order."""
        rest = self.n - self.start
        if rest == 0:
            return np.empty(0, dtype=np.int64)
        return self.start + (self.rank + self.world * np.arange(self.count, dtype=np.int64)) % rest

    def position_after(self, consumed: int) -> int:
        """The global position once every rank has consumed `consumed` of its samples."""
        return min(self.end, self.start + consumed * self.world)


def shard_order(
    seed: int, epoch: int, shard: Shard, shuffle: Shuffle = True, window: int = 1, groups: np.ndarray | None = None
) -> np.ndarray:
    """The sample indices `shard` reads in epoch `epoch`, in order: its positions looked up in
    the epoch's permutation (`gpufeed.shuffle.epoch_order`), which every rank computes alike."""
    return epoch_order(seed, epoch, shard.n, shuffle, window, groups)[shard.positions()]
