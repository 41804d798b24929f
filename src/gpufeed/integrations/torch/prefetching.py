"""A prefetcher that belongs to the process iterating: made there on first use, never at
construction, and never carried into a forked or unpickled copy (its thread and agent
connection would not work there). One per sampler or dataset, so ending one iteration cancels
only that iteration's prefetch."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import gpufeed
from gpufeed.prefetch import Prefetcher, Read

T = TypeVar("T")


def _close_in(prefetcher: Prefetcher, pid: int) -> None:
    """Stop the prefetcher's thread when its owner is gone, only in the process that made it:
    a forked copy of the owner must not talk to the agent over its parent's connection."""
    if os.getpid() == pid:
        prefetcher.close()


class ProcessPrefetcher:
    def __init__(self) -> None:
        self._pid = -1
        self._prefetcher: Prefetcher | None = None

    def ahead(self, items: Iterable[T], read_of: Callable[[T], Read | None]) -> Iterator[T]:
        """`items` unchanged and in order, with the blocks of upcoming reads fetched ahead."""
        if self._prefetcher is None or self._pid != os.getpid():
            self._prefetcher, self._pid = Prefetcher(gpufeed.client()), os.getpid()
            weakref.finalize(self, _close_in, self._prefetcher, self._pid).atexit = False
        return self._prefetcher.ahead(items, read_of)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
