"""Who is in the cluster: each agent registers in the cluster's Redis and heartbeats.

Keys under `prefix` (default `gpufeed:cluster`):
  members        sorted set, node id → the Redis server's time of its last heartbeat
  node:{id}      JSON: address, weight, capacity (written on join; expires unless renewed)
  stats:{id}     JSON: what `gpufeed cluster status` shows (cache use, hits, peer traffic) and
                 each mount's bytes and cached bytes (what the GPU pool places jobs by)
  version        counts joins and clean leaves
A heartbeat writes three keys and reads two numbers, (version, live count); only when they
change (a join, a leave, a heartbeat gone stale) does the node read the member list, so Redis's
work grows with the cluster's churn, not with nodes times nodes (docs/CLUSTER.md).

A node whose heartbeat is older than TTL_S seconds is not a member; times come from Redis's
clock, so nodes' clocks need not agree. A node leaving cleanly removes itself at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gpufeed.cluster.ownership import Node
from gpufeed.config import check_redis_url

log = logging.getLogger("gpufeed.agent")

PREFIX = "gpufeed:cluster"
HEARTBEAT_S = 1.0
TTL_S = 4.0


def check_url(url: str) -> None:
    check_redis_url(url, "--cluster (GPUFEED_CLUSTER)")


def connect(url: str) -> aioredis.Redis:
    check_url(url)
    return aioredis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0, decode_responses=True)


class Membership:
    """This node's registration and its view of the others, refreshed every heartbeat."""

    def __init__(self, url: str, me: Node, stats: Callable[[], dict[str, Any]], prefix: str = PREFIX) -> None:
        self.url = url
        self.me = me
        self.stats = stats
        self.prefix = prefix
        self.redis = connect(url)
        self.nodes: list[Node] = [me]
        """The live members, this node included, sorted by id."""
        self._known: dict[str, Node] = {me.id: me}
        self._failing = False
        self._signature: tuple[object, int] | None = None
        """(version, live count) when the member list was last read."""

    async def _now(self) -> float:
        seconds, micros = await self.redis.time()
        return seconds + micros / 1e6

    async def join(self) -> None:
        await self.redis.incr(f"{self.prefix}:version")
        await self._beat()
        log.info("joined cluster %s as %s at %s (%d members)", self.where, self.me.id, self.me.address, len(self.nodes))

    @property
    def where(self) -> str:
        """The cluster's Redis, without any password in its URL."""
        host = self.url.rsplit("@", 1)[-1]
        return host if "://" in host else f"redis://{host}"

    async def _beat(self) -> None:
        now = await self._now()
        me = self.me
        info = json.dumps({"address": me.address, "weight": me.weight, "capacity": me.capacity})
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(f"{self.prefix}:node:{me.id}", info, ex=int(TTL_S * 4))
            pipe.set(f"{self.prefix}:stats:{me.id}", json.dumps({**self.stats(), "time": now}), ex=int(TTL_S * 4))
            pipe.zadd(f"{self.prefix}:members", {me.id: now})
            pipe.zremrangebyscore(f"{self.prefix}:members", "-inf", now - 100 * TTL_S)
            pipe.get(f"{self.prefix}:version")
            pipe.zcount(f"{self.prefix}:members", now - TTL_S, "+inf")
            *_, version, count = await pipe.execute()
        if (version, count) == self._signature:
            return
        self._signature = (version, count)
        live = sorted(str(i) for i in await self.redis.zrangebyscore(f"{self.prefix}:members", now - TTL_S, "+inf"))
        unknown = [i for i in live if i not in self._known]
        if unknown:
            for node_id, raw in zip(unknown, await self.redis.mget([f"{self.prefix}:node:{i}" for i in unknown]), strict=True):
                if raw is not None:
                    fields = json.loads(raw)
                    self._known[node_id] = Node(node_id, fields["address"], fields["weight"], fields["capacity"])
        before = {node.id for node in self.nodes}
        self.nodes = [self._known[i] for i in live if i in self._known]
        after = {node.id for node in self.nodes}
        for gone in before - after:
            self._known.pop(gone, None)
            log.info("cluster: %s left", gone)
        for new in after - before - {me.id}:
            log.info("cluster: %s joined", new)

    async def beat(self) -> None:
        """One heartbeat; an unreachable Redis keeps the last view (peers and the store still serve)."""
        try:
            await self._beat()
            if self._failing:
                log.info("cluster %s reachable again", self.where)
            self._failing = False
        except (RedisError, OSError) as exc:
            if not self._failing:
                log.warning("cluster %s unreachable (%s): keeping the last view of %d members", self.where, exc, len(self.nodes))
            self._failing = True

    async def leave(self) -> None:
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.zrem(f"{self.prefix}:members", self.me.id)
                pipe.incr(f"{self.prefix}:version")
                pipe.delete(f"{self.prefix}:node:{self.me.id}", f"{self.prefix}:stats:{self.me.id}")
                await pipe.execute()
            log.info("left cluster %s", self.where)
        except (RedisError, OSError) as exc:
            log.warning("cluster %s: could not leave (%s); the others drop this node within %.0f s", self.where, exc, TTL_S)
        finally:
            await self.redis.aclose()


async def status(url: str, prefix: str = PREFIX) -> list[dict[str, Any]]:
    """Every live member with its info and stats, for `gpufeed cluster status`."""
    redis = connect(url)
    try:
        return await members(redis, prefix)
    finally:
        await redis.aclose()


async def members(redis: aioredis.Redis, prefix: str = PREFIX) -> list[dict[str, Any]]:
    """`status` on a connection the caller keeps (the GPU pool's scheduler asks every second)."""
    seconds, micros = await redis.time()
    now = seconds + micros / 1e6
    ids = sorted(str(i) for i in await redis.zrangebyscore(f"{prefix}:members", now - TTL_S, "+inf"))
    if not ids:
        return []
    infos = await redis.mget([f"{prefix}:node:{i}" for i in ids])
    stats = await redis.mget([f"{prefix}:stats:{i}" for i in ids])
    return [
        {"id": i, **json.loads(info or "{}"), **{k: v for k, v in json.loads(stat or "{}").items() if k != "time"},
         "heartbeat_age_s": max(0.0, now - json.loads(stat or "{}").get("time", now))}
        for i, info, stat in zip(ids, infos, stats, strict=True)
    ]
