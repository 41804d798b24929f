"""Packing small files, and training from the pack: gpufeed against LitData and Mosaic, same run.

    python benchmarks/pack.py [--files 3000] [--size 113000] [--small-files 100000] [--small-size 10000]
                              [--workers 2] [--batch 32] [--epochs 2] [--latency-ms 20] [--shard-mib 64]
                              [--persistent] [--store moto|s3rver]

Part 1, packing time, local disk to local disk, for each data set (the JPEG set and the small
files), every packer reading the same files (in the page cache for all of them) and writing
shards of --shard-mib:
- gpufeed pack --workers N (processes for the small files, threads of one process for the 3,000
  JPEGs: see pack/shards.py), the directory mounted (file://) and never read, the node
  agent running already; LitData is handed the list of paths, so the row to compare is the
  pack alone, and the mount's listing is shown added in a row of its own;
- LitData optimize(fn=read the file, num_workers=--workers);
- Mosaic MDSWriter (one process: it has no workers), columns {name: str, data: bytes}.
Printed: seconds, files/s, and each one's speed relative to LitData's.

Part 2, training from S3 (moto, or s3rver with --store s3rver: it serves a shard's ranges from
disk where moto reads the whole shard for each; behind the project's 20 ms latency shaper), the JPEG set, the
epochs.py loop (PIL decode in --workers DataLoader workers, an accelerator step calibrated to
keep it --busy on local disk): local disk; gpufeed over the raw files; gpufeed over the pack
(uploaded next to them) with an exact shuffle, and over a second copy of it with the
block-aware shuffle (window 4); Mosaic StreamingDataset over its own MDS copy (its default
shuffle, py1e, block-aware too); LitData StreamingDataset over its own copy, in its
StreamingDataLoader (its default shuffle: chunks shuffled, then samples within a chunk's
windows; its chunks downloaded with boto3, its own fallback in a process that has started
obstore, as gpufeed's client has here: obstore's runtime does not survive the workers' fork).
Each gpufeed, Mosaic and LitData copy is read for the first time in its epoch 1 (cold: its
blocks or shards were never fetched, Mosaic's and LitData's caches are new directories;
packing read the local copy, whose blocks are another source's). Every loop has one DataLoader
for all its epochs, its workers persistent with --persistent. Printed per epoch: samples/s,
accelerator busy, ratio to local disk, and the GET requests the store server logged.

Needs LitData and Mosaic Streaming beside the pinned CPU torch 2.13, installed without their
dependencies (which would replace torch and pull torchvision, cloud SDKs and more), so they are
deliberately not in the project's extras:

    pip install --no-deps litdata==0.2.76 mosaicml-streaming==0.13.0 transformers==4.57.6 \
        huggingface_hub==0.36.2 tokenizers==0.22.2 safetensors==0.8.0 lightning-utilities tifffile \
        catalogue zstd brotli python-snappy cramjam tqdm

Also: how long a 1,000,000-member pack index takes to decode. And checked, not timed: every
member of the pack and of Mosaic's MDS copy mounted in place by gpufeed reads back
byte-identical to its file, and every sample of LitData's copy mounted in place to what
LitData's own reader reads.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import os
import re
import shutil
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
from common import scratch_home, settle, small_files
from epochs import (
    BUCKET,
    S3_SERVERS,
    Epoch,
    Loader,
    LocalFiles,
    calibrate,
    collate,
    decode,
    feed_loader,
    make_jpegs,
    run_epoch,
    seeded_loader,
    upload,
)
from torch.utils.data import DataLoader

import gpufeed
from gpufeed.bench.shaper import shaping
from gpufeed.integrations.torch import FeedDataset
from gpufeed.namespace import Namespace
from gpufeed.pack import packer


def import_mosaic() -> Any:
    """Mosaic's `streaming`. Its package imports its vision datasets, which need torchvision; no
    torchvision wheel matches the CPU torch 2.13 installed here, and neither MDSWriter nor
    StreamingDataset uses them, so that one subpackage is replaced by an empty module."""
    stub = types.ModuleType("streaming.vision")
    stub.__spec__ = importlib.machinery.ModuleSpec("streaming.vision", None)
    sys.modules.setdefault("streaming.vision", stub)
    import streaming

    return streaming


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def time_gpufeed(root: Path, out: Path, mount: str, shard: int, workers: int) -> tuple[float, float]:
    """(seconds to mount the directory, seconds to pack it): what `gpufeed mount add` and then
    `gpufeed pack` take, the node agent already running, as it does on a node in service."""
    client = gpufeed.client()
    client.agent.stats()
    started = time.perf_counter()
    client.namespace.add_mount(mount, f"file://{root}")
    mounted = time.perf_counter()
    job = packer.prepare(client, mount, packer.destination(f"file://{out}", {}, client), shard_size=shard)
    packer.pack(client, job, workers=workers)
    return mounted - started, time.perf_counter() - mounted


def time_litdata(paths: list[Path], out: Path, shard: int, workers: int) -> float:
    from litdata import optimize

    started = time.perf_counter()
    optimize(fn=read_file, inputs=[str(p) for p in paths], output_dir=str(out), chunk_bytes=shard, num_workers=workers,
             verbose=False, start_method="fork")
    return time.perf_counter() - started


def time_mds(paths: list[Path], out: Path, shard: int) -> float:
    writer_class = import_mosaic().MDSWriter
    started = time.perf_counter()
    with writer_class(out=str(out), columns={"name": "str", "data": "bytes"}, size_limit=shard) as writer:
        for path in paths:
            writer.write({"name": path.name, "data": path.read_bytes()})
    return time.perf_counter() - started


def packing(label: str, root: Path, work: Path, args: argparse.Namespace) -> None:
    paths = sorted(root.iterdir())
    total = sum(p.stat().st_size for p in paths)
    shard, workers = args.shard_mib << 20, args.workers
    os.sync()  # the files were just written: their writeback is not the first packer's to pay
    mount_s, pack_s = time_gpufeed(root, work / f"{label}-gpufeed", f"/in-{label}", shard, workers)
    os.sync()
    litdata_s = time_litdata(paths, work / f"{label}-litdata", shard, args.workers)
    os.sync()
    times = {
        f"gpufeed pack (--workers {workers})": pack_s,
        "gpufeed mount add, then pack": mount_s + pack_s,
        f"LitData optimize ({args.workers} workers)": litdata_s,
        "Mosaic MDSWriter (1 process)": time_mds(paths, work / f"{label}-mds", shard),
    }
    lit = next(seconds for name, seconds in times.items() if name.startswith("LitData"))
    print(f"\npacking {label}: {len(paths):,} files, {total / 2**20:,.0f} MiB, shards of {args.shard_mib} MiB, local disk")
    print(f"{'packer':<36} {'seconds':>8} {'files/s':>9} {'MiB/s':>7} {'speed vs LitData':>17}")
    for name, seconds in times.items():
        print(f"{name:<36} {seconds:>8.1f} {len(paths) / seconds:>9,.0f} {total / 2**20 / seconds:>7.1f} {lit / seconds:>16.2f}x",
              flush=True)


def index_load(members: int) -> None:
    """How long a pack index of `members` members takes to decode and walk (paths and offsets)."""
    from gpufeed.blocks import sums_length
    from gpufeed.pack import index as idx

    rows = [(f"train/n{n % 1000:08d}/img_{n:07d}.jpg", n // 2300, (n % 2300) * 113_000, 113_000, 1.7e9, bytes(32))
            for n in range(members)]
    shards = [(f"s{n}", 2300 * 113_000) for n in range(members // 2300 + 1)]
    data = idx.encode(idx.build("x", 4 << 20, shards, rows, bytes(sum(sums_length(size) for _, size in shards))))
    started = time.perf_counter()
    index = idx.decode(data, "bench")
    decoded = time.perf_counter() - started
    count = sum(1 for _ in index.members())
    walked = time.perf_counter() - started - decoded
    print(f"\npack index of {count:,} members: {len(data) / 2**20:,.0f} MiB, decoded and checked in {decoded:.2f} s, "
          f"every member walked in {walked:.2f} s more", flush=True)


def same_bytes(mount: str, expected: dict[str, bytes]) -> bool:
    got = gpufeed.client().read_files([f"{mount}/{name}" for name in expected])
    return all(hashlib.sha256(g).digest() == hashlib.sha256(e).digest() for g, e in zip(got, expected.values(), strict=True))


def check_in_place(work: Path, root: Path) -> None:
    """The pack and Mosaic's MDS copy of the JPEG set, mounted in place, hold the files' bytes;
    LitData's copy mounted in place holds what LitData's own reader reads from it, sample by
    sample (its workers number the samples, not the file order)."""
    from litdata import StreamingDataset

    files = {p.name: p.read_bytes() for p in sorted(root.iterdir())}
    uncached = {"cache": "off"}  # the bytes are what is checked: caching three copies would fill a small disk
    Namespace().add_mount("/check-pack", f"file://{work / 'jpegs-gpufeed'}", uncached)
    Namespace().add_mount("/check-mds", f"file://{work / 'jpegs-mds'}", {"format": "mds", **uncached})
    Namespace().add_mount("/check-litdata", f"file://{work / 'jpegs-litdata'}", {"format": "litdata", **uncached})
    mds = {f"{n:08d}.data": data for n, data in enumerate(files.values())}
    optimized = StreamingDataset(str(work / "jpegs-litdata"))
    litdata = {f"{n:08d}.0": optimized[n] for n in range(len(optimized))}
    print(f"\nin place: gpufeed pack identical {same_bytes('/check-pack', files)}; "
          f"Mosaic MDS copy identical {same_bytes('/check-mds', mds)}; "
          f"LitData copy ({len(litdata):,} samples) identical {same_bytes('/check-litdata', litdata)}", flush=True)


class Gets:
    """GET requests the store server logged. moto (werkzeug) writes one line per request with
    its method; s3rver writes one per response, with its status and no method, so there every
    200 or 206 counts (during an epoch nothing but GETs reach it)."""

    def __init__(self, log: Path, store: str) -> None:
        self.log, self.seen = log, 0
        self.pattern = re.compile(rb"GET /" if store == "moto" else rb"info\S*: \S+ 20[06] ")

    def count(self) -> int:
        text = self.log.read_bytes()
        new = len(self.pattern.findall(text, self.seen))
        self.seen = len(text)
        return new


class SelfOrdered(Loader):
    """A loop's one DataLoader over a dataset that counts its epochs itself, in its workers
    (Mosaic's in shared memory, LitData's in its loader and, persistent, in each worker):
    nothing to set between epochs; closed like the others, so persistent workers stop."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader: DataLoader | None = loader

    def __call__(self, epoch: int) -> DataLoader:
        assert self.loader is not None, "closed"
        return self.loader


