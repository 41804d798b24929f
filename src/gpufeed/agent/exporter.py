"""The agent's counts in Prometheus' text format, and the HTTP endpoint that serves them.

A prometheus-client collector turns `Metrics` into metric families when a scrape (or `gpufeed
metrics`) asks, so the agent's parts keep counting in plain ints. Every name starts with
`gpufeed_`; labels are bounded: `mount` is a namespace path (never a URL or an option, which may
hold credentials; at most `metrics.MOUNT_LABELS`), `tier`, `kind` and `code` come from fixed sets.
The agent's CPU and memory come from prometheus-client's process collector (Linux /proc).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from importlib import resources
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from gpufeed.agent.metrics import MOUNT_LABELS, Buckets, Metrics
from gpufeed.sources import retry

log = logging.getLogger("gpufeed.agent")

Gauges = Callable[[], list[tuple[str, str, float]]]
"""(name without prefix, help, value) of what the agent holds now: cache bytes, limit, clients…"""
Coverage = Callable[[], dict[str, tuple[int, int]]]
"""Mount path → (bytes in its manifest, bytes of them cached), as last counted."""


class Cluster(Protocol):
    """The cache cluster this agent is a member of (`gpufeed.agent.cluster_node.ClusterNode`), as far
    as the dashboard needs it."""

    async def pools(self) -> list[dict[str, Any]]:
        """Every GPU pool's status board in the cluster's Redis (`gpufeed.cluster.poolboard`)."""
        ...


def _kind(text: str) -> str:
    """A retry kind as a label value: "server error" → "server_error"."""
    return text.replace(" ", "_")


class Collector:
    """Reads `Metrics` at scrape time."""

    def __init__(self, metrics: Metrics, gauges: Gauges, coverage: Coverage) -> None:
        self.metrics = metrics
        self.gauges = gauges
        self.coverage = coverage

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        yield _by_tier("hits", "Blocks read from the cache, by tier (disk) and mount", m.hits)
        yield _by_tier("hit_bytes", "Bytes readers read from cached blocks", m.hit_bytes)
        where = "by where from (store, peer, or direct: a reader's own store read past the cache) and mount"
        yield _by_tier("misses", f"Blocks fetched after a miss, {where}", m.misses)
        yield _by_tier("miss_bytes", f"Bytes fetched after a miss, {where}", m.miss_bytes)
        stall = CounterMetricFamily(
            "gpufeed_stall_seconds", "Seconds readers' reads waited on misses, summed over readers", labels=["mount"]
        )
        for mount, seconds in sorted(m.stall_s.items()):
            stall.add_metric([mount], seconds)
        yield stall
        yield _labelled("requests", "Requests the agent answered, by kind", "kind", m.requests)
        yield _labelled("errors", "Failures answered to readers, by gpufeed error code", "code", m.errors)
        retried = {_kind(kind): n for kind, n in retry.RETRIED.items()}
        yield _labelled("retries", "Store calls attempted again, by kind of failure", "kind", retried)
        for name, what in [
            ("evictions", "Blocks evicted to keep the cache under its limit"),
            ("repairs", "Damaged blocks discarded and fetched again"),
            ("uncached", "Blocks served uncached because the cache could not hold them"),
            ("prefetched", "Blocks prefetched and pinned until read"),
            ("prefetch_errors", "Prefetches that failed (the demand read fetches again)"),
            ("peer_served", "Blocks this node served to peers"),
            ("peer_requests", "Block requests this node answered peers (each carries what the peer wanted meanwhile)"),
            ("peer_served_bytes", "Bytes this node served to peers"),
            ("peer_corrupt", "Blocks a peer sent damaged (the next owner or the store was read)"),
        ]:
            yield CounterMetricFamily(f"gpufeed_{name}", what, value=m.counts[name])
        yield _histogram("store_get_seconds", "Store GET time, first byte to last, per block or object", m.store_get)
        yield _histogram("peer_get_seconds", "Block reads from a cluster peer, request to last byte", m.peer_get)
        yield _histogram("prefetch_lead_seconds", "From a prefetched block landing in the cache to its first read",
                         m.prefetch_lead)
        for name, what, value in self.gauges():
            yield GaugeMetricFamily(f"gpufeed_{name}", what, value=value)
        total = GaugeMetricFamily("gpufeed_mount_bytes", "Bytes in each mount's manifest", labels=["mount"])
        cached = GaugeMetricFamily(
            "gpufeed_mount_cached_bytes",
            "Bytes of each mount in the cache, as last counted (seconds old; minutes for huge mounts)",
            labels=["mount"],
        )
        for mount, (size, present) in sorted(self.coverage().items())[:MOUNT_LABELS]:
            total.add_metric([mount], size)
            cached.add_metric([mount], present)
        yield total
        yield cached


def _by_tier(name: str, what: str, counts: dict[tuple[str, str], int]) -> Metric:
    family = CounterMetricFamily(f"gpufeed_{name}", what, labels=["tier", "mount"])
    for (mount, tier), value in sorted(counts.items()):
        family.add_metric([tier, mount], value)
    return family


def _labelled(name: str, what: str, label: str, counts: dict[str, int]) -> Metric:
    family = CounterMetricFamily(f"gpufeed_{name}", what, labels=[label])
    for value, n in sorted(counts.items()):
        family.add_metric([value], n)
    return family


def _histogram(name: str, what: str, buckets: Buckets) -> Metric:
    family = HistogramMetricFamily(f"gpufeed_{name}", what)
    family.add_metric([], buckets.cumulative(), sum_value=buckets.sum)
    return family


def registry(metrics: Metrics, gauges: Gauges, coverage: Coverage) -> CollectorRegistry:
    """The agent's registry: its counts and the process's CPU, memory and open files."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Collector(metrics, gauges, coverage))  # type: ignore[arg-type]
    ProcessCollector(namespace="gpufeed", registry=reg)
    return reg


def text(reg: CollectorRegistry) -> str:
    return generate_latest(reg).decode()


async def serve(reg: CollectorRegistry, host: str, port: int, cluster: Cluster | None = None) -> Callable[[], Awaitable[None]]:
    """Serve /metrics, and at / the live dashboard for a person (one static page that reads
    /metrics every second), on the running loop; returns the coroutine function that stops it.
    /pool.json is the GPU pools' status boards from the cache cluster's Redis (none without a
    `cluster`), which the page shows when there is one. aiohttp is loaded only when an address
    was asked for."""
    from aiohttp import web

    page = resources.files("gpufeed.agent").joinpath("dashboard.html").read_bytes()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(reg), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def dashboard(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8")

    async def pool_json(request: web.Request) -> web.Response:
        if cluster is None:
            return web.json_response({"pools": []})
        try:
            return web.json_response({"pools": await cluster.pools()})
        except Exception as exc:  # an unreachable Redis is a line on the page, never a failed request
            line = (str(exc).splitlines() or [""])[0]
            return web.json_response({"pools": [], "error": f"{type(exc).__name__}: {line}" if line else type(exc).__name__})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", dashboard)
    app.router.add_get("/pool.json", pool_json)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("metrics on http://%s:%d/metrics, dashboard at /", host if ":" not in host else f"[{host}]", port)
    return runner.cleanup
