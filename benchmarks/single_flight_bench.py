"""Single flight across a node: 4 processes x 2 threads read the same 1,000 cold objects from an
HTTP store (nginx, which logs every request); count the GETs that reached the store.

    python benchmarks/single_flight_bench.py [--objects 1000] [--processes 4] [--threads 2]

Every reader starts at a different offset of the same list, so the same objects are wanted by
several readers at the same moment. Without single flight the store would see up to
processes x threads GETs per object; with it, exactly one. Every byte is checked.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import re
import sys
import threading
import time

from common import scratch_home

import gpufeed
from gpufeed.bench.server import serving
from gpufeed.namespace import Namespace


def reader(paths: list[str], threads: int, offset: int, results: multiprocessing.Queue) -> None:
    client = gpufeed.client()
    digests: dict[str, str] = {}

    def run(start: int) -> None:
        for path in paths[start:] + paths[:start]:
            digests[path] = hashlib.sha256(client.read(path)).hexdigest()

    workers = [threading.Thread(target=run, args=(offset + k * 7,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    client.close()
    results.put(digests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=1000)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    with scratch_home("gpufeed-single-flight-") as work:
        store = work / "store" / "objects"
        store.mkdir(parents=True)
        expected = {}
        for i in range(args.objects):
            data = os.urandom(args.size)
            (store / f"{i:05d}.bin").write_bytes(data)
            expected[f"/web/{i:05d}.bin"] = hashlib.sha256(data).hexdigest()
        log = work / "access.log"
        with serving(work / "store", work / "server", access_log=log) as url:
            Namespace().add_mount("/web", f"{url}/objects", immutable=True)
            paths = sorted(expected)
            context = multiprocessing.get_context("spawn")
            results: multiprocessing.Queue = context.Queue()
            started = time.perf_counter()
            processes = [
                context.Process(target=reader, args=(paths, args.threads, p * 101, results)) for p in range(args.processes)
            ]
            for process in processes:
                process.start()
            seen = [results.get(timeout=600) for _ in processes]
            for process in processes:
                process.join()
            elapsed = time.perf_counter() - started
            time.sleep(0.5)  # nginx logs a request after answering it
            gets = len(re.findall(r'"GET /objects/\d+\.bin ', log.read_text()))
        readers = args.processes * args.threads
        assert all(digests == expected for digests in seen), "a reader got wrong bytes"
        sys.stdout.write(
            f"{args.processes} processes x {args.threads} threads read the same {args.objects:,} cold objects "
            f"({readers * args.objects:,} reads) in {elapsed:.1f} s, every byte checked\n"
            f"GETs at the store: {gets:,} (one per object: {args.objects:,}; "
            f"without single flight up to {readers * args.objects:,})\n"
            f"GETs per object: {gets / args.objects:.3f}\n"
        )


if __name__ == "__main__":
    main()
