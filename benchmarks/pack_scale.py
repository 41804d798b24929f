"""A million-member pack: how long it takes to mount, how fast `stat` answers, and what its
index costs DataLoader workers in memory.

    python benchmarks/pack_scale.py [--members 1000000] [--size 100] [--stats 20000] [--samples 8000]

The pack is written directly with gpufeed's own planner and index encoder (a million real files
would take ext4 longer to create than everything measured here): members of --size random
bytes under 1,000 class directories, 256 MiB shards, on local disk. Then, in one run:
- `mount add` of the pack (the index read and checked, its member table built and saved), timed;
- `stat` of --stats members picked at random, each timed alone: p50, p99, max;
- FeedDataset over the mount (the member table's columns into numpy buffers), timed, with its size;
- a DataLoader reading --samples random members with 2 and then 8 workers (fork, not
  persistent): while it runs, each process's memory from /proc/PID/smaps_rollup. Printed: the
  main process's RSS, each worker's private memory (what it does not share with the main
  process) and the proportional total (PSS) of all of them. The index is shared when a worker's
  private memory stays far below the index's size and the total barely moves from 2 to 8.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch
from common import scratch_home
from torch.utils.data import DataLoader, Subset

import gpufeed
from gpufeed.blocks import chunk_sums
from gpufeed.integrations.torch import FeedDataset
from gpufeed.pack import index as idx
from gpufeed.pack.layout import INDEX_KEY
from gpufeed.pack.plan import Item, pack_digest, plan

MIB = 1 << 20


def write_pack(root: Path, members: int, size: int) -> list[str]:
    """A pack of `members` members of `size` bytes at `root`; returns their paths."""
    paths = [f"train/n{n % 1000:05d}/img_{n:07d}.jpg" for n in range(members)]
    items = [Item(path, size, "") for path in paths]
    shards = plan(items, 256 * MIB, 4 * MIB)
    payload = np.random.default_rng(0).integers(0, 256, size + members, dtype=np.uint8).tobytes()
    rows = []
    sums = []
    for shard in shards:
        data = bytearray(shard.size)
        for n, offset in shard.members:
            member = payload[n : n + size]
            data[offset : offset + size] = member
            rows.append((paths[n], shard.number, offset, size, 1.7e9, hashlib.sha256(member).digest()))
        (root / shard.key).parent.mkdir(parents=True, exist_ok=True)
        (root / shard.key).write_bytes(data)
        sums.append(chunk_sums(data))
    index = idx.build(pack_digest(shards, 4 * MIB), 4 * MIB, [(s.key, s.size) for s in shards], rows, b"".join(sums))
    (root / INDEX_KEY).write_bytes(idx.encode(index))
    return paths


def private_and_pss(pid: int) -> tuple[int, int, int]:
    """(RSS, private, PSS) bytes of process `pid`."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[name] = int(parts[0]) * 1024
    return fields["Rss"], fields["Private_Clean"] + fields["Private_Dirty"], fields["Pss"]


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def loader_memory(dataset: FeedDataset, workers: int, samples: int) -> tuple[int, list[int], int, float]:
    """(main RSS, each worker's private bytes, PSS of all, seconds) at the peak of a run."""
    picked = random.Random(workers).sample(range(len(dataset)), samples)
    loader = DataLoader(Subset(dataset, picked), batch_size=32, num_workers=workers, collate_fn=lambda batch: len(batch))
    peak: dict[int, tuple[int, int, int]] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for pid in [os.getpid(), *children(os.getpid())]:
                try:
                    now = private_and_pss(pid)
                except OSError:
                    continue
                if now[2] > peak.get(pid, (0, 0, 0))[2]:
                    peak[pid] = now
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    started = time.perf_counter()
    read = sum(loader)
    seconds = time.perf_counter() - started
    stop.set()
    watcher.join()
    assert read == samples
    main = peak.pop(os.getpid())
    workers_seen = sorted(peak.values(), key=lambda m: -m[2])[:workers]  # the agent is no child of this process
    return main[0], [w[1] for w in workers_seen], main[2] + sum(w[2] for w in workers_seen), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--stats", type=int, default=20_000)
    parser.add_argument("--samples", type=int, default=8_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with scratch_home("gpufeed-pack-scale-") as work:
        root = work / "pack"
        started = time.perf_counter()
        paths = write_pack(root, args.members, args.size)
        index_bytes = (root / INDEX_KEY).stat().st_size
        print(f"{args.members:,} members of {args.size} B: pack written in {time.perf_counter() - started:.1f} s, "
              f"index {index_bytes / MIB:.0f} MiB", flush=True)

        client = gpufeed.client()
        client.agent.stats()
        started = time.perf_counter()
        client.namespace.add_mount("/big", f"file://{root}")
        print(f"mount add (index read, checked, member table built): {time.perf_counter() - started:.1f} s", flush=True)

        namespace = gpufeed.client().namespace
        picked = random.Random(1).sample(paths, args.stats)
        times = []
        for path in picked:
            began = time.perf_counter_ns()
            namespace.stat(f"/big/{path}")
            times.append(time.perf_counter_ns() - began)
        times.sort()
        p99 = times[int(0.99 * len(times))] / 1e6
        print(f"stat of {args.stats:,} random members: p50 {statistics.median(times) / 1e6:.3f} ms, p99 {p99:.3f} ms, "
              f"max {times[-1] / 1e6:.3f} ms", flush=True)

        started = time.perf_counter()
        dataset = FeedDataset("/big")
        table = dataset.index
        held = table.paths._blob.nbytes + table.paths._offsets.nbytes + table.sizes.nbytes + table.blocks.nbytes
        print(f"FeedDataset over {len(dataset):,} members: built in {time.perf_counter() - started:.1f} s, "
              f"{held / MIB:.0f} MiB of numpy buffers", flush=True)

        print(f"\nDataLoader, {args.samples:,} random members, batch 32, fork, memory at its peak")
        print(f"{'workers':>7} {'main RSS MiB':>13} {'private MiB per worker':>24} {'PSS all MiB':>12} {'samples/s':>10}")
        for workers in (2, 8):
            rss, private, pss, seconds = loader_memory(dataset, workers, args.samples)
            spread = f"{min(private) / MIB:.0f}-{max(private) / MIB:.0f}"
            print(f"{workers:>7} {rss / MIB:>13.0f} {spread:>24} {pss / MIB:>12.0f} {args.samples / seconds:>10,.0f}", flush=True)


if __name__ == "__main__":
    main()
