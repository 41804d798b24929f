"""The read API over every real source kind: file://, S3 on moto, HTTP on nginx."""

from __future__ import annotations

import io
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import gpufeed
from gpufeed.blocks import CHUNK
from gpufeed.errors import InvalidArgument, ObjectChanged, ObjectMissing
from gpufeed.namespace import Namespace
from tests.conftest import Bucket, HttpServer

CONTENT = {f"dir/{i}.bin": os.urandom(1000 + 37 * i) for i in range(5)} | {"empty": b"", "top.txt": b"hello"}


def _file_source(tmp_path: Path) -> tuple[str, dict[str, str], Callable[[str, bytes | None], None]]:
    root = tmp_path / "src"

    def put(key: str, data: bytes | None) -> None:
        path = root / key
        if data is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            stat = path.stat()
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))

    for key, data in CONTENT.items():
        put(key, data)
    return f"file://{root}", {}, put


@pytest.fixture(params=["file", "s3", "http"])
def source(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str], Callable[[str, bytes | None], None]]:
    """(url, options, put) where put(key, bytes) writes and put(key, None) deletes at the source."""
    if request.param == "file":
        return _file_source(tmp_path)
    if request.param == "s3":
        bucket: Bucket = request.getfixturevalue("bucket")

        def put(key: str, data: bytes | None) -> None:
            bucket.put(f"prefix/{key}", data) if data is not None else bucket.delete(f"prefix/{key}")

        for key, data in CONTENT.items():
            put(key, data)
        bucket.put("outside-prefix", b"not mounted")
        return f"{bucket.url}/prefix", {"endpoint": bucket.endpoint}, put
    server: HttpServer = request.getfixturevalue("nginx")
    sub = f"site-{tmp_path.name}"
    url, _, put_file = _file_source(tmp_path)
    shutil.copytree(url.removeprefix("file://"), server.root / sub)

    def put(key: str, data: bytes | None) -> None:
        path = server.root / sub / key
        if data is None:
            path.unlink()
        else:
            before = path.stat().st_mtime_ns if path.exists() else 0
            path.write_bytes(data)
            stat = path.stat()  # HTTP versions have 1 s granularity (Last-Modified): move to a later second
            os.utime(path, ns=(stat.st_atime_ns, max(stat.st_mtime_ns, before) + 10_000_000_000))

    return f"{server.url}/{sub}", {}, put


@pytest.fixture
def mounted(source: tuple[str, dict[str, str], Callable], monkeypatch: pytest.MonkeyPatch) -> Callable[[str, bytes | None], None]:
    url, options, put = source
    Namespace().add_mount("/data", url, options)
    return put


def test_manifest_matches_source(mounted: Callable) -> None:
    files = {s.path: s.size for s in gpufeed.walk("/data")}
    assert files == {f"/data/{k}": len(v) for k, v in CONTENT.items()}
    assert [s.path for s in gpufeed.ls("/data")] == ["/data/dir", "/data/empty", "/data/top.txt"]


def test_read_whole_ranges_and_past_end(mounted: Callable) -> None:
    for key, data in CONTENT.items():
        assert gpufeed.read(f"/data/{key}") == data
    data = CONTENT["dir/3.bin"]
    assert gpufeed.read("/data/dir/3.bin", 10, 100) == data[10:110]
    assert gpufeed.read("/data/dir/3.bin", len(data) - 5, 100) == data[-5:]
    assert gpufeed.read("/data/dir/3.bin", len(data) + 5, 10) == b""
    with pytest.raises(InvalidArgument):
        gpufeed.read("/data/dir/3.bin", -1, 10)


def test_open_read_readinto_seek_tell(mounted: Callable) -> None:
    data = CONTENT["dir/4.bin"]
    with gpufeed.open("/data/dir/4.bin") as f:
        assert f.size == len(data)
        assert f.read(10) == data[:10]
        assert f.tell() == 10
        buffer = bytearray(100)
        assert f.readinto(buffer) == 100
        assert bytes(buffer) == data[10:110]
        assert f.seek(-20, os.SEEK_END) == len(data) - 20
        assert f.read() == data[-20:]
        assert f.read() == b""
        f.seek(5)
        f.seek(5, os.SEEK_CUR)
        assert f.read(3) == data[10:13]
        with pytest.raises(ValueError):
            f.seek(-1)
    with pytest.raises(ValueError):
        f.read()


def test_deleted_at_source_is_a_clear_error(mounted: Callable) -> None:
    mounted("dir/1.bin", None)
    with pytest.raises(ObjectMissing, match=r"/data/dir/1.bin: deleted at the source .* 'gpufeed mount refresh /data'"):
        gpufeed.read("/data/dir/1.bin")


def test_changed_at_source_never_mixes_versions_uncached(source: tuple) -> None:
    url, options, put = source
    Namespace().add_mount("/data", url, {**options, "cache": "off"})
    with gpufeed.open("/data/dir/2.bin") as buffered, gpufeed.open("/data/dir/2.bin") as unbuffered:
        f = unbuffered.raw  # every read goes to the store
        first = f.read(100)
        assert buffered.read(100) == first
        put("dir/2.bin", b"X" * len(CONTENT["dir/2.bin"]))
        with pytest.raises(ObjectChanged, match="/data/dir/2.bin: changed at the source"):
            f.read(100)
        assert buffered.read(100) == CONTENT["dir/2.bin"][100:200], "the whole file was buffered: its version"
    assert first == CONTENT["dir/2.bin"][:100]
    with pytest.raises(ObjectChanged):
        gpufeed.read("/data/dir/2.bin")


