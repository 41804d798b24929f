"""The node agent's process: the socket, the handshake, and a dispatch table from each request
type to the part of the agent that answers it. Nothing else lives here.

One agent owns a cache dir, held by an flock the kernel drops when the process dies, so a
`kill -9` leaves nothing that blocks the next agent. SIGTERM and SIGINT stop it cleanly:
connections are closed, queued prefetches dropped, and nothing is logged but one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvloop

from gpufeed import errors
from gpufeed.agent.fetcher import Fetcher
from gpufeed.agent.manager import AgentConfig, CacheManager
from gpufeed.agent.metrics import OTHER, Metrics
from gpufeed.agent.mounts import MountCoverage
from gpufeed.agent.sessions import Sessions
from gpufeed.agent.writer import StagedBlocks, Uploads
from gpufeed.config import Settings, parse_addr
from gpufeed.errors import GpufeedError
from gpufeed.rpc import codec
from gpufeed.rpc.messages import (
    AgentInfo,
    Cancel,
    Clear,
    Cleared,
    Commit,
    Done,
    Failure,
    Fetch,
    Hello,
    Hits,
    MetricsText,
    MountUsage,
    Prefetch,
    Queued,
    ReaderUsage,
    ReadRanges,
    Refused,
    Remove,
    Reply,
    Request,
    Shutdown,
    Stats,
    Sync,
    Usage,
    UsageInfo,
)
from gpufeed.rpc.messages import Metrics as MetricsRequest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from gpufeed.agent.cluster_node import ClusterNode

log = logging.getLogger("gpufeed.agent")

CACHE_DIR_CHECK_S = 1.0
"""How often the agent checks that its cache dir is still there."""


@dataclass
class Connection:
    """One reader's connection: its process (SO_PEERCRED) and the prefetch sessions it started,
    which end when it closes."""

    pid: int
    owned: set[str] = field(default_factory=set)


class AgentLocked(Exception):
    """Another agent already owns this cache dir."""


class AgentRunning(GpufeedError):
    """Another agent already serves the cache dir; exit code 3 tells a racing starter to connect."""

    exit_code = 3


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
    """The agent's parts, wired together, and the answer to each request."""

    def __init__(self, config: AgentConfig, settings: Settings) -> None:
        self.config = config
        self.metrics_addr = settings.metrics_addr
        self.metrics = Metrics()
        self.manager = CacheManager(config, self.metrics)
        self.sessions = Sessions(self.manager, self.metrics)
        self.fetcher = Fetcher(settings, self.manager, self.sessions, self.metrics)
        self.manager.protected = lambda: frozenset(self.fetcher.inflight).union(self.fetcher.busy, self.sessions.pinned)
        self.connections = 0
        self.last_activity = time.monotonic()
        self._stop: asyncio.Event | None = None
        self.cluster: ClusterNode | None = None
        if settings.cluster:
            from gpufeed.agent.cluster_node import ClusterNode  # aiohttp and redis: only a cluster member loads them

            self.cluster = ClusterNode(
                settings, self.fetcher, config.dirs, self.metrics, self.manager.limit(), self._cluster_stats
            )
        self.uploads = Uploads(settings, config.primary, self.manager, self.metrics)
        staged = StagedBlocks(self.uploads)  # a write not uploaded yet is read from here
        self.fetcher.chain.insert(0, staged)
        self.fetcher.ranges.append(staged)
        self.coverage = MountCoverage(settings, config.dirs)
        self._handlers: dict[type, Callable[[Any, Connection], Awaitable[Reply | None]]] = {
            Hello: self._hello,
            Stats: self._stats,
            Fetch: self._fetch,
            Prefetch: self._prefetch,
            ReadRanges: self._read_ranges,
            Cancel: self._cancel,
            Hits: self._hits,
            Clear: self._clear,
            Shutdown: self._shutdown,
            MetricsRequest: self._metrics,
            Usage: self._usage,
            Commit: self._commit,
            Sync: self._sync,
            Remove: self._remove,
        }
        self._kinds = {kind: kind.__name__.lower() for kind in self._handlers}
        """Request type → its `kind` label (the message's tag)."""

    def info(self) -> AgentInfo:
        manager = self.manager
        return AgentInfo(
            pid=os.getpid(),
            dirs=[str(d) for d in self.config.dirs],
            protocol=codec.VERSION,
            quota=self.config.cache_size,
            limit=manager.limit(),
            bytes=manager.policy.bytes,
            blocks=len(manager.policy),
            clients=self.connections,
            uptime_s=time.time() - self.metrics.started,
            pinned_bytes=self.sessions.pinned_bytes,
            latency_ms=self.metrics.latency_s * 1000,
            **self.metrics.counters(),
        )

    @functools.cached_property
    def registry(self) -> CollectorRegistry:
        """Made on the first scrape or `--metrics-addr`: prometheus-client takes about 0.1 s of
        CPU to import, which every agent start would pay (an agent starts with a job's first
        read). Its counts live in `Metrics` from the start, the process's CPU in /proc."""
        from gpufeed.agent import exporter

        return exporter.registry(self.metrics, self.gauges, lambda: self.coverage.latest)

    def gauges(self) -> list[tuple[str, str, float]]:
        """What the agent holds now, for the exporter."""
        manager = self.manager
        return [
            ("cache_bytes", "Bytes of blocks in the cache", manager.policy.bytes),
            ("cache_limit_bytes", "The quota, bounded by the free space the cache disks keep", manager.limit()),
            ("cache_quota_bytes", "The configured quota", self.config.cache_size),
            ("cache_blocks", "Blocks in the cache", len(manager.policy)),
            ("pinned_bytes", "Bytes of prefetched blocks kept until read", self.sessions.pinned_bytes),
            ("prefetch_queued", "Blocks queued or being fetched for prefetch sessions", self._queued()),
            ("prefetch_ahead_blocks", "Prefetched blocks not read yet: how far prefetch runs ahead",
             len(self.sessions.pinned)),
            ("prefetch_ahead_samples", "Samples the live prefetch sessions have asked for ahead of their consumers",
             self._ahead_samples()),
            ("fetches_in_flight", "Blocks (or whole objects) being fetched now", len(self.fetcher.inflight)),
            ("clients", "Reader connections", self.connections),
            *(
                [
                    ("cluster_members", "Live cluster members as this node sees them", len(self.cluster.membership.nodes)),
                    ("cluster_suspects", "Peers skipped as suspect now", len(self.cluster.blocks.suspected())),
                ]
                if self.cluster is not None
                else []
            ),
        ]

    def _cluster_stats(self) -> dict[str, Any]:
        """What `gpufeed cluster status` shows of this node."""
        m = self.metrics
        fetched = {tier: sum(n for (_, t), n in m.miss_bytes.items() if t == tier) for tier in ("store", "peer")}
        return {
            "cache_bytes": self.manager.policy.bytes,
            "limit": self.manager.limit(),
            "hits": sum(m.hits.values()),
            "misses": sum(m.misses.values()),
            "store_bytes": fetched["store"],
            "peer_bytes": fetched["peer"],
            "served_blocks": m.counts["peer_served"],
            "served_bytes": m.counts["peer_served_bytes"],
            "mounts": {path: list(counts) for path, counts in self.coverage.latest.items()},
        }

    def _ahead_samples(self) -> int:
        return sum(session.ahead_samples for session in self.sessions.sessions.values())

    def _queued(self) -> int:
        return sum(session.queued for session in self.sessions.sessions.values())

    async def _hello(self, request: Hello, conn: Connection) -> Reply:
        return self.info()

    async def _stats(self, request: Stats, conn: Connection) -> Reply:
        return self.info()

    async def _fetch(self, request: Fetch, conn: Connection) -> Reply:
        if not request.at_owners:
            reply = await self.fetcher.fetch(request.groups)
        elif self.cluster is None:
            raise errors.InvalidArgument(
                f"the agent for {self.config.primary} is not in a cache cluster: a cluster warmup needs "
                "an agent started with --cluster"
            )
        else:
            reply = await self.cluster.blocks.warm(self.fetcher.jobs(request.groups), self.fetcher.fetch_jobs)
        if (reader := self.metrics.readers.get(conn.pid)) is not None:
            reader.fetched_bytes += reply.fetched
        return reply

    async def _read_ranges(self, request: ReadRanges, conn: Connection) -> Reply:
        reply = await self.fetcher.read_ranges(request.groups, request.ranges)
        if (reader := self.metrics.readers.get(conn.pid)) is not None:
            reader.fetched_bytes += sum(len(part) for part in reply.parts)
        return reply

    async def _prefetch(self, request: Prefetch, conn: Connection) -> Reply:
        session, created = self.sessions.open(request.session, request.pin)
        if created:
            conn.owned.add(session.name)
        session.ahead_samples = request.ahead_samples
        jobs = self.fetcher.jobs(request.groups)
        self.fetcher.prefetch(session, self.sessions.announce(session, jobs))
        return Queued(len(jobs), self.metrics.prefetch_s)

    async def _cancel(self, request: Cancel, conn: Connection) -> Reply:
        self.sessions.cancel(request.session)
        return Done()

    async def _hits(self, request: Hits, conn: Connection) -> Reply | None:
        self.sessions.hits(request.names, request.read)
        self.metrics.served(conn.pid, request.served)
        return Done() if request.reply else None

    async def _commit(self, request: Commit, conn: Connection) -> Reply:
        return await self.uploads.commit(request)

    async def _sync(self, request: Sync, conn: Connection) -> Reply:
        return await self.uploads.sync(request)

    async def _remove(self, request: Remove, conn: Connection) -> Reply:
        await self.uploads.remove(request)
        return Done()

    async def _clear(self, request: Clear, conn: Connection) -> Reply:
        return Cleared(self.manager.evict_to(0, counted=False))

    async def _shutdown(self, request: Shutdown, conn: Connection) -> Reply:
        assert self._stop is not None
        self._stop.set()
        return Done()

    async def _metrics(self, request: MetricsRequest, conn: Connection) -> Reply:
        from gpufeed.agent import exporter

        return MetricsText(exporter.text(self.registry))

    async def _usage(self, request: Usage, conn: Connection) -> Reply:
        m = self.metrics
        mounts = {mount for mount, _ in [*m.hits, *m.misses]} | set(m.stall_s)
        manager = self.manager
        return UsageInfo(
            time=time.monotonic(),
            bytes=manager.policy.bytes,
            limit=manager.limit(),
            quota=self.config.cache_size,
            blocks=len(manager.policy),
            clients=self.connections,
            prefetch_queued=self._queued(),
            prefetch_ahead=len(self.sessions.pinned),
            prefetch_lead_s=m.prefetch_lead.sum,
            prefetch_leads=sum(m.prefetch_lead.counts),
            prefetch_ahead_samples=self._ahead_samples(),
            mounts=[
                MountUsage(
                    mount,
                    sum(n for (where, _), n in m.hits.items() if where == mount),
                    sum(n for (where, _), n in m.hit_bytes.items() if where == mount),
                    sum(n for (where, _), n in m.misses.items() if where == mount),
                    sum(n for (where, _), n in m.miss_bytes.items() if where == mount),
                    m.stall_s[mount],
                )
                for mount in sorted(mounts, key=lambda name: (name == OTHER, name))
            ],
            readers=[
                ReaderUsage(pid, r.hits, r.hit_bytes, r.fetched_bytes, r.stall_s) for pid, r in sorted(m.readers.items())
            ],
        )

    async def answer(self, request: Request, conn: Connection) -> Reply | None:
        """One request from `conn`. None: a one-way message."""
        kind = type(request)
        self.metrics.requests[self._kinds[kind]] += 1
        try:
            return await self._handlers[kind](request, conn)
        except GpufeedError as exc:
            self.metrics.errors[exc.code] += 1
            return Refused(Failure(exc.code, str(exc)))
        except Exception as exc:  # one bad request must not take the node's cache down
            log.exception("%s request failed", type(request).__name__)
            self.metrics.errors[errors.SourceError.code] += 1
            return Refused(Failure(errors.SourceError.code, f"agent: {exc}"))

    @staticmethod
    async def _unless_gone(
        answering: Coroutine[object, object, Reply | None], ahead: asyncio.Task[Request | None]
    ) -> Reply | None:
        """Answer a fetch unless its reader hangs up first (a warmup stopped with Ctrl-C, a killed
        job): then its fetches stop and None says so. Blocks other readers wait for are fetched
        for them (`Fetcher.ensure`); a block being written is still published."""
        task = asyncio.ensure_future(answering)
        await asyncio.wait((task, ahead), return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and (ahead.exception() is not None or ahead.result() is None):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
        return await task  # finished, or the reader sent its next request early: answer in order

    def _peer(self, writer: asyncio.StreamWriter) -> tuple[int, int]:
        """The connected process's pid and uid."""
        sock: socket.socket = writer.get_extra_info("socket")
        return codec.peer(sock)

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """The first message must be a Hello of this protocol version."""
        try:
            first = await codec.read_request(reader)
        except codec.ProtocolError:
            first = None
        if isinstance(first, Hello) and first.protocol == codec.VERSION:
            writer.write(codec.frame(self.info()))
            return True
        if isinstance(first, Hello):
            message = f"the agent speaks protocol {codec.VERSION}, the reader {first.protocol}"
            writer.write(codec.frame(Refused(Failure("protocol", message))))
        return False

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid, uid = self._peer(writer)
        if uid not in (os.getuid(), 0):
            # only this agent's own user (or root) may use it: the socket has no file permissions,
            # and the agent reads stores with its own credentials into a private cache dir
            log.warning("refused a client of another user")
            writer.close()
            return
        self.connections += 1
        conn = Connection(pid)
        self.metrics.connected(pid)
        ahead: asyncio.Task[Request | None] | None = None
        try:
            if await self._handshake(reader, writer):
                while (request := await (ahead or codec.read_request(reader))) is not None:
                    ahead = None
                    self.last_activity = time.monotonic()
                    if isinstance(request, (Fetch, ReadRanges)):
                        ahead = asyncio.ensure_future(codec.read_request(reader))
                        reply = await self._unless_gone(self.answer(request, conn), ahead)
                        if reply is None:
                            break
                    else:
                        reply = await self.answer(request, conn)
                    if reply is not None and not (isinstance(request, Hits) and not request.reply):  # one way stays one way
                        writer.write(codec.frame(reply))
                        await writer.drain()
        except (ConnectionError, codec.ProtocolError):
            pass  # the reader went away, or spoke another protocol: its requests end here
        except asyncio.CancelledError:
            pass  # the agent is stopping
        finally:
            if ahead is not None:
                ahead.cancel()
            for session in conn.owned:
                self.sessions.cancel(session)
            self.metrics.disconnected(pid)
            self.connections -= 1
            self.last_activity = time.monotonic()
            writer.close()

    async def _watch_cache_dir(self) -> None:
        """An agent whose cache dir was removed under it (`rm -rf` of GPUFEED_HOME) can neither
        serve nor be found by its state file: it exits, and the next reader starts an agent
        that makes the dir again."""
        assert self._stop is not None
        while not self._stop.is_set():
            await asyncio.sleep(CACHE_DIR_CHECK_S)
            if not self.config.primary.is_dir():
                log.error("cache dir %s was removed while this agent served it: exiting", self.config.primary)
                self._stop.set()

    async def _watch_idle(self) -> None:
        assert self._stop is not None and self.config.idle_timeout is not None
        while not self._stop.is_set():
            await asyncio.sleep(min(1.0, self.config.idle_timeout))
            idle = self.connections == 0 and not self.uploads.pending
            if idle and time.monotonic() - self.last_activity > self.config.idle_timeout:
                log.info("no clients for %.0f s: exiting", self.config.idle_timeout)
                self._stop.set()

    async def serve(self) -> None:
        stop_http = None
        if self.metrics_addr:
            from gpufeed.agent import exporter

            try:
                stop_http = await exporter.serve(self.registry, *parse_addr(self.metrics_addr), cluster=self.cluster)
            except OSError as exc:
                raise GpufeedError(f"--metrics-addr {self.metrics_addr}: {exc.strerror or exc}") from None
        if self.metrics_addr or self.cluster is not None:
            self.coverage.start()  # read by a dashboard, a scrape, or the cluster (the GPU pool's placement)
        self._stop = asyncio.Event()
        self.uploads.recover()
        if self.cluster is not None:
            await self.cluster.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        server = await asyncio.start_unix_server(self.handle, path=codec.address(self.config.primary))
        state = self.config.primary / "agent.json"
        try:
            state.write_text(json.dumps({"pid": os.getpid(), "dirs": [str(d) for d in self.config.dirs]}))
        except OSError as exc:  # a full cache dir must not stop the agent from serving uncached
            log.warning("cannot write %s: %s", state, exc.strerror)
        watcher = asyncio.create_task(self._watch_idle()) if self.config.idle_timeout else None
        dir_watcher = asyncio.create_task(self._watch_cache_dir())
        log.info("agent %d serving %s", os.getpid(), ", ".join(map(str, self.config.dirs)))
        if freed := self.manager.meet_quota():  # once serving: readers wait for no unlinks at start
            log.info("evicted %d bytes down to the quota of %d", freed, self.config.cache_size)
        try:
            await self._stop.wait()
        finally:
            if watcher:
                watcher.cancel()
            dir_watcher.cancel()
            self.coverage.stop()
            if stop_http is not None:
                await stop_http()
            server.close()
            if self.cluster is not None:
                await self.cluster.stop()
            state.unlink(missing_ok=True)
            await self.uploads.stop()
            await self._quiesce()
        log.info("agent %d stopped", os.getpid())

    async def _quiesce(self) -> None:
        """Let every other task end before the loop closes, so none is cancelled mid-way and
        logged: queued prefetches are dropped, connections closed."""
        for name in list(self.sessions.sessions):
            self.sessions.cancel(name)
        current = asyncio.current_task()
        others = [task for task in asyncio.all_tasks() if task is not current]
        for task in others:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*others, return_exceptions=True)


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
            agent.manager.scan()
        except OSError as exc:
            raise GpufeedError(f"cache dir {exc.filename or config.primary}: {exc.strerror or exc}") from exc
        uvloop.run(agent.serve())  # libuv's loop: fewer CPU cycles per store completion and client message
    finally:
        os.close(lock)
