"""The FUSE daemon's background work (`integrations.fuse`): read-ahead of sequential readers
and the warmup of the mounted prefix, sent to the agent from one long-lived thread, never from
a libfuse callback (whose Python thread state, and agent connection, lives for one callback)."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator

from gpufeed.client import Client, ObjectHandle
from gpufeed.client.connection import AgentUnavailable
from gpufeed.config import human_bytes
from gpufeed.errors import GpufeedError
from gpufeed.integrations.fuse_mounts import MountState
from gpufeed.paths import FileStat

log = logging.getLogger("gpufeed.fuse")

WARMUP_CHUNK_BYTES = 64 << 20
"""The background warmup queues this much at a time, and at most two chunks at once, so a
million-file mount is not one agent request and demand reads find the store's slots free."""
WARMUP_LOOKUPS = 256
"""Files the warmup looks up in the manifest together (`Client.handle_many`)."""
_DONE = object()


class MountPrefetch(threading.Thread):
    """The one thread that talks to the agent about blocks nobody waits for: read-ahead of
    sequential readers and the background warmup of the mounted prefix. Demand reads go
    through `Client.read_range` on the callback's thread; the agent serves them in slots of
    their own, so they pass whatever this thread has queued (they still share the store's link
    with the prefetches in flight, at most the agent's PREFETCH_CONCURRENCY)."""

    def __init__(self, client: Client, nspath: str, state: MountState) -> None:
        super().__init__(name="gpufeed-fuse-prefetch", daemon=True)
        self.client = client
        self.nspath = nspath
        self.state = state
        self.ahead: queue.Queue[tuple[ObjectHandle, list[int]]] = queue.Queue()
        self._session = f"fuse-{os.getpid()}"
        self._warm_session = f"fuse-warmup-{os.getpid()}"

    def run(self) -> None:
        warming = self._warm() if self.state.warmup else None
        while True:
            try:
                handle, blocks = self.ahead.get(timeout=0.02 if warming is not None else None)
                if missing := self._cached_soon(handle, blocks):
                    self._send([(handle, missing)], self._session, pin=True)
                continue
            except queue.Empty:
                pass
            try:
                if warming is not None and next(warming, _DONE) is _DONE:
                    warming = None
            except GpufeedError as exc:  # the manifest went away under the warmup: read-ahead goes on
                log.warning("gpufeed fuse: warmup of %s stopped: %s", self.nspath, exc)
                warming = None

    @staticmethod
    def _cached_soon(handle: ObjectHandle, blocks: list[int]) -> list[int]:
        """Have the kernel read the cached ones of `blocks` from disk now (a sequential reader
        of a cached file otherwise waits on each page of the block file it reaches); returns
        the others, for the agent to fetch."""
        ref = handle.blocks
        assert ref is not None
        missing = []
        for index in blocks:
            try:
                fd = os.open(ref.path(index), os.O_RDONLY)
            except FileNotFoundError:
                missing.append(index)
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        return missing

    def _send(self, wanted: list[tuple[ObjectHandle, list[int]]], session: str, *, pin: bool) -> bool:
        try:
            self.client.fetches.prefetch(wanted, session, pin=pin)
            return True
        except (AgentUnavailable, GpufeedError, OSError) as exc:
            log.debug("prefetch not sent: %s", exc)
            return False

    def _warm(self) -> Iterator[None]:
        """A generator, one step at a time between read-ahead requests: queue a chunk of the
        prefix's missing blocks, then wait (stepwise) until the chunk before it is cached."""
        started = time.monotonic()
        files = list(self.client.walk(self.nspath))
        self.state.warm_total = len(files)
        if (skipped := self._too_big(files)) is not None:
            self.state.warm_note, self.state.warm_done = skipped, True
            log.warning("gpufeed fuse: warmup of %s %s; reads fill the cache as they go", self.nspath, skipped)
            return
        unfetched: set[str] = set()
        sent: list[tuple[ObjectHandle, list[int]]] = []
        chunk: list[tuple[ObjectHandle, list[int]]] = []
        chunk_bytes = 0
        for number, handle in enumerate(self._handles(files), 1):
            if handle is not None and (ref := handle.blocks) is not None:
                missing = [i for i in range(ref.blocks.count) if not os.path.exists(ref.path(i))]
                if missing:
                    chunk.append((handle, missing))
                    chunk_bytes += sum(ref.length(i) for i in missing)
            if chunk_bytes >= WARMUP_CHUNK_BYTES or number == len(files):
                while chunk and not self._send(chunk, self._warm_session, pin=False):
                    yield  # no agent for now: the next request starts one
                yield from self._cached(sent, unfetched)
                self.state.warm_files = number - len(chunk)
                sent, chunk, chunk_bytes = chunk, [], 0
        yield from self._cached(sent, unfetched)
        if unfetched:
            self.state.warm_note = f"{len(unfetched):,} file{'' if len(unfetched) == 1 else 's'} not cached"
            named = ", ".join(sorted(unfetched)[:3]) + (", ..." if len(unfetched) > 3 else "")
            log.warning("gpufeed fuse: warmup of %s could not cache %s (%s): their fetch failed or they were evicted; "
                        "reads fetch them", self.nspath, self.state.warm_note.removesuffix(" not cached"), named)
        self.state.warm_files, self.state.warm_done = len(files), True
        done = f"{len(files):,} file{'' if len(files) == 1 else 's'}"
        log.info("gpufeed fuse: warmup of %s done: %s in %.1f s", self.nspath, done, time.monotonic() - started)

    def _too_big(self, files: list[FileStat]) -> str | None:
        """Why not to warm `files` at all: more bytes than the cache holds, which a warmup would
        cycle through, evicting what readers just fetched (each byte fetched about twice)."""
        try:
            limit = self.client.agent.stats().limit  # starts the agent the warmup's requests would
        except GpufeedError:
            return None  # no agent can run: the warmup's requests find out and read-ahead goes on
        total = sum(item.size for item in files)
        if total <= limit:
            return None
        return f"skipped: {human_bytes(total)} does not fit the cache's {human_bytes(limit)}"

    def _handles(self, files: list[FileStat]) -> Iterator[ObjectHandle | None]:
        """Each file's handle, WARMUP_LOOKUPS files looked up together; None for a file that
        cannot be opened (said once in the log), which the warmup skips."""
        for start in range(0, len(files), WARMUP_LOOKUPS):
            batch = files[start : start + WARMUP_LOOKUPS]
            try:
                yield from self.client.handle_many([item.path for item in batch])
                continue
            except GpufeedError:
                pass  # one file of the batch: find which, file by file
            for item in batch:
                try:
                    yield self.client.handle(item.path)
                except GpufeedError as exc:
                    log.warning("gpufeed fuse: warmup skips %s: %s", item.path, exc)
                    yield None

    @staticmethod
    def _cached(sent: list[tuple[ObjectHandle, list[int]]], unfetched: set[str]) -> Iterator[None]:
        """Steps until every block of `sent` is published (an evicted or failed one counts as
        done after a while: the warmup is a hint, the demand read fetches it anyway); the
        paths of the files not cached by then go into `unfetched`."""
        deadline = time.monotonic() + 120.0
        for handle, blocks in sent:
            ref = handle.blocks
            assert ref is not None
            for index in blocks:
                while not os.path.exists(ref.path(index)):
                    if time.monotonic() >= deadline:
                        unfetched.add(handle.path)
                        break
                    yield
