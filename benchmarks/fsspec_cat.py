"""Many small files through fsspec: `fs.cat(paths)` on `gpufeed://` against fsspec's own HTTP
filesystem reading the same files from the store, every store 20 ms away, in one run.

    python benchmarks/fsspec_cat.py [--files 300] [--size 100000] [--latency-ms 20]

What zarr's chunk reads, a list of captions or a batch of images read through fsspec look like.
Rows, each over files never read before (a new mount path to the same files, so new blocks):
- gpufeed `fs.cat(paths)`: one batch, the misses fetched together (`cat_ranges`);
- gpufeed one `cat_file` after another: what fsspec's default `cat` does, a round trip each;
- fsspec `HTTPFileSystem.cat(urls)`: the files straight from nginx, all requests in flight at once
  (its async default), nothing cached;
- gpufeed `fs.cat(paths)` again: the same files, now cached.
Prints the seconds each took, files/s, and each row's speed as a ratio to fsspec HTTP's.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import fsspec
from common import scratch_home, small_files

import gpufeed
from gpufeed.bench.server import serving
from gpufeed.bench.shaper import shaping
from gpufeed.namespace import Namespace


def timed(read: Callable[[], dict[str, bytes] | list[bytes]], expected: list[bytes]) -> float:
    started = time.perf_counter()
    got = read()
    seconds = time.perf_counter() - started
    assert sorted(got.values() if isinstance(got, dict) else got) == sorted(expected), "every file's bytes"
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    with scratch_home("gpufeed-fsspec-cat-") as work:
        root = work / "files"
        names = small_files(root, args.files, args.size)
        expected = [(root / name).read_bytes() for name in names]
        with serving(work, work / "nginx") as url, shaping(("127.0.0.1", int(url.rsplit(":", 1)[1])), args.latency_ms,
                                                            None, work / "shaper.log") as shaped:
            base = f"http://127.0.0.1:{shaped}"
            fs = fsspec.filesystem("gpufeed")
            gpufeed.client().agent.stats()  # the agent runs before the clock starts
            for n in (1, 2):
                (work / f"again{n}").symlink_to("files")
                Namespace().add_mount(f"/c{n}", f"{base}/again{n}")
            http = fsspec.filesystem("http")
            rows = [
                ("fsspec HTTPFileSystem.cat", timed(lambda: http.cat([f"{base}/files/{name}" for name in names]), expected)),
                ("gpufeed fs.cat, cold", timed(lambda: fs.cat([f"/c1/{name}" for name in names]), expected)),
                ("gpufeed cat_file each, cold", timed(lambda: [fs.cat_file(f"/c2/{name}") for name in names], expected)),
                ("gpufeed fs.cat, cached", timed(lambda: fs.cat([f"/c1/{name}" for name in names]), expected)),
            ]
        http_s = rows[0][1]
        print(f"{args.files} files of {args.size:,} bytes, store {args.latency_ms:g} ms away")
        print(f"{'read':<30} {'seconds':>8} {'files/s':>9} {'vs fsspec HTTP':>15}")
        for name, seconds in rows:
            print(f"{name:<30} {seconds:>8.2f} {args.files / seconds:>9,.0f} {http_s / seconds:>14.2f}x")


if __name__ == "__main__":
    main()
