"""Hash every file under a namespace path once, through the read path, and record or compare.

A file whose manifest entry has no content hash gets the sha256 of what the store holds
recorded in the mount's current manifest generation: its bytes are read from the store
(`Client.read_uncached`), never from the cache, where a byte flipped in transit before any hash
was known may sit and would otherwise be recorded as the truth. A file that has a hash is read
through the cache, with that hash's algorithm, and compared: what a training job reads. Since
its cached blocks never ask the store, the store is asked first whether it still holds each
such file's object at the listed version (one listing per mount, or a HEAD per object for a
few), so a file changed or deleted at the source since listing is reported even when cached.
Small files are read in batches, large ones in chunks of one pinned version, so memory stays
bounded.
"""

from __future__ import annotations

import hashlib
import logging
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from gpufeed.errors import ObjectChanged, ObjectCorrupted, ObjectMissing, PathNotFound, SourceError
from gpufeed.mount_options import is_writable
from gpufeed.paths import normalize, since_listed
from gpufeed.sources.base import ObjectInfo, Source, same_version

if TYPE_CHECKING:
    from gpufeed.client import Client
    from gpufeed.paths import FileStat

log = logging.getLogger(__name__)
BATCH_BYTES = 64 << 20
BATCH_FILES = 256
CHUNK = 16 << 20
HEAD_AT_MOST = 256
"""Up to this many objects of a mount are checked at the source by a HEAD each; more by one listing."""
HEAD_CONCURRENCY = 16
RECORD_EVERY = 1000
"""Hashes are written to the manifest this many at a time, so a stopped verify keeps most."""
FILE_FAILURES = (ObjectCorrupted, ObjectChanged, ObjectMissing)
"""What fails one file's read (damaged bytes; changed or deleted at the source since listed):
reported among the mismatches, and the other files still checked."""


@dataclass(frozen=True)
class Mismatch:
    path: str
    recorded: str
    computed: str | None
    detail: str = ""

    @property
    def unread(self) -> bool:
        """A file with no hash recorded that could not be read: nothing to compare, not a mismatch."""
        return self.computed is None and self.recorded == "-"

    def __str__(self) -> str:
        if self.unread:
            return f"{self.path}: {self.detail}"
        if self.computed is None:
            return f"{self.path}: recorded {self.recorded}; {self.detail}"
        return f"{self.path}: recorded {self.recorded}, the store holds {self.computed}"


@dataclass
class Verified:
    files: int = 0
    bytes: int = 0
    recorded: int = 0
    matched: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)


def _algorithm(item: FileStat) -> str:
    return item.content_hash.partition(":")[0] if item.content_hash else "sha256"


@dataclass(frozen=True)
class Listed:
    """Files to verify and the manifest generation of each mount they were listed from: the
    generations are read before the walk, so a refresh in between shows as a conflict when
    hashes are recorded, never as hashes written into a generation the files did not come from."""

    files: list[FileStat]
    generations: dict[str, int]


def listed(client: Client, path: str) -> Listed:
    mounts = client.namespace.mounts(fresh=True)
    root = normalize(path).rstrip("/")
    under = [m for m in mounts if m.path.startswith(f"{root}/") or f"{root}/".startswith(f"{m.path}/")]
    client.namespace.tables.check_hashes(under)
    generations = {m.path: m.generation for m in mounts}
    return Listed(list(client.walk(path)), generations)


class _Recorder:
    """New hashes per (mount path, generation), written every RECORD_EVERY."""

    def __init__(self, client: Client, generations: dict[str, int]) -> None:
        self.client = client
        self.generations = generations
        self.pending: dict[tuple[str, int], list[ObjectInfo]] = defaultdict(list)
        self.count = 0
        self.recorded = 0

    def add(self, item: FileStat, info: ObjectInfo, content_hash: str) -> None:
        """`info`: the version that was hashed (a first open may have pinned one the listing lacked)."""
        where = self.client.namespace.resolve(item.path)
        assert where is not None
        generation = self.generations.get(where.mount.path, -1)
        self.pending[(where.mount.path, generation)].append(replace(info, content_hash=content_hash))
        self.count += 1
        if self.count >= RECORD_EVERY:
            self.flush()

    def flush(self) -> None:
        for (mount_path, generation), infos in self.pending.items():
            self.recorded += self.client.namespace.record_hashes(mount_path, generation, infos)
        self.pending.clear()
        self.count = 0


