"""Real agents joined in a cache cluster on loopback, one process each with its own cache dir and
peer port, for the cluster's tests and the GPU pool's placement tests."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpufeed.bench.children import free_port
from gpufeed.client.connection import AgentClient, AgentUnavailable
from gpufeed.cluster.membership import status
from gpufeed.config import Settings
from gpufeed.rpc.messages import Metrics, MetricsText

TOKEN = "cluster-test-token-0123456789"


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
        """How many live members this node's agent sees; 0 while it starts (it joins the cluster
        before its local socket serves)."""
        try:
            text = AgentClient(self.settings()).request(Metrics(), MetricsText, start=False).text
        except AgentUnavailable:
            assert self.process.poll() is None, f"{self.name}'s agent exited: {self.log.read_text()}"
            return 0
        return int(float(re.search(r"^gpufeed_cluster_members (\S+)$", text, re.M)[1]))  # type: ignore[index]

    def read_all(self, paths: list[str]) -> dict[str, str]:
        code = "import hashlib, sys, gpufeed\nfor p in sys.argv[1:]: print(p, hashlib.sha256(gpufeed.read(p)).hexdigest())"
        done = subprocess.run([sys.executable, "-c", code, *paths], env=self.env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return dict(line.split() for line in done.stdout.splitlines())


def random_files(directory: Path, count: int, size: int, nspath: str) -> dict[str, str]:
    """`count` files of random bytes (`size` + n bytes each) written into `directory` (made);
    their paths under the namespace path `nspath`, to their sha256."""
    directory.mkdir(parents=True, exist_ok=True)
    digests = {}
    for i in range(count):
        body = os.urandom(size + i)
        (directory / f"{i:03d}.bin").write_bytes(body)
        digests[f"{nspath}/{i:03d}.bin"] = hashlib.sha256(body).hexdigest()
    return digests


def wait(condition, what: str, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


@contextmanager
def joined(url: str, names: list[str], where: Path) -> Iterator[list[Member]]:
    """Agents named `names` joined through the Redis at `url` (GPUFEED_CLUSTER_TOKEN must be set),
    each seeing all the others; stopped with SIGTERM on exit."""
    members = []
    for name in names:
        cache, port = where / name, free_port()
        cache.mkdir()
        log = where / f"{name}.log"
        argv = [sys.executable, "-m", "gpufeed.agent", "--cache-dir", str(cache), "--cluster", url,
                "--peer-addr", f"127.0.0.1:{port}", "--node-id", name]
        with open(log, "wb") as sink:
            process = subprocess.Popen(argv, stdout=sink, stderr=sink)
        members.append(Member(name, cache, port, process, log))
    try:
        wait(lambda: len(asyncio.run(status(url))) == len(names), f"{len(names)} live members")
        for member in members:
            wait(lambda member=member: member.sees() == len(names), f"{member.name} to see the others")
        yield members
    finally:
        for member in members:
            if member.process.poll() is None:
                member.process.send_signal(signal.SIGTERM)
        for member in members:
            member.process.wait(timeout=30)
