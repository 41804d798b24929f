"""One local two-node Ray cluster for the pool's tests (Ray takes seconds to start on two cores),
stopped when they are done, before the rest of the suite runs: each node declares one fake 16 GiB
GPU as the pool's custom resources and names its gpufeed agent (`AGENTS`). Tests use their own pool names, so each gets a fresh
scheduler, and release what they lease."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import ray
from ray.cluster_utils import Cluster

from gpufeed.pool import inventory
from gpufeed.pool.client import connect

GIB = 1 << 30
AGENTS = ("agent-a", "agent-b")
"""The cache-cluster node ids the two Ray nodes declare as their agents (data-aware placement)."""
T = TypeVar("T")


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    gpu = inventory.resources(inventory.fake(1, 16 * GIB))
    head = gpu | inventory.agent_marker(AGENTS[0])
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": head, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=1, resources=gpu | inventory.agent_marker(AGENTS[1]))
        nodes.wait_for_nodes()
        connect(nodes.address)
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


def eventually(probe: Callable[[], T | None], what: str, timeout: float = 20.0) -> T:
    """Poll `probe` until it returns something truthy, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def running(marker: str) -> bool:
    """Some process's command line contains `marker`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    return True
        except OSError:
            continue
    return False
