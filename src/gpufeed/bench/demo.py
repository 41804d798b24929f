"""`gpufeed demo`: one DataLoader training loop fed three ways from the same generated dataset.

A resnet50-shaped dataset (114,660 B records in tfrecord-sized files) is written to a temp
dir, served over HTTP on loopback behind the shaper (a store DEFAULT_LATENCY_MS away whose
bandwidth is capped), and read by the same loop, with the same workers and shuffle:

- local disk: the generated files read in place (just written, so in the page cache): the
  baseline, what the job would get with the dataset on its own disk;
- direct: from the store, each worker reading one sample at a time, as a map-style dataset
  over object storage does: the store sees the loader's own concurrency (workers x 1
  request) and every sample waits the first-byte latency;
- gpufeed: from the same store, same latency and cap, through the node cache: its first
  epoch is cold (the agent fetches what the sampler will ask for next, many requests in
  flight), the second warm (local blocks).

The batch is smaller than the reference 400 so an epoch has enough steps to measure, and the
compute per batch shrinks with it: the per-sample compute, and so the throughput an H100
demands (about 1,800 samples/s), stay the reference's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from gpufeed.bench.modes import MODES
from gpufeed.bench.remote import DEFAULT_LATENCY_MS
from gpufeed.bench.workloads import WORKLOADS, Workload, workload

if TYPE_CHECKING:  # the CLI reads this module's defaults for every command; running it imports the rest
    from gpufeed.bench.metrics import BenchReport, EpochResult
    from gpufeed.bench.runner import Progress

SAMPLES = 4 * 1251
QUICK_SAMPLES = 1251
EPOCHS = 2
BATCH = 50
DEFAULT_BANDWIDTH_MBPS = 400.0
"""One accelerator's share of a node's link to the store: a 25 Gbit/s NIC shared by eight
accelerators carries about 390 MB/s each, twice what resnet50 on an H100 consumes (about
205 MB/s), so the cap is no reason to starve; the latency is."""

MODES_RUN = (
    MODES["local"],
    replace(MODES["getitem"], name="direct"),
    replace(MODES["cached"], name="gpufeed"),
)
"""The bench modes the demo runs, under the names its table uses."""
EPOCHS_RUN = {"local": 2, "direct": 1, "gpufeed": 2}
WAYS = (("local disk", "local", 2), ("direct", "direct", 1), ("gpufeed cold", "gpufeed", 1), ("gpufeed warm", "gpufeed", 2))
"""Each row of the story: its label, and the mode and epoch it is measured in. Local disk's is
its second epoch, as gpufeed warm's is: both after the workers started, so they compare alike."""


def demo_workload(samples: int = SAMPLES, epochs: int = EPOCHS, batch: int = BATCH) -> Workload:
    reference = WORKLOADS["resnet50"]
    compute = reference.compute * batch / reference.batch
    return workload("resnet50", samples=samples, epochs=epochs, batch=batch, compute=compute)


@dataclass(frozen=True)
class Row:
    """One way of feeding the loop. `busy` is the share of the epoch's wall time the accelerator
    computed, its first batch included (a job waits for it too), so it moves with samples/s;
    ratios are of samples/s, against direct and local disk."""

    way: str
    samples_per_s: float
    busy: float
    source_bytes: int
    vs_direct: float
    vs_local: float


@dataclass(frozen=True)
class DemoResult:
    report: BenchReport
    rows: tuple[Row, ...]
    why: str
    """One sentence: why direct starves at these settings (or why it need not)."""

    def row(self, way: str) -> Row:
        return next(row for row in self.rows if row.way == way)

    @property
    def message(self) -> str:
        cold, warm, direct = self.row("gpufeed cold"), self.row("gpufeed warm"), self.row("direct")
        return (
            f"gpufeed cold epoch: {cold.vs_direct:.1f}x direct (accelerator busy {direct.busy:.0%} -> {cold.busy:.0%}); "
            f"warm: {warm.vs_local:.2f}x local disk"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [asdict(row) for row in self.rows], "why": self.why, "bench": self.report.to_dict()}


