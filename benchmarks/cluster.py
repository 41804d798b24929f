"""N nodes read the same dataset at once: cold, each node alone against the store, then as a
cache cluster; then warm, from a cluster that `gpufeed warmup --cluster` filled first. Needs
root (network namespaces).

    python benchmarks/cluster.py [--nodes 1,2,3,4] [--files 2560] [--size 65536]
                                 [--link-mbit 50] [--store-mbps 25] [--latency-ms 20]
                                 [--ways alone,cluster,warm] [--workers 1] [--no-prefetch]

Every node is a network namespace with its own agent and reader, joined to the host by a veth
pair shaped with `tc tbf` (--link-mbit each way), so links, not this machine's two cores, are
the limit: at 200 Mbit the cores were 80-96 % busy with four nodes, hence 50 by default. The
store is nginx behind the project's shaper on the host's bridge address: --latency-ms to the
first byte, --store-mbps for all nodes together (one store's egress). 160 MiB by default: an
epoch of about 30 s cold and 20-25 s warm, so a reader's start (about half a second before its
links are full) and hashing's spread of blocks over owners weigh what they would in a real
epoch of many more blocks, not a tenth of it. Each node's reader reads
every file once in its own shuffled order, 16 files per call (a batch's `__getitems__`), and
hands that order to the agent ahead of reading, as `FeedSampler` does (`gpufeed.prefetch`);
`--no-prefetch` reads one batch at a time with nothing ahead, the worst case. The cluster's
Redis runs on the bridge too.

Printed per N and way: the store's egress as a multiple of the dataset (from the agents' own
counts of bytes read from the store), the slowest node's epoch time, the aggregate read
throughput and its ratio to N times the one-node figure of the same way, each node's MB/s, and
for the cluster the busiest node's peer traffic against the mean (load balance), how busy the
machine's CPUs were during the epoch (near 100 %: the cores, not the links, set the pace), and
the epoch against what the links and the store allow ("vs bound"): the busiest link, either way,
carries what the agents counted over it (bytes from the store and from peers in, to peers out:
cold, the whole dataset in; warm, the (N-1)/N of it that other nodes own in, and the node's own
share times N-1 out, so a node that owns more than its share sets the pace), at the rate a
plain HTTP download gets over one link while the other way carries one too (measured first,
`plain_link_mbs`), and the store sends the dataset N times alone, once as a
cluster. Linear scaling keeps that ratio as N grows. For `warm` the one-node figure is a node
reading its whole dataset from its own cache (everything local), and the cluster warmup's own
time is printed beside it: each node's reads then cross its link for the (N-1)/N of the blocks
that other nodes own.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

from common import report_file_creation, report_first_touch

from gpufeed.bench.children import free_port
from gpufeed.bench.netns import Host, bridged_hosts
from gpufeed.bench.server import serving
from gpufeed.bench.shaper import shaping
from gpufeed.namespace import Namespace

TOKEN = "benchmark-cluster-token-0123456789"
READER = """
import random, sys, time, gpufeed
paths = [f"/data/{i:05d}.bin" for i in range(int(sys.argv[1]))]
random.Random(int(sys.argv[2])).shuffle(paths)
worker, workers = int(sys.argv[3]), int(sys.argv[4])
client = gpufeed.client()
began = time.monotonic()
total = 0
batches = [paths[i:i + 16] for i in range(16 * worker, len(paths), 16 * workers)]
if sys.argv[5] == "prefetch":  # as FeedSampler does: the agent fetches the next window meanwhile
    from gpufeed.prefetch import Prefetcher, Read
    ordered = iter(Prefetcher(client).ahead([path for batch in batches for path in batch], Read))
    batches = ([next(ordered) for _ in batch] for batch in batches)
for batch in batches:
    total += sum(len(view) for view in client.read_files(batch))
print(total, time.monotonic() - began)
"""


DOWNLOAD = """
import sys, time, urllib.request
for _ in range(200):
    try:
        response = urllib.request.urlopen(sys.argv[1])
        break
    except OSError:
        time.sleep(0.05)
began, got = time.monotonic(), 0
while chunk := response.read(1 << 20):
    got += len(chunk)
