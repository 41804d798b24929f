"""Where fetched bytes came from, on a node of a cache cluster: two real agents joined through a
real redis-server read an nginx-served dataset. The node's metrics count each block under the
store or under the peer that sent it, exactly; store GET times count only store GETs; `gpufeed
top` and the dashboard (in real headless Chromium) show peer bytes apart from the store's."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gpufeed.bench.children import free_port
from gpufeed.client.connection import AgentClient
from gpufeed.cluster.membership import status
from gpufeed.namespace import Namespace
from gpufeed.rpc.messages import Metrics, MetricsText
from tests.agent.chromium import open_page
from tests.agent.test_metrics import samples
from tests.cli.test_cli import ok
from tests.cluster.members import TOKEN, Member, wait
from tests.conftest import HttpServer

FILES = 48
SIZE = 20_000
DB = 13
"""The shared redis-server's database for this file (tests/cluster uses 7, the pool 6 and 11)."""


@contextmanager
def two_nodes(url: str, where: Path, metrics_port: int) -> Iterator[list[Member]]:
    """node0 (serving its metrics and dashboard on `metrics_port`) and node1, joined through the
    Redis at `url`, each seeing the other; stopped with SIGTERM on exit."""
    members = []
    try:
        for name in ("node0", "node1"):
            cache, port = where / name, free_port()
            cache.mkdir()
            log = where / f"{name}.log"
            argv = [sys.executable, "-m", "gpufeed.agent", "--cache-dir", str(cache), "--cluster", url,
                    "--peer-addr", f"127.0.0.1:{port}", "--node-id", name]
            if name == "node0":
                argv += ["--metrics-addr", f"127.0.0.1:{metrics_port}"]
            with open(log, "wb") as sink:
                members.append(Member(name, cache, port, subprocess.Popen(argv, stdout=sink, stderr=sink), log))
        wait(lambda: len(asyncio.run(status(url))) == 2, "2 live members")
        for member in members:
            wait(lambda member=member: member.sees() == 2, f"{member.name} to see the other")
        yield members
    finally:
        for member in members:
            if member.process.poll() is None:
                member.process.terminate()
        for member in members:
            member.process.wait(timeout=30)


def test_peer_bytes_are_counted_and_shown_apart_from_the_store(
    redis_url: str, nginx: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = nginx.root / f"tiers-{tmp_path.name}"
    site.mkdir()
    for i in range(FILES):
        (site / f"{i:03d}.bin").write_bytes(os.urandom(SIZE))
    Namespace().add_mount("/data", f"{nginx.url}/{site.name}")
    paths = [f"/data/{i:03d}.bin" for i in range(FILES)]
    monkeypatch.setenv("GPUFEED_CLUSTER_TOKEN", TOKEN)
    port = free_port()
    with two_nodes(redis_url.rsplit("/", 1)[0] + f"/{DB}", tmp_path, port) as (node0, _):
        assert len(node0.read_all(paths)) == FILES  # each block from its owner: node0's from the store, node1's through node1
        seen = samples(AgentClient(node0.settings()).request(Metrics(), MetricsText, start=False).text)

        def count(name: str, tier: str) -> float:
            return seen[(f"gpufeed_{name}_total", (("mount", "/data"), ("tier", tier)))]

        store, peer = count("misses", "store"), count("misses", "peer")
        assert store + peer == FILES and store > 0 and peer > 0, (store, peer)
        assert count("miss_bytes", "store") == store * SIZE and count("miss_bytes", "peer") == peer * SIZE
        assert seen[("gpufeed_store_get_seconds_count", ())] == store, "a peer's block is no store GET"
        assert seen[("gpufeed_peer_get_seconds_count", ())] == peer

        env = {"GPUFEED_CACHE_DIRS": str(node0.cache)}
        (mount,) = json.loads(ok("top", "--once", "--json", "--interval", "0.1", env=env))["mounts"]
        assert (mount["mount"], mount["misses"], mount["miss_bytes"]) == ("/data", FILES, FILES * SIZE)
        assert (mount["store_bytes"], mount["peer_bytes"]) == (store * SIZE, peer * SIZE)
        assert "peer MB/s" in ok("top", "--once", "--interval", "0.1", env=env)

        stop = threading.Event()

        def read_loop() -> None:  # node0 drops its copies and reads again: half through node1 each time
            while not stop.is_set():
                AgentClient(node0.settings()).clear()
                node0.read_all(paths)

        reader = threading.Thread(target=read_loop, daemon=True)
        reader.start()

        async def look() -> tuple[bool, str, str, str]:
            async with open_page(f"http://127.0.0.1:{port}/") as page:
                await page.wait_for("!document.querySelector('.tile.peer').hidden")
                rate = await page.wait_for("parseFloat(document.getElementById('peer-rate').textContent) > 0 "
                                           "&& document.getElementById('peer-rate').textContent", timeout=60)
                header = await page.evaluate("!document.querySelector('#mounts th.peer').hidden")
                store_cell = await page.evaluate("document.querySelector('#mounts tbody td:nth-child(4)').textContent")
                peer_cell = await page.evaluate("document.querySelector('#mounts tbody td:nth-child(5)').textContent")
                await page.screenshot(tmp_path / "dashboard-peers.png")
                return header, rate, store_cell, peer_cell

        try:
            header, rate, store_cell, peer_cell = asyncio.run(look())
        finally:
            stop.set()
            reader.join(timeout=120)
    assert header and float(rate) > 0
    assert float(store_cell.removesuffix(" MB")) > 0 and float(peer_cell.removesuffix(" MB")) > 0, (store_cell, peer_cell)
