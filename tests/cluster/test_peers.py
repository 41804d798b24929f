"""A cache cluster on loopback: three real agents (one process each, own cache dir, own peer
port) join through a real redis-server and read an nginx-served dataset. Each block is fetched
from the store once for the whole cluster; a killed node is skipped and the store serves its
blocks; the peer API refuses a wrong token, garbage and oversized requests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import http.client
import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from gpufeed.agent.peers import PEER_BATCH_BLOCKS, PEER_BATCH_BYTES, REQUESTS_PER_PEER, OwnerQueue, load_token
from gpufeed.bench.children import free_port
from gpufeed.client import agent_service
from gpufeed.client.connection import AgentClient
from gpufeed.cluster.membership import status
from gpufeed.namespace import Namespace
from gpufeed.rpc.messages import Metrics, MetricsText, PeerFetch
from tests.cluster.members import TOKEN, Member, joined, random_files, wait
from tests.cluster.tls import cluster_certificates
from tests.conftest import HttpServer

FILES = 48


@pytest.fixture
def cluster(redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[Member]]]:
    url = redis_url.rsplit("/", 1)[0] + "/7"
    monkeypatch.setenv("GPUFEED_CLUSTER_TOKEN", TOKEN)
    with joined(url, [f"node{i}" for i in range(3)], tmp_path) as members:
        yield url, members


@pytest.fixture
def dataset(nginx: HttpServer, tmp_path: Path) -> tuple[list[str], dict[str, str], str]:
    site = nginx.root / f"cluster-{tmp_path.name}"
    digests = random_files(site, FILES, 30_000, "/data")
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

    def published() -> dict[str, dict] | None:  # a node's counts reach Redis on its next heartbeat
        nodes = {node["id"]: node for node in asyncio.run(status(url))}
        served = sum(node["served_blocks"] for node in nodes.values())
        return nodes if len(nodes) == 3 and served >= 2 * FILES else None

    # every block was read by its owner and by two nodes that asked the owner for it
    nodes = wait(published, "each node's heartbeat to publish the blocks it served", timeout=10)
    assert sum(node["served_blocks"] for node in nodes.values()) == 2 * FILES, nodes
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


def test_blocks_wanted_from_one_owner_at_once_go_in_few_requests(
    cluster: tuple[str, list[Member]], dataset: tuple[list[str], dict[str, str], str]
) -> None:
    """A batch's reads (a DataLoader's `__getitems__`) of blocks other nodes own cost a request
    per owner and batch of up to PEER_BATCH_BLOCKS, not one per block, at either end."""
    _, members = cluster
    paths, digests, _ = dataset
    assert members[0].read_all(paths) == digests  # every owner has its share cached

    def served() -> tuple[float, float]:
        totals = [0.0, 0.0]
        for member in members[1:]:
            text = AgentClient(member.settings()).request(Metrics(), MetricsText, start=False).text
            for i, name in enumerate(("gpufeed_peer_served_total", "gpufeed_peer_requests_total")):
                totals[i] += float(re.search(rf"^{name} (\S+)$", text, re.M)[1])  # type: ignore[index]
        return totals[0], totals[1]

    blocks_before, requests_before = served()
    code = ("import hashlib, sys, gpufeed\n"
            "for p, v in zip(sys.argv[1:], gpufeed.client().read_files(sys.argv[1:])): print(p, hashlib.sha256(v).hexdigest())")
    AgentClient(members[0].settings()).clear()
    done = subprocess.run([sys.executable, "-c", code, *paths], env=members[0].env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert dict(line.split() for line in done.stdout.splitlines()) == digests
    blocks, requests = (after - before for after, before in zip(served(), (blocks_before, requests_before), strict=True))
    assert blocks >= FILES / 3, "node1 and node2 served node0 the blocks they own"
    assert requests <= blocks / 4, f"{requests:.0f} requests for {blocks:.0f} blocks"


def test_requests_past_the_first_two_to_a_peer_wait_for_a_full_batch() -> None:
    """Two requests to an owner go with whatever is queued; more only carry full batches (by
    count, or by bytes for big blocks), up to REQUESTS_PER_PEER."""
    queue = OwnerQueue()

    def want(length: int = 64 << 10) -> bool:
        go = queue.add((None, 0, length, concurrent.futures.Future()))  # type: ignore[arg-type]
        queue.senders += go
        return go

    assert want() and want(), "the first two go at once"
    assert not any(want() for _ in range(PEER_BATCH_BLOCKS - 3))
    assert want(), "a full batch is waiting"
    queue.take()
    assert not want(), "a part batch waits for a sender"
    assert want(PEER_BATCH_BYTES), "a batch full by bytes goes too"
    queue.senders = REQUESTS_PER_PEER
    assert not want(PEER_BATCH_BYTES), "never more than REQUESTS_PER_PEER"


def test_an_object_checked_whole_is_fetched_once_by_its_owner_and_passed_block_by_block(
    cluster: tuple[str, list[Member]], nginx: HttpServer, tmp_path: Path
) -> None:
    """A file whose sha256 is known (from a checksums file, or a write) is cached only after the
    whole file matched it. Its blocks have one owner, which fetches it once; the other nodes
    ask that owner for each block and check the assembled file against the hash themselves."""
    url, members = cluster
    site = nginx.root / f"hashed-{tmp_path.name}"
    site.mkdir()
    digests, sums = {}, []
    for i in range(12):
        body = os.urandom(30_000 + i)
        (site / f"{i:03d}.bin").write_bytes(body)
        digests[f"/hashed/{i:03d}.bin"] = hashlib.sha256(body).hexdigest()
        sums.append(f"{digests[f'/hashed/{i:03d}.bin']}  {i:03d}.bin\n")
    (tmp_path / "SHA256SUMS").write_text("".join(sums))
    Namespace().add_mount("/hashed", f"{nginx.url}/{site.name}", {"block_size": "8KiB"},
                          checksums=str(tmp_path / "SHA256SUMS"))
    paths = sorted(digests)
    for member in members:
        assert member.read_all(paths) == digests
    assert gets(nginx, site.name) == len(paths), "each file came from the store once, whole, for the whole cluster"
    blocks = 4 * len(paths)  # 30 KB in 8 KiB blocks

    def served() -> int | None:  # a node's counts reach Redis on its next heartbeat
        total = sum(node["served_blocks"] for node in asyncio.run(status(url)))
        return total if total >= 2 * blocks else None

    assert wait(served, "the nodes' heartbeats to publish the blocks they served", timeout=10) == 2 * blocks, (
        "every block went from its owner to each of the two other nodes"
    )


def test_a_cluster_warmup_caches_each_block_once_on_its_owner(
    cluster: tuple[str, list[Member]], dataset: tuple[list[str], dict[str, str], str], nginx: HttpServer
) -> None:
    _, members = cluster
    paths, digests, site = dataset

    def warmup(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "gpufeed", "warmup", "/data", "--cluster", "--json", "--quiet"]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)

    done = warmup(members[0].env())
    assert done.returncode == 0, done.stderr
    total = sum(30_000 + i for i in range(FILES))
    expected = {"files": FILES, "bytes": total, "fetched_bytes": total, "uncached_bytes": 0, "evicted_bytes": 0, "seconds": 0}
    assert json.loads(done.stdout) | {"seconds": 0} == expected
    assert gets(nginx, site) == FILES, "the store served each file once"
    cached = [len(list((member.cache / "blocks").rglob("*-*"))) for member in members]
    assert sum(cached) == FILES and all(cached), f"each block cached once, on its owner, and every node owns some: {cached}"
    again = warmup(members[2].env())
    assert again.returncode == 0 and json.loads(again.stdout)["fetched_bytes"] == 0, "found cached at the owners"
    assert members[1].read_all(paths) == digests
    assert gets(nginx, site) == FILES, "a node that warmed nothing itself reads from the owners"
    alone = warmup({**os.environ, "GPUFEED_CACHE_DIRS": str(members[0].cache.parent / "alone")})
    assert alone.returncode != 0 and "not in a cache cluster" in alone.stderr, alone.stderr
    assert len(alone.stderr.strip().splitlines()) == 1, alone.stderr


def test_owner_only_copies_are_evicted_first_so_the_cluster_holds_a_dataset_no_node_could(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    dataset: tuple[list[str], dict[str, str], str], nginx: HttpServer,
) -> None:
    """Three nodes with 1 MB caches and a 1.5 MB dataset: with `copies=owner-only` each node's
    own third stays cached while the copies it read from the others make room, so epoch after
    epoch the store serves each file once."""
    _, digests, site = dataset
    Namespace().add_mount("/lean", f"{nginx.url}/{site}", {"copies": "owner-only"})
    lean = {path.replace("/data/", "/lean/"): digest for path, digest in digests.items()}
    monkeypatch.setenv("GPUFEED_CLUSTER_TOKEN", TOKEN)
    monkeypatch.setenv("GPUFEED_CACHE_SIZE", "1000000")
    with joined(redis_url.rsplit("/", 1)[0] + "/8", [f"node{i}" for i in range(3)], tmp_path) as members:
        for _ in range(2):
            for member in members:
                assert member.read_all(sorted(lean)) == lean
        assert gets(nginx, site) == FILES, "no owner lost its own blocks to copies"
        for member in members:
            cached = sum(path.stat().st_size for path in (member.cache / "blocks").rglob("*-*"))
            assert cached <= 1_000_000, f"{member.name} keeps to its quota: {cached}"


def test_peers_over_mutual_tls_serve_only_peers_with_a_cluster_certificate(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    dataset: tuple[list[str], dict[str, str], str], nginx: HttpServer,
) -> None:
    paths, digests, site = dataset
    tls = cluster_certificates(tmp_path)
    monkeypatch.setenv("GPUFEED_CLUSTER_TOKEN", TOKEN)
    url = redis_url.rsplit("/", 1)[0] + "/9"
    half = subprocess.run(
        [sys.executable, "-m", "gpufeed.agent", "--cache-dir", str(tmp_path / "half"), "--cluster", url,
         "--peer-addr", f"127.0.0.1:{free_port()}", "--peer-tls-cert", tls["GPUFEED_PEER_TLS_CERT"]],
        capture_output=True, text=True, timeout=60,
    )
    assert half.returncode != 0 and "all three" in half.stderr and len(half.stderr.strip().splitlines()) == 1, half.stderr
    for name, path in tls.items():
        monkeypatch.setenv(name, path)
    with joined(url, [f"node{i}" for i in range(3)], tmp_path) as members:
        for member in members:
            assert member.read_all(paths) == digests
        assert gets(nginx, site) == FILES, "the peers passed every block to each other over TLS"
        assert "(mutual TLS)" in members[0].log.read_text()
        health = f"https://127.0.0.1:{members[0].port}/v1/health"
        with_cert = ssl.create_default_context(cafile=tls["GPUFEED_PEER_TLS_CA"])
        with_cert.load_cert_chain(tls["GPUFEED_PEER_TLS_CERT"], tls["GPUFEED_PEER_TLS_KEY"])
        request = urllib.request.Request(health, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=10, context=with_cert) as response:
            assert response.status == 200
        without_cert = ssl.create_default_context(cafile=tls["GPUFEED_PEER_TLS_CA"])
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            urllib.request.urlopen(request, timeout=10, context=without_cert).read()
        with pytest.raises((ConnectionError, urllib.error.URLError, http.client.HTTPException)):
            urllib.request.urlopen(health.replace("https:", "http:"), timeout=10).read()
        assert all(member.process.poll() is None for member in members), "refused clients harm no node"


def test_the_peer_api_refuses_a_wrong_token_garbage_and_oversized_requests(cluster: tuple[str, list[Member]]) -> None:
    _, members = cluster
    target = f"http://127.0.0.1:{members[0].port}/v1/blocks"

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
    assert post(msgspec.msgpack.encode(PeerFetch([])), TOKEN) == 400, "a request names at least one block"
    assert post(b"\0" * (2 << 20), TOKEN) == 413
    assert members[0].process.poll() is None, "the agent lives on"
    assert "refused: wrong or missing cluster token" in members[0].log.read_text()


def test_cluster_status_lists_the_live_nodes_and_bad_settings_are_one_line(
    cluster: tuple[str, list[Member]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
    here = tmp_path / "this-node"
    here.mkdir()
    agent_service.remember(here, ["--cluster", url, "--peer-addr", "127.0.0.1:1"])  # as `agent start` does
    env = {k: v for k, v in os.environ.items() if k != "GPUFEED_CLUSTER"} | {"GPUFEED_CACHE_DIRS": str(here)}
    argv = [sys.executable, "-m", "gpufeed", "cluster", "status"]
    default = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert "3 live nodes" in default.stdout, "the cluster this node's agent was started in"
    agent_service.forget(here)
    default = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert default.returncode == 2 and "no cluster: give --cluster" in default.stderr
    for argv, needle in [
        (["cluster", "status", "--cluster", "http://nowhere"], "expected redis://HOST:PORT"),
        (["cluster", "status", "--cluster", f"redis://127.0.0.1:{free_port()}/0"], "Connect"),
        (["agent", "--cache-dir", str(tmp_path / "x"), "--cluster", url], "needs --peer-addr HOST:PORT"),
        (["agent", "--cache-dir", str(tmp_path / "x"), "--cluster", "http://x"], "'http://x': expected"),
        (["cluster", "status", "--cluster", f"{url.rsplit('/', 1)[0]}/abc"], "database 'abc' is not a number"),
    ]:
        failed = subprocess.run([sys.executable, "-m", "gpufeed", *argv], capture_output=True, text=True, timeout=60)
        assert failed.returncode != 0 and len(failed.stderr.strip().splitlines()) == 1, failed.stderr
        assert failed.stderr.startswith("gpufeed: error: ") and needle in failed.stderr, failed.stderr
    unset = {k: v for k, v in os.environ.items() if k != "GPUFEED_CLUSTER_TOKEN"}
    no_token = subprocess.run([sys.executable, "-m", "gpufeed", "agent", "--cache-dir", str(tmp_path / "y"), "--cluster", url,
                               "--peer-addr", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60, env=unset)
    assert no_token.returncode != 0 and "GPUFEED_CLUSTER_TOKEN" in no_token.stderr and "Traceback" not in no_token.stderr
    loose = tmp_path / "token"
    loose.write_text("a-token-of-32-characters-or-so-x")
    loose.chmod(0o664)
    refused = subprocess.run([sys.executable, "-m", "gpufeed", "agent", "--cache-dir", str(tmp_path / "z"), "--cluster", url,
                              "--peer-addr", f"127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60,
                             env=unset | {"GPUFEED_CLUSTER_TOKEN_FILE": str(loose)})
    assert refused.returncode != 0 and refused.stderr.count("\n") == 1, refused.stderr
    assert f"{loose}: other users may change it (mode 0664); chmod 600" in refused.stderr
    loose.chmod(0o640)  # a Secret's file read through the pod's group
    monkeypatch.setenv("GPUFEED_CLUSTER_TOKEN_FILE", str(loose))
    assert load_token() == "a-token-of-32-characters-or-so-x"


def test_a_packs_blocks_go_through_their_owners_checked_against_the_index_sums(
    cluster: tuple[str, list[Member]], nginx: HttpServer, tmp_path: Path
) -> None:
    """Blocks of a gpufeed pack's shards are fetched by their owners with the listed chunk sums
    of just those blocks (`ObjectWant.sums`, forwarded in the peer request), and checked there:
    every member reads right on every node, each block from the store once for the cluster."""
    _, members = cluster
    raw = tmp_path / "raw"
    digests = random_files(raw, FILES, 60_000, "/packed")
    site = nginx.root / f"packed-{tmp_path.name}"
    Namespace().add_mount("/raw", f"file://{raw}")
    subprocess.run([sys.executable, "-m", "gpufeed", "pack", "/raw", f"file://{site}", "-q"], check=True, timeout=120)
    Namespace().add_mount("/packed", f"{nginx.url}/{site.name}", {"format": "gpufeed-pack", "block_size": "256KiB"})
    paths = sorted(digests)
    for member in members:
        assert member.read_all(paths) == digests
    time.sleep(0.2)  # nginx logs a request after answering it
    shard_gets = re.findall(rf'"GET /{site.name}/\.gpufeed-pack/shards/\S+\.gfp ', nginx.access_log.read_text())
    blocks = -(-sum(60_000 + i for i in range(FILES)) // (256 << 10))
    assert blocks <= len(shard_gets) <= blocks + 2, "each block from the store once (shards may hold a little padding)"

    # a shard damaged at rest: every node refuses the block, and no owner is taken for a broken peer
    shard = next((site / ".gpufeed-pack" / "shards").glob("*.gfp"))
    before = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same nginx ETag: nothing but the sums can tell
    for member in members:
        AgentClient(member.settings()).clear()
    for member in members:  # two of them ask the block's owner
        done = subprocess.run([sys.executable, "-m", "gpufeed", "cat", "/packed/000.bin"], env=member.env(), capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 1 and "its pack index lists xxh3:" in done.stderr, done.stderr
    assert all("is suspect" not in member.log.read_text() for member in members), "the owners are well; the shard is not"
