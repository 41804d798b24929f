"""Is the emulated remote (loopback HTTP server + latency shaper at 0 ms) ever the bottleneck?

Prints throughput through server+shaper at 0 ms against reading directly, as ratios:

  1. the bench itself at the demand of a resnet50 job on one H100 (0.56 ms of compute per
     sample, ~1,800 samples/s): file:// read directly vs the same files through server+shaper.
     This is the goal row (>= 0.9x): at the rate a training job asks for, the emulation
     must not slow it.
  2. the bench with no compute (the loader as fast as it can go): file:// vs the server
     alone vs server+shaper; this is saturation, where on a small machine the client,
     server and shaper compete for the same cores.
  3. bulk 8 MiB ranged GETs, 8 streams (copy mode's pattern): server alone vs server+shaper.

Run: python benchmarks/shaper_overhead.py [--samples N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import obstore
from obstore.store import HTTPStore
from rich.console import Console
from rich.table import Table

from gpufeed.bench.demo import demo_workload
from gpufeed.bench.generate import generate
from gpufeed.bench.modes import MODES
from gpufeed.bench.runner import BenchConfig, run_bench
from gpufeed.bench.server import serving
from gpufeed.bench.shaper import shaping
from gpufeed.bench.workloads import Workload

BULK_CHUNK = 8 << 20
BULK_STREAMS = 8


def bench_rate(work: Workload, source: str, latency_ms: float | None = None) -> float:
    """Samples/s of the direct mode, best epoch (the first includes worker start-up)."""
    report = run_bench(BenchConfig(work, source, modes=(MODES["direct"],), latency_ms=latency_ms))
    return max(epoch.samples_per_s for epoch in report.modes[0].epochs)


def bulk_rate(base_url: str, key: str, size: int) -> float:
    """MB/s of BULK_STREAMS concurrent 8 MiB ranged GETs over the whole object."""
    store = HTTPStore(base_url, client_options={"allow_http": True})

    def one(start: int) -> int:
        return len(obstore.get(store, key, options={"range": (start, min(size, start + BULK_CHUNK))}).bytes())

    best = 0.0
    for _ in range(3):
        started = time.perf_counter()
        with ThreadPoolExecutor(BULK_STREAMS) as pool:
            moved = sum(pool.map(one, range(0, size, BULK_CHUNK)))
        best = max(best, moved / (time.perf_counter() - started) / 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2 * 1251)
    args = parser.parse_args()
    console = Console()
    work = demo_workload(args.samples, epochs=3)
    saturated = replace(work, compute=0.0)
    with tempfile.TemporaryDirectory(prefix="gpufeed-shaper-bench-") as tmp:
        root = Path(tmp) / "data"
        generate(work, f"file://{root}")
        source = f"file://{root}"
        key = next(p for p in sorted(root.rglob("*")) if p.is_file())
        size = key.stat().st_size
        rows = []
        need = bench_rate(work, source)
        shaped = bench_rate(work, source, latency_ms=0)
        rows.append(("bench, resnet50 H100 demand (samples/s)", "file://", need, shaped))
        with serving(root, Path(tmp) / "run") as url:
            port = int(url.rsplit(":", 1)[1])
            local = bench_rate(saturated, source)
            served = bench_rate(saturated, url)
            with shaping(("127.0.0.1", port), 0, None, Path(tmp) / "shaper.log") as shaper_port:
                through = bench_rate(saturated, f"http://127.0.0.1:{shaper_port}")
                bulk_direct = bulk_rate(url, str(key.relative_to(root)), size)
                bulk_shaped = bulk_rate(f"http://127.0.0.1:{shaper_port}", str(key.relative_to(root)), size)
        rows.append(("bench, no compute (samples/s)", "file://", local, through))
        rows.append(("bench, no compute (samples/s)", "server alone", served, through))
        rows.append((f"bulk 8 MiB GETs x {BULK_STREAMS} (MB/s)", "server alone", bulk_direct, bulk_shaped))

    table = Table(title=f"server + shaper at 0 ms vs direct ({os.cpu_count()} cores)", title_justify="left")
    for name in ("measure", "direct is", "direct", "server+shaper", "ratio"):
        table.add_column(name, justify="left" if name in ("measure", "direct is") else "right")
    for measure, baseline, direct, through_shaper in rows:
        table.add_row(measure, baseline, f"{direct:,.0f}", f"{through_shaper:,.0f}", f"{through_shaper / direct:.2f}x")
    console.print(table)
    console.print(
        f"goal: >= 0.90x on the first row (the rate a training job demands); "
        f"measured {shaped / need:.2f}x", highlight=False,
    )


if __name__ == "__main__":  # worker processes re-import this module; run only in the parent
    main()
