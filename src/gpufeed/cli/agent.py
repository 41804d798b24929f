"""`gpufeed agent` (foreground service) and `gpufeed agent start|stop|status`.

--cache-dir, --cache-size, --metrics-addr and --log-format are accepted before the subcommand
and after it (`agent start --cache-size 200GiB` is how people type it); after it wins."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from gpufeed.cli.console import command_group, counted, err, out
from gpufeed.config import Settings, human_bytes, parse_addr, parse_log_format, parse_quota, with_cluster_flags
from gpufeed.errors import GpufeedError

if TYPE_CHECKING:
    from gpufeed.rpc.messages import AgentInfo

app = command_group(help="The node agent that owns the cache dir.", invoke_without_command=True)

DirsOption = typer.Option([], "--cache-dir", help="Cache dir (repeatable); default $GPUFEED_HOME/cache.")
SizeOption = typer.Option(None, "--cache-size", help="Quota, e.g. 200GiB; always bounded by free space.")
MetricsOption = typer.Option(
    None, "--metrics-addr", help="Serve Prometheus metrics on HOST:PORT (PORT alone: 127.0.0.1); default off."
)
LogFormatOption = typer.Option(None, "--log-format", help="text (default) or json: one JSON object per line.")
ClusterOption = typer.Option(
    None, "--cluster", help="Join the cache cluster whose Redis this is (redis://HOST:PORT/DB) [env: GPUFEED_CLUSTER]."
)
PeerAddrOption = typer.Option(None, "--peer-addr", help="HOST:PORT the peer API binds (with --cluster) [env: GPUFEED_PEER_ADDR].")
AdvertiseOption = typer.Option(None, "--advertise", help="HOST:PORT other nodes reach the peer API at (default: --peer-addr).")
ReplicasOption = typer.Option(None, "--replicas", help="Owners per block (1; 2 fails over without the store).")
WeightOption = typer.Option(None, "--weight", help="This node's share of block ownership relative to others (1).")


@dataclass(frozen=True)
class Asked:
    """The command line's --cache-dir and --cache-size, which a running agent is compared with:
    it keeps the settings it started with."""

    cache_dirs: tuple[Path, ...] = ()
    cache_size: str | None = None
    metrics_addr: str | None = None
    log_format: str | None = None
    cluster: tuple[tuple[str, str | None], ...] = ()
    """Cluster flags as given: (flag, text or None)."""

    def over(self, earlier: Asked) -> Asked:
        return Asked(
            self.cache_dirs or earlier.cache_dirs,
            self.cache_size or earlier.cache_size,
            self.metrics_addr or earlier.metrics_addr,
            self.log_format or earlier.log_format,
            tuple((flag, text if text is not None else dict(earlier.cluster).get(flag)) for flag, text in self.cluster)
            or earlier.cluster,
        )

    def settings(self) -> Settings:
        settings = Settings.from_env()
        changes: dict[str, Any] = {}
        if self.cache_dirs:
            changes["cache_dirs"] = tuple(d.expanduser().absolute() for d in self.cache_dirs)
        if self.cache_size:
            changes["cache_size"] = parse_quota(self.cache_size, "--cache-size")
        if self.metrics_addr:
            parse_addr(self.metrics_addr)
            changes["metrics_addr"] = self.metrics_addr
        if self.log_format:
            changes["log_format"] = parse_log_format(self.log_format)
        return with_cluster_flags(dataclasses.replace(settings, **changes), dict(self.cluster))


def _asked(
    ctx: typer.Context,
    cache_dir: list[Path],
    cache_size: str | None = None,
    metrics_addr: str | None = None,
    log_format: str | None = None,
    cluster: tuple[tuple[str, str | None], ...] = (),
) -> Asked:
    return Asked(tuple(cache_dir), cache_size, metrics_addr, log_format, cluster).over(ctx.obj)


def _cluster(cluster: str | None, peer_addr: str | None, advertise: str | None, replicas: str | None,
             weight: str | None) -> tuple[tuple[str, str | None], ...]:
    return (("--cluster", cluster), ("--peer-addr", peer_addr), ("--advertise", advertise), ("--replicas", replicas),
            ("--weight", weight))


def _differences(asked: Asked, settings: Settings, hello: AgentInfo) -> list[str]:
    """What the command line asked for that the running agent does not have. Its metrics
    address and cluster flags are those `agent start` gave it; an agent a reader started on
    demand has its reader's, which are not known here, so asking for any differs."""
    from gpufeed.client import agent_service
    from gpufeed.client.connection import agent_command

    differ = []
    if asked.cache_size and hello.quota != settings.cache_size:
        differ.append(f"--cache-size {human_bytes(settings.cache_size)}")
    dirs = [str(d) for d in settings.cache_dirs]
    if asked.cache_dirs and hello.dirs != dirs:
        differ.append(f"--cache-dir {' '.join(dirs)}")
    running = agent_service.remembered(settings.cache_dirs[0])
    wanted = agent_command(settings, None)
    given = [("--metrics-addr", asked.metrics_addr)] + [(flag, text) for flag, text in asked.cluster]
    for name, text in given:
        value = agent_service.flag(wanted, name)
        if text is None or value is None:  # not asked for, or of no effect (--peer-addr without --cluster)
            continue
        has = None if running is None else agent_service.flag(running, name)
        if has is None or _setting(name, has) != _setting(name, value):
            differ.append(f"{name} {value}")
    return differ


def _setting(flag: str, value: str) -> object:
    """A flag's value as the agent takes it: `9400` and `127.0.0.1:9400` are one address."""
    return parse_addr(value) if flag in ("--metrics-addr", "--peer-addr", "--advertise") else value


