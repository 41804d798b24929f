"""Shard formats other tools write, read in place: what each member is and where its bytes lie
in its shard, found from the shards' own headers at mount time, never by converting them.

- WebDataset: each `*.tar` under the source; a member is a regular file of a tar (or a link to
  one), in the tar's folder, where it lies comes from the tar headers (for small members, one
  pass over the tars).
- Mosaic MDS (`index.json`, uncompressed `.mds` shards): sample n's column c is the file
  `{n:08d}.{c}`, its bytes the column's encoded bytes, located from the shard's offset table and
  each sample's size header.
- LitData optimized directories (`index.json`, uncompressed `chunk-*.bin` of its PyTree layout):
  sample n's leaf is the file `{n:08d}.{name}`, named by its path in the sample (`image`,
  `meta.label` for a dict; `0`, `1` for a tuple or a bare value), its bytes the leaf's serialized
  bytes as LitData wrote them (a JPEG's file bytes, an int's 8 bytes), located from the chunk's
  offset table and each sample's size header. Sample numbers are LitData's dataset indexes.

Each yields the shards' manifest rows first, then the members in batches (`mounting.listing`).
"""

from __future__ import annotations

import io
import json
import logging
import posixpath
import struct
import tarfile
from collections.abc import Iterator
from typing import Any

from gpufeed.errors import PackError
from gpufeed.pack.layout import shard_row
from gpufeed.sources.base import ObjectInfo, Source

log = logging.getLogger(__name__)
ARROW_ROWS = "its samples are in an Arrow footer (LitData writes one for dicts of plain values), which cannot be read in place"
"""Why a LitData chunk whose samples take no bytes is refused: newer LitData puts such samples
in an Arrow table after its (then empty) PyTree body."""
TAR_WINDOW = 4 << 20
"""Bytes one ranged GET brings while shard headers are read: small members' headers come many to
a read, a big member's data is skipped."""


def webdataset(source: Source) -> Iterator[list[ObjectInfo]]:
    tars = sorted((info for batch in source.list() for info in batch if info.key.endswith(".tar")), key=lambda i: i.key)
    if not tars:
        raise PackError(f"{source.url}: no .tar shards to mount as a WebDataset")
    yield [shard_row(tar) for tar in tars]
    seen: dict[str, str] = {}
    dangling: list[str] = []
    for tar in tars:
        batch: list[ObjectInfo] = []
        folder = posixpath.dirname(tar.key)
        for member, offset, size, mtime in tar_members(source, tar, dangling):
            name = f"{folder}/{member}" if folder else member  # train/ and val/ tars each keep their folder
            if name in seen:
                raise PackError(f"{source.url}: member {name} is in both {seen[name]} and {tar.key}")
            seen[name] = tar.key
            batch.append(ObjectInfo(name, size, mtime, None, None, tar.key, offset, size))
        yield batch
    if dangling:
        log.warning("%s: %d link(s) to no regular file of their tar left out (%s)", source.url, len(dangling), dangling[0])


def tar_members(source: Source, tar: ObjectInfo, dangling: list[str]) -> Iterator[tuple[str, int, int, float]]:
    """(name, data offset, size, mtime) of each regular file in the tar, from its headers; a
    name found twice is its last member, as tar extracts it. A hard or symbolic link to a
    regular file of the same tar is that file's bytes under the link's name (tar keeps a hard
    link's second name only as a link); any other link is added to `dangling` (`tar/name`) and
    left out, since its bytes are not in the shard."""
    reader = _Ranged(source, tar)
    files: dict[str, tuple[str, int, int, float]] = {}
    links: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=reader, mode="r:") as archive:  # type: ignore[call-overload]
            for member in archive:
                name = posixpath.normpath(member.name.removeprefix("./"))
                if member.isreg():
                    files[name] = (name, member.offset_data, member.size, float(member.mtime))
                    links.pop(name, None)
                elif member.islnk():  # names the other member as the archive does
                    links[name] = posixpath.normpath(member.linkname.removeprefix("./"))
                    files.pop(name, None)
                elif member.issym():  # relative to the link's folder
                    links[name] = posixpath.normpath(posixpath.join(posixpath.dirname(name), member.linkname))
                    files.pop(name, None)
            _check_tail(reader, archive.offset)
    except tarfile.TarError as exc:
        raise PackError(f"{source.url}/{tar.key}: not a readable tar ({exc})") from None
    for name, target in links.items():
        for _ in range(40):  # as the kernel's limit on nested symlinks
            if target not in links:
                break
            target = links[target]
        if target in files:
            files[name] = (name, *files[target][1:])
        else:
            dangling.append(f"{tar.key}/{name}")
    yield from sorted(files.values(), key=lambda member: member[1])


