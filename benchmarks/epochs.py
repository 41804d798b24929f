"""Epoch by epoch, a DataLoader training loop reading JPEGs: local disk against reading the store
directly and against gpufeed over HTTP (nginx) and S3 (moto, or s3rver with --store s3rver),
every store 20 ms away.

    python benchmarks/epochs.py [--files 3000] [--size 113000] [--workers 2] [--batch 32]
                                [--epochs 3] [--latency-ms 20] [--busy 0.9] [--persistent]
                                [--store moto|s3rver] [--immutable]

The workload is issue 12's: --files JPEGs of about --size bytes, decoded with PIL in the
DataLoader's workers (batch --batch, --workers workers, shuffled by a seeded sampler), and an
accelerator step per batch (a sleep: the accelerator uses no host CPU) calibrated so the same
loop on local disk keeps it --busy of the time. Every store is behind the project's latency
shaper (first byte --latency-ms after each request). Loops:

- local: the files read from local disk (page cache warm after the first epoch).
- direct http: each worker GETs its samples one by one from nginx, as a plain dataset over
  object storage does (the loader's own concurrency: workers x one request).
- gpufeed http / gpufeed s3: FeedDataset + FeedSampler over a mount never read before, so epoch
  1 is cold and the later ones warm; and a cold epoch 1 with the sampler's prefetch off, over a
  second path to the same files (new blocks, like a new dataset). No cache is cleared before a
  cold epoch: on ext4, creating files within ~35 s of deleting thousands makes each create scan
  the recently freed inodes (measured here: ≈0.5 ms of kernel CPU a file instead of ≈10 µs),
  which would charge a benchmark's own clean-up to the cold epoch after it.

Printed per loop and epoch: samples/s, accelerator busy %, the ratio of samples/s to local
disk's (in the table, to its first loop; in the summary, to the mean of that loop and one more
after all the others, which shows how much this machine drifted during the run), the CPU
seconds (from /proc) of the rest of the machine (its busy time less the services': the loop and
its workers, the kernel's own threads, anything else running), of the node agent, of the
latency shaper (the emulated network: on a real node this CPU is not spent) and of the store
server, and the bytes fetched from the store against the dataset's size.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import obstore
import torch
import uvloop
from common import scratch_home, settle
from obstore.store import HTTPStore, S3Store
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

import gpufeed
from gpufeed.bench.children import free_port, helper
from gpufeed.bench.server import serving
from gpufeed.bench.shaper import shaping
from gpufeed.integrations.torch import FeedDataset, FeedLoader, FeedSampler
from gpufeed.namespace import Namespace

BUCKET = "epochs"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
S3RVER_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1"}


def decode(data: bytes) -> torch.Tensor:
    """What a vision loader does per sample: decode the JPEG to a uint8 tensor."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)


def collate(samples: list[torch.Tensor]) -> int:
    """Batches stay in the workers' memory; the loop needs their count, not a stacked tensor."""
    return len(samples)


def make_jpegs(root: Path, files: int, size: int) -> int:
    """`files` random-noise JPEGs of about `size` bytes (noise compresses to about 0.9 byte a
    pixel at quality 90); returns their total bytes."""
    side = int((size / 0.92) ** 0.5)
    root.mkdir(parents=True)

    def one(i: int) -> int:
        rng = random.Random(i)
        out = io.BytesIO()
        Image.frombytes("RGB", (side, side), rng.randbytes(side * side * 3)).save(out, "JPEG", quality=90)
        (root / f"{i:06d}.jpg").write_bytes(out.getvalue())
        return out.tell()

    with ThreadPoolExecutor(4) as pool:
        return sum(pool.map(one, range(files)))


class LocalFiles(Dataset):
    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return decode(self.paths[i].read_bytes())


class DirectHttp(Dataset):
    """One GET per sample, straight from the store, in the worker that wants it."""

    def __init__(self, url: str, names: list[str]) -> None:
        self.url = url
        self.names = names
        self._store: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._store is None or self._pid != os.getpid():
            self._store, self._pid = HTTPStore(self.url, client_options={"allow_http": True}), os.getpid()
        return decode(obstore.get(self._store, self.names[i]).bytes().to_bytes())


