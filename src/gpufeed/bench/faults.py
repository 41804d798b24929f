"""Fault-injecting HTTP reverse proxy: a store that fails the way real stores do, on demand.

Why it exists: a loopback store never throttles, drops a connection, cuts a body short or
flips a byte, so without it nothing shows that every store call is retried and that no
wrong byte is delivered or cached. It sits in front of a real server (moto's S3, nginx) and,
per HTTP request, answers in one of these ways instead of passing the response through:

    503       S3's SlowDown: status 503 with an S3 XML error body; the store never sees it
    reset     the connection is reset (RST) before any response; the store never sees it
    truncate  status and headers with the full Content-Length, part of the body, then the connection closes
    stall     the response is held `stall` seconds, then sent whole
    flip      one byte of a 2xx body is inverted; the length is unchanged

Each fault has a rate (a fraction of requests); at most one is chosen per request. The choice
is a pure function of (seed, method, path+query, Range header, how many times that same
request came before), so a seed gives the same faults on every run even when requests
interleave differently, and a retry of a request draws afresh. A request whose path+query does
not match `path_filter` passes untouched. Faults that need a body (truncate, flip) pass a
response without one untouched and are not counted.

Requests go upstream with every header as the client sent it, Host included: S3 SigV4 signs
the host, so a client signs for the proxy's address and the store must see that same Host.
Bodies are passed through byte for byte (no decompression).

`GET /__faults__` answers the counts as JSON (so a test can assert that faults really
happened); `POST /__faults__` with a JSON object sets `seed`, `rates`, `path_filter` and
`stall` and starts the counts afresh, so one proxy serves many seeded runs.

Runs as its own process (`python -m gpufeed.bench.faults --upstream URL ...`), like the
shaper, so it never competes with the reader under test for the GIL; `injecting` runs one
for a block of code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import struct
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from gpufeed.bench.children import helper, python_module, until_parent_exits

FAULTS = ("503", "reset", "truncate", "stall", "flip")
CONTROL_PATH = "/__faults__"
MAX_BODY = 1 << 30
"""Largest request body passed upstream: an upload's parts (aiohttp refuses over 1 MiB by default)."""
DEFAULT_STALL = 2.0
MAX_EVENTS = 100_000

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Content-Length", "Expect",
    )
)

SLOWDOWN_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n'
    "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    "<RequestId>gpufeed-faults</RequestId></Error>"
)


def parse_rates(pairs: Mapping[str, float]) -> dict[str, float]:
    """Checked rates: known faults, each in [0, 1], together at most 1 (one fault a request)."""
    rates: dict[str, float] = {}
    for name, rate in pairs.items():
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r} (known: {', '.join(FAULTS)})")
        if not 0.0 <= float(rate) <= 1.0:
            raise ValueError(f"rate of {name} is {rate}: must be between 0 and 1")
        rates[name] = float(rate)
    if sum(rates.values()) > 1.0 + 1e-9:
        raise ValueError(f"rates add up to {sum(rates.values()):g}: at most 1 (one fault per request)")
    return rates


