"""Mounts, manifests and lookups over real sources, against both metadata engines."""

from __future__ import annotations

import gc
import os
import shutil
import weakref
from pathlib import Path

import pytest

import gpufeed
from gpufeed.config import Settings
from gpufeed.errors import (
    InvalidArgument,
    IsADirectory,
    MountConflict,
    MountError,
    MountNotFound,
    NotADirectory,
    PathNotFound,
    SourceUnreachable,
)
from gpufeed.mount_options import CachePolicy, parse_options
from gpufeed.namespace import Namespace
from gpufeed.paths import normalize
from tests.conftest import Bucket


def test_mount_lists_source_into_manifest(namespace: Namespace, dataset: Path) -> None:
    mount, stats = namespace.add_mount("/data", f"file://{dataset}")
    assert (stats.files, stats.bytes, stats.added) == (8, 7 + 3 * 1000 + 3 + 3 * 2000 + 3, 8)
    assert namespace.mounts() == [mount]
    assert [s.path for s in namespace.ls("/data")] == ["/data/README", "/data/empty.bin", "/data/train"]
    assert [s.path for s in namespace.ls("/data/train/cats")] == [f"/data/train/cats/{i}.jpg" for i in range(3)]
    st = namespace.stat("/data/train/dogs/2.jpg")
    assert (st.is_dir, st.size) == (False, 2002)
    assert st.version
    assert namespace.stat("/data/train").is_dir


