"""`gpufeed cache stats|clear|ls`."""

from __future__ import annotations

import math

import typer
from rich.table import Table

from gpufeed.cli.console import command_group, counted, echo, out
from gpufeed.config import Settings, human_bytes

app = command_group(help="Inspect and manage the node cache.", no_args_is_help=True)


@app.command()
def stats() -> None:
    """Size, blocks, hits, misses, bytes fetched and repairs of the running agent; exit 1 when
    none runs (a look at the cache leaves no agent behind, as `agent status` and `metrics`)."""
    from gpufeed.cli.metrics import running_agent

    info = running_agent(Settings.from_env()).stats(start=False)
    table = Table(box=None, show_header=False)
    reads = info.hits + info.misses
    rows = [
        ("cache dirs", ", ".join(info.dirs)),
        ("size", f"{human_bytes(info.bytes)} of {human_bytes(info.limit)} (quota {human_bytes(info.quota)})"),
        ("blocks", str(info.blocks)),
        ("hits", f"{info.hits}" + (f" ({info.hits / reads:.1%})" if reads else "")),
        ("misses", str(info.misses)),
        ("bytes fetched", human_bytes(info.bytes_fetched)
         + (f" ({human_bytes(info.direct_bytes)} by readers, past the cache)" if info.direct_bytes else "")),
        ("repairs", str(info.repairs)),
        ("evictions", str(info.evictions)),
        ("served uncached", str(info.uncached)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    out.print(table)


@app.command()
def clear() -> None:
    """Drop every cached block (sources are untouched)."""
    from gpufeed.client.connection import AgentClient

    removed = AgentClient(Settings.from_env()).clear()
    out.print(f"cleared {human_bytes(removed)}", highlight=False)


@app.command("ls")
def ls(path: str = typer.Argument("/", help="Namespace path.")) -> None:
    """How much of each file under PATH is cached."""
    from gpufeed.client import Client

    files = total = cached = 0
    for item, present in Client().cached_bytes(path):
        files += 1
        total += item.size
        cached += present
        echo(f"{_share(present, item.size):>7}  {item.size:>12}  {item.path}")
    echo(f"{_share(cached, total):>7}  {total:>12}  total ({counted(files, 'file')}, {human_bytes(cached)} cached)")


def _share(part: int, whole: int) -> str:
    """`part` of `whole` as a percentage rounded down: 100.0% only when all of it is cached."""
    return "100.0%" if part >= whole else f"{math.floor(part / whole * 1000) / 10:.1f}%"
