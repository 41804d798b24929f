"""Store-latency shaper: a TCP proxy that makes a loopback store behave like a remote one.

The kernel here has no netem, so latency is added in user space, per request: on each
connection, the first response bytes after a client request are held for `latency` seconds
(keep-alive connections carry many requests, each pays it, as each pays a network round
trip). An optional bandwidth cap paces every byte, across all connections, like one shared
full-duplex link: responses on its downlink, request bodies (uploads) on its uplink, each at
the cap. Runs as its own process (`python -m gpufeed.bench.shaper`) so it never
competes with the benchmark for the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import uvloop

from gpufeed.bench.children import helper, python_module, until_parent_exits

WRITE_HIGH_WATER = 1 << 20
UPLINK_SLACK_S = 0.001
"""An upload chunk due sooner than this goes at once (a request line is not worth a timer)."""


class Pacer:
    """A shared link of `rate` bytes/s: each chunk arrives when the link has finished
    sending it, after the chunks before it. `delay` books the chunk, starting not before
    `after` seconds from now, and says how long until it has arrived."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = 0.0

    def delay(self, size: int, after: float = 0.0) -> float:
        now = time.monotonic()
        start = max(now + after, self._free_at)
        self._free_at = start + size / self.rate
        return self._free_at - now


class Shaper:
    """Protocol-level proxy: bytes go from one transport to the other in the callback that
    received them, so the shaper costs one event-loop turn per chunk, not a task switch."""

    def __init__(self, upstream: tuple[str, int], latency: float, bandwidth: float | None) -> None:
        self.upstream = upstream
        self.latency = latency
        self.pacer = Pacer(bandwidth) if bandwidth else None
        self.uplink = Pacer(bandwidth) if bandwidth else None

    def client_protocol(self) -> asyncio.Protocol:
        return _ClientSide(self)


class _ClientSide(asyncio.Protocol):
    """The connection from the store client; requests pass straight through."""

    def __init__(self, shaper: Shaper) -> None:
        self.shaper = shaper
        self.transport: asyncio.Transport | None = None
        self.store: _StoreSide | None = None
        self.asked = False
        self.early: list[bytes] = []
        self.connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.connecting = asyncio.get_running_loop().create_task(self._connect())  # held: tasks are weakly referenced

    async def _connect(self) -> None:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: _StoreSide(self), *self.shaper.upstream)
        except OSError:
            self.transport.close()

    def store_ready(self, store: _StoreSide) -> None:
        self.store = store
        for data in self.early:
            store.send(data)
        self.early.clear()

    def data_received(self, data: bytes) -> None:
        self.asked = True
        wait = self.shaper.uplink.delay(len(data)) if self.shaper.uplink is not None else 0.0
        if wait > UPLINK_SLACK_S:
            assert self.transport is not None
            self.transport.pause_reading()  # the next chunk waits behind this one, as on a link
            asyncio.get_running_loop().call_later(wait, self._forward_held, data)
        else:
            self._forward(data)

    def _forward(self, data: bytes) -> None:
        if self.store is None:
            self.early.append(data)
        else:
            self.store.send(data)

    def _forward_held(self, data: bytes) -> None:
        self._forward(data)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        if self.store is not None:
            self.store.client_finished()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.store is not None:
            self.store.close()

    def pause_writing(self) -> None:
        if self.store is not None:
            self.store.hold("client")

    def resume_writing(self) -> None:
        if self.store is not None:
            self.store.release("client")


class _StoreSide(asyncio.Protocol):
    """The connection to the store; the first response chunk after each request waits
    `latency`, and every chunk waits for its turn on the paced link."""

    def __init__(self, client: _ClientSide) -> None:
        self.client = client
        self.shaper = client.shaper
        self.transport: asyncio.Transport | None = None
        self.holds: set[str] = set()
        self.closing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        if self.client.transport is None or self.client.transport.is_closing():
            transport.close()
            return
        self.client.store_ready(self)

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def client_finished(self) -> None:
        if self.transport is not None and self.transport.can_write_eof():
            self.transport.write_eof()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def hold(self, reason: str) -> None:
        if not self.holds and self.transport is not None:
            self.transport.pause_reading()
        self.holds.add(reason)

    def release(self, reason: str) -> None:
        self.holds.discard(reason)
        if not self.holds and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        wait = 0.0
        if self.client.asked:
            self.client.asked = False
            wait = self.shaper.latency
        if self.shaper.pacer is not None:
            wait = self.shaper.pacer.delay(len(data), after=wait)
        if wait > 0:
            self.hold("shaping")
            asyncio.get_running_loop().call_later(wait, self._deliver_held, data)
        else:
            self._deliver(data)

    def _deliver_held(self, data: bytes) -> None:
        self._deliver(data)
        self.release("shaping")
        if self.closing:
            self._close_client()

    def _deliver(self, data: bytes) -> None:
        transport = self.client.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)

    def eof_received(self) -> bool:
        self._store_finished()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._store_finished()

    def _store_finished(self) -> None:
        """The store closed: close the client too, once any held bytes have gone out."""
        self.closing = True
        if "shaping" not in self.holds:
            self._close_client()

    def _close_client(self) -> None:
        if self.client.transport is not None:
            self.client.transport.close()


async def _serve(shaper: Shaper, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(shaper.client_protocol, host, port)
    sys.stdout.write(f"{server.sockets[0].getsockname()[1]}\n")
    sys.stdout.flush()
    async with server:
        await until_parent_exits()


@contextmanager
def shaping(
    upstream: tuple[str, int], latency_ms: float, bandwidth_mbps: float | None, log: Path, host: str = "127.0.0.1"
) -> Iterator[int]:
    """Run a shaper in front of `upstream` until the block ends; yields its port on `host`."""
    argv = python_module("gpufeed.bench.shaper", f"{upstream[0]}:{upstream[1]}", "--latency-ms", str(latency_ms))
    argv += ["--host", host]
    if bandwidth_mbps:
        argv += ["--bandwidth", str(bandwidth_mbps)]
    with helper(argv, "the latency shaper", log) as port:
        yield port


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpufeed.bench.shaper", description=__doc__.split("\n\n")[0])
    parser.add_argument("upstream", help="HOST:PORT of the store to shape")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="first-byte delay per request")
    parser.add_argument("--bandwidth", type=float, default=None, help="cap in MB/s (10^6 bytes/s), all connections together")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (a test network's, for other hosts)")
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    bandwidth = args.bandwidth * 1e6 if args.bandwidth else None
    shaper = Shaper((host or "127.0.0.1", int(port)), args.latency_ms / 1000, bandwidth)
    try:
        uvloop.run(_serve(shaper, args.host, args.port))  # the emulated network should take as little of this box's CPU as it can
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
