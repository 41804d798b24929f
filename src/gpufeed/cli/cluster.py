"""`gpufeed cluster status`: the cache cluster's members as its Redis knows them."""

from __future__ import annotations

import typer
from rich.table import Table

from gpufeed.cli.console import command_group, counted, out, print_json
from gpufeed.config import Settings, human_bytes
from gpufeed.errors import GpufeedError, InvalidArgument

app = command_group(help="The cache cluster: nodes that share what they cached.", no_args_is_help=True)


@app.command()
def status(
    cluster: str | None = typer.Option(
        None, "--cluster", help="The cluster's Redis (default: the one this node's agent was started in) [env: GPUFEED_CLUSTER]."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the members as one JSON document."),
) -> None:
    """Nodes, addresses, cache use, hit ratio and each node's share of the cluster's store and
    peer traffic (exit 1 when no node is live)."""
    import asyncio

    from redis.exceptions import RedisError

    from gpufeed.cluster.membership import status as members

    url = cluster or _this_nodes_cluster()
    if not url:
        raise InvalidArgument(
            "no cluster: give --cluster redis://HOST:PORT/DB, set GPUFEED_CLUSTER, "
            "or run 'gpufeed agent start --cluster' here first"
        )
    try:
        nodes = asyncio.run(members(url))
    except (RedisError, OSError) as exc:
        raise GpufeedError(f"cluster {url.rsplit('@', 1)[-1]}: {exc}") from None
    total_store = sum(node.get("store_bytes", 0) for node in nodes) or 1
    total_served = sum(node.get("served_bytes", 0) for node in nodes) or 1
    for node in nodes:
        lookups = node.get("hits", 0) + node.get("misses", 0)
        node["hit_ratio"] = node.get("hits", 0) / lookups if lookups else None
        node["store_share"] = node.get("store_bytes", 0) / total_store
        node["served_share"] = node.get("served_bytes", 0) / total_served
    if as_json:
        print_json(nodes)
    else:
        table = Table("node", "address", "weight", "cache", "hit ratio", "from store", "from peers", "served", "load share",
                      box=None)
        for node in nodes:
            ratio = node["hit_ratio"]
            table.add_row(
                node["id"], node.get("address", "?"), f"{node.get('weight', 1):g}",
                f"{human_bytes(node.get('cache_bytes', 0))} of {human_bytes(node.get('limit', 0))}",
                "-" if ratio is None else f"{ratio:.1%}", human_bytes(node.get("store_bytes", 0)),
                human_bytes(node.get("peer_bytes", 0)), human_bytes(node.get("served_bytes", 0)), f"{node['served_share']:.0%}",
            )
        out.print(f"cluster {url.rsplit('@', 1)[-1]}: {counted(len(nodes), 'live node')}", highlight=False)
        out.print(table)
    if not nodes:
        raise typer.Exit(1)


def _this_nodes_cluster() -> str | None:
    """GPUFEED_CLUSTER, else the cluster `gpufeed agent start --cluster` put this node's agent in."""
    from gpufeed.client import agent_service

    settings = Settings.from_env()
    return settings.cluster or agent_service.flag(agent_service.remembered(settings.cache_dirs[0]) or [], "--cluster")
