"""FeedSampler with the real DataLoader: order, sharding read at iteration time, resume exactly
where the training loop stopped (also after a worker crash and with another world size)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader

import gpufeed
from gpufeed.errors import InvalidArgument
from gpufeed.integrations.torch import FeedDataset, FeedLoader, FeedSampler, Shard, epoch_permutation
from tests.integrations.torch import crashing_job
from tests.integrations.torch.helpers import CrashOnce, N, as_rank, decode, mount_files


@pytest.fixture
def data(tmp_path: Path) -> FeedDataset[int]:
    return FeedDataset(mount_files(tmp_path), transform=decode)


def flat(batches: Iterable[list[int]]) -> list[int]:
    return [int(i) for batch in batches for i in batch]


def take(loader: FeedLoader, batches: int) -> list[int]:
    taken = []
    for batch in loader:
        taken.append(batch)
        if len(taken) == batches:
            break
    return flat(taken)


def order(seed: int, epoch: int, start: int = 0, rank: int = 0, world: int = 1) -> list[int]:
    return epoch_permutation(seed, epoch, N)[Shard(N, start, rank, world).positions()].tolist()


@pytest.mark.parametrize("workers, context", [(0, None), (2, "fork"), (2, "spawn")])
def test_stock_dataloader_reads_the_epoch_in_sampler_order(data: FeedDataset[int], workers: int, context: str | None) -> None:
    sampler = FeedSampler(data, seed=5)
    sampler.set_epoch(1)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=workers, multiprocessing_context=context)
    assert flat(loader) == order(5, 1)


def test_persistent_workers_read_each_epoch_in_its_order(data: FeedDataset[int]) -> None:
    sampler = FeedSampler(data, seed=2)
    loader = FeedLoader(data, batch_size=8, sampler=sampler, num_workers=2, persistent_workers=True)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        assert sampler.state_dict()["position"] == 0
        assert flat(loader) == order(2, epoch)
        assert sampler.state_dict() == {"epoch": epoch, "position": N, "seed": 2, "shuffle": True, "size": N}


@pytest.mark.parametrize(
    "workers_before, batch_before, batches, workers_after, batch_after",
    [
        (2, 4, 3, 0, 4),  # two workers read ahead, a single-process loader continues
        (0, 5, 3, 2, 4),  # position 15 is inside a batch of 4
        (2, 3, 5, 1, 7),
    ],
)
def test_resume_yields_exactly_the_remaining_samples_once(
    data: FeedDataset[int], workers_before: int, batch_before: int, batches: int, workers_after: int, batch_after: int
) -> None:
    sampler = FeedSampler(data, seed=3)
    sampler.set_epoch(2)
    loader = FeedLoader(data, batch_size=batch_before, sampler=sampler, num_workers=workers_before)
    seen = take(loader, batches)
    state = sampler.state_dict()
    assert state["position"] == batches * batch_before == len(seen)
    del loader

    resumed = FeedSampler(data, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    assert len(resumed) == N - len(seen)
    rest = flat(FeedLoader(data, batch_size=batch_after, sampler=resumed, num_workers=workers_after))
    assert seen + rest == order(3, 2)


def test_resume_sample_by_sample_without_a_loader(data: FeedDataset[int]) -> None:
    sampler = FeedSampler(data, seed=4, prefetch=False)
    seen = []
    for index in sampler:
        seen.append(index)
        sampler.mark_consumed(1)
        if len(seen) == 7:
            break
    resumed = FeedSampler(data, seed=4, prefetch=False)
    resumed.load_state_dict(sampler.state_dict())
    assert seen + list(resumed) == order(4, 0)


def test_resume_after_a_worker_was_killed(data: FeedDataset[int], tmp_path: Path) -> None:
    checkpoint, marker = tmp_path / "checkpoint.json", tmp_path / "crash-once"
    marker.touch()
    crash_at = order(crashing_job.SEED, 0)[21]  # inside batch 5
    job = [sys.executable, "-m", "tests.integrations.torch.crashing_job", str(checkpoint), str(marker), str(crash_at)]
    died = subprocess.run(job, check=False, cwd=Path(__file__).parents[3], capture_output=True, text=True, timeout=120)
    assert died.returncode != 0 and not marker.exists(), died.stderr  # the worker was killed and the job died
    saved = json.loads(checkpoint.read_text())
    seen = saved["seen"]
    assert saved["sampler"]["position"] == len(seen) < 24  # the batches handed out before the crash surfaced

    crashing = FeedDataset("/data", transform=CrashOnce(crash_at, marker))
    resumed = FeedSampler(crashing, seed=crashing_job.SEED)
    resumed.load_state_dict(saved["sampler"])
    rest = flat(FeedLoader(crashing, batch_size=4, sampler=resumed, num_workers=1))
    assert seen + rest == order(crashing_job.SEED, 0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_world_sizes_cover_every_index_exactly_once(data: FeedDataset[int], monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    seen = []
    for rank in range(world):
        as_rank(monkeypatch, rank, world)
        sampler = FeedSampler(data, seed=9)
        assert len(sampler) == N // world
        seen += flat(FeedLoader(data, batch_size=4, sampler=sampler))
    assert sorted(seen) == list(range(N))


def test_elastic_resume_from_two_ranks_to_three(data: FeedDataset[int], monkeypatch: pytest.MonkeyPatch) -> None:
    seen, states = [], []
    for rank in range(2):
        as_rank(monkeypatch, rank, 2)
        sampler = FeedSampler(data, seed=1)
        sampler.set_epoch(3)
        seen += take(FeedLoader(data, batch_size=4, sampler=sampler, num_workers=2), 3)
        states.append(sampler.state_dict())
    assert states[0] == states[1] and states[0]["position"] == 24
    for rank in range(3):
        as_rank(monkeypatch, rank, 3)
        sampler = FeedSampler(data, seed=1)
        sampler.load_state_dict(states[0])
        sampler.set_epoch(3)
        seen += flat(FeedLoader(data, batch_size=4, sampler=sampler, num_workers=1))
    assert sorted(seen) == list(range(N))


def test_rank_is_read_when_iteration_starts(data: FeedDataset[int], monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = FeedSampler(data, seed=8)
    as_rank(monkeypatch, 1, 2)
    assert list(sampler) == order(8, 0, rank=1, world=2)


def test_torch_distributed_wins_over_the_environment(
    data: FeedDataset[int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sampler = FeedSampler(data, seed=8)
    as_rank(monkeypatch, 1, 2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert list(sampler) == order(8, 0)
    finally:
        dist.destroy_process_group()


def test_state_without_knowing_what_was_consumed_is_refused(data: FeedDataset[int]) -> None:
    sampler = FeedSampler(data)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    next(iter(loader))
    with pytest.raises(InvalidArgument, match="FeedLoader"):
        sampler.state_dict()
    sampler.set_epoch(1)
    assert sampler.state_dict()["position"] == 0


def test_mismatched_state_is_refused(data: FeedDataset[int]) -> None:
    state = FeedSampler(data, seed=1).state_dict()
    with pytest.raises(InvalidArgument, match="seed=1"):
        FeedSampler(data, seed=2).load_state_dict(state)
    with pytest.raises(InvalidArgument, match="lacks position"):
        FeedSampler(data, seed=1).load_state_dict({k: v for k, v in state.items() if k != "position"})
    with pytest.raises(InvalidArgument, match="past the epoch"):
        FeedSampler(data, seed=1).load_state_dict({**state, "position": N + 1})
    with pytest.raises(InvalidArgument, match="prefetch=False"):
        FeedSampler(list(range(5)))


def test_numpy_integers_are_epochs_and_seeds_floats_are_not(data: FeedDataset[int]) -> None:
    """As DistributedSampler takes them: a loop over np.arange sets epochs with numpy integers."""
    sampler = FeedSampler(data, seed=np.int64(3), prefetch=False)
    sampler.set_epoch(np.int64(2))
    assert type(sampler.state_dict()["epoch"]) is int and json.dumps(sampler.state_dict())
    assert list(sampler) == _epoch(data, seed=3, epoch=2) != _epoch(data, seed=3, epoch=1)
    with pytest.raises(InvalidArgument, match=r"epoch 2.0: expected an integer >= 0"):
        sampler.set_epoch(2.0)  # type: ignore[arg-type]


def _epoch(data: FeedDataset[int], seed: int, epoch: int) -> list[int]:
    sampler = FeedSampler(data, seed=seed, prefetch=False)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_sampler_prefetches_the_files_it_will_hand_out(data: FeedDataset[int]) -> None:
    indices = iter(FeedSampler(data))  # held: a dropped iterator ends (cancels) its prefetch
    first = next(indices)
    total = int(data.sizes.sum())
    deadline = time.monotonic() + 10
    while (cached := sum(size for _, size in gpufeed.client().cached_bytes("/data"))) < total:
        assert time.monotonic() < deadline, f"{cached} of {total} bytes cached after handing out one index"
        time.sleep(0.05)
    assert data[first] == first
