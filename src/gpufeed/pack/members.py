"""A gpufeed pack's members as a manifest: columnar, built once per node from the pack index,
memory-mapped by every process.

Listing a million members into the metadata engine as rows costs ~8 µs a row in SQLite alone
(25 s a million, with the Python around it); this table is built from the index's numpy
columns in about two seconds, saved under `GPUFEED_HOME/packs/<index sha256>`, and opened by
each process with `np.load(mmap_mode="r")`, so DataLoader workers, the agent and FUSE share
its pages instead of holding copies. It answers what the engine answers for a mount: an entry
by (parent, name), a directory's entries, the files under a directory in (parent, name) order.
Entries, directories included, are sorted by (parent, name); a key is found through a sorted
array of its xxh3-64 (collisions are checked against the key itself), a directory's entries
are one contiguous range.
"""

from __future__ import annotations

import bisect
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import numpy as np
import xxhash

from gpufeed.blocks import sums_id, sums_length
from gpufeed.meta.base import Entry
from gpufeed.meta.manifest import usable_key
from gpufeed.pack.index import Index

COLUMNS = (
    "blob", "starts", "hashes", "by_hash", "member", "children", "shard", "offset", "length", "mtime", "sha256", "chunk_sums",
    "chunk_starts",
)
"""Arrays of a table, one `.npy` file each. Per entry (sorted by (parent, name)): `starts`
(its key's offsets in `blob`), `member` (its row in the index columns; -1 for a directory),
`children` (a directory's [start, end) entries). `hashes` (sorted xxh3-64 of keys) and
`by_hash` (the entry each names) find a key. Per member, in index order: `shard`, `offset`,
`length`, `mtime`, `sha256`. Per shard: `chunk_starts` (where its sums begin in `chunk_sums`,
the index's, one more for the end; empty for a version 1 index)."""

CHECKED_ON_OPEN = tuple(name for name in COLUMNS if name != "sha256")
"""Columns each process checks against their sums when it opens a table: all that find a
member and its bytes. Not the members' sha256 (a third of a table), which only `verify`
reads, and which a damaged copy would make report a mismatch, not serve wrong bytes."""
WALK_CHUNK = 8192
log = logging.getLogger("gpufeed")


def _digest(array: np.ndarray) -> str:
    """xxh3-64 of an array's dtype, shape and bytes."""
    hasher = xxhash.xxh3_64(f"{array.dtype.str}{array.shape}".encode())
    hasher.update(np.ascontiguousarray(array).data.cast("B"))
    return hasher.hexdigest()


def drop_if_hashes_damaged(where: Path) -> bool:
    """Check the members' sha256 column of the table saved at `where`, which opening it leaves
    out (CHECKED_ON_OPEN) and `verify` reads: a damaged copy made verify report intact shards
    as changed at the store. A damaged one is removed, to be built again from the index; True
    then."""
    try:
        sums = msgspec.json.decode((where / "sums.json").read_bytes(), type=dict[str, str])
        intact = sums.get("sha256") == _digest(np.load(where / "sha256.npy", mmap_mode="r").view(np.ndarray))
    except FileNotFoundError:
        return False  # none saved: built from the index when opened
    except (OSError, ValueError, msgspec.DecodeError):
        intact = False
    if not intact:
        log.warning("gpufeed: warning: pack member table %s is damaged (its sha256 column); building it again", where)
        shutil.rmtree(where, ignore_errors=True)
    return not intact


class TableMeta(msgspec.Struct, frozen=True):
    """What a table holds besides its arrays: shard keys, the root's entries, counts."""

    shards: list[str]
    root: tuple[int, int]
    files: int
    bytes: int
    skipped: int


def _all_usable(paths: list[str]) -> bool:
    """Whether every path is a `usable_key`, checked over all of them joined: one pass in C
    instead of a call per path. A path with a newline can only make it answer no."""
    joined = "/" + "/\n/".join(paths) + "/"
    return "//" not in joined and "/./" not in joined and "/../" not in joined and "\0" not in joined


