"""A bench or demo report as a terminal table (rich), JSON and a PNG chart (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from gpufeed.bench.metrics import MIB, BenchReport

if TYPE_CHECKING:
    from gpufeed.bench.demo import DemoResult

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
            mode.mode,
            "total",
            f"{mode.au_end_to_end:.1%}",
            f"{mode.samples_per_s:,.0f}",
            "",
            f"{mode.total_s:.2f}",
            "",
            "",
            "",
            f"{mode.source_bytes / MIB:,.0f}",
            style="bold",
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



def store_shape(latency_ms: float, bandwidth_mbps: float | None) -> str:
    cap = f"{bandwidth_mbps:g} MB/s bandwidth cap" if bandwidth_mbps else "no bandwidth cap"
    return f"{latency_ms:g} ms first-byte latency, {cap}"


def demo_table(result: DemoResult) -> Group:
    """The story: one row per way, ratios against direct and local disk, why direct starves,
    and the closing line."""
    report = result.report
    work = report.workload
    assert report.latency_ms is not None, "the demo always reads an emulated store"
    title = (
        f"{work.name}-shaped job: {work.samples:,} samples x {report.record_size:,.0f} B "
        f"({report.dataset_bytes / MIB:,.0f} MiB), batch {work.batch}, {work.workers} workers, "
        f"{work.compute * 1e3:.0f} ms compute per batch\n"
        f"store: {store_shape(report.latency_ms, report.bandwidth_mbps)}"
    )
    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for name in ("way", "samples/s", "accelerator\nbusy", "vs\ndirect", "vs local\ndisk", "from store\nMiB"):
        grid.add_column(name, justify="left" if name == "way" else "right", no_wrap=True)
    for row in result.rows:
        grid.add_row(
            row.way,
            f"{row.samples_per_s:,.0f}",
            f"{row.busy:.0%}",
            f"{row.vs_direct:.2f}x",
            f"{row.vs_local:.2f}x",
            f"{row.source_bytes / MIB:,.0f}",
        )
    legend = (
        "busy: the emulated accelerator's compute time / the epoch's wall time, first batch included. "
        "Ratios are of samples/s, every way measured in this run; local disk and gpufeed warm are second epochs."
    )
    return Group(Text(title), grid, Text(legend, style="dim"), Text(result.why), Text(result.message, style="bold"))


WAY_COLOURS = {"local disk": "#9e9e9e", "direct": "#d62728", "gpufeed cold": "#74c476", "gpufeed warm": "#238b45"}


def write_demo_plot(result: DemoResult, path: Path) -> None:
    """Accelerator busy % per way, each bar labelled with its samples/s and ratios, a line at
    local disk's: the starving bar and the bars that reach the line read at a glance."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    report = result.report
    assert report.latency_ms is not None, "the demo always reads an emulated store"
    rows = result.rows
    figure, axis = plt.subplots(figsize=(9, 5.2), constrained_layout=True)
    axis.bar(range(len(rows)), [r.busy * 100 for r in rows], 0.6, color=[WAY_COLOURS[r.way] for r in rows])
    for x, row in enumerate(rows):  # inside the bar's top, clear of the line; above a bar too short to hold it
        inside = row.busy > 0.12
        y = row.busy * 100 - 2 if inside else row.busy * 100 + 1
        axis.text(x, y, f"{row.busy:.0%}", ha="center", va="top" if inside else "bottom", fontsize="x-large",
                  fontweight="bold", color="white" if inside else "black")
    local = result.row("local disk")
    axis.axhline(local.busy * 100, color="black", linestyle="--", linewidth=1)
    axis.text(1.5, local.busy * 100 + 1, "local disk", ha="center", va="bottom", fontsize="small")  # between bars 2 and 3
    ticks = [f"{r.way}\n{r.samples_per_s:,.0f} samples/s\n{r.vs_direct:.1f}x direct, {r.vs_local:.2f}x local" for r in rows]
    axis.set_xticks(range(len(rows)), ticks)
    axis.set_ylim(0, 105)
    axis.set_ylabel("accelerator busy (%)")
    axis.set_xlabel(textwrap.fill(result.why, 110), fontsize="small")
    work = report.workload
    axis.set_title(
        f"gpufeed demo: accelerator busy, one training loop reading a store with\n"
        f"{store_shape(report.latency_ms, report.bandwidth_mbps)} "
        f"({work.name}-shaped, {work.samples:,} samples, batch {work.batch}, {work.workers} workers)",
        fontsize="medium",
    )
    figure.savefig(path, dpi=110)
    plt.close(figure)
