"""`gpufeed verify NSPATH`: hash what is there once, record it, report what differs."""

from __future__ import annotations

import time
from dataclasses import asdict

import typer

from gpufeed.cli.console import counted, err, out, print_json
from gpufeed.cli.progress import Meter
from gpufeed.config import human_bytes


def verify(
    nspath: str = typer.Argument(..., help="Namespace path (a file or a directory) to hash."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress on stderr; errors and mismatches still print."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the counts, every mismatch and every file not verified as one JSON object."
    ),
) -> None:
    """Hash every file under NSPATH through the read path (sha256, or the algorithm of a hash
    the manifest has). Records the hash where the manifest has none; where it has one, prints
    each mismatch (path and both hashes) and exits 1."""
    from gpufeed import verify as verifying  # its stores and thread pool: not for every command's start
    from gpufeed.client import Client

    client = Client()
    client.namespace.engine.check_writable()
    target = verifying.listed(client, nspath)
    files = target.files
    started = time.monotonic()
    with Meter("verify", len(files), sum(f.size for f in files), quiet) as meter:
        done = verifying.verify(client, target, lambda p: meter.update(p.files, p.bytes))
    unread = [mismatch for mismatch in done.mismatches if mismatch.unread]
    mismatched = [mismatch for mismatch in done.mismatches if not mismatch.unread]
    for mismatch in done.mismatches:
        kind = "not verified" if mismatch.unread else "mismatch"
        err.print(f"gpufeed: {kind}: {mismatch}", markup=False, highlight=False, soft_wrap=True)
    if as_json:
        listed = {"mismatches": [asdict(m) for m in mismatched], "not_verified": [asdict(m) for m in unread]}
        print_json({**asdict(done), **listed, "seconds": round(time.monotonic() - started, 3)})
        if done.mismatches:
            raise typer.Exit(1)
        return
    out.print(
        f"verified {counted(done.files, 'file')}, {human_bytes(done.bytes)} in {time.monotonic() - started:.1f} s: "
        f"{counted(done.recorded, 'hash', 'hashes')} recorded, {done.matched} matched, {len(mismatched)} mismatched"
        + (f", {len(unread)} could not be read" if unread else ""),
        highlight=False,
    )
    if done.mismatches:
        raise typer.Exit(1)
