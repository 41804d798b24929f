"""Warm random reads of 100 KB objects from one process: gpufeed's cache hit path against raw
`os.open`+`os.pread`+`os.close` of the same files, against `os.pread` of the files held open
(as gpufeed holds its block files: the stricter floor), and against fsspec `simplecache::`, in
one run.

    python benchmarks/cache_read_bench.py [--files 2000] [--size 100000] [--reads 5000] [--rounds 21]

Prints samples/s for each reader (median over rounds) and the two ratios the cache issue asks
for, each the median over rounds of the ratio within a round: gpufeed / raw pread (goal >= 0.8,
floor 0.7) and gpufeed / simplecache (floor 3x).
"read_range" resolves each file once, as a dataset does, then reads through
`Client.read_range` with the default checksum verification: the bytes are copied out of the
block file the process holds mapped and the copy is hashed, so every reader here copies each
byte once. "verify=never" is read_range on a mount that opts out. "gpufeed.read(path)"
resolves the path on every read (from the client's remembered handles once it has seen the
path).
A process holds at most a quarter of its open-file limit: the 4,000 block files read here
(two mounts) are all held from `ulimit -n 16384` up; at 1024 a process holds 256 and reads
the rest with open, pread and close, as every hit did before files were held.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable

import fsspec
from common import scratch_home, small_files

import gpufeed
from gpufeed.cache.openfiles import capacity_for
from gpufeed.client import ObjectHandle
from gpufeed.namespace import Namespace

BATCH = 64


def rates(readers: dict[str, Callable[[list[int]], int]], order: list[int], rounds: int) -> list[dict[str, float]]:
    """Samples/s of each reader over `order`, handed to it BATCH indices at a time, once per
    round. The readers take turns within a round, so a ratio of two readers in one round
    compares them under the same conditions (this VM's neighbours and clock vary from one
    second to the next)."""
    batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
    measured = []
    for _ in range(rounds):
        this_round = {}
        for label, fn in readers.items():
            started = time.perf_counter()
            total = 0
            for batch in batches:
                total += fn(batch)
            this_round[label] = len(order) / (time.perf_counter() - started)
        measured.append(this_round)
    for label in readers:
        values = [r[label] for r in measured]
        sys.stdout.write(f"  {label:34} {statistics.median(values):>10,.0f} samples/s  (best {max(values):,.0f})\n")
    return measured


def ratio(measured: list[dict[str, float]], reader: str, baseline: str) -> str:
    """Median over rounds of the two readers' ratio in the same round, with its range."""
    values = sorted(r[reader] / r[baseline] for r in measured)
    return f"{statistics.median(values):.2f}x  (rounds {values[0]:.2f}-{values[-1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--reads", type=int, default=5_000, help="reads per reader per round")
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()

    with scratch_home("gpufeed-cache-bench-") as work:
        source = work / "source"
        names = small_files(source, args.files, args.size)
        Namespace().add_mount("/bench", f"file://{source}")
        Namespace().add_mount("/trusting", f"file://{source}", {"verify": "never"})
        client = gpufeed.client()
        rng = random.Random(0)
        order = [rng.randrange(args.files) for _ in range(args.reads)]
        paths = [f"/bench/{n}" for n in names]
        handles = [client.handle(p) for p in paths]
        trusting = [client.handle(p.replace("/bench/", "/trusting/")) for p in paths]
        for handle in handles + trusting:  # warm the cache
            client.read_range(handle, 0, handle.size)
        local = [str(source / n) for n in names]
        simple = fsspec.filesystem("simplecache", target_protocol="file", cache_storage=str(work / "simplecache"))
        for path in local:  # warm simplecache's copies
            with simple.open(path, "rb") as f:
                f.read()

        def raw(batch: list[int]) -> int:
            total = 0
            for i in batch:
                fd = os.open(local[i], os.O_RDONLY)
                try:
                    total += len(os.pread(fd, args.size, 0))
                finally:
                    os.close(fd)
            return total

        held_fds: list[int] = []  # opened after the line below: the process's own capacity is printed as it was

        def raw_held(batch: list[int]) -> int:
            return sum(len(os.pread(held_fds[i], args.size, 0)) for i in batch)

        def through(opened: list[ObjectHandle]) -> Callable[[list[int]], int]:
            def read(batch: list[int]) -> int:
                total = 0
                for i in batch:
                    handle = opened[i]
                    total += len(client.read_range(handle, 0, handle.size))
                return total

            return read

        def via_path(batch: list[int]) -> int:
            return sum(len(gpufeed.read(paths[i])) for i in batch)

        def via_simplecache(batch: list[int]) -> int:
            total = 0
            for i in batch:
                with simple.open(local[i], "rb") as f:
                    total += len(f.read())
            return total

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        sys.stdout.write(
            f"warm random reads: {args.reads:,} reads of {args.size:,} B over {args.files:,} files; this process may hold "
            f"{capacity_for(client.settings.open_blocks):,} block files mapped "
            f"(GPUFEED_OPEN_BLOCKS, at most ulimit -n {soft:,} / 4)\n"
        )
        if hard == resource.RLIM_INFINITY or hard >= args.files + 256:  # each file open once, as gpufeed holds its blocks
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, args.files + 256), hard))
            held_fds.extend(os.open(path, os.O_RDONLY) for path in local)
        measured = rates(
            {
                "raw os.open+pread+close": raw,
                **({"raw os.pread, files held open": raw_held} if held_fds else {}),
                "gpufeed read_range (handles)": through(handles),
                "gpufeed read_range, verify=never": through(trusting),
                "gpufeed.read(path)": via_path,
                "fsspec simplecache::": via_simplecache,
            },
            order,
            args.rounds,
        )
        client.hits.flush()
        raw_label, simple_label, held_label = "raw os.open+pread+close", "fsspec simplecache::", "raw os.pread, files held open"
        sys.stdout.write(
            f"read_range / raw pread             = {ratio(measured, 'gpufeed read_range (handles)', raw_label)}"
            "  (goal >= 0.8, floor 0.7)\n"
            f"verify=never / raw pread           = {ratio(measured, 'gpufeed read_range, verify=never', raw_label)}\n"
            f"gpufeed.read(path) / raw pread     = {ratio(measured, 'gpufeed.read(path)', raw_label)}\n"
            + (f"read_range / held-open pread       = {ratio(measured, 'gpufeed read_range (handles)', held_label)}"
               "  (both keep their files open)\n" if held_fds else "")
            + f"read_range / simplecache::         = {ratio(measured, 'gpufeed read_range (handles)', simple_label)}"
            "  (floor 3x)\n"
            f"gpufeed.read(path) / simplecache:: = {ratio(measured, 'gpufeed.read(path)', simple_label)}\n"
        )


if __name__ == "__main__":
    main()