def _check_tail(reader: _Ranged, end: int) -> None:
    """The block where tarfile stopped must be an end-of-archive block of zeros (or the object's
    end): tarfile takes a damaged header after the first for the end, and the members after it
    were silently lost (a sixth of a shard's samples gone from training). Whatever follows the
    zeros (a record's padding, however big) is not read."""
    reader.seek(end)
    if (reader.read(tarfile.BLOCKSIZE) or b"").strip(b"\0"):
        raise tarfile.TarError(f"a damaged header at byte {end:,} of {reader.size:,}: the members after it cannot be found")


def mds(source: Source) -> Iterator[list[ObjectInfo]]:
    index, objects = _index_json(source, "MDS")
    where = f"{source.url}/index.json"
    try:
        shards = index["shards"]
        keys = [shard["raw_data"]["basename"] for shard in shards]
        columns = [(list(shard["column_names"]), list(shard["column_sizes"])) for shard in shards]
        if any(len(names) != len(sizes) for names, sizes in columns):
            raise ValueError("a shard names other columns than it sizes")
        counts = [int(shard["samples"]) for shard in shards]
        refused = [shard.get("compression") for shard in shards if shard.get("format") != "mds" or shard.get("compression")]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PackError(f"{where}: not an MDS index ({_missing(exc)})") from None
    if refused:
        raise PackError(f"{where}: only uncompressed MDS shards can be read in place (found {refused[0]})")
    infos = _shards(source, objects, keys, "MDS shard")
    yield [shard_row(info) for info in infos]
    first = 0
    for (names, sizes), count, info in zip(columns, counts, infos, strict=True):
        yield list(_samples(source, info, count, names, sizes, first, "MDS"))
        first += count


def _samples(source: Source, info: ObjectInfo, expected: int, names: list[str], sizes: list[int | None], first: int,
             kind: str, empty: str = "its samples take no bytes") -> Iterator[ObjectInfo]:
    """One file per column of each sample of one MDS shard or LitData chunk, both laid out as
    `u32 count, u32 offsets[count + 1]`, then each sample: a `u32 size` per column whose size
    the index does not fix, then the columns' bytes in order."""
    variable = sum(size is None for size in sizes)
    reader = _Ranged(source, info)
    where = f"{source.url}/{info.key}"
    (count,) = _u32(reader, 1, where)
    if count != expected:
        raise PackError(f"{where}: {kind} header says {count} samples, index.json {expected}")
    offsets = _offsets(reader, count, where)
    if variable and count and offsets[-1] == offsets[0]:
        raise PackError(f"{where}: {empty}")
    fixed = [size for size in sizes if size is not None]
    for n in range(count):
        lengths = fixed
        if variable:  # a shard of fixed-size columns has no size header to read
            reader.seek(offsets[n])
            header = iter(_u32(reader, variable, where))
            lengths = [size if size is not None else next(header) for size in sizes]
        at = offsets[n] + 4 * variable
        if at + sum(lengths) != offsets[n + 1]:
            raise PackError(f"{where}: {kind} sample {first + n} does not fill its offsets")
        for name, length in zip(names, lengths, strict=True):
            yield ObjectInfo(f"{first + n:08d}.{name}", length, info.mtime, None, None, info.key, at, length)
            at += length


