"""The lease bookkeeping alone (no Ray): packing, queue order, quotas, bad requests."""

from __future__ import annotations

import pytest

from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument
from gpufeed.pool.inventory import Gpu, booking, fake, from_resources, resources
from gpufeed.pool.ledger import Ledger, Request
from gpufeed.pool.placement import cached_first

GIB = 1 << 30


def ledger(gpus_per_node: int = 1, nodes: tuple[str, ...] = ("a",), memory: int = 80 * GIB, **kw: object) -> Ledger:
    book = Ledger(**kw)  # type: ignore[arg-type]
    book.set_gpus([Gpu(n, i, memory) for n in nodes for i in range(gpus_per_node)])
    return book


def test_two_halves_share_one_gpu_and_a_third_queues() -> None:
    book = ledger()
    tickets = [book.submit(Request(0.5)) for _ in range(3)]
    granted = book.schedule()
    assert [lease.ticket for lease in granted] == tickets[:2]
    assert {(p.node, p.index, p.share, p.memory) for lease in granted for p in lease.placements} == {("a", 0, 0.5, 40 * GIB)}
    assert book.position(tickets[2]) == 1
    book.release(granted[0].lease_id)
    assert [lease.ticket for lease in book.schedule()] == [tickets[2]]


def test_memory_packs_too() -> None:
    book = ledger()
    book.submit(Request(0.25, 70 * GIB))
    waiting = book.submit(Request(0.25, 20 * GIB))
    assert len(book.schedule()) == 1 and book.position(waiting) == 1


def test_best_fit_keeps_whole_gpus_free() -> None:
    book = ledger(gpus_per_node=2)
    book.submit(Request(0.5))
    book.schedule()
    book.submit(Request(0.25))
    (second,) = book.schedule()
    assert second.placements[0].index == 0
    book.submit(Request(1.0))
    (whole,) = book.schedule()
    assert whole.placements[0].index == 1


def test_priority_first_then_fifo_no_overtaking() -> None:
    book = ledger()
    holder = book.submit(Request(1.0))
    book.schedule()
    low = book.submit(Request(0.5, priority=0))
    big = book.submit(Request(1.0, priority=5))
    high = book.submit(Request(0.5, priority=5))
    assert [book.position(t) for t in (big, high, low)] == [1, 2, 3]
    book.release(f"L{holder}")
    assert [lease.ticket for lease in book.schedule()] == [big]  # nothing overtakes the head
    book.release(f"L{big}")
    assert [lease.ticket for lease in book.schedule()] == [high, low]


def test_quota_waits_without_blocking_other_teams() -> None:
    book = ledger(gpus_per_node=2, quotas={"vision": 1.0})
    first = book.submit(Request(1.0, team="vision"))
    over = book.submit(Request(0.5, team="vision"))
    other = book.submit(Request(0.5, team="nlp"))
    assert [lease.ticket for lease in book.schedule()] == [first, other]
    assert book.position(over) == 1
    book.release(f"L{first}")
    assert [lease.ticket for lease in book.schedule()] == [over]
    assert book.team_usage() == {"nlp": 0.5, "vision": 0.5}


def test_aggregation_spans_distinct_nodes() -> None:
    book = ledger(nodes=("a", "b", "c"))
    book.submit(Request(1.0, nodes=2))
    (lease,) = book.schedule()
    assert len({p.node for p in lease.placements}) == 2


def test_requests_that_can_never_fit_say_why() -> None:
    book = ledger(gpus_per_node=2, memory=16 * GIB, quotas={"small": 0.5})
    assert "share > 0" in (book.check(Request(0)) or "")
    assert "no node has 3 GPUs" in (book.check(Request(3)) or "")
    assert "whole GPUs" in (book.check(Request(1.5)) or "")
    assert "more than the largest GPU's memory (16.0GiB)" in (book.check(Request(0.5, 20 * GIB)) or "")
    assert "1 node(s)" in (book.check(Request(1, nodes=2)) or "")
    assert "at most 0.5 GPUs" in (book.check(Request(1, team="small")) or "")
    assert book.check(Request(2, 16 * GIB)) is None
    assert "declares no GPUs" in (Ledger().check(Request(1)) or "")
    for odd in (float("nan"), float("inf"), float("-inf")):
        assert "share > 0" in (book.check(Request(odd)) or ""), odd
    assert "steps of 0.0001" in (book.check(Request(0.00001)) or "")
    assert "no node has" in (book.check(Request(1e305)) or ""), "not an OverflowError"
    assert book.check(Request(0.0001)) is None and book.check(Request(0.3333)) is None


def test_a_multi_node_request_needs_that_many_nodes_each_holding_its_gpus() -> None:
    """Two GPUs on each of two nodes, where one node has two and another one: never granted,
    and waiting forever at the head of the queue it kept every later request waiting too."""
    book = Ledger()
    book.set_gpus([Gpu("a", 0, 16 * GIB), Gpu("a", 1, 16 * GIB), Gpu("b", 0, 16 * GIB)])
    assert "--nodes 2 --gpu 2: only 1 node(s) have 2 GPUs" in (book.check(Request(2, nodes=2)) or "")
    assert book.check(Request(1, nodes=2)) is None and book.check(Request(2)) is None


def test_placement_hook_prefers_the_node_with_the_data_cached() -> None:
    book = ledger(nodes=("a", "b"), order=cached_first(lambda dataset: {"b": 0.9, "a": 0.1} if dataset == "/data/x" else {}))
    book.submit(Request(0.5, dataset="/data/x"))
    (lease,) = book.schedule()
    assert lease.placements[0].node == "b"


def test_inventory_round_trips_through_ray_resources() -> None:
    declared = resources(fake(2, 16 * GIB))
    assert declared == {"gpufeed_gpu_0": 1.0, "gpufeed_gpu_0_mem": 16384.0, "gpufeed_gpu_1": 1.0, "gpufeed_gpu_1_mem": 16384.0}
    assert [g.memory for g in from_resources("n", declared | {"CPU": 2.0})] == [16 * GIB, 16 * GIB]
    assert booking(1, 0.5, GIB + 1) == {"gpufeed_gpu_1": 0.5, "gpufeed_gpu_1_mem": 1025.0}


def test_quotas_and_idle_timeout_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFEED_POOL_QUOTAS", "vision=2, nlp=0.5")
    monkeypatch.setenv("GPUFEED_POOL_IDLE_TIMEOUT", "60")
    settings = Settings.from_env()
    assert (dict(settings.pool_quotas), settings.pool_idle_timeout) == ({"vision": 2.0, "nlp": 0.5}, 60.0)
    with monkeypatch.context() as bad:  # undone before other fixtures read the settings again
        bad.setenv("GPUFEED_POOL_QUOTAS", "vision=two")
        with pytest.raises(InvalidArgument, match="GPUFEED_POOL_QUOTAS='vision=two': expected TEAM=GPUS"):
            Settings.from_env()
