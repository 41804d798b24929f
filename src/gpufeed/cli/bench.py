"""`gpufeed bench` (a training-job emulator over a source) and `gpufeed bench generate`.

Every gpufeed command imports this module to build its parser, so it imports only what the
options' help needs; the benchmark itself (numpy, its servers, charts) loads when it runs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from gpufeed.bench.modes import DEFAULT_MODES, MODES, parse_modes
from gpufeed.bench.remote import DEFAULT_LATENCY_MS
from gpufeed.bench.workloads import WORKLOADS, Workload, workload
from gpufeed.cli.console import command_group, counted, err, out, print_json
from gpufeed.cli.progress import Meter
from gpufeed.config import human_bytes
from gpufeed.errors import GpufeedError, InvalidArgument

if TYPE_CHECKING:
    from gpufeed.bench.metrics import BenchReport

app = command_group(help="Emulate a training job reading a source and measure how busy its accelerators stay.")

WORKLOAD = typer.Option(None, "--workload", "-w", help=f"One of: {', '.join(WORKLOADS)}.")
SCALE = typer.Option(None, "--scale", help="Multiply the sample count (0.001 fits a laptop).")
SAMPLES = typer.Option(None, "--samples", help="Number of samples.")
SAMPLES_PER_FILE = typer.Option(None, "--samples-per-file", help="Records per file.")
RECORD_SIZE = typer.Option(None, "--record-size", help="Bytes per sample.")
OPTIONS = typer.Option([], "--opt", "-o", help="Source option key=value, as for 'mount add' (repeatable).")
SEED = typer.Option(0, "--seed", help="Seed for data and shuffles.")
MODE_HELP = f"Comma-separated modes, default {','.join(DEFAULT_MODES)}. " + "; ".join(
    f"{m.name}: {m.summary}" for m in MODES.values()
)


EXTRA = ("matplotlib",)  # what `pip install 'gpufeed[bench]'` adds to the core dependencies


def require_extra(command: str) -> None:
    """The benchmark is an optional extra; without it, say how to get it before any work is done."""
    if any(importlib.util.find_spec(name) is None for name in EXTRA):
        raise GpufeedError(f"gpufeed {command} needs the bench extra: pip install 'gpufeed[bench]'")


QUIET = typer.Option(False, "--quiet", "-q", help="No progress on stderr; errors still print.")


def progress(line: str) -> None:
    err.print(line, style="dim", markup=False, highlight=False)


def quiet_progress(line: str) -> None:
    """The progress callback of a --quiet run."""


def check_outputs(*paths: Path | None) -> None:
    """Refuse an output path in a missing directory before the run, not after it."""
    for path in filter(None, paths):
        if not path.parent.is_dir():
            raise InvalidArgument(f"{path}: directory {path.parent} does not exist")
        if path.is_dir():
            raise InvalidArgument(f"{path}: is a directory; give a file name")
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise InvalidArgument(f"{path}: not writable")


def print_report(report: BenchReport, as_json: bool, plot: Path | None) -> None:
    """The table for a person; with --json the result as one JSON object on stdout for a script,
    and the table on stderr beside the progress."""
    from gpufeed.bench.report import table, write_plot

    show = err if as_json else out
    show.print(table(report))
    if plot is not None:
        write_plot(report, plot)
        show.print(f"chart: {plot}", markup=False, highlight=False)
    if as_json:
        print_json(report.to_dict())



@app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    workload_name: str | None = WORKLOAD,
    source: str | None = typer.Option(
        None, "--source", "-s", help="Dataset URL: file:///dir, s3://bucket/prefix, http://host/prefix."
    ),
    opt: list[str] = OPTIONS,
    mode: str | None = typer.Option(None, "--mode", "-m", help=MODE_HELP),
    epochs: int | None = typer.Option(None, "--epochs", help="Epochs per mode."),
    latency_ms: float | None = typer.Option(
        None,
        "--latency-ms",
        help=f"Emulate a remote store with this first-byte latency in ms ({DEFAULT_LATENCY_MS:g} with only --bandwidth).",
    ),
    bandwidth: float | None = typer.Option(
        None, "--bandwidth", help="Emulate a remote store capped at this many MB/s (10^6 bytes/s)."
    ),
    remote: bool = typer.Option(
        False, "--remote", help=f"Emulate a remote store with the default {DEFAULT_LATENCY_MS:g} ms latency."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the results as one JSON object on stdout (the table on stderr)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG chart (AU and time per mode) here."),
    record_size: int | None = RECORD_SIZE,
    samples: int | None = SAMPLES,
    samples_per_file: int | None = SAMPLES_PER_FILE,
    batch: int | None = typer.Option(None, "--batch", help="Samples per batch."),
    compute: float | None = typer.Option(None, "--compute", help="Emulated accelerator seconds per batch."),
    accelerators: int | None = typer.Option(None, "--accelerators", help="Emulated accelerators (data-parallel, lockstep)."),
    workers: int | None = typer.Option(None, "--workers", help="DataLoader worker processes per accelerator."),
    prefetch: int | None = typer.Option(None, "--prefetch", help="Batches in flight per worker (prefetch_factor)."),
    scale: float | None = SCALE,
    seed: int = SEED,
    quiet: bool = QUIET,
) -> None:
    """Run the workload against --source in each mode; print AU, throughput and latency."""
    require_extra("bench")
    if ctx.invoked_subcommand is not None:
        return
    if source is None:
        raise InvalidArgument("--source URL is required (write a dataset with 'gpufeed bench generate')")
    check_outputs(plot)
    from gpufeed.bench.runner import BenchConfig, run_bench
    from gpufeed.mount_options import parse_options

    work = workload(
        workload_name,
        scale=scale,
        compute=compute,
        record_size=record_size,
        samples=samples,
        samples_per_file=samples_per_file,
        batch=batch,
        accelerators=accelerators,
        workers=workers,
        epochs=epochs,
        prefetch=prefetch,
    )
    config = BenchConfig(
        work,
        source,
        parse_options(opt),
        tuple(parse_modes(mode)),
        latency_ms=DEFAULT_LATENCY_MS if remote and latency_ms is None else latency_ms,
        bandwidth_mbps=bandwidth,
        seed=seed,
    )
    print_report(run_bench(config, quiet_progress if quiet else progress), as_json, plot)


@app.command("generate")
def generate(
    dest: str = typer.Argument(..., help="Where to write: file:///dir, s3://bucket/prefix, gs://…, az://…"),
    workload_name: str | None = WORKLOAD,
    scale: float | None = SCALE,
    samples: int | None = SAMPLES,
    samples_per_file: int | None = SAMPLES_PER_FILE,
    record_size: int | None = RECORD_SIZE,
    opt: list[str] = OPTIONS,
    seed: int = SEED,
    quiet: bool = QUIET,
) -> None:
    """Write a dataset of the workload's shape (random bytes; valid npz and JPEG files)."""
    from gpufeed.bench.generate import generate as write_dataset
    from gpufeed.mount_options import parse_options

    work: Workload = workload(
        workload_name, scale=scale, samples=samples, samples_per_file=samples_per_file, record_size=record_size
    )
    with Meter("generate", work.files, quiet=quiet) as meter:
        result = write_dataset(work, dest, parse_options(opt), seed=seed, written=meter.update)
    out.print(
        f"wrote {counted(result.files, f'{work.format} file')}, {human_bytes(result.bytes)} "
        f"({work.files * work.samples_per_file} samples) to {result.url} in {result.seconds:.1f} s",
        markup=False,
        highlight=False,
    )