class DirectHttpBatched(DirectHttp):
    """The batch's GETs in flight together, straight from the store: the batch concurrency
    FeedDataset has, without a cache or prefetch; what a dataset written for object storage
    does, so gpufeed's cold epoch is also shown against it, not only against one GET a worker."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        if self._store is None or self._pid != os.getpid():
            self._store, self._pid = HTTPStore(self.url, client_options={"allow_http": True}), os.getpid()

        async def fetch() -> list[bytes]:
            results = await asyncio.gather(*(obstore.get_async(self._store, self.names[i]) for i in indices))
            return [(await result.bytes_async()).to_bytes() for result in results]

        return [decode(data) for data in asyncio.run(fetch())]


class SeededShuffle(Sampler[int]):
    """The order `RandomSampler(generator=torch.Generator().manual_seed(epoch))` gives, the
    epoch set between epochs, so one DataLoader serves every epoch of a loop."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.count, generator=torch.Generator().manual_seed(self.epoch)).tolist())


class Loader:
    """A loop's one DataLoader for all its epochs, as a training script keeps one. Made anew
    each epoch with persistent workers, each would leave its workers running until the garbage
    collector found it, to be inherited by every worker forked after (measured with 8 workers:
    local disk's first epoch at 0.19x of its second). `close` stops its workers."""

    def __init__(self, loader: DataLoader, sampler: SeededShuffle | FeedSampler) -> None:
        self.loader: DataLoader | None = loader
        self.sampler = sampler

    def __call__(self, epoch: int) -> DataLoader:
        assert self.loader is not None, "closed"
        self.sampler.set_epoch(epoch)
        return self.loader

    def close(self) -> None:
        self.loader = None
        gc.collect()  # a persistent-worker iterator stops its workers when it is collected


def seeded_loader(dataset: Dataset, args: argparse.Namespace) -> Loader:
    order = SeededShuffle(len(dataset))  # type: ignore[arg-type]
    return Loader(DataLoader(dataset, batch_size=args.batch, sampler=order, num_workers=args.workers, collate_fn=collate,
                             persistent_workers=args.persistent), order)


@dataclass
class Epoch:
    samples_s: float
    busy: float
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds of the node agent, the shaper and the store server during the epoch, and of
    the whole machine ("node"): what the others leave of it is mostly the job's (the loop, its
    workers), with the kernel's threads and anything else running."""
    fetched: int = 0


@dataclass
class Loop:
    name: str
    epochs: list[Epoch] = field(default_factory=list)


SERVICES = {"shaper": ("gpufeed.bench.shaper",), "store": ("nginx", "moto_server", "s3rver")}


def cpu_s(pid: int) -> float:
    """A process's user+system CPU seconds so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def node_cpu_s() -> float:
    """The machine's busy CPU seconds so far, every core and process together (/proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def service_cpu_s() -> dict[str, float]:
    """CPU seconds so far of this run's node agent, and of the shapers and store servers this
    process started."""
    try:
        totals = {"agent": cpu_s(gpufeed.client().agent.stats(start=False).pid)}
    except Exception:
        totals = {"agent": 0.0}
    totals |= dict.fromkeys(SERVICES, 0.0)
    totals["node"] = node_cpu_s()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            parent = int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1])
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[:3] if parent == os.getpid() else []
        except OSError:
            continue
        names = {os.path.basename(a.decode(errors="replace")) for a in argv}
        for kind, marks in SERVICES.items():
            if names.intersection(marks):
                totals[kind] += cpu_s(int(entry))
    return totals


def agent_fetched() -> int:
    try:
        return gpufeed.client().agent.stats(start=False).bytes_fetched
    except Exception:
        return 0


@dataclass(frozen=True)
class Clock:
    """An epoch's start: the time, the services' CPU seconds and the agent's fetched bytes then."""

    cpu: dict[str, float]
    fetched: int
    started: float


def start_clock() -> Clock:
    return Clock(service_cpu_s(), agent_fetched(), time.perf_counter())


def run_epoch(loader: Iterator[int] | DataLoader, step_s: float, clock: Clock | None = None) -> Epoch:
    """One pass: the accelerator's step after each batch; busy = time in steps / wall time,
    the first batch included (a cold start is part of the epoch a user waits for). `clock`:
    started earlier, where set-up that may already read (a mount's warmup) belongs to the epoch."""
    clock = clock or start_clock()
    cpu, fetched, started = clock.cpu, clock.fetched, clock.started
    samples = steps = 0
    for count in loader:
        samples += count
        steps += 1
        time.sleep(step_s)
    wall = time.perf_counter() - started
    spent = {kind: seconds - cpu[kind] for kind, seconds in service_cpu_s().items()}
    return Epoch(samples / wall, steps * step_s / wall, spent, agent_fetched() - fetched)


