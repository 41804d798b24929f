"""A packed source as manifest listings: members under their own paths, each pointing at a
range of the object it lies in (`pack_key`, `pack_offset`, `pack_length`), plus one hidden
entry per such object recording its size and version (`layout.OBJECTS_DIR`), which every
member read is pinned to. The read path then reads a member as a range of its shard, through
the shard's cache blocks: nothing else reads or caches bytes.

A gpufeed pack (`gpufeed pack`) is mounted here: its index says where each member is, and its
members are not rows but a member table built from the index (`pack.members`). Shard sets other
tools wrote (WebDataset, Mosaic MDS, LitData) are read in place by `pack.in_place`.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpufeed.errors import (
    InvalidArgument,
    NoDirectoryIndex,
    ObjectChanged,
    ObjectMissing,
    PackError,
    PathNotFound,
    SourceError,
    SourceUnreachable,
)
from gpufeed.pack import in_place
from gpufeed.pack.layout import DIR, FORMATS, INDEX_KEY, shard_row
from gpufeed.sources.base import ObjectInfo, Source

if TYPE_CHECKING:
    from gpufeed.pack.members import MemberTable

HEAD_CONCURRENCY = 32
"""HEADs in flight when a pack's objects are looked up one by one (a listing that hides them)."""


def detect(source: Source, requested: str) -> str:
    """The format to mount `source` as: `requested`, or for auto a gpufeed pack when the source
    holds a pack index (one HEAD), else plain files. HTTP sources are not probed: their listing
    promises no request per mount (a `KEY SIZE` list), so a pack over HTTP is mounted with
    `format=gpufeed-pack`."""
    if requested not in FORMATS:
        raise InvalidArgument(f"option format={requested!r}: expected one of {', '.join(FORMATS)}")
    if requested != "auto":
        return requested
    if source.url.startswith(("http://", "https://")):
        return "files"
    try:
        source.head(INDEX_KEY)
    except SourceUnreachable as exc:  # the listing would wait as long again to say the same; named as the mount's URL
        raise SourceUnreachable(str(exc).replace(f"{source.url}/{INDEX_KEY}", source.url, 1)) from None
    except SourceError:  # missing, or a store that refuses: its listing then says why, better than a HEAD can
        return "files"
    return "gpufeed-pack"


def holds_pack(source: Source) -> bool:
    """Whether `source` has a pack index, by one HEAD; False when it cannot say."""
    try:
        source.head(INDEX_KEY)
    except SourceError:
        return False
    return True


def listing(source: Source, fmt: str) -> Iterator[list[ObjectInfo]]:
    """What a mount of `source` in format `fmt` lists into its manifest, in batches (a gpufeed
    pack lists no members: `pack_rows`)."""
    readers = {"webdataset": in_place.webdataset, "mds": in_place.mds, "litdata": in_place.litdata}
    return readers[fmt](source) if fmt in readers else source.list()


def pack_rows(source: Source) -> tuple[list[ObjectInfo], MemberTable]:
    """A gpufeed pack's manifest rows and its member table. The rows are hidden: one per shard
    and one for the index, whose content hash names the table (`member_table` finds or builds
    it again from that row on any node); the members are in the table, not in rows. A listing
    that does not show the pack's directory (nginx's index hides dot directories) is made up by
    a HEAD of the index and of each shard it names, so a pack served from a web server's
    directory mounts without a listing file, as does one on a host that lists nothing."""
    from gpufeed.pack import index as idx  # numpy: only a pack's mount loads it
    from gpufeed.pack.members import MemberTable

    try:
        objects = {info.key: info for batch in source.list() for info in batch if info.key.startswith(DIR + "/")}
    except (NoDirectoryIndex, PathNotFound):  # a static host (404 for directories too): the index names the rest
        objects = {}
    where = f"{source.url}/{INDEX_KEY}"
    found = objects.get(INDEX_KEY) or (_heads(source, [INDEX_KEY]).get(INDEX_KEY) if not objects else None)
    if found is None:
        raise PackError(f"{where}: no pack index (was 'gpufeed pack' interrupted? run it again)")
    data = source.get_range(INDEX_KEY, 0, found.size, found)
    index = idx.decode(data, where)
    if not objects:
        objects = _heads(source, index.shards)
    for key, size in zip(index.shards, index.shard_sizes, strict=True):
        shard = objects.get(key)
        if shard is None or shard.size != size:
            now = "missing" if shard is None else f"{shard.size} bytes"
            raise PackError(f"{source.url}/{key}: shard {now}, the index says {size} bytes; run 'gpufeed pack' again")
    indexed = replace(found, content_hash=f"sha256:{hashlib.sha256(data).hexdigest()}")
    return [shard_row(objects[key]) for key in index.shards] + [shard_row(indexed)], MemberTable.build(index)


def _heads(source: Source, keys: list[str]) -> dict[str, ObjectInfo]:
    """The objects of `keys` that exist, by HEAD, HEAD_CONCURRENCY at a time."""

    def head(key: str) -> ObjectInfo | None:
        try:
            return source.head(key)
        except ObjectMissing:
            return None

    with ThreadPoolExecutor(HEAD_CONCURRENCY, thread_name_prefix="gpufeed-head") as pool:
        return {info.key: info for info in pool.map(head, keys) if info is not None}


def member_table(source: Source, row: ObjectInfo, tables: Path) -> MemberTable:
    """The member table of the pack whose index the manifest recorded as `row`: the one saved
    under `tables` by whoever mounted it on this node, else built from the index (that version,
    checked against the recorded sha256) and saved for the node's other processes. A home that
    cannot be written keeps it in this process only."""
    from gpufeed.pack import index as idx  # numpy: only a pack's mount loads it
    from gpufeed.pack.members import MemberTable

    assert row.content_hash is not None
    name = row.content_hash.removeprefix("sha256:")
    table = MemberTable.load(tables / name)
    if table is not None:
        return table
    where = f"{source.url}/{INDEX_KEY}"
    changed = PackError(f"{where}: the index changed since it was mounted; run 'gpufeed mount refresh'")
    try:
        data = source.get_range(INDEX_KEY, 0, row.size, replace(row, key=INDEX_KEY))
    except (ObjectChanged, ObjectMissing):
        raise changed from None
    if hashlib.sha256(data).hexdigest() != name:
        raise changed
    table = MemberTable.build(idx.decode(data, where))
    with contextlib.suppress(OSError):
        table.save(tables / name)
    return table
