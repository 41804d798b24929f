"""An unchanged ImageFolder-style loop (PIL opens each JPEG by path) through `gpufeed fuse`,
against the same loop on local disk and through rclone (`--vfs-cache-mode full`) and s3fs-fuse
mounts of the same store, 20 ms away; and a warm sequential read of a big file.

    python benchmarks/fuse.py [--files 3000] [--size 113000] [--workers 2] [--batch 32]
                              [--latency-ms 20] [--busy 0.9] [--big-mib 1024] [--store moto|s3rver]
                              [--skip rclone,s3fs,nginx,big] [--immutable]

The JPEGs and the accelerator step come from benchmarks/epochs.py (the step is calibrated so
the loop on local disk keeps the accelerator --busy of the time; --busy 0 runs no step: data
only). Every mount serves the same S3 bucket (moto, or s3rver with --store s3rver: it serves
from disk and spends less of this machine's CPU per GET) behind the project's latency shaper; every
loop uses the same --workers DataLoader workers and the same shuffled order. The kernel's page
cache is dropped before each loop's first epoch, so epoch 1 is cold for everyone (gpufeed's
node cache is new too: nothing of this dataset was ever fetched); epoch 2 is warm for
everyone (nothing is dropped between epochs). gpufeed's mount warms the mounted path in the
background from the moment it is mounted, as `gpufeed fuse` does by default; the loop starts
at once. Python callbacks per file open are counted by the daemon (`gpufeed fuse ls`), per file the loop opened.

A second gpufeed loop reads the same files from nginx (--skip nginx leaves it out), and so does
rclone's HTTP remote (from an nginx listing its directories as HTML pages, which rclone parses):
an S3 server on this machine spends milliseconds of its CPU per cold object (moto 2 to 7 ms,
s3rver about 1), which on a real node the remote store spends. Each peer is compared with
gpufeed at the same store. The CPU of the daemon, the agent, the shaper and the store server
is printed per gpufeed epoch.

The big file: --big-mib of random bytes on local disk, mounted as file:// and loaded into
the node cache with `gpufeed warmup`; then `cat` of it through the mount against `cat` of the
local file, page cache dropped first (both read from this disk: the block files, the file),
then again with the page cache hot (the mount's pages kept across opens); and once through a
new mount while the block files are still in the page cache (every byte through the daemon).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from common import scratch_home, settle
from epochs import BUCKET, S3_SERVERS, Clock, Epoch, calibrate, collate, cpu_s, make_jpegs, run_epoch, start_clock
from PIL import Image
from torch.utils.data import DataLoader, Dataset, RandomSampler

import gpufeed
from gpufeed.bench.server import serving
from gpufeed.bench.shaper import shaping
from gpufeed.config import Settings
from gpufeed.integrations import fuse_mounts
from gpufeed.namespace import Namespace


class ImageFiles(Dataset):
    """torchvision's ImageFolder in what matters here: a listing of a directory, then
    PIL.Image.open(path) per sample, decoded to RGB."""

    def __init__(self, root: Path) -> None:
        self.paths = sorted(root / name for name in os.listdir(root))

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        with Image.open(self.paths[i]) as image:
            return torch.frombuffer(bytearray(image.convert("RGB").tobytes()), dtype=torch.uint8)


def drop_caches() -> None:
    """Empty the kernel's page cache (root only), so the next read comes from disk or the store;
    the set-up is settled first (`settle`)."""
    settle()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def plain_env() -> dict[str, str]:
    """This environment without AWS_CA_BUNDLE: rclone's AWS SDK refuses a custom CA bundle on
    its HTTP transport (and the store here is plain http)."""
    return {k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"}


def wait_mounted(point: Path, process: subprocess.Popen[bytes] | None, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while point not in mounted_points():
        if process is not None and process.poll() is not None:
            sys.exit(f"{what} exited with code {process.returncode} before mounting")
        if time.monotonic() > deadline:
            sys.exit(f"{what} did not mount {point} within {timeout:.0f} s")
        time.sleep(0.05)


def mounted_points() -> set[Path]:
    return {Path(line.split()[4]) for line in Path("/proc/self/mountinfo").read_text().splitlines()}


def unmount(point: Path, process: subprocess.Popen[bytes] | None = None) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(point)], check=False, capture_output=True)
    if process is not None:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


@contextmanager
def gpufeed_mount(point: Path, nspath: str, warmup: bool = True) -> Iterator[int]:
    """`gpufeed fuse` at `point` until the block ends; yields the daemon's pid."""
    point.mkdir()
    argv = [sys.executable, "-m", "gpufeed", "fuse", str(point), nspath, *([] if warmup else ["--no-warmup"])]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    try:
        yield int(out.split("(pid ")[1].split(")")[0].split(",")[0])
    finally:
        unmount(point)


