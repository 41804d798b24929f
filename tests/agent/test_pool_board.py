"""The GPU pool on the agent's dashboard: the pool's scheduler publishes its status to the cache
cluster's Redis (`gpufeed.cluster.poolboard`), and any agent of that cluster serves it at
/pool.json and shows it on its page. A real redis-server, real agents, a real headless Chromium;
the status published is what the scheduler's `status()` returns, written here as a dict so the
agent's side is tested without Ray."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufeed.agent import exporter
from gpufeed.agent.metrics import Metrics
from gpufeed.bench.children import free_port, helper
from gpufeed.cluster import poolboard
from gpufeed.cluster.membership import connect
from tests.agent.chromium import open_page

TOKEN = "pool-board-test-token-0123456789"
DB = 11
"""A Redis database of this file's own: `read` lists every pool in its database."""

GIB = 2**30
STATUS: dict[str, Any] = {
    "gpus": [
        {"node": "5f3c2a9e0b7d41c6a8e2f0d9c3b1a7e4", "index": 0, "memory": 80 * GIB, "free_share": 0.25,
         "free_memory": 20 * GIB, "leases": ["lease-7f3a"]},
        {"node": "5f3c2a9e0b7d41c6a8e2f0d9c3b1a7e4", "index": 1, "memory": 80 * GIB, "free_share": 1.0,
         "free_memory": 80 * GIB, "leases": []},
    ],
    "leases": [
        {"lease_id": "lease-7f3a", "ticket": 3, "team": "vision", "priority": 1, "share": 0.75, "nodes": 1,
         "placements": [{"node": "5f3c2a9e0b7d41c6a8e2f0d9c3b1a7e4", "index": 0, "share": 0.75, "memory": 60 * GIB,
                         "gpu_memory": 80 * GIB}],
         "started": True, "idle_seconds": 42.0, "memory_used": 12 * GIB, "age": 310.5,
         "dataset": "/data/imagenet", "reason": "cached_first: 93% of /data/imagenet on this node"},
    ],
    "queue": [
        {"ticket": 4, "team": "nlp", "priority": 0, "share": 2.0, "memory": 0, "nodes": 1, "dataset": "",
         "waiting": 12.3, "position": 1, "why": "waiting for a GPU to free"},
    ],
    "teams": {"vision": {"in_use": 0.75, "waiting": 0, "quota": 2.0}, "nlp": {"in_use": 0.0, "waiting": 1, "quota": None}},
    "idle_timeout": 1800.0,
}


def db_url(redis_url: str) -> str:
    return redis_url.rsplit("/", 1)[0] + f"/{DB}"


def redis_call(url: str, call: Callable[[Any], Any]) -> Any:
    """`call(redis)`'s result on a fresh connection to `url` (each test step runs its own loop)."""

    async def go() -> Any:
        redis = connect(url)
        try:
            return await call(redis)
        finally:
            await redis.aclose()

    return asyncio.run(go())


@pytest.fixture
def board_url(redis_url: str) -> str:
    url = db_url(redis_url)
    redis_call(url, lambda redis: redis.flushdb())
    return url


def get_json(url: str) -> tuple[int, dict[str, Any]]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, json.loads(response.read())