def test_a_local_path_mounts_as_the_absolute_file_url_it_means(
    namespace: Namespace, dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(dataset.parent)
    mount, _ = namespace.add_mount("/data", dataset.name)  # relative, as typed in a shell
    assert mount.url == f"file://{dataset}"
    monkeypatch.chdir("/")
    with gpufeed.open("/data/train/cats/1.jpg") as f:
        assert f.read() == bytes([1]) * 1001, "read from another directory: the same files"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert namespace.add_mount("/home", f"~/{dataset.name}")[0].url == f"file://{dataset}"
    assert namespace.add_mount("/short", f"file:{dataset}")[0].url == f"file://{dataset}", "one URL for one directory"
    assert namespace.add_mount("/local", f"file://localhost{dataset}")[0].url == f"file://{dataset}"


def test_ls_and_stat_never_touch_the_source(namespace: Namespace, dataset: Path) -> None:
    namespace.add_mount("/data", f"file://{dataset}")
    shutil.rmtree(dataset)
    assert namespace.stat("/data/train/cats/1.jpg").size == 1001
    assert len(namespace.ls("/data/train/dogs")) == 3
    assert sum(s.size for s in namespace.walk("/data")) == 7 + 3003 + 6003


def test_virtual_directories_above_mounts(namespace: Namespace, dataset: Path) -> None:
    namespace.add_mount("/datasets/imagenet", f"file://{dataset}")
    assert [(s.path, s.is_dir) for s in namespace.ls("/")] == [("/datasets", True)]
    assert [s.path for s in namespace.ls("/datasets")] == ["/datasets/imagenet"]
    assert namespace.stat("/datasets").is_dir
    assert len(list(namespace.walk("/datasets"))) == 8
    with pytest.raises(PathNotFound, match="/elsewhere: no mount contains"):
        namespace.ls("/elsewhere")


def test_a_mount_another_process_just_added_is_found_at_once(namespace: Namespace, dataset: Path) -> None:
    namespace.add_mount("/data", f"file://{dataset}")
    assert namespace.stat("/data/README").size == 7  # the mount table is now remembered
    elsewhere = Namespace(namespace.settings)
    try:
        elsewhere.add_mount("/more", f"file://{dataset}")
    finally:
        elsewhere.close()
    assert namespace.stat("/more/README").size == 7
    with pytest.raises(PathNotFound, match="/other/README: no mount contains"):
        namespace.stat("/other/README")


def test_a_dropped_namespace_is_freed_at_once_not_by_the_garbage_collector(namespace: Namespace) -> None:
    """Scripts drop a Namespace without closing it (`Namespace().add_mount(...)`); its engine's
    connection must go with it, so nothing it holds may point back at it."""
    gc.disable()
    try:
        dropped = weakref.ref(Namespace(namespace.settings))
        assert dropped() is None
    finally:
        gc.enable()


def test_ls_of_a_file_is_the_file(namespace: Namespace, dataset: Path) -> None:
    namespace.add_mount("/data", f"file://{dataset}")
    [only] = namespace.ls("/data/README")
    assert (only.path, only.size) == ("/data/README", 7)


@pytest.mark.parametrize(
    "path", ["/data/../../etc/passwd", "/data/train/../../../etc/passwd", "/../../etc/passwd", "/data/../etc"]
)
def test_path_traversal_never_escapes_a_mount(namespace: Namespace, dataset: Path, path: str) -> None:
    namespace.add_mount("/data", f"file://{dataset}")
    with pytest.raises(PathNotFound, match="no mount contains"):
        namespace.stat(path)
    with pytest.raises(PathNotFound):
        namespace.open_object(path)


def test_dotdot_inside_a_mount_resolves_inside_it(namespace: Namespace, dataset: Path) -> None:
    namespace.add_mount("/data", f"file://{dataset}")
    assert namespace.stat("/data/train/cats/../dogs/0.jpg").size == 2000


@pytest.mark.parametrize("other", ["/data", "/data/sub", "/"])
def test_overlapping_mounts_are_refused(namespace: Namespace, dataset: Path, tmp_path: Path, other: str) -> None:
    namespace.add_mount("/data", f"file://{dataset}")
    error = InvalidArgument if other == "/" else MountConflict
    with pytest.raises(error):
        namespace.add_mount(other, f"file://{tmp_path}")
    assert [m.path for m in namespace.mounts()] == ["/data"]


def test_parent_of_existing_mount_is_refused(namespace: Namespace, dataset: Path, tmp_path: Path) -> None:
    namespace.add_mount("/a/b", f"file://{dataset}")
    with pytest.raises(MountConflict, match="overlaps the mount /a/b"):
        namespace.add_mount("/a", f"file://{tmp_path}")
    namespace.add_mount("/ab", f"file://{tmp_path}")
    assert [m.path for m in namespace.mounts()] == ["/a/b", "/ab"]


def test_refresh_counts_added_changed_removed(namespace: Namespace, dataset: Path) -> None:
    mount, _ = namespace.add_mount("/data", f"file://{dataset}")
    (dataset / "train" / "cats" / "0.jpg").unlink()
    (dataset / "train" / "cats" / "1.jpg").write_bytes(b"changed")
    (dataset / "new").mkdir()
    (dataset / "new" / "a").write_bytes(b"a")
    (dataset / "new" / "b").write_bytes(b"b")
    refreshed, stats = namespace.refresh("/data")
    assert (stats.added, stats.changed, stats.removed) == (2, 1, 1)
    assert refreshed.generation != mount.generation
    assert namespace.stat("/data/train/cats/1.jpg").size == 7
    assert [s.path for s in namespace.ls("/data/new")] == ["/data/new/a", "/data/new/b"]
    with pytest.raises(PathNotFound):
        namespace.stat("/data/train/cats/0.jpg")
    assert list(namespace.engine.walk(mount.generation, "")) == [], "old generation is dropped"


def test_a_refresh_that_lists_nothing_keeps_the_files_unless_allowed(namespace: Namespace, dataset: Path, tmp_path: Path) -> None:
    """As `mount add` refuses an empty listing, so does a refresh of a mount that has files: a
    prefix emptied by mistake must not empty the mount with exit code 0."""
    namespace.add_mount("/data", f"file://{dataset}")
    before = sorted(s.path for s in namespace.walk("/data"))
    shutil.move(dataset, tmp_path / "aside")
    dataset.mkdir()
    with pytest.raises(MountError, match="keeps its files .--allow-empty empties it"):
        namespace.refresh("/data")
    assert sorted(s.path for s in namespace.walk("/data")) == before
    _, stats = namespace.refresh("/data", allow_empty=True)
    assert (stats.files, stats.removed) == (0, len(before))
    namespace.refresh("/data")  # empty before, empty now: nothing to keep


def test_failed_listing_leaves_mounts_untouched(namespace: Namespace, dataset: Path) -> None:
    namespace.add_mount("/data", f"file://{dataset}")
    before = namespace.mounts()
    with pytest.raises(SourceUnreachable):
        namespace.add_mount("/s3", "s3://bucket-x", {"endpoint": "http://127.0.0.1:1"})
    assert namespace.mounts() == before


def test_remove_mount_drops_manifest(namespace: Namespace, dataset: Path) -> None:
    mount, _ = namespace.add_mount("/data", f"file://{dataset}")
    namespace.remove_mount("/data/")
    assert namespace.mounts() == []
    assert namespace.engine.listdir(mount.generation, "") == []
    with pytest.raises(MountNotFound, match="/data: no such mount"):
        namespace.remove_mount("/data")
    with pytest.raises(MountNotFound):
        namespace.refresh("/nope")


def test_opening_a_directory_is_an_error(namespace: Namespace, dataset: Path) -> None:
    namespace.add_mount("/data", f"file://{dataset}")
    for path in ("/data", "/data/train", "/"):
        with pytest.raises(IsADirectory):
            namespace.open_object(path)


def test_a_file_named_as_a_directory_is_refused(namespace: Namespace, dataset: Path) -> None:
    namespace.add_mount("/data", f"file://{dataset}")
    for call in (namespace.stat, namespace.open_object, namespace.ls, lambda path: list(namespace.walk(path))):
        for named in ("/data/README/", "/data/README/."):
            with pytest.raises(NotADirectory, match=f"{named}: not a directory"):
                call(named)
    with pytest.raises(NotADirectory):
        namespace.open_objects(["/data/train/cats/0.jpg", "/data/README/"])
    assert namespace.stat("/data/train/").is_dir and namespace.stat("/data/train/.").is_dir, "a directory may be named so"
    assert [s.path for s in namespace.ls("/data/train/")] == ["/data/train/cats", "/data/train/dogs"]
    assert namespace.open_object("/data/README")[2].size == 7


def test_the_default_block_size_is_recorded_when_a_mount_is_added(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers with another GPUFEED_BLOCK_SIZE name the mount's blocks alike: the cache is not
    split in two, and cluster nodes agree on the owners."""
    monkeypatch.setenv("GPUFEED_BLOCK_SIZE", "64KiB")
    adding = Namespace(Settings.from_env())
    assert adding.add_mount("/data", f"file://{dataset}")[0].options["block_size"] == "64KiB"
    assert adding.add_mount("/big", f"file://{dataset}/train", {"block_size": "8MiB"})[0].options["block_size"] == "8MiB"
    monkeypatch.setenv("GPUFEED_BLOCK_SIZE", "1MiB")
    settings = Settings.from_env()
    assert CachePolicy.of(Namespace(settings).mount("/data"), settings).block_size == 64 << 10
    with monkeypatch.context() as bad:
        bad.setenv("GPUFEED_BLOCK_SIZE", "3")
        with pytest.raises(InvalidArgument, match="GPUFEED_BLOCK_SIZE '3': a block size must be between 4KiB and 1GiB"):
            Settings.from_env()


@pytest.mark.parametrize("bad", ["relative/path", "", "/a\0b"])
def test_bad_paths_are_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        normalize(bad)


def test_normalize() -> None:
    assert normalize("//data//x/./y/") == "/data/x/y"
    assert normalize("/") == "/"


def test_parse_options() -> None:
    assert parse_options(["endpoint=http://h:1/?a=b", "region=", "anonymous=true"]) == {
        "endpoint": "http://h:1/?a=b",
        "region": "",
        "anonymous": "true",
    }
    for bad in (["novalue"], ["=x"], [" =x"]):
        with pytest.raises(InvalidArgument, match="expected key=value"):
            parse_options(bad)


def test_mount_options_are_validated(namespace: Namespace, dataset: Path) -> None:
    with pytest.raises(InvalidArgument, match="unknown option"):
        namespace.add_mount("/data", f"file://{dataset}", {"speed": "fast"})
    with pytest.raises(InvalidArgument, match="exclude each other"):
        namespace.add_mount("/data", f"file://{dataset}", immutable=True, max_age=5)
    with pytest.raises(InvalidArgument, match="cannot mount at /"):
        namespace.add_mount("/", f"file://{dataset}")
    assert namespace.mounts() == []


def test_large_directory_listing(namespace: Namespace, tmp_path: Path) -> None:
    root = tmp_path / "many"
    (root / "d").mkdir(parents=True)
    for i in range(2500):
        fd = os.open(root / "d" / f"{i:05d}", os.O_CREAT | os.O_WRONLY)
        os.close(fd)
    _, stats = namespace.add_mount("/many", f"file://{root}")
    assert stats.files == 2500
    names = [s.path.rsplit("/", 1)[1] for s in namespace.ls("/many/d")]
    assert names == [f"{i:05d}" for i in range(2500)]


def test_lookups_follow_a_refresh_that_dropped_their_generation(namespace: Namespace, dataset: Path) -> None:
    """A reader holding a mount table read just before another process refreshed the mount (and
    dropped the generation it points at) still finds files, and lists directories in full."""
    namespace.add_mount("/data", f"file://{dataset}")
    other = Namespace(namespace.settings)
    for check in (
        lambda: namespace.stat("/data/train/cats/1.jpg").size == 1001,
        lambda: len(namespace.ls("/data/train/cats")) == 3,
        lambda: len(namespace.ls("/data")) == 3,
    ):
        cached = namespace.mounts()[0]
        other.refresh("/data")
        assert namespace.mounts()[0] == cached, "the table is still cached"
        assert check()
    other.close()


def test_refresh_racing_a_remove_does_not_resurrect_the_mount(
    namespace: Namespace, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mount, _ = namespace.add_mount("/data", f"file://{dataset}")
    source = namespace.source(mount)
    other = Namespace(namespace.settings)

    def listing_while_removed():  # the other process unmounts while this one lists
        other.remove_mount("/data")
        yield from type(source).list(source)

    monkeypatch.setattr(source, "list", listing_while_removed)
    with pytest.raises(MountConflict, match="removed or refreshed by another process"):
        namespace.refresh("/data")
    assert namespace.mounts(fresh=True) == []
    assert list(namespace.engine.walk(mount.generation + 1, "")) == [], "the refresh's own generation is dropped"
    other.close()


def test_empty_listing_suggests_the_nearest_prefix(namespace: Namespace, dataset: Path) -> None:
    (dataset / "trian").mkdir()
    hint = rf"file://{dataset}/trian: no objects under this prefix; did you mean file://{dataset}/train\? \(--allow-empty"
    with pytest.raises(MountError, match=hint):
        namespace.add_mount("/data", f"file://{dataset}/trian")
    assert namespace.mounts() == [], "nothing is recorded"
    mount, stats = namespace.add_mount("/data", f"file://{dataset}/trian", allow_empty=True)
    assert stats.files == 0 and namespace.ls("/data") == []
    assert namespace.mounts() == [mount]


def test_empty_s3_prefix_suggests_a_sibling(namespace: Namespace, bucket: Bucket) -> None:
    bucket.put("train/0.bin", b"x")
    bucket.put("val/0.bin", b"y")
    options = {"endpoint": bucket.endpoint}
    with pytest.raises(MountError, match=rf"{bucket.url}/trian: no objects under this prefix; did you mean {bucket.url}/train\?"):
        namespace.add_mount("/data", f"{bucket.url}/trian", options)
    with pytest.raises(MountError, match=r"no objects under this prefix \(--allow-empty mounts it anyway\)"):
        namespace.add_mount("/data", f"{bucket.url}/zzzzzz", options)
    assert namespace.mounts() == []
