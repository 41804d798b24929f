"""Watches a leased job: is it working, and is it within its memory?

"Idle" means: with NVML, the leased GPUs' utilisation stayed under 1 % (device-wide: on a shared
GPU another tenant's work keeps every lease on it busy, which errs on the side of not reclaiming);
without NVML (fake GPUs), the job's process tree used under 1 % of one CPU — it reports no work.
A lease idle for the pool's idle timeout is reclaimed: the job gets SIGTERM, then SIGKILL.
Memory: with NVML, the job's processes' GPU memory above the lease is reported and, by policy,
stopped; without NVML there is nothing to measure and the PyTorch cap is the only guard.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpufeed.pool import inventory
from gpufeed.processes import alive

BUSY = 0.01


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc), however deep."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo.extend(int(child) for child in f.read().split())
        except OSError:
            continue
    return tree


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time of `pids` (those still alive)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / ticks


@dataclass
class IdleMeter:
    """Seconds since the job last looked busy, from successive samples."""

    started: float
    last_busy: float = 0.0
    last_time: float = 0.0
    last_cpu: float = 0.0

    def sample(self, now: float, cpu: float, gpu_utilisation: float | None) -> float:
        if not self.last_time:
            self.last_busy, self.last_time, self.last_cpu = now, now, cpu
            return 0.0
        wall = max(now - self.last_time, 1e-9)
        busy = gpu_utilisation > BUSY if gpu_utilisation is not None else (cpu - self.last_cpu) / wall > BUSY
        if busy:
            self.last_busy = now
        self.last_time, self.last_cpu = now, cpu
        return now - self.last_busy


class Watchdog(threading.Thread):
    """Samples every `interval`; calls `report(idle_seconds, gpu_memory_bytes)` (memory: NVML, else
    0), and `breach(reason)` once when the job is idle for `idle_timeout` (0: never) or over
    `memory_cap` bytes of GPU memory."""

    def __init__(
        self,
        pid: int,
        gpus: Sequence[int],
        memory_cap: int,
        idle_timeout: float,
        report: Callable[[float, int], None],
        breach: Callable[[str], None],
        interval: float = 0.5,
    ) -> None:
        super().__init__(daemon=True, name="gpufeed-watchdog")
        self.pid, self.gpus, self.memory_cap, self.idle_timeout = pid, list(gpus), memory_cap, idle_timeout
        self.report, self.breach, self.interval = report, breach, interval
        self.finished = threading.Event()
        self.nvml = inventory.nvml_available()

    def run(self) -> None:
        meter = IdleMeter(time.monotonic())
        while not self.finished.wait(self.interval):
            if not alive(self.pid):
                return  # the output still draining to the client is no idleness of the job's
            pids = process_tree(self.pid)
            utilisation = max((inventory.utilisation(i) or 0.0) for i in self.gpus) if self.nvml and self.gpus else None
            idle = meter.sample(time.monotonic(), cpu_seconds(pids), utilisation)
            used = self._gpu_memory(set(pids))
            self.report(idle, used)
            if self.idle_timeout and idle >= self.idle_timeout:
                work = "GPU" if self.nvml else "CPU"
                self.breach(f"idle for {idle:.1f} s (no {work} work): reclaimed by policy, command stopped")
                return
            if self.memory_cap and used > self.memory_cap:
                gib, cap = used / (1 << 30), self.memory_cap / (1 << 30)
                self.breach(f"using {gib:.1f} GiB of GPU memory, over its lease of {cap:.1f} GiB: command stopped")
                return

    def _gpu_memory(self, pids: set[int]) -> int:
        if not self.nvml:
            return 0
        return max((sum(b for pid, b in inventory.process_memory(i).items() if pid in pids) for i in self.gpus), default=0)
