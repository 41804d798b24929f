"""One suite, run against every metadata engine (SQLite file and a real redis-server)."""

from __future__ import annotations

import pytest

from gpufeed.errors import MountConflict, PathNotFound
from gpufeed.meta.base import Entry, Mount
from gpufeed.meta.manifest import ManifestStats, count_changes, entries_from_listing
from gpufeed.namespace import Namespace
from gpufeed.sources.base import ObjectInfo


def listing(*keys: str, size: int = 10) -> list[list[ObjectInfo]]:
    return [[ObjectInfo(key, size, 1000.0, f'"{key}-{size}"') for key in keys]]


def write(ns: Namespace, *keys: str, size: int = 10) -> int:
    generation = ns.engine.new_generation()
    for entries in entries_from_listing(listing(*keys, size=size), ManifestStats()):
        ns.engine.put_entries(generation, entries)
    return generation


def test_mount_records_round_trip(namespace: Namespace) -> None:
    engine = namespace.engine
    mount = Mount("/data", "s3://b/p", {"endpoint": "http://x"}, max_age=30.0, generation=7, listed_at=1.5)
    engine.commit_mount(mount, previous=None)
    assert engine.mounts() == [mount]
    with pytest.raises(MountConflict, match="/data is already mounted"):
        engine.commit_mount(mount, previous=None)
    newer = Mount("/data", "s3://b/p", generation=8)
    engine.commit_mount(newer, previous=7)
    assert engine.mounts() == [newer]
    with pytest.raises(MountConflict, match="refreshed by another process"):
        engine.commit_mount(Mount("/data", "s3://b/p", generation=9), previous=7)
    engine.delete_mount("/data")
    assert engine.mounts() == []
    with pytest.raises(MountConflict, match="removed"):
        engine.commit_mount(Mount("/data", "s3://b/p", generation=10), previous=8)
    assert engine.mounts() == [], "a refresh never brings a removed mount back"


def test_generations_are_unique_and_increasing(namespace: Namespace) -> None:
    first = namespace.engine.new_generation()
    second = namespace.engine.new_generation()
    assert second > first


def test_directories_are_implied_by_keys(namespace: Namespace) -> None:
    gen = write(namespace, "a/b/c.bin", "a/d.bin", "top.bin")
    engine = namespace.engine
    assert [e.name for e in engine.listdir(gen, "")] == ["a", "top.bin"]
    assert engine.lookup(gen, "", "a") == Entry("", "a", True)
    assert [(e.name, e.is_dir) for e in engine.listdir(gen, "a")] == [("b", True), ("d.bin", False)]
    c = engine.lookup(gen, "a/b", "c.bin")
    assert c == Entry("a/b", "c.bin", False, 10, 1000.0, '"a/b/c.bin-10"')
    assert engine.lookup(gen, "a/b", "missing") is None
    assert engine.lookup(gen + 1000, "a/b", "c.bin") is None


def test_lookup_many_finds_a_batch_of_one_directory(namespace: Namespace) -> None:
    names = [f"{n:04d}.bin" for n in range(1200)]  # more than one SQLite batch
    gen = write(namespace, *(f"d/{name}" for name in names), "d/sub/x", "e/0000.bin")
    engine = namespace.engine
    asked = [*names[::-1], "missing", "sub"]
    found = engine.lookup_many(gen, "d", asked)
    assert sorted(found) == sorted([*names, "sub"])
    assert all(found[name] == engine.lookup(gen, "d", name) for name in asked if name in found)
    assert found["sub"].is_dir
    assert engine.lookup_many(gen, "d", []) == {} and engine.lookup_many(gen + 1000, "d", names[:3]) == {}


def test_walk_orders_by_parent_then_name_and_respects_prefix(namespace: Namespace) -> None:
    gen = write(namespace, "b/2", "a/1", "a/x/3", "ab/4", "a0", "z")
    keys = [e.key for e in namespace.engine.walk(gen, "")]
    assert keys == ["a0", "z", "a/1", "a/x/3", "ab/4", "b/2"]
    assert [e.key for e in namespace.engine.walk(gen, "a")] == ["a/1", "a/x/3"]
    assert [e.key for e in namespace.engine.walk(gen, "a/x")] == ["a/x/3"]
    assert list(namespace.engine.walk(gen, "nope")) == []


