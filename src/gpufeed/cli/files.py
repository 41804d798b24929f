"""`gpufeed ls|stat|cat|du`: answered from the manifest; only `cat` reads bytes.

Plain lines (no rich markup) so the output pipes into other tools."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from gpufeed.cli.console import counted, echo, err, print_json, when, write_stdout
from gpufeed.config import human_bytes
from gpufeed.errors import GpufeedError, WriteError

if TYPE_CHECKING:
    from gpufeed.client import Client
    from gpufeed.paths import FileStat

CAT_CHUNK = 8 << 20


def _client() -> Client:
    from gpufeed.client import Client  # the reader is loaded by a command that reads, not by `--help`

    return Client()


def _record(item: FileStat) -> dict[str, Any]:
    """One path for a script (`--json`): a file's mtime in seconds since the epoch, its
    version as the manifest pins it (the store's ETag, or what stands for one)."""
    if item.is_dir:
        return {"path": item.path, "type": "directory"}
    return {"path": item.path, "type": "file", "size": item.size, "mtime": item.mtime, "version": item.version}


JsonOption = typer.Option(False, "--json", help="Print the result as JSON on stdout.")


def ls(
    path: str = typer.Argument("/", help="Namespace path."),
    long: bool = typer.Option(False, "-l", "--long", help="Show size and modification time."),
    as_json: bool = typer.Option(False, "--json", help="One JSON array of the entries (path, type, size, mtime, version)."),
) -> None:
    """List a directory (from the manifest; the source is not contacted)."""
    items = _client().ls(path)
    if as_json:
        print_json([_record(item) for item in items])
        return
    for item in items:
        name = item.path.rsplit("/", 1)[-1] + ("/" if item.is_dir else "")
        if long:
            size = "-" if item.is_dir else str(item.size)
            echo(f"{size:>12}  {when(item.mtime):19}  {name}")
        else:
            echo(name)


def stat(path: str = typer.Argument(..., help="Namespace path."), as_json: bool = JsonOption) -> None:
    """Show size, type, modification time and version."""
    item = _client().stat(path)
    if as_json:
        print_json(_record(item))
        return
    echo(f"path:     {item.path}")
    echo(f"type:     {'directory' if item.is_dir else 'file'}")
    if not item.is_dir:
        echo(f"size:     {item.size}")
        echo(f"modified: {when(item.mtime)}")
        echo(f"version:  {item.version}")


def cat(path: list[str] = typer.Argument(..., help="Namespace paths of files.")) -> None:
    """Write the files' bytes to standard output, one after another. As POSIX cat, a file that
    cannot be read is named on stderr and the others are still written; the exit code is then 1."""
    client = _client()
    failed = False
    for one in path:
        try:
            with client.open(one) as f:
                while chunk := f.read(CAT_CHUNK):
                    write_stdout(chunk)
        except WriteError:
            raise
        except GpufeedError as exc:
            if len(path) == 1:
                raise
            write_stdout(b"", flush=True)  # what came before, before the error line
            err.print(f"gpufeed: error: {exc}")
            failed = True
    write_stdout(b"", flush=True)
    if failed:
        raise typer.Exit(1)


def du(path: str = typer.Argument("/", help="Namespace path."), as_json: bool = JsonOption) -> None:
    """Total size and file count under a path."""
    files = total = 0
    for item in _client().walk(path):
        files += 1
        total += item.size
    if as_json:
        print_json({"path": path, "bytes": total, "files": files})
        return
    echo(f"{total}\t{human_bytes(total)}\t{counted(files, 'file')}\t{path}")


def register(app: typer.Typer) -> None:
    for command in (ls, stat, cat, du):
        app.command(command.__name__)(command)
