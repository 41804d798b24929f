"""`gpufeed pack`: read a namespace directory through the read path, write shards and an index.

Why this shape: packing is one more reader (members come through `Client.read_once`, batched,
pinned and checked like any read; cached files from the cache, the rest from the store without
filling the cache with files that will be read through the pack from now on) and one more writer of a store (`Source.put`). It is
resumable because the plan is a pure function of the input (`pack.plan`): a shard's key names
its exact contents, a finished shard is published whole by one PUT followed by its sums
(`<shard>.sums`: its members' sha256, its chunks' xxh3), and a rerun keeps every shard whose
key and size match. The index is
written last, by one PUT, so a reader sees the previous pack or the complete new one. A rerun
over unchanged input finds an index with the same digest and does nothing.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from gpufeed.client import Client
from gpufeed.errors import InvalidArgument, ObjectMissing, PackError, PathNotFound
from gpufeed.pack import index as idx
from gpufeed.pack.layout import DIR, INDEX_KEY, SHARDS_DIR
from gpufeed.pack.plan import Item, Shard, pack_digest, plan
from gpufeed.pack.shards import SUMS_SUFFIX, ShardTask, sums_key, sums_size
from gpufeed.pack.shards import run as shards_run
from gpufeed.paths import FileStat, normalize
from gpufeed.sources import Source, open_source
from gpufeed.sources.base import ObjectInfo
from gpufeed.sources.stores import local_path

log = logging.getLogger("gpufeed")


@dataclass
class Packed:
    """What a pack run did. `up_to_date`: the destination already held this pack."""

    files: int
    bytes: int
    shards: int
    written: int
    kept: int
    up_to_date: bool
    index_key: str
    removed: int = 0
    """Shards of an earlier pack into the same destination that this index no longer names."""


def members(client: Client, nspath: str, order: Path | None) -> list[tuple[str, FileStat]]:
    """(path relative to `nspath`, file) for every file under it: the paths of `order` first,
    in its order, then the rest in directory order."""
    nspath = normalize(nspath)
    base = nspath.rstrip("/") + "/"
    try:
        files = {item.path[len(base) :]: item for item in client.walk(nspath) if item.path.startswith(base)}
    except PathNotFound as exc:
        raise PackError(f"{nspath}: nothing to pack ({exc})") from None
    if not files:
        raise PackError(f"{nspath}: no files to pack (is it a file, or an empty directory?)")
    if order is None:
        return list(files.items())
    try:
        lines = order.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"--order {order}: {exc}") from None
    def relative(name: str) -> str:
        return name[len(base) :] if name.startswith(base) else name.lstrip("/")

    chosen: dict[str, FileStat] = {}
    for number, line in enumerate(lines, 1):
        name = relative(line)  # as written: a name may start with '#' or end in a space
        if name not in files:
            if not line.strip() or line.lstrip().startswith("#"):
                continue  # a blank line, or a comment
            name = relative(line.strip())
        if name not in files:
            raise InvalidArgument(f"--order {order}:{number}: {name!r} is not a file under {nspath}")
        chosen[name] = files[name]
    return [*chosen.items(), *((path, item) for path, item in files.items() if path not in chosen)]


def destination(url: str, options: dict[str, str], client: Client) -> Source:
    """The store to write to; a local directory is created first."""
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        raise InvalidArgument(f"{url}: an HTTP server cannot be written; pack into a local dir, s3://, gs:// or az://")
    if parts.scheme == "file":
        try:
            local_path(parts.path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PackError(f"{url}: cannot create the destination ({exc.strerror})") from None
    return open_source(url, options, client.settings)


def _existing(dest: Source) -> dict[str, int]:
    """Objects already under the pack's directory at the destination: key -> size."""
    found: dict[str, int] = {}
    for batch in dest.list():
        found.update((info.key, info.size) for info in batch if info.key.startswith(DIR + "/"))
    return found


