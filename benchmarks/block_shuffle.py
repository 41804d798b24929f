"""The block-aware shuffle against the exact one, over a packed mount: what the store serves in
one cold epoch with a cache smaller than the data set, and how much randomness each order keeps.

    python benchmarks/block_shuffle.py [--files 3000] [--size 113000] [--cache 0.25] [--windows 1,4,16] [--batch 32]

--files files of --size bytes are packed (`gpufeed pack`, in-process) into 4 MiB cache blocks
and served by nginx, which logs every request; the pack is mounted over HTTP and the node
cache is limited to --cache of the packed bytes. For the exact shuffle and the block-aware one
with each window, one epoch is read cold (cache cleared, fresh client) by FeedSampler's order
with its prefetch, --batch samples per `__getitems__`, no decoding and no training step.
Printed per order: the GETs and bytes nginx served from the shards (and their ratio to the
packed bytes), the epoch's seconds, and two measures of randomness of the order itself: how
far apart in the epoch two samples that are neighbours in the pack are read, as a fraction of
the epoch (apart/n: 1/3 for a uniform shuffle, 1/n for the packed order), and the distinct
cache blocks one batch draws from (about --batch for an exact shuffle of a large set). Also:
how long the block-aware order of 1,000,000 samples takes to compute.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import time
from pathlib import Path

import numpy as np
from common import scratch_home, small_files

import gpufeed
from gpufeed.bench.server import serving
from gpufeed.integrations.torch import FeedDataset, FeedSampler
from gpufeed.namespace import Namespace
from gpufeed.pack.packer import destination, pack, prepare
from gpufeed.shuffle import block_permutation, epoch_order

MIB = 1 << 20
HEADER = f"{'order':<12}{'shard GETs':>11}{'MiB fetched':>12}{'x packed':>9}{'seconds':>8}{'apart/n':>8}{'blocks/batch':>13}"


def shard_gets(log: Path) -> tuple[int, int]:
    """(requests, bytes) nginx served from the pack's shards so far."""
    time.sleep(0.5)  # nginx logs a request after answering it
    found = re.findall(r'"GET /pack/\.gpufeed-pack/shards/\S+ HTTP/[\d.]+" 20\d (\d+)', log.read_text())
    return len(found), sum(int(size) for size in found)


def cold_epoch(data: FeedDataset[bytes], sampler: FeedSampler, batch: int, log: Path) -> tuple[int, int, float]:
    """(shard GETs, shard bytes, seconds) of one epoch read from an empty cache."""
    gpufeed.client().agent.clear()
    gpufeed._default = None
    before = shard_gets(log)
    started = time.perf_counter()
    indices = iter(sampler)
    while chunk := list(itertools.islice(indices, batch)):
        data.__getitems__(chunk)
    seconds = time.perf_counter() - started
    del indices  # ends its prefetch
    after = shard_gets(log)
    return after[0] - before[0], after[1] - before[1], seconds


def randomness(order: np.ndarray, blocks: np.ndarray, batch: int) -> tuple[float, float]:
    """(mean distance in the epoch between samples that are neighbours in the pack / n, mean
    distinct blocks per batch)."""
    n = len(order)
    read_at = np.empty(n, dtype=np.int64)
    read_at[order] = np.arange(n)
    apart = float(np.abs(np.diff(read_at)).mean() / n)
    full = n // batch * batch
    per_batch = np.sort(blocks[order[:full]].reshape(-1, batch), axis=1)
    distinct = float((1 + (np.diff(per_batch, axis=1) != 0).sum(axis=1)).mean())
    return apart, distinct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--size", type=int, default=113_000)
    parser.add_argument("--cache", type=float, default=0.25, help="cache size as a fraction of the packed bytes")
    parser.add_argument("--windows", default="1,4,16")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    windows = [int(w) for w in args.windows.split(",")]

    with scratch_home("gpufeed-block-shuffle-") as work:
        os.environ["GPUFEED_CACHE_SIZE"] = str(int(args.cache * args.files * args.size))
        small_files(work / "raw", args.files, args.size)
        ns = Namespace()
        ns.add_mount("/raw", f"file://{work / 'raw'}", {"cache": "off"})
        client = gpufeed.client()
        www = work / "www"
        pack(client, prepare(client, "/raw", destination(f"file://{www / 'pack'}", {}, client), shard_size=64 * MIB), workers=2)
        listing = work / "listing.txt"  # nginx's index leaves out the pack's dot directory
        files = [f for f in (www / "pack").rglob("*") if f.is_file()]
        listing.write_text("".join(f"{f.relative_to(www / 'pack')} {f.stat().st_size}\n" for f in files))
        log = work / "access.log"
        with serving(www, work / "nginx", access_log=log) as url:
            ns.add_mount("/p", f"{url}/pack", {"format": "gpufeed-pack", "list": str(listing)})
            gpufeed._default = None
            data: FeedDataset[bytes] = FeedDataset("/p")
            packed = int(data.sizes.sum())
            blocks = len(np.unique(data.blocks))
            print(
                f"{len(data)} samples of {args.size:,} B in {blocks} blocks of 4 MiB ({packed / MIB:,.0f} MiB packed), "
                f"cache {args.cache:.0%} of it, batches of {args.batch}, one cold epoch each"
            )
            print(HEADER)
            modes: list[tuple[str, bool | str, int]] = [("exact", True, 1), *((f"block w={w}", "block", w) for w in windows)]
            for name, shuffle, window in modes:
                sampler = FeedSampler(data, shuffle=shuffle, shuffle_window=window, seed=0)
                gets, fetched, seconds = cold_epoch(data, sampler, args.batch, log)
                apart, distinct = randomness(epoch_order(0, 0, len(data), shuffle, window, data.blocks), data.blocks, args.batch)
                ratio = fetched / packed
                print(f"{name:<12}{gets:>11}{fetched / MIB:>12,.0f}{ratio:>9.2f}{seconds:>8.1f}{apart:>8.3f}{distinct:>13.1f}")
    groups = np.arange(1_000_000) // 37
    started = time.perf_counter()
    block_permutation(0, 0, groups, 4)
    print(f"block-aware order of 1,000,000 samples in 27,028 blocks: {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
