"""`gpufeed metrics`: the running agent's metrics in Prometheus' text format, asked over the
agent's own socket, so it works whether or not the agent serves --metrics-addr."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpufeed.cli.console import write_stdout
from gpufeed.config import Settings
from gpufeed.errors import GpufeedError

if TYPE_CHECKING:
    from gpufeed.client.connection import AgentClient


def running_agent(settings: Settings) -> AgentClient:
    """A client of the agent for the settings' cache dir; never starts one (a view of an agent
    must not start it). Raises one line when none runs."""
    from gpufeed.client.connection import AgentClient, connect

    primary = settings.cache_dirs[0]
    sock = connect(primary)
    if sock is None:
        raise GpufeedError(f"no agent running for {primary} (start one with 'gpufeed agent start', or read through gpufeed)")
    sock.close()
    return AgentClient(settings)


def metrics() -> None:
    """Print the running agent's metrics (Prometheus text format); exit 1 when none runs."""
    from gpufeed.rpc.messages import Metrics, MetricsText

    text = running_agent(Settings.from_env()).request(Metrics(), MetricsText, start=False).text
    write_stdout(text, flush=True)
