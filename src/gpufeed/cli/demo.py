"""`gpufeed demo`: why a training loop starves reading object storage, and what the node cache
does about it, on this machine in under a minute."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from gpufeed.bench import demo as experiment
from gpufeed.bench.remote import DEFAULT_LATENCY_MS, check_shape
from gpufeed.cli.bench import QUIET, check_outputs, progress, quiet_progress, require_extra
from gpufeed.cli.console import err, out, print_json
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument


def output_dir(out_dir: Path | None) -> Path:
    """`--out`, else GPUFEED_HOME/demo; made here, before the run, so a place the demo cannot
    write to is refused before a minute is spent."""
    folder = out_dir if out_dir is not None else Settings.from_env().home / "demo"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgument(f"{folder}: cannot make the output directory: {exc.strerror}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidArgument(f"{folder}: output directory not writable")
    return folder


def demo(
    quick: bool = typer.Option(False, "--quick", help=f"A small dataset ({experiment.QUICK_SAMPLES} samples), for CI."),
    latency_ms: float = typer.Option(DEFAULT_LATENCY_MS, "--latency-ms", help="First-byte latency of the emulated store."),
    bandwidth: float = typer.Option(
        experiment.DEFAULT_BANDWIDTH_MBPS, "--bandwidth", help="Bandwidth cap of the emulated store, MB/s (10^6 B/s); 0: none."
    ),
    samples: int | None = typer.Option(None, "--samples", help=f"Samples in the dataset (default {experiment.SAMPLES})."),
    out_dir: Path | None = typer.Option(None, "--out", help="Directory for the chart; default GPUFEED_HOME/demo."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as one JSON object on stdout (the table on stderr)."),
    quiet: bool = QUIET,
) -> None:
    """Train one emulated accelerator from the same generated dataset three ways: local disk,
    direct from a store with object-storage latency, and through gpufeed (cold, then warm)."""
    require_extra("demo")
    if bandwidth < 0:
        raise InvalidArgument(f"--bandwidth {bandwidth:g}: must be >= 0 MB/s (0: no cap)")
    cap = bandwidth or None
    check_shape(latency_ms, cap)
    if samples is None:
        samples = experiment.QUICK_SAMPLES if quick else experiment.SAMPLES
    work = experiment.demo_workload(samples)
    folder = output_dir(out_dir)
    plot = folder / "demo.png"
    check_outputs(plot)
    from gpufeed.bench.report import demo_table, store_shape, write_demo_plot

    show = err if as_json else out
    show.print(
        f"gpufeed demo: a {work.name}-shaped training loop ({work.samples:,} samples, batch {work.batch}, "
        f"{work.workers} workers; the accelerator consumes {experiment.consumes(work):,.0f} samples/s) fed three ways: "
        f"local disk, direct from a store with {store_shape(latency_ms, cap)} (--latency-ms, --bandwidth), "
        f"and gpufeed over the same store, cold then warm",
        markup=False,
        highlight=False,
    )
    result = experiment.run_demo(work, latency_ms, cap, quiet_progress if quiet else progress)
    show.print(demo_table(result))
    write_demo_plot(result, plot)
    show.print(f"chart: {plot}", markup=False, highlight=False)
    if as_json:
        print_json({**result.to_dict(), "chart": str(plot)})
