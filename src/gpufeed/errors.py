"""Exception hierarchy. Every message names what failed and where (mount, path, endpoint),
because the CLI prints it as the only line a user sees. Each class has a stable `code`: the
agent reports errors by code, and readers raise the same class again (`from_code`)."""

from __future__ import annotations


class GpufeedError(Exception):
    """Base of every error gpufeed raises on purpose; `exit_code` is what the CLI returns."""

    exit_code = 1
    code = "error"


class InvalidArgument(GpufeedError, ValueError):
    """Malformed user input: bad URL, bad option, bad path."""

    exit_code = 2
    code = "invalid_argument"


class NamespacePathError(GpufeedError):
    """A namespace path that does not exist (no mount, or not in the mount's manifest)."""

    code = "namespace_path"


class PathNotFound(NamespacePathError, FileNotFoundError):
    code = "path_not_found"


class IsADirectory(NamespacePathError, IsADirectoryError):
    code = "is_a_directory"


class NotADirectory(NamespacePathError, NotADirectoryError):
    """A file's path written as a directory's (`/data/README/`), refused as POSIX does."""

    code = "not_a_directory"


class MountError(GpufeedError):
    """Mount table problems: unknown mount, overlapping mounts."""

    code = "mount"


class MountNotFound(MountError):
    code = "mount_not_found"


class MountConflict(MountError):
    code = "mount_conflict"


class MetadataError(GpufeedError):
    """The metadata engine (SQLite file or Redis server) cannot be used."""

    code = "metadata"


class SourceError(GpufeedError):
    """A store failed to answer; the message names the endpoint and key."""

    code = "source"


class SourceUnreachable(SourceError, ConnectionError):
    code = "source_unreachable"


class SourceDown(SourceUnreachable):
    """Not tried: a call found the store unreachable through all its retries moments ago
    (`sources.retry`); a caller that counts its own tries (an upload) does not count this one."""


class NoDirectoryIndex(SourceError):
    """An HTTP server answers a directory's URL with no JSON index (an HTML page, a 4xx other than
    404, which is PathNotFound): a static host. What needs no listing (a pack, whose index names
    its shards) reads on."""


class SourceAuthError(SourceError, PermissionError):
    code = "source_auth"


class ObjectMissing(SourceError, FileNotFoundError):
    """The manifest lists an object the source no longer has."""

    code = "object_missing"


class ObjectChanged(SourceError):
    """The source object's version differs from the manifest's; bytes of two versions never mix."""

    code = "object_changed"


class ObjectCorrupted(SourceError):
    """The store kept returning bytes that do not match what it (or the manifest) vouches for:
    an ETag's MD5, a store checksum, a content hash. Never delivered, never cached."""

    code = "object_corrupted"


class PackError(GpufeedError):
    """A pack that cannot be written or read: an empty input, a corrupt or incomplete index."""

    code = "pack"


class ReadOnlyMount(GpufeedError, PermissionError):
    """A write to a mount not marked writable (`mount add --writable`), or to a packed mount."""

    code = "read_only_mount"


class WriteError(GpufeedError):
    """A write that cannot be staged or uploaded: a full staging disk, a store that refuses it."""

    code = "write"


class NotCached(GpufeedError):
    """A warmup whose blocks the node cache did not take (no agent, a full cache): reads of
    them go to the store."""

    code = "not_cached"


class PoolError(GpufeedError):
    """The GPU pool cannot serve: no Ray cluster, no Ray installed, a lease lost or reclaimed."""

    code = "pool"


def _codes(cls: type[GpufeedError]) -> dict[str, type[GpufeedError]]:
    """Code → the class that defines it: a subclass that only inherits its parent's code (the
    torch index's IndexOutOfRange, an InvalidArgument) never takes the code over."""
    found = {cls.code: cls} if "code" in cls.__dict__ else {}
    for sub in cls.__subclasses__():
        found.update(_codes(sub))
    return found


def from_code(code: str, message: str) -> GpufeedError:
    """The error a code names (SourceError for a code this release does not know)."""
    return _codes(GpufeedError).get(code, SourceError)(message)
