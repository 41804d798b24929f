"""`gpufeed demo`: the GPU-starvation experiment on this machine, with no set-up.

A resnet50-shaped dataset (114,660 B records in tfrecord-sized files) is written to a temp
dir, served over HTTP on loopback behind the shaper (a remote store 20 ms away), mounted,
and read in every mode. The batch is smaller than the reference 400 so an epoch has enough
steps to measure, and the compute per batch shrinks with it: the per-sample compute, and so
the throughput an H100 demands (about 1,800 samples/s), stay the reference's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpufeed.bench.modes import MODES
from gpufeed.bench.remote import DEFAULT_LATENCY_MS
from gpufeed.bench.workloads import WORKLOADS, Workload, workload

if TYPE_CHECKING:  # the CLI reads this module's defaults for every command; running it imports the rest
    from gpufeed.bench.metrics import BenchReport
    from gpufeed.bench.runner import Progress

SAMPLES = 5 * 1251
EPOCHS = 2
BATCH = 50


def demo_workload(samples: int = SAMPLES, epochs: int = EPOCHS, batch: int = BATCH) -> Workload:
    reference = WORKLOADS["resnet50"]
    compute = reference.compute * batch / reference.batch
    return workload("resnet50", samples=samples, epochs=epochs, batch=batch, compute=compute)


def run_demo(
    work: Workload, latency_ms: float = DEFAULT_LATENCY_MS, progress: Progress = lambda line: None
) -> BenchReport:
    """Generate, serve, mount and bench in every mode; the temp dir and everything started
    for it are gone when this returns or raises."""
    from gpufeed.bench.generate import generate
    from gpufeed.bench.runner import BenchConfig, interruptible, run_bench, scratch_dir

    with interruptible(), scratch_dir("gpufeed-demo-") as tmp:
        data = tmp / "resnet50"
        written = generate(work, f"file://{data}")
        progress(f"wrote {written.files} files, {written.bytes / 2**20:,.0f} MiB to {data} in {written.seconds:.1f} s")
        config = BenchConfig(work, f"file://{data}", modes=tuple(MODES.values()), latency_ms=latency_ms)
        return run_bench(config, progress)
