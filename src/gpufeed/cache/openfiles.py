"""Block files a reader keeps open between hits, and the counter that tells it when to let go.

Opening and closing a block file costs more than a tenth of a warm 100 KB hit, so a process
keeps the files it read open (`OpenBlocks`). Block files never change once published, so a
held file always has the right bytes, even after the agent deleted it; but a deleted file's
disk space is freed only when the last holder closes it. The agent therefore counts its
deletions (eviction, `cache clear`, repair) in a small shared file, `DELETIONS`, and a
reader that sees the count move closes everything it holds at its next hit. A process that
stops reading keeps its files (at most `capacity`) until it reads again or exits.
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
from pathlib import Path

DELETIONS = "deletions"
"""File in the primary cache dir: 8 bytes, the number of times the agent deleted block files."""


def deletion_counter(primary: Path, *, writable: bool) -> memoryview | None:
    """The shared deletion count as a one-element memoryview of an unsigned 64-bit integer,
    or None when the file cannot be had (the agent: a full disk; a reader: no agent ever ran
    here). The agent writes the 8 bytes before mapping them, so a full disk fails here with
    ENOSPC instead of faulting later when a page is first written."""
    path = primary / DELETIONS
    try:
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if writable else os.O_RDONLY, 0o600)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < 8:
            if not writable:
                return None
            os.pwrite(fd, bytes(8), 0)
        mapped = mmap.mmap(fd, 8, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    except OSError:
        return None
    finally:
        os.close(fd)
    return memoryview(mapped).cast("Q")


class Held:
    """One open block file; closed when the last reference goes, so a thread in the middle
    of a pread keeps it open although another thread let it go."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self, close=os.close) -> None:  # type: ignore[no-untyped-def]
        try:
            close(self.fd)
        except OSError:
            pass  # the program closed every descriptor itself (a daemon after fork)


def capacity_for(wanted: int) -> int:
    """`wanted`, but at most a quarter of this process's open-file limit: the rest belongs to
    the program (DataLoader workers share tensors through file descriptors)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(0, min(wanted, soft // 4)) if soft != resource.RLIM_INFINITY else max(0, wanted)


class OpenBlocks:
    """Up to `capacity` open block files of one cache, the oldest let go first. Without the
    agent's deletion counter nothing is kept: a held file could pin deleted blocks' space.

    A hit looks its file up in `held` itself and calls `open` on a miss, and the reader calls
    `check` every few dozen hits: no method call or counter read on each hit."""

    def __init__(self, deletions: memoryview | None, capacity: int) -> None:
        self._deletions = deletions
        self.capacity = capacity if deletions is not None else 0
        self._seen = deletions[0] if deletions is not None else 0
        self.held: dict[str, Held] = {}
        """Path → open file. Keep a looked-up `Held` referenced while reading from its fd."""
        self._lock = threading.Lock()

    def open(self, path: str) -> Held:
        """Open `path` (FileNotFoundError on a miss) and hold it, room and counter permitting."""
        if not self.capacity:
            return Held(os.open(path, os.O_RDONLY))
        self.check()
        assert self._deletions is not None
        before = self._deletions[0]
        held = Held(os.open(path, os.O_RDONLY))
        with self._lock:
            if self._deletions[0] == before:  # else the file may be one the agent just deleted
                if len(self.held) >= self.capacity:
                    del self.held[next(iter(self.held))]
                self.held[path] = held
        return held

    def check(self) -> None:
        """Let go of every held file if the agent deleted block files since the last look."""
        if self._deletions is not None and self._deletions[0] != self._seen:
            with self._lock:
                self._seen = self._deletions[0]
                self.held = {}

    def close(self) -> None:
        """Let go of every held file (a thread mid-read keeps its own until done)."""
        with self._lock:
            self.held = {}

    def forget(self, path: str) -> None:
        """Stop holding `path` (found damaged: its replacement is a new file)."""
        with self._lock:
            self.held.pop(path, None)