def test_changed_at_source_never_mixes_versions_cached(source: tuple) -> None:
    """Cached blocks belong to the manifest's version: an open file keeps reading that version
    while it is cached, and a block not yet cached fails instead of mixing in new bytes."""
    url, options, put = source
    big = os.urandom(5 * 4096 + 123)
    put("big.bin", big)
    Namespace().add_mount("/data", url, {**options, "block_size": "4KiB"})
    with gpufeed.open("/data/big.bin") as f:
        assert f.read(100) == big[:100]
        put("big.bin", os.urandom(len(big)))
        assert f.read(4000 - 100) == big[100:4000], "block 0 is cached: same version"
        f.seek(3 * 4096)
        with pytest.raises(ObjectChanged, match="/data/big.bin: changed at the source"):
            f.read(100)
    Namespace().refresh("/data")
    assert gpufeed.read("/data/big.bin") != big


def test_refresh_makes_new_version_readable(mounted: Callable) -> None:
    mounted("top.txt", b"new contents")
    _, stats = Namespace().refresh("/data")
    assert stats.changed == 1
    assert gpufeed.read("/data/top.txt") == b"new contents"


def test_max_age_revalidates_on_open(source: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    url, options, put = source
    ns = Namespace()
    ns.add_mount("/data", url, options, max_age=0)
    put("top.txt", b"fresh!")
    time.sleep(0.01)
    assert gpufeed.read("/data/top.txt") == b"fresh!"
    assert gpufeed.stat("/data/top.txt").size == 6, "manifest entry updated"


def test_readinto_over_many_blocks_fills_the_buffer_with_a_block_missing_from_the_cache(tmp_path: Path) -> None:
    root = tmp_path / "big"
    root.mkdir()
    body = os.urandom(5 * 4096 + 123)
    (root / "f.bin").write_bytes(body)
    Namespace().add_mount("/big", f"file://{root}", {"block_size": "4KiB"})
    client = gpufeed.client()
    handle = client.handle("/big/f.bin")
    client.warm(handle)
    assert handle.blocks is not None
    os.unlink(handle.blocks.path(2))  # evicted: the copy block by block stops there, the rest is read again
    buffer = bytearray(len(body) - 100)
    with gpufeed.open("/big/f.bin") as f:
        f.seek(50)
        assert f.readinto(buffer) == len(buffer)
        assert f.readinto(bytearray(1000)) == 50, "short at the end of the file"
    assert bytes(buffer) == body[50:-50]


def test_reads_over_many_blocks_are_copied_once_into_one_buffer(tmp_path: Path) -> None:
    """A read over several blocks (a shard read whole, a checkpoint's tensor), cached or fetched
    for it, copies each block into its one result, handed out as it is: `read_range` returns a view of a bytes
    of its own, which `FeedFile.read` returns without copying again. With a block missing and
    another damaged, the bytes are still right and the damaged block is repaired."""
    root = tmp_path / "big"
    root.mkdir()
    block = 1 << 20
    body = os.urandom(5 * block + 123)
    (root / "f.bin").write_bytes(body)
    Namespace().add_mount("/big", f"file://{root}", {"block_size": "1MiB"})
    client = gpufeed.client()
    handle = client.handle("/big/f.bin")
    cold = client.read_range(handle, 100, 3 * block)  # fetched first, then read back
    assert cold == body[100 : 3 * block]
    assert type(cold.obj) is bytes and cold.nbytes == len(cold.obj)
    client.warm(handle)
    assert handle.blocks is not None
    for _ in range(2):  # block files not held by this process, then held (from their second read)
        for start, end in [(0, len(body)), (100, 3 * block + 5), (block, 3 * block), (block - 1, block + 1)]:
            data = client.read_range(handle, start, end)
            assert data == body[start:end]
            assert type(data.obj) is bytes and data.nbytes == len(data.obj), "one buffer, nothing to copy again"
        with gpufeed.open("/big/f.bin") as f:
            f.seek(10)
            assert f.read(2 * block) == body[10 : 10 + 2 * block]
            assert f.read() == body[10 + 2 * block :]
    os.unlink(handle.blocks.path(2))
    damaged = handle.blocks.path(3)
    with open(damaged, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"XXXXX")
    assert client.read_range(handle, 50, len(body) - 50) == body[50:-50]
    buffer = bytearray(len(body))
    with gpufeed.open("/big/f.bin") as f:
        assert f.readinto(buffer) == len(body)
    assert buffer == body
    assert Path(damaged).read_bytes()[-5:] == body[4 * block - 5 : 4 * block], "the damaged block was fetched again"


def test_lines_and_small_reads_come_from_a_buffer(tmp_path: Path) -> None:
    """`gpufeed.open` buffers as Python's `open` does: iterating a JSON-lines file reads the
    cache once per checksum chunk, not once per line (or per byte, as an unbuffered file's
    `readline` does)."""
    root = tmp_path / "text"
    root.mkdir()
    body = b"".join(b'{"id": %d, "caption": "%s"}\n' % (i, b"x" * (i % 90)) for i in range(20_000))
    (root / "d.jsonl").write_bytes(body)
    Namespace().add_mount("/text", f"file://{root}")
    client = gpufeed.client()
    client.warm(client.handle("/text/d.jsonl"))
    with gpufeed.open("/text/d.jsonl") as f:
        assert list(f) == body.splitlines(keepends=True)
        reads = f.handle.tally.hits
        assert reads <= -(-len(body) // CHUNK) + 1, f"{reads} reads of the cache for {len(body)} bytes of lines"
        f.seek(12345)
        assert f.read(10) + f.readline() == body[12345 : body.index(b"\n", 12355) + 1]
    with io.TextIOWrapper(gpufeed.open("/text/d.jsonl"), encoding="utf-8") as text:  # a buffered file: text mode works
        assert text.readline() == body[: body.index(b"\n") + 1].decode()
