"""Metadata engine benchmark: mount a 1,000,000-object source, then stat and ls from the manifest.

For each engine (SQLite file, Redis server) it measures, in a fresh process per size:
  * ingest: objects/s while the manifest is written, and the peak RSS growth — measured at
    two sizes, so bounded memory shows as a flat line rather than a claim;
  * stat: latency of random single-file stats through the Namespace (goal < 1 ms);
  * ls: a 10,000-entry directory through the Namespace (goal < 100 ms).

The source is synthetic (objects come from a generator, 1,000 per directory plus one directory
of 10,000) so the figure is the metadata engine's, not a store's listing speed; `--real N`
adds an end-to-end `mount add` of a file:// tree of N real files.

    python benchmarks/meta_bench.py                # 1M objects, both engines
    python benchmarks/meta_bench.py --objects 200000 --engines sqlite
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gpufeed.config import Settings
from gpufeed.meta import Mount, open_engine
from gpufeed.meta.manifest import write_manifest
from gpufeed.namespace import Namespace
from gpufeed.sources.base import ObjectInfo

BIG_DIR = 10_000
PER_DIR = 1_000


class SyntheticSource:
    """`objects` objects: one directory of BIG_DIR files, the rest PER_DIR per directory."""

    url = "synthetic://bench"

    def __init__(self, objects: int) -> None:
        self.objects = objects

    def list(self) -> Iterator[list[ObjectInfo]]:
        batch: list[ObjectInfo] = []
        for i in range(self.objects):
            key = f"big/{i:07d}.jpg" if i < BIG_DIR else f"d{i // PER_DIR:05d}/{i:07d}.jpg"
            batch.append(ObjectInfo(key, 100_000 + i % 1000, 1.7e9 + i, f'"{i:032x}"'))
            if len(batch) == 1000:
                yield batch
                batch = []
        if batch:
            yield batch

    def key(self, i: int) -> str:
        return f"big/{i:07d}.jpg" if i < BIG_DIR else f"d{i // PER_DIR:05d}/{i:07d}.jpg"


def rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def run_one(objects: int, stats_n: int, ls_n: int) -> dict[str, float]:
    """Runs in a child process with GPUFEED_HOME / GPUFEED_META already set."""
    settings = Settings.from_env()
    engine = open_engine(settings)
    source = SyntheticSource(objects)
    base_rss = rss_kib()
    started = time.perf_counter()
    write_manifest(engine, Mount("/bench", source.url), source, create=True)
    ingest_s = time.perf_counter() - started
    peak_rss_growth = rss_kib() - base_rss

    namespace = Namespace(settings, engine)
    rng = random.Random(0)
    paths = [f"/bench/{source.key(rng.randrange(objects))}" for _ in range(stats_n)]
    latencies = []
    for path in paths:
        t0 = time.perf_counter()
        namespace.stat(path)
        latencies.append(time.perf_counter() - t0)
    latencies.sort()

    ls_times = []
    for _ in range(ls_n):
        t0 = time.perf_counter()
        listing = namespace.ls("/bench/big")
        ls_times.append(time.perf_counter() - t0)
    assert len(listing) == BIG_DIR
    return {
        "objects": objects,
        "ingest_s": ingest_s,
        "ingest_objects_per_s": objects / ingest_s,
        "peak_rss_growth_mib": peak_rss_growth / 1024,
        "stat_mean_us": statistics.fmean(latencies) * 1e6,
        "stat_p50_us": latencies[len(latencies) // 2] * 1e6,
        "stat_p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
        "ls_10k_median_ms": statistics.median(ls_times) * 1e3,
    }


def run_real(count: int) -> dict[str, float]:
    """End to end: `mount add` of a file:// tree of `count` empty files."""
    root = Path(tempfile.mkdtemp(prefix="gpufeed-real-"))
    try:
        for i in range(count):
            d = root / f"d{i // PER_DIR:04d}"
            if i % PER_DIR == 0:
                d.mkdir()
            os.close(os.open(d / f"{i:07d}.jpg", os.O_CREAT | os.O_WRONLY))
        started = time.perf_counter()
        _, stats = Namespace().add_mount("/real", f"file://{root}")
        elapsed = time.perf_counter() - started
        assert stats.files == count
        return {"objects": count, "mount_add_s": elapsed, "objects_per_s": count / elapsed}
    finally:
        shutil.rmtree(root)


def child(args: argparse.Namespace) -> None:
    result = run_real(args.real) if args.real else run_one(args.objects, args.stats, args.ls)
    sys.stdout.write(json.dumps(result) + "\n")


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return server, f"redis://127.0.0.1:{port}/0"


def spawn(env: dict[str, str], *extra: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", *extra], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=100_000, help="second size, to show memory does not grow")
    parser.add_argument("--engines", default="sqlite,redis")
    parser.add_argument("--stats", type=int, default=20_000)
    parser.add_argument("--ls", type=int, default=20)
    parser.add_argument("--real", type=int, default=0, help="also mount a file:// tree of this many real files")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    rows = []
    with tempfile.TemporaryDirectory(prefix="gpufeed-meta-bench-") as tmp:
        for engine in args.engines.split(","):
            server = None
            for objects in (args.small, args.objects):
                home = Path(tmp) / f"{engine}-{objects}"
                env = {**os.environ, "GPUFEED_HOME": str(home)}
                if engine == "redis":
                    server, url = start_redis(Path(tmp))
                    env["GPUFEED_META"] = url
                else:
                    env.pop("GPUFEED_META", None)
                try:
                    result = spawn(env, "--objects", str(objects), "--stats", str(args.stats), "--ls", str(args.ls))
                finally:
                    if server is not None:
                        server.terminate()
                        server.wait()
                rows.append((engine, result))
        if args.real:
            env = {**os.environ, "GPUFEED_HOME": str(Path(tmp) / "real")}
            env.pop("GPUFEED_META", None)
            real = spawn(env, "--real", str(args.real))

    header = (
        f"{'engine':8} {'objects':>9} {'ingest s':>9} {'obj/s':>9} {'peak RSS +MiB':>14} "
        f"{'stat p50 us':>12} {'stat p99 us':>12} {'ls 10k ms':>10}"
    )
    sys.stdout.write(header + "\n")
    for engine, r in rows:
        sys.stdout.write(
            f"{engine:8} {r['objects']:>9,} {r['ingest_s']:>9.1f} {r['ingest_objects_per_s']:>9,.0f} "
            f"{r['peak_rss_growth_mib']:>14.1f} {r['stat_p50_us']:>12.1f} {r['stat_p99_us']:>12.1f} "
            f"{r['ls_10k_median_ms']:>10.1f}\n"
        )
    for engine, r in rows:
        if r["objects"] == args.objects:
            sys.stdout.write(
                f"{engine}: stat p99 {r['stat_p99_us'] / 1000:.3f} ms (goal < 1 ms, {1000 / r['stat_p99_us']:.1f}x under); "
                f"ls 10k {r['ls_10k_median_ms']:.1f} ms (goal < 100 ms, {100 / r['ls_10k_median_ms']:.1f}x under)\n"
            )
    if args.real:
        sys.stdout.write(
            f"file:// mount add of {real['objects']:,} real files: {real['mount_add_s']:.1f} s "
            f"({real['objects_per_s']:,.0f} objects/s)\n"
        )


if __name__ == "__main__":
    main()
