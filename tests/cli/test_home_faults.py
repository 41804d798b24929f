"""A full or read-only GPUFEED_HOME on a real filesystem (a small tmpfs): reading commands keep
working, writing commands fail with one line naming the path (and the free space), and what was
stored is intact afterwards."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufeed.client.connection import stop_agent
from gpufeed.config import Settings
from tests.cli.test_cli import fails, ok
from tests.meta.test_schema import schema_1_sqlite


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """GPUFEED_HOME on its own 2 MiB tmpfs (mounting needs root, as this suite runs)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "home"
    where.mkdir()
    _mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where))
    monkeypatch.setenv("GPUFEED_HOME", str(where))
    try:
        yield where
    finally:
        _mount("-o", "remount,rw", str(where))
        stop_agent(Settings.from_env())
        if subprocess.run(["umount", str(where)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(where)], check=True)  # a process that was exiting held it


def read_only(home: Path) -> None:
    """Remount the home read-only; the agent a read started keeps files open for writing, so it goes first."""
    stop_agent(Settings.from_env())
    for _ in range(100):  # an exiting process may hold a file open for writing a moment longer
        if subprocess.run(["mount", "-o", "remount,ro", str(home)], capture_output=True, check=False).returncode == 0:
            return
        time.sleep(0.1)
    _mount("-o", "remount,ro", str(home))


def fill(directory: Path) -> Path:
    """Write until the filesystem is full; returns the file to delete to free it."""
    filler = directory / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    assert shutil.disk_usage(directory).free == 0
    return filler


def api_read(path: str) -> bytes:
    result = subprocess.run(
        [sys.executable, "-c", f"import gpufeed, sys; sys.stdout.buffer.write(gpufeed.read({path!r}))"],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def reading_works(dataset: Path) -> None:
    assert ok("ls", "/data/train").split() == ["cats/", "dogs/"]
    assert "size:     1001" in ok("stat", "/data/train/cats/1.jpg")
    assert [m["path"] for m in json.loads(ok("mount", "ls", "--json"))] == ["/data"]
    assert ok("cat", "/data/README") == "readme\n"
    assert api_read("/data/train/dogs/2.jpg") == (dataset / "train/dogs/2.jpg").read_bytes()


def writing_fails(dataset: Path, why: str) -> None:
    for args in (
        ("mount", "add", "/other", f"file://{dataset}"),
        ("mount", "refresh", "/data"),
        ("mount", "rm", "/data"),
        ("verify", "/data"),
    ):
        line = fails(1, *args)
        assert "cannot write the metadata database" in line and "meta.db: " + why in line, (args, line)


def test_full_home(home: Path, dataset: Path) -> None:
    ok("mount", "add", "/data", f"file://{dataset}")
    filler = fill(home)
    reading_works(dataset)
    writing_fails(dataset, "no space left on device (")
    assert f"bytes free in {home})" in fails(1, "mount", "add", "/other", f"file://{dataset}")
    filler.unlink()
    assert [m["path"] for m in json.loads(ok("mount", "ls", "--json"))] == ["/data"], "earlier state intact"
    ok("mount", "add", "/other", f"file://{dataset}")
    assert ok("cat", "/other/README") == "readme\n"


def test_read_only_home(home: Path, dataset: Path) -> None:
    ok("mount", "add", "/data", f"file://{dataset}")
    ok("verify", "/data/train/cats")
    read_only(home)
    reading_works(dataset)
    writing_fails(dataset, "read-only file system")
    assert not (home / "meta.db-shm").exists(), "nothing was written"
    _mount("-o", "remount,rw", str(home))
    assert [m["path"] for m in json.loads(ok("mount", "ls", "--json"))] == ["/data"], "earlier state intact"
    assert "3 hashes recorded, 3 matched" in ok("verify", "/data/train")


def test_read_only_home_without_a_database(home: Path, dataset: Path) -> None:
    read_only(home)
    assert "no mounts" in ok("mount", "ls")
    line = fails(1, "mount", "add", "/data", f"file://{dataset}")
    assert f"cannot write the metadata database {home}/meta.db: read-only file system" in line


def test_unmerged_write_ahead_log_on_a_read_only_home_is_refused(home: Path, dataset: Path, tmp_path: Path) -> None:
    """A writer that died left changes in meta.db-wal; a read-only directory cannot merge them,
    and reading the database without them would show stale mounts: refuse in one line."""
    ok("mount", "add", "/data", f"file://{dataset}")
    elsewhere = tmp_path / "copy"
    elsewhere.mkdir()
    shutil.copy(home / "meta.db", elsewhere / "meta.db")
    conn = sqlite3.connect(elsewhere / "meta.db", isolation_level=None)
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("DELETE FROM mounts")
    shutil.copy(elsewhere / "meta.db-wal", home / "meta.db-wal")  # as a crash leaves it
    conn.close()
    read_only(home)
    line = fails(1, "mount", "ls")
    assert f"{home}/meta.db" in line and "write-ahead log" in line
    _mount("-o", "remount,rw", str(home))
    assert "no mounts" in ok("mount", "ls"), "a writable directory merges the log: the mount was deleted"


def test_schema_1_database_on_a_read_only_home_is_read_unmigrated(home: Path) -> None:
    schema_1_sqlite(home / "meta.db")
    read_only(home)
    assert [m["path"] for m in json.loads(ok("mount", "ls", "--json"))] == ["/data"]
    assert ok("ls", "/data").split() == ["README", "train/"]
    assert "size:     10" in ok("stat", "/data/train/a.jpg")
    _mount("-o", "remount,rw", str(home))
    assert sqlite3.connect(home / "meta.db").execute("PRAGMA user_version").fetchone()[0] == 0, "not migrated, not written"
