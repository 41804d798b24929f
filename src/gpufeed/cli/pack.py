"""`gpufeed pack NSPATH DEST_URL`: small files into shards, under their original paths."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import typer

from gpufeed.cli.console import counted, echo, out
from gpufeed.cli.progress import Meter
from gpufeed.config import human_bytes, parse_size

if TYPE_CHECKING:
    from gpufeed.client import Client
    from gpufeed.pack.packer import Packed


def pack(
    nspath: str = typer.Argument(..., help="Namespace directory to pack, e.g. /data/imagenet."),
    dest: str = typer.Argument(..., help="Where to write the pack: a local dir, s3://bucket/prefix, gs://…, az://…"),
    shard_size: str = typer.Option("256MiB", "--shard-size", help="Largest shard (a bigger file gets a shard alone)."),
    workers: int = typer.Option(4, "--workers", "-w", help="Processes reading and writing shards at once."),
    ray: str | None = typer.Option(
        None, "--ray", metavar="ADDRESS", help="Write the shards as tasks of this Ray cluster (host:port, or auto)."
    ),
    order: Path | None = typer.Option(None, "--order", help="File of paths (one a line) to pack first, in this order."),
    opt: list[str] = typer.Option([], "--opt", "-o", help="Destination store option key=value (repeatable)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr; errors still print."),
    as_json: bool = typer.Option(False, "--json", help="Print what was done as one JSON object."),
) -> None:
    """Pack every file under NSPATH into shards plus an index at DEST_URL, reading through the
    cache. Mount DEST_URL and the files keep their paths. Interrupted, it resumes (finished
    shards are kept); over unchanged input it does nothing. Shards of an earlier pack that the
    new index does not name are removed once it is published. With --ray, each shard is a task of
    an existing Ray cluster; its nodes need gpufeed, an agent, and the namespace's metadata on
    Redis (GPUFEED_META)."""
    from gpufeed.client import Client
    from gpufeed.mount_options import parse_options
    from gpufeed.pack import packer
    from gpufeed.sources import as_url
    from gpufeed.sources.stores import local_path

    started = time.monotonic()
    dest = as_url(dest)
    client = Client()
    local = local_path(urlsplit(dest).path) if dest.startswith("file://") else None
    fresh = local is not None and not local.exists()
    try:
        job = packer.prepare(
            client, nspath, packer.destination(dest, parse_options(opt), client),
            shard_size=parse_size(shard_size, "--shard-size"), order=order,
        )
        with Meter("pack", len(job.items), job.bytes, quiet=quiet or job.up_to_date()) as meter:
            done = packer.pack(client, job, workers=workers, ray_address=ray, progress=meter.update)
    except BaseException:
        if fresh and local is not None:  # the directory this pack made, while it is still empty
            with contextlib.suppress(OSError):
                local.rmdir()
        raise
    seconds = time.monotonic() - started
    if as_json:
        echo(json.dumps({**asdict(done), "seconds": round(seconds, 3)}))
        return
    if done.up_to_date:
        files, shards = counted(done.files, "file"), counted(done.shards, "shard")
        out.print(f"{dest}: up to date ({files} in {shards}{removed(done)}){_as_listed(client, job.nspath)}", highlight=False)
        return
    out.print(
        f"packed {counted(done.files, 'file')}, {human_bytes(done.bytes)} from {job.nspath} into {dest}: "
        f"{counted(done.shards, 'shard')} "
        f"({done.written} written, {done.kept} kept from an earlier run{removed(done)}) in {seconds:.1f} s",
        highlight=False,
    )


def _as_listed(client: Client, nspath: str) -> str:
    """The pack follows the manifest, not the store: files added since the listing are not in it."""
    where = client.namespace.resolve(nspath)
    if where is None or not where.mount.listed_at:
        return ""
    listed = time.strftime("%Y-%m-%d %H:%M", time.localtime(where.mount.listed_at))
    path = where.mount.path
    return f" with {path} as listed at {listed} (files added since: run gpufeed mount refresh {path} first)"


def removed(done: Packed) -> str:
    """What the run's summary adds when it removed an earlier pack's shards."""
    return f", {counted(done.removed, 'stale shard')} removed" if done.removed else ""
