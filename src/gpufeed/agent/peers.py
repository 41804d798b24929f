"""Peers: a miss for a block another node owns is served by that node, from its cache or
fetched from the store once, by it. One more `BlockSource` in the fetcher's chain, before the
store, and the HTTP API that answers it (HTTPS with mutual TLS when the node has a certificate,
`peer_tls`).

    POST /v1/blocks  Authorization: Bearer TOKEN, body: msgpack `PeerFetch` (one block of one
                     object a group, up to PEER_BATCH_BLOCKS)
      200  a frame per block as the owner has it (FRAME_HEADER): msgpack `PeerBlock`, its bytes
           and their xxh3-64, which the asker checks, or 404 (the owner cannot cache it: the
           asker reads the store itself) or 502 (the store failed the owner; where the store's
           verdict is on the object itself, gone, changed or corrupted, the asker reads the store
           too and reports what it finds, and the owner is not suspect)
      400 malformed, 401 wrong token, 413 over MAX_REQUEST
    POST /v1/warm    body: msgpack `PeerWarm` (blocks the peer owns, for a cluster warmup)
      200  msgpack `Fetched`: once every block is cached there, known uncached, or failed
    GET /v1/health   200 "ok" (token required too): how a suspect peer is probed

Blocks are named by the request's own object identity (`Fetcher.jobs` derives it, as for local
readers): no paths, nothing to traverse. A peer that fails, times out or refuses is suspect at
once and skipped, then probed in the background until it answers; the store is always last.
An asker sends the blocks it wants from one owner while its last requests to it are out as one
request (`OwnerQueue`): a round trip, and the HTTP work on both ends, per batch, not per block.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
import os
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
import xxhash

from gpufeed import errors
from gpufeed.cluster.membership import Membership
from gpufeed.cluster.ownership import Node, owners
from gpufeed.config import Settings
from gpufeed.rpc.messages import Failure, Fetched, Group, ObjectWant, PeerBlock, PeerFetch, PeerWarm
from gpufeed.sources.http_index import why_failed

if TYPE_CHECKING:
    from gpufeed.agent.fetcher import Job
    from gpufeed.agent.metrics import Metrics

log = logging.getLogger("gpufeed.agent")

MAX_REQUEST = 1 << 20
CONNECT_TIMEOUT_S = 1.5
"""Longer than the first SYN retransmit (1 s): a SYN that a busy link dropped must not make a
healthy peer suspect and send its blocks to the store."""
READ_TIMEOUT_S = 10.0
"""A peer that took the request but sends nothing for this long is suspect: a hung process. Its
store may be slow, so this is generous; a host that is gone is caught by UNACKED_S instead."""
UNACKED_S = 1.5
"""A request the peer's host has not acknowledged for this long fails (TCP_USER_TIMEOUT): a host
off the network is skipped within 1.5 s even on a kept-alive connection. Linux applies it to the
handshake too, so it must outlast the first SYN retransmit (1 s), as CONNECT_TIMEOUT_S does."""
WARM_TIMEOUT_S = 300.0
"""How long an owner may take to cache a cluster warmup's batch from its store before it is
suspect and this node fetches that batch itself."""
PROBE_S = 1.0
PEER_BATCH_BLOCKS = 16
PEER_BATCH_BYTES = 4 << 20
"""A request to a peer carries at most this many blocks and bytes: the owner fetches a request's
blocks all at once, and a batch's later blocks arrive behind its earlier ones on one connection."""
REQUESTS_PER_PEER = 8
"""Requests in flight to one peer; what queues meanwhile goes in the next."""
SMALL_REQUESTS_PER_PEER = 2
"""Of those, how many may go with less than a full batch. More small requests cost both ends
HTTP work per block, and their streams share the link, so the block a reader waits for arrives
no sooner: three and four nodes reading from each other over 50 Mbit links kept the machine
42-66 % busy this way, 62-77 % with every request sent at once."""
_block_decoder = msgspec.msgpack.Decoder(PeerBlock)
FRAME_HEADER = 4
"""A reply is a frame per block, in the order the owner has them: this many bytes of length
(big-endian), then the msgpack `PeerBlock`."""
_fetched_decoder = msgspec.msgpack.Decoder(Fetched)
encoder = msgspec.msgpack.Encoder()

serving_peer: contextvars.ContextVar[bool] = contextvars.ContextVar("serving_peer", default=False)
"""Set while the agent fetches for a peer: such a fetch goes to the store, never to a third node."""