@dataclass
class Plan:
    """Which fault each request gets, and what was injected so far."""

    seed: int = 0
    rates: dict[str, float] = field(default_factory=dict)
    path_filter: re.Pattern[str] | None = None
    stall: float = DEFAULT_STALL
    seen: Counter[str] = field(default_factory=Counter)
    injected: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    matched: int = 0
    events: list[tuple[str, str, str]] = field(default_factory=list)

    def draw(self, method: str, target: str, range_header: str) -> tuple[str | None, random.Random]:
        """The fault for this request (None: pass it) and the generator its details come from."""
        self.requests += 1
        identity = f"{method} {target} {range_header}"
        occurrence = self.seen[identity]
        self.seen[identity] += 1
        rng = random.Random(f"{self.seed}|{identity}|{occurrence}")
        if self.path_filter is not None and not self.path_filter.search(target):
            return None, rng
        self.matched += 1
        roll = rng.random()
        for name in FAULTS:
            rate = self.rates.get(name, 0.0)
            if roll < rate:
                return name, rng
            roll -= rate
        return None, rng

    def record(self, fault: str, method: str, target: str) -> None:
        self.injected[fault] += 1
        if len(self.events) < MAX_EVENTS:
            self.events.append((fault, method, target))

    def report(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "rates": self.rates,
            "requests": self.requests,
            "matched": self.matched,
            "injected": {name: self.injected.get(name, 0) for name in FAULTS},
            "events": [{"fault": f, "method": m, "target": t} for f, m, t in self.events],
        }

    def configure(self, settings: Mapping[str, Any]) -> None:
        """New settings (those given) and fresh counts."""
        if "seed" in settings:
            self.seed = int(settings["seed"])
        if "rates" in settings:
            self.rates = parse_rates(settings["rates"])
        if "path_filter" in settings:
            self.path_filter = re.compile(settings["path_filter"]) if settings["path_filter"] else None
        if "stall" in settings:
            self.stall = float(settings["stall"])
        self.seen.clear()
        self.injected.clear()
        self.events.clear()
        self.requests = self.matched = 0


def _passed(raw: tuple[tuple[bytes, bytes], ...]) -> CIMultiDict[str]:
    """End-to-end headers as they came on the wire: names spelled as sent (aiohttp's parsed
    headers respell known names, "ETag" as "Etag"), repeats kept."""
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in raw:
        text = name.decode("latin-1")
        if text.lower() not in HOP_BY_HOP:
            headers.add(text, value.decode("latin-1"))
    return headers