class MemberTable:
    """The members of one pack, as the manifest of the mount showing them."""

    def __init__(self, arrays: dict[str, np.ndarray], meta: TableMeta) -> None:
        self._a = arrays
        self._blob, self._starts, self._hashes = arrays["blob"], arrays["starts"], arrays["hashes"]
        self._by_hash, self._member, self._children = arrays["by_hash"], arrays["member"], arrays["children"]
        self.meta = meta
        self.shards = meta.shards
        self.files, self.bytes, self.skipped = meta.files, meta.bytes, meta.skipped
        self._shard_numbers = {key: n for n, key in enumerate(meta.shards)}
        self._sums_ids: dict[str, str | None] = {}

    # -- building and storing -----------------------------------------------------------

    @classmethod
    def build(cls, index: Index) -> MemberTable:
        """The table of `index`'s members and the directories their paths imply; members whose
        path no namespace path could name ('..', empty components) are left out and counted."""
        paths = index.paths
        usable = list(range(len(paths))) if _all_usable(paths) else [n for n, p in enumerate(paths) if usable_key(p)]
        texts = paths if len(usable) == len(paths) else [paths[n] for n in usable]
        parents = [text.rpartition("/")[0] for text in texts]
        dirs: set[str] = set()
        for parent in set(parents):
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = parent.rpartition("/")[0]
        dir_list = sorted(dirs)
        texts = [*texts, *dir_list]
        parents += [d.rpartition("/")[0] for d in dir_list]
        # parent + NUL + name orders as (parent, name): NUL sorts before every character a path holds
        sort_keys = [f"{p}\0{t[len(p) + 1 if p else 0 :]}" for p, t in zip(parents, texts, strict=True)]
        order = sorted(range(len(texts)), key=sort_keys.__getitem__)
        entry_keys = [texts[n].encode() for n in order]
        lengths = np.fromiter(map(len, entry_keys), dtype=np.int64, count=len(entry_keys))
        starts = np.zeros(len(entry_keys) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        hashes = np.fromiter(map(xxhash.xxh3_64_intdigest, entry_keys), dtype=np.uint64, count=len(entry_keys))
        by_hash = np.argsort(hashes, kind="stable")
        ordered = np.asarray(order, dtype=np.int64)
        member = np.asarray(usable + [-1] * len(dir_list), dtype=np.int64)[ordered]
        # a directory's entries are the run of entries with its parent id; -1 is the root
        dir_id = {d: k for k, d in enumerate(dir_list)}
        parent_of = np.fromiter((dir_id.get(p, -1) for p in parents), dtype=np.int64, count=len(parents))[ordered]
        bounds = np.flatnonzero(parent_of[1:] != parent_of[:-1]) + 1
        run_starts = np.concatenate([[0], bounds]) if len(parent_of) else np.zeros(0, np.int64)
        run_ends = np.concatenate([bounds, [len(parent_of)]]) if len(parent_of) else np.zeros(0, np.int64)
        owners = parent_of[run_starts]
        position = np.empty(len(order), dtype=np.int64)
        position[ordered] = np.arange(len(order))
        children = np.zeros((len(entry_keys), 2), dtype=np.int64)
        below = owners >= 0
        children[position[len(usable) + owners[below]]] = np.stack([run_starts[below], run_ends[below]], axis=1)
        at_root = np.flatnonzero(~below)
        root = (int(run_starts[at_root[0]]), int(run_ends[at_root[0]])) if len(at_root) else (0, 0)
        lengths_column = index.lengths
        arrays: dict[str, np.ndarray] = {
            "blob": np.frombuffer(b"".join(entry_keys), dtype=np.uint8),
            "starts": starts,
            "hashes": hashes[by_hash],
            "by_hash": by_hash,
            "member": member,
            "children": children,
            "shard": index.shard_of,
            "offset": index.offsets,
            "length": lengths_column,
            "mtime": index.mtimes,
            "sha256": np.frombuffer(index.sha256, dtype=np.uint8).reshape(-1, 32),
            "chunk_sums": np.frombuffer(index.chunk_sums, dtype=np.uint8),
            "chunk_starts": np.cumsum([0, *map(sums_length, index.shard_sizes)]) if index.version >= 2 else np.zeros(0, np.int64),
        }
        total = int(lengths_column[np.asarray(usable, dtype=np.int64)].sum()) if usable else 0
        return cls(arrays, TableMeta(index.shards, root, len(usable), total, len(index.paths) - len(usable)))

    def save(self, where: Path) -> None:
        """Write the table to directory `where` atomically: built beside it and renamed, so a
        process opening it sees all of it or none; another process's copy already there wins."""
        where.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f".{where.name}.", dir=where.parent))
        try:
            for name in COLUMNS:
                np.save(building / f"{name}.npy", np.ascontiguousarray(self._a[name]))
            meta = msgspec.json.encode(self.meta)
            sums = {name: _digest(self._a[name]) for name in COLUMNS} | {"meta": xxhash.xxh3_64_hexdigest(meta)}
            (building / "sums.json").write_bytes(msgspec.json.encode(sums))
            (building / "meta.json").write_bytes(meta)
            os.rename(building, where)
        except OSError:
            shutil.rmtree(building, ignore_errors=True)
            if not (where / "meta.json").exists():
                raise

    @classmethod
    def load(cls, where: Path) -> MemberTable | None:
        """The table saved at `where`, memory-mapped; None when there is none. A damaged one
        (a file missing, cut short or changed: its columns are checked against the sums saved
        with it, CHECKED_ON_OPEN, about 20 ms a million members) is removed, so the caller
        builds it again."""
        try:
            raw = (where / "meta.json").read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            sums = msgspec.json.decode((where / "sums.json").read_bytes(), type=dict[str, str])
        except FileNotFoundError:  # saved by a release that wrote no sums: built again, quietly
            shutil.rmtree(where, ignore_errors=True)
            return None
        except (OSError, msgspec.DecodeError):
            sums = {}
        try:
            if sums.get("meta") != xxhash.xxh3_64_hexdigest(raw):
                raise ValueError("meta.json does not match its sum")
            meta = msgspec.json.decode(raw, type=TableMeta)
            # plain ndarray views of the maps: np.memmap's indexing runs Python code per access
            arrays = {name: np.load(where / f"{name}.npy", mmap_mode="r").view(np.ndarray) for name in COLUMNS}
            if any(sums.get(name) != _digest(arrays[name]) for name in CHECKED_ON_OPEN):
                raise ValueError("a column does not match its sum")
            table = cls(arrays, meta)
            entries, members = len(table), len(arrays["length"])
            if len(arrays["starts"]) != entries + 1 or len(arrays["children"]) != entries or len(arrays["sha256"]) != members:
                raise ValueError("columns of different lengths")
            starts = arrays["chunk_starts"]
            if len(starts) not in (0, len(meta.shards) + 1) or (len(starts) and starts[-1] != len(arrays["chunk_sums"])):
                raise ValueError("chunk sums of different lengths")
        except (OSError, ValueError, msgspec.DecodeError) as exc:
            log.warning("gpufeed: warning: pack member table %s is damaged (%s); building it again", where, exc)
            shutil.rmtree(where, ignore_errors=True)
            return None
        return table

    # -- what the engine answers --------------------------------------------------------

    def chunk_sums(self, shard: str) -> memoryview | None:
        """The chunk sums the index lists for `shard` (a key), a view of the mapped table (no
        copy: a process may hold thousands of shards); None when it lists none."""
        starts = self._a["chunk_starts"]
        n = self._shard_numbers.get(shard)
        if not len(starts) or n is None:
            return None
        return memoryview(self._a["chunk_sums"][int(starts[n]) : int(starts[n + 1])].data)

    def sums_id(self, shard: str) -> str | None:
        """What names `shard`'s chunk sums (`ObjectInfo.sums_id`), worked out once per shard."""
        if shard not in self._sums_ids:
            sums = self.chunk_sums(shard)
            self._sums_ids[shard] = None if sums is None else sums_id(sums)
        return self._sums_ids[shard]

    def __len__(self) -> int:
        return len(self._member)

    def _key(self, n: int) -> bytes:
        return self._blob[self._starts[n] : self._starts[n + 1]].tobytes()

    def entry(self, n: int) -> Entry:
        parent, _, name = self._key(n).decode().rpartition("/")
        m = int(self._member[n])
        if m < 0:
            return Entry(parent, name, True)
        a = self._a
        length = int(a["length"][m])
        return Entry(
            parent, name, False, length, float(a["mtime"][m]), None, f"sha256:{a['sha256'][m].tobytes().hex()}",
            self.shards[int(a["shard"][m])], int(a["offset"][m]), length,
        )

    def entries(self, ns: np.ndarray) -> list[Entry]:
        """The entries numbered `ns`, built column by column: a million walked entries cost a
        few seconds, not one numpy lookup per field each."""
        starts, ends = self._starts[ns], self._starts[ns + 1]
        blob = self._blob
        keys = [blob[s:e].tobytes().decode() for s, e in zip(starts.tolist(), ends.tolist(), strict=True)]
        rows = np.asarray(self._member[ns])
        files = rows >= 0
        m = rows[files]
        a = self._a
        lengths, mtimes = a["length"][m].tolist(), a["mtime"][m].tolist()
        shards, offsets = [self.shards[k] for k in a["shard"][m].tolist()], a["offset"][m].tolist()
        digests = np.asarray(a["sha256"][m]).tobytes().hex()
        out: list[Entry] = []
        f = 0
        for key, is_file in zip(keys, files.tolist(), strict=True):
            parent, _, name = key.rpartition("/")
            if not is_file:
                out.append(Entry(parent, name, True))
                continue
            out.append(Entry(
                parent, name, False, lengths[f], mtimes[f], None, f"sha256:{digests[64 * f : 64 * f + 64]}",
                shards[f], offsets[f], lengths[f],
            ))
            f += 1
        return out

    def find(self, key: str) -> int | None:
        """The entry numbered by `key` (relative to the mount), or None."""
        wanted = key.encode()
        h = np.uint64(xxhash.xxh3_64_intdigest(wanted))
        at = int(np.searchsorted(self._hashes, h))
        while at < len(self._hashes) and self._hashes[at] == h:
            n = int(self._by_hash[at])
            if self._key(n) == wanted:
                return n
            at += 1
        return None

    def lookup(self, parent: str, name: str) -> Entry | None:
        n = self.find(f"{parent}/{name}" if parent else name)
        return None if n is None else self.entry(n)

    def _range(self, directory: str) -> tuple[int, int]:
        if directory == "":
            return self.meta.root
        n = self.find(directory)
        if n is None or self._member[n] >= 0:
            return (0, 0)
        start, end = self._children[n]
        return int(start), int(end)

    def listdir(self, parent: str) -> list[Entry]:
        """Entries directly under `parent`, sorted by name."""
        start, end = self._range(parent)
        return self.entries(np.arange(start, end, dtype=np.int64))

    def files_under(self, prefix: str) -> np.ndarray:
        """Entry numbers of the files under directory `prefix` ('' for all), in (parent, name) order."""
        if prefix == "":
            spans = [(0, len(self))]
        else:  # its own entries, then every entry whose parent lies in [prefix/, prefix0)
            parents = _Parents(self)
            spans = [self._range(prefix), (bisect.bisect_left(parents, prefix + "/"), bisect.bisect_left(parents, prefix + "0"))]
        found = [start + np.flatnonzero(self._member[start:end] >= 0) for start, end in spans if end > start]
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def walk(self, prefix: str) -> Iterator[Entry]:
        """Files under directory `prefix` ('' for all), ordered by (parent, name)."""
        files = self.files_under(prefix)
        for chunk in range(0, len(files), WALK_CHUNK):
            yield from self.entries(files[chunk : chunk + WALK_CHUNK])

    def columns(self, files: np.ndarray, prefix: bytes) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(paths as one UTF-8 buffer, their end offsets, sizes, shard numbers, offsets in the
        shard) of the files numbered `files`, each path `prefix` + its key: a dataset's index
        of a million members without a Python object each."""
        starts, ends = self._starts[files], self._starts[files + 1]
        lengths = ends - starts
        out_ends = np.cumsum(lengths + len(prefix))
        total = int(out_ends[-1]) if len(files) else 0
        out = np.empty(total, dtype=np.uint8)
        begins = out_ends - lengths  # where each key goes, after its prefix
        for k, byte in enumerate(prefix):
            out[begins - len(prefix) + k] = byte
        within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[np.repeat(begins, lengths) + within] = self._blob[np.repeat(starts, lengths) + within]
        rows = self._member[files]
        a = self._a
        sizes, shards, offsets = (a[name][rows].astype(np.int64) for name in ("length", "shard", "offset"))
        return out.tobytes(), out_ends, sizes, shards, offsets

    def file_hashes(self) -> tuple[np.ndarray, np.ndarray]:
        """(xxh3-64 of each file's key, its member row), sorted by hash: what `changes` compares."""
        rows = np.asarray(self._member)[np.asarray(self._by_hash)]
        files = rows >= 0
        return np.asarray(self._hashes)[files], rows[files]

    def changes(self, old: MemberTable) -> tuple[int, int, int]:
        """(added, changed, removed) files from `old` to this table: by key, a file changes when
        its length or sha256 does."""
        new_keys, new_rows = self.file_hashes()
        old_keys, old_rows = old.file_hashes()
        _, new_at, old_at = np.intersect1d(new_keys, old_keys, return_indices=True)
        a, b = new_rows[new_at], old_rows[old_at]
        differ = (np.asarray(self._a["length"])[a] != np.asarray(old._a["length"])[b]) | np.any(
            np.asarray(self._a["sha256"])[a] != np.asarray(old._a["sha256"])[b], axis=1
        )
        kept = len(new_at)
        return len(new_keys) - kept, int(differ.sum()), len(old_keys) - kept


class _Parents(Sequence[str]):
    """The parent of each entry, in entry order: what `bisect` searches for a subtree."""

    def __init__(self, table: MemberTable) -> None:
        self._table = table

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, n: int) -> str:  # type: ignore[override]
        return self._table._key(n).decode().rpartition("/")[0]
