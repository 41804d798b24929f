"""`gpufeed demo`: see GPU starvation and its cures on this machine in about a minute."""

from __future__ import annotations

from pathlib import Path

import typer

from gpufeed.bench import demo as experiment
from gpufeed.bench.remote import DEFAULT_LATENCY_MS
from gpufeed.cli.bench import check_outputs, print_report, progress, require_extra
from gpufeed.cli.console import out


def demo(
    samples: int = typer.Option(experiment.SAMPLES, "--samples", help="Samples in the generated dataset."),
    epochs: int = typer.Option(experiment.EPOCHS, "--epochs", help="Epochs per mode."),
    latency_ms: float = typer.Option(DEFAULT_LATENCY_MS, "--latency-ms", help="First-byte latency of the emulated store."),
    plot: Path = typer.Option(Path("gpufeed-demo.png"), "--plot", help="Where to write the chart."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
) -> None:
    """Generate a small resnet50-shaped dataset, serve it as a remote store, train on it in every mode."""
    require_extra("demo")
    check_outputs(plot, json_out)
    work = experiment.demo_workload(samples, epochs)
    out.print(
        f"gpufeed demo: {work.name}-shaped job, {work.samples} samples, batch {work.batch}, "
        f"{work.compute * 1e3:.0f} ms compute per batch, {work.workers} workers, store {latency_ms:g} ms away",
        highlight=False,
    )
    report = experiment.run_demo(work, latency_ms, progress)
    print_report(report, json_out, plot)
