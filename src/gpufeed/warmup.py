"""Warmup: load paths into the node cache before a job reads them.

Progress is the cache itself: blocks already cached are skipped, so a warmup that was killed
resumes where it stopped when run again. A running warmup publishes its progress in the
primary cache dir (`warmups/PID.json`) for `gpufeed warmup status`; files of dead processes
are ignored and removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpufeed.processes import alive

if TYPE_CHECKING:
    from gpufeed.client import Client
    from gpufeed.paths import FileStat

STATUS_INTERVAL_S = 0.5


@dataclass
class Progress:
    paths: list[str]
    files: int
    bytes: int
    done_files: int = 0
    done_bytes: int = 0
    fetched_bytes: int = 0
    """Bytes read from stores for this warmup: whole blocks, so a pack's member costs its
    shard's block, and a block another member fetched first costs nothing."""
    uncached_bytes: int = 0
    """Bytes of the files the node cache did not take (no agent, a full cache)."""
    pid: int = field(default_factory=os.getpid)
    started: float = field(default_factory=time.time)


class Stopped(KeyboardInterrupt):
    """Ctrl-C during a warmup: what it had done, and the bytes cached of the files it was still fetching."""

    def __init__(self, progress: Progress, partial_bytes: int) -> None:
        super().__init__()
        self.progress, self.partial_bytes = progress, partial_bytes


def files_under(client: Client, paths: Iterable[str]) -> list[FileStat]:
    """Every file under `paths`, from the manifest, in the order given; a file under two of
    them (a directory and a file in it) once."""
    files = {item.path: item for path in paths for item in client.walk(path)}
    return list(files.values())


def status_dir(client: Client) -> Path:
    return client.settings.cache_dirs[0] / "warmups"


def running(client: Client) -> Iterator[Progress]:
    """Warmups in progress on this node (their processes are alive)."""
    directory = status_dir(client)
    for entry in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        try:
            progress = Progress(**json.loads(entry.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if alive(progress.pid):
            yield progress
        else:
            entry.unlink(missing_ok=True)


def warm(
    client: Client,
    files: list[FileStat],
    paths: list[str],
    concurrency: int,
    report: Callable[[Progress], None],
    *,
    at_owners: bool = False,
) -> Progress:
    """Fetch every block of `files` through the agent, `concurrency` files at a time; with
    `at_owners`, into the caches of the blocks' owners in the cache cluster (`Client.warm`)."""
    progress = Progress(paths, len(files), sum(f.size for f in files))
    read_before = client.source_bytes
    status = status_dir(client) / f"{progress.pid}.json"
    lock = threading.Lock()
    written = 0.0

    def publish_status() -> None:
        """For `warmup status`; a cache dir that cannot take the file (full, read-only) only
        means this warmup is not listed there: the warmup itself goes on."""
        try:
            status.parent.mkdir(parents=True, exist_ok=True)
            status.write_text(json.dumps(asdict(progress)))
        except OSError:
            pass

    publish_status()

    active: dict[int, tuple[str, int]] = {}  # a fetch under way -> (its path, its bytes counted in done_bytes)

    def tick() -> None:
        nonlocal written
        report(progress)
        if time.monotonic() - written > STATUS_INTERVAL_S:
            publish_status()
            written = time.monotonic()

    def one(number: int, item: FileStat) -> None:
        with lock:
            active[number] = (item.path, 0)

        def fetched(size: int) -> None:
            with lock:
                active[number] = (item.path, active[number][1] + size)
                progress.done_bytes += size
                tick()

        left = client.warm(client.handle(item.path), fetched, at_owners=at_owners)
        with lock:
            progress.uncached_bytes += left
            progress.done_files += 1
            progress.done_bytes += item.size - active.pop(number)[1]
            progress.fetched_bytes = client.source_bytes - read_before
            tick()

    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="gpufeed-warmup")
    try:
        for _ in pool.map(one, range(len(files)), files):
            pass
        pool.shutdown()
    except KeyboardInterrupt:
        # Waiting for the fetches in flight could take minutes on a big object: drop them; what
        # they published stays cached and a rerun resumes from there.
        pool.shutdown(wait=False, cancel_futures=True)
        with lock:
            progress.done_bytes -= sum(counted for _, counted in active.values())
            partial = sum(present for path, _ in active.values() for _, present in client.cached_bytes(path))
        raise Stopped(progress, partial) from None
    finally:
        with contextlib.suppress(OSError):
            status.unlink(missing_ok=True)
    return progress
