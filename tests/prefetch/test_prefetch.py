"""Sampler-aware prefetch through a real agent: ahead of need, bounded, cancelled, pinned."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import gpufeed
from gpufeed.namespace import Namespace
from gpufeed.prefetch import Batch, Prefetcher, Read, Wanted
from gpufeed.rpc.messages import AgentInfo, Usage, UsageInfo


def agent_stats() -> AgentInfo:
    return gpufeed.client().agent.stats()


def ahead_samples() -> int:
    return gpufeed.client().agent.request(Usage(), UsageInfo).prefetch_ahead_samples


def wait_for(condition, what: str, timeout: float = 20.0) -> AgentInfo:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = agent_stats()
        if condition(stats):
            return stats
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}: {agent_stats()}")


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    root = tmp_path / "src"
    root.mkdir()
    for i in range(60):
        (root / f"{i:03d}.bin").write_bytes(os.urandom(1000))
    Namespace().add_mount("/data", f"file://{root}")
    return [f"/data/{i:03d}.bin" for i in range(60)]


def test_blocks_are_fetched_before_they_are_read(files: list[str]) -> None:
    client = gpufeed.client()
    prefetcher = Prefetcher(client)
    order = list(reversed(files))
    iterator = prefetcher.ahead(order, Read)
    first = next(iterator)
    wait_for(lambda s: s.prefetched == 60, "the whole window")
    got = [first, *iterator]
    assert got == order, "items come back unchanged and in order"
    for path in got:
        client.read(path)
    assert client.source_bytes == 0, "no read had to fetch: every block was there"
    assert agent_stats().misses == 60
    prefetcher.close()


def test_a_warm_pass_asks_the_agent_for_nothing(files: list[str]) -> None:
    """Blocks already on disk are not asked for again: a warm epoch costs a stat per block in the
    prefetch thread, not an agent round trip per block (nor a pin of what is already there)."""
    client = gpufeed.client()
    prefetcher = Prefetcher(client)
    for path in prefetcher.ahead(files, Read):
        client.read(path)
    cold = wait_for(lambda s: s.prefetched + s.misses >= 60, "the cold pass")
    for path in prefetcher.ahead(files, Read):
        client.read(path)
    prefetcher.close()  # joins the sender thread: every batch it was given has been handled
    warm = agent_stats()
    assert (warm.misses, warm.prefetched) == (cold.misses, cold.prefetched), "the warm pass sent the agent nothing"
    assert prefetcher.errors == 0


def test_the_window_is_bounded_in_bytes(files: list[str]) -> None:
    prefetcher = Prefetcher(gpufeed.client(), min_bytes=5000, max_bytes=5000)
    iterator = prefetcher.ahead(files, Read)
    next(iterator)
    stats = wait_for(lambda s: s.prefetched >= 5, "five files")
    time.sleep(0.2)  # nothing more may arrive while the consumer stands still
    assert agent_stats().prefetched <= 6, stats
    for _ in range(10):
        next(iterator)
    wait_for(lambda s: s.prefetched >= 15, "the window to slide")
    assert ahead_samples() == 5, "the lead in samples: five 1,000-byte files fill the 5,000-byte window"
    prefetcher.close()
    assert ahead_samples() == 0, "an ended session leads nothing"


def test_a_burst_of_pulls_at_the_start_does_not_stretch_the_window(files: list[str]) -> None:
    """A DataLoader takes prefetch_factor x workers batches of indices at once when an epoch
    starts. Over the milliseconds that takes, that is no consume rate: the window stays at its
    floor instead of growing to the whole epoch."""
    prefetcher = Prefetcher(gpufeed.client(), min_bytes=20_000, max_bytes=1 << 20)
    iterator = prefetcher.ahead(files, Read)
    for _ in range(20):
        next(iterator)
    wait_for(lambda s: s.prefetched >= 39, "the files pulled and the window after them")
    assert ahead_samples() == 20, "twenty 1,000-byte files fill the 20,000-byte floor"
    prefetcher.close()


def test_ending_the_iteration_releases_pins_and_drops_queued_work(files: list[str]) -> None:
    prefetcher = Prefetcher(gpufeed.client())
    iterator = prefetcher.ahead(files, Read)
    next(iterator)
    wait_for(lambda s: s.pinned_bytes > 0, "pinned blocks")
    iterator.close()
    wait_for(lambda s: s.pinned_bytes == 0, "pins to be released")
    prefetcher.close()


def test_read_blocks_are_unpinned_and_unknown_items_are_passed_through(files: list[str]) -> None:
    client = gpufeed.client()
    prefetcher = Prefetcher(client)
    items = ["not a file", *files[:3]]
    iterator = prefetcher.ahead(items, lambda item: Read(item) if item.startswith("/") else None)
    assert next(iterator) == "not a file"
    wait_for(lambda s: s.prefetched == 3, "three files")
    for path in iterator:
        client.read(path)
    client.hits.flush()
    wait_for(lambda s: s.pinned_bytes == 0, "read blocks to be unpinned")
    prefetcher.close()


def test_what_was_queued_while_a_request_was_out_goes_as_one_request(files: list[str]) -> None:
    """A loader takes a batch of indices at once and the window is topped up sample by sample;
    the sender gathers what is queued into one request, not one per sample."""
    client = gpufeed.client()
    prefetcher = Prefetcher(client)
    for n, path in enumerate(files[:10], 1):  # queued before the sender runs, as a burst of top-ups
        handle = client.handle(path)
        assert handle.blocks is not None
        prefetcher._queue.put(Batch("burst", {(handle.blocks.oid, 0): Wanted(handle, 1)}, n))
    prefetcher._start()
    wait_for(lambda s: s.prefetched == 10, "the ten files")
    assert prefetcher.requests == 1
    assert ahead_samples() == 10, "the request carries the lead of the latest top-up"
    prefetcher.close()
    client.cancel_prefetch("burst")


def test_the_window_looks_its_files_up_a_directory_at_a_time(files: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a file per sample was a manifest query per sample in the training process:
    the window's files are looked up together (one query per directory and batch)."""
    client = gpufeed.client()
    engine = client.namespace.engine
    lookup_many = engine.lookup_many
    batches: list[int] = []

    def counted(generation: int, parent: str, names: list[str]) -> dict:
        batches.append(len(names))
        return lookup_many(generation, parent, names)

    monkeypatch.setattr(engine, "lookup", lambda *args: pytest.fail("a file was looked up on its own"))
    monkeypatch.setattr(engine, "lookup_many", counted)
    prefetcher = Prefetcher(client)
    assert list(prefetcher.ahead(files, Read)) == files
    prefetcher.close()
    assert sum(batches) == 60 and len(batches) == 1
    handles = client.handle_many(files[::-1])
    assert [h.path for h in handles] == files[::-1] and len(batches) == 1, "remembered handles need no lookup"


