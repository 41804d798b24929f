"""A gpufeed pack's member table answers exactly what manifest rows of the same members answer,
is saved for the node's other processes, and is rebuilt from the pinned index where missing."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from gpufeed.client import Client
from gpufeed.config import Settings
from gpufeed.errors import PackError
from gpufeed.integrations.torch.index import FileIndex
from gpufeed.meta.base import Entry
from gpufeed.meta.manifest import ManifestStats, entries_from_listing
from gpufeed.meta.sqlite import SqliteEngine
from gpufeed.namespace import Namespace
from gpufeed.pack import index as idx
from gpufeed.pack.members import MemberTable
from gpufeed.sources.base import ObjectInfo
from tests.cli.test_cli import ok

PATHS = [
    "a/x", "a-b/y", "a/b/z", "top", "a/b-c/w", "a/b/a", "a0/q", "deep/er/still/f", "a/b/z2", "x/../y", "x//y", "ü/ñ",
]  # '-' and '0' sort around '/': a subtree is no contiguous key range; two paths no namespace can name


def index_of(paths: list[str], version: int = 0) -> idx.Index:
    rows = [(p, n % 2, 100 * n, n + version, 1.7e9 + n, bytes([n + version]) * 32) for n, p in enumerate(paths)]
    return idx.build("d", 4 << 20, [("s0", 10_000), ("s1", 10_000)], rows, bytes(16))


def as_rows(index: idx.Index, tmp_path: Path) -> tuple[SqliteEngine, int]:
    """The same members as manifest rows in SQLite: what a mount listed before member tables."""
    engine = SqliteEngine(tmp_path / "rows.db")
    generation = engine.new_generation()
    infos = [
        ObjectInfo(m.path, m.length, m.mtime, None, f"sha256:{m.sha256}", m.shard, m.offset, m.length)
        for m in index.members()
    ]
    for entries in entries_from_listing([infos], ManifestStats()):
        engine.put_entries(generation, entries)
    return engine, generation


def test_the_table_answers_what_manifest_rows_answer(tmp_path: Path) -> None:
    index = index_of(PATHS)
    built = MemberTable.build(index)
    built.save(tmp_path / "table")
    table = MemberTable.load(tmp_path / "table")
    assert table is not None and (table.files, table.skipped) == (10, 2)
    engine, generation = as_rows(index, tmp_path)
    directories = ["", "a", "a/b", "a/b-c", "a-b", "a0", "deep", "deep/er", "deep/er/still", "ü", "top", "nowhere"]
    for found in (built, table):
        for directory in directories:
            assert found.listdir(directory) == engine.listdir(generation, directory), directory
            assert list(found.walk(directory)) == list(engine.walk(generation, directory)), directory
        for path in [*PATHS, "a", "a/b", "deep/er", "nowhere", "a/nope"]:
            parent, _, name = path.rpartition("/")
            assert found.lookup(parent, name) == engine.lookup(generation, parent, name), path
    entry = table.lookup("a/b", "z")
    assert isinstance(entry, Entry) and (entry.pack_key, entry.pack_offset, entry.size) == ("s0", 200, 2)
    assert entry.content_hash == f"sha256:{'02' * 32}"


def test_changes_count_added_changed_and_removed_files() -> None:
    old = MemberTable.build(index_of(["a/1", "a/2", "b/3"]))
    new = MemberTable.build(index_of(["a/1", "a/2", "c/4", "c/5"], version=0))
    assert new.changes(old) == (2, 0, 1)
    changed = MemberTable.build(index_of(["a/1", "a/2", "b/3"], version=1))
    assert changed.changes(old) == (0, 3, 0), "each length and hash moved"
    assert old.changes(old) == (0, 0, 0)


def mounted_pack(tmp_path: Path, dataset: Path) -> tuple[Namespace, Path]:
    """`dataset` mounted at /data, packed to tmp_path/p and that mounted at /p; and where this
    node keeps member tables."""
    ns = Namespace()
    ns.add_mount("/data", f"file://{dataset}")
    ok("pack", "/data", f"file://{tmp_path}/p")
    ns.add_mount("/p", f"file://{tmp_path}/p")
    return ns, Settings.from_env().home / "packs"


def test_a_node_without_the_table_rebuilds_it_from_the_pinned_index(
    tmp_path: Path, dataset: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ns, tables = mounted_pack(tmp_path, dataset)
    (saved,) = tables.iterdir()
    shutil.rmtree(saved)  # as on a node that did not mount it (the manifest is shared through Redis)
    fresh = Namespace()
    assert [f.path for f in fresh.ls("/p/train")] == ["/p/train/cats", "/p/train/dogs"]
    assert (saved / "meta.json").exists(), "rebuilt and saved again"
    assert gpufeed.client().read("/p/train/dogs/2.jpg") == bytes([102]) * 2002
    with open(saved / "hashes.npy", "r+b") as f:
        f.truncate(100)  # a damaged table: removed and built again
    assert Namespace().stat("/p/train/cats/2.jpg").size == 1002
    assert MemberTable.load(saved) is not None
    offsets = np.load(saved / "offset.npy")
    np.save(saved / "offset.npy", offsets ^ 1)  # a flipped bit in every offset: read from it, every member is wrong
    with caplog.at_level(logging.WARNING, "gpufeed"):
        assert Client().read("/p/train/dogs/2.jpg") == bytes([102]) * 2002, "a changed column is caught, not served"
    assert f"pack member table {saved} is damaged (a column does not match its sum); building it again" in caplog.text
    assert np.array_equal(np.load(saved / "offset.npy"), offsets)

    (dataset / "train" / "dogs" / "2.jpg").write_bytes(b"changed")
    ns.refresh("/data")
    ok("pack", "/data", f"file://{tmp_path}/p")  # the store's index changes under the mount
    shutil.rmtree(saved)
    with pytest.raises(PackError, match=r"the index changed since it was mounted; run 'gpufeed mount refresh'"):
        Namespace().ls("/p/train")
    _, stats = ns.refresh("/p")
    assert (stats.files, stats.added, stats.changed, stats.removed) == (8, 8, 0, 0), "the old table is gone: all new"
    assert Client().read("/p/train/dogs/2.jpg") == b"changed"


def test_verify_rebuilds_a_table_whose_hashes_are_damaged_and_does_not_blame_the_store(tmp_path: Path, dataset: Path) -> None:
    """Opening a table leaves its members' sha256 unchecked (only verify reads them): a damaged
    copy made verify report an intact shard's member as changed at the store, on every rerun."""
    _, tables = mounted_pack(tmp_path, dataset)
    (saved,) = tables.iterdir()
    hashes = np.load(saved / "sha256.npy")
    damaged = hashes.copy()
    damaged[-1, 0] ^= 5
    np.save(saved / "sha256.npy", damaged)
    out = ok("verify", "/p")
    assert out.endswith("8 matched, 0 mismatched\n"), out
    assert np.array_equal(np.load(saved / "sha256.npy"), hashes), "built again from the index"


