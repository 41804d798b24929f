"""The metadata database holds mounts' options, credentials among them (`--opt secret_access_key=`):
its owner alone reads it."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

from gpufeed.config import Settings
from gpufeed.meta.sqlite import SqliteEngine
from gpufeed.namespace import Namespace


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_database_and_its_wal_are_private_under_a_permissive_umask(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "f").write_bytes(b"x")
    path = tmp_path / "home" / "meta.db"
    old = os.umask(0o022)
    try:
        engine = SqliteEngine(path)
        Namespace(Settings.from_env(), engine).add_mount("/d", f"file://{tmp_path / 'data'}")
    finally:
        os.umask(old)
    wal = path.with_name("meta.db-wal")
    assert wal.exists()
    assert (mode(path), mode(wal)) == (0o600, 0o600)
    engine.close()


def test_a_world_readable_database_of_an_earlier_release_is_narrowed_on_open(tmp_path: Path) -> None:
    path = tmp_path / "meta.db"
    sqlite3.connect(path).close()
    path.chmod(0o644)
    SqliteEngine(path).close()
    assert mode(path) == 0o600
