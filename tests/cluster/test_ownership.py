"""Rendezvous ownership: every node computes the same owners; a join or a leave moves about
1/N of the blocks and nothing else; load follows weight."""

from __future__ import annotations

from collections import Counter

from gpufeed.cluster.ownership import Node, owners

BLOCKS = [f"{i:08x}-{i % 7}" for i in range(20_000)]


def nodes(n: int, weight: float = 1.0) -> list[Node]:
    return [Node(f"node{i}", f"10.0.0.{i}:7000", weight) for i in range(n)]


def test_owners_do_not_depend_on_the_order_nodes_are_listed_in() -> None:
    members = nodes(5)
    for block in BLOCKS[:500]:
        assert owners(block, members, 2) == owners(block, list(reversed(members)), 2)


def test_load_is_even_within_ten_percent() -> None:
    load = Counter(owners(block, nodes(4))[0].id for block in BLOCKS)
    mean = len(BLOCKS) / 4
    assert max(load.values()) <= 1.1 * mean and min(load.values()) >= 0.9 * mean, load


def test_a_join_moves_about_one_nth_and_only_to_the_new_node() -> None:
    before = {block: owners(block, nodes(4))[0].id for block in BLOCKS}
    after = {block: owners(block, nodes(5))[0].id for block in BLOCKS}
    moved = [block for block in BLOCKS if before[block] != after[block]]
    assert all(after[block] == "node4" for block in moved), "blocks move only to the node that joined"
    assert 0.15 <= len(moved) / len(BLOCKS) <= 0.25, len(moved)


def test_a_leave_moves_only_the_leavers_blocks_and_replicas_fail_over() -> None:
    members = nodes(4)
    survivors = [node for node in members if node.id != "node2"]
    for block in BLOCKS[:2000]:
        first, second = owners(block, members, 2)
        now = owners(block, survivors, 1)[0]
        if first.id != "node2":
            assert now == first, "a block the leaver did not own stays where it was"
        else:
            assert now == second, "the second owner takes over the leaver's blocks"


def test_weight_sets_the_share() -> None:
    members = [Node("big", "a:1", 3.0), Node("small", "b:1", 1.0)]
    load = Counter(owners(block, members)[0].id for block in BLOCKS)
    assert 0.72 <= load["big"] / len(BLOCKS) <= 0.78, load