def load_token() -> str:
    """The cluster's shared secret: `GPUFEED_CLUSTER_TOKEN_FILE` (a file only its user reads) or
    `GPUFEED_CLUSTER_TOKEN`; never a command-line argument, never stored in Redis."""
    path = os.environ.get("GPUFEED_CLUSTER_TOKEN_FILE")
    if path:
        try:
            token = Path(path).read_text().strip()
            mode = os.stat(path).st_mode & 0o777
        except OSError as exc:
            raise errors.InvalidArgument(f"GPUFEED_CLUSTER_TOKEN_FILE {path}: {exc.strerror or exc}") from None
        if mode & 0o022:  # whoever may change it chooses the cluster's secret
            raise errors.InvalidArgument(
                f"GPUFEED_CLUSTER_TOKEN_FILE {path}: other users may change it (mode {mode:04o}); chmod 600 {path}"
            )
        if mode & 0o004:  # a Kubernetes Secret's default (0644) among them: warned, not refused
            log.warning("GPUFEED_CLUSTER_TOKEN_FILE %s: every user of this machine may read it (mode %04o): "
                        "chmod 600 (or 640) it", path, mode)
    else:
        token = os.environ.get("GPUFEED_CLUSTER_TOKEN", "").strip()
    if len(token) < 16:
        raise errors.InvalidArgument(
            "a cluster needs a token of at least 16 characters in GPUFEED_CLUSTER_TOKEN_FILE or GPUFEED_CLUSTER_TOKEN"
        )
    return token


def peer_tls(settings: Settings) -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """The peer API's server and client TLS contexts, or None for plain HTTP. Mutual: a node
    serves only peers whose certificate the cluster's CA signed, and checks the certificate of
    every peer it asks against that CA and the peer's advertised address."""
    files = (settings.peer_tls_cert, settings.peer_tls_key, settings.peer_tls_ca)
    if not any(files):
        return None
    if not all(files):
        raise errors.InvalidArgument("peer TLS needs GPUFEED_PEER_TLS_CERT, GPUFEED_PEER_TLS_KEY and GPUFEED_PEER_TLS_CA "
                                     "(python -m gpufeed.agent: --peer-tls-cert, --peer-tls-key, --peer-tls-ca), all three")
    cert, key, ca = files
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
        server.verify_mode = ssl.CERT_REQUIRED
        server.load_cert_chain(cert, key)
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        client.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise errors.InvalidArgument(f"peer TLS ({cert}, {key}, {ca}): {getattr(exc, 'strerror', None) or exc}") from None
    return server, client


class Suspects:
    """Peers skipped after a failure, each probed every PROBE_S until it answers again."""

    def __init__(self, probe: PeerProbe) -> None:
        self.since: dict[str, float] = {}
        self._probe = probe
        self._tasks: set[asyncio.Task[None]] = set()

    def __contains__(self, node_id: str) -> bool:
        return node_id in self.since

    def mark(self, node: Node, why: str) -> None:
        if node.id in self.since:
            return
        self.since[node.id] = time.monotonic()
        log.warning("peer %s (%s) is suspect: %s; skipped until it answers", node.id, node.address, why)
        task = asyncio.create_task(self._until_back(node))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _until_back(self, node: Node) -> None:
        while not await self._probe(node):
            await asyncio.sleep(PROBE_S)
        away = time.monotonic() - self.since.pop(node.id, time.monotonic())
        log.info("peer %s answers again after %.1f s", node.id, away)


class PeerProbe:
    def __init__(self, session: aiohttp.ClientSession, headers: dict[str, str], scheme: str) -> None:
        self.session = session
        self.headers = headers
        self.scheme = scheme

    async def __call__(self, node: Node) -> bool:
        try:
            async with self.session.get(f"{self.scheme}://{node.address}/v1/health", headers=self.headers) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False


def _peer_socket(addr: tuple[int, int, int, str, Any]) -> socket.socket:
    family, kind, proto, _, _ = addr
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(UNACKED_S * 1000))
    return sock


STORE_VERDICTS = frozenset({errors.ObjectMissing.code, errors.ObjectChanged.code, errors.ObjectCorrupted.code})
"""Codes of an owner's 502 that speak of the object, not of the owner: it stays trusted."""

Wanted = tuple["Job", int, int, "asyncio.Future[memoryview | None]"]
"""A block asked of a peer: its job, index and length, and where its bytes go."""


