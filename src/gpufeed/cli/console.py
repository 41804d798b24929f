"""Shared rich consoles and formatting for CLI output."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from rich.progress import Progress

out = Console()
err = Console(stderr=True)


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) if timestamp else "-"


def transfer_progress(verb: str, files: int) -> Progress:
    """The bar of a command that moves a known number of files and bytes (warmup, verify); its
    task takes the field `files`, the count done so far."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (
        TextColumn(verb),
        BarColumn(),
        TextColumn("{task.fields[files]}/" + str(files) + " files"),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=err, transient=False)
