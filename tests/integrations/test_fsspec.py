"""fsspec protocol `gpufeed://`: pandas and pyarrow read through the cache; writes to writable mounts."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import fsspec
import pandas as pd
import pyarrow.parquet as pq
import pytest

import gpufeed
from gpufeed.client.connection import AgentClient
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument, NamespacePathError, ObjectMissing, ReadOnlyMount
from gpufeed.namespace import Namespace
from tests.agent.test_metrics import agent_metrics

FETCHES = ("gpufeed_requests_total", (("kind", "fetch"),))


@pytest.fixture
def table(tmp_path: Path) -> pd.DataFrame:
    frame = pd.DataFrame({"label": range(1000), "path": [f"img/{i}.jpg" for i in range(1000)]})
    (tmp_path / "src" / "tables").mkdir(parents=True)
    frame.to_parquet(tmp_path / "src" / "tables" / "index.parquet")
    (tmp_path / "src" / "notes.txt").write_bytes(b"0123456789")
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    return frame


def test_pandas_and_pyarrow_read_through_the_cache(table: pd.DataFrame) -> None:
    assert pd.read_parquet("gpufeed:///data/tables/index.parquet").equals(table)
    fs = fsspec.filesystem("gpufeed")
    assert pq.read_table("/data/tables/index.parquet", filesystem=fs).to_pandas().equals(table)
    info = AgentClient(Settings.from_env()).stats()
    assert info.blocks == 1 and info.misses == 1, "one fetch; every later read a hit"


def test_listing_info_and_ranges(table: pd.DataFrame, tmp_path: Path) -> None:
    fs = fsspec.filesystem("gpufeed")
    assert fs.ls("gpufeed:///data", detail=False) == ["/data/notes.txt", "/data/tables"]
    assert fs.info("/data/notes.txt")["size"] == 10
    assert fs.info("/data/tables")["type"] == "directory"
    written = datetime.fromtimestamp((tmp_path / "src" / "notes.txt").stat().st_mtime, UTC)
    assert abs((fs.modified("/data/notes.txt") - written).total_seconds()) < 1e-3, "the file's own time, listed"
    assert fs.cat_file("gpufeed:///data/notes.txt", 2, 5) == b"234"
    assert fs.cat_file("/data/notes.txt", -3) == b"789"
    with fsspec.open("gpufeed:///data/notes.txt") as f:
        f.seek(4)
        assert f.read(2) == b"45"
    assert fs.find("/data") == ["/data/notes.txt", "/data/tables/index.parquet"]


def test_a_mount_not_writable_refuses_writes(table: pd.DataFrame) -> None:
    with pytest.raises(ReadOnlyMount, match="mount it with --writable"):
        fsspec.filesystem("gpufeed").open("/data/new.txt", "wb")
    with pytest.raises(InvalidArgument, match="mode 'ab' is not supported"):
        fsspec.filesystem("gpufeed").open("/data/new.txt", "ab")


def test_writes_pipe_copy_move_and_remove_on_a_writable_mount(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    Namespace().add_mount("/out", f"file://{out}", writable=True, allow_empty=True)
    fs = fsspec.filesystem("gpufeed")
    fs.pipe_file("gpufeed:///out/a/one.txt", b"one")
    with fs.open("/out/a/two.txt", "wb") as f:
        f.write(b"two")
    fs.copy("/out/a/one.txt", "/out/b/one-copy.txt")
    fs.mv("/out/a/two.txt", "/out/b/two.txt")
    fs.rm("/out/a/one.txt")
    assert fs.find("/out") == ["/out/b/one-copy.txt", "/out/b/two.txt"]
    assert fs.cat_file("/out/b/two.txt") == b"two"
    gpufeed.sync("/out")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == ["b/one-copy.txt", "b/two.txt"]


def test_directories_copy_move_and_remove_recursively(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    Namespace().add_mount("/out", f"file://{out}", writable=True, allow_empty=True)
    fs = fsspec.filesystem("gpufeed")
    for name in ("a.txt", "b.txt", "sub/c.txt", "sub/deeper/d.txt"):
        fs.pipe_file(f"/out/d1/{name}", name.encode())
    fs.cp("/out/d1", "/out/d2", recursive=True)
    assert fs.find("/out/d2") == ["/out/d2/a.txt", "/out/d2/b.txt", "/out/d2/sub/c.txt", "/out/d2/sub/deeper/d.txt"]
    assert fs.cat_file("/out/d2/sub/deeper/d.txt") == b"sub/deeper/d.txt"
    fs.mv("/out/d2", "/out/d3", recursive=True)
    assert not fs.exists("/out/d2") and len(fs.find("/out/d3")) == 4
    with pytest.raises(IsADirectoryError):
        fs.rm("/out/d1")  # not recursive: refused, nothing removed
    assert len(fs.find("/out/d1")) == 4
    fs.rm("/out/d1", recursive=True)
    fs.rm("/out/d3/sub", recursive=True)
    assert fs.find("/out") == ["/out/d3/a.txt", "/out/d3/b.txt"]
    gpufeed.sync("/out")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == ["d3/a.txt", "d3/b.txt"]


def test_cat_of_many_files_fetches_their_misses_in_one_request(tmp_path: Path) -> None:
    """fsspec's `cat` and `cat_ranges` read one file after another by default: a round trip to
    the store each. gpufeed's read them as one batch, so a cold set of files costs the agent one
    fetch request; a file that fails is that file's error, as fsspec's `on_error` asks."""
    root = tmp_path / "src"
    root.mkdir()
    files = {f"/data/{i:02d}.bin": bytes([i]) * (1000 + 37 * i) for i in range(40)}
    for path, body in files.items():
        (root / path.removeprefix("/data/")).write_bytes(body)
    (root / "gone.bin").write_bytes(b"listed, never read")
    Namespace().add_mount("/data", f"file://{root}")
    fs = fsspec.filesystem("gpufeed")
    gpufeed.client().agent.stats()  # started: its count of requests begins here
    before = agent_metrics().get(FETCHES, 0)
    assert fs.cat(sorted(files)) == files
    assert agent_metrics()[FETCHES] - before == 1, "the 40 misses in one request"
    assert fs.cat("/data/0*.bin") == {p: b for p, b in files.items() if p.startswith("/data/0")}
    got = fs.cat_ranges(["/data/01.bin", "/data/missing.bin", "gpufeed:///data/02.bin"], [0, 0, -10], [5, 5, None])
    assert got[0] == files["/data/01.bin"][:5] and got[2] == files["/data/02.bin"][-10:]
    assert isinstance(got[1], NamespacePathError)
    assert fs.cat(["/data/03.bin", "/data/missing.bin"], on_error="omit") == {"/data/03.bin": files["/data/03.bin"]}
    with pytest.raises(NamespacePathError):
        fs.cat(["/data/03.bin", "/data/missing.bin"])
    (root / "gone.bin").unlink()  # deleted at the source after it was listed: that file's error only
    got = fs.cat_ranges(["/data/gone.bin", "/data/05.bin"], None, None)
    assert isinstance(got[0], ObjectMissing) and got[1] == files["/data/05.bin"]
