"""Redis metadata engine for clusters: every node sees the same mounts and manifests.

Layout (prefix `gf:` by default, `?prefix=` in the URL changes it):
  gf:mounts                hash  mount path -> mount record (JSON)
  gf:generation            counter
  gf:g:{gen}:dirs          set   every parent directory that has entries
  gf:g:{gen}:d:{parent}    hash  name -> encoded entry
  gf:schema                the schema version (gpufeed.meta.base)
A stat is one HGET, an `ls` one HGETALL. An entry is "d" for a directory, else the JSON array
[size, mtime, etag, content_hash, pack_key, pack_offset, pack_length] without trailing nulls.
Schema 1 encoded files as "f|size|mtime|etag"; such rows are still read (their new fields are
null), so migrating a schema-1 database only records the version: no row is rewritten.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from typing import cast
from urllib.parse import parse_qs, urlsplit, urlunsplit

import msgspec
import redis
from redis.typing import EncodableT, FieldT

from gpufeed.errors import MetadataError, MountConflict
from gpufeed.meta.base import SCHEMA_VERSION, Entry, Mount, engine_errors, newer_schema

PIPELINE_CHUNK = 500

_SWITCH_GENERATION = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if current and cjson.decode(current).generation == tonumber(ARGV[2]) then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
    return 1
end
return 0
"""


_json = msgspec.json.Encoder()
_fields = msgspec.json.Decoder(list)


def _encode(entry: Entry) -> str:
    if entry.is_dir:
        return "d"
    fields = list(entry[3:])
    while fields[-1] is None:
        fields.pop()
    return _json.encode(fields).decode()


def _decode(parent: str, name: str, raw: str) -> Entry:
    if raw == "d":
        return Entry(parent, name, True)
    if raw.startswith("f|"):  # schema 1
        _, size, mtime, etag = raw.split("|", 3)
        return Entry(parent, name, False, int(size), float(mtime), etag or None)
    return Entry(parent, name, False, *_fields.decode(raw))


@engine_errors(redis.RedisError)
class RedisEngine:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.prefix = parse_qs(parts.query).get("prefix", ["gf"])[0]
        self._connect_url = urlunsplit(parts._replace(query=""))
        shown = parts.hostname or ""
        if parts.port:
            shown += f":{parts.port}"
        self.url = urlunsplit(parts._replace(netloc=shown, query=""))  # what messages show: no password
        self._pid = -1
        self._client: redis.Redis | None = None
        self._check()

    @property
    def _r(self) -> redis.Redis:
        """With decode_responses every reply is str; redis-py types replies `bytes | str`, so
        reads that need str cast them."""
        if self._pid != os.getpid() or self._client is None:
            self._client = redis.Redis.from_url(
                self._connect_url, decode_responses=True, socket_connect_timeout=5, socket_timeout=30
            )
            self._pid = os.getpid()
        return self._client

    def _check(self) -> None:
        """Reach the server and settle the schema version: an empty prefix or a schema-1
        layout (no version key) is recorded as the current version; a newer one is refused."""
        key = f"{self.prefix}:schema"
        try:
            raw = self._r.get(key)
            if raw is None:
                self._r.setnx(key, SCHEMA_VERSION)
                raw = self._r.get(key)
        except redis.RedisError as exc:
            raise MetadataError(f"metadata server {self.url}: {exc}") from exc
        try:
            version = int(cast(str, raw))
        except (TypeError, ValueError):
            raise MetadataError(f"metadata server {self.url}: {key} is {raw!r}, not a schema version") from None
        if version > SCHEMA_VERSION:
            raise newer_schema(f"metadata server {self.url} (prefix {self.prefix})", version)

    def _dirs(self, generation: int) -> str:
        return f"{self.prefix}:g:{generation}:dirs"

    def _dir(self, generation: int, parent: str) -> str:
        return f"{self.prefix}:g:{generation}:d:{parent}"

    def check_writable(self) -> None:
        """Redis reports a refused write (read-only replica, maxmemory) on the write itself."""

    def mounts(self) -> list[Mount]:
        records = self._r.hgetall(f"{self.prefix}:mounts")
        return [Mount.from_json(records[path]) for path in sorted(records)]

    def commit_mount(self, mount: Mount, *, previous: int | None) -> None:
        key = f"{self.prefix}:mounts"
        if previous is None:
            if not self._r.hsetnx(key, mount.path, mount.to_json()):
                raise MountConflict(f"{mount.path} is already mounted")
            return
        if not self._r.eval(_SWITCH_GENERATION, 1, key, mount.path, previous, mount.to_json()):
            raise MountConflict(f"{mount.path} was removed or refreshed by another process meanwhile")

    def delete_mount(self, path: str) -> None:
        self._r.hdel(f"{self.prefix}:mounts", path)

    def new_generation(self) -> int:
        return int(self._r.incr(f"{self.prefix}:generation"))

    def put_entries(self, generation: int, entries: Iterable[Entry]) -> None:
        by_parent: dict[str, dict[FieldT, EncodableT]] = defaultdict(dict)
        for entry in entries:
            by_parent[entry.parent][entry.name] = _encode(entry)
        pipe = self._r.pipeline(transaction=False)
        pipe.sadd(self._dirs(generation), *by_parent)
        for parent, mapping in by_parent.items():
            pipe.hset(self._dir(generation, parent), mapping=mapping)
        pipe.execute()

    def delete_entry(self, generation: int, parent: str, name: str) -> None:
        self._r.hdel(self._dir(generation, parent), name)

    def drop_generation(self, generation: int) -> None:
        dirs = self._dirs(generation)
        batch: list[str] = []
        for parent in self._r.sscan_iter(dirs, count=1000):
            batch.append(self._dir(generation, parent))
            if len(batch) >= PIPELINE_CHUNK:
                self._r.unlink(*batch)
                batch = []
        if batch:
            self._r.unlink(*batch)
        self._r.unlink(dirs)

    def lookup(self, generation: int, parent: str, name: str) -> Entry | None:
        raw = cast("str | None", self._r.hget(self._dir(generation, parent), name))
        return _decode(parent, name, raw) if raw is not None else None

    def lookup_many(self, generation: int, parent: str, names: Sequence[str]) -> dict[str, Entry]:
        if not names:
            return {}
        raws = cast("list[str | None]", self._r.hmget(self._dir(generation, parent), list(names)))
        return {name: _decode(parent, name, raw) for name, raw in zip(names, raws, strict=True) if raw is not None}

    def listdir(self, generation: int, parent: str) -> list[Entry]:
        mapping = cast("dict[str, str]", self._r.hgetall(self._dir(generation, parent)))
        return [_decode(parent, name, mapping[name]) for name in sorted(mapping)]

    def walk(self, generation: int, prefix: str) -> Iterator[Entry]:
        below = prefix + "/"
        parents = sorted(
            p for p in self._r.sscan_iter(self._dirs(generation), count=1000)
            if not prefix or p == prefix or p.startswith(below)
        )
        for start in range(0, len(parents), PIPELINE_CHUNK):
            chunk = parents[start : start + PIPELINE_CHUNK]
            pipe = self._r.pipeline(transaction=False)
            for parent in chunk:
                pipe.hgetall(self._dir(generation, parent))
            for parent, mapping in zip(chunk, pipe.execute(), strict=True):
                for name in sorted(mapping):
                    entry = _decode(parent, name, mapping[name])
                    if not entry.is_dir:
                        yield entry

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
