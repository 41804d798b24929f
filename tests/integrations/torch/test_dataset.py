"""FeedDataset and FeedIterableDataset: the index built once from the manifest, bytes through the
read path in every DataLoader worker, streaming shards by rank and worker, an S3 mount."""

from __future__ import annotations

import pickle
from pathlib import Path, PurePosixPath

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


def test_the_transform_gets_the_bytes_the_read_returned_not_a_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm batch hands each small file's bytes object to the transform as the cache read made
    it: the same object, no second copy."""
    import gpufeed

    data = FeedDataset(mount_files(tmp_path))
    data.__getitems__(list(range(N)))  # cold: now every file is a cache hit
    client = gpufeed.client()
    returned: list[memoryview] = []
    read_files = client.read_files

    def recording(paths: list[str]) -> list[memoryview]:
        views = read_files(paths)
        returned.extend(views)
        return views

    monkeypatch.setattr(client, "read_files", recording)
    seen: list[bytes] = []
    data.transform = lambda sample: seen.append(sample) or decode(sample)
    assert data.__getitems__([3, 1, 4]) == [3, 1, 4]
    assert all(type(sample) is bytes for sample in seen)
    assert all(sample is view.obj for sample, view in zip(seen, returned, strict=True)), "handed out without a copy"


def test_labels_without_a_subclass(tmp_path: Path) -> None:
    root = tmp_path / "imagefolder"
    for name in ("dog", "cat", "bird"):
        (root / name).mkdir(parents=True)
        for i in range(3):
            (root / name / f"{i}.jpg").write_bytes(f"{name}{i}".encode())
    Namespace().add_mount("/img", f"file://{root}")
    folders = FeedDataset("/img", target="folder")
    assert folders.classes == ["bird", "cat", "dog"] and folders.class_to_idx == {"bird": 0, "cat": 1, "dog": 2}
    pairs = dict(folders.__getitems__(list(range(len(folders)))))
    assert pairs[b"cat2"] == 1 and pairs[b"dog0"] == 2 and folders[0] == (b"bird0", 0)
    batches = DataLoader(folders, batch_size=4, num_workers=2, collate_fn=list)  # the labeller pickles to workers
    assert sorted(label for batch in batches for _, label in batch) == [0] * 3 + [1] * 3 + [2] * 3
    by_name = FeedDataset("/img", transform=len, target=lambda path: path.rsplit("/", 1)[1])
    assert by_name[4] == (4, "1.jpg")
    with pytest.raises(InvalidArgument, match="target="):
        FeedDataset("/img", target="parent")  # type: ignore[arg-type]


def test_folder_labels_are_the_first_folder_under_the_root(tmp_path: Path) -> None:
    """Tiny-ImageNet's train/<class>/images/<file>: the class is n01, not `images`."""
    root = tmp_path / "tiny"
    for name in ("n01", "n02"):
        (root / "train" / name / "images").mkdir(parents=True)
        for i in range(2):
            (root / "train" / name / "images" / f"{name}_{i}.JPEG").write_bytes(name.encode())
        (root / "train" / name / f"{name}_boxes.txt").write_bytes(name.encode())
    (root / "README").write_bytes(b"readme")
    Namespace().add_mount("/tiny", f"file://{root}")
    listed = ["/tiny/train/n01", Path("/tiny/train/n02")]  # class folders
    for given in ("/tiny/train", "/tiny/train/", PurePosixPath("/tiny/train"), listed):
        data = FeedDataset(given, target="folder")
        assert data.classes == ["n01", "n02"]
        assert [(sample.decode(), label) for sample, label in (data[i] for i in range(len(data)))] == [
            ("n01", 0)
        ] * 3 + [("n02", 1)] * 3
    with pytest.raises(InvalidArgument, match="/tiny/README: not inside a class folder under /tiny"):
        FeedDataset("/tiny", target="folder")
    files = FeedDataset(["/tiny/train/n02/images/n02_1.JPEG", "/tiny/train/n01/images/n01_0.JPEG"], target="folder")
    assert files.classes == ["images"] and [files[i][1] for i in range(2)] == [0, 0], "a listed file: its own folder"


@pytest.mark.parametrize("persistent", [False, True])
def test_hits_served_in_dataloader_workers_reach_the_agents_counts(tmp_path: Path, persistent: bool) -> None:
    """Workers exit without atexit handlers; their hits are reported all the same, so `cache
    stats` and eviction see every hit."""
    import gpufeed

    data = FeedDataset(mount_files(tmp_path), transform=decode)
    data.__getitems__(list(range(N)))  # cold, in this process
    before = gpufeed.client().agent.stats().hits
    loader = DataLoader(data, batch_size=8, num_workers=2, collate_fn=list, persistent_workers=persistent)
    assert sorted(i for batch in loader for i in batch) == list(range(N))
    del loader  # persistent workers exit when their loader goes
    import gc

    gc.collect()
    assert gpufeed.client().agent.stats().hits - before == N
