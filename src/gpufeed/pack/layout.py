"""Names: where a pack keeps its index and shards, and where a packed mount's manifest records
the objects its members lie in. Light on purpose: the namespace imports it on every read."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING
from urllib.parse import quote

if TYPE_CHECKING:
    from gpufeed.sources.base import ObjectInfo

DIR = ".gpufeed-pack"
"""Reserved directory at the root of a pack and of a packed mount's manifest; `ls` and `walk`
of the mount hide it."""
INDEX_KEY = f"{DIR}/index"
SHARDS_DIR = f"{DIR}/shards"
OBJECTS_DIR = f"{DIR}/objects"
"""Manifest directory of a packed mount holding one entry per shard (a pack's shard, a
WebDataset tar, an MDS shard, a LitData chunk): its size and version, which every member read
is pinned to."""

FORMATS = ("auto", "files", "gpufeed-pack", "webdataset", "mds", "litdata")
"""Mount option `format`: auto finds a gpufeed pack index, else plain files."""


def object_entry(key: str) -> tuple[str, str]:
    """(parent, name) of the manifest entry recording the object `key` (a shard) of a packed mount."""
    return OBJECTS_DIR, quote(key, safe="")


def shard_row(info: ObjectInfo) -> ObjectInfo:
    """The manifest row recording the object `info` (a shard) of a packed mount."""
    parent, name = object_entry(info.key)
    return replace(info, key=f"{parent}/{name}")


def hidden(parent: str) -> bool:
    """Whether manifest entries under `parent` belong to the reserved directory."""
    return parent == DIR or parent.startswith(DIR + "/")
