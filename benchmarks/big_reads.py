"""Sequential reads of one big cached file through the Python API (`gpufeed.open`: `read(n)` and
`readinto`), against the same reads of the local file with Python's own `open(path, "rb")` (its
page cache warm), in one run; and lines read from a JSON-lines file both ways.

    python benchmarks/big_reads.py [--size-mib 1024] [--block-size 4MiB] [--rounds 3] [--lines-mib 64]

What big files are read like: a shard read whole or in large pieces, `np.load` and `torch.load`
reading an array or a tensor's bytes, a checkpoint restored. The file is cached first (`warm`);
then each reader runs in a process of its own, so the first pass reads block files the process
does not hold yet, as a job's first read of a file does, and later passes the ones it holds
(`cache.openfiles`). Lines: `for line in f` over a JSON-lines file of captions. Each row is the
median of --rounds processes: MiB/s of the first pass and of the second, for gpufeed and for the
local file, and gpufeed's ratio to local in each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from common import scratch_home

import gpufeed
from gpufeed.config import parse_size
from gpufeed.namespace import Namespace

READER = r"""
import sys, time
import gpufeed
path, size, mode, passes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
opener = (lambda: gpufeed.open(path)) if path.startswith("/big/") else (lambda: open(path, "rb"))
if path.startswith("/big/"):
    gpufeed.client()  # started before the clock, as a job's is by its first read: its imports are not a read's
rates = []
for _ in range(passes):
    total, started = 0, time.perf_counter()
    with opener() as f:
        if mode == "lines":
            total = sum(len(line) for line in f)
        elif mode == "readinto":
            buffer = bytearray(size)
            while n := f.readinto(buffer):
                total += n
        else:
            while data := f.read(size):
                total += len(data)
    rates.append(total / 2**20 / (time.perf_counter() - started))
print(" ".join(f"{r:.1f}" for r in rates))
"""


def rates(path: str, size: int, mode: str, rounds: int) -> tuple[float, float]:
    """Median MiB/s of a first and a second pass over the file, each round a new process."""
    runs = []
    for _ in range(rounds):
        argv = [sys.executable, "-c", READER, path, str(size), mode, "2"]
        out = subprocess.run(argv, check=True, capture_output=True, text=True)
        runs.append([float(r) for r in out.stdout.split()])
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--block-size", default="4MiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lines-mib", type=int, default=64, help="size of the JSON-lines file, about")
    args = parser.parse_args()
    size = args.size_mib << 20
    with scratch_home("gpufeed-big-reads-") as work:
        root = work / "src"
        root.mkdir()
        local = root / "f.bin"
        with open(local, "wb") as f:
            for _ in range(args.size_mib):
                f.write(os.urandom(1 << 20))
        lines = root / "d.jsonl"
        with open(lines, "wb") as f:
            for i in range(args.lines_mib * 4096):
                f.write(b'{"id": %d, "caption": "%s"}\n' % (i, b"x" * (i % 480)))
        Namespace().add_mount("/big", f"file://{root}", {"block_size": args.block_size})
        client = gpufeed.client()
        for name in ("f.bin", "d.jsonl"):
            client.warm(client.handle(f"/big/{name}"))
            Path(root / name).read_bytes()  # the local file's page cache, as the cached blocks' is
        block = parse_size(args.block_size, "--block-size")
        print(f"a {args.size_mib:,} MiB file in blocks of {args.block_size}, read sequentially; MiB/s, median of {args.rounds} "
              f"processes; first pass (block files not held) / second pass (held)")
        print(f"{'read':<22} {'gpufeed':>17} {'local file':>17} {'gpufeed / local':>17}")
        for mode, piece in [("read", 1 << 20), ("read", block), ("read", 4 * block), ("read", size),
                            ("readinto", block), ("readinto", 4 * block), ("lines", 0)]:
            name = "d.jsonl" if mode == "lines" else "f.bin"
            ours = rates(f"/big/{name}", piece, mode, args.rounds)
            theirs = rates(str(root / name), piece, mode, args.rounds)
            label = (f"lines of {args.lines_mib} MiB JSONL" if mode == "lines" else
                     f"{mode}({piece >> 20} MiB)" if piece < size else f"{mode}() whole")
            print(f"{label:<22} {ours[0]:>8,.0f} {ours[1]:>8,.0f} {theirs[0]:>8,.0f} {theirs[1]:>8,.0f} "
                  f"{ours[0] / theirs[0]:>8.2f} {ours[1] / theirs[1]:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