def litdata(source: Source) -> Iterator[list[ObjectInfo]]:
    index, objects = _index_json(source, "LitData")
    where = f"{source.url}/index.json"
    try:
        chunks, config = index["chunks"], index["config"]
        keys = [chunk["filename"] for chunk in chunks]
        counts = [int(chunk["chunk_size"]) for chunk in chunks]
        leaves = len(config["data_format"])
        refused = [f"{name}={config[name]}" for name in ("compression", "encryption") if config.get(name)]
        if config.get("item_loader", "PyTreeLoader") != "PyTreeLoader":
            refused.append(f"item_loader={config['item_loader']}")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PackError(f"{where}: not a LitData index ({_missing(exc)})") from None
    if refused:
        raise PackError(f"{where}: only uncompressed, unencrypted PyTreeLoader chunks can be read in place "
                        f"(found {', '.join(refused)})")
    names = leaf_names(config.get("data_spec"), leaves)
    infos = _shards(source, objects, keys, "LitData chunk")
    yield [shard_row(info) for info in infos]
    first = 0
    for count, info in zip(counts, infos, strict=True):
        yield list(_samples(source, info, count, names, [None] * len(names), first, "LitData", ARROW_ROWS))
        first += count


def _missing(exc: Exception) -> str:
    """What an index.json lacks, in its own terms: a field, or a field of the wrong kind."""
    return f"no {exc.args[0]!r} field" if isinstance(exc, KeyError) else f"a field of the wrong kind: {exc}"


def leaf_names(data_spec: object, leaves: int) -> list[str]:
    """Each leaf's path in a LitData sample (its `data_spec`, a torch pytree spec as JSON): dict
    keys, list and tuple positions, joined by '.'. Positions `0`…`leaves - 1` where the spec is
    unreadable, or where a key could not be a file name."""
    try:
        _, spec = json.loads(data_spec) if isinstance(data_spec, str) else (None, None)
        names = [".".join(path) for path in _paths(spec)] if spec is not None else []
    except (ValueError, TypeError, KeyError):
        names = []
    fine = len(names) == leaves and len(set(names)) == leaves and all(names)
    return names if fine else [str(n) for n in range(leaves)]


def _paths(spec: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    children = spec["children_spec"]
    if spec["type"] is None or not children:
        yield ()
        return
    keys = json.loads(spec["context"]) if spec["type"] in ("builtins.dict", "collections.OrderedDict") else range(len(children))
    for key, child in zip(keys, children, strict=True):
        name = str(key)
        if not name or "/" in name or name.startswith("."):
            raise ValueError(name)
        yield from ((name, *rest) for rest in _paths(child))


def _index_json(source: Source, kind: str) -> tuple[Any, dict[str, ObjectInfo]]:
    """A shard set's `index.json`, parsed, and the objects at the source root by key."""
    objects = {info.key: info for batch in source.list() for info in batch}
    where = f"{source.url}/index.json"
    found = objects.get("index.json")
    if found is None:
        raise PackError(f"{where}: no {kind} index.json")
    try:
        return json.loads(bytes(source.get_range("index.json", 0, found.size, found))), objects
    except ValueError as exc:
        raise PackError(f"{where}: not a {kind} index ({exc})") from None


def _shards(source: Source, objects: dict[str, ObjectInfo], keys: list[str], kind: str) -> list[ObjectInfo]:
    missing = [key for key in keys if key not in objects]
    if missing:
        raise PackError(f"{source.url}/{missing[0]}: {kind} missing")
    return [objects[key] for key in keys]


def _u32(reader: _Ranged, count: int, where: str) -> tuple[int, ...]:
    """`count` little-endian u32s at the reader's position: a header that says more than its
    shard holds fails here, before anything that size is read."""
    if reader.tell() + 4 * count > reader.size:
        raise PackError(f"{where}: ends inside a header ({count} numbers at byte {reader.tell()} of {reader.size})")
    return struct.unpack(f"<{count}I", reader.read(4 * count))


def _offsets(reader: _Ranged, count: int, where: str) -> tuple[int, ...]:
    """A shard's table of where each of its `count` samples starts, and where the last ends."""
    offsets = _u32(reader, count + 1, where)
    if offsets[-1] > reader.size:
        raise PackError(f"{where}: its offsets run past its {reader.size} bytes")
    return offsets


class _Ranged(io.RawIOBase):
    """A seekable read-only view of one object version, read in TAR_WINDOW ranged GETs."""

    def __init__(self, source: Source, info: ObjectInfo) -> None:
        super().__init__()
        self._source, self._info = source, info
        self._pos = 0
        self._window = memoryview(b"")
        self._window_at = 0

    @property
    def size(self) -> int:
        return self._info.size

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
