"""The reading side of the one read path: `reader` (Client: path → handle → hit, agent fetch or
source ranges), `handles` (path → object pinned at its listed version, and its blocks),
`fetches` (what the agent is asked to fetch), `direct` (reads straight from a store), `plan`
(pure: ranges → block pieces), `connection` (the agent socket), `agent_service` (the agent
`agent start` made, started again the same after a crash), `file` (the file object),
`writer` (a file being written: staged for the agent to upload).

The classes below are imported on first use, so a process that only talks to the agent
(`gpufeed.client.connection`: `gpufeed agent status`, `gpufeed cache clear`) does not load the
reader, the namespace and the metadata engines."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpufeed.client.file import FeedFile
    from gpufeed.client.handles import ObjectHandle
    from gpufeed.client.reader import Client
    from gpufeed.client.writer import FeedWriter

_LAZY = {
    "Client": "gpufeed.client.reader",
    "FeedFile": "gpufeed.client.file",
    "FeedWriter": "gpufeed.client.writer",
    "ObjectHandle": "gpufeed.client.handles",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = ["Client", "FeedFile", "FeedWriter", "ObjectHandle"]
