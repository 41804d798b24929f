"""Namespace paths: how a path is made canonical before it is resolved (so it cannot escape
its mount), what a lookup answers, and the one-line error for an object the store changed since
its mount was listed. Shared by the namespace and the readers, writers and tools that take its
answers."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

from gpufeed.errors import InvalidArgument
from gpufeed.meta import Mount
from gpufeed.meta.base import Entry
from gpufeed.sources.base import ObjectInfo


@dataclass(frozen=True, slots=True)
class FileStat:
    """What `stat` and `ls` report for a namespace path: the path and, for a file, the object
    as the manifest records it (`info.key` is relative to the mount's source root)."""

    path: str
    is_dir: bool
    info: ObjectInfo | None = None

    @property
    def size(self) -> int:
        return self.info.size if self.info is not None else 0

    @property
    def mtime(self) -> float:
        return self.info.mtime if self.info is not None else 0.0

    @property
    def etag(self) -> str | None:
        return self.info.etag if self.info is not None else None

    @property
    def content_hash(self) -> str | None:
        return self.info.content_hash if self.info is not None else None

    @property
    def version(self) -> str | None:
        return self.info.version if self.info is not None else None

    @classmethod
    def of(cls, path: str, entry: Entry) -> FileStat:
        return cls(path, True) if entry.is_dir else cls(path, False, entry.object_info())


@dataclass(frozen=True, slots=True)
class Resolved:
    """A path inside a mount: `key` is relative to the mount's source root ('' for the root)."""

    mount: Mount
    key: str

    @property
    def split(self) -> tuple[str, str]:
        parent, _, name = self.key.rpartition("/")
        return parent, name


def normalize(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidArgument(f"{path!r}: namespace paths are absolute, e.g. /data/train/0001.jpg")
    if "\0" in path:
        raise InvalidArgument(f"{path!r}: path contains a NUL byte")
    if not path.isascii():
        try:
            path.encode()
        except UnicodeEncodeError:  # a name the shell passed as bytes that are not UTF-8 (or a lone surrogate)
            raise InvalidArgument(f"{printable(path)}: not valid UTF-8; namespace paths, like keys, are UTF-8 text") from None
    clean = posixpath.normpath(path)
    return "/" + clean.lstrip("/")


_SAID = (": the object changed at the source since it was listed", ": not found at the source")
"""What a source's own error says that `since_listed` says already."""


def printable(path: str) -> str:
    """`path` printable: bytes that are not UTF-8, passed undecoded (a shell's argument, a file
    name), as \\xff; other lone surrogates as \\ud800."""
    try:
        return path.encode(errors="surrogateescape").decode(errors="backslashreplace")
    except UnicodeEncodeError:
        return path.encode(errors="backslashreplace").decode()


def since_listed(path: str, what: str, mount: str, detail: str) -> str:
    """The one-line error for an object `what` ("deleted", "changed") under the manifest of
    `mount`, with the way out; `detail` is the source's error about it."""
    for said in _SAID:
        detail = detail.replace(said, "")
    return f"{path}: {what} at the source since mount {mount} was listed ({detail}); run 'gpufeed mount refresh {mount}'"
