"""A bench report as a terminal table (rich), JSON and a PNG chart (matplotlib, Agg)."""

from __future__ import annotations

import json
from pathlib import Path

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from gpufeed.bench.metrics import MIB, BenchReport

COLUMNS = ("mode", "epoch", "AU", "samples\n/s", "MiB/s", "time\ns", "1st\nbatch s", "p50\nms", "p99\nms", "source\nMiB")


def table(report: BenchReport) -> Group:
    """Heading, one row per mode and epoch (plus set-up and total rows), and a legend."""
    work = report.workload
    where = report.source
    if report.latency_ms is not None:
        where += f", emulated remote: {report.latency_ms:g} ms"
        if report.bandwidth_mbps:
            where += f", {report.bandwidth_mbps:g} MB/s"
    title = (
        f"{work.name}: {work.samples} samples x {report.record_size:,.0f} B, batch {work.batch}, "
        f"compute {work.compute * 1e3:g} ms/batch, {work.accelerators} accelerator(s) x {work.workers} workers\n{where}"
    )
    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for name in COLUMNS:
        grid.add_column(name, justify="left" if name == "mode" else "right", no_wrap=True)
    for mode in report.modes:
        if mode.setup_s:
            grid.add_row(mode.mode, "set-up", "", "", "", f"{mode.setup_s:.2f}", "", "", "", f"{mode.setup_bytes / MIB:,.0f}")
        for e in mode.epochs:
            grid.add_row(
                mode.mode,
                str(e.epoch),
                f"{e.au:.1%}",
                f"{e.samples_per_s:,.0f}",
                f"{e.mib_per_s:,.1f}",
                f"{e.epoch_s:.2f}",
                f"{e.first_batch_s:.2f}",
                f"{e.latency_p50_ms:.2f}",
                f"{e.latency_p99_ms:.2f}",
                f"{e.source_bytes / MIB:,.0f}",
            )
        grid.add_row(
            f"[bold]{mode.mode}[/bold]",
            "[bold]total[/bold]",
            f"[bold]{mode.au_end_to_end:.1%}[/bold]",
            f"[bold]{mode.samples_per_s:,.0f}[/bold]",
            "",
            f"[bold]{mode.total_s:.2f}[/bold]",
            "",
            "",
            "",
            f"[bold]{mode.source_bytes / MIB:,.0f}[/bold]",
            end_section=True,
        )
    legend = (
        "AU: compute / training wall time, first step excluded (MLPerf Storage). "
        "total: AU and samples/s over the whole run, set-up and first batches included. "
        "p50/p99: time a worker took to read a batch (its samples are read together)."
    )
    if work.au_pass is not None:
        legend += f" {work.name} passes at AU >= {work.au_pass:.0%}."
    return Group(Text(title), grid, Text(legend, style="dim"))


def write_json(report: BenchReport, path: Path) -> None:
    path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def write_plot(report: BenchReport, path: Path) -> None:
    """AU per epoch and time per mode (set-up stacked under the epochs), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    modes = report.modes
    figure, (au_axis, time_axis) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    epochs = max((len(m.epochs) for m in modes), default=0)
    width = 0.8 / max(epochs, 1)
    for k in range(epochs):
        values = [m.epochs[k].au * 100 if k < len(m.epochs) else 0 for m in modes]
        positions = [i + (k - (epochs - 1) / 2) * width for i in range(len(modes))]
        bars = au_axis.bar(positions, values, width, label=f"epoch {k + 1}")
        au_axis.bar_label(bars, fmt="%.0f", fontsize="small")
    if report.workload.au_pass is not None:
        au_axis.axhline(report.workload.au_pass * 100, color="black", linestyle="--", linewidth=1, label="MLPerf pass")
    au_axis.set_xticks(range(len(modes)), [m.mode for m in modes])
    au_axis.set_ylim(0, 105)
    au_axis.set_ylabel("accelerator utilisation (%)")
    au_axis.set_title("AU per epoch")
    au_axis.legend(fontsize="small")

    bottoms = [0.0] * len(modes)
    setup = [m.setup_s for m in modes]
    if any(setup):
        time_axis.bar(range(len(modes)), setup, color="grey", label="set-up (copy)")
        bottoms = setup[:]
    for k in range(epochs):
        values = [m.epochs[k].epoch_s if k < len(m.epochs) else 0 for m in modes]
        time_axis.bar(range(len(modes)), values, bottom=bottoms, label=f"epoch {k + 1}")
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    time_axis.set_xticks(range(len(modes)), [m.mode for m in modes])
    time_axis.set_ylabel("seconds")
    time_axis.set_title("time to train")
    time_axis.legend(fontsize="small")

    remote = f", {report.latency_ms:g} ms store latency" if report.latency_ms is not None else ""
    figure.suptitle(f"gpufeed bench: {report.workload.name}{remote}")
    figure.savefig(path, dpi=110)
    plt.close(figure)

