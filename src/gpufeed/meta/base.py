"""The metadata engine protocol and the records it stores.

A mount's manifest is stored as one *generation*: rows (parent dir, name) → entry. A refresh
writes a new generation beside the old one and then switches the mount record to it in one
write, so readers see the old manifest or the new one, never half of each.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, Protocol

from gpufeed.sources.base import ObjectInfo


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
    """One manifest row. Directories have is_dir=True and no size or version."""

    parent: str
    name: str
    is_dir: bool
    size: int = 0
    mtime: float = 0.0
    etag: str | None = None

    @property
    def key(self) -> str:
        return f"{self.parent}/{self.name}" if self.parent else self.name

    def object_info(self) -> ObjectInfo:
        return ObjectInfo(self.key, self.size, self.mtime, self.etag)

    def same_version(self, other: Entry) -> bool:
        if self.size != other.size or self.etag != other.etag:
            return False
        return self.etag is not None or self.mtime == other.mtime


class MetaEngine(Protocol):
    """Storage for mounts and manifests. One shared test suite runs against every engine."""

    url: str

    def mounts(self) -> list[Mount]: ...

    def commit_mount(self, mount: Mount, *, create: bool) -> None:
        """Insert (create=True, refused with MountConflict if the path exists) or replace."""
        ...

    def delete_mount(self, path: str) -> None: ...

    def new_generation(self) -> int: ...

    def put_entries(self, generation: int, entries: Iterable[Entry]) -> None: ...

    def drop_generation(self, generation: int) -> None: ...

    def lookup(self, generation: int, parent: str, name: str) -> Entry | None: ...

    def listdir(self, generation: int, parent: str) -> list[Entry]:
        """Entries directly under `parent`, sorted by name."""
        ...

    def walk(self, generation: int, prefix: str) -> Iterator[Entry]:
        """Files under directory `prefix` ('' for all), ordered by (parent, name)."""
        ...

    def close(self) -> None: ...