def gone_from_source(client: Client, files: list[FileStat]) -> dict[str, str]:
    """Path -> why, for each hashed file whose object (a pack member's: its shard) the store no
    longer holds at the version the mount listed. A write still uploading (listed with its hash
    and no store version yet) is not asked about; a store that cannot be asked leaves its files
    to the cache-only check, with one warning."""
    wanted: dict[str, dict[str, tuple[ObjectInfo, list[str]]]] = defaultdict(dict)
    for item in files:
        if item.content_hash is None or item.info is None:
            continue  # read from the store, pinned to the listed version: a change fails that read
        where = client.namespace.resolve(item.path)
        assert where is not None
        if item.info.etag is None and item.info.pack_key is None and is_writable(where.mount):
            continue  # written here: the agent holds its bytes until the upload lands
        keys = wanted[where.mount.path]
        key = item.info.pack_key or item.info.key
        if key not in keys:
            keys[key] = (client.namespace.container(where, item.info) if item.info.pack_key else item.info, [])
        keys[key][1].append(item.path)
    why: dict[str, str] = {}
    for mount_path, keys in wanted.items():
        source = client.namespace.source(client.namespace.mount(mount_path))
        try:
            now = _now_at(source, list(keys))
        except (SourceError, PathNotFound) as exc:
            log.warning("cannot ask %s whether files under %s changed (%s): checked against the cache only",
                        source.url, mount_path, exc)
            continue
        for key, (listed_info, paths) in keys.items():
            found = now.get(key)
            if found is None or not same_version(listed_info, found):
                what, detail = ("deleted", "no such object now") if found is None else ("changed", f"now version {found.version}")
                for path in paths:
                    why[path] = since_listed(f"{source.url}/{key}", what, mount_path, detail)
    return why


def _now_at(source: Source, keys: list[str]) -> dict[str, ObjectInfo]:
    """What the store holds now of `keys`: a HEAD each (HEAD_CONCURRENCY at a time) for a few,
    one listing of the source for many."""
    if len(keys) > HEAD_AT_MOST:
        wanted = set(keys)
        return {info.key: info for batch in source.list() for info in batch if info.key in wanted}

    def head(key: str) -> ObjectInfo | None:
        try:
            return source.head(key)
        except ObjectMissing:
            return None

    with ThreadPoolExecutor(HEAD_CONCURRENCY) as pool:
        return {key: info for key, info in zip(keys, pool.map(head, keys), strict=True) if info is not None}


def verify(client: Client, target: Listed, progress: Callable[[Verified], None] = lambda _: None) -> Verified:
    """Hash the listed files; record hashes where the manifest has none, compare where it has
    one, after asking the store which of those it no longer holds as listed (`gone_from_source`).
    (A list, not the walk itself: the walk is over before hashes are written beside it.)"""
    done = Verified()
    gone = gone_from_source(client, target.files)
    for item in target.files:
        if item.path in gone:
            done.mismatches.append(Mismatch(item.path, item.content_hash or "-", None, gone[item.path]))
            done.files += 1
    progress(done)
    recorder = _Recorder(client, target.generations)

    def check(item: FileStat, digest: str, hashed: ObjectInfo | None = None) -> None:
        computed = f"{_algorithm(item)}:{digest}"
        if item.content_hash is None:
            assert hashed is not None
            recorder.add(item, hashed, computed)
        elif item.content_hash == computed:
            done.matched += 1
        else:
            done.mismatches.append(Mismatch(item.path, item.content_hash, computed))
        done.files += 1
        done.bytes += item.size
        progress(done)

    def one(item: FileStat) -> None:
        hasher = hashlib.new(_algorithm(item))
        try:
            handle = client.handle(item.path)
            for start in range(0, handle.size, CHUNK):
                end = min(handle.size, start + CHUNK)
                if item.content_hash is None:
                    hasher.update(client.read_uncached([(handle, start, end)])[0])
                else:
                    hasher.update(client.read_range(handle, start, end))
        except FILE_FAILURES as exc:
            done.mismatches.append(Mismatch(item.path, item.content_hash or "-", None, f"the read failed: {exc}"))
            done.files += 1
            progress(done)
            return
        check(item, hasher.hexdigest(), handle.listed)

    def batch(items: list[FileStat]) -> None:
        try:
            handles = client.handle_many([item.path for item in items])
        except FILE_FAILURES:  # a version check found one changed: each alone names which
            for item in items:
                one(item)
            return
        hashed = [n for n, item in enumerate(items) if item.content_hash is not None]
        unhashed = [n for n, item in enumerate(items) if item.content_hash is None]
        views: dict[int, memoryview] = {}
        try:
            got = client.read_many([(handles[n], 0, handles[n].size) for n in hashed])
            views.update(zip(hashed, got, strict=True))
        except FILE_FAILURES:
            for n in hashed:  # find which one, read alone
                one(items[n])
        try:
            got = client.read_uncached([(handles[n], 0, handles[n].size) for n in unhashed])
            views.update(zip(unhashed, got, strict=True))
        except FILE_FAILURES:
            for n in unhashed:
                one(items[n])
        for n, view in views.items():
            check(items[n], hashlib.new(_algorithm(items[n]), view).hexdigest(), handles[n].listed)

    small: list[FileStat] = []
    small_bytes = 0
    for item in target.files:
        if item.path in gone:
            continue
        if item.size > CHUNK:
            one(item)
            continue
        small.append(item)
        small_bytes += item.size
        if small_bytes >= BATCH_BYTES or len(small) >= BATCH_FILES:
            batch(small)
            small, small_bytes = [], 0
    if small:
        batch(small)
    recorder.flush()
    done.recorded = recorder.recorded
    return done
