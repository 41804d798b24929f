"""FeedDataset and FeedIterableDataset: the index built once from the manifest, bytes through the
read path in every DataLoader worker, streaming shards by rank and worker, an S3 mount."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from gpufeed.errors import InvalidArgument, PathNotFound
from gpufeed.integrations.torch import FeedDataset, FeedIterableDataset, FeedLoader, FeedSampler, epoch_permutation
from gpufeed.namespace import Namespace
from tests.conftest import Bucket
from tests.integrations.torch.helpers import N, content, decode, mount_files


def test_dataset_indexes_a_directory_once_and_reads_bytes(tmp_path: Path) -> None:
    data = FeedDataset(mount_files(tmp_path))
    assert len(data) == N
    assert data.paths[7] == "/data/f00007.bin" and data.paths[-1] == f"/data/f{N - 1:05d}.bin"
    assert data.sizes.tolist() == [len(content(i)) for i in range(N)]
    assert data[7] == content(7) and data[-1] == content(N - 1)
    copy = pickle.loads(pickle.dumps(data))
    assert copy[3] == content(3) and list(copy.paths) == list(data.paths)


def test_dataset_over_a_list_of_paths_keeps_their_order(tmp_path: Path) -> None:
    mount_files(tmp_path)
    data = FeedDataset(["/data/f00009.bin", "/data/f00002.bin"], transform=decode)
    assert [data[0], data[1]] == [9, 2]
    assert data.read_of(1).path == "/data/f00002.bin" and data.read_of(1).end == len(content(2))


def test_a_batch_is_read_with_one_call_in_its_order(tmp_path: Path) -> None:
    data = FeedDataset(mount_files(tmp_path), transform=decode)
    assert data.__getitems__([5, 0, 5, N - 1]) == [5, 0, 5, N - 1]
    batches = DataLoader(data, batch_size=4, collate_fn=list)  # PyTorch's fetcher calls __getitems__
    assert [item for batch in batches for item in batch] == list(range(N))


def test_bad_input_is_refused(tmp_path: Path) -> None:
    mount_files(tmp_path)
    (tmp_path / "empty").mkdir()
    Namespace().add_mount("/empty", f"file://{tmp_path / 'empty'}", allow_empty=True)
    with pytest.raises(InvalidArgument, match="no files"):
        FeedDataset("/empty")
    with pytest.raises(InvalidArgument, match="empty list"):
        FeedDataset([])
    with pytest.raises(InvalidArgument, match="namespace path"):
        FeedDataset(42)  # type: ignore[arg-type]
    with pytest.raises(PathNotFound, match="/data/missing"):
        FeedDataset("/data/missing")
    data = FeedDataset("/data")
    with pytest.raises(IndexError, match="out of range"):
        data[N]
    with pytest.raises(InvalidArgument, match="expected an integer"):
        data["3"]  # type: ignore[index]


@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2), (3, 2)])
def test_streaming_ranks_and_workers_read_every_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int, workers: int
) -> None:
    stream = FeedIterableDataset(mount_files(tmp_path), transform=decode)
    seen = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        mine = [int(i) for i in DataLoader(stream, batch_size=None, num_workers=workers)]
        assert len(mine) == len(stream) and set(mine) == set(range(rank, N, world))
        seen += mine
    assert sorted(seen) == list(range(N))


def test_streaming_rank_travels_with_a_pickled_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spawned worker has no torch.distributed; it gets the rank of the process that sent it the dataset."""
    stream = FeedIterableDataset(mount_files(tmp_path), transform=decode)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sent = pickle.dumps(stream)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert list(pickle.loads(sent)) == list(range(1, N, 2))
    assert list(stream) == list(range(N))


def test_s3_mount_through_sampler_and_workers(bucket: Bucket) -> None:
    for i in range(30):
        bucket.put(f"train/f{i:05d}.bin", content(i))
    Namespace().add_mount("/s3", bucket.url, {"endpoint": bucket.endpoint})
    data = FeedDataset("/s3/train", transform=decode)
    sampler = FeedSampler(data, seed=11)
    got = [int(i) for batch in FeedLoader(data, batch_size=4, sampler=sampler, num_workers=2) for i in batch]
    assert got == epoch_permutation(11, 0, 30).tolist()