def _current_digest(dest: Source, existing: dict[str, int]) -> str | None:
    """The digest of the index at the destination, when there is a readable one."""
    size = existing.get(INDEX_KEY)
    if size is None:
        return None
    try:
        index = idx.decode(dest.get_range(INDEX_KEY, 0, size), dest.url)
    except (PackError, ObjectMissing):
        return None  # a corrupt or vanished index is simply written again
    return index.digest if index.version == idx.VERSION else None  # an older one is written again, with what it lacks


@dataclass
class Plan:
    """A pack to write: the files (path relative to the packed directory, file) in order, the
    shards they go into, and what the destination holds already."""

    nspath: str
    dest: Source
    files: list[tuple[str, FileStat]]
    items: list[Item]
    shards: list[Shard]
    digest: str
    block_size: int
    existing: dict[str, int]

    @property
    def bytes(self) -> int:
        return sum(item.size for item in self.items)

    def up_to_date(self) -> bool:
        """Whether the destination holds this pack already, index and every shard."""
        existing = self.existing
        return _current_digest(self.dest, existing) == self.digest and all(existing.get(s.key) == s.size for s in self.shards)


def _outside_sources(client: Client, nspath: str, dest: Source) -> None:
    """A pack written under the source it packs would be listed by the source's next refresh,
    and packed again by the next pack of `nspath`: refused. One written under another mount's
    source is said in a warning: that mount's next refresh lists the pack's files among its own."""
    path = normalize(nspath)
    where = _place(dest)
    for mount in client.namespace.mounts():
        source = client.namespace.source(mount)
        same_store = getattr(dest, "endpoint", None) == getattr(source, "endpoint", None)
        if not same_store or not f"{where}/".startswith(f"{_place(source)}/"):
            continue
        if mount.path.startswith(path.rstrip("/") + "/") or f"{path}/".startswith(f"{mount.path}/"):
            raise InvalidArgument(
                f"{dest.url}: inside the source of {mount.path} ({source.url}); a pack there would be packed again by the "
                f"next pack of {path}: write it elsewhere"
            )
        log.warning("%s: inside the source of mount %s (%s): its next refresh lists the pack's %s/ among its files",
                    dest.url, mount.path, source.url, DIR)


def _place(source: Source) -> str:
    """Where a source's objects lie, to compare two: a local directory with its links resolved."""
    root = getattr(source, "root", None)
    return f"file://{os.path.realpath(root)}" if isinstance(root, str) else source.url


def prepare(client: Client, nspath: str, dest: Source, *, shard_size: int, order: Path | None = None) -> Plan:
    """Walk `nspath` (from the manifest), lay out the shards, and list what `dest` holds."""
    if shard_size < 4096:
        raise InvalidArgument(f"--shard-size {shard_size}: must be at least 4KiB")
    _outside_sources(client, nspath, dest)
    files = members(client, nspath, order)
    items = [Item(path, item.size, item.version or "") for path, item in files]
    block_size = client.settings.block_size
    shards = plan(items, shard_size, block_size)
    return Plan(normalize(nspath), dest, files, items, shards, pack_digest(shards, block_size), block_size, _existing(dest))


