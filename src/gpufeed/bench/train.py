"""Emulated accelerators: the training loop that consumes batches and sleeps the compute time.

Data-parallel accelerators step in lockstep, as synchronous training does: each step takes
one batch per accelerator, then all compute at once (one sleep).
"""

from __future__ import annotations

import time
from itertools import islice

import numpy as np

from gpufeed.bench.loader import DataLoader
from gpufeed.bench.metrics import EpochResult, epoch_result
from gpufeed.bench.workloads import Workload


def train_epoch(mode: str, loader: DataLoader, epoch: int, work: Workload, record_size: float) -> EpochResult:
    clock = time.perf_counter
    started = clock()
    first_batch = None
    steps = samples = source_bytes = 0
    latencies: list[np.ndarray] = []
    batches = loader.epoch(epoch)
    while step := list(islice(batches, work.accelerators)):
        if first_batch is None:
            first_batch = clock()
        for batch in step:
            samples += batch.samples
            source_bytes += batch.source_bytes
            latencies.append(batch.latencies)
        time.sleep(work.compute)
        steps += 1
    ended = clock()
    return epoch_result(
        mode,
        epoch,
        started=started,
        first_batch=ended if first_batch is None else first_batch,
        ended=ended,
        steps=steps,
        compute=work.compute,
        samples=samples,
        record_size=record_size,
        latencies=np.concatenate(latencies) if latencies else np.empty(0),
        source_bytes=source_bytes,
    )
