"""Checkpoints: how long a save blocks the training loop, how fast a restore reads, how fast the
upload goes against the link's cap.

    python benchmarks/checkpoint.py [--sizes 1GiB,4GiB] [--ranks 2] [--latency-ms 20] [--bandwidth 400]

The store is s3rver (it serves byte ranges from disk; moto reads a whole object per range) behind
the latency shaper: 20 ms before each response and a cap on each direction of the link. Each of
`--ranks` gloo ranks holds size/ranks bytes of fp32 tensors of 32 MiB, on CPU. Every step starts
on a barrier and its time is the slowest rank's.

Blocked per save (what the loop waits for):
- torch.save to local disk, DCP FileSystemWriter to local disk (dcp.save): the whole call;
- DCP FileSystemWriter to local disk with dcp.async_save: the call (a copy to host memory);
- gpufeed: dcp.save with GpufeedWriter (the whole call, upload included) and dcp.async_save
  (the call; `cache_staged_state_dict`, so the second save, shown, reuses the host copy);
- s3torchconnector's S3StorageWriter, dcp.save and dcp.async_save, when it is installed
  (`pip install --no-deps s3torchconnector s3torchconnectorclient tenacity`).
Restore (the page cache dropped before each): dcp.load from the local-disk checkpoint (the
baseline), gpufeed on the node that saved (a restart: the blocks are in its cache), gpufeed on a
fresh node (another cache dir and agent: from the store through the shaper), s3torchconnector.
Upload: checkpoint bytes over the time from the async_save call to its future's end, against
the cap, beside what one obstore put of 256 MiB straight to s3rver (no shaper) achieves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import scratch_home  # noqa: E402

import gpufeed  # noqa: E402
import gpufeed.torch  # noqa: E402
from gpufeed.bench.children import free_port, helper  # noqa: E402
from gpufeed.bench.shaper import shaping  # noqa: E402
from gpufeed.client.connection import stop_agent  # noqa: E402
from gpufeed.config import parse_size  # noqa: E402
from gpufeed.namespace import Namespace  # noqa: E402

TENSOR = 32 << 20
BUCKET = "ckpt"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_REGION": "us-east-1"}


def make_state(nbytes: int, rank: int) -> dict[str, torch.Tensor]:
    """This rank's shard of the model: names of its own, as a sharded model's are (DCP saves a
    tensor that two ranks name alike once, as a replica)."""
    generator = torch.Generator().manual_seed(rank)
    count = max(1, nbytes // TENSOR)
    return {f"rank{rank}.layer{i:03d}.weight": torch.randn(TENSOR // 4, generator=generator) for i in range(count)}


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


class Rank:
    """One rank's steps, each timed from a barrier to the slowest rank's end."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.times: dict[str, float] = {}
        self.group = dist.new_group(backend="gloo")  # the timing's collectives never meet an async save's

    def timed(self, name: str, step: Callable[[], Any], *, drop: bool = False) -> Any:
        if self.rank == 0:  # no step pays for the writeback of the one before
            drop_page_cache() if drop else os.sync()
        dist.barrier(group=self.group)
        start = time.perf_counter()
        result = step()
        self.times[name] = self.slowest(time.perf_counter() - start)
        return result

    def slowest(self, seconds: float) -> float:
        elapsed = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=self.group)
        return float(elapsed[0])


def s3tc_filesystem(endpoint: str) -> Any:
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem

    client = S3Client("us-east-1", endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True))
    return S3FileSystem("us-east-1", s3_client=client)


def run_rank(rank: int, world: int, port: int, size: int, work: str, endpoint: str, results: Any) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    me = Rank(rank, world)
    state = make_state(size // world, rank)
    target = {name: torch.empty_like(t) for name, t in state.items()}
    local = Path(work) / "local"
    label = f"{size >> 20}M"

    gpufeed.client().agent.hello()  # the node agent runs before the job, as a service does
    me.timed("torch.save local", lambda: torch.save(state, local / f"torch-{rank}.pt"))
    me.timed("dcp local", lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(local / "dcp")))
    local_async = dcp.FileSystemWriter(local / "dcp-async")  # its cached copy is pinned memory: no accelerator, no cache
    for n in (1, 2):
        saving = me.timed(f"dcp local async call {n}", lambda w=local_async: dcp.async_save(state, storage_writer=w))
        saving.result()

    me.timed("gpufeed sync", lambda: dcp.save(state, storage_writer=gpufeed.torch.GpufeedWriter(f"/ckpt/{label}/sync")))
    gpufeed_async = gpufeed.torch.GpufeedWriter(f"/ckpt/{label}/async", cache_staged_state_dict=True)
    for n in (1, 2):
        began = time.perf_counter()
        saving = me.timed(f"gpufeed async call {n}", lambda w=gpufeed_async: dcp.async_save(state, storage_writer=w))
        saving.result()
        me.times[f"gpufeed async total {n}"] = me.slowest(time.perf_counter() - began)

    s3tc = True
    try:
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
    except ImportError:
        s3tc = False
    if s3tc:
        def s3tc_writer(name: str) -> Any:
            writer = S3StorageWriter("us-east-1", f"s3://{BUCKET}/s3tc/{label}/{name}", thread_count=2)
            writer.fs = s3tc_filesystem(endpoint)
            return writer

        me.timed("s3tc sync", lambda: dcp.save(state, storage_writer=s3tc_writer("sync")))
        saving = me.timed("s3tc async call", lambda: dcp.async_save(state, storage_writer=s3tc_writer("async")))
        saving.result()

    me.timed("restore local", lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(local / "dcp")), drop=True)
    assert all(torch.equal(target[k], state[k]) for k in state)
    reader = gpufeed.torch.GpufeedReader(f"/ckpt/{label}/async")
    me.timed("restore gpufeed same node", lambda: dcp.load(target, storage_reader=reader), drop=True)
    assert all(torch.equal(target[k], state[k]) for k in state)
    os.environ["GPUFEED_CACHE_DIRS"] = str(Path(work) / f"fresh-node-{rank}")
    gpufeed._default = None
    fresh = gpufeed.torch.GpufeedReader(f"/ckpt/{label}/async")
    me.timed("restore gpufeed fresh node", lambda: dcp.load(target, storage_reader=fresh), drop=True)
    assert all(torch.equal(target[k], state[k]) for k in state)
    stop_agent(gpufeed.client().settings)
    if s3tc:
        def s3tc_load() -> None:
            s3tc_reader = S3StorageReader("us-east-1", f"s3://{BUCKET}/s3tc/{label}/sync")
            s3tc_reader.fs = s3tc_filesystem(endpoint)
            dcp.load(target, storage_reader=s3tc_reader)

        me.timed("restore s3tc", s3tc_load, drop=True)
        assert all(torch.equal(target[k], state[k]) for k in state)
    if rank == 0:
        results.put(me.times)
    dist.destroy_process_group()