def consumes(work: Workload) -> float:
    """Samples/s the emulated accelerators take when no read keeps them waiting."""
    return work.batch * work.accelerators / work.compute


def starvation(work: Workload, record_size: float, latency_ms: float, bandwidth_mbps: float | None) -> str:
    """Why direct cannot keep up, from the store's shape and the loader's concurrency: each
    of its requests waits the latency, and only workers x 1 are in flight; a bandwidth cap
    bounds it too. Both are upper bounds, so the sentence is true whatever the machine."""
    demand = consumes(work)
    in_flight = work.workers * work.accelerators
    by_latency = in_flight / (latency_ms / 1e3) if latency_ms > 0 else float("inf")
    by_bandwidth = bandwidth_mbps * 1e6 / record_size if bandwidth_mbps else float("inf")
    ceiling = min(by_latency, by_bandwidth)
    if ceiling >= demand:
        store = (
            f"could feed direct up to {ceiling:,.0f} samples/s, no less than the accelerator consumes ({demand:,.0f})"
            if ceiling < float("inf")
            else "adds neither latency nor a bandwidth cap"
        )
        return f"At these settings the store {store}: direct need not starve; raise --latency-ms or lower --bandwidth to see it."
    if by_latency <= by_bandwidth:
        return (
            f"direct starves because every sample waits {latency_ms:g} ms for its first byte and the loader keeps only "
            f"{in_flight} requests in flight ({in_flight} workers x 1): at most {in_flight} / {latency_ms:g} ms = "
            f"{by_latency:,.0f} samples/s, while the accelerator consumes {demand:,.0f}."
        )
    return (
        f"direct starves because the store's {bandwidth_mbps:g} MB/s carries at most {by_bandwidth:,.0f} samples/s "
        f"of {record_size:,.0f} B, while the accelerator consumes {demand:,.0f}."
    )


def _epoch(report: BenchReport, mode: str, epoch: int) -> EpochResult:
    result = next(m for m in report.modes if m.mode == mode)
    return result.epochs[epoch - 1]


def summarise(report: BenchReport) -> DemoResult:
    assert report.latency_ms is not None, "the demo always reads an emulated store"
    epochs = {way: _epoch(report, mode, epoch) for way, mode, epoch in WAYS}
    direct, local = epochs["direct"].samples_per_s, epochs["local disk"].samples_per_s
    rows = tuple(
        Row(way, e.samples_per_s, e.compute_s / e.epoch_s, e.source_bytes, e.samples_per_s / direct, e.samples_per_s / local)
        for way, e in epochs.items()
    )
    why = starvation(report.workload, report.record_size, report.latency_ms, report.bandwidth_mbps)
    return DemoResult(report, rows, why)


def run_demo(
    work: Workload,
    latency_ms: float = DEFAULT_LATENCY_MS,
    bandwidth_mbps: float | None = DEFAULT_BANDWIDTH_MBPS,
    progress: Progress = lambda line: None,
) -> DemoResult:
    """Generate, serve, mount and run the loop every way; the temp dir and everything started
    for it are gone when this returns or raises."""
    from gpufeed.bench.generate import generate
    from gpufeed.bench.runner import BenchConfig, interruptible, run_bench, scratch_dir

    with interruptible(), scratch_dir("gpufeed-demo-") as tmp:
        data = tmp / "resnet50"
        written = generate(work, f"file://{data}")
        files = f"{written.files:,} file{'s' if written.files != 1 else ''}"
        progress(f"wrote {files}, {written.bytes / 2**20:,.0f} MiB to {data} in {written.seconds:.1f} s")
        config = BenchConfig(
            work,
            f"file://{data}",
            modes=MODES_RUN,
            latency_ms=latency_ms,
            bandwidth_mbps=bandwidth_mbps,
            mode_epochs=EPOCHS_RUN,
        )
        return summarise(run_bench(config, progress))