class OwnerQueue:
    """Blocks wanted from one peer and not yet sent, and how many requests to it are out."""

    def __init__(self) -> None:
        self.waiting: collections.deque[Wanted] = collections.deque()
        self.waiting_bytes = 0
        self.senders = 0

    def add(self, wanted: Wanted) -> bool:
        """Queue a block; whether another request should go now (`SMALL_REQUESTS_PER_PEER`)."""
        self.waiting.append(wanted)
        self.waiting_bytes += wanted[2]
        if self.senders < SMALL_REQUESTS_PER_PEER:
            return True
        full = len(self.waiting) >= PEER_BATCH_BLOCKS or self.waiting_bytes >= PEER_BATCH_BYTES
        return full and self.senders < REQUESTS_PER_PEER

    def take(self) -> list[Wanted]:
        """The next request's blocks, in the order asked: at least one, at most
        PEER_BATCH_BLOCKS and PEER_BATCH_BYTES; those whose askers went away are dropped."""
        batch: list[Wanted] = []
        size = 0
        while self.waiting and len(batch) < PEER_BATCH_BLOCKS:
            job, index, length, wanted = self.waiting[0]
            if batch and size + length > PEER_BATCH_BYTES:
                break
            self.waiting.popleft()
            self.waiting_bytes -= length
            if not wanted.done():
                batch.append((job, index, length, wanted))
                size += length
        return batch

    def answer_all(self) -> None:
        """Answer every waiting asker None (they read the next owner or the store) and forget them."""
        for _, _, _, wanted in self.waiting:
            if not wanted.done():
                wanted.set_result(None)
        self.waiting.clear()
        self.waiting_bytes = 0


