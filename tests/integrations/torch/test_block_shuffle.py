"""The block-aware shuffle: its order as a pure function (a permutation, deterministic, at most
`window` blocks open at a time), the sampler's API and resume state, and a packed mount read
through it with a cache smaller than the data set."""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from gpufeed.errors import InvalidArgument
from gpufeed.integrations.torch import FeedDataset, FeedIterableDataset, FeedSampler, block_permutation, epoch_permutation
from gpufeed.namespace import Namespace
from gpufeed.pack.packer import destination, pack, prepare
from tests.conftest import HttpServer
from tests.integrations.torch.helpers import N, decode, mount_files


def uneven_groups(count: int, seed: int = 0) -> np.ndarray:
    """Group ids of `count` groups of 1 to 40 samples, with sparse, unsorted ids."""
    rng = np.random.default_rng(seed)
    return np.repeat(rng.permutation(count) * 7 + 3, rng.integers(1, 41, count))


def open_groups(order: np.ndarray, groups: np.ndarray) -> int:
    """The most groups that, at one point of reading `order`, have some samples read and some not."""
    read = groups[order]
    ids, dense = np.unique(read, return_inverse=True)
    positions = np.arange(len(read))
    first = np.full(len(ids), len(read))
    np.minimum.at(first, dense, positions)
    last = np.zeros(len(ids), dtype=np.int64)
    np.maximum.at(last, dense, positions)
    change = np.zeros(len(read) + 1, dtype=np.int64)
    np.add.at(change, first, 1)
    np.add.at(change, last, -1)
    return int(np.cumsum(change).max())


def test_block_order_is_a_deterministic_permutation_of_its_own_per_epoch() -> None:
    groups = uneven_groups(300)
    first = block_permutation(7, 3, groups, 4)
    assert np.array_equal(np.sort(first), np.arange(len(groups)))
    assert np.array_equal(first, block_permutation(7, 3, groups.copy(), 4))
    assert not np.array_equal(first, block_permutation(7, 4, groups, 4))
    assert not np.array_equal(first, block_permutation(8, 3, groups, 4))
    assert not np.array_equal(first, block_permutation(7, 3, groups, 5))
    assert block_permutation(0, 0, np.empty(0, dtype=np.int64), 1).tolist() == []


@pytest.mark.parametrize("window", [1, 2, 4, 16])
def test_at_most_window_blocks_are_open_at_once(window: int) -> None:
    """A group is open from its first sample read to its last: with `window` blocks of cache,
    each block is fetched once."""
    groups = uneven_groups(500, seed=window)
    for epoch in range(3):
        assert open_groups(block_permutation(1, epoch, groups, window), groups) <= window
    exact = epoch_permutation(1, 0, len(groups))
    assert open_groups(exact, groups) > 100, "an exact shuffle keeps most blocks open"


def test_window_one_reads_each_group_whole_in_a_shuffled_order() -> None:
    groups = np.repeat(np.arange(50), 20)
    order = block_permutation(2, 0, groups, 1)
    read = groups[order]
    runs = read[np.r_[0, np.flatnonzero(np.diff(read)) + 1]]
    assert sorted(runs.tolist()) == list(range(50)), "each group read in one run"
    assert runs.tolist() != list(range(50)), "the groups come in a shuffled order"
    assert not np.array_equal(order[:20], np.arange(20)), "and shuffled inside"


def test_a_million_samples_are_ordered_in_one_vectorised_pass() -> None:
    groups = np.arange(1_000_000) // 37
    order = block_permutation(0, 1, groups, 4)
    assert len(order) == 1_000_000 and np.bincount(order).max() == 1


