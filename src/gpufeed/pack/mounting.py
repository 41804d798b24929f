"""A packed source as manifest listings: members under their own paths, each pointing at a
range of the object it lies in (`pack_key`, `pack_offset`, `pack_length`), plus one hidden
entry per such object recording its size and version (`layout.OBJECTS_DIR`), which every
member read is pinned to. The read path then reads a member as a range of its shard, through
the shard's cache blocks: nothing else reads or caches bytes.

Three formats: a gpufeed pack (`gpufeed pack`; its index says where each member is, and its
members are not rows but a member table built from the index, `pack.members`); a
WebDataset tar set read in place (each `*.tar` at the source root; where each member is comes
from the tar headers, read once at mount time); a Mosaic MDS directory read in place
(`index.json` and uncompressed `.mds` shards): sample n's column c is the file `{n:08d}.{c}`,
its bytes the column's encoded bytes, located from the shard's offset table and each sample's
size header.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import struct
import tarfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from gpufeed.errors import InvalidArgument, ObjectChanged, ObjectMissing, PackError, SourceError
from gpufeed.pack import index as idx
from gpufeed.pack.layout import DIR, FORMATS, INDEX_KEY, object_entry
from gpufeed.pack.members import MemberTable
from gpufeed.sources.base import ObjectInfo, Source

TAR_WINDOW = 4 << 20
"""Bytes one ranged GET brings while tar headers are read: small members' headers come many to a
read, a big member's data is skipped."""


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
    except SourceError:  # missing, or a store that refuses: its listing then says why, better than a HEAD can
        return "files"
    return "gpufeed-pack"


def listing(source: Source, fmt: str) -> Iterator[list[ObjectInfo]]:
    """What a mount of `source` in format `fmt` lists into its manifest, in batches (a gpufeed
    pack lists no members: `pack_rows`)."""
    if fmt == "webdataset":
        return _webdataset(source)
    if fmt == "mds":
        return _mds(source)
    return source.list()


def _table(info: ObjectInfo) -> ObjectInfo:
    parent, name = object_entry(info.key)
    return replace(info, key=f"{parent}/{name}")


def pack_rows(source: Source) -> tuple[list[ObjectInfo], MemberTable]:
    """A gpufeed pack's manifest rows and its member table. The rows are hidden: one per shard
    and one for the index, whose content hash names the table (`member_table` finds or builds
    it again from that row on any node); the members are in the table, not in rows."""
    objects = {info.key: info for batch in source.list() for info in batch if info.key.startswith(DIR + "/")}
    where = f"{source.url}/{INDEX_KEY}"
    found = objects.get(INDEX_KEY)
    if found is None:
        raise PackError(f"{where}: no pack index (was 'gpufeed pack' interrupted? run it again)")
    data = source.get_range(INDEX_KEY, 0, found.size, found)
    index = idx.decode(data, where)
    for key, size in zip(index.shards, index.shard_sizes, strict=True):
        shard = objects.get(key)
        if shard is None or shard.size != size:
            now = "missing" if shard is None else f"{shard.size} bytes"
            raise PackError(f"{source.url}/{key}: shard {now}, the index says {size} bytes; run 'gpufeed pack' again")
    indexed = replace(found, content_hash=f"sha256:{hashlib.sha256(data).hexdigest()}")
    return [_table(objects[key]) for key in index.shards] + [_table(indexed)], MemberTable.build(index)


def member_table(source: Source, row: ObjectInfo, tables: Path) -> MemberTable:
    """The member table of the pack whose index the manifest recorded as `row`: the one saved
    under `tables` by whoever mounted it on this node, else built from the index (that version,
    checked against the recorded sha256) and saved for the node's other processes. A home that
    cannot be written keeps it in this process only."""
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


def _webdataset(source: Source) -> Iterator[list[ObjectInfo]]:
    tars = sorted((info for batch in source.list() for info in batch if info.key.endswith(".tar")), key=lambda i: i.key)
    if not tars:
        raise PackError(f"{source.url}: no .tar shards to mount as a WebDataset")
    yield [_table(tar) for tar in tars]
    seen: dict[str, str] = {}
    for tar in tars:
        batch: list[ObjectInfo] = []
        for name, offset, size, mtime in tar_members(source, tar):
            if name in seen:
                raise PackError(f"{source.url}: member {name} is in both {seen[name]} and {tar.key}")
            seen[name] = tar.key
            batch.append(ObjectInfo(name, size, mtime, None, None, tar.key, offset, size))
        yield batch