def test_drop_generation_removes_every_entry(namespace: Namespace) -> None:
    keep = write(namespace, "k/1")
    gen = write(namespace, "a/b/c", "d")
    namespace.engine.drop_generation(gen)
    assert namespace.engine.listdir(gen, "") == []
    assert list(namespace.engine.walk(gen, "")) == []
    assert [e.key for e in namespace.engine.walk(keep, "")] == ["k/1"]


def test_entries_keep_size_mtime_and_missing_etag(namespace: Namespace) -> None:
    gen = namespace.engine.new_generation()
    namespace.engine.put_entries(gen, [Entry("", "f", False, 2**40, 1234.5678, None), Entry("", "g|h", False, 1, 0.0, "e|t|a|g")])
    assert namespace.engine.lookup(gen, "", "f") == Entry("", "f", False, 2**40, 1234.5678, None)
    assert namespace.engine.lookup(gen, "", "g|h") == Entry("", "g|h", False, 1, 0.0, "e|t|a|g")


def test_unicode_names_sort_consistently(namespace: Namespace) -> None:
    gen = write(namespace, "é/1", "e/2", "日本/3", "Z/4")
    keys = [e.key for e in namespace.engine.walk(gen, "")]
    assert keys == sorted(keys, key=lambda k: (k.rpartition("/")[0], k.rpartition("/")[2]))


def test_count_changes_merges_two_generations(namespace: Namespace) -> None:
    old = write(namespace, "same", "gone", "dir/changed")
    new = namespace.engine.new_generation()
    fresh = listing("same", "new", "dir/new2")[0] + [ObjectInfo("dir/changed", 99, 1000.0, '"other"')]
    for entries in entries_from_listing([fresh], ManifestStats()):
        namespace.engine.put_entries(new, entries)
    stats = ManifestStats()
    count_changes(namespace.engine.walk(old, ""), namespace.engine.walk(new, ""), stats)
    assert (stats.added, stats.changed, stats.removed) == (2, 1, 1)


def test_unreachable_keys_are_skipped_and_counted(namespace: Namespace) -> None:
    stats = ManifestStats()
    batches = list(entries_from_listing(listing("ok", "a//b", "../up", "x/./y", ""), stats))
    assert [e.key for batch in batches for e in batch] == ["ok"]
    assert (stats.files, stats.skipped) == (1, 4)


def test_a_written_object_is_recorded_with_its_directories_and_removed_alone(namespace: Namespace, tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "seed").write_bytes(b"s")
    namespace.add_mount("/out", f"file://{tmp_path / 'src'}", writable=True)
    pending = ObjectInfo("runs/7/ckpt.bin", 3, 5.0, None, "sha256:" + "ab" * 32)
    assert namespace.record_written("/out", pending)
    assert [item.path for item in namespace.ls("/out/runs")] == ["/out/runs/7"]
    uploaded = ObjectInfo("runs/7/ckpt.bin", 3, 6.0, '"etag"', pending.content_hash)
    newer = ObjectInfo("runs/7/ckpt.bin", 4, 7.0, None, "sha256:" + "cd" * 32)
    assert namespace.record_written("/out", newer)
    assert not namespace.record_written("/out", uploaded, replacing=pending), "a newer write of the path stays"
    assert namespace.stat("/out/runs/7/ckpt.bin").size == 4
    namespace.record_removed("/out", "runs/7/ckpt.bin")
    assert [i.path for i in namespace.ls("/out")] == ["/out/seed"], "the directories it leaves empty go with it"
    with pytest.raises(PathNotFound):
        namespace.ls("/out/runs")
    namespace.record_written("/out", ObjectInfo("a/b/one", 1, 1.0, None, None))
    namespace.record_written("/out", ObjectInfo("a/two", 1, 1.0, None, None))
    namespace.record_removed("/out", "a/b/one")
    assert [i.path for i in namespace.ls("/out/a")] == ["/out/a/two"], "a directory that still holds a file stays"
