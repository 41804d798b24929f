"""The namespace: mounts map absolute paths to sources; lookups answer from the manifest.

`ls` and `stat` never touch a source. Paths are normalised before they are resolved, so
`/data/../../etc/passwd` is `/etc/passwd`, which no mount contains: a path cannot escape
its mount.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from gpufeed.config import Settings, size_text
from gpufeed.errors import (
    InvalidArgument,
    IsADirectory,
    MetadataError,
    MountConflict,
    MountError,
    MountNotFound,
    NotADirectory,
    ObjectChanged,
    ObjectMissing,
    PackError,
    PathNotFound,
    ReadOnlyMount,
)
from gpufeed.meta import MetaEngine, Mount, open_engine
from gpufeed.meta.base import Entry
from gpufeed.meta.checksums import parse_checksums
from gpufeed.meta.manifest import ManifestStats, write_manifest
from gpufeed.mount_options import CACHE_OPTIONS, CachePolicy, is_writable, option_texts, packed, source_options
from gpufeed.pack.layout import DIR as PACK_DIR
from gpufeed.pack.layout import hidden, object_entry
from gpufeed.pack.tables import MemberTables
from gpufeed.paths import FileStat, Resolved, normalize, since_listed
from gpufeed.sources import Source, as_url, open_source
from gpufeed.sources.base import ObjectInfo, same_version

if TYPE_CHECKING:
    import numpy as np

    from gpufeed.pack.members import MemberTable


MOUNTS_TTL_S = 1.0


class Namespace:
    def __init__(self, settings: Settings | None = None, engine: MetaEngine | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.engine = engine or open_engine(self.settings)
        self._sources: dict[tuple[str, str], Source] = {}
        self.tables = MemberTables(self.settings.home, self.engine)
        self._mounts: list[Mount] | None = None
        self._mounts_read = 0.0

    def close(self) -> None:
        self.engine.close()

    # -- mounts ---------------------------------------------------------------------------

    def mounts(self, *, fresh: bool = False) -> list[Mount]:
        """The mount table. Lookups reuse it for up to MOUNTS_TTL_S, so a read costs one manifest
        probe instead of re-reading every mount; a mount whose generation went stale is caught
        by `_switched`, and changes made through this Namespace are seen at once."""
        now = time.monotonic()
        if fresh or self._mounts is None or now - self._mounts_read > MOUNTS_TTL_S:
            self._mounts, self._mounts_read = self.engine.mounts(), now
        return self._mounts

    def _forget_mounts(self) -> None:
        self._mounts = None

    def mount(self, path: str) -> Mount:
        path = normalize(path)
        for mount in self.mounts(fresh=True):
            if mount.path == path:
                return mount
        raise MountNotFound(f"{path}: no such mount (see 'gpufeed mount ls')")

    def add_mount(
        self,
        path: str,
        url: str,
        options: Mapping[str, object] | None = None,
        *,
        immutable: bool = False,
        max_age: float | None = None,
        checksums: str | None = None,
        allow_empty: bool = False,
        writable: bool = False,
        listed: Callable[[ManifestStats], None] | None = None,
    ) -> tuple[Mount, ManifestStats]:
        """Validate, list the source once into a manifest, then record the mount. A local path
        is taken as the file:// URL it means. `checksums` names a sha256sum/md5sum file whose
        hashes the entries carry. An empty listing is refused (most often a typo in the prefix)
        unless `allow_empty` or `writable` (where a job's output goes, empty at first); nothing
        is recorded. `listed` hears the counts so far while the
        listing runs."""
        path = normalize(path)
        url = as_url(url)
        if path == "/":
            raise InvalidArgument("cannot mount at /: choose a path such as /data")
        self.engine.check_writable()
        if immutable and max_age is not None:
            raise InvalidArgument("--immutable and --max-age exclude each other")
        if max_age is not None and not (math.isfinite(max_age) and max_age >= 0):
            raise InvalidArgument(f"--max-age {max_age}: must be a number of seconds >= 0")
        texts = {**option_texts(options or {}), **({"writable": "true"} if writable else {})}
        mount = Mount(path, url, texts, immutable=immutable, max_age=max_age)
        policy = CachePolicy.of(mount, self.settings)
        if "block_size" not in texts:  # the default of this process, for every reader of the mount
            mount = replace(mount, options={**texts, "block_size": size_text(policy.block_size)})
        if mount.options.get("writable", "false") not in ("true", "false"):
            raise InvalidArgument(f"{path}: option writable={mount.options['writable']!r}: expected true or false")
        if is_writable(mount) and url.startswith(("http://", "https://")):
            raise InvalidArgument(f"{url}: an HTTP source cannot be written (--writable needs file, s3, gs or az)")
        hashes = parse_checksums(checksums) if checksums is not None else None
        source = open_source(url, source_options(mount), self.settings)
        for other in self.mounts(fresh=True):  # after the URL's own checks, which name a typo in it
            if path == other.path:
                raise MountConflict(
                    f"{path} is already a mount ({other.url}); 'gpufeed mount refresh {path}' lists it again, "
                    f"'gpufeed mount rm {path}' removes it"
                )
            if path.startswith(other.path + "/") or other.path.startswith(path + "/"):
                raise MountConflict(f"cannot mount {url} at {path}: it overlaps the mount {other.path} ({other.url})")
        from gpufeed.pack import mounting

        fmt = mounting.detect(source, mount.options.get("format", "auto"))
        cache_options = {k: v for k, v in mount.options.items() if k in CACHE_OPTIONS and k != "format"}
        if fmt != "files":
            cache_options["format"] = fmt
        mount = replace(mount, options={**source.options, **cache_options})

        def refuse_empty(stats: ManifestStats) -> None:
            if stats.files == 0 and not allow_empty and not is_writable(mount):
                if fmt != "files":  # shards were found, or their reader would have said what is missing
                    raise MountError(f"{url}: its {fmt} shards hold no members (--allow-empty mounts it anyway)")
                from gpufeed.sources.stores import nearest_prefix

                # HTTP is not probed for a pack, and its listing hides the pack's dot dir
                if url.startswith(("http://", "https://")) and mounting.holds_pack(source):
                    raise MountError(f"{url}: no objects listed, but a gpufeed pack is there: mount it with "
                                     "--opt format=gpufeed-pack")
                near = nearest_prefix(url, source_options(mount), self.settings)
                hint = f"; did you mean {near}?" if near else ""
                raise MountError(f"{url}: no objects under this prefix{hint} (--allow-empty mounts it anyway)")

        self._forget_mounts()
        if fmt != "gpufeed-pack":
            return write_manifest(
                self.engine, mount, source, create=True, hashes=hashes, check=refuse_empty, progress=listed,
                listing=mounting.listing(source, fmt),
            )
        if hashes is not None:
            raise InvalidArgument(f"{url}: a gpufeed pack carries its members' sha256; --checksums is for plain files")
        rows, table = mounting.pack_rows(source)
        self.tables.save(table, rows[-1])
        mount, stats = write_manifest(self.engine, mount, source, create=True, listing=[rows])
        stats.files, stats.bytes, stats.skipped, stats.added = table.files, table.bytes, table.skipped, table.files
        if listed is not None:
            listed(stats)
        return mount, stats

    def refresh(
        self, path: str, listed: Callable[[ManifestStats], None] | None = None, *, allow_empty: bool = False
    ) -> tuple[Mount, ManifestStats]:
        """Re-list the mount's source into a new manifest. A listing that finds nothing where the
        manifest has files is refused unless `allow_empty`, as `add_mount` refuses one: a prefix
        emptied by mistake (or a store answering empty) must not empty the mount quietly."""
        mount = self.mount(path)
        self.engine.check_writable()
        self._forget_mounts()
        from gpufeed.pack import mounting

        source = self.source(mount)
        fmt = mount.options.get("format", "files")

        def refuse_empty(stats: ManifestStats) -> None:
            if stats.files == 0 and not allow_empty and next(self.engine.walk(mount.generation, ""), None) is not None:
                raise MountError(
                    f"{mount.url}: the listing finds no objects now; {mount.path} keeps its files (--allow-empty empties it)"
                )

        try:
            if fmt != "gpufeed-pack":
                return write_manifest(
                    self.engine, mount, source, create=False, check=refuse_empty, progress=listed,
                    listing=mounting.listing(source, fmt),
                )
            try:
                old = self.members(mount)
            except PackError:  # its index is gone or changed in the store: all is counted as added
                old = None
            before = self.tables.name(mount)
            rows, table = mounting.pack_rows(source)
            self.tables.save(table, rows[-1])
            mount, stats = write_manifest(self.engine, mount, source, create=False, listing=[rows])
            self.tables.drop(before, self.mounts(fresh=True))
            stats.files, stats.bytes, stats.skipped, stats.kept_hashes = table.files, table.bytes, table.skipped, 0
            stats.added, stats.changed, stats.removed = table.changes(old) if old is not None else (table.files, 0, 0)
            if listed is not None:
                listed(stats)
            return mount, stats
        finally:
            self._forget_mounts()  # a reader in another thread may have cached the old table meanwhile

    def remove_mount(self, path: str) -> Mount:
        mount = self.mount(path)
        self.engine.check_writable()
        table = self.tables.name(mount)
        self.engine.delete_mount(mount.path)
        self._forget_mounts()
        self.engine.drop_generation(mount.generation)
        self.tables.drop(table, self.mounts(fresh=True))
        return mount

    def record_hashes(self, mount_path: str, generation: int, infos: list[ObjectInfo]) -> int:
        """Record the content hashes `infos` carry in the entries of `generation` that have none
        and still have the info's version, while the mount still has that generation; returns
        how many were recorded. A refresh meanwhile fails with MountConflict and leaves nothing."""
        mount = self.mount(mount_path)
        if mount.generation != generation:
            raise MountConflict(f"{mount.path} was refreshed meanwhile; run verify again")
        rows = []
        for info in infos:
            parent, _, name = info.key.rpartition("/")
            entry = self.engine.lookup(generation, parent, name)
            if entry is None or entry.is_dir or entry.content_hash is not None:
                continue
            if entry.object_info().version == info.version:
                rows.append(entry._replace(content_hash=info.content_hash))
        self.engine.put_entries(generation, rows)
        if self.mount(mount_path).generation != generation:
            self.engine.drop_generation(generation)  # the refresh dropped it already, maybe before these rows
            raise MountConflict(f"{mount.path} was refreshed meanwhile; run verify again")
        return len(rows)

    def source(self, mount: Mount) -> Source:
        cache_key = (mount.url, repr(sorted(mount.options.items())))
        source = self._sources.get(cache_key)
        if source is None:
            source = self._sources[cache_key] = open_source(mount.url, source_options(mount), self.settings)
        return source

    # -- packed mounts' members --------------------------------------------------------------

    def members(self, mount: Mount) -> MemberTable | None:
        """The member table of a gpufeed-pack mount's generation (`MemberTables.of`). Another
        process's refresh is seen when the mount table is next read (MOUNTS_TTL_S), as for any
        mount; until then this process reads the previous pack, which stays whole."""
        return self.tables.of(mount, self.source)

    def member_files(self, path: str) -> tuple[Mount, MemberTable, np.ndarray] | None:
        """For a directory of a gpufeed-pack mount: the mount, its member table and the numbers
        of the files under it, in `walk` order (a dataset's index of a million members built
        from the table's columns, with no object per file); None for any other path."""
        where = self.resolve(normalize(path))
        table = None if where is None else self.members(where.mount)
        if where is None or table is None:
            return None
        if where.key:
            entry = table.lookup(*where.split)
            if entry is None or not entry.is_dir:
                return None
        return where.mount, table, table.files_under(where.key)

    def _lookup(self, mount: Mount, parent: str, name: str) -> Entry | None:
        table = self.members(mount)
        return self.engine.lookup(mount.generation, parent, name) if table is None else table.lookup(parent, name)

    def _lookup_many(self, mount: Mount, parent: str, names: list[str]) -> dict[str, Entry]:
        table = self.members(mount)
        if table is None:
            return self.engine.lookup_many(mount.generation, parent, names)
        return {name: entry for name in names if (entry := table.lookup(parent, name)) is not None}

    def _listdir(self, mount: Mount, parent: str) -> list[Entry]:
        table = self.members(mount)
        return self.engine.listdir(mount.generation, parent) if table is None else table.listdir(parent)

    # -- lookups --------------------------------------------------------------------------

    def resolve(self, path: str) -> Resolved | None:
        """The mount holding `path`, or None when `path` is above every mount (a virtual dir).
        A path no remembered mount holds is checked against the table as it is now: a mount
        added moments ago by another process is found, not reported missing."""
        path = normalize(path)
        for fresh in (False, True):
            mounts = self.mounts(fresh=fresh)
            for mount in mounts:
                if path == mount.path:
                    return Resolved(mount, "")
                if path.startswith(mount.path + "/"):
                    return Resolved(mount, path[len(mount.path) + 1 :])
            if path == "/" or any(m.path.startswith(path.rstrip("/") + "/") for m in mounts):
                return None
        raise PathNotFound(f"{path}: no mount contains this path (see 'gpufeed mount ls')")

    def _switched(self, where: Resolved) -> Resolved | None:
        """`where` against the mount's current generation, if a refresh switched it since `where`
        was resolved (the old generation may already be dropped); None when nothing changed."""
        current = next((m for m in self.mounts(fresh=True) if m.path == where.mount.path), None)
        if current is None or current.generation == where.mount.generation:
            return None
        return Resolved(current, where.key)

    def _entry(self, path: str, where: Resolved) -> tuple[Entry, Resolved]:
        parent, name = where.split
        entry = self._lookup(where.mount, parent, name)
        if entry is None and (switched := self._switched(where)) is not None:
            where, entry = switched, self._lookup(switched.mount, parent, name)
        if entry is None:
            raise PathNotFound(f"{path}: no such file or directory in mount {where.mount.path} ({where.mount.url})")
        return entry, where

    def stat(self, path: str) -> FileStat:
        raw, path = path, normalize(path)
        where = self.resolve(path)
        if where is None or where.key == "":
            return FileStat(path, True)
        return FileStat.of(path, _as_named(raw, self._entry(path, where)[0]))

    def ls(self, path: str) -> list[FileStat]:
        raw, path = path, normalize(path)
        where = self.resolve(path)
        base = path.rstrip("/")
        if where is None:
            children = sorted({m.path[len(base) + 1 :].split("/")[0] for m in self.mounts() if m.path.startswith(base + "/")})
            return [FileStat(f"{base}/{name}", True) for name in children]
        if where.key:
            entry, where = self._entry(path, where)
            if not _as_named(raw, entry).is_dir:
                return [FileStat.of(path, entry)]
        entries = self._listdir(where.mount, where.key)
        if not entries and (switched := self._switched(where)) is not None:
            entries = self._listdir(switched.mount, where.key)
        prefix = base + "/"
        hide = PACK_DIR if where.key == "" and packed(where.mount) else None
        return [FileStat.of(prefix + e.name, e) for e in entries if e.name != hide]

    def walk(self, path: str) -> Iterator[FileStat]:
        """Every file under `path` (or `path` itself when it is a file)."""
        raw, path = path, normalize(path)
        where = self.resolve(path)
        if where is None:
            base = path.rstrip("/")
            for mount in self.mounts():
                if mount.path.startswith(base + "/"):
                    yield from self.walk(mount.path)
            return
        if where.key:
            entry, where = self._entry(path, where)
            if not _as_named(raw, entry).is_dir:
                yield FileStat.of(path, entry)
                return
        table = self.members(where.mount)
        if table is not None:
            for e in table.walk(where.key):
                yield FileStat(f"{where.mount.path}/{e.key}", False, e.object_info())
            return
        hide = packed(where.mount)
        for e in self.engine.walk(where.mount.generation, where.key):
            if not (hide and hidden(e.parent)):
                yield FileStat.of(f"{where.mount.path}/{e.key}", e)

    def open_object(self, path: str) -> tuple[Resolved, Source, ObjectInfo]:
        """Pin the version every read of one handle uses, so blocks of two versions never mix.

        Normally that is the manifest's version and costs no store request. An entry listed
        without one (an HTTP `--list` line `KEY SIZE`: no ETag, no mtime) takes it from one HEAD
        on its first open (ETag, else Last-Modified) and records it, so later opens, in any
        process, skip the HEAD; immutable mounts read unconditionally and skip it. With
        --max-age, once the listing is older than the limit every open HEADs the object and a
        changed one is recorded as its new version, which that handle then reads."""
        raw, path = path, normalize(path)
        where = self.resolve(path)
        if where is None or where.key == "":
            raise IsADirectory(f"{path}: is a directory")
        entry, where = self._entry(path, where)
        return self._opened(path, _as_named(raw, entry), where)

    def open_objects(self, paths: Sequence[str]) -> list[tuple[Resolved, Source, ObjectInfo]]:
        """`open_object` of each path, the manifest entries looked up one directory at a time
        (a query per directory the batch touches, not per file): how a pass over a dataset
        (`gpufeed pack`) resolves its files."""
        resolved: list[tuple[str, str, Resolved]] = []
        wanted: dict[tuple[str, int, str], list[str]] = {}
        for raw in paths:
            path = normalize(raw)
            where = self.resolve(path)
            if where is None or where.key == "":
                raise IsADirectory(f"{path}: is a directory")
            resolved.append((raw, path, where))
            parent, name = where.split
            wanted.setdefault((where.mount.path, where.mount.generation, parent), []).append(name)
        mounts = {where.mount.path: where.mount for _, _, where in resolved}
        found = {
            (mount, generation, parent): self._lookup_many(mounts[mount], parent, names)
            for (mount, generation, parent), names in wanted.items()
        }
        opened = []
        for raw, path, where in resolved:
            parent, name = where.split
            entry = found[(where.mount.path, where.mount.generation, parent)].get(name)
            if entry is None:  # not listed, or a refresh switched the mount meanwhile: as open_object finds out
                entry, where = self._entry(path, where)
            opened.append(self._opened(path, _as_named(raw, entry), where))
        return opened

    def _opened(self, path: str, entry: Entry, where: Resolved) -> tuple[Resolved, Source, ObjectInfo]:
        if entry.is_dir:
            raise IsADirectory(f"{path}: is a directory")
        mount, source, info = where.mount, self.source(where.mount), entry.object_info()
        if info.pack_key is not None:
            return where, source, info  # read as a range of its shard, pinned to the shard's listed version
        stale = mount.max_age is not None and time.time() - mount.listed_at > mount.max_age
        unpinned = not mount.immutable and info.etag is None and info.mtime <= 0
        if not (stale or unpinned):
            return where, source, info
        try:
            current = source.head(where.key)
        except ObjectMissing as exc:
            raise ObjectMissing(since_listed(path, "deleted", mount.path, str(exc))) from exc
        if same_version(current, info):
            if not unpinned:
                return where, source, info  # keeps its content hash
            pinned = entry._replace(mtime=current.mtime, etag=current.etag)  # the listed object, now with its version
        elif stale:  # changed since listing: this open reads the new version
            pinned = Entry(entry.parent, entry.name, False, current.size, current.mtime, current.etag)
        else:
            raise ObjectChanged(since_listed(path, "changed", mount.path, f"listed {info.size} bytes, now {current.size}"))
        try:
            self.engine.put_entries(mount.generation, [pinned])
        except MetadataError:
            pass  # a read-only or full GPUFEED_HOME: this handle is pinned all the same; the next open pins again
        return where, source, pinned.object_info()

    # -- writes (recorded by the agent, which stages and uploads them) ----------------------

    def writable_target(self, path: str) -> Resolved:
        """Where a write of `path` goes: a file path in a writable mount, not a directory, and
        not below a file (the store would take `a.json/x` beside `a.json`, and the manifest,
        which cannot list a name as both, would hide one of them)."""
        raw, path = path, normalize(path)
        where = self.resolve(path)
        if where is None or where.key == "" or raw.endswith("/"):
            raise IsADirectory(f"{raw}: is a directory; a write names a file")
        if not is_writable(where.mount):
            why = "a packed mount is read-only" if packed(where.mount) else "mount it with --writable to write"
            raise ReadOnlyMount(f"{path}: mount {where.mount.path} ({where.mount.url}) is read-only: {why}")
        parent, name = where.split
        entry = self.engine.lookup(where.mount.generation, parent, name)
        if entry is not None and entry.is_dir:
            raise IsADirectory(f"{path}: is a directory")
        while parent:
            above, _, folder = parent.rpartition("/")
            entry = self.engine.lookup(where.mount.generation, above, folder)
            if entry is not None and not entry.is_dir:
                raise NotADirectory(f"{path}: {where.mount.path}/{parent} is a file, not a directory")
            if entry is not None:
                break  # a directory listed: its parents are directories too
            parent = above
        return where

    def record_written(self, mount_path: str, info: ObjectInfo, *, replacing: ObjectInfo | None = None) -> bool:
        """Put a written object into the mount's current manifest, with its directories. With
        `replacing`, only while the entry is still that version (an upload recording its ETag
        must not overwrite a newer write of the same path); returns whether it was recorded."""
        mount = self.mount(mount_path)
        parent, _, name = info.key.rpartition("/")
        if replacing is not None:
            entry = self.engine.lookup(mount.generation, parent, name)
            if entry is None or entry.object_info().version != replacing.version or entry.content_hash != info.content_hash:
                return False
        rows = []
        directory = parent
        while directory:
            grand, _, base = directory.rpartition("/")
            rows.append(Entry(grand, base, True))
            directory = grand
        rows.append(Entry.of(info))
        self.engine.put_entries(mount.generation, rows)
        return True

    def record_removed(self, mount_path: str, key: str) -> None:
        """Take a removed object out of the manifest, and the directories it leaves empty: an
        object store has no directories but those its keys imply."""
        mount = self.mount(mount_path)
        parent, _, name = key.rpartition("/")
        self.engine.delete_entry(mount.generation, parent, name)
        while parent and not self.engine.listdir(mount.generation, parent):
            parent, _, name = parent.rpartition("/")
            self.engine.delete_entry(mount.generation, parent, name)

    def container(self, where: Resolved, member: ObjectInfo) -> ObjectInfo:
        """The object a pack member's bytes lie in (its shard), as the mount listed it: every
        read of the member is a range of it, pinned to that version and, for a gpufeed pack,
        checked against the chunk sums its index lists."""
        assert member.pack_key is not None
        parent, name = object_entry(member.pack_key)
        entry = self.engine.lookup(where.mount.generation, parent, name)
        if entry is None:
            raise PackError(
                f"{where.mount.path}/{member.key}: its shard {member.pack_key} is not in the manifest; "
                f"run 'gpufeed mount refresh {where.mount.path}'"
            )
        table = self.members(where.mount)
        sums = None if table is None else table.sums_id(member.pack_key)
        return replace(entry.object_info(), key=member.pack_key, sums_id=sums)

    def shard_sums(self, mount: Mount, shard: str) -> memoryview | None:
        """The chunk sums a gpufeed pack mount's index lists for `shard` (`container`'s sums_id names them)."""
        table = self.members(mount)
        return None if table is None else table.chunk_sums(shard)


def _as_named(raw: str, entry: Entry) -> Entry:
    """`entry`, refused when the path named it as a directory (a trailing '/' or '/.') and it is a file."""
    if raw.endswith(("/", "/.")) and not entry.is_dir:
        raise NotADirectory(f"{raw}: not a directory")
    return entry
