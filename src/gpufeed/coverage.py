"""How much of each file is in the cache: from the manifest and the block files alone, never
the store. `gpufeed cache ls`, `warmup --dry-run` and the agent's per-mount cached fraction all
count it here, so they agree."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from gpufeed.blocks import object_blocks, overlap
from gpufeed.cache.layout import block_path
from gpufeed.config import Settings
from gpufeed.mount_options import CachePolicy, source_options
from gpufeed.namespace import Namespace
from gpufeed.paths import FileStat


def cached_bytes(namespace: Namespace, settings: Settings, dirs: tuple[Path, ...], path: str) -> Iterator[tuple[FileStat, int]]:
    """(file, bytes of it present in the cache dirs `dirs`) for every file under `path`."""
    for item in namespace.walk(path):
        where = namespace.resolve(item.path)
        assert where is not None and item.version is not None
        policy = CachePolicy.of(where.mount, settings)
        if not policy.enabled:
            yield item, 0
            continue
        mount = where.mount
        info = item.info
        assert info is not None
        lo, hi = 0, info.size
        if info.pack_key is not None:  # a pack member: the part of its shard's blocks it lies in
            lo = info.pack_offset or 0
            hi = lo + info.size
            info = namespace.container(where, info)
        blocks = object_blocks(mount.url, source_options(mount), info, policy.block_size, not mount.immutable)
        present = (i for i in blocks.span(lo, hi) if os.path.exists(block_path(dirs, blocks.block(i))))
        yield item, sum(overlap(blocks.block_size, i, lo, hi) for i in present)


def mount_coverage(namespace: Namespace, settings: Settings, dirs: tuple[Path, ...]) -> dict[str, tuple[int, int]]:
    """Mount path → (bytes in its manifest, bytes of them cached)."""
    covered: dict[str, tuple[int, int]] = {}
    for mount in namespace.mounts(fresh=True):
        total = cached = 0
        for item, present in cached_bytes(namespace, settings, dirs, mount.path):
            total += item.size
            cached += present
        covered[mount.path] = (total, cached)
    return covered