def pack(
    client: Client,
    job: Plan,
    *,
    workers: int = 4,
    ray_address: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Packed:
    """Write the shards `job.dest` lacks (`workers` at a time, see `shards.run`, or as tasks of
    the Ray cluster at `ray_address`), then the index. `progress` hears the files and bytes done so
    far, shards kept from an earlier run included."""
    if workers < 1:
        raise InvalidArgument(f"--workers {workers}: must be at least 1")
    items, shards, dest, existing = job.items, job.shards, job.dest, job.existing
    if job.up_to_date():
        return Packed(len(items), job.bytes, len(shards), 0, len(shards), True, INDEX_KEY, _remove_stale(job, existing))
    done = [
        s for s in shards if existing.get(s.key) == s.size and existing.get(sums_key(s.key)) == sums_size(len(s.members), s.size)
    ]
    kept = {s.number for s in done}
    todo = [s for s in shards if s.number not in kept]
    counts = _Counts(progress)
    counts.add(sum(len(s.members) for s in done), sum(items[n].size for s in done for n, _ in s.members))
    sums = {s.number: dest.get_range(sums_key(s.key), 0, sums_size(len(s.members), s.size)).tobytes() for s in done}
    base = job.nspath.rstrip("/")
    tasks = [
        ShardTask(
            s.key, s.size, [f"{base}/{items[n].path}" for n, _ in s.members], [items[n].size for n, _ in s.members],
            [offset for _, offset in s.members], dest.url, dest.options,
        )
        for s in todo
    ]
    written = shards_run(tasks, workers=workers, progress=counts.add, ray_address=ray_address)
    sums.update(zip((s.number for s in todo), written, strict=True))
    rows = [
        (items[n].path, shard.number, offset, items[n].size, job.files[n][1].mtime, sums[shard.number][32 * k : 32 * k + 32])
        for shard in shards
        for k, (n, offset) in enumerate(shard.members)
    ]
    chunks = b"".join(sums[shard.number][32 * len(shard.members) :] for shard in shards)
    index = idx.build(job.digest, job.block_size, [(s.key, s.size) for s in shards], rows, chunks)
    present = _published(job, dest.put(INDEX_KEY, idx.encode(index)))
    return Packed(len(items), job.bytes, len(shards), len(todo), len(done), False, INDEX_KEY, _remove_stale(job, present))


def _published(job: Plan, index: ObjectInfo) -> dict[str, int]:
    """The destination once the index is in place, checked to hold that index (`index`, as the
    store reported it written) and every shard it names. Two packs into one destination at once
    break each other (each deletes what the other wrote as stale, the last index wins): the
    loser fails here in one line instead of saying "packed" over a pack missing shards."""
    present = _existing(job.dest)
    lost = [s.key for s in job.shards if present.get(s.key) != s.size]
    now = job.dest.head(INDEX_KEY)
    if lost or (now.size, now.etag, now.mtime) != (index.size, index.etag, index.mtime):
        what = f"{len(lost)} of the shards its index names are gone ({lost[0]}...)" if lost else "its index was replaced"
        raise PackError(
            f"{job.dest.url}: the pack changed while it was written: {what}; another 'gpufeed pack' into this "
            "destination at the same time? Run one at a time, then this one again"
        )
    return present


def _remove_stale(job: Plan, present: dict[str, int]) -> int:
    """Delete the shards (and their digests) at the destination that the published index does
    not name: an earlier pack's, or an interrupted run's over input that changed since. Only
    after the index is in place, so a crash leaves garbage, never a pack missing a shard; and
    only what was there before this run began (so not what a pack running beside it wrote
    since), counted if still there (`present`). A node that still has the old index mounted
    reads what it cached, and is told to refresh for the rest."""
    named = {key for shard in job.shards for key in (shard.key, sums_key(shard.key))}
    stale = sorted(
        key for key in job.existing if key.startswith(SHARDS_DIR + "/") and key not in named and key in present
    )
    job.dest.delete(stale)
    _remove_staged(job.dest)
    return sum(1 for key in stale if not key.endswith((SUMS_SUFFIX, ".sha256")))  # .sha256: version 1's sums


def _remove_staged(dest: Source) -> None:
    """A killed run's half-written shards in a local dir: the store writes KEY#N and renames it,
    and its listing shows neither, so `_remove_stale` cannot see them."""
    root = getattr(dest, "root", None)
    if isinstance(root, str):
        for staged in glob.glob(os.path.join(glob.escape(root), SHARDS_DIR, "*#*")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)


class _Counts:
    """Files and bytes done, summed across workers."""

    def __init__(self, progress: Callable[[int, int], None] | None) -> None:
        self.files = self.bytes = 0
        self._progress = progress
        self._lock = threading.Lock()

    def add(self, files: int, size: int) -> None:
        with self._lock:
            self.files += files
            self.bytes += size
            if self._progress is not None:
                self._progress(self.files, self.bytes)