def mosaic_loader(remote: str, local: Path, args: argparse.Namespace) -> Loader:
    streaming = import_mosaic()

    class Decoded(streaming.StreamingDataset):  # type: ignore[misc,name-defined]
        def __getitem__(self, index: int) -> torch.Tensor:
            return decode(super().__getitem__(index)["data"])

    dataset = Decoded(remote=remote, local=str(local), shuffle=True, shuffle_seed=0, batch_size=args.batch)
    # Its S3 client fetched index.json here, and forked workers inherit it with its kept-alive
    # connection: two workers downloading shards on one socket read each other's responses
    # (measured: a shard whose first 8 MiB part held another shard's bytes, and PIL failing on
    # its samples in 2 runs of 3). Mosaic's own clean_up drops the client, so each worker makes its own.
    for stream in dataset.streams:
        stream._downloader.clean_up()
    return SelfOrdered(DataLoader(dataset, batch_size=args.batch, num_workers=args.workers, collate_fn=collate,
                                  persistent_workers=args.persistent))


def litdata_loader(remote: str, endpoint: str, cache: Path, args: argparse.Namespace) -> Loader:
    """LitData's StreamingDataset in its own StreamingDataLoader (a torch DataLoader that sets the
    dataset's batch size, worker count and epoch, as LitData documents). Its samples are the
    files' bytes (time_litdata's fn). Each worker has its own S3 client, unlike Mosaic's: LitData
    makes its boto3 client anew in a process that did not make it."""
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.streaming import downloader

    # LitData downloads chunks with obstore where it can, but obstore's runtime does not survive a
    # fork, and gpufeed's client has started it in this process: forked workers would hang on
    # their first chunk. LitData's own guard against a parent that started it (set here as it sets
    # it itself) has them download with boto3, as it does then: measured here, about the samples/s
    # of obstore in a process that never started it (2 workers, 1,000 JPEGs, 20 ms away).
    assert hasattr(downloader, "_OBSTORE_INIT_PID"), "this LitData has no obstore fork guard: its workers would hang"
    downloader._OBSTORE_INIT_PID = os.getpid()
    dataset = StreamingDataset(remote, cache_dir=str(cache), shuffle=True, seed=0, transform=decode,
                               storage_options={"endpoint_url": endpoint})
    return SelfOrdered(StreamingDataLoader(dataset, batch_size=args.batch, num_workers=args.workers, collate_fn=collate,
                                           persistent_workers=args.persistent))


