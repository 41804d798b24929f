"""Make any source a "remote" one: route it through the latency shaper.

A file:// directory is served over HTTP on loopback and shaped; an http:// source or an
S3/GCS/Azure source with a plain-http endpoint (MinIO, moto, a local gateway) is shaped
where it stands. The shaper works on TCP bytes, so TLS endpoints cannot be shaped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import SplitResult, urlsplit, urlunsplit

from gpufeed.errors import InvalidArgument

DEFAULT_LATENCY_MS = 20.0


def _address(url: str, parts: SplitResult) -> tuple[str, int]:
    if parts.scheme != "http" or not parts.hostname:
        raise InvalidArgument(f"{url}: only plain http:// endpoints can be shaped (the shaper cannot see into TLS)")
    return parts.hostname, parts.port or 80


def _shaped(url: str, port: int) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{port}"))


def check_shape(latency_ms: float, bandwidth_mbps: float | None) -> None:
    """Refuse a store shape the shaper cannot emulate, before anything is started."""
    if latency_ms < 0:
        raise InvalidArgument(f"--latency-ms {latency_ms:g}: must be >= 0")
    if bandwidth_mbps is not None and bandwidth_mbps <= 0:
        raise InvalidArgument(f"--bandwidth {bandwidth_mbps:g}: must be > 0 MB/s")


@contextmanager
def emulate_remote(
    url: str, options: dict[str, str], latency_ms: float, bandwidth_mbps: float | None, run_dir: Path
) -> Iterator[tuple[str, dict[str, str]]]:
    """Yields the (url, options) to mount instead of `url`: the same data behind the shaper."""
    from gpufeed.bench.server import serving  # aiohttp's server: only a run that emulates a store needs it
    from gpufeed.bench.shaper import shaping

    check_shape(latency_ms, bandwidth_mbps)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    with ExitStack() as stack:
        if scheme == "file":
            root = Path(parts.path)
            if not root.is_dir():
                raise InvalidArgument(f"{url}: no such directory")
            url = stack.enter_context(serving(root, run_dir))
            parts = urlsplit(url)
        if scheme in ("file", "http", "https"):
            upstream = _address(url, parts)
            port = stack.enter_context(shaping(upstream, latency_ms, bandwidth_mbps, run_dir / "shaper.log"))
            yield _shaped(url, port), options
            return
        endpoint = options.get("endpoint")
        if not endpoint:
            raise InvalidArgument(
                f"{url}: to emulate a remote store, give its plain-http endpoint with --opt endpoint=http://HOST:PORT"
            )
        upstream = _address(endpoint, urlsplit(endpoint))
        port = stack.enter_context(shaping(upstream, latency_ms, bandwidth_mbps, run_dir / "shaper.log"))
        yield url, {**options, "endpoint": _shaped(endpoint, port)}
