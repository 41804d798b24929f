"""The agent's parts without a socket: the fetcher resolves blocks through disk and the store,
once per block however many want it, and the manager publishes and evicts."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gpufeed.agent.fetcher import FETCH_CONCURRENCY, Fetcher, Job, StoreBlocks
from gpufeed.agent.manager import AgentConfig, CacheManager
from gpufeed.agent.metrics import Metrics
from gpufeed.agent.sessions import Sessions
from gpufeed.blocks import CorruptBlock, object_blocks
from gpufeed.cache import blockfile
from gpufeed.cache.layout import BlockRef
from gpufeed.cache.openfiles import OpenBlocks
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument
from gpufeed.rpc.messages import Group, ObjectWant, SourceSpec
from gpufeed.sources.base import ObjectInfo


class CountingStore:
    """The store end of the chain, counting what it is asked for."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.reads: list[tuple[int, int]] = []

    async def read(self, job: Job, start: int, end: int) -> memoryview:
        self.reads.append((start, end))
        await asyncio.sleep(0.01)  # let every other wanter arrive while this read is in flight
        return memoryview(self.data[start:end])

    def only_blocks(self, job: Job) -> bool:
        return False


def parts(tmp_path: Path) -> tuple[Fetcher, CacheManager, Metrics]:
    config = AgentConfig((tmp_path / "cache",), 1 << 30, 0.0, None)
    metrics = Metrics()
    manager = CacheManager(config, metrics)
    manager.scan()
    sessions = Sessions(manager, metrics)
    fetcher = Fetcher(Settings.from_env(), manager, sessions, metrics)
    manager.protected = lambda: frozenset(fetcher.inflight).union(fetcher.busy, sessions.pinned)
    return fetcher, manager, metrics


def group(root: Path, info: ObjectInfo, blocks: list[int], block_size: int = 4096) -> Group:
    return Group(SourceSpec(f"file://{root}", {}), [ObjectWant(info, True, block_size, blocks)])


def test_one_store_read_per_block_however_many_want_it(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "obj").write_bytes(data)
    info = ObjectInfo("obj", len(data), 1.0, "v1")
    fetcher, manager, _ = parts(tmp_path)
    store = CountingStore(data)
    fetcher.chain = [store]

    async def run() -> None:
        replies = await asyncio.gather(*(fetcher.fetch([group(tmp_path / "src", info, [0, 1, 2])]) for _ in range(8)))
        assert all(not r.failures and not r.uncached for r in replies)
        assert sum(r.fetched for r in replies) == len(data), "the bytes are counted once, for whoever fetched them"

    asyncio.run(run())
    assert sorted(store.reads) == [(0, 4096), (4096, 8192), (8192, 10_000)]
    blocks = object_blocks(f"file://{tmp_path / 'src'}", {}, info, 4096, True)
    ref = BlockRef.of(manager.config.dirs, blocks, True, OpenBlocks(Path("/nonexistent"), 0))
    assert b"".join(bytes(blockfile.read(ref, i, 0, blocks.length(i))) for i in range(3)) == data


