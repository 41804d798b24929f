"""gpufeed: one namespace over every store, read through one path.

    import gpufeed
    with gpufeed.open("/data/train/0001.jpg", "rb") as f:
        header = f.read(16)

Importing gpufeed is cheap on purpose (a DataLoader worker, a CLI `--help`, a script that only
wants `gpufeed.errors`): the client, and with it obstore, aiohttp, numpy and redis, is imported
on first use; torch, matplotlib and the CLI only by the modules that need them.
"""

from __future__ import annotations

import os
import sys
import types

TYPE_CHECKING = False  # typing costs an import; type checkers treat this name as True
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Literal, overload

    from gpufeed import logs
    from gpufeed.client import Client, FeedFile, FeedWriter
    from gpufeed.errors import GpufeedError
    from gpufeed.paths import FileStat
else:

    def overload(function: object) -> object:  # typing's, without importing typing at run time
        return function

_LAZY = {
    "Client": "gpufeed.client",
    "FeedFile": "gpufeed.client",
    "FeedWriter": "gpufeed.client",
    "FileStat": "gpufeed.namespace",
    "GpufeedError": "gpufeed.errors",
}

_default: Client | None = None
_default_pid = -1


class _Package(types.ModuleType):
    """The package module. Importing the submodule `gpufeed.client` would set the attribute
    `gpufeed.client` to that module, hiding the function `gpufeed.client()` for the rest of the
    process; eagerly importing it first used to prevent that, lazily we refuse the overwrite."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "client" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


_SUBMODULES = ("logs",)
"""Submodules reachable as attributes once `gpufeed` is imported: `gpufeed.logs.Appender(...)`."""


def __getattr__(name: str) -> object:
    """`gpufeed.Client` and friends, imported on first access (PEP 562)."""
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpufeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, *_SUBMODULES})


def client() -> Client:
    """The process-wide client, built from the environment on first use (and again after fork)."""
    global _default, _default_pid
    if _default is None or _default_pid != os.getpid():
        from gpufeed.client import Client

        _default, _default_pid = Client(), os.getpid()
    return _default


@overload
def open(path: str | os.PathLike[str], mode: Literal["rb", "br"] = "rb") -> FeedFile: ...  # noqa: A001
@overload
def open(path: str | os.PathLike[str], mode: Literal["wb", "bw"], *, sync: bool = False) -> FeedWriter: ...  # noqa: A001, F811
def open(path: str | os.PathLike[str], mode: str = "rb", *, sync: bool = False) -> FeedFile | FeedWriter:  # noqa: A001, F811
    """`rb`: a seekable read-only binary file. `wb`: a new version of a file in a writable mount
    (`mount add --writable`), readable on this node once closed and uploaded in the background;
    `sync=True` makes `close()` wait for the upload."""
    return client().open(path, mode, sync=sync)


def write(path: str | os.PathLike[str], data: bytes | bytearray | memoryview, *, sync: bool = False) -> None:
    """Write `path` whole (`open(path, "wb")` for a file written piece by piece)."""
    client().write(path, data, sync=sync)


def sync(path: str | os.PathLike[str] = "/") -> int:
    """Wait until this node's writes under `path` are in their stores; how many were waited for."""
    return client().sync(path)


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a file of a writable mount from its store and the manifest."""
    client().remove(path)


def read(path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> bytes:
    """`length` bytes (all to the end when None) from `offset`."""
    return client().read(path, offset, length)


def ls(path: str | os.PathLike[str]) -> list[FileStat]:
    return client().ls(path)


def stat(path: str | os.PathLike[str]) -> FileStat:
    return client().stat(path)


def walk(path: str | os.PathLike[str]) -> Iterator[FileStat]:
    return client().walk(path)


__all__ = [
    "Client", "FeedFile", "FeedWriter", "FileStat", "GpufeedError", "client", "logs", "ls", "open", "read", "remove", "stat",
    "sync", "walk", "write",
]
