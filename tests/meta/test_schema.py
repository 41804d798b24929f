"""Schema v2: new fields round-trip, stable entry ids, databases of the schema before versions
were recorded are migrated on open, and a newer schema is refused."""

from __future__ import annotations

import json
import sqlite3
import uuid
from pathlib import Path

import pytest
import redis

from gpufeed.config import Settings
from gpufeed.errors import MetadataError
from gpufeed.meta.base import SCHEMA_VERSION, Entry
from gpufeed.meta.redis import RedisEngine
from gpufeed.meta.sqlite import SqliteEngine
from gpufeed.namespace import Namespace
from gpufeed.sources.base import ObjectInfo

# The DDL of schema 1, copied as it was before schema versions existed: do not edit.
SCHEMA_1 = """
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

MOUNT_1 = {
    "path": "/data", "url": "file:///srv/ds", "options": {}, "immutable": False,
    "max_age": None, "generation": 3, "listed_at": 1700000000.5,
}


def schema_1_sqlite(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(SCHEMA_1)
    conn.execute("INSERT INTO mounts VALUES (?, ?)", ("/data", json.dumps(MOUNT_1, sort_keys=True)))
    conn.execute("INSERT INTO counters VALUES ('generation', 3)")
    conn.executemany(
        "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(3, "", "train", 1, 0, 0.0, None), (3, "train", "a.jpg", 0, 10, 1000.5, '"e1"'), (3, "", "README", 0, 7, 99.0, None)],
    )
    conn.close()


def test_sqlite_schema_1_is_migrated_on_open(tmp_path: Path) -> None:
    path = tmp_path / "meta.db"
    schema_1_sqlite(path)
    ns = Namespace(Settings.from_env(), SqliteEngine(path))
    [mount] = ns.mounts()
    assert (mount.path, mount.url, mount.generation) == ("/data", "file:///srv/ds", 3)
    assert [s.path for s in ns.ls("/data")] == ["/data/README", "/data/train"]
    st = ns.stat("/data/train/a.jpg")
    assert (st.size, st.mtime, st.etag, st.content_hash) == (10, 1000.5, '"e1"', None)
    assert ns.record_hashes("/data", 3, [ObjectInfo("train/a.jpg", 10, 1000.5, '"e1"', "sha256:" + "ab" * 32)]) == 1
    assert ns.record_hashes("/data", 3, [ObjectInfo("README", 8, 99.0, None, "sha256:" + "ab" * 32)]) == 0, "not that version"
    assert ns.stat("/data/train/a.jpg").content_hash == "sha256:" + "ab" * 32
    assert ns.engine.new_generation() == 4, "the counter survives the migration"
    ns.close()
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    columns = [row[1] for row in conn.execute("PRAGMA table_info(entries)")]
    assert columns[-4:] == ["content_hash", "pack_key", "pack_offset", "pack_length"]


def test_sqlite_newer_schema_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "meta.db"
    SqliteEngine(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(MetadataError, match=f"schema version {SCHEMA_VERSION + 1} is newer .* upgrade gpufeed"):
        SqliteEngine(path)
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1


def test_redis_schema_1_is_read_and_versioned(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    r.hset(f"{prefix}:mounts", "/data", json.dumps(MOUNT_1, sort_keys=True))
    r.set(f"{prefix}:generation", 3)
    r.sadd(f"{prefix}:g:3:dirs", "", "train")
    r.hset(f"{prefix}:g:3:d:", mapping={"train": "d", "README": "f|7|99.0|"})
    r.hset(f"{prefix}:g:3:d:train", mapping={"a.jpg": 'f|10|1000.5|"e|1"'})
    ns = Namespace(Settings.from_env(), RedisEngine(f"{redis_url}?prefix={prefix}"))
    assert r.get(f"{prefix}:schema") == str(SCHEMA_VERSION)
    [mount] = ns.mounts()
    assert mount.generation == 3
    assert [s.path for s in ns.ls("/data")] == ["/data/README", "/data/train"]
    st = ns.stat("/data/train/a.jpg")
    assert (st.size, st.mtime, st.etag, st.content_hash) == (10, 1000.5, '"e|1"', None)
    assert ns.stat("/data/README").etag is None
    assert ns.record_hashes("/data", 3, [ObjectInfo("train/a.jpg", 10, 1000.5, '"e|1"', "md5:" + "cd" * 16)]) == 1
    assert ns.stat("/data/train/a.jpg").content_hash == "md5:" + "cd" * 16
    assert [e.key for e in ns.engine.walk(3, "")] == ["README", "train/a.jpg"]
    ns.close()


def test_redis_newer_schema_is_refused(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    redis.Redis.from_url(redis_url).set(f"{prefix}:schema", SCHEMA_VERSION + 1)
    with pytest.raises(MetadataError, match=f"prefix {prefix}.*newer than this gpufeed knows.*upgrade gpufeed"):
        RedisEngine(f"{redis_url}?prefix={prefix}")


def test_new_fields_round_trip(namespace: Namespace) -> None:
    gen = namespace.engine.new_generation()
    info = ObjectInfo("p/q.bin", 5, 12.25, "e|t", "sha256:" + "0" * 64, "packs/p0|1.tar", 4096, 5)
    namespace.engine.put_entries(gen, [Entry("", "p", True), Entry.of(info), Entry("p", "bare", False, 1, 0.0)])
    assert namespace.engine.lookup(gen, "p", "q.bin").object_info() == info  # type: ignore[union-attr]
    assert namespace.engine.lookup(gen, "p", "bare") == Entry("p", "bare", False, 1, 0.0)
    assert {e.key: e.object_info() for e in namespace.engine.walk(gen, "p")}["p/q.bin"] == info


def test_entry_id_is_stable_across_refresh(namespace: Namespace, dataset: Path) -> None:
    mount, _ = namespace.add_mount("/data", f"file://{dataset}")
    before = {e.key: e.entry_id for e in namespace.engine.walk(mount.generation, "")}
    (dataset / "train" / "cats" / "0.jpg").write_bytes(b"changed")
    refreshed, _ = namespace.refresh("/data")
    after = {e.key: e.entry_id for e in namespace.engine.walk(refreshed.generation, "")}
    assert refreshed.generation != mount.generation
    assert after == before and len(set(after.values())) == len(after)
