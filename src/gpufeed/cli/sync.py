"""`gpufeed sync [PATH]`: wait until this node's writes under PATH are in their stores."""

from __future__ import annotations

import time

import typer

from gpufeed.cli.console import counted, out


def sync(path: str = typer.Argument("/", help="Namespace path whose writes to wait for (default: all).")) -> None:
    """Wait for the uploads of every file this node wrote under PATH (`gpufeed.open(p, "wb")`,
    fsspec, checkpoints). Exits 1 naming an upload that keeps failing; its bytes stay staged and
    its upload is retried."""
    from gpufeed.client import Client

    started = time.monotonic()
    count = Client().sync(path)
    out.print(f"synced {path}: {counted(count, 'upload')} waited for in {time.monotonic() - started:.1f} s", highlight=False)
