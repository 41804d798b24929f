"""The agent's metrics as Prometheus sees them: a real Debian `prometheus` server scrapes the
agent's --metrics-addr and its query API returns the counts a known read pattern caused."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import gpufeed
from gpufeed.bench.children import free_port, helper
from gpufeed.client import Client
from gpufeed.client.connection import AgentClient
from gpufeed.config import Settings
from gpufeed.namespace import Namespace
from gpufeed.rpc.messages import Metrics, MetricsText
from tests.conftest import need_binary
from tests.writes.test_appender import eventually

PROMETHEUS = "/usr/bin/prometheus"
"""Debian's package puts it here; scripts/test installs it when missing."""
FILES = 12


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Exposition text → {(sample name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def agent_metrics() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return samples(AgentClient(Settings.from_env()).request(Metrics(), MetricsText, start=False).text)


@pytest.fixture
def data(tmp_path: Path) -> dict[str, bytes]:
    root = tmp_path / "src"
    root.mkdir()
    files = {f"{i:03d}.bin": bytes([i]) * (3000 + 100 * i) for i in range(FILES)}
    for name, body in files.items():
        (root / name).write_bytes(body)
    Namespace().add_mount("/data", f"file://{root}")
    return files


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[str], str]]:
    """Starts a Prometheus server that scrapes HOST:PORT every second; returns its base URL."""
    with contextlib.ExitStack() as servers:

        def start(target: str) -> str:
            if not Path(PROMETHEUS).exists():
                need_binary("prometheus")
            config = tmp_path / "prometheus.yml"
            config.write_text(json.dumps({  # YAML is a superset of JSON
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [{"job_name": "gpufeed", "static_configs": [{"targets": [target]}]}],
            }))
            port = free_port()
            argv = [
                PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            ]
            servers.enter_context(helper(argv, "prometheus", tmp_path / "prometheus.log", port=port))
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while not _ready(base):  # it answers 503 while its storage opens
                assert time.monotonic() < deadline, "prometheus never became ready"
                time.sleep(0.2)
            return base

        yield start


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as response:
            return response.status == 200
    except OSError:  # urllib's HTTPError (503) is one
        return False


def query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_the_hits_and_misses_the_reads_caused(
    data: dict[str, bytes], prometheus: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("GPUFEED_METRICS_ADDR", f"127.0.0.1:{port}")  # the agent reads start inherits it
    warm_passes = 3
    for _ in range(1 + warm_passes):
        for name, body in data.items():
            assert gpufeed.read(f"/data/{name}") == body
    gpufeed.client().hits.flush()  # waits until the agent counted them
    hits, misses = FILES * warm_passes, FILES
    size = sum(map(len, data.values()))

    seen = agent_metrics()  # the same counts over the agent's socket
    assert seen[("gpufeed_hits_total", (("mount", "/data"), ("tier", "disk")))] == hits
    assert seen[("gpufeed_misses_total", (("mount", "/data"), ("tier", "store")))] == misses
    assert seen[("gpufeed_hit_bytes_total", (("mount", "/data"), ("tier", "disk")))] == warm_passes * size
    assert seen[("gpufeed_miss_bytes_total", (("mount", "/data"), ("tier", "store")))] == size
    assert seen[("gpufeed_store_get_seconds_count", ())] == misses
    assert seen[("gpufeed_requests_total", (("kind", "fetch"),))] == misses  # one cold read alone a request
    assert seen[("gpufeed_stall_seconds_total", (("mount", "/data"),))] > 0
    assert seen[("gpufeed_cache_blocks", ())] == FILES
    assert seen[("gpufeed_process_resident_memory_bytes", ())] > 0

    server = prometheus(f"127.0.0.1:{port}")
    promql = 'gpufeed_hits_total{mount="/data",tier="disk"}'
    deadline = time.monotonic() + 30
    result: list[dict] = []
    while time.monotonic() < deadline and not result:  # until the first scrape has landed
        result = query(server, promql)
        time.sleep(0.2)
    assert result, f"Prometheus never scraped the agent ({promql} stayed empty)"
    assert float(result[0]["value"][1]) == hits
    assert float(query(server, 'gpufeed_misses_total{mount="/data"}')[0]["value"][1]) == misses
    assert query(server, 'up{job="gpufeed"}')[0]["value"][1] == "1"


def test_what_a_reader_that_stopped_reading_did_reaches_the_agent(data: dict[str, bytes], tmp_path: Path) -> None:
    """A paused loop or an idle FUSE daemon leaves hits (and reads past the cache) unreported,
    as reports ride on reads: they are sent within IDLE_REPORT_S all the same, the reader
    still open, however few there were."""
    Namespace().add_mount("/off", f"file://{tmp_path / 'src'}", {"cache": "off"})
    warming = Client()
    for name in data:
        warming.read(f"/data/{name}")
    warming.close()
    agent = AgentClient(Settings.from_env())
    before = agent.stats()
    reader = Client()
    for name, body in data.items():
        assert reader.read(f"/data/{name}") == body
    assert reader.read("/off/000.bin") == data["000.bin"]
    eventually(lambda: agent.stats().hits == before.hits + FILES, "the idle reader's few hits reported")
    eventually(lambda: agent.stats().misses == before.misses + 1, "and its read past the cache")
    reader.close()


def test_reads_past_the_cache_count_as_direct_misses(data: dict[str, bytes], tmp_path: Path) -> None:
    """A mount with cache=off reads the store from the reader itself: the agent never sees those
    reads but counts what the reader reports, so `cache stats` and store MB/s cover them."""
    Namespace().add_mount("/off", f"file://{tmp_path / 'src'}", {"cache": "off"})
    assert gpufeed.client().agent.stats().misses == 0  # started: readers report to a running agent, never start one
    for name, body in data.items():
        assert gpufeed.read(f"/off/{name}") == body
    gpufeed.client().hits.flush()
    seen = agent_metrics()
    assert seen[("gpufeed_misses_total", (("mount", "/off"), ("tier", "direct")))] == FILES
    assert seen[("gpufeed_miss_bytes_total", (("mount", "/off"), ("tier", "direct")))] == sum(map(len, data.values()))
    assert seen[("gpufeed_cache_blocks", ())] == 0, "nothing cached"
    assert gpufeed.client().agent.stats().misses == FILES


def test_a_bad_or_taken_metrics_address_is_one_line_and_a_failed_start(tmp_path: Path) -> None:
    agent = [sys.executable, "-m", "gpufeed.agent", "--cache-dir", str(tmp_path / "cache")]
    bad = subprocess.run([*agent, "--metrics-addr", "localhost:http"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "--metrics-addr 'localhost:http'" in bad.stderr
    with helper([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port := free_port())],
                "http.server", tmp_path / "http.log", port=port):
        taken = subprocess.run([*agent, "--metrics-addr", str(port)], capture_output=True, text=True, timeout=60)
    assert taken.returncode == 1, taken.stderr
    assert f"--metrics-addr {port}: " in taken.stderr and "Traceback" not in taken.stderr
