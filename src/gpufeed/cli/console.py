"""Shared rich consoles and formatting for CLI output."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import IO, Any, cast

import typer
from rich.console import Console

from gpufeed.errors import WriteError

PIPED_WIDTH = 240
"""The width tables are laid out in when the output is not a terminal (a pipe, a log)."""


def _width(stream: Any) -> int | None:
    """A table piped or logged keeps its addresses and paths whole: rich would fit it to 80
    columns. On a terminal (or with COLUMNS set), the terminal's width."""
    terminal = getattr(stream, "isatty", None)
    return None if os.environ.get("COLUMNS") or (terminal is not None and terminal()) else PIPED_WIDTH


class _Stdout:
    """sys.stdout as `out` writes it, looked up at each write (tests swap it): a write that
    fails (a full disk, a closed descriptor) is one WriteError naming standard output."""

    def write(self, text: str) -> int:
        return _written(lambda stream: stream.write(text))

    def flush(self) -> None:
        _written(lambda stream: stream.flush())

    def __getattr__(self, name: str) -> Any:
        return getattr(sys.stdout, name)


def _written(call: Any) -> Any:
    if sys.stdout is None:  # started with descriptor 1 closed (`>&-`)
        raise WriteError("cannot write to standard output: it is closed")
    try:
        return call(sys.stdout)
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise WriteError(f"cannot write to standard output: {exc.strerror or exc}") from exc


out = Console(file=cast(IO[str], _Stdout()), markup=False, highlight=False, soft_wrap=True, width=_width(sys.stdout))
"""Plain text: a path or URL with brackets in it is printed as it is (rich markup would take
`[/x]` for a closing tag and fail), and a line piped to a script is not broken at 80 columns."""
err = Console(stderr=True, markup=False, highlight=False, soft_wrap=True, width=_width(sys.stderr))


def command_group(**options: Any) -> typer.Typer:
    """A typer app whose help is prose: a docstring's line breaks are joined, and `[env: X]` is
    shown as text (typer's default rich markup takes it for a style tag and drops it)."""
    return typer.Typer(rich_markup_mode="markdown", **options)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`1 file`, `2 files`, `1,234 files` (`plural` for a noun that takes more than an s)."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) if timestamp else "-"


def write_stdout(data: bytes | str, *, flush: bool = False) -> None:
    """Write a command's output; one that cannot be written (a full disk, a dead terminal) is
    one line naming standard output, not an internal error. A closed pipe (`| head`) is no
    error at all: `cli.main.run` ends quietly on BrokenPipeError."""
    _written(lambda stream: stream.write(data) if isinstance(data, str) else stream.buffer.write(data))
    if flush:
        _written(lambda stream: stream.flush())


def echo(line: str) -> None:
    """One line of a command's output, as `typer.echo` writes it, failing as `write_stdout` does."""
    write_stdout(line + "\n", flush=True)


def print_json(result: Any, *, indent: int | None = None) -> None:
    """A command's result for a script (`--json`): one JSON document on stdout, nothing else there."""
    write_stdout(json.dumps(result, indent=indent) + "\n", flush=True)
