"""Data-aware placement on the two-node Ray cluster: two real agents in a real cache cluster
(Redis), one per Ray node; a job naming its dataset goes to the node whose agent holds most of
it cached, and moves when that changes. The rules themselves (fractions per mount, reasons)
are checked without Ray."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import ray
import redis
from ray.cluster_utils import Cluster

from gpufeed.client.connection import AgentClient
from gpufeed.cluster import poolboard
from gpufeed.cluster.membership import status as cluster_status
from gpufeed.namespace import Namespace
from gpufeed.pool import inventory
from gpufeed.pool.client import lease, scheduler, status
from gpufeed.pool.inventory import Gpu
from gpufeed.pool.ledger import Ledger, Request
from gpufeed.pool.placement import CacheMap, cached_first, dataset_fraction
from tests.cluster.members import TOKEN, joined, wait
from tests.conftest import HttpServer
from tests.pool.conftest import AGENTS, GIB

FILES = 24


def test_a_dataset_counts_the_mounts_under_it_or_the_mount_that_holds_it() -> None:
    mounts = {"/imagenet": [100, 25], "/imagenet-val": [50, 50], "/coco": [200, 0]}
    assert dataset_fraction(mounts, "/imagenet") == 0.25
    assert dataset_fraction(mounts, "imagenet/train/") == 0.25, "inside a mount: that mount's fraction"
    assert dataset_fraction(mounts, "/") == 75 / 350
    assert dataset_fraction(mounts, "/other") is None
    assert dataset_fraction({"/a": [0, 0]}, "/a") == 0.0


def test_the_ledger_asks_the_cache_order_and_the_lease_says_why() -> None:
    ledger = Ledger()
    ledger.set_gpus([Gpu("n1", 0, 16 * GIB), Gpu("n2", 0, 16 * GIB), Gpu("n3", 0, 16 * GIB)])
    cache = CacheMap(agents={"n2": "agent-b", "n3": "agent-c"}, mounts={"n2": {"/d": [10, 9]}, "n3": {"/d": [10, 2]}})
    ledger.order = cached_first(cache.cached)
    ledger.submit(Request(1.0, dataset="/d"))
    (placed,) = ledger.schedule()
    assert placed.placements[0].node == "n2" and placed.candidates == ["n2", "n3", "n1"]
    assert cache.reason(placed, clustered=True) == "/d: 90% cached on agent-b (others that fit: agent-c 20%, ray node n1 0%)"
    ledger.submit(Request(1.0, dataset="/elsewhere"))
    (packed,) = ledger.schedule()
    assert cache.reason(packed, clustered=True) == "/elsewhere: cached on no node that fits (2); placed by GPU fit"
    assert "no cache cluster" in cache.reason(packed, clustered=False)


@pytest.fixture
def dataset(nginx: HttpServer, tmp_path: Path) -> list[str]:
    site = nginx.root / f"placement-{tmp_path.name}"
    site.mkdir()
    for i in range(FILES):
        (site / f"{i:03d}.bin").write_bytes(os.urandom(50_000))
    Namespace().add_mount("/data", f"{nginx.url}/{site.name}")
    return [f"/data/{i:03d}.bin" for i in range(FILES)]


def ray_node_of(agent: str) -> str:
    marker = next(iter(inventory.agent_marker(agent)))
    return next(n["NodeID"] for n in ray.nodes() if n.get("Alive") and marker in n.get("Resources", {}))


def test_a_job_naming_its_dataset_goes_where_it_is_cached(
    cluster: Cluster, dataset: list[str], redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = redis_url.rsplit("/", 1)[0] + "/6"
    monkeypatch.setenv("GPUFEED_CLUSTER_TOKEN", TOKEN)
    with joined(url, list(AGENTS), tmp_path) as (a, b):

        def cached(name: str) -> float:
            node = next(n for n in asyncio.run(cluster_status(url)) if n["id"] == name)
            total, held = node.get("mounts", {}).get("/data", (0, 0))
            return held / total if total else -1.0

        b.read_all(dataset)  # agent-b holds all of it; agent-a the blocks it owns (it served them to b)
        wait(lambda: cached("agent-b") == 1.0 and 0 <= cached("agent-a") < 1.0, "the agents to publish what they hold", 30)
        scheduler("data", cluster=url)
        with lease(Request(1.0, dataset="/data"), pool="data") as granted:
            assert granted.nodes == [ray_node_of("agent-b")]
            (shown,) = status("data")["leases"]
            assert shown["dataset"] == "/data"
            assert shown["reason"].startswith("/data: 100% cached on agent-b (others that fit: agent-a")
            board = redis.Redis.from_url(url, decode_responses=True)  # what every agent's dashboard shows
            published = wait(lambda: json.loads(board.get(poolboard.KEY.format(pool="data")) or "{}").get("leases"),
                             "the scheduler to publish its board")
            assert [(ls["lease_id"], ls["reason"]) for ls in published] == [(shown["lease_id"], shown["reason"])]
            with lease(Request(1.0), pool="data") as other:  # no dataset: packs onto the GPU left
                assert other.nodes == [ray_node_of("agent-a")] and other.lease["reason"] == ""

        AgentClient(b.settings()).clear()
        a.read_all(dataset)
        wait(lambda: cached("agent-a") == 1.0 and cached("agent-b") < 1.0, "agent-a to publish that it holds it all", 30)
        with lease(Request(1.0, dataset="/data/"), pool="data") as granted:
            assert granted.nodes == [ray_node_of("agent-a")], "the job follows the cache"
            assert "100% cached on agent-a" in granted.lease["reason"]
