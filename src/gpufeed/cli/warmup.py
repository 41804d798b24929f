"""`gpufeed warmup PATH... [--list FILE] [--concurrency N] [--dry-run]` and `gpufeed warmup status [PATH]...`.

Namespace paths are absolute, so the word `status` cannot be one: as the first argument it selects
the status view, and the paths after it narrow that view to the warmups that touch them. (A click
sub-command would not do: the group's variadic PATH argument swallows its name.)
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

from gpufeed import warmup as warming
from gpufeed.cli.console import counted, err, out, print_json
from gpufeed.cli.progress import Meter
from gpufeed.config import human_bytes
from gpufeed.errors import GpufeedError, InvalidArgument, NotCached

if TYPE_CHECKING:
    from gpufeed.client import Client


def _paths(paths: list[str], listing: Path | None) -> list[str]:
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
    paths: list[str] | None = typer.Argument(
        None, help="Namespace paths (files or directories), or 'status [PATH]...' to show running warmups."
    ),
    listing: Path | None = typer.Option(None, "--list", help="File with one namespace path per line."),
    concurrency: int = typer.Option(16, "--concurrency", "-p", min=1, max=1024, help="Files fetched at once."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print the total size and the cached fraction."),
    cluster: bool = typer.Option(
        False, "--cluster", help="Cache each block on its owner in the cache cluster, all nodes fetching their share at once."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr; errors still print."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
) -> None:
    """Load PATHs into the node cache before a job reads them; 'warmup status' shows running ones.

    What is cached already is skipped, so a warmup that was stopped resumes where it stopped.
    With --cluster (an agent started with --cluster) every block is fetched once, by its
    owner, into the owner's cache; this node keeps the blocks it owns.
    'gpufeed warmup status [PATH]...' lists the running warmups (those reading under or
    containing a PATH)."""
    if paths and paths[0] == "status":
        if listing is not None or dry_run:
            raise InvalidArgument("'warmup status' takes namespace paths only, not --list or --dry-run")
        status(paths[1:], as_json)
        return
    if dry_run and cluster:
        raise InvalidArgument("--dry-run shows this node's cache: it does not combine with --cluster")
    from gpufeed.client import Client

    client = Client()
    wanted = _paths(paths or [], listing)
    if dry_run:
        total = cached = count = 0
        for path in wanted:
            for item, present in client.cached_bytes(path):
                count += 1
                total += item.size
                cached += present
        if as_json:
            print_json({"files": count, "bytes": total, "cached_bytes": cached, "to_fetch_bytes": total - cached})
            return
        share = math.floor(cached / total * 1000) / 10 if total else 100.0  # 14 B to fetch is not "100.0% cached"
        to_fetch = human_bytes(total - cached)
        out.print(f"{counted(count, 'file')}, {human_bytes(total)}; {share:.1f}% cached ({to_fetch} to fetch)", highlight=False)
        return
    files = warming.files_under(client, wanted)
    try:
        with Meter("warmup", len(files), sum(f.size for f in files), quiet) as meter:
            done = warming.warm(
                client, files, wanted, concurrency, lambda p: meter.update(p.done_files, p.done_bytes), at_owners=cluster
            )
    except warming.Stopped as stop:
        _stopped(stop, as_json)
    elapsed = time.monotonic() - meter.started
    fetched, uncached = done.fetched_bytes, done.uncached_bytes
    cached = max(0, done.done_bytes - fetched - uncached)  # a pack's member costs its shard's whole block: maybe more than it
    evicted, limit = (0, 0) if cluster or uncached else _evicted_again(client, wanted, sum(f.size for f in files))
    if as_json:
        summary = {"files": done.done_files, "bytes": done.done_bytes, "fetched_bytes": fetched,
                   "uncached_bytes": uncached, "evicted_bytes": evicted, "seconds": round(elapsed, 3)}
        print_json(summary)
    else:
        out.print(
            f"warmed {counted(done.done_files, 'file')}, {human_bytes(done.done_bytes)} in {elapsed:.1f} s: "
            f"fetched {human_bytes(fetched)}, {human_bytes(cached)} were cached already"
            + (f", {human_bytes(uncached)} not cached" if uncached else "")
            + (f", {human_bytes(evicted)} evicted again" if evicted else ""),
            highlight=False,
        )
    if uncached:  # a script that warms before training must not take this for a warm cache
        raise NotCached(
            f"warmup: {human_bytes(uncached)} of {human_bytes(done.done_bytes)} could not be cached "
            "(see the warning above); reads of them go to the store"
        )
    if evicted:
        raise NotCached(
            f"warmup: {human_bytes(evicted)} of {human_bytes(done.done_bytes)} did not stay cached: the cache holds "
            f"{human_bytes(limit)} (gpufeed agent start --cache-size); reads of them go to the store"
        )


def _evicted_again(client: Client, wanted: list[str], total: int) -> tuple[int, int]:
    """Bytes of a warmup of `wanted` (`total` bytes) bigger than the cache that it pushed out
    again (its first files for its last), and the cache's limit; nothing is looked at when it fits."""
    try:
        limit = client.agent.stats(start=False).limit
    except GpufeedError:
        return 0, 0
    if total <= limit * 0.9:  # well inside the cache (block headers and whole shard blocks take a little more)
        return 0, limit
    present = {item.path: got for path in wanted for item, got in client.cached_bytes(path)}  # a file under two paths once
    return max(0, total - sum(present.values())), limit


