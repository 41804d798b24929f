"""SQLite metadata engine: the embedded default, one file under GPUFEED_HOME.

WAL mode lets training processes read while `mount refresh` writes. Entries are keyed by
(generation, parent, name) in a WITHOUT ROWID table, so a stat is one B-tree probe and an
`ls` is one range scan. A connection never crosses a fork (DataLoader workers): each process
opens its own.

A full or read-only GPUFEED_HOME: opening writes nothing unless the database must be created or
migrated, so reading commands keep working. A WAL database needs its -shm file to be read; where
the directory cannot hold one it is opened immutable, which is right only when no -wal file
holds unmerged pages (else one clear error: never a stale read). A missing database that cannot
be created reads as an empty one. Writes then fail in one line naming the file and why.

Forks: a thread inside SQLite holds its mutexes; a child forked then (a DataLoader worker while
the prefetch thread opens its connection) inherits them locked and hangs in its first
`sqlite3.connect`. So every call into SQLite holds one process-wide lock, and `os.fork` takes it
first (`os.register_at_fork`): a fork waits for the call in progress, never splits it.
"""

from __future__ import annotations

import functools
import inspect
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar
from urllib.parse import quote

from gpufeed.errors import MetadataError, MountConflict
from gpufeed.meta.base import SCHEMA_VERSION, Entry, Mount, engine_errors, newer_schema

CREATE = f"""
CREATE TABLE mounts (
    path TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE entries (
    generation INTEGER NOT NULL,
    parent TEXT NOT NULL,
    name TEXT NOT NULL,
    is_dir INTEGER NOT NULL,
    size INTEGER NOT NULL,
    mtime REAL NOT NULL,
    etag TEXT,
    content_hash TEXT,
    pack_key TEXT,
    pack_offset INTEGER,
    pack_length INTEGER,
    PRIMARY KEY (generation, parent, name)
) WITHOUT ROWID;
CREATE TABLE counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
PRAGMA user_version = {SCHEMA_VERSION};
"""

MIGRATIONS = {
    1: """
ALTER TABLE entries ADD COLUMN content_hash TEXT;
ALTER TABLE entries ADD COLUMN pack_key TEXT;
ALTER TABLE entries ADD COLUMN pack_offset INTEGER;
ALTER TABLE entries ADD COLUMN pack_length INTEGER;
PRAGMA user_version = 2;
""",
}
"""Version n -> n+1, each run in one transaction (version 0, no tables, runs CREATE). Version 1
is the layout before versions were recorded (user_version 0 with tables)."""

_COLUMNS = {
    1: "parent, name, is_dir, size, mtime, etag, NULL, NULL, NULL, NULL",
    2: "parent, name, is_dir, size, mtime, etag, content_hash, pack_key, pack_offset, pack_length",
}
"""What a row select reads per schema version: a v1 database that cannot be migrated (read-only)
is still read, its new fields null."""

# Python's sqlite3 binds only exact int/float/str/bytes without looking for an adapter; for None
# and bool that search is two failed attribute lookups per value, which doubled the time to
# write a row with four nullable columns. A registered adapter is one dict probe. Both return
# what sqlite3 binds anyway (NULL; 0/1).
sqlite3.register_adapter(type(None), lambda _: None)
sqlite3.register_adapter(bool, int)

_IN_SQLITE = threading.RLock()
"""Held by every call into SQLite in this process, and by `os.fork` while it forks."""
os.register_at_fork(before=_IN_SQLITE.acquire, after_in_parent=_IN_SQLITE.release, after_in_child=_IN_SQLITE.release)
WALK_BATCH = 1024
LOOKUP_BATCH = 500
"""Names bound in one `lookup_many` query (SQLite allows 32,766 variables; a smaller batch keeps a statement cheap to prepare)."""