def test_a_home_that_cannot_hold_tables_keeps_them_in_the_process(tmp_path: Path, dataset: Path) -> None:
    ns, tables = mounted_pack(tmp_path, dataset)
    shutil.rmtree(tables)
    tables.write_text("not a directory")  # saving under it fails with an OSError
    fresh = Namespace()
    assert fresh.stat("/p/train/cats/1.jpg").size == 1001
    assert [f.path for f in fresh.walk("/p/train/cats")] == [f"/p/train/cats/{n}.jpg" for n in range(3)]


def test_a_dataset_index_from_the_table_equals_one_walked_file_by_file(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = Namespace()
    ns.add_mount("/data", f"file://{dataset}")
    ok("pack", "/data", f"file://{tmp_path}/p", "--shard-size", "4KiB")  # several shards
    ns.add_mount("/p", f"file://{tmp_path}/p", {"block_size": "64KiB"})
    roots = ["/p/train", "/data/README", "/p", "/p/train/dogs/1.jpg", "/p/train/cats"]
    client = gpufeed.client()
    assert client.namespace.member_files("/p/train") is not None and client.namespace.member_files("/data") is None
    fast = FileIndex.build(roots, client)
    monkeypatch.setattr(Namespace, "member_files", lambda self, path: None)
    walked = FileIndex.build(roots, client)
    assert list(fast.paths) == list(walked.paths) and len(fast) == 6 + 1 + 8 + 1 + 3
    assert fast.sizes.tolist() == walked.sizes.tolist()
    assert fast.blocks.tolist() == walked.blocks.tolist()
    assert len(set(fast.blocks.tolist())) > 2, "members of several shards"


def test_a_table_no_mount_names_is_removed(tmp_path: Path, dataset: Path) -> None:
    ns, tables = mounted_pack(tmp_path, dataset)
    ns.add_mount("/q", f"file://{tmp_path}/p")  # the same pack twice: one table
    (first,) = tables.iterdir()
    (dataset / "README").write_bytes(b"a new readme\n")
    ns.refresh("/data")
    ok("pack", "/data", f"file://{tmp_path}/p")
    ns.refresh("/p")
    assert first.exists(), "/q still names it"
    assert len(list(tables.iterdir())) == 2
    ns.remove_mount("/q")
    (second,) = tables.iterdir()
    assert second != first
    assert Client().read("/p/README") == b"a new readme\n"
    ns.remove_mount("/p")
    assert list(tables.iterdir()) == []