def store_ceiling(endpoint: str) -> float:
    """MB/s of one 256 MiB put straight to s3rver (no shaper): how fast the store takes one stream."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(BUCKET, endpoint=endpoint, access_key_id="S3RVER", secret_access_key="S3RVER", region="us-east-1",
                    client_options={"allow_http": True})
    body = os.urandom(256 << 20)
    start = time.perf_counter()
    obstore.put(store, "ceiling.bin", body)
    return len(body) / (time.perf_counter() - start) / 1e6


def report(size: int, times: dict[str, float], args: argparse.Namespace, ceiling: float) -> None:
    mb = size / 1e6
    print(f"\n== state {size / 2**30:g} GiB over {args.ranks} ranks; store {args.latency_ms:g} ms, cap {args.bandwidth:g} MB/s "
          f"each way (one 256 MiB put straight to s3rver: {ceiling:,.0f} MB/s)")
    blocked = times["gpufeed async call 2"]
    print(f"{'blocked per save':42} {'s':>8}  gpufeed async_save's block as a share of it")
    for name in ("torch.save local", "dcp local", "dcp local async call 2", "gpufeed sync", "s3tc sync", "s3tc async call",
                 "gpufeed async call 1", "gpufeed async call 2"):
        if name in times:
            print(f"  {name:40} {times[name]:8.3f}  {blocked / times[name]:6.1%}")
    print("restore (page cache dropped)                    s      MB/s   vs local disk")
    base = times["restore local"]
    for name in ("restore local", "restore gpufeed same node", "restore gpufeed fresh node", "restore s3tc"):
        if name in times:
            print(f"  {name:40} {times[name]:8.3f} {mb / times[name]:8.0f}   {base / times[name]:5.2f}x")
    uploads = (("gpufeed async, call to end", times["gpufeed async total 2"]), ("gpufeed sync save", times["gpufeed sync"]),
               ("s3tc sync save", times.get("s3tc sync")))
    for name, seconds in uploads:
        if seconds:
            rate = mb / seconds
            print(f"  upload: {name:32} {rate:8.0f} MB/s = {rate / args.bandwidth:5.2f} of the cap")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1GiB,4GiB", help="checkpoint sizes, all ranks together")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--bandwidth", type=float, default=400.0, help="link cap in MB/s, each way")
    args = parser.parse_args()
    if shutil.which("s3rver") is None:
        sys.exit("checkpoint benchmark: s3rver is missing (npm install -g s3rver)")
    os.environ.update(CREDENTIALS)
    with scratch_home("gpufeed-ckpt-bench-") as work:
        data = work / "s3rver"
        data.mkdir()
        store_port = free_port()
        argv = ["s3rver", "-d", str(data), "-p", str(store_port), "-a", "127.0.0.1", "--configure-bucket", BUCKET, "--silent"]
        with helper(argv, "s3rver", work / "s3rver.log", port=store_port), \
                shaping(("127.0.0.1", store_port), args.latency_ms, args.bandwidth, work / "shaper.log") as shaped:
            direct = f"http://127.0.0.1:{store_port}"
            endpoint = f"http://127.0.0.1:{shaped}"
            ceiling = store_ceiling(direct)
            Namespace().add_mount("/ckpt", f"s3://{BUCKET}/gpufeed", {"endpoint": endpoint}, writable=True, allow_empty=True)
            for size in (parse_size(text) for text in args.sizes.split(",")):
                run = work / f"run-{size}"
                (run / "local").mkdir(parents=True)
                results: Any = mp.get_context("fork").SimpleQueue()
                mp.start_processes(run_rank, args=(args.ranks, free_port(), size, str(run), endpoint, results),
                                   nprocs=args.ranks, start_method="fork")
                report(size, results.get(), args, ceiling)
                shutil.rmtree(run, ignore_errors=True)
                subprocess.run(["rm", "-rf", str(data / BUCKET / "s3tc")], check=False)


if __name__ == "__main__":
    main()
