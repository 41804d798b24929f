"""What a bench run measured, per mode and per epoch, with MLPerf Storage's definitions.

AU (accelerator utilisation) = emulated compute time / wall time of the training phase, the
phase starting when the first batch arrives: the first step's I/O (worker start-up, cold
pipeline) is excluded from AU and counted in samples/s and time to first batch instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from gpufeed.bench.workloads import Workload

MIB = 1 << 20


@dataclass(frozen=True)
class EpochResult:
    mode: str
    epoch: int
    au: float
    samples: int
    steps: int
    samples_per_s: float
    mib_per_s: float
    epoch_s: float
    first_batch_s: float
    compute_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    latency_mean_ms: float
    source_bytes: int


def epoch_result(
    mode: str,
    epoch: int,
    *,
    started: float,
    first_batch: float,
    ended: float,
    steps: int,
    compute: float,
    samples: int,
    record_size: float,
    latencies: np.ndarray,
    source_bytes: int,
) -> EpochResult:
    """Times are perf_counter() seconds; `latencies` are per-sample read seconds."""
    compute_s = steps * compute
    training = ended - first_batch
    epoch_s = ended - started
    per_s = samples / epoch_s if epoch_s > 0 else 0.0
    p50, p99 = np.percentile(latencies, [50, 99]) if latencies.size else (0.0, 0.0)
    return EpochResult(
        mode=mode,
        epoch=epoch,
        au=compute_s / training if training > 0 else 1.0,
        samples=samples,
        steps=steps,
        samples_per_s=per_s,
        mib_per_s=per_s * record_size / MIB,
        epoch_s=epoch_s,
        first_batch_s=first_batch - started,
        compute_s=compute_s,
        latency_p50_ms=float(p50) * 1e3,
        latency_p99_ms=float(p99) * 1e3,
        latency_mean_ms=float(latencies.mean()) * 1e3 if latencies.size else 0.0,
        source_bytes=source_bytes,
    )


@dataclass(frozen=True)
class ModeResult:
    """One mode's run: its set-up (the copy, for `copy`) and its epochs."""

    mode: str
    setup_s: float
    setup_bytes: int
    epochs: tuple[EpochResult, ...]

    @property
    def total_s(self) -> float:
        return self.setup_s + sum(e.epoch_s for e in self.epochs)

    @property
    def au(self) -> float:
        """Mean AU over the epochs (MLPerf's figure; set-up is not in it)."""
        return float(np.mean([e.au for e in self.epochs])) if self.epochs else 0.0

    @property
    def au_end_to_end(self) -> float:
        """Compute over everything the job waited for, set-up and first batches included."""
        return sum(e.compute_s for e in self.epochs) / self.total_s if self.total_s > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return sum(e.samples for e in self.epochs) / self.total_s if self.total_s > 0 else 0.0

    @property
    def source_bytes(self) -> int:
        return self.setup_bytes + sum(e.source_bytes for e in self.epochs)

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "au": self.au,
            "au_end_to_end": self.au_end_to_end,
            "samples_per_s": self.samples_per_s,
            "setup_s": self.setup_s,
            "total_s": self.total_s,
            "source_bytes": self.source_bytes,
        }


@dataclass
class BenchReport:
    workload: Workload
    source: str
    dataset_bytes: int
    record_size: float
    latency_ms: float | None = None
    bandwidth_mbps: float | None = None
    modes: list[ModeResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload.to_dict(),
            "source": self.source,
            "dataset_bytes": self.dataset_bytes,
            "record_size": self.record_size,
            "latency_ms": self.latency_ms,
            "bandwidth_mbps": self.bandwidth_mbps,
            "results": [asdict(e) for m in self.modes for e in m.epochs],
            "modes": [m.summary() for m in self.modes],
        }
