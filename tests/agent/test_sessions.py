"""Prefetch pins without a socket, over a real file store: in-flight prefetches count against
the pin budget, a prefetch waits for room instead of overrunning a small cache, and a block
stays pinned until every read announced for it is reported."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufeed.agent import sessions as sessions_module
from gpufeed.agent.fetcher import Fetcher
from gpufeed.agent.manager import AgentConfig, CacheManager
from gpufeed.agent.metrics import Metrics
from gpufeed.agent.sessions import PIN_FRACTION, Sessions
from gpufeed.config import Settings
from gpufeed.rpc.messages import Group, ObjectWant, SourceSpec
from gpufeed.sources.base import ObjectInfo

BLOCK = 4096
CACHE_BLOCKS = 16
BUDGET = int(PIN_FRACTION * CACHE_BLOCKS)
COUNT = 40


def small_cache(tmp_path: Path) -> tuple[Fetcher, Sessions, Group, list[str]]:
    """An agent's parts with a cache of 16 blocks (a pin budget of 8), and a request for every
    block of a 40-block file, each announced with two reads; returns the block names too."""
    root = tmp_path / "src"
    root.mkdir()
    (root / "obj").write_bytes(os.urandom(COUNT * BLOCK))
    metrics = Metrics()
    room = CACHE_BLOCKS * (BLOCK + 256)  # a block file holds a header too
    manager = CacheManager(AgentConfig((tmp_path / "cache",), room, 0.0, None), metrics)
    manager.scan()
    sessions = Sessions(manager, metrics)
    fetcher = Fetcher(Settings.from_env(), manager, sessions, metrics)
    manager.protected = lambda: frozenset(fetcher.inflight).union(fetcher.busy, sessions.pinned)
    info = ObjectInfo("obj", COUNT * BLOCK, 1.0, "v1")
    want = ObjectWant(info, False, BLOCK, list(range(COUNT)), [], [2] * COUNT)
    group = Group(SourceSpec(f"file://{root}", {}), [want])
    names = [job.block.name for job in fetcher.jobs([group])]
    return fetcher, sessions, group, names


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def test_prefetch_waits_for_room_and_never_pins_past_the_budget(tmp_path: Path) -> None:
    fetcher, sessions, group, names = small_cache(tmp_path)
    most = 0

    def held() -> int:
        """Blocks pinned; the most pinned or in flight so far is kept."""
        nonlocal most
        most = max(most, len(sessions.pinned) + sessions.reserved_bytes // BLOCK)
        return len(sessions.pinned)

    async def run() -> None:
        session, _ = sessions.open("job", True)
        fetcher.prefetch(session, sessions.announce(session, fetcher.jobs([group])))
        await until(lambda: held() == BUDGET and session.queued == COUNT - BUDGET, "the budget to fill")
        assert set(sessions.pinned) == set(names[:BUDGET]), "the first blocks asked for, in order"
        sessions.hits("", " ".join([names[0], names[1]]))
        assert names[0] in sessions.pinned, "one read of two: kept"
        sessions.hits(names[0])
        await until(lambda: held() == BUDGET and session.queued == COUNT - BUDGET - 1, "the next block")
        assert names[0] not in sessions.pinned and names[BUDGET] in sessions.pinned, "read twice: let go for the next"
        for name in list(sessions.pinned):
            sessions.hits(name if name != names[1] else "")  # every pinned block read once (block 1 was)
        await until(lambda: held() == BUDGET and session.queued == COUNT - BUDGET - 2, "a stale pin to go")
        assert names[1] not in sessions.pinned, "every pin read once and none in flight: the one read first goes"
        assert session.queued == COUNT - BUDGET - 2, "one at a time"
        sessions.cancel("job")
        await until(lambda: session.queued == 0, "the waiting prefetches to end")
        assert sessions.pinned_bytes == sessions.reserved_bytes == 0 and sessions.announced == {}

    asyncio.run(run())
    assert most <= BUDGET, f"{most} blocks pinned or in flight, over the budget of {BUDGET}"
    assert len(fetcher.manager.policy) == BUDGET + 2, "nothing fetched that was not given room"


def test_a_block_a_demand_read_took_is_kept_for_the_reads_still_announced(tmp_path: Path) -> None:
    """The reader outran the prefetch: the block it fetched on demand is pinned for the rest of
    its announced reads, and the queued prefetch of it fetches nothing more."""
    fetcher, sessions, group, names = small_cache(tmp_path)

    async def run() -> None:
        session, _ = sessions.open("job", True)
        sessions.announce(session, fetcher.jobs([group]))  # announced, nothing queued yet
        wanted = Group(group.source, [ObjectWant(group.objects[0].info, False, BLOCK, [5])])
        reply = await fetcher.fetch([wanted])
        assert not reply.failures and names[5] in sessions.pinned, "kept for its second read"
        sessions.hits("", names[5])
        sessions.hits(names[5])
        assert names[5] not in sessions.pinned and names[5] not in sessions.announced

    asyncio.run(run())


def test_pins_no_read_reached_go_once_stale_when_a_prefetch_needs_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that stopped before what it asked for leaves pins nobody reads: once stale, the
    oldest goes each time a prefetch needs room, so the node's prefetch does not stall for good."""
    monkeypatch.setattr(sessions_module, "STALE_PIN_S", 0.0)
    fetcher, sessions, group, names = small_cache(tmp_path)

    async def run() -> None:
        stopped, _ = sessions.open("stopped", True)
        fetcher.prefetch(stopped, sessions.announce(stopped, fetcher.jobs([group])[:BUDGET]))
        await until(lambda: len(sessions.pinned) == BUDGET and stopped.queued == 0, "the stopped reader's pins")
        job, _ = sessions.open("job", True)
        fetcher.prefetch(job, sessions.announce(job, fetcher.jobs([group])[BUDGET : BUDGET + 3]))
        await until(lambda: job.queued == 0, "the next job's prefetch")
        assert set(names[BUDGET : BUDGET + 3]) <= set(sessions.pinned), "the job's blocks are pinned"
        assert len(set(sessions.pinned) & set(names[:BUDGET])) == BUDGET - 3, "three stale pins made room, no more"

    asyncio.run(run())
