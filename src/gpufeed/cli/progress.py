"""Progress of a long command, on stderr so that stdout keeps only the result.

On a terminal a rich bar (files, bytes, rate, ETA); elsewhere (a log, a pipe, CI) a plain line
every few seconds and one at the end, so a big transfer never looks hung and a log stays
readable; `quiet` shows nothing.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING

from gpufeed.cli.console import err
from gpufeed.config import Settings, human_bytes

if TYPE_CHECKING:
    from rich.progress import Progress


class Meter:
    """Counts files and bytes done against totals (0 when unknown) and shows them. A `listing`
    counts objects found, its bytes only their sizes: its rate is in objects per second."""

    def __init__(
        self, verb: str, files: int = 0, size: int = 0, quiet: bool = False, unit: str = "files", listing: bool = False
    ) -> None:
        self.verb, self.files, self.size, self.unit, self.listing = verb, files, size, unit, listing
        self.done_files = self.done_bytes = 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._mode = "quiet" if quiet else "bar" if err.is_terminal else "plain"
        self._bar: Progress | None = None
        if self._mode == "bar":
            self._bar = _rich_bar(verb, files, unit, bool(size))
            self._task = self._bar.add_task(verb, total=size or None, files=0)

    def __enter__(self) -> Meter:
        if self._bar is not None:
            self._bar.start()
        elif self._mode == "plain":
            threading.Thread(target=self._tick, args=(Settings.from_env().progress_interval,), daemon=True).start()
        return self

    def _tick(self, interval: float) -> None:
        """A line every `interval` even while nothing finishes: a stalled fetch shows as one."""
        while not self._stop.wait(interval):
            err.print(self.line(), highlight=False, markup=False, soft_wrap=True)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._bar is not None:
            self._bar.stop()
        elif self._mode == "plain" and kind is None:  # a failure says so in its own one line
            err.print(self.line(), highlight=False, markup=False, soft_wrap=True)

    def update(self, files: int, size: int) -> None:
        """Set the counts done so far; cheap enough to call per file or per block (plain lines come
        from a ticker, not from here)."""
        self.done_files, self.done_bytes = files, size
        if self._bar is not None:
            self._bar.update(self._task, completed=size if self.size else files, files=files)

    def line(self) -> str:
        """`warmup: 1,234/5,000 files, 1.2 GiB/4.8 GiB, 310.0 MiB/s, ETA 12 s`."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        parts = [f"{self.done_files:,}" + (f"/{self.files:,}" if self.files else "") + f" {self.unit}"]
        if self.listing:
            parts += [human_bytes(self.done_bytes), f"{self.done_files / elapsed:,.0f} {self.unit}/s"]
        elif self.size or self.done_bytes:
            parts.append(human_bytes(self.done_bytes) + (f"/{human_bytes(self.size)}" if self.size else ""))
            rate = self.done_bytes / elapsed
            parts.append(f"{human_bytes(rate)}/s")
            if self.size and rate > 0 and self.done_bytes < self.size:
                parts.append(f"ETA {(self.size - self.done_bytes) / rate:.0f} s")
        parts.append(f"{elapsed:.1f} s")
        return f"{self.verb}: " + ", ".join(parts)


def _rich_bar(verb: str, files: int, unit: str, sized: bool) -> Progress:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    count = TextColumn("{task.fields[files]:,}" + (f"/{files:,}" if files else "") + f" {unit}")
    if sized:
        return Progress(
            TextColumn(verb),
            BarColumn(),
            count,
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=err,
        )
    return Progress(SpinnerColumn(), TextColumn(verb), count, TimeElapsedColumn(), console=err)
