"""FeedIterableDataset: the epoch's shuffled order, equal shares for every rank (padded or
dropped), DataLoader workers, prefetch, and a real two-process DDP job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

import gpufeed
from gpufeed.errors import InvalidArgument
from gpufeed.integrations.torch import FeedIterableDataset, Shard, epoch_permutation
from gpufeed.integrations.torch.order import shard_order
from tests.integrations.torch import ddp_job
from tests.integrations.torch.helpers import as_rank, decode, mount_files

N = 31  # not divisible by 2 or 3: ranks need padding or a dropped tail


@pytest.fixture
def root(tmp_path: Path) -> str:
    return mount_files(tmp_path, N)


def test_shuffle_reads_each_epoch_in_its_own_order_every_file_once(root: str) -> None:
    stream = FeedIterableDataset(root, transform=decode, shuffle=True, seed=3)
    first = list(stream)
    stream.set_epoch(1)
    second = list(stream)
    assert first == epoch_permutation(3, 0, N).tolist() and second == epoch_permutation(3, 1, N).tolist()
    assert first != second and sorted(first) == sorted(second) == list(range(N))
    again = FeedIterableDataset(root, transform=decode, shuffle=True, seed=3)
    again.set_epoch(1)
    assert list(again) == second and again.epoch == 1
    assert list(FeedIterableDataset(root, transform=decode, shuffle=True, seed=4)) != first
    assert list(FeedIterableDataset(root, transform=decode)) == list(range(N))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_gets_an_equal_share(root: str, monkeypatch: pytest.MonkeyPatch, world: int, drop_last: bool) -> None:
    stream = FeedIterableDataset(root, transform=decode, shuffle=True, seed=5, drop_last=drop_last)
    stream.set_epoch(2)
    order = epoch_permutation(5, 2, N).tolist()
    shares = []
    for rank in range(world):
        as_rank(monkeypatch, rank, world)
        shares.append(list(stream))
        assert len(shares[-1]) == len(stream)
    lengths = {len(share) for share in shares}
    seen = [i for share in shares for i in share]
    if drop_last:
        assert lengths == {N // world} and len(seen) % world == 0
        assert sorted(seen) == sorted(order[: len(seen)])  # no duplicates; only the tail is left out
    else:
        assert lengths == {-(-N // world)}
        padding = len(seen) - N
        assert 0 <= padding < world and sorted(seen) == sorted(order + order[:padding])  # duplicates only from wrap-around


@pytest.mark.parametrize("persistent", [False, True])
def test_two_workers_read_the_rank_share_once_epoch_after_epoch(
    root: str, monkeypatch: pytest.MonkeyPatch, persistent: bool
) -> None:
    stream = FeedIterableDataset(root, transform=decode, shuffle=True, seed=8)
    loader = DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=persistent)
    as_rank(monkeypatch, 1, 3)
    for epoch in range(2):
        stream.set_epoch(epoch)
        share = shard_order(8, epoch, Shard(N, 0, 1, 3), shuffle=True).tolist()
        assert [int(i) for i in loader] == share  # the loader alternates between the workers' halves


def test_spawned_workers_take_the_rank_and_the_epoch_along(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = FeedIterableDataset(root, transform=decode, shuffle=True, seed=8, drop_last=True)
    loader = DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="spawn")
    as_rank(monkeypatch, 0, 2)
    for epoch in (0, 4):
        stream.set_epoch(epoch)
        assert [int(i) for i in loader] == shard_order(8, epoch, Shard(N, 0, 0, 2, drop_last=True)).tolist()


def test_rank_is_read_when_iteration_starts(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = FeedIterableDataset(root, transform=decode)
    as_rank(monkeypatch, 2, 3)
    assert len(stream) == 11 and list(stream) == list(range(2, N, 3)) + [1]  # position 32 wraps to 1


def test_prefetch_fetches_this_rank_share_ahead(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = FeedIterableDataset(root, transform=decode, shuffle=True, seed=1)
    as_rank(monkeypatch, 0, 2)
    share = shard_order(1, 0, Shard(N, 0, 0, 2))
    wanted = {stream.files.paths[i] for i in share.tolist()}
    reading = iter(stream)  # kept: ending the iteration would end its prefetch
    assert next(reading) == share[0]
    deadline = time.monotonic() + 10
    while (cached := {item.path for item, size in gpufeed.client().cached_bytes(root) if size}) != wanted:
        assert cached < wanted and time.monotonic() < deadline, f"{len(cached)} of {len(wanted)} files cached"
        time.sleep(0.05)


def test_bad_input_is_refused(root: str) -> None:
    with pytest.raises(InvalidArgument, match="seed -1"):
        FeedIterableDataset(root, seed=-1)
    stream: FeedIterableDataset[bytes] = FeedIterableDataset(root)
    with pytest.raises(InvalidArgument, match="epoch -1"):
        stream.set_epoch(-1)
    with pytest.raises(InvalidArgument, match="epoch '1'"):
        stream.set_epoch("1")  # type: ignore[arg-type]


def test_two_process_ddp_job_reads_every_index_and_steps_in_lockstep(root: str, tmp_path: Path) -> None:
    """Each rank builds its datasets before init_process_group, so they must learn their rank later."""
    env = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE")}
    env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    outs = [tmp_path / f"rank{rank}.json" for rank in range(ddp_job.WORLD)]
    jobs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.torch.ddp_job", str(tmp_path / "pg"), str(rank), str(out)],
            cwd=Path(__file__).parents[3], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank, out in enumerate(outs)
    ]
    for job in jobs:
        output, _ = job.communicate(timeout=60)
        assert job.returncode == 0, output
    reports = [json.loads(out.read_text()) for out in outs]

    order = epoch_permutation(ddp_job.SEED, 0, N).tolist()
    for name in ("sampler", "stream"):
        ranks = [report[name] for report in reports]
        assert [r["len"] for r in ranks] == [len(r["indices"]) for r in ranks] == [-(-N // ddp_job.WORLD)] * ddp_job.WORLD
        assert len(ranks[0]["reduced"]) == len(ranks[1]["reduced"]) and set(ranks[0]["reduced"]) == {ddp_job.WORLD}
        counts = Counter(i for r in ranks for i in r["indices"])
        assert set(counts) == set(range(N))
        assert {i: c for i, c in counts.items() if c > 1} == {order[0]: 2}  # the one wrap-around pad