def _fork_safe(cls: type[T]) -> type[T]:
    """Class decorator: each public method (and `_db`, which may connect) runs under `_IN_SQLITE`."""

    def guarded(method: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(method)
        def call(*args: object, **kwargs: object) -> R:
            with _IN_SQLITE:
                return method(*args, **kwargs)

        return call

    for name, member in list(vars(cls).items()):
        if inspect.isfunction(member) and not name.startswith("_") and not inspect.isgeneratorfunction(member):
            setattr(cls, name, guarded(member))
    return cls


_entry = Entry._make  # rows come back in Entry's field order; is_dir is 0/1, which compares as bool

_CANNOT_WRITE = ("readonly", "read-only", "disk", "full", "unable to open", "locking protocol")
FULL_MARGIN = 1 << 20
"""Less free space than this on the database's filesystem counts as a full disk."""

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def _writes(method: Callable[Concatenate[SqliteEngine, P], R]) -> Callable[Concatenate[SqliteEngine, P], R]:
    """A write on a database that cannot be written fails with one line naming the path and
    why (read-only, or full and how much is free), not SQLite's "disk I/O error"."""

    @functools.wraps(method)
    def call(self: SqliteEngine, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.read_only is not None:
            raise self.cannot_write(self.read_only)
        try:
            return method(self, *args, **kwargs)
        except sqlite3.OperationalError as exc:
            if any(word in str(exc).lower() for word in _CANNOT_WRITE):
                raise self.cannot_write(str(exc)) from exc
            raise

    return call


def _private(path: Path) -> None:
    """The database holds mounts' options, credentials among them: readable by its owner only
    (SQLite gives its WAL and shared-memory files the database's mode). A database made
    world-readable by an earlier release is narrowed when its owner opens it."""
    try:  # created here, never opened here: closing a descriptor of a database this process has open
        # elsewhere would drop that connection's POSIX locks (SQLite's own warning)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError:
        return  # a read-only home: opened (or refused) as before
    for file in (path, path.with_name(f"{path.name}-wal"), path.with_name(f"{path.name}-shm")):
        try:
            info = file.stat()
            if info.st_uid == os.getuid() and info.st_mode & 0o077:
                file.chmod(0o600)
        except OSError:
            pass


@engine_errors(sqlite3.OperationalError, sqlite3.DatabaseError)
@_fork_safe
class SqliteEngine:
    """Opening never writes unless the database must be created or migrated, so reading
    commands work on a read-only or full GPUFEED_HOME. Where SQLite cannot open it for reading
    (a WAL database needs its -shm file, which a read-only or full directory cannot hold),
    it is opened immutable, which is safe only when no WAL holds unmerged pages."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = f"sqlite://{path}"
        self.read_only: str | None = None
        """Why this engine cannot write (None when it can): writes fail at once with it."""
        self.version = SCHEMA_VERSION
        self._local = threading.local()
        self._connect()

    def cannot_write(self, why: str) -> MetadataError:
        where = self.path.parent
        try:
            fs = os.statvfs(where)
        except OSError:
            fs = None
        if fs is not None and fs.f_flag & os.ST_RDONLY:
            why = "read-only file system"
        elif fs is not None and (fs.f_bavail * fs.f_frsize < FULL_MARGIN or "full" in why):
            why = f"no space left on device ({fs.f_bavail * fs.f_frsize} bytes free in {where})"
        elif where.exists() and not os.access(where, os.W_OK):
            why = f"permission denied on {where}"
        return MetadataError(f"cannot write the metadata database {self.path}: {why}")

    def check_writable(self) -> None:
        if self.read_only is not None:
            raise self.cannot_write(self.read_only)

    def _connect(self) -> sqlite3.Connection:
        with _IN_SQLITE:
            conn = self._open()
        self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def _open(self) -> sqlite3.Connection:
        try:
            created = not self.path.exists()
            if created:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            _private(self.path)
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
            if created:
                conn.execute("PRAGMA journal_mode=WAL")
            version = self._version(conn)
        except (sqlite3.Error, OSError) as exc:
            if not self.path.exists() or self.path.stat().st_size == 0:
                return self._empty(str(exc))
            conn, version = self._open_immutable(exc)
        if version > SCHEMA_VERSION:
            conn.close()
            raise newer_schema(f"metadata database {self.path}", version)
        if version < SCHEMA_VERSION and self.read_only is None:
            version = self._migrate(conn, version)
        if version == 0:  # a database that was never created and cannot be now
            conn.close()
            return self._empty(self.read_only or "empty database")
        self.version = version
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    @staticmethod
    def _version(conn: sqlite3.Connection) -> int:
        """0: no tables yet; 1: the layout before versions were recorded; else user_version."""
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version == 0:
            tables = conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'entries'").fetchone()
            return 1 if tables[0] else 0
        return version

    def _empty(self, why: str) -> sqlite3.Connection:
        """Where GPUFEED_HOME cannot hold a database: an empty one in memory that refuses
        writes, so reading commands see no mounts and writing ones say why they cannot."""
        self.read_only = why
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        conn.executescript(CREATE)
        return conn

    def _open_immutable(self, cause: sqlite3.Error | OSError) -> tuple[sqlite3.Connection, int]:
        wal = self.path.with_name(self.path.name + "-wal")
        if wal.exists() and wal.stat().st_size > 0:
            raise MetadataError(
                f"metadata database {self.path}: cannot be read ({cause}) and its write-ahead log {wal} holds changes "
                "that only a writable directory can merge"
            ) from cause
        try:
            conn = sqlite3.connect(
                f"file:{quote(str(self.path))}?mode=ro&immutable=1", uri=True, isolation_level=None, check_same_thread=False
            )
            version = self._version(conn)
        except sqlite3.Error as exc:
            raise MetadataError(f"metadata database {self.path}: {exc}") from exc
        self.read_only = str(cause)
        return conn, version

    def _migrate(self, conn: sqlite3.Connection, version: int) -> int:
        """Bring an older database to SCHEMA_VERSION, one transaction per step. A database that
        cannot be written stays as it is and is read at its version."""
        try:
            while version < SCHEMA_VERSION:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    if self._version(conn) != version:  # another process migrated it meanwhile
                        conn.execute("COMMIT")
                        version = self._version(conn)
                        continue
                    script, after = (CREATE, SCHEMA_VERSION) if version == 0 else (MIGRATIONS[version], version + 1)
                    for statement in script.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
                version = after
        except sqlite3.OperationalError as exc:
            self.read_only = str(exc)
        return version

    @property
    def _columns(self) -> str:
        return _COLUMNS[self.version]

    @property
    def _db(self) -> sqlite3.Connection:
        if getattr(self._local, "pid", None) != os.getpid():
            return self._connect()
        return self._local.conn

    def mounts(self) -> list[Mount]:
        return [Mount.from_json(r[0]) for r in self._db.execute("SELECT record FROM mounts ORDER BY path")]

    @_writes
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

    @_writes
    def delete_mount(self, path: str) -> None:
        self._db.execute("DELETE FROM mounts WHERE path = ?", (path,))

    @_writes
    def new_generation(self) -> int:
        row = self._db.execute(
            "INSERT INTO counters (name, value) VALUES ('generation', 1) "
            "ON CONFLICT (name) DO UPDATE SET value = value + 1 RETURNING value"
        ).fetchone()
        return int(row[0])

    @_writes
    def put_entries(self, generation: int, entries: Iterable[Entry]) -> None:
        db = self._db
        db.execute("BEGIN")
        try:
            db.executemany(  # the generation as a literal: rows bind as they are, no tuple per row
                f"INSERT OR REPLACE INTO entries (generation, {_COLUMNS[2]}) VALUES ({int(generation)}, {', '.join('?' * 10)})",
                entries,
            )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    @_writes
    def delete_entry(self, generation: int, parent: str, name: str) -> None:
        self._db.execute("DELETE FROM entries WHERE generation = ? AND parent = ? AND name = ?", (generation, parent, name))

    @_writes
    def drop_generation(self, generation: int) -> None:
        self._db.execute("DELETE FROM entries WHERE generation = ?", (generation,))

    def lookup(self, generation: int, parent: str, name: str) -> Entry | None:
        row = self._db.execute(
            f"SELECT {self._columns} FROM entries WHERE generation = ? AND parent = ? AND name = ?",
            (generation, parent, name),
        ).fetchone()
        return _entry(row) if row else None

    def lookup_many(self, generation: int, parent: str, names: Sequence[str]) -> dict[str, Entry]:
        found: dict[str, Entry] = {}
        for start in range(0, len(names), LOOKUP_BATCH):
            chunk = names[start : start + LOOKUP_BATCH]
            marks = ", ".join("?" * len(chunk))
            rows = self._db.execute(
                f"SELECT {self._columns} FROM entries WHERE generation = ? AND parent = ? AND name IN ({marks})",
                (generation, parent, *chunk),
            ).fetchall()
            found.update((entry.name, entry) for entry in map(_entry, rows))
        return found

    def listdir(self, generation: int, parent: str) -> list[Entry]:
        rows = self._db.execute(
            f"SELECT {self._columns} FROM entries WHERE generation = ? AND parent = ? ORDER BY name",
            (generation, parent),
        ).fetchall()
        return list(map(_entry, rows))

    def walk(self, generation: int, prefix: str) -> Iterator[Entry]:
        """Rows fetched in batches under the fork lock, yielded outside it: a slow consumer
        never holds up a fork."""
        with _IN_SQLITE:
            cursor = self._walk(generation, prefix)
        while True:
            with _IN_SQLITE:
                rows = cursor.fetchmany(WALK_BATCH)
            if not rows:
                return
            yield from map(_entry, rows)

    def _walk(self, generation: int, prefix: str) -> sqlite3.Cursor:
        if prefix:
            # '0' is the character after '/', so [prefix/, prefix0) is everything below prefix.
            cursor = self._db.execute(
                f"SELECT {self._columns} FROM entries WHERE generation = ? AND is_dir = 0 "
                "AND (parent = ? OR (parent >= ? AND parent < ?)) ORDER BY parent, name",
                (generation, prefix, prefix + "/", prefix + "0"),
            )
        else:
            cursor = self._db.execute(
                f"SELECT {self._columns} FROM entries WHERE generation = ? AND is_dir = 0 ORDER BY parent, name",
                (generation,),
            )
        return cursor

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local.pid = None