def calibrate(measure: Callable[[float], Epoch], step_s: float, busy: float) -> float:
    """The step that keeps the accelerator `busy` on local disk. Busy = step / batch time; while
    the loop waits for data the batch time is the data's, so scaling the step by busy / measured
    lands on it (the workers run beside the step, so the data-only rate is only a first guess)."""
    for _ in range(3):
        measured = measure(step_s)
        if abs(measured.busy - busy) < 0.02:
            break
        step_s *= busy / measured.busy  # data-bound: the batch time stays, so this lands on `busy`
    return step_s


def run_loop(name: str, epochs: int, loader: Loader, step_s: float, report: Callable[[Loop], None]) -> Loop:
    """`epochs` epochs of one way of reading, with a loader of its own (its first epoch starts
    the workers, as a job's does). The set-up before it is settled first (`settle`: the JPEGs,
    the plain-write baseline and S3 uploads written back, its garbage collected), so neither
    lands in this loop's epochs; what a loop writes itself is not flushed between its epochs."""
    settle()
    loop = Loop(name)
    try:
        for epoch in range(epochs):
            loop.epochs.append(run_epoch(loader(epoch), step_s))
            print(f"  {name}: epoch {epoch + 1} {loop.epochs[-1].samples_s:,.0f} samples/s", file=sys.stderr, flush=True)
    finally:
        loader.close()
    report(loop)
    return loop


def plain_write_ms(paths: list[Path], target: Path) -> float:
    """CPU ms per file to write `paths`' bytes to new files under `target` as plainly as a cache
    can (open, write, close, rename into place): the part of a cold object's cost that is this
    machine's filesystem and memory, measured next to the agent's. Nothing is deleted (see the
    module doc)."""
    contents = [p.read_bytes() for p in paths]
    (target / "tmp").mkdir(parents=True)
    started = time.process_time()
    for n, data in enumerate(contents):
        temp = target / "tmp" / str(n)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.rename(temp, target / str(n))
    return (time.process_time() - started) / len(paths) * 1000


def bare_get_ms(store: Any, keys: list[str], sizes: list[int] | None = None, concurrency: int = 48) -> float:
    """CPU ms per object of GETting `keys` with obstore alone on uvloop (no checks, no cache, no
    agent): the store client's part of a cold object's cost, measured in this process. With
    `sizes`, each as one plain ranged GET (one completion), as the agent reads an object whose
    version its request need not pin; else a GET and then its body, as it reads the others."""

    async def fetch_all() -> None:
        slots = asyncio.Semaphore(concurrency)

        async def one(n: int, key: str) -> None:
            async with slots:
                if sizes is None:
                    await (await obstore.get_async(store, key)).bytes_async()
                else:
                    await obstore.get_range_async(store, key, start=0, end=sizes[n])

        await asyncio.gather(*(one(n, key) for n, key in enumerate(keys)))

    started = time.process_time()
    uvloop.run(fetch_all())
    return (time.process_time() - started) / len(keys) * 1000


def feed_loader(dataset: FeedDataset, args: argparse.Namespace, prefetch: bool = True, shuffle: bool | str = True) -> Loader:
    gpufeed.client().agent.stats()  # the agent runs before epoch 1: its start-up is not a cold object's CPU
    sampler = FeedSampler(dataset, shuffle=shuffle, seed=0, prefetch=prefetch)
    return Loader(FeedLoader(dataset, batch_size=args.batch, sampler=sampler, num_workers=args.workers, collate_fn=collate,
                             persistent_workers=args.persistent), sampler)


