"""Exception hierarchy. Every message names what failed and where (mount, path, endpoint),
because the CLI prints it as the only line a user sees."""

from __future__ import annotations


class GpufeedError(Exception):
    """Base of every error gpufeed raises on purpose; `exit_code` is what the CLI returns."""

    exit_code = 1


class InvalidArgument(GpufeedError, ValueError):
    """Malformed user input: bad URL, bad option, bad path."""

    exit_code = 2


class NamespacePathError(GpufeedError):
    """A namespace path that does not exist (no mount, or not in the mount's manifest)."""


class PathNotFound(NamespacePathError, FileNotFoundError):
    pass


class IsADirectory(NamespacePathError, IsADirectoryError):
    pass


class MountError(GpufeedError):
    """Mount table problems: unknown mount, overlapping mounts."""


class MountNotFound(MountError):
    pass


class MountConflict(MountError):
    pass


class MetadataError(GpufeedError):
    """The metadata engine (SQLite file or Redis server) cannot be used."""


class SourceError(GpufeedError):
    """A store failed to answer; the message names the endpoint and key."""


class SourceUnreachable(SourceError, ConnectionError):
    pass


class SourceAuthError(SourceError, PermissionError):
    pass


class ObjectMissing(SourceError, FileNotFoundError):
    """The manifest lists an object the source no longer has."""


class ObjectChanged(SourceError):
    """The source object's version differs from the manifest's; bytes of two versions never mix."""


class ObjectCorrupted(SourceError):
    """The store kept returning bytes that do not match what it (or the manifest) vouches for:
    an ETag's MD5, a store checksum, a content hash. Never delivered, never cached."""
