"""Pipeline sharing across nodes (issue 17 item 4): a pandas job on node A writes Parquet to
`gpufeed://`, a job on node B reads it. Two nodes on loopback are two agents with their own cache
dirs and one Redis manifest, so B sees what A recorded. Without a cluster B reads the store; in a
cache cluster a block A owns comes from A's cache (where A's upload left it), never the store."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest

import gpufeed
from gpufeed.blocks import object_blocks
from gpufeed.client.connection import AgentClient, stop_agent
from gpufeed.cluster.ownership import Node, owners
from gpufeed.config import Settings
from gpufeed.mount_options import CachePolicy, source_options
from gpufeed.namespace import Namespace
from gpufeed.rpc.messages import Metrics, MetricsText
from tests.agent.test_metrics import samples
from tests.cluster.members import TOKEN, Member, joined
from tests.conftest import Bucket
from tests.writes.test_writes import moto_requests

DB = 9
"""The cluster's Redis database: its own, so no other test's members are counted."""

READ = """\
import os, sys, pandas
for path in sys.argv[1:]:
    frame = pandas.read_parquet('gpufeed://' + path)
    print(path, int(pandas.util.hash_pandas_object(frame).sum()), flush=True)
os._exit(0)
"""
"""Node B's job: each partition read with pandas (pyarrow), printed as a digest of its frame. It
ends with os._exit: pyarrow's reader threads now and then abort the interpreter's shutdown
after the work is done (apache/arrow#34314)."""

pytestmark = pytest.mark.parametrize("meta_url", ["redis"], indirect=True)


def partition(i: int) -> pd.DataFrame:
    """A partition of a few KiB, one block: an object of several blocks that has a content hash is
    read whole from the store and checked against the hash (`Job.verified_whole`), never through a peer."""
    return pd.DataFrame({"label": range(i * 500, (i + 1) * 500), "path": [f"img/{i}/{j}.jpg" for j in range(500)]})


def digest(frame: pd.DataFrame) -> str:
    return str(int(pd.util.hash_pandas_object(frame).sum()))


def read_on(env: dict[str, str], paths: list[str]) -> dict[str, str]:
    """Node B's job, a process of its own on node B's agent: path → digest of the frame it read."""
    done = subprocess.run([sys.executable, "-c", READ, *paths], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dict(line.split() for line in done.stdout.splitlines())


@pytest.fixture
def out(namespace: Namespace, bucket: Bucket) -> Bucket:
    """/out, writable, on a moto bucket, in the manifest both nodes share."""
    namespace.add_mount("/out", bucket.url, {"endpoint": bucket.endpoint}, writable=True, allow_empty=True)
    return bucket


def test_another_node_reads_a_written_parquet_from_the_store(out: Bucket, server_dir: Path, tmp_path: Path) -> None:
    frame = pd.DataFrame({"label": range(5000), "path": [f"img/{i}.jpg" for i in range(5000)]})
    frame.to_parquet("gpufeed:///out/etl/index.parquet")  # node A: this process and its agent
    gpufeed.sync("/out/etl")
    log = server_dir / "moto.log"
    assert moto_requests(out, log, "GET", "etl/index.parquet") == 0
    node_b = tmp_path / "node-b"
    try:
        read = read_on({**os.environ, "GPUFEED_CACHE_DIRS": str(node_b)}, ["/out/etl/index.parquet"])
    finally:
        stop_agent(dataclasses.replace(Settings.from_env(), cache_dirs=(node_b,)))
    assert read == {"/out/etl/index.parquet": digest(frame)}, "node B gets the frame node A wrote"
    assert moto_requests(out, log, "GET", "etl/index.parquet") == 1, "node B's cache is its own: the store served it"
    assert moto_requests(out, log, "PUT", "etl/index.parquet") == 1, "uploaded once, by node A"


@pytest.fixture
def nodes(out: Bucket, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Member]]:
    """nodeA and nodeB in a cache cluster; this process is a job on nodeA."""
    monkeypatch.setenv("GPUFEED_CLUSTER_TOKEN", TOKEN)
    with joined(redis_url.rsplit("/", 1)[0] + f"/{DB}", ["nodeA", "nodeB"], tmp_path) as members:
        monkeypatch.setenv("GPUFEED_CACHE_DIRS", str(members[0].cache))
        gpufeed._default = None
        yield members


def owner(namespace: Namespace, path: str, members: list[Member]) -> str:
    """The member owning the one block of `path`, from the manifest as every agent computes it."""
    where = namespace.resolve(path)
    assert where is not None
    info = namespace.stat(path).info
    assert info is not None
    block_size = CachePolicy.of(where.mount, Settings.from_env()).block_size
    blocks = object_blocks(where.mount.url, source_options(where.mount), info, block_size, not where.mount.immutable)
    assert blocks.count == 1
    (node,) = owners(blocks.block(0).name, [Node(member.name, "") for member in members])
    return node.id


def metric(member: Member, name: str, **labels: str) -> float:
    text = AgentClient(member.settings()).request(Metrics(), MetricsText, start=False).text
    return samples(text).get((f"gpufeed_{name}", tuple(sorted(labels.items()))), 0.0)


def test_in_a_cluster_another_node_reads_what_the_writer_owns_from_its_cache(
    nodes: list[Member], namespace: Namespace, out: Bucket, server_dir: Path
) -> None:
    node_a, node_b = nodes
    paths: list[str] = []
    frames: dict[str, pd.DataFrame] = {}
    by_owner: dict[str, list[str]] = {"nodeA": [], "nodeB": []}
    while len(paths) < 4 or not all(by_owner.values()):  # the owners follow the bucket's random name
        assert len(paths) < 64, by_owner
        path = f"/out/etl/part-{len(paths):03d}.parquet"
        frames[path] = partition(len(paths))
        frames[path].to_parquet(f"gpufeed://{path}")
        paths.append(path)
        by_owner[owner(namespace, path, nodes)].append(path)
    gpufeed.sync("/out/etl")

    assert read_on(node_b.env(), paths) == {path: digest(frame) for path, frame in frames.items()}
    log = server_dir / "moto.log"
    gets = {path: moto_requests(out, log, "GET", path.removeprefix("/out/")) for path in paths}
    assert gets == {path: int(path in by_owner["nodeB"]) for path in paths}, (
        "node A's blocks came from its cache; node B fetched its own from the store, once each")
    assert all(moto_requests(out, log, "PUT", path.removeprefix("/out/")) == 1 for path in paths)
    assert metric(node_a, "peer_served_total") == len(by_owner["nodeA"])
    assert metric(node_b, "misses_total", mount="/out", tier="peer") == len(by_owner["nodeA"])
    assert metric(node_b, "misses_total", mount="/out", tier="store") == len(by_owner["nodeB"])
