"""Block files a reading process keeps open and mapped between hits, and the count that tells
it when to let go.

A warm 100 KB hit that opens, preads and closes its block file runs at about 0.7 of a plain
open+pread+close of the same bytes; one that copies out of a mapping its process holds, at
about 0.9 (benchmarks/cache_read_bench.py). So a process keeps the files it read mapped
(`OpenBlocks`, one per cache per process): a hit copies the bytes out of the page cache with
no system call but one fstat, and verifies the copy. The mapping never leaves the read path:
what readers get is a bytes object of its own.

Block files never change once published, so a held file always has the right bytes, even
after the agent deleted it; but a deleted file's disk space is freed only when the last holder
lets go. The agent therefore counts its deletions (eviction, `cache clear`, repair) in a small
file, `DELETIONS`, and a reader that sees the count move lets go of everything it holds: when
it is about to hold another file, and every few dozen hits. A process that stops reading keeps
its files (at most `capacity` and HELD_BYTES) until it reads again or exits; a forked child
lets go of its copies at once.

What mapping costs, as for any memory-mapped data: the pages a reader touched count in its RSS
(they are the shared page cache, not extra memory), and a file truncated behind gpufeed's back
during the copy would fault (SIGBUS). gpufeed never truncates a published block, and every
read checks the file's size before it touches the mapping, so a block damaged between reads
is a CorruptBlock, repaired. `GPUFEED_OPEN_BLOCKS=0` holds and maps nothing: every hit is an
open, two preads and a close.
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
import weakref
from pathlib import Path

HELD_BYTES = 1 << 30
"""Most bytes of block files one process holds per cache: what a process that stopped reading
can keep of deleted blocks' disk space."""
SEEN_FILES = 1 << 16
"""Files read once that a process remembers, to hold them when read again."""
DELETIONS = "deletions"
"""File in the primary cache dir: the number of times the agent deleted block files, 8 bytes."""


class DeletionCounter:
    """The deletion count, read and written with pread/pwrite: a write to a full copy-on-write
    disk then fails with an error instead of a mapped page faulting with SIGBUS."""

    def __init__(self, path: Path, fd: int, value: int) -> None:
        self.path = path
        self._fd = fd
        self.value = value

    @classmethod
    def create(cls, primary: Path) -> DeletionCounter | None:
        """The agent's counter, kept from its last run; None when the cache dir cannot hold it
        (then no file is left behind, and readers hold nothing)."""
        path = primary / DELETIONS
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return None
        data = os.pread(fd, 8, 0)
        if len(data) == 8:
            return cls(path, fd, int.from_bytes(data, "little"))
        counter = cls(path, fd, 0)
        return counter if counter.bump() else None

    @classmethod
    def watch(cls, primary: Path) -> DeletionCounter | None:
        """A reader's view; None when there is no count to watch."""
        try:
            fd = os.open(primary / DELETIONS, os.O_RDONLY)
        except OSError:
            return None
        counter = cls(primary / DELETIONS, fd, 0)
        value = counter.read()
        if value is None:
            counter.close()
            return None
        counter.value = value
        return counter

    def read(self) -> int | None:
        """The count now; None once the file is gone (the cache dir was wiped, or the agent
        could not write it and removed it)."""
        data = os.pread(self._fd, 8, 0)
        if len(data) != 8 or os.fstat(self._fd).st_nlink == 0:
            return None
        return int.from_bytes(data, "little")

    def bump(self) -> bool:
        """Count one more deletion; False when the count cannot be written, and then the file is
        removed, which tells readers to stop holding files."""
        try:
            os.pwrite(self._fd, (self.value + 1).to_bytes(8, "little"), 0)
        except OSError:
            self.path.unlink(missing_ok=True)
            self.close()
            return False
        self.value += 1
        return True

    def close(self) -> None:
        os.close(self._fd)


class Held:
    """One held block file, mapped whole. The mapping keeps a descriptor of its own until the
    last reference goes, so a thread in the middle of a read keeps it although another thread
    let it go."""

    __slots__ = ("map", "mapped", "checksum")

    def __init__(self, mapped: mmap.mmap) -> None:
        self.map = mapped
        """Its `size()` is the file's size now (an fstat), checked before the mapping is touched."""
        self.mapped = memoryview(mapped)
        """What hits copy from (and verify in place, for big blocks)."""
        self.checksum: int | None = None
        """A one-chunk block's checksum, once a read has checked its header: the file never
        changes, so later reads verify their data against it and skip the header (a header
        damaged since changes no data byte)."""


