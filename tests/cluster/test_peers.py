"""A cache cluster on loopback: three real agents (one process each, own cache dir, own peer
port) join through a real redis-server and read an nginx-served dataset. Each block is fetched
from the store once for the whole cluster; a killed node is skipped and the store serves its
blocks; the peer API refuses a wrong token, garbage and oversized requests."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufeed.bench.children import free_port
from gpufeed.client.connection import AgentClient
from gpufeed.cluster.membership import status
from gpufeed.config import Settings
from gpufeed.namespace import Namespace
from gpufeed.rpc.messages import Metrics, MetricsText
from tests.conftest import HttpServer

TOKEN = "cluster-test-token-0123456789"
FILES = 48


@dataclass
class Member:
    name: str
    cache: Path
    port: int
    process: subprocess.Popen
    log: Path

    def env(self) -> dict[str, str]:
        return {**os.environ, "GPUFEED_CACHE_DIRS": str(self.cache)}

    def settings(self) -> Settings:
        return dataclasses.replace(Settings.from_env(), cache_dirs=(self.cache,))

    def sees(self) -> int:
        """How many live members this node's agent sees."""
        text = AgentClient(self.settings()).request(Metrics(), MetricsText, start=False).text
        return int(float(re.search(r"^gpufeed_cluster_members (\S+)$", text, re.M)[1]))  # type: ignore[index]

    def read_all(self, paths: list[str]) -> dict[str, str]:
        code = "import hashlib, sys, gpufeed\nfor p in sys.argv[1:]: print(p, hashlib.sha256(gpufeed.read(p)).hexdigest())"
        done = subprocess.run([sys.executable, "-c", code, *paths], env=self.env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return dict(line.split() for line in done.stdout.splitlines())


def wait(condition, what: str, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


@pytest.fixture
def cluster(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[Member]]]:
    url = redis_url.rsplit("/", 1)[0] + "/7"
    monkeypatch.setenv("GPUFEED_CLUSTER_TOKEN", TOKEN)
    members = []
    for i in range(3):
        cache, port = tmp_path / f"node{i}", free_port()
        cache.mkdir()
        log = tmp_path / f"node{i}.log"
        argv = [sys.executable, "-m", "gpufeed.agent", "--cache-dir", str(cache), "--cluster", url,
                "--peer-addr", f"127.0.0.1:{port}", "--node-id", f"node{i}"]
        with open(log, "wb") as sink:
            process = subprocess.Popen(argv, stdout=sink, stderr=sink)
        members.append(Member(f"node{i}", cache, port, process, log))
    try:
        wait(lambda: len(asyncio.run(status(url))) == 3, "three live members")
        for member in members:
            wait(lambda member=member: member.sees() == 3, f"{member.name} to see the others")
        yield url, members
    finally:
        for member in members:
            if member.process.poll() is None:
                member.process.send_signal(signal.SIGTERM)
        for member in members:
            member.process.wait(timeout=30)


@pytest.fixture
def dataset(nginx: HttpServer, tmp_path: Path) -> tuple[list[str], dict[str, str], str]:
    site = nginx.root / f"cluster-{tmp_path.name}"
    site.mkdir()
    digests = {}
    for i in range(FILES):
        body = os.urandom(30_000 + i)
        (site / f"{i:03d}.bin").write_bytes(body)
        digests[f"/data/{i:03d}.bin"] = hashlib.sha256(body).hexdigest()
    Namespace().add_mount("/data", f"{nginx.url}/{site.name}")
    return sorted(digests), digests, site.name


def gets(nginx: HttpServer, site: str) -> int:
    time.sleep(0.2)  # nginx logs a request after answering it
    return len(re.findall(rf'"GET /{site}/\d+\.bin ', nginx.access_log.read_text()))


def test_each_block_is_fetched_from_the_store_once_for_the_whole_cluster(
    cluster: tuple[str, list[Member]], dataset: tuple[list[str], dict[str, str], str], nginx: HttpServer
) -> None:
    url, members = cluster
    paths, digests, site = dataset
    for member in members:
        assert member.read_all(paths) == digests
    assert gets(nginx, site) == FILES, "three nodes read every file; the store served each once"
    nodes = {node["id"]: node for node in asyncio.run(status(url))}
    served = sum(node["served_blocks"] for node in nodes.values())
    assert served >= FILES, nodes  # every block a node did not own came from its owner
    owned = [node["store_bytes"] for node in nodes.values()]
    assert sum(owned) == sum(30_000 + i for i in range(FILES)) and all(owned), "each owner fetched its share, once"

    members[1].process.kill()  # kill -9: no goodbye, its membership lingers until the TTL
    members[1].process.wait()
    AgentClient(members[0].settings()).clear()
    began = time.monotonic()
    assert members[0].read_all(paths) == digests, "every byte right with an owner dead"
    assert time.monotonic() - began < 15
    log = members[0].log.read_text()
    assert "peer node1 (127.0.0.1:" in log and "is suspect" in log, log
    wait(lambda: {node["id"] for node in asyncio.run(status(url))} == {"node0", "node2"}, "node1 to drop out")


def test_the_peer_api_refuses_a_wrong_token_garbage_and_oversized_requests(cluster: tuple[str, list[Member]]) -> None:
    _, members = cluster
    target = f"http://127.0.0.1:{members[0].port}/v1/block"

    def post(body: bytes, token: str) -> int:
        request = urllib.request.Request(target, data=body, headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert post(b"\x81\xa4type", "wrong-token-wrong-token") == 401
    assert post(b"\x81\xa4type", TOKEN) == 400
    assert post(b"not msgpack at all", TOKEN) == 400
    assert post(b"\0" * (2 << 20), TOKEN) == 413
    assert members[0].process.poll() is None, "the agent lives on"
    assert "refused: wrong or missing cluster token" in members[0].log.read_text()


def test_cluster_status_lists_the_live_nodes_and_bad_settings_are_one_line(
    cluster: tuple[str, list[Member]], tmp_path: Path
) -> None:
    url, members = cluster
    shown = subprocess.run([sys.executable, "-m", "gpufeed", "cluster", "status", "--cluster", url, "--json"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    nodes = json.loads(shown.stdout)
    assert [node["id"] for node in nodes] == ["node0", "node1", "node2"]
    assert all(node["address"] == f"127.0.0.1:{m.port}" and node["limit"] > 0 for node, m in zip(nodes, members, strict=True))
    table = subprocess.run([sys.executable, "-m", "gpufeed", "cluster", "status", "--cluster", url],
                           capture_output=True, text=True, timeout=60)
    assert "3 live nodes" in table.stdout and "node1" in table.stdout
    for argv, needle in [
        (["cluster", "status", "--cluster", "http://nowhere"], "expected redis://HOST:PORT"),
        (["cluster", "status", "--cluster", f"redis://127.0.0.1:{free_port()}/0"], "Connect"),
        (["agent", "--cache-dir", str(tmp_path / "x"), "--cluster", url], "needs --peer-addr HOST:PORT"),
    ]:
        failed = subprocess.run([sys.executable, "-m", "gpufeed", *argv], capture_output=True, text=True, timeout=60)
        assert failed.returncode != 0 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr
        assert failed.stderr.startswith("gpufeed: error: ") and needle in failed.stderr, failed.stderr
    unset = {k: v for k, v in os.environ.items() if k != "GPUFEED_CLUSTER_TOKEN"}
    no_token = subprocess.run([sys.executable, "-m", "gpufeed", "agent", "--cache-dir", str(tmp_path / "y"), "--cluster", url,
                               "--peer-addr", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60, env=unset)
    assert no_token.returncode != 0 and "GPUFEED_CLUSTER_TOKEN" in no_token.stderr and "Traceback" not in no_token.stderr
