"""The cache dirs' contents: which blocks are there, the quota, eviction and repair.

All state is rebuilt from the cache dirs at start (`scan`), so a `kill -9` leaves nothing the
next agent has to trust. Blocks are only ever removed here, and every removal is counted in
the deletion count readers watch to let go of files they hold (`cache.openfiles`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpufeed.agent.metrics import Metrics
from gpufeed.blocks import BlockId
from gpufeed.cache import blockfile
from gpufeed.cache.eviction import S3Fifo
from gpufeed.cache.layout import block_path
from gpufeed.cache.openfiles import DeletionCounter

log = logging.getLogger("gpufeed.agent")

HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.85
FULL_BACKOFF_S = 5.0
"""After a write failed for lack of space, how long blocks are served uncached before trying again."""
DISK_CHECK_S = 2.0
"""How often the agent asks the cache filesystems for free space; in between, its own
publishes and evictions are what changes."""
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
INLINE_PUBLISH = 256 * 1024
"""Blocks up to this size are written on the event loop: checksumming and writing 100 KB takes
less than handing it to a thread and waking the loop when the thread is done (measured:
benchmarks/epochs.py, agent CPU per cold object); bigger ones go to a thread."""
_BLOCK_NAME = re.compile(r"[0-9a-f]{32}-\d+")


@dataclass(frozen=True)
class AgentConfig:
    dirs: tuple[Path, ...]
    cache_size: int
    free_ratio: float
    idle_timeout: float | None

    @property
    def primary(self) -> Path:
        return self.dirs[0]


class CacheManager:
    def __init__(self, config: AgentConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.policy = S3Fifo()
        self.sizes: dict[str, int] = {}
        self.protected: Callable[[], frozenset[str]] = frozenset
        """Names eviction must skip (blocks being fetched, pinned blocks); set by the agent."""
        self.full_until = 0.0
        self._warned_full = False
        self.deletions = DeletionCounter.create(config.primary)
        """The count readers watch to let go of deleted block files; None when the cache dir
        cannot hold it (full), and then readers hold none."""
        self._disk_cap = 0
        self._disk_checked = -DISK_CHECK_S

    def scan(self) -> None:
        """Rebuild the index from the block files; drop temp files a crashed agent left."""
        for root in self.config.dirs:
            shutil.rmtree(root / "tmp", ignore_errors=True)
            (root / "tmp").mkdir(parents=True, exist_ok=True)
            blocks = root / "blocks"
            found: list[tuple[float, str, int]] = []
            if blocks.is_dir():
                for sub in os.scandir(blocks):
                    for entry in os.scandir(sub.path):
                        if not _BLOCK_NAME.fullmatch(entry.name):
                            continue  # not a block (an .nfs file, a stray copy): never indexed, never evicted
                        st = entry.stat()
                        found.append((st.st_mtime, entry.name, st.st_size))
            for _, name, size in sorted(found):
                self.policy.insert(name, size)
                self.sizes[name] = size

    def path(self, block: BlockId) -> str:
        return block_path(self.config.dirs, block)

    def present(self, block: BlockId) -> bool:
        """Whether the block is published; one deleted behind the agent's back is forgotten."""
        if block.name not in self.policy:
            return False
        if os.path.exists(self.path(block)):
            return True
        self.forget(block.name)
        return False

    def limit(self) -> int:
        """The quota, bounded by what the cache filesystems can hold while keeping free_ratio
        of each free. The disk is asked at most every DISK_CHECK_S: right after an eviction,
        readers may still hold the evicted files (`cache.openfiles`), and a disk that does
        not show their space free yet must not make every publish evict again."""
        now = time.monotonic()
        if now - self._disk_checked >= DISK_CHECK_S:
            room = 0.0
            for device in {os.stat(d).st_dev: d for d in self.config.dirs}.values():
                st = os.statvfs(device)
                room += st.f_bavail * st.f_frsize - self.config.free_ratio * st.f_blocks * st.f_frsize
            self._disk_cap = int(self.policy.bytes + room)
            self._disk_checked = now
        return max(0, min(self.config.cache_size, self._disk_cap))

    def can_hold(self, length: int) -> bool:
        """False while the disk was found full moments ago, or when one block exceeds the room."""
        return time.monotonic() >= self.full_until and length <= self.limit()

    async def publish(self, block: BlockId, data: memoryview, copy: bool = False, listed: bytes | None = None) -> bool:
        """Write a verified block into the cache; False when the disk cannot hold it (then the
        reader is served uncached, warned once, and the cache shrinks to what fits). A `copy`
        (of a block another cluster node owns) is evicted before any other block. `listed`: the
        chunk sums the block must have (`blockfile.publish`), checked as its header is made."""
        path = self.path(block)
        for attempt in range(2):
            try:
                if len(data) <= INLINE_PUBLISH:
                    written = blockfile.publish(path, block, data, listed)
                else:
                    written = await asyncio.to_thread(blockfile.publish, path, block, data, listed)
                break
            except OSError as exc:
                full = exc.errno in FULL_ERRNOS
                if full and attempt == 0 and self.evict_to(max(0, self.policy.bytes - 4 * len(data))):
                    continue
                if full:
                    self.full_until = time.monotonic() + FULL_BACKOFF_S
                    self._disk_checked = -DISK_CHECK_S  # ask the disk again: the quota follows what fits
                if not self._warned_full:
                    where = os.path.dirname(path)
                    log.warning("cannot write blocks to %s (%s): serving reads uncached", where, exc.strerror or exc)
                    self._warned_full = True
                self.metrics.count("uncached")
                return False
        self.policy.insert(block.name, written, copy)
        self.sizes[block.name] = written
        limit = self.limit()
        if self.policy.bytes > HIGH_WATERMARK * limit:
            self.evict_to(int(LOW_WATERMARK * limit))
        return True

    def meet_quota(self) -> int:
        """Evict down to a quota lowered since the last agent, oldest first; returns the bytes
        freed. Only the quota counts here: a disk that other data filled leaves the cache as it
        is, serving hits (new blocks then go uncached), as it did before the restart."""
        if self.policy.bytes <= self.config.cache_size:
            return 0
        return self.evict_to(int(LOW_WATERMARK * self.config.cache_size))

    def discard(self, block: BlockId) -> None:
        """Remove a block a reader found damaged, before it is fetched again."""
        _unlink(self.path(block))
        self._deleted()
        self.forget(block.name)
        self.metrics.count("repairs")

    def forget(self, name: str) -> None:
        self.policy.remove(name)
        self.sizes.pop(name, None)

    def evict_to(self, goal: int, *, counted: bool = True) -> int:
        """Unlink the coldest blocks until the cache holds `goal` bytes; each is an eviction in
        the metrics unless a user asked for it (`cache clear`)."""
        freed = 0
        victims = self.policy.victims(goal, self.protected())
        for name in victims:
            _unlink(self.path(BlockId.parse(name)))
            freed += self.sizes.pop(name, 0)
        if counted:
            self.metrics.count("evictions", len(victims))
        if victims:
            self._deleted()
        return freed

    def _deleted(self) -> None:
        """Tell readers that block files are gone, after the unlinks, so they close the ones
        they hold and the space is freed (`cache.openfiles`)."""
        if self.deletions is not None and not self.deletions.bump():
            self.deletions = None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
