"""Pack → mount → every member byte-identical; resume after kill -9; bad inputs; the packed view
through fsspec. Real moto S3 server, real `gpufeed` processes for the CLI contract."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import msgspec
import pytest

import gpufeed
from gpufeed.client import Client
from gpufeed.client.connection import AgentClient, stop_agent
from gpufeed.config import Settings
from gpufeed.errors import ObjectMissing, PackError
from gpufeed.meta.base import Entry
from gpufeed.namespace import Namespace
from gpufeed.pack import index as idx
from gpufeed.pack import packer
from gpufeed.pack.layout import DIR, INDEX_KEY, object_entry
from gpufeed.pack.members import MemberTable
from gpufeed.pack.shards import ShardBuffers, ShardTask, write_shard
from tests.cli.test_cli import fails, ok
from tests.client.test_forked_reads import in_forked_child
from tests.conftest import Bucket, HttpServer
from tests.writes.test_appender import eventually


def files_in(bucket: Bucket, prefix: str, count: int, seed: int = 0) -> dict[str, bytes]:
    """`count` files of 1 B to 40 KB (and every 50th 1.5 MiB) in nested dirs, uploaded under `prefix`."""
    rng = random.Random(seed)
    out = {}
    for n in range(count):
        size = 1_500_000 if n % 50 == 7 else rng.randint(1, 40_000)
        key = f"train/c{n % 7}/img_{n:04d}.jpg"
        out[key] = rng.randbytes(size)
        bucket.put(f"{prefix}/{key}", out[key])
    return out


def sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def opts(bucket: Bucket) -> list[str]:
    return ["--opt", f"endpoint={bucket.endpoint}"]


def shard_keys(bucket: Bucket, prefix: str) -> set[str]:
    """The shard and digest objects of the pack at `prefix`."""
    listing = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=f"{prefix}/{DIR}/shards/")  # type: ignore[attr-defined]
    return {item["Key"] for item in listing.get("Contents", [])}


def test_pack_mount_every_member_identical(bucket: Bucket) -> None:
    raw = files_in(bucket, "raw", 240)
    ok("mount", "add", "/raw", f"{bucket.url}/raw", *opts(bucket))
    packed = f"{bucket.url}/packed"
    out = ok("pack", "/raw", packed, "--shard-size", "1MiB", "--workers", "3", *opts(bucket))
    assert "packed 240 files" in out
    ok("mount", "add", "/imnet", packed, *opts(bucket))
    ok("cache", "clear")  # packing cached the raw files' blocks; count only what the packed view reads
    warmed = json.loads(ok("warmup", "/imnet/train/c1", "-q", "--json"))
    cached = AgentClient(Settings.from_env()).stats().bytes  # block files: the bytes and their chunk sums
    assert warmed["bytes"] < warmed["fetched_bytes"] <= cached < 1.01 * warmed["fetched_bytes"], (
        "what the store sent: the members' whole shard blocks, each once"
    )

    ns = Namespace()
    listed = {f.path.removeprefix("/imnet/"): f for f in ns.walk("/imnet")}
    assert set(listed) == set(raw)
    assert [f.path for f in ns.ls("/imnet")] == ["/imnet/train"], "the pack's own directory is hidden"
    for key, data in raw.items():
        info = listed[key].info
        assert info is not None and info.pack_key is not None and info.size == len(data)
        assert info.content_hash == f"sha256:{sha(data)}"
        assert sha(gpufeed.read(f"/imnet/{key}")) == sha(data), key
    with gpufeed.open("/imnet/train/c0/img_0007.jpg") as f:  # a 1.5 MiB member, read in pieces
        f.seek(1_000_000)
        assert f.read(10) == raw["train/c0/img_0007.jpg"][1_000_000:1_000_010]
        assert f.read() == raw["train/c0/img_0007.jpg"][1_000_010:]

    # the cache holds the shards' blocks, not one block per file: many members to a block
    stats = AgentClient(Settings.from_env()).stats()
    assert stats.blocks < len(raw) / 4, stats.blocks
    # gpufeed verify hashes every member through the packed view and finds the index's hashes
    assert "240 matched, 0 mismatched" in ok("verify", "/imnet")


def test_packed_view_through_fsspec_and_read_files(bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = files_in(bucket, "raw", 60, seed=1)
    ns = Namespace()
    ns.add_mount("/raw", f"{bucket.url}/raw", {"endpoint": bucket.endpoint})
    ok("pack", "/raw", f"{bucket.url}/p", "--shard-size", "256KiB", *opts(bucket))
    ns.add_mount("/p", f"{bucket.url}/p", {"endpoint": bucket.endpoint})
    fs = fsspec.filesystem("gpufeed")
    assert fs.ls("/p", detail=False) == ["/p/train"]
    key = "train/c3/img_0010.jpg"
    assert fs.info(f"/p/{key}")["size"] == len(raw[key])
    assert fs.cat_file(f"/p/{key}") == raw[key]
    assert fs.cat_file(f"/p/{key}", start=5, end=-5) == raw[key][5:-5]
    with fs.open(f"/p/{key}", "rb") as f:
        assert f.read() == raw[key]
    keys = sorted(raw)
    random.Random(3).shuffle(keys)  # an exact per-sample shuffle reads as well as an ordered one
    client = Client()  # as a new DataLoader worker: nothing of the pack opened yet
    looked_up: list[str | None] = []
    container = client.namespace.container

    def counted(where: Any, member: Any) -> Any:
        looked_up.append(member.pack_key)
        return container(where, member)

    monkeypatch.setattr(client.namespace, "container", counted)
    got = client.read_files([f"/p/{k}" for k in keys])
    assert [sha(g) for g in got] == [sha(raw[k]) for k in keys]
    shards = {f.info.pack_key for f in Namespace().walk("/p") if f.info is not None}
    assert sorted(looked_up) == sorted(shards) and len(shards) > 1, "each shard's pinned version looked up once, not per member"


def test_rerun_is_a_noop_and_order_is_followed(bucket: Bucket, tmp_path: Path) -> None:
    raw = files_in(bucket, "raw", 30, seed=2)
    Namespace().add_mount("/raw", f"{bucket.url}/raw", {"endpoint": bucket.endpoint})
    order = tmp_path / "order.txt"
    first = ["train/c6/img_0027.jpg", "/raw/train/c0/img_0000.jpg"]
    order.write_text("\n".join(first) + "\n")
    dest = tmp_path / "packed"
    ok("pack", "/raw", f"file://{dest}", "--order", str(order))
    index = (dest / INDEX_KEY).read_bytes()
    assert "up to date" in ok("pack", "/raw", f"file://{dest}", "--order", str(order))
    assert (dest / INDEX_KEY).read_bytes() == index
    from gpufeed.pack import index as idx

    paths = idx.decode(index, "test").paths
    assert paths[:2] == ["train/c6/img_0027.jpg", "train/c0/img_0000.jpg"] and sorted(paths) == sorted(raw)


def test_an_order_file_names_files_as_written_and_skips_comments(tmp_path: Path, dataset: Path) -> None:
    (dataset / "#first.txt").write_bytes(b"1")
    (dataset / "trail ").write_bytes(b"2")
    Namespace().add_mount("/data", f"file://{dataset}")
    order = tmp_path / "order.txt"
    order.write_text("# the two odd names first\n#first.txt\n\ntrail \n  /data/README  \n")
    files = packer.members(Client(), "/data", order)
    assert [path for path, _ in files[:3]] == ["#first.txt", "trail ", "README"]
    assert len(files) == 10


def test_kill_during_pack_then_rerun_gives_the_same_index(bucket: Bucket, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    rng = random.Random(4)
    for n in range(400):
        (tmp_path / "src" / f"{n:04d}.bin").write_bytes(rng.randbytes(rng.randint(100, 9000)))
    Namespace().add_mount("/src", f"file://{tmp_path / 'src'}")
    args = ["/src", "--shard-size", "8KiB", "--workers", "1", "--quiet", *opts(bucket)]
    ok("pack", *args[:1], f"{bucket.url}/clean", *args[1:])
    clean = bucket.client.get_object(Bucket=bucket.name, Key=f"clean/{INDEX_KEY}")["Body"].read()  # type: ignore[attr-defined]

    def shards() -> int:
        return len(shard_keys(bucket, "killed"))

    env = {**os.environ, "COLUMNS": "200"}
    child = subprocess.Popen([sys.executable, "-m", "gpufeed", "pack", *args[:1], f"{bucket.url}/killed", *args[1:]], env=env)
    deadline = time.monotonic() + 60
    while shards() < 6 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL, "the pack finished before it could be killed"
    index_keys = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=f"killed/{INDEX_KEY}")  # type: ignore[attr-defined]
    assert index_keys.get("KeyCount", 0) == 0, "no index before the last shard"
    out = ok("pack", *args[:1], f"{bucket.url}/killed", *args[1:], "--json")
    assert '"kept": 0' not in out
    resumed = bucket.client.get_object(Bucket=bucket.name, Key=f"killed/{INDEX_KEY}")["Body"].read()  # type: ignore[attr-defined]
    assert resumed == clean


def test_bad_inputs_one_line(bucket: Bucket, tmp_path: Path, dataset: Path) -> None:
    Namespace().add_mount("/data", f"file://{dataset}")
    (tmp_path / "a-file").write_bytes(b"x")
    assert "cannot create the destination" in fails(1, "pack", "/data", f"file://{tmp_path}/a-file/pack")
    assert fails(2, "pack", "/data", "http://127.0.0.1:1/out").endswith(
        "http://127.0.0.1:1/out: an HTTP server cannot be written; pack into a local dir, s3://, gs:// or az://")
    line = fails(1, "pack", "/data", "s3://no-such-bucket/x", *opts(bucket))
    assert "no-such-bucket" in line and "NoSuchBucket" in line
    (tmp_path / "empty").mkdir()
    ok("mount", "add", "/empty", f"file://{tmp_path}/empty", "--allow-empty")
    assert "/empty: no files to pack" in fails(1, "pack", "/empty", f"file://{tmp_path}/p1")
    assert "/data/none: nothing to pack" in fails(1, "pack", "/data/none", f"file://{tmp_path}/p2")
    assert not (tmp_path / "p1").exists() and not (tmp_path / "p2").exists(), "a pack that failed leaves no empty destination"
    inside = fails(2, "pack", "/data/train", f"{dataset}/packed")  # the next pack of /data would pack it again
    assert f"file://{dataset}/packed: inside the source of /data (file://{dataset})" in inside
    (tmp_path / "link").symlink_to(dataset)
    inside = fails(2, "pack", "/data/train", f"{tmp_path}/link/packed")  # the same place, through a link
    assert f"file://{tmp_path}/link/packed: inside the source of /data (file://{dataset})" in inside
    (tmp_path / "other").mkdir()
    ok("mount", "add", "/other", f"file://{tmp_path}/other", "--allow-empty")
    warned = subprocess.run([sys.executable, "-m", "gpufeed", "pack", "/data", f"{tmp_path}/other/packed"],
                            capture_output=True, text=True, check=True).stderr
    assert f"inside the source of mount /other (file://{tmp_path}/other): its next refresh lists the pack's" in warned
    ok("pack", "/data", f"file://{tmp_path}/p3")
    staged = next((tmp_path / "p3" / DIR / "shards").iterdir()).with_suffix(".gfp#7")  # as a killed pack leaves one
    staged.write_bytes(b"half a shard")
    assert "up to date (8 files in 1 shard) with /data as listed at " in ok("pack", "/data", f"file://{tmp_path}/p3")
    assert not staged.exists(), "the pack that completed removed it"
    (tmp_path / "p3" / INDEX_KEY).write_bytes(b"GFPACK\x00\x01garbage")
    line = fails(1, "mount", "add", "/p3", f"file://{tmp_path}/p3")
    assert "corrupt pack index" in line and INDEX_KEY in line
    assert fails(1, "mount", "add", "/p4", f"file://{tmp_path}/p3", "--opt", "format=webdataset").endswith(
        "no .tar shards to mount as a WebDataset"
    )


def test_a_pack_served_over_http_without_its_format_is_named(nginx: HttpServer, dataset: Path) -> None:
    """An HTTP listing hides the pack's dot dir: the empty mount says what is there and how to mount it."""
    ok("mount", "add", "/data", f"file://{dataset}")
    site = nginx.root / f"packed-{dataset.parent.name}"
    ok("pack", "/data", f"file://{site}")
    url = f"{nginx.url}/{site.name}"
    assert fails(1, "mount", "add", "/p", url) == (
        f"gpufeed: error: {url}: no objects listed, but a gpufeed pack is there: mount it with --opt format=gpufeed-pack"
    )
    ok("mount", "add", "/p", url, "--opt", "format=gpufeed-pack")
    assert gpufeed.read("/p/train/dogs/2.jpg") == (dataset / "train" / "dogs" / "2.jpg").read_bytes()


