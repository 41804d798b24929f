"""gpufeed: one namespace over every store, read through one path.

    import gpufeed
    with gpufeed.open("/data/train/0001.jpg") as f:
        header = f.read(16)
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from gpufeed.client import Client, FeedFile
from gpufeed.errors import GpufeedError
from gpufeed.namespace import FileStat

_default: Client | None = None
_default_pid = -1


def client() -> Client:
    """The process-wide client, built from the environment on first use (and again after fork)."""
    global _default, _default_pid
    if _default is None or _default_pid != os.getpid():
        _default, _default_pid = Client(), os.getpid()
    return _default


def open(path: str) -> FeedFile:  # noqa: A001 - mirrors the builtin on purpose
    return client().open(path)


def read(path: str, offset: int = 0, length: int | None = None) -> bytes:
    return client().read(path, offset, length)


def ls(path: str) -> list[FileStat]:
    return client().ls(path)


def stat(path: str) -> FileStat:
    return client().stat(path)


def walk(path: str) -> Iterator[FileStat]:
    return client().walk(path)


__all__ = ["Client", "FeedFile", "FileStat", "GpufeedError", "client", "ls", "open", "read", "stat", "walk"]