def test_bad_shuffles_and_windows_are_refused(tmp_path: Path) -> None:
    data = FeedDataset(mount_files(tmp_path), transform=decode)
    with pytest.raises(InvalidArgument, match="shuffle='nonsense': expected True, False or 'block'"):
        FeedSampler(data, shuffle="nonsense")
    for window in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgument, match="shuffle_window .*: expected an integer >= 1"):
            FeedSampler(data, shuffle="block", shuffle_window=window)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="needs a dataset with `blocks`"):
        FeedSampler(list(range(5)), shuffle="block", prefetch=False)
    with pytest.raises(InvalidArgument, match="shuffle_window 0"):
        FeedIterableDataset("/data", shuffle="block", shuffle_window=0)
    with pytest.raises(InvalidArgument, match="integer id per sample"):
        block_permutation(0, 0, np.zeros(3), 2)


def test_sampler_reads_the_block_order_and_resumes_only_into_it(tmp_path: Path) -> None:
    data = FeedDataset(mount_files(tmp_path), transform=decode)
    assert sorted(data.blocks.tolist()) == list(range(N)), "plain files: a block of their own each"
    sampler = FeedSampler(data, shuffle="block", shuffle_window=3, seed=4, prefetch=False)
    sampler.set_epoch(2)
    expected = block_permutation(4, 2, data.blocks, 3).tolist()
    seen = []
    for index in sampler:
        seen.append(index)
        sampler.mark_consumed(1)
        if len(seen) == 7:
            break
    state = sampler.state_dict()
    assert (state["shuffle"], state["shuffle_window"], state["position"]) == ("block", 3, 7)
    resumed = FeedSampler(data, shuffle="block", shuffle_window=3, seed=4, prefetch=False)
    resumed.load_state_dict(state)
    assert seen + list(resumed) == expected
    with pytest.raises(InvalidArgument, match="shuffle='block' but this sampler has shuffle=True"):
        FeedSampler(data, seed=4, prefetch=False).load_state_dict(state)
    with pytest.raises(InvalidArgument, match="shuffle_window=3 but this sampler has shuffle_window=5"):
        FeedSampler(data, shuffle="block", shuffle_window=5, seed=4, prefetch=False).load_state_dict(state)
    exact = FeedSampler(data, seed=4, prefetch=False).state_dict()
    assert exact["shuffle"] is True and "shuffle_window" not in exact, "an exact shuffle's state is unchanged"
    with pytest.raises(InvalidArgument, match="shuffle=True but this sampler has shuffle='block'"):
        resumed.load_state_dict(exact)
    data.index = dataclasses.replace(data.index, blocks=data.blocks // 2)  # two files to a block now: bigger blocks
    with pytest.raises(InvalidArgument, match="block_layout=.* resuming would read another order"):
        FeedSampler(data, shuffle="block", shuffle_window=3, seed=4, prefetch=False).load_state_dict(state)


def test_iterable_dataset_streams_the_block_order(tmp_path: Path) -> None:
    stream = FeedIterableDataset(mount_files(tmp_path), transform=decode, shuffle="block", shuffle_window=2, seed=1)
    stream.set_epoch(1)
    assert list(stream) == block_permutation(1, 1, stream.files.blocks, 2).tolist()


def packed_site(nginx: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, bytes]]:
    """750 files of 2 to 8 KB packed (in-process) into 1 MiB shards of 64 KiB cache blocks,
    served by nginx and mounted at /p; the raw files are read uncached, so the cache starts
    empty. Files of at most an eighth of a block never straddle a block boundary in a pack, as
    113 KB JPEGs in 4 MiB blocks do not (`pack.plan.place`). Returns the site's name in the
    access log and the files."""
    monkeypatch.setenv("GPUFEED_BLOCK_SIZE", "64KiB")
    monkeypatch.setenv("GPUFEED_CACHE_SIZE", "1MiB")  # about a quarter of the packed bytes
    gpufeed._default = None
    rng = random.Random(5)
    raw = {f"c{n % 5}/f{n:04d}.bin": rng.randbytes(rng.randint(2000, 8192)) for n in range(750)}
    for key, data in raw.items():
        (tmp_path / "raw" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "raw" / key).write_bytes(data)
    ns = Namespace()
    ns.add_mount("/raw", f"file://{tmp_path / 'raw'}", {"cache": "off"})
    client = gpufeed.client()
    site = f"pack-{tmp_path.name}"
    url = f"file://{nginx.root / site}"
    pack(client, prepare(client, "/raw", destination(url, {}, client), shard_size=1 << 20), workers=1)
    listing = tmp_path / "listing.txt"  # nginx's index leaves out the pack's dot directory
    files = [f for f in (nginx.root / site).rglob("*") if f.is_file()]
    listing.write_text("".join(f"{f.relative_to(nginx.root / site)} {f.stat().st_size}\n" for f in files))
    ns.add_mount("/p", f"{nginx.url}/{site}", {"format": "gpufeed-pack", "list": str(listing)})
    gpufeed._default = None  # a client that sees the new mount now, not when its mount table expires
    return site, raw