@contextmanager
def peer_mount(point: Path, name: str, argv: list[str]) -> Iterator[Path]:
    """Another tool's FUSE mount (`argv`, which serves in the foreground) at `point`, until the block ends."""
    point.mkdir()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=plain_env())
    wait_mounted(point, process, name)
    try:
        yield point
    finally:
        unmount(point, process)


def rclone_s3(point: Path, endpoint: str, cache: Path) -> list[str]:
    return ["rclone", "mount", f":s3:{BUCKET}/train", str(point), "--read-only", "--vfs-cache-mode", "full",
            "--cache-dir", str(cache), "--s3-provider", "Other", "--s3-endpoint", endpoint, "--s3-region", "us-east-1",
            "--s3-access-key-id", os.environ["AWS_ACCESS_KEY_ID"], "--s3-secret-access-key",
            os.environ["AWS_SECRET_ACCESS_KEY"], "--config", "/dev/null"]  # fmt: skip


def rclone_http(point: Path, url: str, cache: Path) -> list[str]:
    """rclone's HTTP remote over the same files at nginx (it lists nginx's HTML index)."""
    return ["rclone", "mount", ":http:", str(point), "--http-url", url, "--read-only", "--vfs-cache-mode", "full",
            "--cache-dir", str(cache), "--config", "/dev/null"]  # fmt: skip


def s3fs(point: Path, endpoint: str, cache: Path) -> list[str]:
    cache.mkdir()
    secrets = point.parent / "s3fs-passwd"
    secrets.write_text(f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}\n")
    secrets.chmod(0o600)
    return ["s3fs", f"{BUCKET}:/train", str(point), "-f", "-o", f"url={endpoint}", "-o", "use_path_request_style",
            "-o", f"passwd_file={secrets}", "-o", f"use_cache={cache}", "-o", "ro"]  # fmt: skip


@dataclass
class Loop:
    name: str
    epochs: list[Epoch] = field(default_factory=list)
    callbacks: list[str] = field(default_factory=list)
    daemon_cpu_s: list[float] = field(default_factory=list)


def calls_now(point: Path) -> dict[str, int]:
    """The daemon's callback counts once its state file is newer than now."""
    asked = time.time()
    settings = Settings.from_env()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = fuse_mounts.state(settings, point) or {}
        if float(state.get("written", 0)) > asked:  # type: ignore[arg-type]
            return dict(state["calls"])  # type: ignore[call-overload]
        time.sleep(0.1)
    sys.exit(f"the gpufeed daemon at {point} wrote no state file")


def per_open(before: dict[str, int], after: dict[str, int], opens: int) -> str:
    """Callbacks per file the loop opened (`opens`): an immutable mount's daemon hears of no
    open but the first (zero-message opens), so its own count is no denominator."""
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    parts = ", ".join(f"{name} {count / opens:.2f}" for name, count in sorted(delta.items()) if count)
    return f"{sum(delta.values()) / opens:.2f} callbacks per open ({parts})"


def run_loop(name: str, root: Path, args: argparse.Namespace, step_s: float, daemon: int = 0, clock: Clock | None = None) -> Loop:
    """Two epochs over `root`, the page cache dropped before the first (unless `daemon`, the pid
    of the gpufeed mount's daemon, says the caller just mounted it and dropped it before).
    `clock`: epoch 1's, started before the mount, whose daemon's CPU then all counts."""
    if not daemon:
        drop_caches()
    dataset = ImageFiles(root)
    loop = Loop(name)
    for epoch in range(2):
        order = RandomSampler(dataset, generator=torch.Generator().manual_seed(epoch))
        loader = DataLoader(dataset, batch_size=args.batch, sampler=order, num_workers=args.workers, collate_fn=collate)
        before = calls_now(root) if daemon and epoch else {}  # epoch 1: the mount is new, its counts near 0
        cpu = cpu_s(daemon) if daemon and not (clock and epoch == 0) else 0.0
        loop.epochs.append(run_epoch(loader, step_s, clock if epoch == 0 else None))
        if daemon:
            loop.daemon_cpu_s.append(cpu_s(daemon) - cpu)
            loop.callbacks.append(per_open(before, calls_now(root), len(dataset)))
        print(f"  {name}: epoch {epoch + 1} {loop.epochs[-1].samples_s:,.0f} samples/s", file=sys.stderr, flush=True)
    return loop


