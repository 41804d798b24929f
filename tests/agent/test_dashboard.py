"""The agent's dashboard page in a real headless Chromium (it loads from --metrics-addr, its
charts draw, its numbers move while a read loop runs), and the Grafana dashboard shipped for
teams that run Grafana, which must query only names the agent exports."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import gpufeed
from gpufeed.bench.children import free_port
from gpufeed.client.connection import AgentClient
from gpufeed.config import Settings
from gpufeed.namespace import Namespace
from gpufeed.rpc.messages import Metrics, MetricsText
from tests.agent.chromium import open_page

FILES = 40


def test_the_dashboard_draws_and_moves_while_reads_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "src"
    root.mkdir()
    for i in range(FILES):
        (root / f"{i:03d}.bin").write_bytes(bytes([i]) * 200_000)
    Namespace().add_mount("/data", f"file://{root}")
    port = free_port()
    monkeypatch.setenv("GPUFEED_METRICS_ADDR", f"127.0.0.1:{port}")  # the agent the first read starts inherits it
    gpufeed.read("/data/000.bin")
    stop = threading.Event()

    def read_loop() -> None:  # cold reads first, then warm ones, until the page has seen them
        while not stop.is_set():
            for i in range(FILES):
                gpufeed.read(f"/data/{i:03d}.bin")
            gpufeed.client().hits.flush()

    reader = threading.Thread(target=read_loop, daemon=True)
    reader.start()

    async def look() -> tuple[str, str, int, str, str, int]:
        async with open_page(f"http://127.0.0.1:{port}/") as page:
            await page.wait_for("document.title === 'gpufeed agent'")
            await page.wait_for("Number(document.getElementById('throughput').dataset.points || 0) >= 2")
            first = await page.evaluate("document.getElementById('cache-rate').textContent")
            await page.wait_for("parseFloat(document.getElementById('cache-rate').textContent) > 0")
            moved = await page.wait_for(f"document.getElementById('cache-rate').textContent !== {first!r} "
                                        "&& document.getElementById('cache-rate').textContent")
            points = await page.evaluate("Number(document.getElementById('throughput').dataset.points)")
            mount = await page.evaluate("document.querySelector('#mounts tbody td')?.textContent")
            cached = await page.wait_for(  # the agent counts each mount's cached bytes a second after it starts
                "/^\\d+\\.\\d %$/.test(document.querySelector('#mounts tbody td:last-child')?.textContent || '') "
                "&& document.querySelector('#mounts tbody td:last-child').textContent"
            )
            peers = await page.evaluate("[...document.querySelectorAll('.peer')].filter(e => !e.hidden).length")
            await page.screenshot(tmp_path / "dashboard.png")
            return first, moved, points, mount, cached, peers

    try:
        first, moved, points, mount, cached, peers = asyncio.run(look())
    finally:
        stop.set()
        reader.join(timeout=30)
    assert float(moved) > 0 and moved != first
    assert points >= 2
    assert mount == "/data"
    assert 0 < float(cached.removesuffix(" %")) <= 100, "the mount's cached fraction"
    assert peers == 0, "no peer tile, legend or column on a node outside a cache cluster (tests/agent/test_tiers.py)"
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_grafana_dashboard_queries_only_metrics_the_agent_exports(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x" * 1000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    gpufeed.read("/data/a.bin")
    text = AgentClient(Settings.from_env()).request(Metrics(), MetricsText, start=False).text
    families = list(text_string_to_metric_families(text))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {s.name for family in families for s in family.samples} | {  # a counter with no sample yet too
        family.name + suffix for family in families for suffix in suffixes.get(family.type, ())
    }
    board = json.loads((Path(__file__).parents[2] / "docs" / "grafana" / "gpufeed.json").read_text())
    queried = {name for panel in board["panels"] for target in panel["targets"]
               for name in re.findall(r"\bgpufeed_\w+", target["expr"])}
    assert len(queried) >= 10
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"