def test_a_block_stays_pinned_until_every_read_the_window_announced(files: list[str]) -> None:
    """Three reads of one file in the window: its block is kept for all three, not only the first."""
    client = gpufeed.client()
    prefetcher = Prefetcher(client)
    iterator = prefetcher.ahead([files[0]] * 3 + [files[1]], Read)
    next(iterator)
    both = wait_for(lambda s: s.prefetched == 2, "both blocks").pinned_bytes
    for n in range(3):
        client.read(files[0])
        client.hits.flush()
        assert agent_stats().pinned_bytes == (both if n < 2 else both // 2), f"after {n + 1} of 3 reads"
    client.read(files[1])
    client.hits.flush()
    assert agent_stats().pinned_bytes == 0
    prefetcher.close()


def test_every_iteration_of_one_prefetcher_is_prefetched(files: list[str]) -> None:
    """Ending an iteration ends its session at the agent for good; the next epoch of the same
    sampler starts one of its own, so a cache that lost the blocks is filled ahead again."""
    client = gpufeed.client()
    prefetcher = Prefetcher(client)
    for path in prefetcher.ahead(files, Read):
        client.read(path)
    client.hits.flush()
    client.agent.clear()
    first = agent_stats().prefetched
    iterator = prefetcher.ahead(files, Read)
    next(iterator)
    wait_for(lambda s: s.prefetched == first + 60, "the second epoch's window")
    iterator.close()
    prefetcher.close()
