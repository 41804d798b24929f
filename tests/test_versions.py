"""What a read returns after the source object changed, per mount policy (strict, --immutable,
--max-age) and per block (in the node cache or not), on real stores: nginx with a `--list` of
`KEY SIZE` lines (no version until the first open pins one), nginx's JSON index (versions are
Last-Modified) and S3 on moto (ETags). Objects are replaced at the source, never mocked."""

from __future__ import annotations

import itertools
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import gpufeed
from gpufeed.client import Client, FeedFile
from gpufeed.client.file import RawFeedFile
from gpufeed.errors import ObjectChanged, ObjectMissing
from gpufeed.namespace import Namespace
from tests.cli.test_cli import fails
from tests.conftest import Bucket, HttpServer

BLOCK = 4096
KEY = "big.bin"
PATH = f"/data/{KEY}"
REFRESH = r"run 'gpufeed mount refresh /data'"


@dataclass
class Store:
    url: str
    options: dict[str, str]
    replace: Callable[[bytes | None], None]
    """Put new bytes (a new version) at KEY, or delete it with None."""
    requests: Callable[[], list[str]] | None = None
    """HTTP only: 'METHOD path' of every request that reached the server for this store so far."""


def _nginx_store(kind: str, server: HttpServer, data: bytes, tmp_path: Path) -> Store:
    site = f"v-{uuid.uuid4().hex[:10]}"
    path = server.root / site / KEY
    path.parent.mkdir()
    path.write_bytes(data)
    marks = itertools.count()

    def replace(new: bytes | None) -> None:
        if new is None:
            path.unlink()
            return
        before = path.stat().st_mtime_ns
        path.write_bytes(new)
        stat = path.stat()  # nginx's ETag and Last-Modified have 1 s granularity: move to a later second
        os.utime(path, ns=(stat.st_atime_ns, max(stat.st_mtime_ns, before) + 10_000_000_000))

    def requests() -> list[str]:
        """Send a marker request and wait for its log line: nginx (one process) has logged every
        earlier request by then, so the count is exact without sleeping."""
        mark = f"/{site}/mark-{next(marks)}"
        try:
            urllib.request.urlopen(server.url + mark, timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
        for _ in range(10_000):
            lines = server.access_log.read_text().splitlines()
            if any(f"GET {mark} " in line for line in lines):
                break
        else:
            raise AssertionError(f"{mark} never reached the access log")
        found = [line.split('"')[1].rsplit(" ", 1)[0] for line in lines if f" /{site}/" in line]
        return [r for r in found if "/mark-" not in r]

    options: dict[str, str] = {}
    if kind == "http-list":
        listing = tmp_path / "listing.txt"
        listing.write_text(f"{KEY} {len(data)}\n")
        options["list"] = str(listing)
    return Store(f"{server.url}/{site}", options, replace, requests)


OLD = os.urandom(3 * BLOCK + 100)
NEW = os.urandom(len(OLD))


@pytest.fixture(params=["http-list", "http-index", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """KEY holding OLD (3 full blocks and a tail) at a fresh place in a real store."""
    if request.param == "s3":
        bucket: Bucket = request.getfixturevalue("bucket")
        bucket.put(KEY, OLD)

        def replace(new: bytes | None) -> None:
            bucket.put(KEY, new) if new is not None else bucket.delete(KEY)

        return Store(bucket.url, {"endpoint": bucket.endpoint}, replace)
    return _nginx_store(request.param, request.getfixturevalue("nginx"), OLD, tmp_path)


@pytest.fixture
def http_list(nginx: HttpServer, tmp_path: Path) -> Store:
    return _nginx_store("http-list", nginx, OLD, tmp_path)


def mount(store: Store, *, cache: bool = True, immutable: bool = False, max_age: float | None = None) -> None:
    options = {**store.options, "block_size": "4KiB", "cache": "on" if cache else "off"}
    Namespace().add_mount("/data", store.url, options, immutable=immutable, max_age=max_age)


def read_at(f: RawFeedFile | FeedFile, offset: int, size: int) -> bytes:
    f.seek(offset)
    return f.read(size)


@pytest.fixture
def opened() -> Iterator[Callable[[], RawFeedFile]]:
    """Open files whose every read goes to the read path (`FeedFile.raw`): these tests say which
    reads the cache serves and which the store must; a buffered file serves a read its buffer
    holds from there (`test_a_buffered_file_reads_only_its_version`)."""
    files: list[FeedFile] = []

    def open_() -> RawFeedFile:
        files.append(gpufeed.open(PATH))  # kept: a buffered file closes its raw file when collected
        return files[-1].raw

    yield open_
    for f in files:
        f.close()


# -- default (strict): only the listed version is ever read -------------------------------


def test_strict_open_file_serves_cached_blocks_and_fails_uncached_ones(store: Store, opened: Callable) -> None:
    """The must-show case: an object replaced between two range reads of one open file. Block 0
    is cached and IS the listed version; a read that needs the store fails as a whole, even
    when it also covers the cached block: old bytes or a clear error, never a mix."""
    mount(store)
    f = opened()
    assert read_at(f, 0, 100) == OLD[:100]
    store.replace(NEW)
    assert read_at(f, 100, BLOCK - 100) == OLD[100:BLOCK], "cached block of the listed version"
    with pytest.raises(ObjectChanged, match=rf"{PATH}: changed at the source .*{REFRESH}"):
        read_at(f, BLOCK - 50, 100)  # 50 cached bytes + 50 that must come from the store
    with pytest.raises(ObjectChanged):
        read_at(f, 2 * BLOCK, 10)
    assert read_at(f, 0, BLOCK) == OLD[:BLOCK], "the failed reads cached nothing of the new version"


def test_strict_uncached_mount_fails_the_read_after_a_change(store: Store, opened: Callable) -> None:
    mount(store, cache=False)
    f = opened()
    assert read_at(f, 0, 100) == OLD[:100]
    store.replace(NEW)
    with pytest.raises(ObjectChanged, match=rf"{PATH}: changed at the source .*{REFRESH}"):
        read_at(f, 100, 100)
    with pytest.raises(ObjectChanged):
        gpufeed.read(PATH, 0, 100)


def test_strict_later_opens_read_the_listed_version_until_refresh(store: Store) -> None:
    mount(store)
    assert gpufeed.read(PATH, 0, 100) == OLD[:100]
    store.replace(NEW)
    assert gpufeed.read(PATH, 0, BLOCK) == OLD[:BLOCK], "cached blocks are the manifest's version"
    with pytest.raises(ObjectChanged, match=REFRESH):
        gpufeed.read(PATH)
    Namespace().refresh("/data")
    assert gpufeed.read(PATH) == NEW, "after refresh every block is the new version, block 0 too"


def test_strict_deleted_object_is_a_clear_error(store: Store) -> None:
    mount(store)
    store.replace(None)
    with pytest.raises(ObjectMissing, match=rf"{PATH}: deleted at the source .*{REFRESH}"):
        gpufeed.read(PATH)


def test_strict_cli_prints_one_line_naming_the_path(store: Store) -> None:
    mount(store)
    assert gpufeed.read(PATH, 0, 10) == OLD[:10]  # a KEY SIZE entry has a version once opened
    store.replace(NEW)
    line = fails(1, "cat", PATH)
    assert PATH in line and "changed at the source" in line and "gpufeed mount refresh /data" in line


def test_a_buffered_file_reads_only_its_version(store: Store) -> None:
    """What `gpufeed.open` returns buffers up to a block (here): a read its buffer holds is
    served from there, bytes of the version it opened, and a read past it that needs the store
    fails. Old bytes or a clear error, never a mix, as for the unbuffered file."""
    mount(store)
    with gpufeed.open(PATH) as f:
        assert read_at(f, 0, 100) == OLD[:100]
        store.replace(NEW)
        assert read_at(f, 100, BLOCK - 100) == OLD[100:BLOCK], "from the buffer: the version opened"
        with pytest.raises(ObjectChanged, match=rf"{PATH}: changed at the source"):
            read_at(f, BLOCK - 50, 100)


# -- --immutable: a promise by the user; reads are not conditional ---------------------------


def test_immutable_serves_cached_blocks_and_reads_uncached_ones_as_they_are_now(store: Store, opened: Callable) -> None:
    mount(store, immutable=True)
    f = opened()
    assert read_at(f, 0, 100) == OLD[:100]
    store.replace(NEW)
    assert read_at(f, 0, BLOCK) == OLD[:BLOCK], "cached block"
    assert read_at(f, 2 * BLOCK, 100) == NEW[2 * BLOCK : 2 * BLOCK + 100], "uncached block: the object as it is now"
    assert gpufeed.read(PATH, BLOCK, 100) == NEW[BLOCK : BLOCK + 100], "a new open too"


def test_immutable_uncached_mount_reads_the_new_bytes(store: Store, opened: Callable) -> None:
    mount(store, cache=False, immutable=True)
    f = opened()
    assert read_at(f, 0, 100) == OLD[:100]
    store.replace(NEW)
    assert read_at(f, 0, 100) == NEW[:100]


@pytest.mark.parametrize("cache", [True, False])
def test_immutable_never_returns_a_short_read(store: Store, cache: bool) -> None:
    mount(store, cache=cache, immutable=True)
    store.replace(NEW[:-50])
    with pytest.raises(ObjectChanged, match=PATH):
        gpufeed.read(PATH, 3 * BLOCK, 100)
    with pytest.raises(ObjectChanged, match=PATH):
        gpufeed.read(PATH)
    store.replace(NEW + b"grown")
    assert gpufeed.read(PATH) == NEW, "a grown object is read up to its listed size"


# -- --max-age S: past S every open re-checks and reads the current version ---------------------


def test_max_age_past_the_limit_each_open_reads_the_current_version(store: Store, opened: Callable) -> None:
    mount(store, max_age=0)
    listed = gpufeed.stat(PATH).version
    f = opened()
    assert read_at(f, 0, 100) == OLD[:100]
    store.replace(NEW)
    assert read_at(f, 0, BLOCK) == OLD[:BLOCK], "an open file keeps its version: cached block"
    with pytest.raises(ObjectChanged, match=PATH):
        read_at(f, 2 * BLOCK, 100)  # ...and fails where the store must send a block of it
    g = opened()
    assert read_at(g, 0, len(NEW)) == NEW, "a new open pins the new version: new blocks, block 0 too"
    assert gpufeed.stat(PATH).version != listed, "the manifest records the version an open pinned"
    store.replace(OLD[:-10])
    assert gpufeed.read(PATH) == OLD[:-10], "and the next change is picked up on the next open"
    assert gpufeed.stat(PATH).size == len(OLD) - 10


def test_max_age_uncached_mount(store: Store) -> None:
    mount(store, cache=False, max_age=0)
    assert gpufeed.read(PATH, 0, 100) == OLD[:100]
    store.replace(NEW)
    assert gpufeed.read(PATH) == NEW


def test_max_age_within_the_limit_is_strict(store: Store) -> None:
    mount(store, max_age=3600)
    assert gpufeed.read(PATH, 0, 100) == OLD[:100]
    store.replace(NEW)
    assert gpufeed.read(PATH, 0, BLOCK) == OLD[:BLOCK]
    with pytest.raises(ObjectChanged, match=REFRESH):
        gpufeed.read(PATH, 2 * BLOCK, 100)


def test_max_age_deleted_object_is_a_clear_error(store: Store) -> None:
    mount(store, max_age=0)
    store.replace(None)
    with pytest.raises(ObjectMissing, match=rf"{PATH}: deleted at the source .*{REFRESH}"):
        gpufeed.read(PATH)


# -- HTTP `KEY SIZE` entries: a version from the first open --------------------------------------


def test_a_listed_entry_without_version_is_pinned_once_by_its_first_open(http_list: Store, namespace: Namespace) -> None:
    """On both metadata engines (the `namespace` fixture points GPUFEED_META at SQLite, then Redis)."""
    assert http_list.requests is not None
    mount(http_list)
    head = f"HEAD /{http_list.url.rsplit('/', 1)[1]}/{KEY}"
    assert http_list.requests() == [head], "a KEY SIZE listing costs one request: its first line is checked"
    assert gpufeed.stat(PATH).etag is None
    assert gpufeed.read(PATH) == OLD
    assert http_list.requests()[:2] == [head, head], "the first open pins the version"
    assert [r.split()[0] for r in http_list.requests()].count("HEAD") == 2
    etag = Namespace().stat(PATH).etag
    assert etag is not None and etag.startswith('"') and etag.endswith(f'-{len(OLD):x}"'), "nginx's ETag: mtime-size"
    other = Client()  # as in another process: the version is in the manifest
    assert other.read(PATH, 0, 10) == OLD[:10]
    other.close()
    assert [r.split()[0] for r in http_list.requests()].count("HEAD") == 2


def test_a_refresh_after_a_pin_counts_no_change_and_unpins(http_list: Store) -> None:
    """The version a first open pinned is not a change of the object: refresh reports nothing
    changed, and the new listing's entry is pinned again by its own first open."""
    mount(http_list)
    assert gpufeed.read(PATH) == OLD and gpufeed.stat(PATH).etag is not None
    _, stats = Namespace().refresh("/data")
    assert (stats.added, stats.changed, stats.removed) == (0, 0, 0)
    assert gpufeed.stat(PATH).etag is None
    assert gpufeed.read(PATH) == OLD


def test_immutable_mount_does_not_pin(http_list: Store) -> None:
    assert http_list.requests is not None
    mount(http_list, immutable=True)
    listed = len(http_list.requests())  # the listing's check of its first line
    assert gpufeed.read(PATH) == OLD
    assert {r.split()[0] for r in http_list.requests()[listed:]} == {"GET"}, "one GET per block, no HEAD"
    assert gpufeed.stat(PATH).etag is None


def test_a_size_change_before_the_first_open_is_a_clear_error(http_list: Store) -> None:
    mount(http_list)
    http_list.replace(OLD + b"more")
    with pytest.raises(ObjectChanged, match=rf"{PATH}: changed .* \(listed {len(OLD)} bytes, now {len(OLD) + 4}\); {REFRESH}"):
        gpufeed.read(PATH)
    assert gpufeed.stat(PATH).etag is None, "nothing recorded"


def test_a_delete_before_the_first_open_is_a_clear_error(http_list: Store) -> None:
    mount(http_list)
    http_list.replace(None)
    with pytest.raises(ObjectMissing, match=rf"{PATH}: deleted at the source .*{REFRESH}"):
        gpufeed.read(PATH)


def test_max_age_keeps_the_hash_of_an_unchanged_object_listed_from_an_index(nginx: HttpServer, tmp_path: Path) -> None:
    """An index listing records a modification time, a HEAD an ETag too: the same object, so
    after --max-age its content hash and its blocks stay."""
    import hashlib
    import uuid

    name = f"t-{uuid.uuid4().hex[:8]}"
    (nginx.root / name).mkdir()
    (nginx.root / name / "a.bin").write_bytes(b"z" * 5000)
    sums = tmp_path / "SUMS"
    sums.write_text(f"{hashlib.sha256(b'z' * 5000).hexdigest()}  a.bin\n")
    client = Client()
    client.namespace.add_mount("/h", f"{nginx.url}/{name}", max_age=0.0, checksums=str(sums))
    assert client.read("/h/a.bin") == b"z" * 5000
    assert client.stat("/h/a.bin").content_hash is not None