def shard_gets(nginx: HttpServer, site: str) -> list[int]:
    """The size of each response nginx served from the pack's shards so far."""
    time.sleep(0.3)  # nginx logs a request after answering it
    found = re.findall(rf'"GET /{site}/\.gpufeed-pack/shards/\S+ HTTP/[\d.]+" 20\d (\d+)', nginx.access_log.read_text())
    return [int(size) for size in found]


@dataclasses.dataclass(frozen=True)
class StoreReads:
    requests: int
    bytes: int
    blocks: int
    """Requests for a whole cache block (the rest read members around missing blocks)."""


def store_reads_of_one_epoch(
    nginx: HttpServer, site: str, data: FeedDataset[bytes], sampler: FeedSampler, raw: dict[str, bytes]
) -> StoreReads:
    """What the store served during one cold epoch read in batches of 16 with the sampler's
    prefetch, checking every sample. Hits are reported after each batch: this cache holds 16
    blocks, a few batches, where a real one holds far more than the 512 hits or 2 s between a
    reader's reports (`HIT_REPORT_BATCH`), and the agent keeps a prefetched block until its
    reads are reported."""
    gpufeed.client().agent.clear()
    gpufeed._default = None
    before = len(shard_gets(nginx, site))
    indices = iter(sampler)
    seen: list[int] = []
    while batch := list(itertools.islice(indices, 16)):
        for i, got in zip(batch, data.__getitems__(batch), strict=True):
            assert got == raw[data.paths[i].removeprefix("/p/")]
        gpufeed.client().hits.flush()
        seen += batch
    assert sorted(seen) == list(range(len(data))), "every sample once"
    del indices  # ends the prefetch
    served = shard_gets(nginx, site)[before:]
    shards = (nginx.root / site / ".gpufeed-pack" / "shards").iterdir()
    whole = {64 << 10} | {size % (64 << 10) for f in shards if (size := f.stat().st_size) % (64 << 10)}
    return StoreReads(len(served), sum(served), sum(1 for size in served if size in whole))


def test_block_shuffle_of_a_packed_mount_fetches_each_block_about_once(
    nginx: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a cache of a quarter of the data, an exact shuffle reads blocks that are evicted
    before most of their samples are read, or reads samples one request each; the block-aware
    one fetches about every block once."""
    site, raw = packed_site(nginx, tmp_path, monkeypatch)
    data: FeedDataset[bytes] = FeedDataset("/p")
    blocks = len(np.unique(data.blocks))
    packed = sum(len(v) for v in raw.values())
    assert packed // (64 << 10) <= blocks <= packed // (60 << 10) + 2, "members share the blocks they lie in"
    exact = store_reads_of_one_epoch(nginx, site, data, FeedSampler(data, seed=3), raw)
    block = store_reads_of_one_epoch(nginx, site, data, FeedSampler(data, shuffle="block", shuffle_window=2, seed=3), raw)
    # measured: every block once (62 of 62) and 1.10-1.12x the packed bytes, quiet or with three
    # busy loops on the same core; the exact shuffle read 8-9.6x the bytes
    assert block.blocks <= 1.1 * blocks and block.bytes < 1.25 * packed, (block, blocks, packed)
    assert exact.bytes > 3 * block.bytes and exact.requests > 3 * block.requests, (exact, block)
