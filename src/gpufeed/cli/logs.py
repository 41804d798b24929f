"""`gpufeed logs tail|recover`: inference logs written by `gpufeed.logs.Appender`.

Records go to stdout as their lines, unchanged, so the output pipes into `jq` and friends."""

from __future__ import annotations

import sys
import time

import typer

from gpufeed.cli.console import command_group, echo, err
from gpufeed.errors import InvalidArgument

app = command_group(help="Read and recover inference logs (gpufeed.logs.Appender).", no_args_is_help=True)


@app.command()
def tail(
    path: str = typer.Argument(..., help="Log directory (the Appender's path)."),
    lines: int = typer.Option(10, "-n", "--lines", help="How many of the last records to print."),
    follow: bool = typer.Option(False, "-f", "--follow", help="Then print new segments' records as they are committed."),
    interval: float = typer.Option(1.0, "--interval", help="Seconds between looks for new segments with --follow."),
) -> None:
    """Print the last records of a log directory, oldest first, across its committed segments.

    The open segment of a running appender shows once it is committed (its max_seconds at the
    latest). A read-only mount is fine: tail only reads. With --follow, a segment committed late
    (one recovered from a dead appender) is printed when it appears, after newer ones."""
    from gpufeed import logs

    if lines < 0 or interval <= 0:
        raise InvalidArgument(f"logs tail: -n must be >= 0 and --interval > 0, got {lines} and {interval}")
    sink = sys.stdout.buffer
    found = logs.segments(path)
    if not found and not follow:  # say so on stderr: stdout stays the records only
        err.print(f"{path}: no committed log segments (*{logs.SUFFIX}) here yet; an Appender's segments appear once committed")
    seen = {segment.path for segment in found}
    last: list[bytes] = []
    for segment in reversed(found):
        if len(last) >= lines:
            break
        last[:0] = logs.lines(segment)
    for line in last[-lines:] if lines else ():
        sink.write(line + b"\n")
    sink.flush()
    while follow:
        time.sleep(interval)
        for segment in logs.segments(path):
            if segment.path not in seen:
                seen.add(segment.path)
                sink.writelines(line + b"\n" for line in logs.lines(segment))
        sink.flush()


@app.command()
def recover(path: str = typer.Argument(..., help="Log directory (the Appender's path).")) -> None:
    """Commit the segments this node's dead appenders of PATH left in their write-ahead logs
    (a new Appender for PATH does it too)."""
    from gpufeed import logs

    count = logs.recover(path)
    echo(f"recovered {path}: {count} segment(s) committed")
