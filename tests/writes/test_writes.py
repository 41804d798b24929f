"""Writes through gpufeed to a real S3-compatible server (moto) and a local dir: staged on this
node, readable at once from the cache with no GET, uploaded whole in the background, recorded in
the manifest; resumed by the next agent after kill -9; refused on read-only mounts."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import gpufeed
import gpufeed.torch
from gpufeed.client.connection import AgentClient, stop_agent
from gpufeed.config import Settings
from gpufeed.errors import IsADirectory, NotADirectory, PathNotFound, ReadOnlyMount, WriteError
from gpufeed.namespace import Namespace
from tests.conftest import Bucket


def moto_requests(bucket: Bucket, log: Path, method: str, key: str, *, prefix: bool = False) -> int:
    """Requests moto logged for `key` of `bucket` (or for every key under `key` with `prefix`)
    with `method`, from its werkzeug log: one line per request, from every test of the session.
    werkzeug may style a line whose status is neither 200 nor 304 (a ranged GET's 206) with ANSI
    colour codes, depending on how the session started it: they are dropped first."""
    end = "[^ ]*" if prefix else "[ ?]"
    text = ANSI_STYLE.sub("", log.read_text())
    return len(re.findall(rf'"{method} /{re.escape(bucket.name)}/{re.escape(key)}{end}', text))


ANSI_STYLE = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def out(bucket: Bucket) -> Bucket:
    bucket.put("seed/readme.txt", b"seed")
    Namespace().add_mount("/out", bucket.url, {"endpoint": bucket.endpoint}, writable=True)
    return bucket


def test_a_closed_file_reads_back_at_once_and_reaches_the_store_whole(out: Bucket, server_dir: Path) -> None:
    body = os.urandom(9 << 20)  # three 4 MiB blocks and a bit: a multipart upload
    with gpufeed.open("/out/run1/model.bin", "wb") as f:
        for i in range(0, len(body), 1 << 20):
            f.write(body[i : i + (1 << 20)])
    assert gpufeed.stat("/out/run1/model.bin").size == len(body)
    assert [item.path for item in gpufeed.ls("/out/run1")] == ["/out/run1/model.bin"]
    assert gpufeed.read("/out/run1/model.bin") == body, "read back on this node while (or after) it uploads"
    assert gpufeed.sync("/out") in (0, 1)
    stored = out.client.get_object(Bucket=out.name, Key="run1/model.bin")["Body"].read()  # type: ignore[attr-defined]
    assert hashlib.sha256(stored).digest() == hashlib.sha256(body).digest()
    assert moto_requests(out, server_dir / "moto.log", "GET", "run1/model.bin") == 1, "only the check above"
    entry = gpufeed.stat("/out/run1/model.bin")
    assert entry.etag is not None and entry.content_hash == f"sha256:{hashlib.sha256(body).hexdigest()}"
    gpufeed._default = None
    assert gpufeed.read("/out/run1/model.bin") == body, "a fresh process reads it from the cache"
    assert moto_requests(out, server_dir / "moto.log", "GET", "run1/model.bin") == 1, "and never from the store"


def test_write_through_waits_for_the_store_and_overwrite_replaces(out: Bucket) -> None:
    gpufeed.write("/out/a.txt", b"first", sync=True)
    assert out.client.get_object(Bucket=out.name, Key="a.txt")["Body"].read() == b"first"  # type: ignore[attr-defined]
    with gpufeed.open("/out/a.txt", "wb", sync=True) as f:
        f.write(b"second version")
    assert gpufeed.read("/out/a.txt") == b"second version"
    assert out.client.get_object(Bucket=out.name, Key="a.txt")["Body"].read() == b"second version"  # type: ignore[attr-defined]
    gpufeed.remove("/out/a.txt")
    with pytest.raises(PathNotFound):
        gpufeed.stat("/out/a.txt")
    assert "Contents" not in out.client.list_objects_v2(Bucket=out.name, Prefix="a.txt")  # type: ignore[attr-defined]


def test_a_writer_that_raises_commits_nothing(out: Bucket) -> None:
    gpufeed.write("/out/kept.bin", b"old", sync=True)
    with pytest.raises(RuntimeError), gpufeed.open("/out/kept.bin", "wb") as f:
        f.write(b"half of the new")
        raise RuntimeError("the job died mid-write")
    assert gpufeed.read("/out/kept.bin") == b"old"
    staging = AgentClient(Settings.from_env()).dirs[0] / "staging"
    assert not [p for p in staging.iterdir() if p.name.startswith("tmp-")], "its staged bytes are gone"


def test_writes_are_refused_where_they_cannot_go(out: Bucket, tmp_path: Path) -> None:
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "x").write_bytes(b"x")
    Namespace().add_mount("/ro", f"file://{tmp_path / 'ro'}")
    with pytest.raises(ReadOnlyMount, match="/ro/x: mount /ro .* is read-only: mount it with --writable"):
        gpufeed.open("/ro/x", "wb")
    gpufeed.write("/out/dir/f", b"1")
    with pytest.raises(IsADirectory):
        gpufeed.open("/out/dir", "wb")
    with pytest.raises(IsADirectory, match="/out/new/: is a directory; a write names a file"):
        gpufeed.write("/out/new/", b"x")
    for below in ("/out/dir/f/x", "/out/dir/f/deeper/x"):
        with pytest.raises(NotADirectory, match=f"{below}: /out/dir/f is a file, not a directory"):
            gpufeed.write(below, b"x")
    assert gpufeed.read("/out/dir/f") == b"1", "the file stays readable"
    with pytest.raises(TypeError, match=r"write\(\) of /out/dir/f: data must be bytes-like, not str \(encode text"):
        gpufeed.write("/out/dir/f", "text")  # type: ignore[arg-type]
    assert gpufeed.read("/out/dir/f") == b"1", "the failed write committed nothing"
    gpufeed.write("/out/dir/g", b"2")  # beside it: fine
    with pytest.raises(ValueError, match="use 'rb' or 'wb'"):
        gpufeed.open("/out/dir/f", "ab")  # type: ignore[call-overload]
    gpufeed.sync()


def test_a_full_staging_disk_is_one_clear_error_and_keeps_what_was_stored(out: Bucket, tmp_path: Path) -> None:
    gpufeed.write("/out/big.bin", b"stored before", sync=True)
    staging = AgentClient(Settings.from_env()).dirs[0] / "staging"
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    try:
        moved = staging.with_name("staging.real")
        staging.rename(moved)
        staging.symlink_to(small)
        with pytest.raises(WriteError, match=r"/out/big.bin: the staging disk is full .*nothing was written"):
            with gpufeed.open("/out/big.bin", "wb") as f:
                f.write(os.urandom(2 << 20))
        # torch.save's zip writer reports a failed write as "unexpected pos": the write's own error instead
        with pytest.raises(WriteError, match=r"/out/big.bin: the staging disk is full .*nothing was written"):
            gpufeed.torch.save({"w": torch.ones(1 << 19)}, "/out/big.bin")
        with pytest.raises(WriteError, match=r"/out/run/step-00000001/__0_0.distcp: the staging disk is full"):
            gpufeed.torch.Checkpoints("/out/run").save({"w": torch.ones(1 << 19)}, 1)
        staging.unlink()
        moved.rename(staging)
    finally:
        subprocess.run(["umount", str(small)], check=False)
    assert gpufeed.read("/out/big.bin") == b"stored before"


def test_the_cli_mounts_writable_and_syncs(out: Bucket, tmp_path: Path) -> None:
    local = tmp_path / "outdir"
    local.mkdir()
    cli = [sys.executable, "-m", "gpufeed"]
    added = subprocess.run([*cli, "mount", "add", "/local", f"file://{local}", "--writable"],
                           capture_output=True, text=True, timeout=60)
    assert added.returncode == 0, added.stderr  # empty: where a job's output goes needs no --allow-empty
    code = "import gpufeed; gpufeed.write('/local/x/y.txt', b'hello')"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    synced = subprocess.run([*cli, "sync", "/local"], capture_output=True, text=True, timeout=60)
    assert synced.returncode == 0, synced.stderr
    assert (local / "x" / "y.txt").read_bytes() == b"hello"
    http = subprocess.run([*cli, "mount", "add", "/web", "http://127.0.0.1:1/x", "--writable"],
                          capture_output=True, text=True, timeout=60)
    assert http.returncode == 2 and "an HTTP source cannot be written" in http.stderr and "Traceback" not in http.stderr
    stop_agent(Settings.from_env())


def test_a_pipeline_stage_writes_parquet_and_the_next_reads_it_from_the_cache(out: Bucket, server_dir: Path) -> None:
    frame = pd.DataFrame({"label": range(5000), "path": [f"img/{i}.jpg" for i in range(5000)]})
    frame.to_parquet("gpufeed:///out/etl/index.parquet")  # the ETL stage, through fsspec
    gpufeed.sync("/out/etl")
    # os._exit after the answer: pyarrow's reader threads now and then abort the interpreter's
    # shutdown ("terminate called without an active exception", apache/arrow#34314), after the
    # read is done and right
    code = (
        "import os, pandas; frame = pandas.read_parquet('gpufeed:///out/etl/index.parquet'); "
        "print(len(frame), frame.label.sum(), flush=True); os._exit(0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)  # the training stage
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["5000", str(sum(range(5000)))]
    assert moto_requests(out, server_dir / "moto.log", "GET", "etl/index.parquet") == 0, "read from this node's cache"
    assert moto_requests(out, server_dir / "moto.log", "PUT", "etl/index.parquet") == 1, "uploaded once"


def test_another_node_reads_a_big_written_file_in_ranges_checked_against_its_hash(
    out: Bucket, server_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = os.urandom(40 << 20)  # a checkpoint-sized file: checked whole, read in 16 MiB ranges
    gpufeed.write("/out/ckpt/shard.bin", body, sync=True)
    monkeypatch.setenv("GPUFEED_CACHE_DIRS", str(tmp_path / "other-node"))  # another node: its own cache and agent
    gpufeed._default = None
    assert hashlib.sha256(gpufeed.read("/out/ckpt/shard.bin")).digest() == hashlib.sha256(body).digest()
    assert moto_requests(out, server_dir / "moto.log", "GET", "ckpt/shard.bin") == 3, "three ranges, all in flight"
    stop_agent(Settings.from_env())
