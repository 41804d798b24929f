"""Data-aware placement: among the nodes that fit a lease, put first the node whose gpufeed agent
holds most of the job's dataset cached.

The cache cluster knows: every agent publishes each mount's bytes and cached bytes with its
heartbeat (`agent.mounts.MountCoverage`, seconds old). The scheduler reads them once a second
(`read_cache_map`) and maps each Ray node to its agent: by the marker resource that
`gpufeed gpu resources` declares (`inventory.agent_marker`), else by the one agent that advertises
the Ray node's address. A dataset is a namespace path; its cached fraction on a node counts the
mounts at or under it, or the mount that holds it (per-mount granularity: a dataset inside a
mount is placed by that mount's fraction).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from gpufeed.cluster.membership import members
from gpufeed.pool import inventory
from gpufeed.pool.ledger import Lease, NodeOrder, Request

CachedFractions = Callable[[str], Mapping[str, float]]


def cached_first(cached: CachedFractions) -> NodeOrder:
    """A node order that ranks nodes by the cached fraction of the request's dataset, keeping
    the packing order among equals; requests naming no dataset keep the packing order."""

    def order(request: Request, nodes: Sequence[str]) -> Sequence[str]:
        if not request.dataset:
            return nodes
        fractions = cached(request.dataset)
        return sorted(nodes, key=lambda node: -fractions.get(node, 0.0))

    return order


def dataset_fraction(mounts: Mapping[str, Sequence[int]], dataset: str) -> float | None:
    """The cached fraction of `dataset` from one agent's (bytes, cached bytes) per mount; None
    when no mount holds it."""
    dataset = "/" + dataset.strip("/")
    inside = [counts for path, counts in mounts.items() if dataset == "/" or path == dataset or path.startswith(dataset + "/")]
    if not inside:
        holders = sorted((path for path in mounts if dataset.startswith(path.rstrip("/") + "/")), key=len)
        inside = [mounts[holders[-1]]] if holders else []
    if not inside:
        return None
    total = sum(int(c[0]) for c in inside)
    return sum(int(c[1]) for c in inside) / total if total else 0.0


@dataclass
class CacheMap:
    """What the cluster's agents hold, by Ray node: the agent's name and its mounts' counts."""

    agents: dict[str, str] = field(default_factory=dict)
    """Ray node id → the agent's node id in the cache cluster."""
    mounts: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    """Ray node id → mount path → [bytes, cached bytes]."""

    def cached(self, dataset: str) -> dict[str, float]:
        fractions = {}
        for node, mounts in self.mounts.items():
            fraction = dataset_fraction(mounts, dataset)
            if fraction is not None:
                fractions[node] = fraction
        return fractions

    def reason(self, lease: Lease, clustered: bool) -> str:
        """Why a lease naming a dataset sits where it does, in one line for `gpu status`."""
        dataset = lease.request.dataset
        if not clustered:
            return f"{dataset}: no cache cluster to ask (the pool started without GPUFEED_CLUSTER); placed by GPU fit"
        fractions = self.cached(dataset)
        chosen = lease.placements[0].node
        if not any(fractions.get(node, 0.0) > 0 for node in lease.candidates):
            return f"{dataset}: cached on no node that fits ({len(lease.candidates)}); placed by GPU fit"
        line = f"{dataset}: {fractions.get(chosen, 0.0):.0%} cached on {self.name(chosen)}"
        others = [f"{self.name(n)} {fractions.get(n, 0.0):.0%}" for n in lease.candidates if n != chosen][:3]
        return line + (f" (others that fit: {', '.join(others)})" if others else " (the only node that fits)")

    def name(self, node: str) -> str:
        return self.agents.get(node) or f"ray node {node[:8]}"


async def read_cache_map(redis: aioredis.Redis, ray_nodes: Sequence[Mapping[str, Any]]) -> CacheMap:
    """The cluster's live agents matched to the alive Ray nodes (`ray.nodes()` entries)."""
    agents = await members(redis)
    by_digest = {inventory.agent_digest(a["id"]): a for a in agents}
    by_host: dict[str, list[dict[str, Any]]] = {}
    for member in agents:
        by_host.setdefault(str(member.get("address", "")).rsplit(":", 1)[0], []).append(member)
    hosts = [str(n.get("NodeManagerAddress", "")) for n in ray_nodes]
    found = CacheMap()
    for node in ray_nodes:
        digest = inventory.marked_agent(node.get("Resources", {}))
        host = str(node.get("NodeManagerAddress", ""))
        agent = by_digest.get(digest) if digest else None
        if agent is None and digest is None and hosts.count(host) == 1 and len(by_host.get(host, [])) == 1:
            agent = by_host[host][0]
        if agent is not None:
            found.agents[node["NodeID"]] = agent["id"]
            found.mounts[node["NodeID"]] = dict(agent.get("mounts", {}))
    return found
