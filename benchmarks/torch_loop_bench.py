"""A real PyTorch training loop over an S3 store 20 ms away: the fraction of step time spent
waiting for data with gpufeed (FeedDataset + FeedSampler, cold cache) against the same loop
reading each batch through plain fsspec/s3fs (its concurrent `cat` of the batch's keys, as
FeedDataset fetches a batch together).

    pip install s3fs     # the baseline's reader; a benchmark dependency, not a test one
    python benchmarks/torch_loop_bench.py [--objects 2000] [--size 100000] [--latency-ms 20]

moto's S3 server holds the objects; the latency shaper in front of it delays every request's
first response byte by --latency-ms, as a remote store would. Both loops are the same: a tiny
model trained on CPU (torch 2.13), a DataLoader with --workers workers and --batch samples a
batch, one epoch in a shuffled order, and --accelerator-ms of sleep per step standing for the
accelerator's share of the step (the CPU here is not a GPU). Only the dataset and sampler
differ. A loop's wait fraction is the time spent in next(loader) over the loop's whole time.
A third loop, gpufeed with the sampler's prefetch off (each miss fetched when a worker asks),
shows how much of the gain is the prefetch of the sampler's upcoming order; the cache is
cleared before the last loop, so every loop reads cold.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from common import scratch_home
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

import gpufeed
from gpufeed.bench.children import free_port, helper
from gpufeed.bench.shaper import shaping
from gpufeed.integrations.torch import FeedDataset, FeedSampler
from gpufeed.namespace import Namespace

BUCKET = "torch-loop"
FEATURES = 4096
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def features(data: bytes) -> torch.Tensor:
    """The model's input: the sample's first FEATURES bytes, scaled to [0, 1]."""
    return torch.frombuffer(bytearray(data[:FEATURES]), dtype=torch.uint8).float() / 255


class S3fsDataset(Dataset):
    """The baseline: every sample is one s3fs read, as a plain fsspec dataset does it. Each
    worker opens its own filesystem (no event loop or connection crosses a fork)."""

    def __init__(self, keys: list[str], endpoint: str) -> None:
        self.keys = keys
        self.endpoint = endpoint
        self._fs: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.keys)

    def _filesystem(self) -> Any:
        if self._fs is None or self._pid != os.getpid():
            import s3fs  # imported by the parent before the workers fork: no import inside the epoch

            self._fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, skip_instance_cache=True)
            self._pid = os.getpid()
        return self._fs

    def __getitem__(self, i: int) -> torch.Tensor:
        return features(self._filesystem().cat_file(f"{BUCKET}/{self.keys[i]}"))

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        """The batch's objects fetched together (s3fs's concurrent `cat`), as FeedDataset fetches
        its batch: the same concurrency on both sides, not one request per worker."""
        paths = [f"{BUCKET}/{self.keys[i]}" for i in indices]
        fetched = self._filesystem().cat(paths)
        return [features(fetched[path]) for path in paths]


def train(loader: Iterable[torch.Tensor], accelerator_s: float) -> dict[str, float]:
    """One epoch of a tiny model; returns the time waiting for batches and the loop's time."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    waited = first = 0.0
    samples = 0
    started = time.perf_counter()
    batches = iter(loader)
    while True:
        before = time.perf_counter()
        try:
            batch = next(batches)
        except StopIteration:
            break
        waited += time.perf_counter() - before
        if samples == 0:
            first = waited
        samples += len(batch)
        loss = model(batch).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(accelerator_s)
    elapsed = time.perf_counter() - started
    return {"wait": waited, "first": first, "elapsed": elapsed, "fraction": waited / elapsed, "samples/s": samples / elapsed}


def upload(endpoint: str, objects: int, size: int) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    keys = [f"train/{i:06d}.bin" for i in range(objects)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: s3.put_object(Bucket=BUCKET, Key=key, Body=os.urandom(size)), keys))
    return keys


def loader_of(dataset: Dataset, sampler: Any, args: argparse.Namespace) -> DataLoader:
    return DataLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers)


def report(name: str, result: dict[str, float]) -> None:
    print(
        f"{name:<34} wait fraction {result['fraction']:6.1%}   waited {result['wait']:5.1f} s "
        f"(first batch {result['first']:4.1f} s) of {result['elapsed']:5.1f} s   {result['samples/s']:6.1f} samples/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=2000)
    parser.add_argument("--size", type=int, default=100_000, help="bytes per object")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--accelerator-ms", type=float, default=100.0, help="sleep per step standing for the accelerator")
    args = parser.parse_args()
    if args.size < FEATURES:
        parser.error(f"--size must be at least {FEATURES} bytes")
    moto_server = shutil.which("moto_server", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if moto_server is None:
        sys.exit("moto_server is not installed: pip install -e '.[test]'")
    os.environ.update(CREDENTIALS)
    torch.set_num_threads(1)
    import s3fs  # noqa: F401  # here, not in each worker's first batch
    accelerator_s = args.accelerator_ms / 1000

    with scratch_home("gpufeed-torch-loop-") as work:
        port = free_port()
        with helper([moto_server, "-H", "127.0.0.1", "-p", str(port)], "moto_server", work / "moto.log", port=port):
            keys = upload(f"http://127.0.0.1:{port}", args.objects, args.size)
            with shaping(("127.0.0.1", port), args.latency_ms, None, work / "shaper.log") as shaped_port:
                shaped = f"http://127.0.0.1:{shaped_port}"
                print(
                    f"{args.objects} objects x {args.size / 1000:g} KB on moto S3 behind {args.latency_ms:g} ms; "
                    f"batch {args.batch}, {args.workers} DataLoader workers, {args.accelerator_ms:g} ms accelerator per step"
                )
                baseline_data = S3fsDataset(keys, shaped)
                order = RandomSampler(baseline_data, generator=torch.Generator().manual_seed(0))
                baseline = train(loader_of(baseline_data, order, args), accelerator_s)
                report("fsspec/s3fs", baseline)

                Namespace().add_mount("/bench", f"s3://{BUCKET}/train", {"endpoint": shaped})
                feed_data = FeedDataset("/bench", transform=features)
                unprefetched = train(loader_of(feed_data, FeedSampler(feed_data, prefetch=False), args), accelerator_s)
                report("gpufeed, sampler prefetch off", unprefetched)
                gpufeed.client().agent.clear()  # the next loop starts cold too
                feed = train(loader_of(feed_data, FeedSampler(feed_data), args), accelerator_s)
                report("gpufeed FeedDataset+FeedSampler", feed)
    print(f"samples/s: gpufeed / fsspec-s3fs = {feed['samples/s'] / baseline['samples/s']:.2f}x "
          f"(waiting for data: {baseline['wait']:.1f} s against {feed['wait']:.1f} s)")


if __name__ == "__main__":
    main()
