"""An agent as a member of a cache cluster: registration and heartbeat in the cluster's Redis,
its peers as the first source of blocks (`peers.PeerBlocks`), and its peer API (`peer_server`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from gpufeed import errors
from gpufeed.agent.peer_server import PeerServer
from gpufeed.agent.peers import PeerBlocks, load_token, peer_tls
from gpufeed.cluster import poolboard
from gpufeed.cluster.membership import HEARTBEAT_S, Membership, check_url
from gpufeed.cluster.ownership import Node
from gpufeed.config import Settings, cluster_node_id, parse_addr

if TYPE_CHECKING:
    from gpufeed.agent.fetcher import Fetcher
    from gpufeed.agent.metrics import Metrics


class ClusterNode:
    """This agent as a member of a cache cluster: its registration and heartbeat, its peers as
    the first source of blocks, and its peer API."""

    def __init__(self, settings: Settings, fetcher: Fetcher, dirs: tuple[Path, ...], metrics: Metrics,
                 capacity: int, stats: Callable[[], dict[str, Any]]) -> None:
        check_url(settings.cluster)  # first: a wrong URL is the mistake to name, not what it lacks
        if not settings.peer_addr:
            raise errors.InvalidArgument("a cluster member needs --peer-addr HOST:PORT (GPUFEED_PEER_ADDR) for its peer API")
        if settings.replicas < 1:
            raise errors.InvalidArgument(f"--replicas {settings.replicas}: must be at least 1")
        token = load_token()
        advertise = settings.advertise or settings.peer_addr
        host, port = parse_addr(advertise, "--advertise")
        if host in ("0.0.0.0", "::"):
            raise errors.InvalidArgument(f"--advertise {advertise}: give an address the other nodes can reach")
        self.bind = parse_addr(settings.peer_addr, "--peer-addr")
        me = Node(cluster_node_id(settings), f"{host}:{port}", settings.node_weight, capacity)
        self.membership = Membership(settings.cluster, me, stats)
        tls = peer_tls(settings)
        self.blocks = PeerBlocks(self.membership, settings.replicas, token, metrics, tls[1] if tls else None)
        self.server = PeerServer(fetcher, dirs, token, metrics, tls[0] if tls else None)
        fetcher.chain.insert(0, self.blocks)
        self._beating: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            await self.server.start(*self.bind)
        except OSError as exc:
            raise errors.GpufeedError(f"--peer-addr {self.bind[0]}:{self.bind[1]}: {exc.strerror or exc}") from None
        self.blocks.start()
        try:
            await self.membership.join()
        except (RedisError, OSError) as exc:
            await self.stop()
            raise errors.GpufeedError(f"cluster {self.membership.where}: {exc}") from None
        self._beating = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self.membership.beat()

    async def pools(self) -> list[dict[str, Any]]:
        """The GPU pools' status boards in this cluster's Redis, for the dashboard (/pool.json)."""
        return await poolboard.read(self.membership.redis)

    async def stop(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            await self.membership.leave()
        await self.server.stop()
        await self.blocks.close()
