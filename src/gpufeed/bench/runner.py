"""One bench run: mount the source (through the shaper when a remote is emulated) in a
private namespace, then, for each mode, prepare it and train for the given epochs.

Everything the run starts (servers, shaper, worker processes, temp files, the mount) is
undone on the way out, including on Ctrl-C and SIGTERM. Workers start with forkserver, so
a script that calls `run_bench` needs the `if __name__ == "__main__":` guard, as PyTorch's
DataLoader does under spawn.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpufeed.bench.dataset import Dataset
from gpufeed.bench.loader import DataLoader
from gpufeed.bench.metrics import BenchReport, ModeResult
from gpufeed.bench.modes import DEFAULT_MODES, MODES, Mode, RunContext
from gpufeed.bench.remote import DEFAULT_LATENCY_MS, emulate_remote
from gpufeed.bench.train import train_epoch
from gpufeed.bench.workloads import Workload
from gpufeed.client import Client
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument
from gpufeed.namespace import Namespace
from gpufeed.processes import alive

MOUNT = "/bench"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchConfig:
    """latency_ms / bandwidth_mbps: None for both reads the source as it is; either one set
    makes it remote (latency defaults to DEFAULT_LATENCY_MS). `mode_epochs` gives a mode
    another number of epochs than the workload's (a baseline needs fewer)."""

    work: Workload
    source: str
    options: dict[str, str] = field(default_factory=dict)
    modes: tuple[Mode, ...] = tuple(MODES[name] for name in DEFAULT_MODES)
    latency_ms: float | None = None
    bandwidth_mbps: float | None = None
    seed: int = 0
    mode_epochs: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.modes:
            raise InvalidArgument(f"no mode to run (valid: {', '.join(MODES)})")

    @property
    def remote(self) -> bool:
        return self.latency_ms is not None or self.bandwidth_mbps is not None


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM and SIGINT raise KeyboardInterrupt in the main thread, so cleanup runs for
    both (SIGINT may arrive ignored from a shell that started us in the background). Once
    one arrived, more are ignored until the block is left: a second Ctrl-C must not cut the
    cleanup short."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGTERM, signal.SIGINT)

    def interrupt(signum: int, frame: object) -> None:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


PRIVATE = ("GPUFEED_HOME", "GPUFEED_META", "GPUFEED_CACHE_DIRS")


def private_settings(home: Path) -> Settings:
    """The user's settings (timeouts, sizes) with a home of the run's own: its metadata and
    anything kept under home (a cache) start empty and never touch the user's."""
    saved = {name: os.environ.pop(name) for name in PRIVATE if name in os.environ}
    os.environ["GPUFEED_HOME"] = str(home)
    try:
        return Settings.from_env()
    finally:
        os.environ.pop("GPUFEED_HOME")
        os.environ.update(saved)


OWNER = "owner.pid"


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temp dir removed when the block ends. It records its owner's pid, and directories
    of the same prefix whose owner is dead (a run killed with SIGKILL) are removed first:
    a copied dataset can be large, and the next run should not inherit it."""
    base = Path(tempfile.gettempdir())
    for stale in base.glob(f"{prefix}*"):
        try:
            owner = int((stale / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not ours, or unreadable
        if not alive(owner):
            shutil.rmtree(stale, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=prefix))
    (path / OWNER).write_text(str(os.getpid()))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_mode(mode: Mode, run: RunContext, config: BenchConfig) -> ModeResult:
    work = config.work
    epochs_to_run = config.mode_epochs.get(mode.name, work.epochs)
    run.progress(f"{mode.name}: {mode.summary}")
    with mode.prepare(run) as prepared:
        if prepared.setup_s:
            run.progress(f"{mode.name}: set-up took {prepared.setup_s:.1f} s")
        loader = DataLoader(
            prepared.reader,
            run.dataset,
            batch=work.batch,
            workers=work.workers * work.accelerators,
            prefetch=work.prefetch,
            seed=config.seed,
            ahead=prepared.ahead,
        )
        epochs = []
        with loader:
            for epoch in range(1, epochs_to_run + 1):
                fetched = prepared.source_bytes() if prepared.source_bytes else 0
                if epoch == 1 and prepared.start is not None:
                    prepared.start()
                result = train_epoch(mode.name, loader, epoch, work, run.dataset.record_size)
                if prepared.source_bytes:
                    result = replace(result, source_bytes=result.source_bytes + prepared.source_bytes() - fetched)
                run.progress(
                    f"{mode.name}: epoch {epoch}/{epochs_to_run}: {result.samples_per_s:,.0f} samples/s in "
                    f"{result.epoch_s:.1f} s (first batch {result.first_batch_s:.1f} s, then AU {result.au:.0%})"
                )
                epochs.append(result)
    return ModeResult(mode.name, prepared.setup_s, prepared.setup_bytes, tuple(epochs))


def _check_steps(work: Workload) -> None:
    """AU leaves an epoch's first step out: an epoch of one step would measure nothing and say 100 %."""
    if work.samples < 2 * work.batch * work.accelerators:
        raise InvalidArgument(
            f"--samples {work.samples}: an epoch needs 2 steps of {work.accelerators} × {work.batch} samples or more "
            "(AU leaves the first step out); give more samples or a smaller --batch"
        )


def run_bench(config: BenchConfig, progress: Progress = lambda line: None) -> BenchReport:
    """Each mode mounts the source at MOUNT/<mode> with its own mount options (a cached
    mode and an uncached one differ there), runs, and unmounts. Every mode reads the emulated
    remote store when there is one, but a mode that is not `remote` (the local baseline)."""
    latency = config.latency_ms if config.latency_ms is not None else DEFAULT_LATENCY_MS
    with interruptible(), ExitStack() as stack:
        workdir = stack.enter_context(scratch_dir("gpufeed-bench-"))
        settings = private_settings(workdir / "home")
        given = (config.source, dict(config.options))
        url, options = given
        if config.remote:
            run_dir = workdir / "run"
            run_dir.mkdir()
            url, options = stack.enter_context(emulate_remote(url, options, latency, config.bandwidth_mbps, run_dir))
            cap = f", {config.bandwidth_mbps:g} MB/s" if config.bandwidth_mbps else ""
            progress(f"serving {config.source} as a remote store at {url} ({latency:g} ms{cap})")
        namespace = Namespace(settings)
        client = Client(settings, namespace)
        stack.callback(client.close)
        report: BenchReport | None = None
        for mode in config.modes:
            path = f"{MOUNT}/{mode.name}"
            mount_url, mount_options = (url, options) if mode.remote else given
            namespace.add_mount(path, mount_url, {**mount_options, **mode.mount_options}, immutable=True)
            try:
                dataset = Dataset.from_mount(client, path, config.work, config.source)
                if report is None:
                    _check_steps(config.work)
                    mib = dataset.bytes / 2**20
                    progress(f"reading {dataset.samples} samples from {len(dataset.paths)} files, {mib:,.0f} MiB")
                    report = BenchReport(
                        config.work,
                        config.source,
                        dataset.bytes,
                        dataset.record_size,
                        latency if config.remote else None,
                        config.bandwidth_mbps,
                    )
                report.modes.append(run_mode(mode, RunContext(settings, dataset, workdir, progress), config))
            finally:
                namespace.remove_mount(path)
        assert report is not None, "BenchConfig refuses an empty mode list"
        return report
