"""A forwarding proxy that spoils the next few responses on purpose, in a scripted order, so a
test knows exactly which request failed how (the faults suite's proxy does the random mix).

Faults: "503" (SlowDown), "502" (Bad Gateway, as a proxy in front of a stopped store answers),
"reset" (close before answering), "truncate" (half the body, then close), "flip" (one byte of
the body changed, at a random place), "flip0" (the first byte changed, the same way every
time), "short" (half the body with a matching Content-Length, so only a length check can see
it), and "ok" (passed through untouched)."""

from __future__ import annotations

import http.client
import http.server
import random
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

FAULTS = ("503", "502", "reset", "truncate", "flip", "flip0", "short", "ok")
ERROR_ANSWERS = {
    "502": (502, "Bad Gateway", b"<html><body><h1>502 Bad Gateway</h1></body></html>"),
    "503": (503, "Slow Down", b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"),
}


@dataclass
class Script:
    """Faults to apply, in order, to requests whose method is `method` and whose path contains `match`."""

    faults: deque[str] = field(default_factory=deque)
    method: str = "GET"
    match: str = ""
    requests: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_fault(self, method: str, path: str, pinned: bool = False) -> str | None:
        with self.lock:
            self.requests.append(f"{method} {path}" + (" pinned" if pinned else ""))
            if method == self.method and self.match in path and self.faults:
                return self.faults.popleft()
            return None


@dataclass
class Flaky:
    url: str
    script: Script

    def plan(self, faults: list[str] | str, method: str = "GET", match: str = "", forever: bool = False) -> None:
        """The next matching requests get `faults`, in order; `forever` repeats one fault."""
        items = [faults] * 10_000 if forever and isinstance(faults, str) else list(faults)
        assert all(f in FAULTS for f in items), items
        with self.script.lock:
            self.script.faults = deque(items)
            self.script.method, self.script.match = method, match
            self.script.requests.clear()

    def count(self, method: str, match: str = "") -> int:
        with self.script.lock:
            return sum(1 for r in self.script.requests if r.startswith(method + " ") and match in r)

    def pinned(self, method: str, match: str = "") -> int:
        """Requests that pinned a version (If-Match or If-Unmodified-Since)."""
        with self.script.lock:
            return sum(1 for r in self.script.requests if r.startswith(method + " ") and match in r and r.endswith(" pinned"))


@contextmanager
def flaky_proxy(upstream: str) -> Iterator[Flaky]:
    """A proxy on a free loopback port forwarding to `upstream` (http://host:port[/base])."""
    target = urlsplit(upstream)
    script = Script()
    rng = random.Random(7)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            pinned = "If-Match" in self.headers or "If-Unmodified-Since" in self.headers
            fault = script.next_fault(self.command, self.path, pinned)
            if fault == "reset":
                self.close_connection = True
                self.connection.shutdown(2)
                return
            if fault in ERROR_ANSWERS:
                status, reason, payload = ERROR_ANSWERS[fault]
                self.send_response(status, reason)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                return
            conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            headers["Host"] = target.netloc
            conn.request(self.command, self.path, body=body, headers=headers)
            upstream_response = conn.getresponse()
            data = upstream_response.read()
            conn.close()
            if fault in ("flip", "flip0") and data:
                spoiled = bytearray(data)
                spoiled[rng.randrange(len(spoiled)) if fault == "flip" else 0] ^= 0x5A
                data = bytes(spoiled)
            if fault == "short" and data:
                data = data[: len(data) // 2]
            self.send_response(upstream_response.status, upstream_response.reason)
            head = self.command == "HEAD"
            for name, value in upstream_response.getheaders():
                if name.lower() not in ("transfer-encoding", "connection") and (head or name.lower() != "content-length"):
                    self.send_header(name, value)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if fault == "truncate":
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            if not head:
                self.wfile.write(data)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: object, client_address: object) -> None:
            """A client that hangs up on a spoiled answer is expected; no traceback."""

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Flaky(f"http://127.0.0.1:{server.server_address[1]}", script)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
