"""The epoch order and the sharding math, as the pure functions they are."""

from __future__ import annotations

from collections import Counter
from itertools import chain

import numpy as np
import pytest

from gpufeed.errors import InvalidArgument
from gpufeed.integrations.torch import Shard, epoch_permutation


def test_permutation_is_a_pure_function_of_seed_epoch_and_size() -> None:
    first = epoch_permutation(7, 3, 1000)
    assert np.array_equal(first, epoch_permutation(7, 3, 1000))
    assert sorted(first.tolist()) == list(range(1000))
    assert not np.array_equal(first, epoch_permutation(7, 4, 1000))
    assert not np.array_equal(first, epoch_permutation(8, 3, 1000))
    assert not np.array_equal(epoch_permutation(0, 1, 1000), epoch_permutation(1, 0, 1000))
    assert epoch_permutation(7, 3, 5, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def taken(n: int, start: int, world: int, drop_last: bool = False) -> list[list[int]]:
    return [Shard(n, start, rank, world, drop_last).positions().tolist() for rank in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_world_sizes_cover_every_position_exactly_once(world: int) -> None:
    shares = taken(60, 0, world)
    assert sorted(chain(*shares)) == list(range(60))
    assert {len(share) for share in shares} == {60 // world}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_uneven_rest_is_padded_from_its_start_or_dropped(world: int) -> None:
    n, start = 61, 10
    padded = Counter(chain(*taken(n, start, world)))
    pad = -(61 - 10) % world
    assert set(padded) == set(range(start, n))
    assert sorted(p for p, c in padded.items() if c > 1) == list(range(start, start + pad))
    assert len({len(share) for share in taken(n, start, world)}) == 1
    dropped = chain(*taken(n, start, world, drop_last=True))
    assert sorted(dropped) == list(range(start, start + (n - start) // world * world))


def test_elastic_continuation_from_two_to_three_ranks() -> None:
    n, consumed = 62, 7
    before = [Shard(n, 0, rank, 2).positions()[:consumed].tolist() for rank in range(2)]
    position = Shard(n, 0, 0, 2).position_after(consumed)
    after = taken(n, position, 3)
    assert position == 14
    assert sorted(chain(*before, *after)) == list(range(n))


def test_position_after_stops_at_the_end() -> None:
    shard = Shard(61, 0, 1, 3)
    assert shard.count == 21 and shard.position_after(21) == 61
    assert Shard(61, 0, 1, 3, drop_last=True).position_after(20) == 60
    assert Shard(61, 61, 0, 3).positions().tolist() == []


@pytest.mark.parametrize(
    "args",
    [(10, 0, 2, 2), (10, 0, -1, 2), (10, 0, 0, 0), (10, 11, 0, 1), (10, -1, 0, 1)],
)
def test_bad_shards_are_refused(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(InvalidArgument):
        Shard(*args)


def test_negative_seed_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="seed -1"):
        epoch_permutation(-1, 0, 10)
