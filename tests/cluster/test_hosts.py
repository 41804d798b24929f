"""The cache cluster across real separate hosts: three agents, each in its own network
namespace joined by a veth pair to a bridge, a real redis-server and nginx behind the latency
shaper on the bridge. A node cut off mid-epoch, by its link going down or by kill -9, is skipped
within the suspect timeout while two other nodes read, every byte still arrives, and the node
serves again once it is back."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from gpufeed.agent.peers import UNACKED_S
from gpufeed.bench.children import free_port
from gpufeed.bench.netns import Host, bridged_hosts
from gpufeed.bench.shaper import shaping
from gpufeed.namespace import Namespace
from tests.cluster.members import random_files
from tests.conftest import HttpServer

TOKEN = "netns-cluster-token-0123456789"
FILES = 60
READER = """
import hashlib, sys, time, gpufeed
paths = sys.argv[2:]
slowest = 0.0
for i, p in enumerate(paths):
    if sys.argv[1] == "pause" and i == len(paths) // 2:
        print("half", flush=True)  # the test cuts a node now, then lets the epoch go on
        sys.stdin.readline()
    began = time.monotonic()
    data = gpufeed.read(p)
    slowest = max(slowest, time.monotonic() - began)
    print(p, hashlib.sha256(data).hexdigest(), flush=True)