def training(work: Path, root: Path, args: argparse.Namespace) -> None:
    paths = sorted(root.iterdir())
    calibration = seeded_loader(LocalFiles(paths), args)
    run_epoch(calibration(0), 0.0)
    data_only = max((run_epoch(calibration(0), 0.0) for _ in range(2)), key=lambda e: e.samples_s)
    step_s = calibrate(lambda step: run_epoch(calibration(0), step), args.busy * args.batch / data_only.samples_s, args.busy)
    calibration.close()
    print(f"\ntraining from S3 ({args.store}) {args.latency_ms:g} ms away: {len(paths):,} JPEGs, batch {args.batch}, "
          f"{args.workers} workers{' (persistent, in every loop)' if args.persistent else ''}, "
          f"accelerator step {step_s * 1000:.0f} ms (local disk alone feeds {data_only.samples_s:,.0f} samples/s)")
    print(f"{'loop':<34} {'epoch':>5} {'samples/s':>10} {'busy':>6} {'vs local':>9} {'GETs':>7} {'agent CPU s':>12} "
          f"{'store+shaper CPU s':>19}")
    rows: list[tuple[str, int, Epoch, int | None]] = []
    failed: list[str] = []

    def loop(name: str, loader: Loader, gets: Gets | None) -> None:
        settle()
        try:
            for epoch in range(args.epochs):
                if gets is not None:
                    gets.count()
                try:
                    result = run_epoch(loader(epoch), step_s)
                except Exception as exc:  # a peer's loop that breaks loses its own rows, not the table
                    failed.append(f"{name}, epoch {epoch + 1}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
                    print(f"  {failed[-1]}", file=sys.stderr, flush=True)
                    return
                rows.append((name, epoch + 1, result, gets.count() if gets is not None else None))
                print(f"  {name}: epoch {epoch + 1} {result.samples_s:,.0f} samples/s", file=sys.stderr, flush=True)
        finally:
            loader.close()  # persistent workers stop here, not in a later loop's epochs

    loop("local disk", seeded_loader(LocalFiles(paths), args), None)
    store, _ = S3_SERVERS[args.store]
    with store(work, root) as endpoint:
        gets = Gets(work / f"{args.store}.log", args.store)
        upload(endpoint, work / "jpegs-gpufeed", "packed")
        upload(endpoint, work / "jpegs-gpufeed", "packed-again")
        upload(endpoint, work / "jpegs-mds", "mds")
        upload(endpoint, work / "jpegs-litdata", "litdata")
        port = int(endpoint.rsplit(":", 1)[1])
        with shaping(("127.0.0.1", port), args.latency_ms, None, work / "shaper.log") as shaped:
            options = {"endpoint": f"http://127.0.0.1:{shaped}"}
            Namespace().add_mount("/raw", f"s3://{BUCKET}/train", options)
            Namespace().add_mount("/packed", f"s3://{BUCKET}/packed", options)
            loop("gpufeed s3, raw files", feed_loader(FeedDataset("/raw", transform=decode), args), gets)
            loop("gpufeed s3, packed", feed_loader(FeedDataset("/packed", transform=decode), args), gets)
            Namespace().add_mount("/packed-block", f"s3://{BUCKET}/packed-again", options)  # a copy: cold blocks of its own
            block_loader = feed_loader(FeedDataset("/packed-block", transform=decode), args, shuffle="block")
            loop("gpufeed s3, packed, block shuffle", block_loader, gets)
            os.environ["S3_ENDPOINT_URL"] = options["endpoint"]
            loop("Mosaic StreamingDataset, MDS copy", mosaic_loader(f"s3://{BUCKET}/mds", work / "mosaic-cache", args), gets)
            litdata = litdata_loader(f"s3://{BUCKET}/litdata", options["endpoint"], work / "litdata-cache", args)
            loop("LitData StreamingDataset, its copy", litdata, gets)
    loop("local disk, again", seeded_loader(LocalFiles(paths), args), None)
    local = statistics.mean(e.samples_s for name, _, e, _ in rows if name.startswith("local disk"))
    for name, epoch, result, count in rows:
        print(f"{name:<34} {epoch:>5} {result.samples_s:>10,.0f} {result.busy:>6.1%} {result.samples_s / local:>8.2f}x "
              f"{'' if count is None else f'{count:,}':>7} {result.cpu_s['agent']:>12.2f} "
              f"{result.cpu_s['store'] + result.cpu_s['shaper']:>19.2f}")
    for line in failed:
        print(f"failed: {line}")
    print("vs local: to the mean of the local-disk loops before and after the others; CPU: seconds the node agent, and "
          "the store server and latency shaper this run hosts beside the loop (a real node hosts neither), spent in the "
          "epoch; LitData downloads with boto3, its fallback where its process started obstore (gpufeed's client did)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--size", type=int, default=113_000)
    parser.add_argument("--small-files", type=int, default=100_000)
    parser.add_argument("--small-size", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--busy", type=float, default=0.9)
    parser.add_argument("--shard-mib", type=int, default=64)
    parser.add_argument("--persistent", action="store_true", help="persistent DataLoader workers")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--store", choices=("moto", "s3rver"), default="moto", help="the S3 server of the training part")
    args = parser.parse_args()
    args.persistent = args.persistent and args.workers > 0  # a DataLoader refuses persistent workers without workers
    os.environ.update(S3_SERVERS[args.store][1])
    torch.set_num_threads(1)
    with scratch_home("gpufeed-pack-") as work:
        root = work / "jpegs"
        total = make_jpegs(root, args.files, args.size)
        print(f"{args.files:,} JPEGs of {total / args.files / 1000:,.0f} KB; {args.small_files:,} files of {args.small_size:,} B")
        packing("jpegs", root, work, args)
        if args.small_files:
            small = work / "small"
            small_files(small, args.small_files, args.small_size)
            packing("small", small, work, args)
            # only its packing time is measured: its copies and the blocks its packing cached
            # (about 4 GiB) would leave the S3 server of the training part no room on a small disk
            for copy in (small, *work.glob("small-*")):
                shutil.rmtree(copy)
            gpufeed.client().agent.clear()
        check_in_place(work, root)
        index_load(1_000_000)
        if not args.skip_training:
            training(work, root, args)


if __name__ == "__main__":
    main()