def run_feed_loop(name: str, point: Path, nspath: str, args: argparse.Namespace, step_s: float) -> Loop:
    """`run_loop` through a gpufeed mount made as epoch 1 starts (the page cache dropped first),
    as a user mounts and then runs the script: its background warmup runs beside the job from
    the job's first moment. Mounted before the drop and the wait for the daemon's state file,
    the warmup had fetched part of the set before epoch 1's clock started; so the clock starts
    before the mount, and the mount's time (and what its warmup fetched meanwhile) is epoch 1's."""
    drop_caches()
    clock = start_clock()
    with gpufeed_mount(point, nspath) as daemon:
        return run_loop(name, point, args, step_s, daemon, clock)


def cat_gb_s(path: Path) -> float:
    started = time.perf_counter()
    subprocess.run(["cat", str(path)], check=True, stdout=subprocess.DEVNULL)
    return path.stat().st_size / (time.perf_counter() - started) / 1e9


def big_file(work: Path, mib: int) -> list[tuple[str, float]]:
    """Warm sequential reads: cat through the mount vs cat of the local file."""
    source = work / "big"
    source.mkdir()
    local = source / "big.bin"
    chunk = os.urandom(1 << 20)
    with local.open("wb") as out:
        for _ in range(mib):
            out.write(chunk)
    Namespace().add_mount("/big", f"file://{source}")
    subprocess.run([sys.executable, "-m", "gpufeed", "warmup", "-q", "/big"], check=True, stdout=subprocess.DEVNULL)
    rows = []
    point = work / "mnt-big"
    with gpufeed_mount(point, "/big", warmup=False):
        before = calls_now(point)
        for where, path in (("local file", local), ("gpufeed fuse", point / "big.bin")):
            drop_caches()
            rows.append((f"{where}, page cache dropped", cat_gb_s(path)))
            rows.append((f"{where}, page cache hot", cat_gb_s(path)))
        after = calls_now(point)
    point = work / "mnt-big-again"
    with gpufeed_mount(point, "/big", warmup=False):  # new files: nothing in their page cache
        rows.append(("gpufeed fuse, new mount, block files hot", cat_gb_s(point / "big.bin")))
    reads = after.get("read", 0) - before.get("read", 0)
    print(f"big file: {mib} MiB, {reads} read callbacks for the two cats through the mount "
          f"({mib / max(reads, 1):.2f} MiB per callback)")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=3000)
    parser.add_argument("--size", type=int, default=113_000, help="bytes per JPEG, about")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--busy", type=float, default=0.9, help="accelerator busy share on local disk (0: no step)")
    parser.add_argument("--big-mib", type=int, default=1024)
    parser.add_argument("--store", choices=sorted(S3_SERVERS), default="moto", help="the S3 server every S3 mount reads")
    parser.add_argument("--skip", default="", help="comma-separated: rclone, s3fs, nginx, big")
    parser.add_argument("--immutable", action="store_true",
                        help="mount the stores --immutable, as for a dataset that does not change: reads pin no version")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if os.geteuid() != 0:
        sys.exit("run as root: every loop starts with the page cache dropped (/proc/sys/vm/drop_caches)")
    store, credentials = S3_SERVERS[args.store]
    os.environ.update(credentials)
    torch.set_num_threads(1)

    with scratch_home("gpufeed-fuse-") as work:
        root = work / "jpegs"
        total = make_jpegs(root, args.files, args.size)

        def local(step: float) -> Epoch:
            order = RandomSampler(root_set, generator=torch.Generator().manual_seed(0))
            return run_epoch(DataLoader(root_set, batch_size=args.batch, sampler=order, num_workers=args.workers,
                                        collate_fn=collate), step)  # fmt: skip

        root_set = ImageFiles(root)
        local(0.0)
        data_only = max((local(0.0) for _ in range(2)), key=lambda epoch: epoch.samples_s)
        step_s = calibrate(local, args.busy * args.batch / data_only.samples_s, args.busy) if args.busy else 0.0
        print(f"{args.files} JPEGs, {total / 2**20:,.0f} MiB; batch {args.batch}, {args.workers} DataLoader workers for "
              f"every loop; store: {args.store} S3 {args.latency_ms:g} ms away"
              f"{' (gpufeed mounts --immutable)' if args.immutable else ''}; accelerator step {step_s * 1000:.0f} ms "
              f"(local disk alone feeds {data_only.samples_s:,.0f} samples/s)", flush=True)  # fmt: skip

        loops = [run_loop("local disk", root, args, step_s)]
        with store(work, root) as endpoint:
            port = int(endpoint.rsplit(":", 1)[1])
            with shaping(("127.0.0.1", port), args.latency_ms, None, work / "shaper.log") as shaped:
                remote = f"http://127.0.0.1:{shaped}"
                Namespace().add_mount("/s3", f"s3://{BUCKET}/train", {"endpoint": remote}, immutable=args.immutable)
                gpufeed.client().agent.stats()  # the node agent runs as a service before the job starts
                loops.append(run_feed_loop("gpufeed fuse", work / "mnt-gpufeed", "/s3", args, step_s))
                if "rclone" not in skip and shutil.which("rclone"):
                    point = work / "mnt-rclone"
                    with peer_mount(point, "rclone", rclone_s3(point, remote, work / "rclone-cache")):
                        loops.append(run_loop("rclone vfs-cache full", point, args, step_s))
                if "s3fs" not in skip and shutil.which("s3fs"):
                    point = work / "mnt-s3fs"
                    with peer_mount(point, "s3fs", s3fs(point, remote, work / "s3fs-cache")):
                        loops.append(run_loop("s3fs use_cache", point, args, step_s))
        if "nginx" not in skip:  # the same files at a store whose server costs this machine little CPU
            with serving(root.parent, work / "nginx") as http_url:
                port = int(http_url.rsplit(":", 1)[1])
                with shaping(("127.0.0.1", port), args.latency_ms, None, work / "shaper-http.log") as shaped:
                    Namespace().add_mount("/http", f"http://127.0.0.1:{shaped}/{root.name}", immutable=args.immutable)
                    loops.append(run_feed_loop("gpufeed fuse, nginx", work / "mnt-http", "/http", args, step_s))
            if "rclone" not in skip and shutil.which("rclone"):  # the same store for rclone: its HTTP remote
                with serving(root.parent, work / "nginx-html", index="html") as html_url:
                    port = int(html_url.rsplit(":", 1)[1])
                    point = work / "mnt-rclone-http"
                    with shaping(("127.0.0.1", port), args.latency_ms, None, work / "shaper-html.log") as shaped:
                        argv = rclone_http(point, f"http://127.0.0.1:{shaped}/{root.name}/", work / "rclone-http-cache")
                        with peer_mount(point, "rclone", argv):
                            loops.append(run_loop("rclone vfs-cache full, nginx", point, args, step_s))
        loops.append(run_loop("local disk, again", root, args, step_s))
        big = [] if "big" in skip else big_file(work, args.big_mib)

    local_rate = [statistics.mean(loop.epochs[n].samples_s for loop in loops if loop.name.startswith("local")) for n in (0, 1)]
    print(f"\n{'loop':<24} {'epoch 1 samples/s':>18} {'vs local':>9} {'epoch 2 samples/s':>18} {'vs local':>9}")
    for loop in loops:
        cells = [f"{e.samples_s:>18,.0f} {e.samples_s / local_rate[n]:>8.2f}x" for n, e in enumerate(loop.epochs)]
        print(f"{loop.name:<24} {' '.join(cells)}")
    print(f"(local: the mean of its loop before and after the others: epoch 1 {local_rate[0]:,.0f}, "
          f"epoch 2 {local_rate[1]:,.0f} samples/s)")  # fmt: skip
    for loop in loops:  # each peer against gpufeed at the same store
        if loop.name.startswith(("rclone", "s3fs")):
            at_nginx = loop.name.endswith(", nginx")
            feed = next(f for f in loops if f.name == ("gpufeed fuse, nginx" if at_nginx else "gpufeed fuse"))
            print(f"{feed.name} vs {loop.name}: epoch 1 {feed.epochs[0].samples_s / loop.epochs[0].samples_s:.1f}x, "
                  f"epoch 2 {feed.epochs[1].samples_s / loop.epochs[1].samples_s:.1f}x")  # fmt: skip
    for loop in (loop for loop in loops if loop.callbacks):
        for n, (epoch, text, daemon) in enumerate(zip(loop.epochs, loop.callbacks, loop.daemon_cpu_s, strict=True), 1):
            spent = epoch.cpu_s
            print(f"{loop.name} epoch {n}: {text}; CPU in {args.files / epoch.samples_s:.1f} s of wall: FUSE daemon "
                  f"{daemon:.1f} s, agent {spent['agent']:.1f} s, latency shaper {spent['shaper']:.1f} s, "
                  f"store server {spent['store']:.1f} s")  # fmt: skip
    if big:
        base = dict(big)
        for name, rate in big:
            kind = name.split(", ", 1)[1]
            local = base["local file, " + ("page cache hot" if kind.endswith("hot") else kind)]
            print(f"{name:<44} {rate:6.2f} GB/s  {rate / local:5.2f}x local")


if __name__ == "__main__":
    main()
