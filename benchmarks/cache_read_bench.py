"""Warm random reads of 100 KB objects from one process: gpufeed's cache hit path against raw
`os.open`+`os.pread`+`os.close` of the same files and against fsspec `simplecache::`, in one run.

    python benchmarks/cache_read_bench.py [--files 2000] [--size 100000] [--reads 20000]

Prints samples/s for each reader and the two ratios the cache issue asks for:
gpufeed / raw pread (goal >= 0.8, floor 0.7) and gpufeed / simplecache (floor 3x).
"read_range" resolves each file once, as a dataset does, then reads through
`Client.read_range` with the default checksum verification; "verify=never" is read_range on
a mount that opts out; "gpufeed.read(path)" resolves the path on every read (from the
client's remembered handles once it has seen the path).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable

import fsspec

import gpufeed
from gpufeed.client import ObjectHandle
from gpufeed.namespace import Namespace

from common import scratch_home

BATCH = 64


def rates(readers: dict[str, Callable[[list[int]], int]], order: list[int], rounds: int = 5) -> dict[str, float]:
    """Samples/s of each reader over `order`, handed to it BATCH indices at a time; best of
    `rounds`. The rounds interleave the readers, so a noisy neighbour or a frequency change
    hits all of them alike."""
    batches = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
    best = dict.fromkeys(readers, 0.0)
    for _ in range(rounds):
        for label, fn in readers.items():
            started = time.perf_counter()
            total = 0
            for batch in batches:
                total += fn(batch)
            best[label] = max(best[label], len(order) / (time.perf_counter() - started))
    for label, value in best.items():
        sys.stdout.write(f"  {label:34} {value:>10,.0f} samples/s\n")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--reads", type=int, default=20_000)
    args = parser.parse_args()

    with scratch_home("gpufeed-cache-bench-") as work:
        source = work / "source"
        source.mkdir()
        payload = os.urandom(args.size + 4096)
        names = [f"{i:06d}.jpg" for i in range(args.files)]
        for i, name in enumerate(names):
            (source / name).write_bytes(payload[i % 4096 : i % 4096 + args.size])
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

        sys.stdout.write(f"warm random reads: {args.reads:,} reads of {args.size:,} B over {args.files:,} files\n")
        measured = rates(
            {
                "raw os.open+pread+close": raw,
                "gpufeed read_range (handles)": through(handles),
                "gpufeed read_range, verify=never": through(trusting),
                "gpufeed.read(path)": via_path,
                "fsspec simplecache::": via_simplecache,
            },
            order,
        )
        raw_rate, handle_rate, trusting_rate, path_rate, simple_rate = measured.values()
        client.hits.flush()
        sys.stdout.write(
            f"read_range / raw pread          = {handle_rate / raw_rate:.2f}x  (goal >= 0.8, floor 0.7)\n"
            f"verify=never / raw pread        = {trusting_rate / raw_rate:.2f}x\n"
            f"gpufeed.read(path) / raw pread  = {path_rate / raw_rate:.2f}x\n"
            f"read_range / simplecache::      = {handle_rate / simple_rate:.1f}x  (floor 3x)\n"
            f"gpufeed.read(path) / simplecache:: = {path_rate / simple_rate:.1f}x\n"
        )

if __name__ == "__main__":
    main()
