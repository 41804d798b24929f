"""S3-FIFO as a pure data structure: admission, promotion, ghosts, protection, scan resistance."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from gpufeed.cache.eviction import S3Fifo


def test_new_blocks_enter_small_and_unread_ones_leave_first() -> None:
    policy = S3Fifo()
    for i in range(10):
        policy.insert(f"b{i}", 100)
    policy.access("b0")
    victims = policy.victims(500)
    assert "b0" not in victims and len(victims) == 5
    assert policy.bytes == 500
    assert "b0" in policy.main


def test_ghost_hit_goes_straight_to_main() -> None:
    policy = S3Fifo()
    policy.insert("a", 10)
    assert policy.victims(0) == ["a"]
    policy.insert("a", 10)
    assert "a" in policy.main


def test_protected_blocks_are_never_chosen() -> None:
    policy = S3Fifo()
    for i in range(5):
        policy.insert(f"b{i}", 10)
    victims = policy.victims(0, frozenset({"b2"}))
    assert sorted(victims) == ["b0", "b1", "b3", "b4"]
    assert policy.bytes == 10 and "b2" in policy


def test_copies_of_other_nodes_blocks_go_first_even_when_newer_and_read() -> None:
    policy = S3Fifo()
    for i in range(5):
        policy.insert(f"own{i}", 100)
    for i in range(4):
        policy.insert(f"copy{i}", 100, copy=True)
        policy.access(f"copy{i}")
    assert policy.bytes == 900 and len(policy) == 9
    assert policy.victims(600, frozenset({"copy1"})) == ["copy0", "copy2", "copy3"], "oldest first, protected kept"
    assert policy.victims(400) == ["copy1", "own0"], "the last copy, then S3-FIFO's own choice"
    policy.remove("own1")
    assert policy.bytes == 300 and "copy1" not in policy


def test_remove_and_reinsert_keep_byte_counts_exact() -> None:
    policy = S3Fifo()
    policy.insert("x", 7)
    policy.insert("x", 7)
    assert policy.bytes == 7 and len(policy) == 1
    policy.remove("x")
    policy.remove("x")
    assert policy.bytes == 0 and len(policy) == 0


def _later_epoch_hit_rate(orders: list[list[int]], capacity: int, lru: bool) -> float:
    resident: OrderedDict[int, None] = OrderedDict()
    policy = S3Fifo()
    hits = 0
    for epoch, order in enumerate(orders):
        for block in order:
            name = str(block)
            hit = block in resident if lru else name in policy
            if epoch > 0:
                hits += hit
            if lru:
                resident[block] = None
                resident.move_to_end(block)
                while len(resident) > capacity:
                    resident.popitem(last=False)
            elif hit:
                policy.access(name)
            else:
                policy.insert(name, 1)
                policy.victims(capacity)
        if not lru:
            assert len(policy) <= capacity
    return hits / sum(len(o) for o in orders[1:])


@pytest.mark.parametrize("shuffle", [False, True])
def test_epochs_larger_than_the_cache_hit_more_than_lru(shuffle: bool) -> None:
    """Each epoch reads all 1,000 blocks; the cache holds 500. Sequential epochs: LRU hits nothing,
    S3-FIFO keeps a resident set. Shuffled epochs: S3-FIFO still beats LRU."""
    rng = random.Random(1)
    orders = [rng.sample(range(1000), 1000) if shuffle else list(range(1000)) for _ in range(6)]
    lru = _later_epoch_hit_rate(orders, 500, lru=True)
    s3fifo = _later_epoch_hit_rate(orders, 500, lru=False)
    assert s3fifo > lru + 0.04, (s3fifo, lru)
    if not shuffle:
        assert lru == 0 and s3fifo > 0.2
