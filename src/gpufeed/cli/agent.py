"""`gpufeed agent` (foreground service) and `gpufeed agent start|stop|status`."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

import typer

from gpufeed.client.connection import AgentClient, connect, stop_agent
from gpufeed.agent.manager import AgentConfig
from gpufeed.agent.service import run_agent
from gpufeed.cli.console import human_bytes, out
from gpufeed.config import Settings, parse_size

app = typer.Typer(help="The node agent that owns the cache dir.", invoke_without_command=True)

DirsOption = typer.Option([], "--cache-dir", help="Cache dir (repeatable); default $GPUFEED_HOME/cache.")
SizeOption = typer.Option(None, "--cache-size", help="Quota, e.g. 200GiB; always bounded by free space.")


def _settings(cache_dir: list[Path], cache_size: Optional[str]) -> Settings:
    settings = Settings.from_env()
    changes: dict = {}
    if cache_dir:
        changes["cache_dirs"] = tuple(d.expanduser().absolute() for d in cache_dir)
    if cache_size:
        changes["cache_size"] = parse_size(cache_size, "--cache-size")
    return dataclasses.replace(settings, **changes)


@app.callback()
def agent(
    ctx: typer.Context,
    cache_dir: list[Path] = DirsOption,
    cache_size: Optional[str] = SizeOption,
    idle_timeout: Optional[float] = typer.Option(None, "--idle-timeout", help="Exit after this many seconds without clients."),
) -> None:
    """Run the agent in the foreground (a service), or manage one with a subcommand."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = _settings(cache_dir, cache_size)
        return
    settings = _settings(cache_dir, cache_size)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    config = AgentConfig(settings.cache_dirs, settings.cache_size, settings.cache_free_ratio, idle_timeout)
    run_agent(config, settings)


@app.command()
def start(ctx: typer.Context) -> None:
    """Start a background agent (no idle timeout) unless one is running."""
    settings: Settings = ctx.obj
    if (sock := connect(settings.cache_dirs[0])) is not None:
        sock.close()
        out.print(f"an agent already serves {settings.cache_dirs[0]}", highlight=False)
        return
    agent = AgentClient(settings)
    agent.start(None).close()
    info = agent.stats(start=False)
    out.print(f"agent {info.pid} serving {', '.join(info.dirs)}", highlight=False)


@app.command()
def stop(ctx: typer.Context) -> None:
    """Stop the agent for the cache dir; readers fall back or start a new one on demand."""
    settings: Settings = ctx.obj
    pid = stop_agent(settings)
    primary = settings.cache_dirs[0]
    out.print(f"stopped agent {pid} for {primary}" if pid else f"no agent running for {primary}", highlight=False)


@app.command()
def status(ctx: typer.Context) -> None:
    """Show the running agent (exit 1 when none runs)."""
    settings: Settings = ctx.obj
    primary = settings.cache_dirs[0]
    if (sock := connect(primary)) is None:
        out.print(f"no agent running for {primary}", highlight=False)
        raise typer.Exit(1)
    sock.close()
    info = AgentClient(settings).stats()
    out.print(
        f"agent {info.pid} serving {', '.join(info.dirs)}: {info.blocks} blocks, "
        f"{human_bytes(info.bytes)} of {human_bytes(info.limit)}, {info.clients} clients, "
        f"up {info.uptime_s:.0f} s",
        highlight=False,
    )
