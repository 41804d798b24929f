"""Turn a source listing into a manifest generation, and count what changed between two.

Engine-independent: it only uses the `MetaEngine` primitives, so SQLite and Redis write and
diff manifests the same way. Memory stays bounded by the number of directories, not objects.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

from gpufeed.meta.base import Entry, MetaEngine, Mount
from gpufeed.mount_options import packed
from gpufeed.pack.layout import hidden
from gpufeed.sources.base import ObjectInfo, Source

log = logging.getLogger(__name__)
WRITE_BATCH = 10_000


@dataclass
class ManifestStats:
    """What a listing produced, and against the previous manifest what it added/changed/removed:
    the files a reader sees (not the hidden rows recording a packed mount's shards)."""

    files: int = 0
    bytes: int = 0
    skipped: int = 0
    added: int = 0
    changed: int = 0
    removed: int = 0
    unhashed: int | None = None
    """With a checksums file: listed files it has no hash for."""
    unlisted: int | None = None
    """With a checksums file: its paths that name no listed object."""
    kept_hashes: int = 0
    """On refresh: content hashes carried over from unchanged objects."""
    shadowed: int = 0
    """Keys that are also a directory (`a` beside `a/b`, which S3 allows): the directory is
    listed, as mountpoint-s3 and s3fs do, and the files are counted and named, not hidden
    without a word. Found in store listings, which are sorted; in an unsorted one (a `--list`
    file) a file listed before its directory with other keys between is missed, since keeping
    every key seen would cost memory by the object, not by the directory."""
    shadowed_key: str = ""
    """The first of them."""


def usable_key(key: str) -> bool:
    """Keys a namespace path can name; '..', '.' and empty components could never be reached."""
    wrapped = f"/{key}/"  # an empty, '.' or '..' component shows as '//', '/./' or '/../'
    return "//" not in wrapped and "/./" not in wrapped and "/../" not in wrapped and "\0" not in key


def entries_from_listing(
    batches: Iterable[list[ObjectInfo]], stats: ManifestStats, hashes: dict[str, str] | None = None, hide: bool = False
) -> Iterator[list[Entry]]:
    """File entries plus one entry per implied directory, in batches of about WRITE_BATCH.
    `hashes` (key -> content hash) is consumed: what is left names no listed object. With
    `hide` (a packed mount), the rows of its reserved pack directory are not counted."""
    seen_dirs: set[str] = set()
    prefixes: list[ObjectInfo] = []  # listed files that prefix the current key (listings are sorted)
    out: list[Entry] = []
    for batch in batches:
        for info in batch:
            if not usable_key(info.key):
                stats.skipped += 1
                continue
            if info.key in seen_dirs:  # its entry would replace the directory's
                _shadowed(stats, info, counted=False)
                continue
            while prefixes and not info.key.startswith(prefixes[-1].key):
                prefixes.pop()
            if prefixes and info.key.startswith(prefixes[-1].key + "/"):  # the directory's entry replaces it
                shadowed = prefixes.pop()
                _shadowed(stats, shadowed, counted=not (hide and hidden(shadowed.key.rpartition("/")[0])))
            prefixes.append(info)
            parent = info.key.rpartition("/")[0]
            directory = parent
            while directory and directory not in seen_dirs:
                seen_dirs.add(directory)
                grand, _, base = directory.rpartition("/")
                out.append(Entry(grand, base, True))
                directory = grand
            if hashes is not None:
                content_hash = hashes.pop(info.key, None)
                if content_hash is None:
                    stats.unhashed = (stats.unhashed or 0) + 1
                else:
                    info = replace(info, content_hash=content_hash)
            out.append(Entry.of(info))
            if not (hide and hidden(parent)):
                stats.files += 1
                stats.bytes += info.size
        if len(out) >= WRITE_BATCH:
            yield out
            out = []
    if out:
        yield out


def _shadowed(stats: ManifestStats, info: ObjectInfo, counted: bool) -> None:
    """`info` is a file and a directory: the directory's entry stands, the file is named unless
    empty: S3's folder markers (`dir/`, which the store client lists as `dir`) are no loss."""
    if info.size:
        stats.shadowed += 1
        stats.shadowed_key = stats.shadowed_key or info.key
    if counted:
        stats.files -= 1
        stats.bytes -= info.size


def count_changes(old: Iterator[Entry], new: Iterator[Entry], stats: ManifestStats, hide: bool = False) -> list[Entry]:
    """Merge-join two generations ordered by (parent, name). Returns the new entries that take
    over the content hash of their unchanged (same version) old entry: a hash vouches for one
    version, so a changed object loses it."""
    sentinel = Entry("\U0010ffff", "", False)
    keep: list[Entry] = []
    a, b = next(old, sentinel), next(new, sentinel)
    while a is not sentinel or b is not sentinel:
        ka, kb = (a.parent, a.name), (b.parent, b.name)
        if ka == kb:
            if not a.same_version(b):
                stats.changed += not (hide and hidden(b.parent))
            elif a.content_hash is not None and b.content_hash is None:
                keep.append(b._replace(content_hash=a.content_hash))
            a, b = next(old, sentinel), next(new, sentinel)
        elif a is not sentinel and (b is sentinel or ka < kb):
            stats.removed += not (hide and hidden(a.parent))
            a = next(old, sentinel)
        else:
            stats.added += not (hide and hidden(b.parent))
            b = next(new, sentinel)
    stats.kept_hashes = len(keep)
    return keep


def write_manifest(
    engine: MetaEngine,
    mount: Mount,
    source: Source,
    *,
    create: bool,
    hashes: dict[str, str] | None = None,
    check: Callable[[ManifestStats], None] | None = None,
    progress: Callable[[ManifestStats], None] | None = None,
    listing: Iterable[list[ObjectInfo]] | None = None,
) -> tuple[Mount, ManifestStats]:
    """List `source` into a new generation and switch `mount` to it; the old one is dropped after.
    `hashes` (key -> "sha256:<hex>"…) go into the entries they name; `check` may refuse the
    listing (raise) before anything is recorded; `progress` hears the counts after every batch
    written, so a listing of millions of objects shows progress. `listing` replaces the
    source's own (a packed source lists its members: `pack.mounting`)."""
    stats = ManifestStats()
    hide = packed(mount)
    generation = engine.new_generation()
    try:
        for entries in entries_from_listing(source.list() if listing is None else listing, stats, hashes, hide):
            engine.put_entries(generation, entries)
            if progress is not None:
                progress(stats)
        if stats.shadowed:
            log.warning("%s: %d file(s) not shown, a directory of the same name stands there (%s)",
                        source.url, stats.shadowed, stats.shadowed_key)
        if hashes is not None:
            stats.unlisted = len(hashes)
            stats.unhashed = stats.unhashed or 0
        if check is not None:
            check(stats)
        if create:
            stats.added = stats.files
        else:
            keep = count_changes(engine.walk(mount.generation, ""), engine.walk(generation, ""), stats, hide)
            for start in range(0, len(keep), WRITE_BATCH):
                engine.put_entries(generation, keep[start : start + WRITE_BATCH])
        listed = replace(mount, generation=generation, listed_at=time.time())
        engine.commit_mount(listed, previous=None if create else mount.generation)
    except BaseException:
        engine.drop_generation(generation)
        raise
    if not create:
        engine.drop_generation(mount.generation)
    return listed, stats