class PeerBlocks:
    """The owners of a block, asked in order before the store (`fetcher.BlockSource`)."""

    def __init__(self, membership: Membership, replicas: int, token: str, metrics: Metrics,
                 tls: ssl.SSLContext | None = None) -> None:
        self.membership = membership
        self.replicas = replicas
        self.metrics = metrics
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/msgpack"}
        self.tls = tls
        self.scheme = "https" if tls is not None else "http"
        self.session: aiohttp.ClientSession | None = None
        self.suspects: Suspects | None = None
        self._queues: dict[str, OwnerQueue] = {}
        self._senders: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=0, socket_factory=_peer_socket, ssl=self.tls or True)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self.suspects = Suspects(PeerProbe(self.session, self.headers, self.scheme))

    def suspected(self) -> list[str]:
        return [] if self.suspects is None else list(self.suspects.since)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def _peers(self, job: Job) -> list[Node]:
        """The live owners to ask, in order, before this node goes to the store itself. An
        object checked whole against its hash has one owner for all its blocks, which fetches
        it once."""
        nodes = self.membership.nodes
        if serving_peer.get() or len(nodes) < 2 or job.group is None:
            return []
        assert self.suspects is not None
        asked = []
        for node in owners(job.blocks.oid if job.verified_whole else job.block.name, nodes, self.replicas):
            if node.id == self.membership.me.id:
                break  # this node owns it: the store, by this node
            if node.id not in self.suspects:
                asked.append(node)
        return asked

    def only_blocks(self, job: Job) -> bool:
        return bool(self._peers(job))

    async def read(self, job: Job, start: int, end: int) -> memoryview | None:
        index, offset = divmod(start, job.blocks.block_size)
        if offset or end != start + job.blocks.length(index):
            return None  # peers pass whole blocks
        assert self.suspects is not None
        for node in self._peers(job):
            if node.id in self.suspects:  # marked while another part of the object was asked
                continue
            began = time.monotonic()
            data = await self._ask(node, job, index, end - start)
            if data is not None:
                self.metrics.fetched(job.mount, "peer", len(data), time.monotonic() - began)
                return data
        return None

    async def _ask(self, node: Node, job: Job, index: int, length: int) -> memoryview | None:
        """The block from `node`, sent with whatever else this node wants from it meanwhile;
        None when it has not got it, or failed (then it is suspect)."""
        queue = self._queues.get(node.id)
        if queue is None:
            queue = self._queues[node.id] = OwnerQueue()
        wanted: asyncio.Future[memoryview | None] = asyncio.get_running_loop().create_future()
        if queue.add((job, index, length, wanted)):
            queue.senders += 1
            task = asyncio.create_task(self._send(node, queue))
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return await wanted

    async def _send(self, node: Node, queue: OwnerQueue) -> None:
        """Send what is queued for `node`, a batch a request, until nothing is; every asker
        gets an answer, None when the peer has not got the block or failed."""
        assert self.suspects is not None
        try:
            while queue.waiting:
                batch = queue.take()
                try:
                    if batch and node.id not in self.suspects:
                        await self._request(node, batch)
                finally:
                    for _, _, _, wanted in batch:
                        if not wanted.done():
                            wanted.set_result(None)
        finally:
            queue.senders -= 1
            if not queue.senders:
                queue.answer_all()  # only when the last sender stopped on an error

    async def _request(self, node: Node, batch: list[Wanted]) -> None:
        """One request for the batch; each block is handed to its asker as it arrives (the owner
        sends them in the order it has them), so none waits for the batch's slowest."""
        assert self.session is not None and self.suspects is not None
        groups = []
        for job, index, _, _ in batch:
            assert job.group is not None
            want = job.want
            asked = ObjectWant(want.info, want.check, want.block_size, [index], sums=job.listed or b"")
            groups.append(Group(job.group.source, [asked], job.group.credentials, job.group.mount))
        try:
            async with self.session.post(
                f"{self.scheme}://{node.address}/v1/blocks", data=encoder.encode(PeerFetch(groups)), headers=self.headers
            ) as response:
                if response.status != 200:
                    self.suspects.mark(node, f"HTTP {response.status} {(await response.text())[:200]}")
                    return
                for _ in batch:
                    size = int.from_bytes(await response.content.readexactly(FRAME_HEADER), "big")
                    block = _block_decoder.decode(await response.content.readexactly(size))
                    if not 0 <= block.number < len(batch):
                        raise msgspec.ValidationError(f"block {block.number} of a request for {len(batch)}")
                    job, index, length, wanted = batch[block.number]
                    data = block.data
                    if block.status == 404 or (block.status == 502 and block.code in STORE_VERDICTS):
                        got = None  # this node reads the store itself; its own read says what is wrong there
                    elif block.status != 200:
                        self.suspects.mark(node, f"{block.status} {data[:200].decode(errors='replace')}")
                        return
                    elif len(data) != length or xxhash.xxh3_64_hexdigest(data) != block.xxh3:
                        self.metrics.count("peer_corrupt")
                        why = f"block {job.blocks.block(index).name} arrived damaged ({len(data)} of {length} bytes)"
                        self.suspects.mark(node, why)
                        return
                    else:
                        got = memoryview(data)
                    if not wanted.done():
                        wanted.set_result(got)
        except (TimeoutError, aiohttp.ClientError, OSError, asyncio.IncompleteReadError, msgspec.DecodeError,
                msgspec.ValidationError) as exc:
            self.suspects.mark(node, why_failed(exc))

    async def warm(self, jobs: list[Job], here: Callable[[list[Job]], Awaitable[Fetched]]) -> Fetched:
        """Have each job's block cached by its first live owner, every owner at once; `here`
        fetches the blocks this node owns, and those of an owner that fails."""
        local: list[Job] = []
        by_owner: dict[str, tuple[Node, list[Job]]] = {}
        for job in jobs:
            asked = self._peers(job)
            if asked:
                by_owner.setdefault(asked[0].id, (asked[0], []))[1].append(job)
            else:
                local.append(job)
        replies = await asyncio.gather(here(local), *(self._warm_at(node, owned, here) for node, owned in by_owner.values()))
        return Fetched(
            [pair for reply in replies for pair in reply.uncached],
            [failure for reply in replies for failure in reply.failures],
            sum(reply.fetched for reply in replies),
        )

    async def _warm_at(self, node: Node, jobs: list[Job], here: Callable[[list[Job]], Awaitable[Fetched]]) -> Fetched:
        """One owner's share of a warmup, as one request; its reply renumbered to the asker's objects."""
        assert self.session is not None and self.suspects is not None
        of_object: dict[int, list[Job]] = {}
        for job in jobs:
            of_object.setdefault(job.number, []).append(job)
        numbers = list(of_object)
        groups = []
        for same in of_object.values():
            first, want = same[0], same[0].want
            assert first.group is not None
            sums = b"".join(job.listed or b"" for job in same)
            wanted = ObjectWant(want.info, want.check, want.block_size, [job.index for job in same], sums=sums)
            groups.append(Group(first.group.source, [wanted], first.group.credentials, first.group.mount))
        try:
            async with self.session.post(
                f"{self.scheme}://{node.address}/v1/warm", data=encoder.encode(PeerWarm(groups)), headers=self.headers,
                timeout=aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S, sock_read=WARM_TIMEOUT_S),
            ) as response:
                if response.status != 200:
                    self.suspects.mark(node, f"HTTP {response.status} {(await response.text())[:200]}")
                    return await here(jobs)
                reply = _fetched_decoder.decode(await response.read())
        except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError) as exc:
            self.suspects.mark(node, why_failed(exc))
            return await here(jobs)
        return Fetched(
            [(numbers[number], index) for number, index in reply.uncached],
            [Failure(f.code, f.message, None if f.object is None else numbers[f.object]) for f in reply.failures],
            reply.fetched,
        )