@contextmanager
def s3_store(work: Path, root: Path) -> Iterator[str]:
    """moto's S3 server holding the JPEGs under train/; yields its endpoint."""
    import boto3

    moto = shutil.which("moto_server", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if moto is None:
        sys.exit("moto_server is not installed: pip install -e '.[test]'")
    port = free_port()
    with helper([moto, "-H", "127.0.0.1", "-p", str(port)], "moto_server", work / "moto.log", port=port):
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        upload(endpoint, root, "train")
        yield endpoint


@contextmanager
def s3rver_store(work: Path, root: Path) -> Iterator[str]:
    """s3rver holding the JPEGs under train/; yields its endpoint."""
    if shutil.which("s3rver") is None:
        sys.exit("s3rver is not installed: npm install -g s3rver")
    port = free_port()
    argv = ["s3rver", "-d", str(work / "s3rver"), "-p", str(port), "-a", "127.0.0.1", "--configure-bucket", BUCKET]
    legacy = {"NODE_OPTIONS": "--openssl-legacy-provider"}  # its continuation tokens (past 1,000 keys) use an old cipher
    with helper(argv, "s3rver", work / "s3rver.log", port=port, env=legacy):
        endpoint = f"http://127.0.0.1:{port}"
        upload(endpoint, root, "train")
        yield endpoint


def upload(endpoint: str, local: Path, prefix: str) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    files = [p for p in local.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{p.relative_to(local)}", Body=p.read_bytes()), files))


S3_SERVERS = {"moto": (s3_store, CREDENTIALS), "s3rver": (s3rver_store, S3RVER_CREDENTIALS)}
"""The S3 servers a benchmark can use, with the credentials each takes: moto (the tests' server,
which reads a whole object for every ranged GET and costs this machine milliseconds of CPU per
GET) and s3rver (ranges served from disk, and cheaper per GET)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--size", type=int, default=113_000, help="bytes per JPEG, about")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--busy", type=float, default=0.9, help="accelerator busy share the step is calibrated to on local disk")
    parser.add_argument("--persistent", action="store_true", help="persistent DataLoader workers")
    parser.add_argument("--immutable", action="store_true",
                        help="mount the stores --immutable, as for a dataset that does not change: reads pin no version")
    parser.add_argument("--store", choices=sorted(S3_SERVERS), default="moto",
                        help="the S3 server: moto burns milliseconds of this machine's CPU per GET, s3rver less")
    args = parser.parse_args()
    s3_server, s3_credentials = S3_SERVERS[args.store]
    os.environ.update(s3_credentials)
    torch.set_num_threads(1)

    with scratch_home("gpufeed-epochs-") as work:
        root = work / "jpegs"
        total = make_jpegs(root, args.files, args.size)
        paths = sorted(root.iterdir())
        names = [p.name for p in paths]
        sizes = [p.stat().st_size for p in paths]

        calibration = seeded_loader(LocalFiles(paths), args)
        run_epoch(calibration(0), 0.0)  # warms the page cache
        # the faster of two: a run slowed by something else on the machine would make the step too long
        data_only = max((run_epoch(calibration(0), 0.0) for _ in range(2)), key=lambda epoch: epoch.samples_s)
        step_s = calibrate(lambda step: run_epoch(calibration(0), step), args.busy * args.batch / data_only.samples_s, args.busy)
        calibration.close()
        print(f"{args.files} JPEGs, {total / 2**20:,.0f} MiB ({total / args.files / 1000:,.0f} KB each); batch {args.batch}, "
              f"{args.workers} workers{' (persistent)' if args.persistent else ''}; stores {args.latency_ms:g} ms away"
              f"{', mounted --immutable' if args.immutable else ''}; "
              f"accelerator step {step_s * 1000:.0f} ms (local disk alone feeds {data_only.samples_s:,.0f} samples/s)")
        results: list[Loop] = []
        writes: dict[str, float] = {}
        gets: dict[str, float] = {}
        local_rate = 0.0

        def report(loop: Loop) -> None:
            results.append(loop)
            base = local_rate or statistics.mean(e.samples_s for e in loop.epochs)
            for n, epoch in enumerate(loop.epochs, 1):
                fetched = f"{epoch.fetched / total:5.2f}x data" if loop.name.startswith("gpufeed") else ""
                spent = epoch.cpu_s
                rest = spent["node"] - spent["agent"] - spent["shaper"] - spent["store"]
                cpu = f"{rest:5.2f} s " + (f"{spent['agent']:5.2f} s {spent['shaper']:5.2f} s {spent['store']:5.2f} s"
                                          if loop.name.startswith("gpufeed") else "")
                print(f"{loop.name:<28} {n:>5} {epoch.samples_s:>10,.0f} {epoch.busy:>6.1%} {epoch.samples_s / base:>8.2f}x "
                      f"{cpu:<31} {fetched:>11}", flush=True)

        print(f"{'loop':<28} {'epoch':>5} {'samples/s':>10} {'busy':>6} {'vs local':>9} "
              f"{'CPU: rest / agent / shaper / store':<31} {'fetched':>11}")
        local = run_loop("local disk", args.epochs, seeded_loader(LocalFiles(paths), args), step_s, report)
        local_rate = statistics.mean(e.samples_s for e in local.epochs)

        with serving(root.parent, work / "nginx") as http_url:
            port = int(http_url.rsplit(":", 1)[1])
            with shaping(("127.0.0.1", port), args.latency_ms, None, work / "shaper-http.log") as shaped:
                url = f"http://127.0.0.1:{shaped}/{root.name}"

                run_loop("direct http", 1, seeded_loader(DirectHttp(url, names), args), step_s, report)
                run_loop("direct http, batch at once", 1, seeded_loader(DirectHttpBatched(url, names), args), step_s, report)
                Namespace().add_mount("/http", url, immutable=args.immutable)
                http = FeedDataset("/http", transform=decode)
                writes["gpufeed http"] = plain_write_ms(paths, work / "home" / "plain-http")
                http_store = HTTPStore(url, client_options={"allow_http": True})
                gets["gpufeed http"] = bare_get_ms(http_store, names, sizes if args.immutable else None)
                run_loop("gpufeed http", args.epochs, feed_loader(http, args), step_s, report)
                (root.parent / "again").symlink_to(root.name)  # the same files at a second URL: blocks never cached
                Namespace().add_mount("/http-again", f"http://127.0.0.1:{shaped}/again", immutable=args.immutable)
                again = FeedDataset("/http-again", transform=decode)
                writes["gpufeed http, prefetch off"] = plain_write_ms(paths, work / "home" / "plain-again")
                gets["gpufeed http, prefetch off"] = gets["gpufeed http"]
                run_loop("gpufeed http, prefetch off", 1, feed_loader(again, args, prefetch=False), step_s, report)

        with s3_server(work, root) as endpoint:
            port = int(endpoint.rsplit(":", 1)[1])
            with shaping(("127.0.0.1", port), args.latency_ms, None, work / "shaper-s3.log") as shaped:
                Namespace().add_mount("/s3", f"s3://{BUCKET}/train", {"endpoint": f"http://127.0.0.1:{shaped}"},
                                      immutable=args.immutable)
                s3 = FeedDataset("/s3", transform=decode)
                writes[f"gpufeed s3 ({args.store})"] = plain_write_ms(paths, work / "home" / "plain-s3")
                store = S3Store(BUCKET, endpoint=f"http://127.0.0.1:{shaped}", client_options={"allow_http": True})
                # S3 objects are read in one plain GET either way: their ETag names their bytes
                gets[f"gpufeed s3 ({args.store})"] = bare_get_ms(store, [f"train/{name}" for name in names], sizes)
                run_loop(f"gpufeed s3 ({args.store})", args.epochs, feed_loader(s3, args), step_s, report)

        after = run_loop("local disk, again", args.epochs, seeded_loader(LocalFiles(paths), args), step_s, report)
        local_rate = statistics.mean(e.samples_s for e in local.epochs + after.epochs)
        print(f"local disk fed {statistics.mean(e.samples_s for e in local.epochs):,.0f} samples/s before the other loops "
              f"and {statistics.mean(e.samples_s for e in after.epochs):,.0f} after them; the ratios below are to the mean")

    summary = {loop.name: [e.samples_s / local_rate for e in loop.epochs] for loop in results}
    print("samples/s as a fraction of local disk's: " + "; ".join(
        f"{name} " + " / ".join(f"{r:.2f}" for r in ratios) for name, ratios in summary.items()))
    for loop in results:
        if loop.name.startswith("gpufeed"):
            per_object = {kind: seconds / args.files * 1000 for kind, seconds in loop.epochs[0].cpu_s.items() if kind != "node"}
            print(f"CPU per cold object, {loop.name}: " + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in per_object.items())
                  + f" (in this run, a bare obstore GET of each object, asked as the agent asks: {gets[loop.name]:.2f} ms; "
                  f"a plain open/write/rename of each file: {writes[loop.name]:.2f} ms)")


if __name__ == "__main__":
    main()