def _already(hello: AgentInfo) -> str:
    return f"an agent already serves {', '.join(hello.dirs)} (pid {hello.pid}, quota {human_bytes(hello.quota)})"


def _serving(hello: AgentInfo) -> str:
    return f"agent {hello.pid} serving {', '.join(hello.dirs)} with a {human_bytes(hello.quota)} quota"


@app.callback()
def agent(
    ctx: typer.Context,
    cache_dir: list[Path] = DirsOption,
    cache_size: str | None = SizeOption,
    idle_timeout: float | None = typer.Option(None, "--idle-timeout", help="Exit after this many seconds without clients."),
    metrics_addr: str | None = MetricsOption,
    log_format: str | None = LogFormatOption,
    cluster: str | None = ClusterOption,
    peer_addr: str | None = PeerAddrOption,
    advertise: str | None = AdvertiseOption,
    replicas: str | None = ReplicasOption,
    weight: str | None = WeightOption,
) -> None:
    """Run the agent in the foreground (a service), or manage one with a subcommand."""
    joins = _cluster(cluster, peer_addr, advertise, replicas, weight)
    asked = Asked(tuple(cache_dir), cache_size, metrics_addr, log_format, joins)
    if ctx.invoked_subcommand is not None:
        ctx.obj = asked
        return
    from gpufeed.agent.manager import AgentConfig  # only the service needs the agent's modules
    from gpufeed.agent.service import run_agent
    from gpufeed.logsetup import configure

    settings = asked.settings()
    configure(settings.log_format, debug=settings.debug)
    config = AgentConfig(settings.cache_dirs, settings.cache_size, settings.cache_free_ratio, idle_timeout)
    run_agent(config, settings)


@app.command()
def start(
    ctx: typer.Context,
    cache_dir: list[Path] = DirsOption,
    cache_size: str | None = SizeOption,
    metrics_addr: str | None = MetricsOption,
    log_format: str | None = LogFormatOption,
    cluster: str | None = ClusterOption,
    peer_addr: str | None = PeerAddrOption,
    advertise: str | None = AdvertiseOption,
    replicas: str | None = ReplicasOption,
    weight: str | None = WeightOption,
) -> None:
    """Start a background agent (no idle timeout) unless one is running; fails when one runs
    with another quota, dirs, metrics address or cluster settings than the flags ask for. A
    reader that finds it gone (killed) starts it again with these settings (`agent_service`)."""
    from gpufeed.client import agent_service
    from gpufeed.client.connection import AGENT_ENTRY, AgentClient, agent_command, connect, node_start_lock

    joins = _cluster(cluster, peer_addr, advertise, replicas, weight)
    asked = _asked(ctx, cache_dir, cache_size, metrics_addr, log_format, joins)
    settings = asked.settings()
    agent = AgentClient(settings)
    # one start at a time per node: of two at once (every rank running it), the second finds
    # the first one's agent and compares its settings, instead of both saying they started theirs
    running = connect(settings.cache_dirs[0])  # one already serving: no lock to take (a read-only home)
    with contextlib.nullcontext() if running is not None else node_start_lock(settings.cache_dirs[0]):
        if (sock := running or connect(settings.cache_dirs[0])) is not None:
            sock.close()
            hello = agent.stats(start=False)
            if differ := _differences(asked, settings, hello):
                raise GpufeedError(f"{_already(hello)}, not {' and '.join(differ)}: stop it first with 'gpufeed agent stop'")
            advice = "to change its settings, stop it first with 'gpufeed agent stop'"
            out.print(f"{_already(hello)}; {advice}", highlight=False, soft_wrap=True)
            return
        agent_service.forget(settings.cache_dirs[0])  # a service that died: these flags replace its own
        agent.start(None).close()
        agent_service.remember(settings.cache_dirs[0], agent_command(settings, None)[len(AGENT_ENTRY) :])
    where = ""
    if settings.metrics_addr:
        host, port = parse_addr(settings.metrics_addr)
        where = f"; metrics on http://{host}:{port}/metrics"
    out.print(_serving(agent.stats(start=False)) + where, highlight=False, soft_wrap=True)
    readers = Settings.from_env().cache_dirs[0].absolute()
    if settings.cache_dirs[0].absolute() != readers:  # an agent is found by its first dir: readers would start their own
        dirs = ":".join(str(d) for d in settings.cache_dirs)
        err.print(
            f"note: readers here use the agent of {readers}, not this one; set GPUFEED_CACHE_DIRS={dirs} "
            "for them (and for 'gpufeed agent stop') to use it"
        )


@app.command()
def stop(ctx: typer.Context, cache_dir: list[Path] = DirsOption) -> None:
    """Stop the agent for the cache dir; readers fall back or start a new one on demand."""
    from gpufeed.client.connection import stop_agent

    settings = _asked(ctx, cache_dir).settings()
    pid = stop_agent(settings)
    primary = settings.cache_dirs[0]
    out.print(f"stopped agent {pid} for {primary}" if pid else f"no agent running for {primary}", highlight=False, soft_wrap=True)


@app.command()
def status(ctx: typer.Context, cache_dir: list[Path] = DirsOption) -> None:
    """Show the running agent (exit 1 when none runs)."""
    from gpufeed.client.connection import AgentClient, connect

    settings = _asked(ctx, cache_dir).settings()
    primary = settings.cache_dirs[0]
    if (sock := connect(primary)) is None:
        out.print(f"no agent running for {primary}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    sock.close()
    info = AgentClient(settings).stats()
    out.print(
        f"{_serving(info)}: {counted(info.blocks, 'block')}, {human_bytes(info.bytes)} of {human_bytes(info.limit)}, "
        f"{counted(info.clients - 1, 'client')}, up {info.uptime_s:.0f} s",  # not this command's own connection
        highlight=False,
        soft_wrap=True,
    )