print("slowest", slowest)
"""
WORST_READ_S = UNACKED_S + 1.5
"""A read may wait out the suspect timeout once, then the store (a loaded machine's margin)."""


@dataclass
class Node:
    host: Host
    cache: Path
    process: subprocess.Popen
    log: Path

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """A process on this host (agents listen on abstract sockets, which are per namespace)."""
        env = {**os.environ, "GPUFEED_CACHE_DIRS": str(self.cache)}
        return subprocess.run(self.host.command([sys.executable, *argv]), env=env, capture_output=True, text=True, timeout=120)

    def metric(self, name: str, labels: str = "") -> float:
        assert self.process.poll() is None, self.log.read_text()
        done = self.run("-m", "gpufeed", "metrics")
        found = re.search(rf"^gpufeed_{name}{re.escape(labels)} (\S+)$", done.stdout, re.M)
        return float(found[1]) if found else 0.0

    def store_fetches(self) -> float:
        return self.metric("misses_total", '{mount="/data",tier="store"}')

    def clear(self) -> None:
        assert self.run("-m", "gpufeed", "cache", "clear").returncode == 0

    def read_all(self, paths: list[str]) -> tuple[dict[str, str], float]:
        done = self.run("-c", READER, "straight", *paths)
        assert done.returncode == 0, done.stderr
        return _digests(done.stdout)

    def start(self, argv: list[str]) -> subprocess.Popen[str]:
        env = {**os.environ, "GPUFEED_CACHE_DIRS": str(self.cache)}
        return subprocess.Popen(self.host.command([sys.executable, *argv]), env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _digests(output: str) -> tuple[dict[str, str], float]:
    lines = dict(line.split() for line in output.splitlines())
    return {k: v for k, v in lines.items() if k != "slowest"}, float(lines["slowest"])


def read_while_cut(readers: list[Node], paths: list[str], cut: Callable[[], None]) -> list[tuple[dict[str, str], float]]:
    """`readers` read `paths` at once; halfway through, with every reader paused, `cut` runs."""
    running = [reader.start(["-c", READER, "pause", *paths]) for reader in readers]
    before = []
    for process in running:
        assert process.stdout is not None
        lines = []
        while (line := process.stdout.readline()) != "half\n":
            assert line, process.communicate(timeout=30)[1]  # it ended before halfway
            lines.append(line)
        before.append("".join(lines))
    cut()
    results = []
    for process, first in zip(running, before, strict=True):
        out, err = process.communicate("go\n", timeout=120)
        assert process.returncode == 0, err
        results.append(_digests(first + out))
    return results


def wait(condition, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def hosts() -> Iterator[tuple[str, list[Host]]]:
    if os.geteuid() != 0:
        pytest.fail("the cluster tests need root for network namespaces (the README's test command runs as root)")
    with bridged_hosts(3) as made:
        yield made


def test_a_node_cut_off_mid_epoch_by_link_or_kill_is_skipped_and_comes_back(
    hosts: tuple[str, list[Host]], nginx: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bridge, members = hosts
    site = nginx.root / f"hosts-{tmp_path.name}"
    digests = random_files(site, FILES, 20_000, "/data")
    paths = sorted(digests)
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", bridge, "--save", "", "--appendonly", "no",
                              "--protected-mode", "no"],  # bound to the test's own bridge only
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    monkeypatch.setenv("GPUFEED_CLUSTER_TOKEN", TOKEN)
    upstream = urlsplit(nginx.url)
    nodes: list[Node] = []
    try:
        with shaping((upstream.hostname or "127.0.0.1", upstream.port or 80), 5, None, tmp_path / "shaper.log", bridge) as port:
            Namespace().add_mount("/data", f"http://{bridge}:{port}/{site.name}")

            def agent_argv(i: int) -> list[str]:
                return [sys.executable, "-m", "gpufeed.agent", "--cache-dir", str(tmp_path / f"node{i}"), "--cluster",
                        f"redis://{bridge}:{redis_port}/0", "--peer-addr", f"{members[i].address}:7070", "--node-id",
                        f"node{i}"]

            for i, host in enumerate(members):
                cache, log = tmp_path / f"node{i}", tmp_path / f"node{i}.log"
                cache.mkdir()
                with open(log, "wb") as sink:
                    nodes.append(Node(host, cache, subprocess.Popen(host.command(agent_argv(i)), stdout=sink, stderr=sink), log))
            for node in nodes:
                wait(lambda node=node: node.metric("cluster_members") == 3, f"{node.host.name} to see the others")

            def store_gets() -> int:
                time.sleep(0.2)  # nginx logs a request after answering it
                return len(re.findall(rf'"GET /{site.name}/\d+\.bin ', nginx.access_log.read_text()))

            assert nodes[0].read_all(paths)[0] == digests
            assert nodes[1].read_all(paths)[0] == digests
            assert store_gets() == FILES, "two nodes, each block from the store once"

            for node in nodes[:2]:
                node.clear()  # node0 and node1 keep no copy of node2's blocks, so they must ask it
            for got, slowest in read_while_cut(nodes[:2], paths, nodes[2].host.link_down):  # off the network, agent running
                assert got == digests, "every byte right with an owner unreachable"
                assert slowest < WORST_READ_S, f"a read waited {slowest:.1f} s for a peer gone off the network"
            for node in nodes[:2]:
                assert node.metric("cluster_suspects") >= 1
                assert "is suspect" in node.log.read_text()

            nodes[2].host.link_up()
            wait(lambda: nodes[0].metric("cluster_suspects") == 0, "node2 to answer again")
            served = nodes[2].metric("peer_served_total")
            before = store_gets(), [node.store_fetches() for node in nodes]
            nodes[0].clear()
            assert nodes[0].read_all(paths)[0] == digests
            assert nodes[2].metric("peer_served_total") > served, "node2 serves again"
            after = store_gets(), [node.store_fetches() for node in nodes]
            assert after[1][1:] == before[1][1:], "the peers served from their caches"
            assert after[0] - before[0] == after[1][0] - before[1][0] < FILES, "node0 fetched only the blocks it owns"

            for node in nodes[:2]:
                node.clear()
            for got, slowest in read_while_cut(nodes[:2], paths, nodes[2].process.kill):  # kill -9: no goodbye
                assert got == digests, "every byte right with an owner killed"
                assert slowest < WORST_READ_S, f"a read waited {slowest:.1f} s for a killed peer"
            nodes[2].process.wait(timeout=20)
            with open(nodes[2].log, "ab") as sink:  # the same node, restarted on its cache
                nodes[2].process = subprocess.Popen(nodes[2].host.command(agent_argv(2)), stdout=sink, stderr=sink)
            wait(lambda: nodes[0].metric("cluster_suspects") == 0 and nodes[0].metric("cluster_members") == 3,
                 "node2 to rejoin")
            nodes[0].clear()
            assert nodes[0].read_all(paths)[0] == digests
            assert nodes[2].metric("peer_served_total") > 0, "the restarted node2 serves its blocks"
    finally:
        for node in nodes:
            node.process.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                node.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                node.process.kill()
        redis.terminate()
        redis.wait(timeout=20)