def test_a_pack_on_a_web_server_that_lists_nothing_mounts_from_its_index(tmp_path: Path, dataset: Path) -> None:
    """A static host (HTML directory pages, or none) has no JSON index; a pack needs none: its
    index names the shards."""
    from gpufeed.bench.server import serving

    ok("mount", "add", "/data", f"file://{dataset}")
    ok("pack", "/data", f"file://{tmp_path}/www/packed")
    with serving(tmp_path / "www", tmp_path / "nginx", index="html") as url:
        ok("mount", "add", "/p", f"{url}/packed", "--opt", "format=gpufeed-pack")
        assert gpufeed.read("/p/train/dogs/2.jpg") == (dataset / "train" / "dogs" / "2.jpg").read_bytes()

    class NoDirectories(http.server.SimpleHTTPRequestHandler):  # as S3 website hosting or GitHub Pages: 404
        def send_head(self) -> Any:
            if self.path.endswith("/"):
                self.send_error(404)
                return None
            return super().send_head()

        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(NoDirectories, directory=str(tmp_path / "www"))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            ok("mount", "add", "/p404", f"http://127.0.0.1:{server.server_address[1]}/packed", "--opt", "format=gpufeed-pack")
            assert gpufeed.read("/p404/train/cats/1.jpg") == (dataset / "train" / "cats" / "1.jpg").read_bytes()
        finally:
            server.shutdown()


