"""`gpufeed ls|stat|cat|du`: answered from the manifest; only `cat` reads bytes.

Plain lines (no rich markup) so the output pipes into other tools."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from gpufeed.cli.console import counted, human_bytes, when, write_stdout

if TYPE_CHECKING:
    from gpufeed.client import Client

CAT_CHUNK = 8 << 20


def _client() -> Client:
    from gpufeed.client import Client  # the reader is loaded by a command that reads, not by `--help`

    return Client()


def ls(
    path: str = typer.Argument("/", help="Namespace path."),
    long: bool = typer.Option(False, "-l", "--long", help="Show size, modification time and version."),
) -> None:
    """List a directory (from the manifest; the source is not contacted)."""
    for item in _client().ls(path):
        name = item.path.rsplit("/", 1)[-1] + ("/" if item.is_dir else "")
        if long:
            size = "-" if item.is_dir else str(item.size)
            typer.echo(f"{size:>12}  {when(item.mtime):19}  {name}")
        else:
            typer.echo(name)


def stat(path: str = typer.Argument(..., help="Namespace path.")) -> None:
    """Show size, type, modification time and version."""
    item = _client().stat(path)
    typer.echo(f"path:     {item.path}")
    typer.echo(f"type:     {'directory' if item.is_dir else 'file'}")
    if not item.is_dir:
        typer.echo(f"size:     {item.size}")
        typer.echo(f"modified: {when(item.mtime)}")
        typer.echo(f"version:  {item.version}")


def cat(path: list[str] = typer.Argument(..., help="Namespace paths of files.")) -> None:
    """Write the files' bytes to standard output, one after another."""
    client = _client()
    for one in path:
        with client.open(one) as f:
            while chunk := f.read(CAT_CHUNK):
                write_stdout(chunk)
    write_stdout(b"", flush=True)


def du(path: str = typer.Argument("/", help="Namespace path.")) -> None:
    """Total size and file count under a path."""
    files = total = 0
    for item in _client().walk(path):
        files += 1
        total += item.size
    typer.echo(f"{total}\t{human_bytes(total)}\t{counted(files, 'file')}\t{path}")


def register(app: typer.Typer) -> None:
    for command in (ls, stat, cat, du):
        app.command(command.__name__)(command)
