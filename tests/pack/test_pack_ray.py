"""`gpufeed pack --ray`: shards written as tasks of a real local Ray cluster (two nodes), the
namespace on Redis as a multi-node setup needs; the index equals a pack made without Ray."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray.cluster_utils import Cluster

from gpufeed.pack.layout import INDEX_KEY
from tests.cli.test_cli import fails, ok
from tests.conftest import Bucket
from tests.pack.test_pack import files_in, opts


@pytest.fixture
def ray_cluster() -> Iterator[str]:
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=1)
        nodes.wait_for_nodes()
        yield nodes.address
    finally:
        nodes.shutdown()


def test_pack_on_a_ray_cluster_writes_the_same_pack(
    bucket: Bucket, redis_url: str, ray_cluster: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFEED_META", f"{redis_url}?prefix=r{uuid.uuid4().hex[:10]}")
    files_in(bucket, "raw", 90, seed=5)
    ok("mount", "add", "/raw", f"{bucket.url}/raw", *opts(bucket))
    args = ["--shard-size", "256KiB", "--quiet", *opts(bucket)]
    ok("pack", "/raw", f"{bucket.url}/here", *args)
    out = ok("pack", "/raw", f"{bucket.url}/ray", "--ray", ray_cluster, "--json", *args)
    assert '"written": 0' not in out and '"kept": 0' in out, out

    def pack(prefix: str) -> dict[str, str]:
        listing = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=f"{prefix}/")  # type: ignore[attr-defined]
        return {item["Key"].removeprefix(prefix): item["ETag"] for item in listing["Contents"]}

    here = pack("here")
    assert sum(key.endswith(".gfp") for key in here) > 2 and f"/{INDEX_KEY}" in here
    assert pack("ray") == here, "every shard, digest file and the index are the same objects"


def test_pack_with_an_unreachable_ray_cluster_is_one_line(bucket: Bucket, tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x" * 100)
    ok("mount", "add", "/src", f"file://{tmp_path / 'src'}")
    line = fails(1, "pack", "/src", f"file://{tmp_path / 'out'}", "--ray", "127.0.0.1:1", "--quiet")
    assert "no Ray cluster at 127.0.0.1:1" in line, line
    assert not (tmp_path / "out" / INDEX_KEY).exists()