def _reset(request: web.BaseRequest) -> None:
    """Close the client's connection with a TCP RST (SO_LINGER 0), as a dropped connection looks."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class FaultProxy:
    """The proxy's request handler and its one upstream session."""

    def __init__(self, upstream: str, plan: Plan) -> None:
        self.upstream = upstream.rstrip("/")
        self.plan = plan
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent", "Content-Type"),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == CONTROL_PATH:
            return await self._control(request)
        target = request.raw_path
        fault, rng = self.plan.draw(request.method, target, request.headers.get("Range", ""))
        if fault == "503":
            self.plan.record(fault, request.method, target)
            return web.Response(status=503, text=SLOWDOWN_BODY, content_type="application/xml", headers={"Retry-After": "0"})
        if fault == "reset":
            self.plan.record(fault, request.method, target)
            _reset(request)
            return web.Response()  # aiohttp finds the connection gone and drops this quietly
        if fault == "stall":
            self.plan.record(fault, request.method, target)
            await asyncio.sleep(self.plan.stall)
        try:
            status, headers, body = await self._forward(request, target)
        except (aiohttp.ClientError, OSError) as exc:
            return web.Response(status=502, text=f"fault proxy: upstream {self.upstream} failed: {exc}\n")
        has_body = bool(body) and request.method != "HEAD"
        if fault == "flip" and has_body and 200 <= status < 300:
            self.plan.record(fault, request.method, target)
            position = rng.randrange(len(body))
            body = body[:position] + bytes([body[position] ^ 0xFF]) + body[position + 1 :]
        elif fault == "truncate" and has_body:
            self.plan.record(fault, request.method, target)
            return await self._truncated(request, status, headers, body, rng.randrange(len(body)))
        if request.method == "HEAD":
            return web.Response(status=status, headers=headers)
        headers["Content-Length"] = str(len(body))
        return web.Response(status=status, headers=headers, body=body)

    async def _forward(self, request: web.Request, target: str) -> tuple[int, CIMultiDict[str], bytes]:
        assert self.session is not None
        outgoing = _passed(request.raw_headers)
        data = await request.read() if request.body_exists else None
        url = URL(self.upstream + target, encoded=True)
        async with self.session.request(
            request.method, url, headers=outgoing, data=data, allow_redirects=False
        ) as response:
            body = await response.read()
            headers = _passed(response.raw_headers)
            if request.method == "HEAD" and "Content-Length" in response.headers:
                headers["Content-Length"] = response.headers["Content-Length"]
            return response.status, headers, body

    async def _truncated(
        self, request: web.Request, status: int, headers: CIMultiDict[str], body: bytes, cut: int
    ) -> web.StreamResponse:
        """Promise the whole body, send `cut` bytes of it, then close the connection. A close,
        not a reset: a reset may discard what the client has not read yet, headers included."""
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = len(body)
        await response.prepare(request)
        if cut:
            await response.write(body[:cut])
        if request.transport is not None:
            request.transport.close()  # sends what is buffered, then FIN
        return response

    async def _control(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                settings = await request.json()
                if not isinstance(settings, dict):
                    raise TypeError("expected a JSON object")
                self.plan.configure(settings)
            except (ValueError, TypeError, re.error) as exc:
                return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(self.plan.report())


async def _serve(proxy: FaultProxy, port: int) -> None:
    await proxy.start()
    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_route("*", "/{tail:.*}", proxy.handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    sys.stdout.write(f"{runner.addresses[0][1]}\n")
    sys.stdout.flush()
    try:
        await until_parent_exits()
    finally:
        await runner.cleanup()
        await proxy.close()


@dataclass(frozen=True)
class FaultControl:
    """A running proxy, seen from a test: its URL, its counts, new settings."""

    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, data: bytes | None = None) -> dict[str, Any]:
        request = urllib.request.Request(self.url + CONTROL_PATH, data=data, method="POST" if data else "GET")
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def counts(self) -> dict[str, Any]:
        """{"requests", "matched", "injected": {fault: n}, "events": [{fault, method, target}]}"""
        return self._call()

    def configure(self, **settings: Any) -> dict[str, Any]:
        """Set any of seed, rates, path_filter, stall; counts start afresh."""
        return self._call(json.dumps(settings).encode())


def _argv(upstream: str, seed: int, rates: Mapping[str, float], path_filter: str | None, stall: float) -> list[str]:
    argv = python_module("gpufeed.bench.faults", "--upstream", upstream, "--seed", str(seed), "--stall", str(stall))
    for name, rate in rates.items():
        argv += ["--rate", f"{name}={rate}"]
    if path_filter:
        argv += ["--path-filter", path_filter]
    return argv


@contextmanager
def injecting(
    upstream: str,
    log: Path,
    *,
    seed: int = 0,
    rates: Mapping[str, float] | None = None,
    path_filter: str | None = None,
    stall: float = DEFAULT_STALL,
) -> Iterator[FaultControl]:
    """Run a fault proxy in front of `upstream` (http://HOST:PORT) until the block ends."""
    parse_rates(rates or {})
    argv = _argv(upstream, seed, rates or {}, path_filter, stall)
    with helper(argv, "the fault proxy", log) as port:
        yield FaultControl(port)


def _rate(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return name, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FAULT=RATE, e.g. 503=0.05") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gpufeed.bench.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="http://HOST:PORT of the store to put faults in front of")
    parser.add_argument("--port", type=int, default=0, help="loopback port to listen on (0: any free one)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed gives the same faults")
    parser.add_argument(
        "--rate", type=_rate, action="append", default=[], metavar="FAULT=RATE",
        help=f"fraction of requests that get FAULT, one of {', '.join(FAULTS)}; repeat for each",
    )
    parser.add_argument("--path-filter", default=None, metavar="REGEX", help="only requests whose path+query matches")
    parser.add_argument("--stall", type=float, default=DEFAULT_STALL, help="seconds a stalled response is held")
    args = parser.parse_args(argv)
    if not args.upstream.startswith("http://"):
        parser.error(f"--upstream {args.upstream}: expected http://HOST:PORT")
    try:
        rates = parse_rates(dict(args.rate))
        pattern = re.compile(args.path_filter) if args.path_filter else None
    except (ValueError, re.error) as exc:
        parser.error(str(exc))
    plan = Plan(seed=args.seed, rates=rates, path_filter=pattern, stall=args.stall)
    try:
        asyncio.run(_serve(FaultProxy(args.upstream, plan), args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
