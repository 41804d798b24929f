"""The peer HTTP API of a cluster node: the answering side of `agent.peers` (the protocol is
described there). Blocks are served from this node's cache, or fetched from its store once (a
fetch for a peer never goes to a third node, `serving_peer`), and streamed as the node has them."""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import xxhash
from aiohttp import web

from gpufeed import errors
from gpufeed.agent.peers import FRAME_HEADER, MAX_REQUEST, PEER_BATCH_BLOCKS, encoder, serving_peer
from gpufeed.blocks import CorruptBlock
from gpufeed.cache import blockfile
from gpufeed.cache.layout import BlockRef
from gpufeed.cache.openfiles import OpenBlocks
from gpufeed.rpc.messages import PeerBlock, PeerFetch, PeerWarm

if TYPE_CHECKING:
    from gpufeed.agent.fetcher import Fetcher, Job
    from gpufeed.agent.metrics import Metrics

log = logging.getLogger("gpufeed.agent")

_decoder = msgspec.msgpack.Decoder(PeerFetch)
_warm_decoder = msgspec.msgpack.Decoder(PeerWarm)


class PeerServer:
    """The peer HTTP API of this node."""

    def __init__(self, fetcher: Fetcher, dirs: tuple[Path, ...], token: str, metrics: Metrics,
                 tls: ssl.SSLContext | None = None) -> None:
        self.fetcher = fetcher
        self.tls = tls
        self.dirs = dirs
        self.expected = f"Bearer {token}".encode()
        self.metrics = metrics
        self.files = OpenBlocks(dirs[0], 0)
        self._runner: web.AppRunner | None = None

    def _allowed(self, request: web.Request) -> bool:
        if hmac.compare_digest(request.headers.get("Authorization", "").encode(), self.expected):
            return True
        log.warning("peer request from %s refused: wrong or missing cluster token", request.remote)
        return False

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok") if self._allowed(request) else web.Response(status=401, text="wrong token")

    async def blocks(self, request: web.Request) -> web.StreamResponse:
        if not self._allowed(request):
            return web.Response(status=401, text="wrong token")
        try:
            groups = _decoder.decode(await request.read()).groups
            if not 0 < len(groups) <= PEER_BATCH_BLOCKS:
                raise errors.InvalidArgument(f"{len(groups)} blocks: a request names 1 to {PEER_BATCH_BLOCKS}")
            if any(len(group.objects) != 1 or len(group.objects[0].blocks) != 1 for group in groups):
                raise errors.InvalidArgument("a group names exactly one block of one object")
            jobs = self.fetcher.jobs(groups)
        except web.HTTPRequestEntityTooLarge:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError, errors.InvalidArgument) as exc:
            return web.Response(status=400, text=f"malformed block request: {exc}")
        response = web.StreamResponse(headers={"Content-Type": "application/x-gpufeed-blocks"})
        await response.prepare(request)
        mark = serving_peer.set(True)
        try:
            for ready in asyncio.as_completed([self._ensure(number, job) for number, job in enumerate(jobs)]):
                number, status = await ready
                frame, served = await asyncio.to_thread(self._frame, number, jobs[number], status)
                await response.write(frame)
                if served:
                    self.metrics.count("peer_served")
                    self.metrics.count("peer_served_bytes", served)
        finally:
            serving_peer.reset(mark)
        self.metrics.count("peer_requests")
        await response.write_eof()
        return response

    async def _ensure(self, number: int, job: Job) -> tuple[int, str | errors.GpufeedError]:
        """(number, 'ok' | 'uncached' | the error the store's read failed with on this node)."""
        try:
            status, _ = await self.fetcher.ensure(job)
        except errors.GpufeedError as exc:
            return number, exc
        return number, status

    def _frame(self, number: int, job: Job, status: str | errors.GpufeedError) -> tuple[bytes, int]:
        """The block's frame of the reply, and the bytes of it served; off the event loop, as
        it reads the block file."""
        if isinstance(status, errors.GpufeedError):
            block = PeerBlock(number, 502, str(status).encode(), code=status.code)
        else:
            try:
                if status != "ok":
                    raise FileNotFoundError
                ref = BlockRef.of(self.dirs, job.blocks, True, self.files)
                data = blockfile.read(ref, job.index, 0, job.blocks.length(job.index))
                block = PeerBlock(number, 200, data, xxhash.xxh3_64_hexdigest(data))  # type: ignore[arg-type]
            except (FileNotFoundError, CorruptBlock):
                block = PeerBlock(number, 404, b"")
        body = encoder.encode(block)
        return len(body).to_bytes(FRAME_HEADER, "big") + body, len(block.data) if block.status == 200 else 0

    async def warm(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            return web.Response(status=401, text="wrong token")
        try:
            jobs = self.fetcher.jobs(_warm_decoder.decode(await request.read()).groups)
        except web.HTTPRequestEntityTooLarge:
            raise
        except (msgspec.DecodeError, msgspec.ValidationError, errors.InvalidArgument) as exc:
            return web.Response(status=400, text=f"malformed warm request: {exc}")
        mark = serving_peer.set(True)
        try:
            reply = await self.fetcher.fetch_jobs(jobs)
        finally:
            serving_peer.reset(mark)
        return web.Response(body=encoder.encode(reply), content_type="application/msgpack")

    async def start(self, host: str, port: int) -> None:
        app = web.Application(client_max_size=MAX_REQUEST)
        app.router.add_post("/v1/blocks", self.blocks)
        app.router.add_post("/v1/warm", self.warm)
        app.router.add_get("/v1/health", self.health)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port, ssl_context=self.tls).start()
        log.info("peer API on %s:%d (%s)", host, port, "mutual TLS" if self.tls else "plain HTTP")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