def test_an_object_with_a_content_hash_is_fetched_whole_once(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    info = ObjectInfo("obj", len(data), 1.0, "v1", "sha256:" + "0" * 64)
    fetcher, manager, _ = parts(tmp_path)
    store = CountingStore(data)
    fetcher.chain = [store]

    async def run() -> None:
        replies = await asyncio.gather(*(fetcher.fetch([group(tmp_path, info, [i])]) for i in (2, 0, 1, 2)))
        assert all(not r.failures for r in replies)

    asyncio.run(run())
    assert store.reads == [(0, len(data))], "one whole read, checked by the source, then every block published"
    blocks = object_blocks(f"file://{tmp_path}", {}, info, 4096, True)
    assert all(manager.present(blocks.block(i)) for i in range(3))


class StalledPeer:
    """A peer that holds every request until released, as a node does whose own reads wait on
    this one; it never has the block, so the chain goes on to the store."""

    def __init__(self) -> None:
        self.asked = 0
        self.release = asyncio.Event()

    async def read(self, job: Job, start: int, end: int) -> None:
        self.asked += 1
        await self.release.wait()
        return None

    def only_blocks(self, job: Job) -> bool:
        return True


def test_reads_waiting_on_a_peer_leave_the_store_free(tmp_path: Path) -> None:
    """Two nodes whose fetch slots all wait on each other's answers must not stall: the store's
    slots bound store reads only, so a block served for a peer (store only) is read at once
    however many of this node's reads are waiting on that peer."""
    root = tmp_path / "src"
    root.mkdir()
    waiting = FETCH_CONCURRENCY + 8
    infos = []
    for i in range(waiting + 1):
        (root / f"obj{i}").write_bytes(os.urandom(1000))
        infos.append(ObjectInfo(f"obj{i}", 1000, 1.0, "v1"))
    fetcher, _, metrics = parts(tmp_path)
    peer = StalledPeer()
    fetcher.chain = [peer, StoreBlocks(metrics)]

    def unchecked(info: ObjectInfo) -> list[Group]:  # the files' versions are not the listing's here
        return [Group(SourceSpec(f"file://{root}", {}), [ObjectWant(info, False, 4096, [0])])]

    async def run() -> None:
        stalled = [asyncio.create_task(fetcher.fetch(unchecked(info))) for info in infos[:waiting]]
        for _ in range(300):  # every read reaches the peer (before the change, only as many as there were slots)
            if peer.asked == waiting:
                break
            await asyncio.sleep(0.01)
        fetcher.chain = [StoreBlocks(metrics)]  # what a node serving a peer asks: its store only
        served = await asyncio.wait_for(fetcher.fetch(unchecked(infos[waiting])), 10)
        assert not served.failures and served.fetched == 1000
        peer.release.set()
        replies = await asyncio.gather(*stalled)
        assert all(not r.failures for r in replies), "released, the waiting reads go on to the store"

    asyncio.run(run())


def test_a_repair_discards_the_damaged_block_and_fetches_it_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = os.urandom(5000)
    info = ObjectInfo("obj", len(data), 1.0, "v1")
    fetcher, manager, metrics = parts(tmp_path)
    store = CountingStore(data)
    fetcher.chain = [store]
    blocks = object_blocks(f"file://{tmp_path}", {}, info, 4096, True)
    ref = BlockRef.of(manager.config.dirs, blocks, True, OpenBlocks(Path("/nonexistent"), 0))

    async def run(repair: list[int]) -> None:
        want = ObjectWant(info, True, 4096, [0], repair)
        reply = await fetcher.fetch([Group(SourceSpec(f"file://{tmp_path}", {}), [want])])
        assert not reply.failures

    asyncio.run(run([]))
    path = Path(manager.path(blocks.block(0)))
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 0xFF  # a changed byte whatever it was (writing b"x" left a block ending in x intact)
    path.write_bytes(damaged)
    with pytest.raises(CorruptBlock):
        blockfile.read(ref, 0, 0, 4096)
    with caplog.at_level("WARNING", logger="gpufeed.agent"):
        asyncio.run(run([0]))
    assert bytes(blockfile.read(ref, 0, 0, 4096)) == data[:4096]
    assert metrics.counts["repairs"] == 1 and len(store.reads) == 2
    [line] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert line == f"block 0 of obj was damaged on disk ({path}): discarded and fetched again", "an operator hears of it"


def test_a_block_index_outside_the_object_is_refused(tmp_path: Path) -> None:
    fetcher, _, _ = parts(tmp_path)
    with pytest.raises(InvalidArgument, match="outside obj"):
        fetcher.jobs([group(tmp_path, ObjectInfo("obj", 5000, 1.0, "v1"), [2])])


def test_the_manager_evicts_to_its_quota(tmp_path: Path) -> None:
    config = AgentConfig((tmp_path / "cache",), 20_000, 0.0, None)
    metrics = Metrics()
    manager = CacheManager(config, metrics)
    manager.scan()
    blocks = object_blocks("file:///src", {}, ObjectInfo("obj", 40_000, 1.0, "v1"), 4096, True)

    async def publish_all() -> None:
        for i in range(blocks.count):
            assert await manager.publish(blocks.block(i), memoryview(os.urandom(blocks.length(i))))

    asyncio.run(publish_all())
    assert manager.policy.bytes <= 20_000 and metrics.counts["evictions"] > 0
    kept = [i for i in range(blocks.count) if manager.present(blocks.block(i))]
    assert kept and len(kept) < blocks.count


def test_pins_are_released_by_the_bytes_they_counted(tmp_path: Path) -> None:
    """A pinned block the manager forgets (its file vanished) still gives back what its pin
    counted: pinned bytes never leak until prefetch stops for good."""
    fetcher, manager, metrics = parts(tmp_path)
    sessions = fetcher.sessions
    (tmp_path / "s").mkdir()
    info = ObjectInfo("k", 1 << 20, 1.0, "v")
    block = object_blocks(f"file://{tmp_path / 's'}", {}, info, 1 << 20, True).block(0)
    assert asyncio.run(manager.publish(block, memoryview(b"x" * (1 << 20))))
    session, created = sessions.open("s", True)
    sessions.announce(session, fetcher.jobs([group(tmp_path / "s", info, [0], 1 << 20)]))
    sessions.pin(session, block.name)
    assert created and sessions.pinned_bytes > 1 << 20
    os.unlink(manager.path(block))
    assert not manager.present(block)
    sessions.cancel("s")
    assert (sessions.pinned, sessions.pinned_bytes) == ({}, 0)


def test_a_prefetch_arriving_after_its_cancel_pins_nothing(tmp_path: Path) -> None:
    """The reader's prefetch thread may send a batch after the loop that owns the session sent
    Cancel: the ended session is not started again."""
    fetcher, manager, _ = parts(tmp_path)
    sessions = fetcher.sessions
    session, _ = sessions.open("job", True)
    sessions.cancel("job")
    late, created = sessions.open("job", True)
    assert late.cancelled and not created and "job" not in sessions.sessions
    block = object_blocks("file:///s", {}, ObjectInfo("k", 10, 1.0, "v"), 4096, True).block(0)
    sessions.pin(late, block.name)
    assert sessions.pinned == {}


def test_a_foreign_file_among_the_blocks_is_never_indexed(tmp_path: Path) -> None:
    """An .nfs silly-rename or a stray copy under blocks/ is left alone: eviction goes on."""
    root = tmp_path / "cache"
    (root / "blocks" / "ab").mkdir(parents=True)
    (root / "blocks" / "ab" / ".nfs0000000001").write_bytes(b"x" * 100)
    manager = CacheManager(AgentConfig((root,), 3 << 20, 0.0, None), Metrics())
    manager.scan()
    assert len(manager.policy) == 0
    blocks = object_blocks("file:///s", {}, ObjectInfo("k", 4 << 20, 1.0, "v"), 1 << 20, True)

    async def publish_all() -> None:
        for i in range(blocks.count):
            assert await manager.publish(blocks.block(i), memoryview(b"y" * (1 << 20)))

    asyncio.run(publish_all())
    assert manager.metrics.counts["evictions"] > 0 and manager.policy.bytes <= 3 << 20