def _stopped(stop: warming.Stopped, as_json: bool) -> NoReturn:
    """Say how much is cached and leave at once with 130: the fetches still in flight are
    dropped rather than waited for (they would keep a big object's Ctrl-C waiting for minutes)."""
    p = stop.progress
    cached = max(0, p.done_bytes - p.uncached_bytes) + stop.partial_bytes
    if as_json:
        summary = {"interrupted": True, "files": p.done_files, "bytes": cached, "uncached_bytes": p.uncached_bytes,
                   "of_files": p.files, "of_bytes": p.bytes}
        print_json(summary)
    not_cached = f" ({human_bytes(p.uncached_bytes)} not cached)" if p.uncached_bytes else ""
    err.print(
        f"gpufeed: interrupted: {p.done_files}/{p.files} files complete, {human_bytes(cached)} of "
        f"{human_bytes(p.bytes)} cached{not_cached}; run the same warmup again to resume",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


def _touches(warming_paths: list[str], wanted: list[str]) -> bool:
    """Whether a warmup of `warming_paths` reads anything under (or containing) a path in `wanted`."""
    if not wanted:
        return True
    return any(_under(a, b) or _under(b, a) for a in warming_paths for b in wanted)


def _under(path: str, top: str) -> bool:
    top = top.rstrip("/")
    return path == top or path.startswith(top + "/") or not top


def status(wanted: list[str], as_json: bool = False) -> None:
    """Show the warmups running on this node, those touching `wanted` when paths are given."""
    for path in wanted:
        if not path.startswith("/"):
            raise InvalidArgument(f"warmup status {path}: namespace paths start with '/'")
    from gpufeed.client import Client

    running = [p for p in warming.running(Client()) if _touches(p.paths, wanted)]
    if as_json:
        print_json([asdict(p) for p in running])
        return
    if not running:
        out.print("no warmup running" + (f" under {' '.join(wanted)}" if wanted else ""), highlight=False)
        return
    for p in running:
        share = p.done_bytes / p.bytes if p.bytes else 1.0
        out.print(
            f"pid {p.pid}: {' '.join(p.paths)}: {p.done_files}/{p.files} files, "
            f"{human_bytes(p.done_bytes)} of {human_bytes(p.bytes)} ({share:.0%}), running {time.time() - p.started:.0f} s",
            highlight=False,
        )