def tar_members(source: Source, tar: ObjectInfo) -> Iterator[tuple[str, int, int, float]]:
    """(name, data offset, size, mtime) of each regular file in the tar, from its headers."""
    reader = _Ranged(source, tar)
    try:
        with tarfile.open(fileobj=reader, mode="r:") as archive:  # type: ignore[call-overload]
            for member in archive:
                if member.isreg():
                    name = member.name.removeprefix("./")
                    yield name, member.offset_data, member.size, float(member.mtime)
    except tarfile.TarError as exc:
        raise PackError(f"{source.url}/{tar.key}: not a readable tar ({exc})") from None


class _Ranged(io.RawIOBase):
    """A seekable read-only view of one object version, read in TAR_WINDOW ranged GETs."""

    def __init__(self, source: Source, info: ObjectInfo) -> None:
        super().__init__()
        self._source, self._info = source, info
        self._pos = 0
        self._window = memoryview(b"")
        self._window_at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._info.size}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        target = memoryview(buffer).cast("B")
        end = min(self._pos + len(target), self._info.size)
        if end <= self._pos:
            return 0
        at = self._window_at
        if not (at <= self._pos and end <= at + len(self._window)):
            stop = min(self._info.size, max(end, self._pos + TAR_WINDOW))
            self._window = self._source.get_range(self._info.key, self._pos, stop, self._info)
            self._window_at = at = self._pos
        count = end - self._pos
        target[:count] = self._window[self._pos - at : end - at]
        self._pos = end
        return count


def _mds(source: Source) -> Iterator[list[ObjectInfo]]:
    objects = {info.key: info for batch in source.list() for info in batch}
    where = f"{source.url}/index.json"
    found = objects.get("index.json")
    if found is None:
        raise PackError(f"{where}: no MDS index.json")
    try:
        shards = json.loads(bytes(source.get_range("index.json", 0, found.size, found)))["shards"]
    except (ValueError, KeyError, TypeError) as exc:
        raise PackError(f"{where}: not an MDS index ({exc})") from None
    tables: list[ObjectInfo] = []
    for shard in shards:
        if shard.get("format") != "mds" or shard.get("compression"):
            raise PackError(f"{where}: only uncompressed MDS shards can be read in place (found {shard.get('compression')})")
        key = shard["raw_data"]["basename"]
        if key not in objects:
            raise PackError(f"{source.url}/{key}: MDS shard missing")
        tables.append(objects[key])
    yield [_table(info) for info in tables]
    first = 0
    for shard, info in zip(shards, tables, strict=True):
        yield list(_mds_samples(source, info, shard, first))
        first += int(shard["samples"])


def _mds_samples(source: Source, info: ObjectInfo, shard: dict, first: int) -> Iterator[ObjectInfo]:
    """One file per column of each sample of one MDS shard: `u32 count, u32 offsets[count + 1]`,
    then each sample, `u32 size` per variable-size column, then the columns' bytes in order."""
    names, sizes = shard["column_names"], shard["column_sizes"]
    variable = [n for n, size in enumerate(sizes) if size is None]
    reader = _Ranged(source, info)
    (count,) = struct.unpack("<I", reader.read(4))
    if count != int(shard["samples"]) or 4 * (count + 2) > info.size:
        raise PackError(f"{source.url}/{info.key}: MDS shard header says {count} samples, index.json {shard['samples']}")
    offsets = struct.unpack(f"<{count + 1}I", reader.read(4 * (count + 1)))
    for n in range(count):
        at = offsets[n]
        lengths = list(sizes)
        if variable:
            reader.seek(at)
            for column, size in zip(variable, struct.unpack(f"<{len(variable)}I", reader.read(4 * len(variable))), strict=True):
                lengths[column] = size
        at += 4 * len(variable)
        if at + sum(lengths) != offsets[n + 1]:
            raise PackError(f"{source.url}/{info.key}: MDS sample {first + n} does not fill its offsets")
        for name, length in zip(names, lengths, strict=True):
            yield ObjectInfo(f"{first + n:08d}.{name}", length, info.mtime, None, None, info.key, at, length)
            at += length