print(got / (time.monotonic() - began) / 1e6)
"""
LINK_BYTES = 32 << 20


def plain_link_mbs(link_mbit: float, work: Path) -> float:
    """MB/s of a plain HTTP download (Python's http.server, urllib) over one shaped link while
    the other way carries another (the mean of the two): the baseline the rows' bounds are
    computed from."""
    served = work / "link"
    served.mkdir()
    (served / "blob").write_bytes(os.urandom(LINK_BYTES))
    with ExitStack() as stack, bridged_hosts(2, link_mbit) as (_, hosts):
        for host in hosts:
            server = subprocess.Popen(host.command([sys.executable, "-m", "http.server", "8000", "--bind", host.address,
                                                    "-d", str(served)]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(server.wait, 10)
            stack.callback(server.terminate)
        downloads = [subprocess.Popen(host.command([sys.executable, "-c", DOWNLOAD, f"http://{other.address}:8000/blob"]),
                                      stdout=subprocess.PIPE, text=True) for host, other in zip(hosts, hosts[::-1], strict=True)]
        rates = [float(download.communicate(timeout=600)[0]) for download in downloads]
        return sum(rates) / len(rates)


def bound_s(way: str, count: int, dataset: float, busiest_link: float, link_mbs: float, store_mbs: float,
            local_mbs: float | None) -> float:
    """The shortest epoch the links and the store allow a node (seconds): the busiest link's
    bytes, either way, at `link_mbs`; warm, plus its own share read at `local_mbs` (the one-node
    warm row's rate; left out when that row was not run)."""
    if way == "warm":
        local_s = dataset / count / (local_mbs * 1e6) if local_mbs else 0.0
        return busiest_link / (link_mbs * 1e6) + local_s
    copies = count if way == "alone" else 1
    return max(busiest_link / (link_mbs * 1e6), copies * dataset / (store_mbs * 1e6))


def node_metrics(host: Host, cache: Path, *patterns: str) -> list[float] | None:
    """For each pattern, the sum of the node agent's samples matching it; None while no agent answers."""
    env = {**os.environ, "GPUFEED_CACHE_DIRS": str(cache)}
    done = subprocess.run(host.command([sys.executable, "-m", "gpufeed", "metrics"]), env=env, capture_output=True,
                          text=True, timeout=60)
    if done.returncode != 0:
        return None
    return [sum(float(value) for value in re.findall(rf"^{pattern} (\S+)$", done.stdout, re.M)) for pattern in patterns]


def link_counts(nodes: list[tuple[Host, Path]]) -> list[tuple[float, float, float]]:
    """Per node, as its agent counted them so far: bytes read from the store, bytes read from
    peers, and bytes served to peers."""
    counts = []
    for host, cache in nodes:
        got = node_metrics(host, cache, r'gpufeed_miss_bytes_total\{mount="/data",tier="store"\}',
                           r'gpufeed_miss_bytes_total\{mount="/data",tier="peer"\}', "gpufeed_peer_served_bytes_total")
        if got is None:
            raise SystemExit(f"{host.name}'s agent stopped answering")
        store, peers, served = got
        counts.append((store, peers, served))
    return counts


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def run(count: int, way: str, args: argparse.Namespace, store_url: str, work: Path) -> dict[str, float | list[float]]:
    clustered = way != "alone"
    with ExitStack() as stack:
        bridge, hosts = stack.enter_context(bridged_hosts(count, args.link_mbit))
        upstream = urlsplit(store_url)
        port = stack.enter_context(shaping((upstream.hostname or "127.0.0.1", upstream.port or 80), args.latency_ms,
                                           args.store_mbps, work / "shaper.log", bridge))
        home = work / f"home-{count}-{way}"
        stack.callback(shutil.rmtree, home, True)  # last, once the agents stopped: rows must not fill the disk
        os.environ["GPUFEED_HOME"] = str(home)
        Namespace().add_mount("/data", f"http://{bridge}:{port}/data")
        redis_port = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", bridge, "--save", "", "--appendonly",
                                  "no", "--protected-mode", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(redis.wait, 20)
        stack.callback(redis.terminate)
        env = {**os.environ, "GPUFEED_CLUSTER_TOKEN": TOKEN}
        caches = []
        agents = []
        for i, host in enumerate(hosts):
            cache = home / f"node{i}"
            cache.mkdir(parents=True)
            argv = [sys.executable, "-m", "gpufeed.agent", "--cache-dir", str(cache)]
            if clustered:
                argv += ["--cluster", f"redis://{bridge}:{redis_port}/0", "--peer-addr", f"{host.address}:7070",
                         "--node-id", f"node{i}"]
            log = open(work / f"agent-{count}-{way}-{i}.log", "wb")  # noqa: SIM115 - closed by the stack
            stack.callback(log.close)
            agent = subprocess.Popen(host.command(argv), stdout=log, stderr=log, env=env)
            stack.callback(agent.wait, 30)
            stack.callback(agent.send_signal, signal.SIGTERM)
            caches.append(cache)
            agents.append(agent)
        deadline = time.monotonic() + 60
        for host, cache in zip(hosts, caches, strict=True):
            while node_metrics(host, cache, "gpufeed_cluster_members") != [count if clustered else 0]:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{host.name}'s agent did not come up: see {work}")
                time.sleep(0.2)
        warmup_s = 0.0
        if way == "warm":
            began = time.monotonic()
            argv = [sys.executable, "-m", "gpufeed", "warmup", "/data", "--cluster", "--quiet"]
            warmup = subprocess.run(hosts[0].command(argv), env={**env, "GPUFEED_CACHE_DIRS": str(caches[0])},
                                    capture_output=True, text=True)
            if warmup.returncode != 0:
                raise SystemExit(f"the cluster warmup failed: {warmup.stderr.strip()}")
            warmup_s = time.monotonic() - began
        pairs = list(zip(hosts, caches, strict=True))
        before = link_counts(pairs)
        busy_before, total_before = cpu_times()
        readers = [
            [subprocess.Popen(host.command([sys.executable, "-c", READER, str(args.files), str(i), str(w), str(args.workers),
                                            "prefetch" if args.prefetch else "batches"]),
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "GPUFEED_CACHE_DIRS": str(cache)})
             for w in range(args.workers)]
            for i, (host, cache) in enumerate(zip(hosts, caches, strict=True))
        ]
        seconds = []
        for workers in readers:  # a node's epoch ends with its last worker
            total = took = 0.0
            for reader in workers:
                out, _ = reader.communicate(timeout=600)
                if reader.returncode != 0:
                    raise SystemExit(f"a reader failed: see {work}")
                total += int(out.split()[0])
                took = max(took, float(out.split()[1]))
            assert total == args.files * args.size
            seconds.append(took)
        busy_after, total_after = cpu_times()
        counts = link_counts(pairs)
        epoch = [[now - then for now, then in zip(*node, strict=True)] for node in zip(counts, before, strict=True)]
        served = [out for _, _, out in epoch]
    dataset = args.files * args.size
    return {
        "egress": sum(store for store, _, _ in counts) / dataset,  # a warm row's includes its warmup
        "busiest_link": max(max(store + peers, out) for store, peers, out in epoch),
        "slowest_s": max(seconds),
        "aggregate_mbs": count * dataset / max(seconds) / 1e6,
        "node_mbs": [dataset / s / 1e6 for s in seconds],
        "load": max(served) / (sum(served) / len(served)) if clustered and sum(served) > 0 else 0.0,
        "warmup_s": warmup_s,
        "cpu": (busy_after - busy_before) / max(total_after - total_before, 1.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1,2,3,4")
    parser.add_argument("--files", type=int, default=2560,
                        help="one block each: the busiest owner's share narrows with the square root of the blocks")
    parser.add_argument("--size", type=int, default=64 << 10)
    parser.add_argument("--link-mbit", type=float, default=50)
    parser.add_argument("--store-mbps", type=float, default=25)
    parser.add_argument("--latency-ms", type=float, default=20)
    parser.add_argument("--ways", default="alone,cluster,warm")
    parser.add_argument("--workers", type=int, default=1, help="readers per node, taking batches in turn (DataLoader workers)")
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                        help="readers hand their order to the agent ahead of reading (gpufeed.prefetch, as FeedSampler does)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/cluster.py needs root (network namespaces)")
    work = Path(tempfile.mkdtemp(prefix="gpufeed-cluster-"))
    report_file_creation(work)
    report_first_touch(work)
    try:
        data = work / "www" / "data"
        data.mkdir(parents=True)
        for i in range(args.files):
            (data / f"{i:05d}.bin").write_bytes(os.urandom(args.size))
        link_mbs = plain_link_mbs(args.link_mbit, work)
        with serving(work / "www", work / "server") as store_url:
            dataset = args.files * args.size
            print(f"{args.files} files of {args.size:,} B ({dataset / 2**20:.0f} MiB); store {args.latency_ms:g} ms, "
                  f"{args.store_mbps:g} MB/s for all; each node's link {args.link_mbit:g} Mbit/s "
                  f"(a plain HTTP download over it, both ways at once: {link_mbs:.2f} MB/s); "
                  f"{args.workers} reader(s) a node, "
                  f"{'order handed ahead (prefetch)' if args.prefetch else 'one batch at a time'}")
            print(f"{'N':>2} {'way':8} {'store egress':>13} {'slowest s':>10} {'aggregate MB/s':>15} {'vs N x 1 node':>14} "
                  f"{'vs bound':>9} {'load max/mean':>14} {'CPU busy':>9}  per node MB/s")
            single: dict[str, float] = {}
            local_mbs: float | None = None
            for count in (int(n) for n in args.nodes.split(",")):
                for way in args.ways.split(","):
                    result = run(count, way, args, store_url, work)
                    aggregate = float(result["aggregate_mbs"])  # type: ignore[arg-type]
                    single.setdefault(way, aggregate / count)
                    local_mbs = aggregate if count == 1 and way == "warm" else local_mbs
                    bound = bound_s(way, count, dataset, float(result["busiest_link"]), link_mbs, args.store_mbps, local_mbs)  # type: ignore[arg-type]
                    nodes = " ".join(f"{mbs:.1f}" for mbs in result["node_mbs"])  # type: ignore[union-attr]
                    load = f"{result['load']:.2f}" if way != "alone" and count > 1 else "-"
                    warmed = f"  (cluster warmup {result['warmup_s']:.2f} s)" if way == "warm" else ""
                    slowest = float(result["slowest_s"])  # type: ignore[arg-type]
                    print(f"{count:>2} {way:8} {result['egress']:>12.2f}x "
                          f"{slowest:>10.2f} {aggregate:>15.1f} {aggregate / (count * single[way]):>13.2f}x "
                          f"{bound / slowest:>8.2f}x {load:>14} {result['cpu']:>8.0%}  {nodes}{warmed}", flush=True)
    except BaseException:
        print(f"the agents' and the shaper's logs are kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
