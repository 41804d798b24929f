"""`gpufeed warmup PATH... [--list FILE] [--concurrency N] [--dry-run]` and `gpufeed warmup status`.

Namespace paths are absolute, so the word `status` cannot be one: it selects the status view.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from gpufeed import warmup as warming
from gpufeed.cli.console import err, human_bytes, out
from gpufeed.client import Client
from gpufeed.errors import InvalidArgument



def _paths(paths: list[str], listing: Optional[Path]) -> list[str]:
    wanted = list(paths)
    if listing is not None:
        try:
            wanted += [line.strip() for line in listing.read_text().splitlines() if line.strip() and not line.startswith("#")]
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"--list {listing}: {getattr(exc, 'strerror', None) or exc}") from exc
    if not wanted:
        raise InvalidArgument("give one or more namespace paths, or --list FILE")
    return wanted


def warmup(
    paths: Optional[list[str]] = typer.Argument(None, help="Namespace paths (files or directories), or 'status'."),
    listing: Optional[Path] = typer.Option(None, "--list", help="File with one namespace path per line."),
    concurrency: int = typer.Option(16, "--concurrency", "-p", min=1, max=1024, help="Files fetched at once."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print the total size and the cached fraction."),
) -> None:
    """Load PATHs into the cache through the agent; what is cached already is skipped, so a
    warmup that was stopped resumes where it stopped. 'gpufeed warmup status' lists running ones."""
    if paths == ["status"]:
        status()
        return
    client = Client()
    wanted = _paths(paths or [], listing)
    if dry_run:
        total = cached = count = 0
        for path in wanted:
            for item, present in client.cached_bytes(path):
                count += 1
                total += item.size
                cached += present
        fraction = cached / total if total else 1.0
        out.print(f"{count} files, {human_bytes(total)}; {fraction:.1%} cached ({human_bytes(total - cached)} to fetch)", highlight=False)
        return
    files = warming.files_under(client, wanted)
    columns = (
        TextColumn("warming"),
        BarColumn(),
        TextColumn("{task.fields[files]}/" + str(len(files)) + " files"),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    started = time.monotonic()
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task("warmup", total=sum(f.size for f in files), files=0)
        done = warming.warm(
            client, files, wanted, concurrency, lambda p: bar.update(task, completed=p.done_bytes, files=p.done_files)
        )
    elapsed = time.monotonic() - started
    fetched = done.done_bytes - done.skipped_bytes
    out.print(
        f"warmed {done.done_files} files, {human_bytes(done.done_bytes)} in {elapsed:.1f} s: "
        f"fetched {human_bytes(fetched)}, {human_bytes(done.skipped_bytes)} were cached already",
        highlight=False,
    )


def status() -> None:
    """Show the warmups running on this node."""
    running = list(warming.running(Client()))
    if not running:
        out.print("no warmup running", highlight=False)
        return
    for p in running:
        share = p.done_bytes / p.bytes if p.bytes else 1.0
        out.print(
            f"pid {p.pid}: {' '.join(p.paths)}: {p.done_files}/{p.files} files, "
            f"{human_bytes(p.done_bytes)} of {human_bytes(p.bytes)} ({share:.0%}), running {time.time() - p.started:.0f} s",
            highlight=False,
        )