def test_a_file_changed_since_its_listing_stops_the_pack_in_one_line(tmp_path: Path, dataset: Path) -> None:
    Namespace().add_mount("/data", f"file://{dataset}")
    (dataset / "train" / "dogs" / "1.jpg").write_bytes(b"longer than it was listed" * 100)
    line = fails(1, "pack", "/data", f"file://{tmp_path}/p")
    assert "/data/train/dogs/1.jpg: changed at the source since mount /data was listed" in line, line
    assert line.endswith("run 'gpufeed mount refresh /data'"), line
    assert not (tmp_path / "p" / INDEX_KEY).exists(), "no index: nothing claims the pack is whole"


def test_two_packs_into_one_destination_at_once_fail_the_one_whose_shards_went(
    tmp_path: Path, dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second pack that starts while the first writes its shards deletes them as stale; the
    first then must not say "packed" over an index naming shards that are gone."""
    Namespace().add_mount("/data", f"file://{dataset}")
    client = Client()
    url = f"file://{tmp_path}/p"
    real_run = packer.shards_run
    second: list[packer.Packed] = []
    calls = []

    def shards_then_another_pack(*args: Any, **kwargs: Any) -> list[bytes]:
        written = real_run(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:  # the first pack's shards are written, its index not yet: the second runs whole
            cats = packer.prepare(client, "/data/train/cats", packer.destination(url, {}, client), shard_size=4096)
            second.append(packer.pack(client, cats, workers=1))
        return written

    monkeypatch.setattr(packer, "shards_run", shards_then_another_pack)
    first = packer.prepare(client, "/data/train", packer.destination(url, {}, client), shard_size=4096)
    with pytest.raises(PackError, match=r"the pack changed while it was written: \d+ of the shards its index names are gone"):
        packer.pack(client, first, workers=1)
    assert second and second[0].removed > 0, "the second pack removed the first's shards as stale"
    monkeypatch.setattr(packer, "shards_run", real_run)
    ok("pack", "/data/train", url, "--shard-size", "4KiB")
    Namespace().add_mount("/packed", url)
    assert gpufeed.read("/packed/dogs/2.jpg", 0, 2002) == bytes([102]) * 2002


def test_a_reused_shard_buffer_keeps_nothing_of_the_shard_before(tmp_path: Path, dataset: Path) -> None:
    Namespace().add_mount("/data", f"file://{dataset}")
    dogs = ["/data/train/dogs/0.jpg", "/data/train/dogs/1.jpg"]  # 2,000 and 2,001 bytes of 100 and 101
    out = f"file://{tmp_path}/out"
    (tmp_path / "out").mkdir()
    buffers = ShardBuffers()
    write_shard(ShardTask("s1", 8192, dogs, [2000, 2001], [0, 4096], out, {}), None, buffers)
    write_shard(ShardTask("s2", 6000, dogs[1:], [2001], [2048], out, {}), None, buffers)  # where s1's bytes were
    assert (tmp_path / "out" / "s2").read_bytes() == bytes(2048) + bytes([101]) * 2001 + bytes(6000 - 4049)


def test_members_are_a_member_table_and_the_manifest_pins_the_index(bucket: Bucket, tmp_path: Path, dataset: Path) -> None:
    ns = Namespace()
    ns.add_mount("/data", f"file://{dataset}")
    ok("pack", "/data", f"file://{tmp_path}/p")
    ns.add_mount("/p", f"file://{tmp_path}/p")
    mount = ns.mount("/p")
    assert mount.options["format"] == "gpufeed-pack"
    assert ns.engine.lookup(mount.generation, "train/cats", "1.jpg") is None, "members are not manifest rows"
    index_row = ns.engine.lookup(mount.generation, *object_entry(INDEX_KEY))
    assert index_row is not None and index_row.content_hash is not None
    saved = Settings.from_env().home / "packs" / index_row.content_hash.removeprefix("sha256:")
    assert (saved / "meta.json").exists(), "the table is saved for this node's other processes"
    table = MemberTable.load(saved)
    assert table is not None
    row = table.lookup("train/cats", "1.jpg")
    assert isinstance(row, Entry) and row.pack_key is not None and row.pack_length == 1001
    assert Namespace().members(mount) is not None, "another process opens the saved table"
    assert gpufeed.read("/p/train/cats/1.jpg") == bytes([1]) * 1001
    assert gpufeed.read("/p/empty.bin") == b""
    assert gpufeed.stat("/p/README").size == 7
    ns.add_mount("/as-files", f"file://{tmp_path}/p", {"format": "files"})
    assert [f.path for f in ns.ls("/as-files")] == [f"/as-files/{DIR}"], "a raw view shows the pack itself"


def _packed_members(bucket: Bucket, *, without_chunk_sums: bool = False) -> dict[str, bytes]:
    """200 members of 50 KB packed in 8 MiB shards and mounted at /p, by a process that used
    obstore; `without_chunk_sums`: the index rewritten as version 1, which lists none."""
    rng = random.Random(5)
    raw = {f"f/{n:03d}.bin": rng.randbytes(50_000) for n in range(200)}
    for key, data in raw.items():
        bucket.put(f"raw/{key}", data)
    ns = Namespace()
    ns.add_mount("/raw", f"{bucket.url}/raw", {"endpoint": bucket.endpoint})
    ok("pack", "/raw", f"{bucket.url}/p", "--shard-size", "8MiB", *opts(bucket))
    if without_chunk_sums:
        key = f"p/{INDEX_KEY}"
        index = idx.decode(bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read(), key)  # type: ignore[attr-defined]
        bucket.put(key, idx.encode(msgspec.structs.replace(index, version=1, chunk_sums=b"")))
    ns.add_mount("/p", f"{bucket.url}/p", {"endpoint": bucket.endpoint})
    return raw


@pytest.mark.parametrize("chunk_sums", [False, True], ids=["version-1-index", "chunk-sums"])
def test_forked_worker_reads_a_sparse_batch_of_members_around_their_blocks(bucket: Bucket, chunk_sums: bool) -> None:
    """A DataLoader worker forked from a process that used obstore reads random members of
    different shard blocks (a sparse batch) without waiting for those blocks: the agent reads
    the members' ranges for it, only their bytes, and caches the blocks for later reads. Where
    the index lists chunk sums, a range is read as the whole chunks it lies in, to be checked:
    the first batch's chunks do not fit the budget (`READ_AROUND_SHARE`), so it waits for its
    blocks."""
    raw = _packed_members(bucket, without_chunk_sums=not chunk_sums)
    keys = ["f/000.bin", "f/090.bin", "f/180.bin"]  # one in each 4 MiB block
    hashes, source_bytes, direct_bytes = in_forked_child([f"/p/{k}" for k in keys])
    assert hashes == [sha(raw[k]) for k in keys]
    if chunk_sums:
        assert source_bytes > 8 << 20 and direct_bytes == 0, "two 4 MiB blocks and a shard's tail, fetched by the agent"
    else:
        assert (source_bytes, direct_bytes) == (3 * 50_000, 0), "the members' bytes, read by the agent, not whole blocks"
    client = gpufeed.client()
    eventually(lambda: all(n == 50_000 for k in keys for _, n in client.cached_bytes(f"/p/{k}")), "the hinted blocks cached")
    assert [sha(bytes(v)) for v in client.read_files([f"/p/{k}" for k in keys])] == [sha(raw[k]) for k in keys]
    assert client.source_bytes == 0, "the hinted blocks are cached: hits"


def test_forked_worker_reading_around_a_deleted_shard_names_the_member(bucket: Bucket) -> None:
    _packed_members(bucket)
    for key in shard_keys(bucket, "p"):
        bucket.delete(key)
    got = in_forked_child(["/p/f/000.bin", "/p/f/090.bin"])
    assert isinstance(got, str) and re.match(r"ObjectMissing: /p/f/(000|090)\.bin: deleted at the source", got), got


def test_repack_after_a_change_and_refresh_the_packed_mount(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A changed file: the rerun rewrites only the shard holding it and removes the one it
    replaces; a node that has not refreshed is told to, and a refresh of the packed mount serves
    the new bytes."""
    (tmp_path / "src").mkdir()
    for n in range(20):
        (tmp_path / "src" / f"{n:02d}.bin").write_bytes(bytes([n]) * 3000)
    ns = Namespace()
    ns.add_mount("/src", f"file://{tmp_path / 'src'}")
    dest = f"{bucket.url}/p"
    ok("pack", "/src", dest, "--shard-size", "8KiB", *opts(bucket))
    ns.add_mount("/p", dest, {"endpoint": bucket.endpoint})
    assert gpufeed.read("/p/05.bin") == bytes([5]) * 3000
    (tmp_path / "src" / "05.bin").write_bytes(b"new" * 1000)
    ns.refresh("/src")
    before = shard_keys(bucket, "p")
    out = ok("pack", "/src", dest, "--shard-size", "8KiB", "--json", *opts(bucket))
    assert '"written": 1' in out and '"kept": 9' in out and '"removed": 1' in out, out
    after = shard_keys(bucket, "p")
    assert len(after) == len(before) == 20 and len(after - before) == 2, (before, after)  # one shard and its digests
    monkeypatch.setenv("GPUFEED_CACHE_DIRS", str(tmp_path / "other-node"))  # a node with nothing cached yet
    try:
        with pytest.raises(ObjectMissing, match="deleted at the source .*run 'gpufeed mount refresh /p'"):
            Client().read("/p/04.bin")  # its shard was the one replaced
    finally:
        stop_agent(Settings.from_env())
    monkeypatch.delenv("GPUFEED_CACHE_DIRS")
    _, stats = ns.refresh("/p")
    assert (stats.files, stats.added, stats.changed, stats.removed) == (20, 0, 1, 0)
    assert Client().read("/p/05.bin") == b"new" * 1000
    assert Client().read("/p/06.bin") == bytes([6]) * 3000


def test_shards_written_in_worker_processes_match_a_pack_in_this_process(
    bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpufeed.pack import packer, shards

    files_in(bucket, "raw", 120, seed=6)
    client = gpufeed.client()
    client.namespace.add_mount("/raw", f"{bucket.url}/raw", {"endpoint": bucket.endpoint})

    children: list[int] = []

    def pack(dest: Path) -> list[tuple[int, int]]:
        heard: list[tuple[int, int]] = []

        def progress(files: int, size: int) -> None:
            heard.append((files, size))
            children.append(len(multiprocessing.active_children()))

        job = packer.prepare(client, "/raw", packer.destination(f"file://{dest}", {}, client), shard_size=256 << 10)
        done = packer.pack(client, job, workers=3, progress=progress)
        assert done.written == done.shards > 3
        return heard

    alone = pack(tmp_path / "threads")
    assert max(children) == 0, "120 files are packed on threads"
    monkeypatch.setattr(shards, "PROCESSES_FROM_FILES", 0)
    started = multiprocessing.active_children()
    heard = pack(tmp_path / "processes")
    assert max(children) == 3, "three worker processes wrote the shards"
    assert (tmp_path / "processes" / INDEX_KEY).read_bytes() == (tmp_path / "threads" / INDEX_KEY).read_bytes()
    assert heard[-1] == alone[-1] and heard[-1][0] == 120, "every file's progress reached the caller"
    assert len(heard) > 3, "progress came shard by shard, not once at the end"
    assert multiprocessing.active_children() == started, "the worker processes are gone"


def test_requests_carry_the_sums_of_their_blocks_and_direct_reads_share_chunks(tmp_path: Path) -> None:
    """A request names a shard by its sums' id and carries the listed sums of the blocks it
    wants only (128 bytes a 4 MiB block), never the whole shard's; reads straight from the store
    (cache off) of members in a row share reads of whole chunks instead of each reading its own."""
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = random.Random(9)
    files = {f"f{n:03d}.bin": rng.randbytes(100_000) for n in range(120)}
    for name, data in files.items():
        (raw / name).write_bytes(data)
    Namespace().add_mount("/raw", f"file://{raw}")
    ok("pack", "/raw", f"file://{tmp_path}/p")
    ok("mount", "add", "/p", f"file://{tmp_path}/p")
    ok("mount", "add", "/off", f"file://{tmp_path}/p", "--opt", "cache=off")
    client = Client()
    handle = client.handle("/p/f050.bin")
    assert handle.info.sums_id is not None and handle.chunk_sums is not None
    assert len(handle.chunk_sums) == 8 * -(-handle.info.size // (256 << 10)), "the whole shard's sums stay in the reader"
    (group,), _ = client.fetches._groups([(handle, [0, 1], [])])
    assert len(group.objects[0].sums) == 2 * 8 * 16, "the sums of blocks 0 and 1 only (of 3)"
    assert [sha(bytes(v)) for v in client.read_files([f"/p/{k}" for k in files])] == [sha(v) for v in files.values()]
    names = [f"/off/{k}" for k in sorted(files)[10:50]]
    assert [sha(bytes(v)) for v in client.read_files(names)] == [sha(files[n.rsplit("/", 1)[1]]) for n in names]
    assert client.direct_bytes < 1.2 * 40 * 100_000, "forty members in a row read as shared chunks"


def test_a_killed_pack_takes_its_worker_processes_with_it(tmp_path: Path, dataset: Path) -> None:
    """Killed (SIGTERM from a scheduler or `timeout`, kill -9), a pack that wrote its shards in
    worker processes left them waiting for tasks for ever, holding its caller's output open: a
    CI step reading it hung."""
    Namespace().add_mount("/data", f"file://{dataset}")
    out = tmp_path / "out"
    out.mkdir()
    code = textwrap.dedent(
        f"""
        import sys
        from gpufeed.pack import shards
        tasks = [shards.ShardTask(f"s{{n}}", 4096, ["/data/README"], [7], [0], "file://{out}", {{}}) for n in range(20000)]
        shards._in_processes(tasks, 2, lambda files, size: print("wrote", flush=True))
        """
    )
    marker = f"GPUFEED_TEST_PACK_{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env={**os.environ, marker: "1"})
    assert child.stdout is not None and child.stdout.readline() == "wrote\n", "the workers wrote a shard"
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)  # the output ends: nothing holds it any more
    eventually(lambda: not _with_environment(f"{marker}=1"), "the worker processes to exit", seconds=30)


def _with_environment(entry: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if entry.encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found
