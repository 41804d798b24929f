"""The metadata engine protocol and the records it stores.

A mount's manifest is stored as one *generation*: rows (parent dir, name) → entry. A refresh
writes a new generation beside the old one and then switches the mount record to it in one
write, so readers see the old manifest or the new one, never half of each.

Schema versions (SQLite `PRAGMA user_version`, Redis `{prefix}:schema`):
  1  rows of (parent, name, is_dir, size, mtime, etag); SQLite's user_version was left 0
  2  adds content_hash, pack_key, pack_offset, pack_length (all nullable)
An engine migrates an older database when it opens it, and refuses a newer one.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

import xxhash

from gpufeed.errors import MetadataError
from gpufeed.sources.base import ObjectInfo, same_version

SCHEMA_VERSION = 2


def newer_schema(where: str, found: int) -> MetadataError:
    return MetadataError(
        f"{where}: metadata schema version {found} is newer than this gpufeed knows ({SCHEMA_VERSION}); upgrade gpufeed"
    )


@dataclass(frozen=True)
class Mount:
    """A source mounted at a namespace path. `generation` names its current manifest."""

    path: str
    url: str
    options: dict[str, str] = field(default_factory=dict)
    immutable: bool = False
    max_age: float | None = None
    generation: int = 0
    listed_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> Mount:
        return cls(**json.loads(raw))


class Entry(NamedTuple):
    """One manifest row: where it sits (parent, name), whether it is a directory, then the
    fields of the object's `ObjectInfo`. A thin tuple because a mount writes millions of them;
    `of` and `object_info` are the one place rows and ObjectInfo convert. Directories have a
    true is_dir (SQLite gives 1) and no size or version."""

    parent: str
    name: str
    is_dir: bool
    size: int = 0
    mtime: float = 0.0
    etag: str | None = None
    content_hash: str | None = None
    pack_key: str | None = None
    pack_offset: int | None = None
    pack_length: int | None = None

    @classmethod
    def of(cls, info: ObjectInfo) -> Entry:
        parent, _, name = info.key.rpartition("/")
        return cls(
            parent, name, False, info.size, info.mtime, info.etag,
            info.content_hash, info.pack_key, info.pack_offset, info.pack_length,
        )

    @property
    def key(self) -> str:
        return f"{self.parent}/{self.name}" if self.parent else self.name

    @property
    def entry_id(self) -> int:
        """Stable id of the entry: xxh3-64 of its key (relative to the mount's source root).
        A pure function of the key, so it is the same in every generation (a refresh keeps it
        for an unchanged key), on every engine and every node, and needs no column."""
        return xxhash.xxh3_64_intdigest(self.key.encode())

    def object_info(self) -> ObjectInfo:
        return ObjectInfo(
            self.key, self.size, self.mtime, self.etag,
            self.content_hash, self.pack_key, self.pack_offset, self.pack_length,
        )

    def same_version(self, other: Entry) -> bool:
        """Whether two rows describe one version (`sources.base.same_version`): the version a
        first open pinned, or an ETag a HEAD added, is not a change."""
        return same_version(self.object_info(), other.object_info())


class MetaEngine(Protocol):
    """Storage for mounts and manifests. One shared test suite runs against every engine."""

    url: str

    def mounts(self) -> list[Mount]: ...

    def check_writable(self) -> None:
        """Raise MetadataError (naming where and why) when the engine is known to refuse writes,
        so a writing command fails before it lists a store or hashes a dataset."""
        ...

    def commit_mount(self, mount: Mount, *, previous: int | None) -> None:
        """Insert the mount (previous=None; MountConflict if the path exists) or switch it to a
        new generation only while it still has generation `previous` (MountConflict if another
        process removed or refreshed it meanwhile): a refresh never resurrects a removed mount."""
        ...

    def delete_mount(self, path: str) -> None: ...

    def new_generation(self) -> int: ...

    def put_entries(self, generation: int, entries: Iterable[Entry]) -> None: ...

    def delete_entry(self, generation: int, parent: str, name: str) -> None:
        """Remove one file entry (an object deleted through gpufeed); its directories stay."""
        ...

    def drop_generation(self, generation: int) -> None: ...

    def lookup(self, generation: int, parent: str, name: str) -> Entry | None: ...

    def lookup_many(self, generation: int, parent: str, names: Sequence[str]) -> dict[str, Entry]:
        """The entries of `names` under `parent` that exist, by name: a batch of files of one
        directory in one round trip instead of one each."""
        ...

    def listdir(self, generation: int, parent: str) -> list[Entry]:
        """Entries directly under `parent`, sorted by name."""
        ...

    def walk(self, generation: int, prefix: str) -> Iterator[Entry]:
        """Files under directory `prefix` ('' for all), ordered by (parent, name)."""
        ...

    def close(self) -> None: ...


EngineT = TypeVar("EngineT")


def engine_errors(*error_types: type[BaseException]) -> Callable[[type[EngineT]], type[EngineT]]:
    """Class decorator: a driver error in any public method (or while iterating a generator
    method) becomes a MetadataError naming the engine's URL, so users see one clear line."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isgeneratorfunction(method):

            @functools.wraps(method)
            def generator(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
                try:
                    yield from method(self, *args, **kwargs)
                except error_types as exc:
                    raise MetadataError(f"metadata engine {self.url}: {exc}") from exc

            return generator

        @functools.wraps(method)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except error_types as exc:
                raise MetadataError(f"metadata engine {self.url}: {exc}") from exc

        return call

    def decorate(cls: type[EngineT]) -> type[EngineT]:
        for name, member in list(vars(cls).items()):
            if inspect.isfunction(member) and not name.startswith("_"):
                setattr(cls, name, wrap(member))
        return cls

    return decorate
