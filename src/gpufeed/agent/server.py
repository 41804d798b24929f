"""The node agent: the one process that writes a cache dir.

It fetches missing blocks with high concurrency (async obstore), single-flight across every
client (N processes wanting one block → one source GET), publishes them atomically, keeps the
cache under its quota with S3-FIFO, and counts what happened. Clients read published blocks
straight from disk; they come here only for misses and to report hits in batches.

All state is rebuilt from the cache dir at start (`scan`), and the lock is an flock the kernel
drops when the process dies, so a `kill -9` leaves nothing that blocks the next agent.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufeed import errors
from gpufeed.agent import protocol
from gpufeed.cache import blockfile
from gpufeed.cache.eviction import S3Fifo
from gpufeed.cache.layout import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, block_length, block_name, block_path, object_id
from gpufeed.cache.openfiles import DeletionCounter
from gpufeed.config import Settings
from gpufeed.errors import GpufeedError
from gpufeed.sources import Source, open_source
from gpufeed.namespace import source_identity
from gpufeed.sources.base import ObjectInfo, version_string

log = logging.getLogger("gpufeed.agent")

FETCH_CONCURRENCY = 64
PREFETCH_CONCURRENCY = 48
PIN_FRACTION = 0.5  # prefetch stops while pinned blocks fill this much of the cache
HIGH_WATERMARK = 0.95
LOW_WATERMARK = 0.85
FULL_BACKOFF_S = 5.0
DISK_CHECK_S = 2.0
"""How often the agent asks the cache filesystems for free space; in between, its own
publishes and evictions are what changes."""
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
MAX_BLOCKS_PER_REQUEST = 65536
_PEER = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class AgentConfig:
    dirs: tuple[Path, ...]
    cache_size: int
    free_ratio: float
    idle_timeout: float | None

    @property
    def primary(self) -> Path:
        return self.dirs[0]


@dataclass
class Session:
    """One prefetching job (a sampler's iteration): its queued fetches and pinned blocks."""

    name: str
    pin: bool = True
    """Whether its fetched blocks stay pinned until read. A reader's hints about blocks it read
    around do not pin: nothing promises those blocks will be read soon."""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    pinned: set[str] = field(default_factory=set)
    cancelled: bool = False


class AgentLocked(Exception):
    """Another agent already owns this cache dir."""


def acquire_lock(primary: Path) -> int:
    """The agent's lifetime lock on the primary dir; the kernel drops it when the process dies.
    A new cache dir is private to its user (0700): blocks hold whatever the sources hold."""
    primary.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(primary / "agent.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AgentLocked(str(primary)) from None
    return fd


class Agent:
    def __init__(self, config: AgentConfig, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.policy = S3Fifo()
        self.sizes: dict[str, int] = {}
        self.inflight: dict[str, asyncio.Future[str]] = {}
        self.sources: dict[str, Source] = {}
        self.stats: Counter[str] = Counter()
        self.connections = 0
        self.last_activity = time.monotonic()
        self.full_until = 0.0
        self.warned_full = False
        self.started = time.time()
        self.sessions: dict[str, Session] = {}
        self.pinned: dict[str, str] = {}
        self.pinned_bytes = 0
        self.latency_s = 0.02
        self.deletions = DeletionCounter.create(config.primary)
        """The count readers watch to let go of deleted block files; None when the cache dir
        cannot hold it (full), and then readers hold none."""
        self._disk_cap = 0
        self._disk_checked = -DISK_CHECK_S
        self._stop: asyncio.Event | None = None
        self._fetch_slots: asyncio.Semaphore | None = None
        self._prefetch_slots: asyncio.Semaphore | None = None

    # -- state on disk ----------------------------------------------------------------------

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
                        st = entry.stat()
                        found.append((st.st_mtime, entry.name, st.st_size))
            for _, name, size in sorted(found):
                self.policy.insert(name, size)
                self.sizes[name] = size

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

    def _evict_to(self, goal: int) -> int:
        freed = 0
        victims = self.policy.victims(goal, frozenset(self.inflight).union(self.pinned))
        for name in victims:
            oid, _, index = name.rpartition("-")
            block_path(self.config.dirs, oid, int(index)).unlink(missing_ok=True)
            freed += self.sizes.pop(name, 0)
            self.stats["evictions"] += 1
        if victims:
            self._deleted()
        return freed

    def _deleted(self) -> None:
        """Tell readers that block files are gone, after the unlinks, so they close the ones
        they hold and the space is freed (`cache.openfiles`)."""
        if self.deletions is not None and not self.deletions.bump():
            self.deletions = None

    def _make_room(self) -> None:
        limit = self.limit()
        if self.policy.bytes > HIGH_WATERMARK * limit:
            self._evict_to(int(LOW_WATERMARK * limit))

    # -- fetching ---------------------------------------------------------------------------

    def source(self, spec: dict[str, Any]) -> Source:
        """The store for a request; its options may carry the caller's credentials."""
        key = json.dumps(spec, sort_keys=True)
        source = self.sources.get(key)
        if source is None:
            source = self.sources[key] = open_source(spec["url"], spec["options"], self.settings)
        return source

    async def block(self, source: Source, obj: dict[str, Any], index: int, repair: bool) -> tuple[str, int]:
        """Make block `index` of `obj` present; returns ('ok' or 'uncached', bytes this call
        fetched from the source). 'uncached': the cache cannot hold it and the client reads the
        source itself. A call that joins another's fetch fetched nothing."""
        oid = obj["oid"]
        name = block_name(oid, index)
        path = block_path(self.config.dirs, oid, index)
        if repair and name not in self.inflight:
            path.unlink(missing_ok=True)
            self._deleted()
            self._forget(name)
            self.stats["repairs"] += 1
        elif name in self.policy:
            if path.exists():
                return "ok", 0
            self._forget(name)  # deleted behind our back: fetch it again
        pending = self.inflight.get(name)
        if pending is not None:
            return await asyncio.shield(pending), 0
        length = block_length(obj["size"], obj["block_size"], index)
        if time.monotonic() < self.full_until or length > self.limit():
            self.stats["uncached"] += 1
            return "uncached", 0
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.inflight[name] = future
        try:
            result = await self._fetch_and_publish(source, obj, index, name, path)
            future.set_result(result)
            return result, length
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # a waiter re-raises it; nobody waiting is fine too
            raise
        finally:
            del self.inflight[name]

    def _forget(self, name: str) -> None:
        self._unpin(name)
        self.policy.remove(name)
        self.sizes.pop(name, None)

    async def _fetch_and_publish(self, source: Source, obj: dict[str, Any], index: int, name: str, path: Path) -> str:
        block_size, size = obj["block_size"], obj["size"]
        start, end = index * block_size, min(size, (index + 1) * block_size)
        expect = ObjectInfo(obj["key"], size, obj["mtime"], obj["etag"]) if obj["check"] else None
        assert self._fetch_slots is not None
        async with self._fetch_slots:
            began = time.monotonic()
            data = await source.get_range_async(obj["key"], start, end, expect)
            self.latency_s = 0.9 * self.latency_s + 0.1 * (time.monotonic() - began)
        self.stats["misses"] += 1
        self.stats["bytes_fetched"] += len(data)
        if len(data) != end - start:  # the object shrank or grew: never publish a short block
            raise errors.ObjectChanged(f"{obj['key']}: the source returned {len(data)} bytes for [{start}, {end})")
        for attempt in range(2):
            try:
                written = await asyncio.to_thread(blockfile.publish, path, data)
                break
            except OSError as exc:
                full = exc.errno in FULL_ERRNOS
                if full and attempt == 0 and self._evict_to(max(0, self.policy.bytes - 4 * len(data))):
                    continue
                if full:
                    self.full_until = time.monotonic() + FULL_BACKOFF_S
                if not self.warned_full:
                    log.warning("cannot write blocks to %s (%s): serving reads uncached", path.parent, exc.strerror or exc)
                    self.warned_full = True
                self.stats["uncached"] += 1
                return "uncached"
        self.policy.insert(name, written)
        self.sizes[name] = written
        self._make_room()
        return "ok"

    def _jobs(self, groups: list[dict[str, Any]]) -> list[tuple[int, Source, dict[str, Any], int]]:
        """(object number, source, object, block index) for every block a request names, after
        checking it. Objects are numbered across groups in order; names are computed here,
        never taken from a client."""
        jobs: list[tuple[int, Source, dict[str, Any], int]] = []
        number = 0
        for group in groups:
            spec = group["source"]
            source = self.source(spec)
            identity = source_identity(spec["url"], spec["options"])
            for obj in group["objects"]:
                block_size = obj["block_size"]
                if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
                    raise errors.InvalidArgument(f"block size {block_size} is outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
                if any(not 0 <= i < -(-obj["size"] // block_size) for i in obj["blocks"]):
                    raise errors.InvalidArgument(f"a block index is outside {obj['key']} ({obj['size']} bytes)")
                version = version_string(obj["size"], obj["mtime"], obj["etag"])
                obj["oid"] = object_id(identity, obj["key"], version, block_size, bool(obj["check"]))
                jobs.extend((number, source, obj, index) for index in obj["blocks"])
                number += 1
                if len(jobs) > MAX_BLOCKS_PER_REQUEST:
                    raise errors.InvalidArgument(f"more than {MAX_BLOCKS_PER_REQUEST} blocks in one request")
        return jobs

    async def fetch(self, message: dict[str, Any]) -> dict[str, Any]:
        """Demand reads: reply once every block is published (or known uncached or failed)."""
        uncached: list[list[int]] = []
        failures: list[dict[str, Any]] = []
        fetched = 0

        async def one(number: int, source: Source, obj: dict[str, Any], index: int) -> None:
            nonlocal fetched
            try:
                status, got = await self.block(source, obj, index, index in obj.get("repair", ()))
            except GpufeedError as exc:
                failures.append({"object": number, "error": type(exc).__name__, "message": str(exc)})
                return
            except Exception as exc:  # one block's bug or I/O error fails that read, not its neighbours
                log.exception("block %d of %s", index, obj["key"])
                failures.append({"object": number, "error": "SourceError", "message": f"agent: {exc}"})
                return
            fetched += got
            if status == "uncached":
                uncached.append([number, index])

        await asyncio.gather(*(one(*job) for job in self._jobs(message["groups"])))
        return {"ok": not failures, "uncached": uncached, "errors": failures, "fetched": fetched}

    def prefetch(self, message: dict[str, Any], owned: set[str]) -> dict[str, Any]:
        """Queue blocks a job will read soon and reply at once. Queued blocks are fetched in the
        order asked, at most PREFETCH_CONCURRENCY at a time so demand reads keep their slots;
        fetched ones stay pinned (never evicted) until read or until the session ends."""
        session = self.sessions.get(message["session"])
        if session is None:
            session = self.sessions[message["session"]] = Session(message["session"], bool(message.get("pin", True)))
            owned.add(session.name)
        jobs = self._jobs(message["groups"])
        for _, source, obj, index in jobs:
            task = asyncio.create_task(self._prefetch_block(session, source, obj, index))
            session.tasks.add(task)
            task.add_done_callback(session.tasks.discard)
        return {"ok": True, "queued": len(jobs), "latency_s": self.latency_s}

    async def _prefetch_block(self, session: Session, source: Source, obj: dict[str, Any], index: int) -> None:
        assert self._prefetch_slots is not None
        async with self._prefetch_slots:
            if session.cancelled or (session.pin and self.pinned_bytes > PIN_FRACTION * self.limit()):
                return
            try:
                status, _ = await self.block(source, obj, index, False)
            except Exception as exc:  # a hint that failed: the demand read will fetch or report
                self.stats["prefetch_errors"] += 1
                log.debug("prefetch of block %d of %s failed: %s", index, obj["key"], exc)
                return
            name = block_name(obj["oid"], index)
            if status == "ok" and session.pin and not session.cancelled and name not in self.pinned:
                self.pinned[name] = session.name
                session.pinned.add(name)
                self.pinned_bytes += self.sizes.get(name, 0)
                self.stats["prefetched"] += 1

    def _unpin(self, name: str) -> None:
        owner = self.pinned.pop(name, None)
        if owner is not None:
            self.pinned_bytes -= self.sizes.get(name, 0)
            session = self.sessions.get(owner)
            if session is not None:
                session.pinned.discard(name)

    def cancel(self, name: str) -> None:
        """End a prefetch session: queued blocks are dropped, pinned ones released."""
        session = self.sessions.pop(name, None)
        if session is None:
            return
        session.cancelled = True
        for block in list(session.pinned):
            self._unpin(block)

    # -- serving ----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "dirs": [str(d) for d in self.config.dirs],
            "quota": self.config.cache_size,
            "limit": self.limit(),
            "bytes": self.policy.bytes,
            "blocks": len(self.policy),
            "clients": self.connections,
            "uptime_s": time.time() - self.started,
            "pinned_bytes": self.pinned_bytes,
            "latency_ms": self.latency_s * 1000,
            "protocol": protocol.VERSION,
            **{
                k: self.stats[k]
                for k in ("hits", "misses", "bytes_fetched", "repairs", "evictions", "uncached", "prefetched", "prefetch_errors")
            },
        }

    async def dispatch(self, message: dict[str, Any], owned: set[str]) -> dict[str, Any]:
        """One request; `owned` collects the prefetch sessions this connection started, which
        end when it closes."""
        op = message.get("op")
        if op == "fetch":
            return await self.fetch(message)
        if op == "prefetch":
            return self.prefetch(message, owned)
        if op == "cancel":
            self.cancel(message["session"])
            return {"ok": True}
        if op == "hits":
            names = message["names"].split()
            for name in names:
                self.policy.access(name)
                self._unpin(name)
            self.stats["hits"] += len(names)
            return {"ok": True}
        if op in ("hello", "stats"):
            return {"ok": True, **self.snapshot()}
        if op == "clear":
            removed = self._evict_to(0)
            return {"ok": True, "removed_bytes": removed}
        if op == "shutdown":
            assert self._stop is not None
            self._stop.set()
            return {"ok": True}
        return {"ok": False, "errors": [{"error": "InvalidArgument", "message": f"unknown agent op {op!r}"}]}

    def _trusted(self, writer: asyncio.StreamWriter) -> bool:
        """Only this agent's own user (or root) may use it: the socket has no file permissions,
        and the agent reads stores with its own credentials into a private cache dir."""
        sock: socket.socket = writer.get_extra_info("socket")
        _, uid, _ = _PEER.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER.size))
        return uid in (os.getuid(), 0)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._trusted(writer):
            log.warning("refused a client of another user")
            writer.close()
            return
        self.connections += 1
        owned: set[str] = set()
        try:
            while (message := await protocol.read_message(reader)) is not None:
                self.last_activity = time.monotonic()
                try:
                    reply = await self.dispatch(message, owned)
                except Exception as exc:  # one bad request must not take the node's cache down
                    log.exception("request %s failed", message.get("op"))
                    reply = {"ok": False, "errors": [{"error": "SourceError", "message": f"agent: {exc}"}]}
                if not message.get("noreply"):
                    writer.write(protocol.encode(reply))
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            for session in owned:
                self.cancel(session)
            self.connections -= 1
            self.last_activity = time.monotonic()
            writer.close()

    async def _watch_idle(self) -> None:
        assert self._stop is not None and self.config.idle_timeout is not None
        while not self._stop.is_set():
            await asyncio.sleep(min(1.0, self.config.idle_timeout))
            if self.connections == 0 and time.monotonic() - self.last_activity > self.config.idle_timeout:
                log.info("no clients for %.0f s: exiting", self.config.idle_timeout)
                self._stop.set()

    async def serve(self) -> None:
        self._stop = asyncio.Event()
        self._fetch_slots = asyncio.Semaphore(FETCH_CONCURRENCY)
        self._prefetch_slots = asyncio.Semaphore(PREFETCH_CONCURRENCY)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        server = await asyncio.start_unix_server(self.handle, path=protocol.address(self.config.primary))
        state = self.config.primary / "agent.json"
        try:
            state.write_text(json.dumps({"pid": os.getpid(), "dirs": [str(d) for d in self.config.dirs]}))
        except OSError as exc:  # a full cache dir must not stop the agent from serving uncached
            log.warning("cannot write %s: %s", state, exc.strerror)
        watcher = asyncio.create_task(self._watch_idle()) if self.config.idle_timeout else None
        log.info("agent %d serving %s", os.getpid(), ", ".join(map(str, self.config.dirs)))
        try:
            await self._stop.wait()
        finally:
            if watcher:
                watcher.cancel()
            server.close()
            state.unlink(missing_ok=True)


class AgentRunning(GpufeedError):
    """Another agent already serves the cache dir; exit code 3 tells a racing starter to connect."""

    exit_code = 3


def run_agent(config: AgentConfig, settings: Settings) -> None:
    """Run in the foreground until stopped."""
    try:
        lock = acquire_lock(config.primary)
    except AgentLocked:
        raise AgentRunning(f"an agent already serves {config.primary} (see 'gpufeed agent status')") from None
    except OSError as exc:
        raise GpufeedError(f"cache dir {config.primary}: {exc.strerror or exc}") from exc
    try:
        agent = Agent(config, settings)
        try:
            agent.scan()
        except OSError as exc:
            raise GpufeedError(f"cache dir {exc.filename or config.primary}: {exc.strerror or exc}") from exc
        asyncio.run(agent.serve())
    finally:
        os.close(lock)