def capacity_for(wanted: int) -> int:
    """`wanted`, but at most a quarter of this process's open-file limit: the rest belongs to
    the program (DataLoader workers share tensors through file descriptors)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(0, min(wanted, soft // 4)) if soft != resource.RLIM_INFINITY else max(0, wanted)


class OpenBlocks:
    """Up to `capacity` open block files of one cache and at most HELD_BYTES of them, the first
    ones read twice. Nothing is held without the agent's deletion count: a held file could keep
    deleted blocks' space.

    A file is held from its second read on: mapping costs more than one pread, so it pays only
    for a file read again by the same process. A read that missed (the block was not cached yet)
    does not count, so a cold epoch maps nothing: its reads are first reads, and a DataLoader
    worker that reads each sample once an epoch and exits (no persistent workers), or a FUSE
    daemon whose files the kernel then keeps in its page cache, never reads them again.

    A hit looks its file up in `held` itself and calls `open` when it is not held; the reader
    calls `check` every few dozen hits, and a miss (the agent may have deleted blocks) at once.
    So a hit makes no extra system call."""

    def __init__(self, primary: Path, capacity: int) -> None:
        self._counter = DeletionCounter.watch(primary)
        self.capacity = capacity if self._counter is not None else 0
        self.held: dict[str, Held] = {}
        """Path → open file. Keep a looked-up `Held` referenced while reading from it."""
        self._bytes = 0
        self._seen: set[str] = set()
        """Files read once and not held: held when read again."""
        self._full = False
        """HELD_BYTES reached: hold no more until letting go."""
        self._lock = threading.Lock()
        self._checking = threading.Lock()

    def open(self, path: str) -> Held | None:
        """The file at `path` held and mapped (FileNotFoundError on a miss), or None when it is
        not held: its first read, or no room. The caller then reads it with open, pread and
        close, and calls `check` if the file is missing. Nothing held is let go to make room:
        when the files read exceed what a process may hold (random samples of a big dataset),
        swapping them would map, fault in and unmap a file per read, dearer than the pread a
        file not held gets."""
        if self._full or len(self.held) >= self.capacity:
            return None
        if path not in self._seen:
            return None  # a first read: `read_unheld` marks it once it found the file
        self.check()
        if len(self.held) >= self.capacity:
            return None
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.lseek(fd, 0, os.SEEK_END)
            if self._bytes + size > HELD_BYTES:
                self._full = True
                return None
            if not size:  # an empty (damaged) file cannot be mapped
                return None
            held = Held(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
        finally:
            os.close(fd)
        with self._lock:
            if len(self.held) < self.capacity:
                self.held[path] = held
                self._bytes += size
        return held

    def read_unheld(self, path: str) -> None:
        """`path` was read without being held: its next read holds it, if there is room."""
        if self._full or len(self.held) >= self.capacity:
            return
        if len(self._seen) >= SEEN_FILES:
            self._seen.clear()
        self._seen.add(path)

    def check(self) -> None:
        """Let go of every held file if the agent deleted block files since the last look; hold
        nothing from now on if its count is gone. One thread looks at a time; the others go on."""
        if self._counter is None or not self._checking.acquire(blocking=False):
            return
        try:
            counter = self._counter
            value = counter.read() if counter is not None else None
            if counter is None or value == counter.value:
                return
            if value is None:
                self.capacity = 0
                self._counter = None
                counter.close()
            else:
                counter.value = value
        finally:
            self._checking.release()
        self.close()

    def close(self) -> None:
        """Let go of every held file (a thread mid-read keeps its own until done)."""
        with self._lock:
            dropped, self.held, self._bytes, self._full = self.held, {}, 0, False
        dropped.clear()  # closes them, outside the lock: each close may free a file's space

    def forget(self, path: str) -> None:
        """Stop holding `path` (found damaged: a repair replaces it with a new file)."""
        with self._lock:
            held = self.held.pop(path, None)
            if held is not None:
                self._bytes -= len(held.mapped)

    def _after_fork_in_child(self) -> None:
        """The child's copies of the parent's files: close them now, while the numbers are
        still theirs, and start unlocked."""
        self._lock = threading.Lock()
        self._checking = threading.Lock()
        self.held, self._bytes, self._full, self._seen = {}, 0, False, set()


_by_cache: weakref.WeakValueDictionary[Path, OpenBlocks] = weakref.WeakValueDictionary()
_registry = threading.Lock()


def for_cache(primary: Path, wanted: int) -> OpenBlocks:
    """This process's open files of the cache at `primary`: one set however many clients the
    process makes, so the limit is the process's (the first client's setting decides it). It
    lives while a client reads that cache."""
    with _registry:
        files = _by_cache.get(primary)
        if files is None:
            files = _by_cache[primary] = OpenBlocks(primary, capacity_for(wanted))
        return files


def _after_fork_in_child() -> None:
    global _registry
    _registry = threading.Lock()
    for files in list(_by_cache.values()):
        files._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
