"""SQLite metadata engine: the embedded default, one file under GPUFEED_HOME.

WAL mode lets training processes read while `mount refresh` writes. Entries are keyed by
(generation, parent, name) in a WITHOUT ROWID table, so a stat is one B-tree probe and an
`ls` is one range scan. A connection never crosses a fork (DataLoader workers): each process
opens its own.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from gpufeed.errors import MetadataError, MountConflict
from gpufeed.meta.base import Entry, Mount, engine_errors

SCHEMA = """
CREATE TABLE IF NOT EXISTS mounts (
    path TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS entries (
    generation INTEGER NOT NULL,
    parent TEXT NOT NULL,
    name TEXT NOT NULL,
    is_dir INTEGER NOT NULL,
    size INTEGER NOT NULL,
    mtime REAL NOT NULL,
    etag TEXT,
    PRIMARY KEY (generation, parent, name)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""

_COLUMNS = "parent, name, is_dir, size, mtime, etag"


_entry = Entry._make  # rows come back in Entry's field order; is_dir is 0/1, which compares as bool


@engine_errors(sqlite3.OperationalError, sqlite3.DatabaseError)
class SqliteEngine:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = f"sqlite://{path}"
        self._local = threading.local()
        self._connect()

    def _connect(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise MetadataError(f"metadata database {self.path}: {exc}") from exc
        self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    @property
    def _db(self) -> sqlite3.Connection:
        if getattr(self._local, "pid", None) != os.getpid():
            return self._connect()
        return self._local.conn

    def mounts(self) -> list[Mount]:
        return [Mount.from_json(r[0]) for r in self._db.execute("SELECT record FROM mounts ORDER BY path")]

    def commit_mount(self, mount: Mount, *, previous: int | None) -> None:
        if previous is None:
            try:
                self._db.execute("INSERT INTO mounts (path, record) VALUES (?, ?)", (mount.path, mount.to_json()))
            except sqlite3.IntegrityError:
                raise MountConflict(f"{mount.path} is already mounted") from None
            return
        cursor = self._db.execute(
            "UPDATE mounts SET record = ? WHERE path = ? AND json_extract(record, '$.generation') = ?",
            (mount.to_json(), mount.path, previous),
        )
        if cursor.rowcount != 1:
            raise MountConflict(f"{mount.path} was removed or refreshed by another process meanwhile")

    def delete_mount(self, path: str) -> None:
        self._db.execute("DELETE FROM mounts WHERE path = ?", (path,))

    def new_generation(self) -> int:
        row = self._db.execute(
            "INSERT INTO counters (name, value) VALUES ('generation', 1) "
            "ON CONFLICT (name) DO UPDATE SET value = value + 1 RETURNING value"
        ).fetchone()
        return int(row[0])

    def put_entries(self, generation: int, entries: Iterable[Entry]) -> None:
        db = self._db
        db.execute("BEGIN")
        try:
            db.executemany(
                f"INSERT OR REPLACE INTO entries (generation, {_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                ((generation, *e) for e in entries),
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def drop_generation(self, generation: int) -> None:
        self._db.execute("DELETE FROM entries WHERE generation = ?", (generation,))

    def lookup(self, generation: int, parent: str, name: str) -> Entry | None:
        row = self._db.execute(
            f"SELECT {_COLUMNS} FROM entries WHERE generation = ? AND parent = ? AND name = ?",
            (generation, parent, name),
        ).fetchone()
        return _entry(row) if row else None

    def listdir(self, generation: int, parent: str) -> list[Entry]:
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM entries WHERE generation = ? AND parent = ? ORDER BY name",
            (generation, parent),
        ).fetchall()
        return list(map(_entry, rows))

    def walk(self, generation: int, prefix: str) -> Iterator[Entry]:
        if prefix:
            # '0' is the character after '/', so [prefix/, prefix0) is everything below prefix.
            cursor = self._db.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE generation = ? AND is_dir = 0 "
                "AND (parent = ? OR (parent >= ? AND parent < ?)) ORDER BY parent, name",
                (generation, prefix, prefix + "/", prefix + "0"),
            )
        else:
            cursor = self._db.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE generation = ? AND is_dir = 0 ORDER BY parent, name",
                (generation,),
            )
        for row in cursor:
            yield _entry(row)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local.pid = None