@contextlib.contextmanager
def agent(tmp_path: Path, name: str, *flags: str) -> Iterator[str]:
    """A real agent process serving its dashboard; yields its base URL."""
    cache, port = tmp_path / name, free_port()
    cache.mkdir()
    argv = [sys.executable, "-m", "gpufeed.agent", "--cache-dir", str(cache), "--metrics-addr", f"127.0.0.1:{port}", *flags]
    with helper(argv, f"agent {name}", tmp_path / f"{name}.log", port=port):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def cluster_agent(board_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("GPUFEED_CLUSTER_TOKEN", TOKEN)
    with agent(tmp_path, "member", "--cluster", board_url, "--peer-addr", f"127.0.0.1:{free_port()}", "--node-id", "n0") as url:
        yield url


def test_publish_and_read_round_trip_through_redis(board_url: str) -> None:
    async def go(redis: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
        empty = await poolboard.read(redis)
        before = time.time()
        await poolboard.publish(redis, "train", STATUS)
        await poolboard.publish(redis, "eval", {**STATUS, "leases": [], "queue": []})
        await redis.set("gpufeed:pool:broken", "{not json")
        await redis.set("gpufeed:pool:list", "[1, 2]")
        await redis.sadd(poolboard.POOLS, "broken", "list", "expired")  # "expired": named, its board gone
        boards = await poolboard.read(redis)
        assert all(before <= board["time"] <= time.time() for board in boards)
        assert await redis.smembers(poolboard.POOLS) == {"train", "eval", "broken", "list"}, "an expired pool is forgotten"
        return empty, boards, await redis.ttl("gpufeed:pool:train")

    empty, boards, ttl = redis_call(board_url, go)
    assert empty == []
    assert [board["pool"] for board in boards] == ["eval", "train"], "sorted by name; unparsable boards skipped"
    train = boards[1]
    assert {k: v for k, v in train.items() if k not in ("pool", "time")} == STATUS
    assert boards[0]["leases"] == [] and boards[0]["gpus"] == STATUS["gpus"]
    assert 0 < ttl <= poolboard.TTL_S == 10, "a board expires unless published again"


def test_the_dashboard_shows_a_published_pool_and_hides_it_once_expired(
    cluster_agent: str, board_url: str, tmp_path: Path
) -> None:
    status, state = get_json(f"{cluster_agent}/pool.json")
    assert (status, state) == (200, {"pools": []}), "a cluster with no pool"
    redis_call(board_url, lambda redis: poolboard.publish(redis, "train", STATUS))

    status, state = get_json(f"{cluster_agent}/pool.json")
    assert status == 200 and [board["pool"] for board in state["pools"]] == ["train"]
    assert {k: v for k, v in state["pools"][0].items() if k not in ("pool", "time")} == STATUS

    async def look() -> tuple[str, str, str, str, bool]:
        async with open_page(f"{cluster_agent}/") as page:
            await page.wait_for("!document.getElementById('pool').hidden")
            leases = await page.wait_for(
                "document.querySelector('[data-pool=\"train\"] .pool-leases tbody')?.innerText || ''")
            gpus = await page.evaluate("document.querySelector('[data-pool=\"train\"] .pool-gpus tbody').innerText")
            queue = await page.evaluate("document.querySelector('[data-pool=\"train\"] .pool-queue tbody').innerText")
            teams = await page.evaluate("document.querySelector('[data-pool=\"train\"] .pool-teams tbody').innerText")
            await page.screenshot(tmp_path / "pool.png")
            # the scheduler stops: its board expires in Redis and the section goes away on the next poll
            await asyncio.to_thread(redis_call, board_url, lambda redis: redis.pexpire("gpufeed:pool:train", 100))
            hidden = await page.wait_for("document.getElementById('pool').hidden")
            return leases, gpus, queue, teams, hidden

    leases, gpus, queue, teams, hidden = asyncio.run(look())
    assert "lease-7f3a" in leases and "vision" in leases
    assert "cached_first: 93% of /data/imagenet on this node" in leases and "/data/imagenet" in leases
    assert "42 s" in leases, "the lease's idle time"
    assert "5f3c2a9e0b7d" in gpus and "25 %" in gpus and "20.0 GiB / 80.0 GiB" in gpus
    assert "nlp" in queue and "waiting for a GPU to free" in queue
    assert "0.75 / 2" in teams
    assert hidden
    assert (tmp_path / "pool.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert get_json(f"{cluster_agent}/pool.json") == (200, {"pools": []})


def test_an_agent_without_a_cluster_serves_no_pools(tmp_path: Path) -> None:
    with agent(tmp_path, "alone") as base:
        assert get_json(f"{base}/pool.json") == (200, {"pools": []})


class Unreachable:
    """A cluster whose Redis is gone: `pools` is `poolboard.read` on a port nothing listens on."""

    def __init__(self) -> None:
        self.url = f"redis://127.0.0.1:{free_port()}/0"

    async def pools(self) -> list[dict[str, Any]]:
        redis = connect(self.url)
        try:
            return await poolboard.read(redis)
        finally:
            await redis.aclose()


def test_an_unreachable_redis_is_an_error_line_not_a_failed_request() -> None:
    async def go() -> tuple[int, dict[str, Any]]:
        port, reg = free_port(), exporter.registry(Metrics(), lambda: [], lambda: {})
        stop = await exporter.serve(reg, "127.0.0.1", port, cluster=Unreachable())
        try:
            return await asyncio.to_thread(get_json, f"http://127.0.0.1:{port}/pool.json")
        finally:
            await stop()

    status, state = asyncio.run(go())
    assert status == 200 and state["pools"] == []
    assert state["error"].startswith("ConnectionError: ") and "\n" not in state["error"], state
