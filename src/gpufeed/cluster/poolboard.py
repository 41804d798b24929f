"""The GPU pool's status board in the cache cluster's Redis: how the node agent's dashboard shows
a pool without importing Ray.

The pool's scheduler (a Ray actor) publishes what `gpufeed gpu status` shows every second to
`gpufeed:pool:{pool}`; any agent of the same cache cluster reads every pool's board for its
dashboard. The key expires TTL_S seconds after the last publish, so a stopped scheduler's pool
disappears from the page on its own, with nothing to clean up.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis.asyncio as aioredis

log = logging.getLogger("gpufeed.agent")

KEY = "gpufeed:pool:{pool}"
POOLS = "gpufeed:pools"
"""The names of the pools that ever published: a reader asks for those boards only (no SCAN over
a Redis database that may also hold millions of metadata keys)."""
TTL_S = 10


async def publish(redis: aioredis.Redis, pool: str, status: dict[str, Any]) -> None:
    """Write `pool`'s status (GPUs, leases, queue, teams, idle timeout) with the time it was
    taken; it expires unless published again within TTL_S seconds."""
    board = {"pool": pool, "time": time.time(), **status}
    async with redis.pipeline(transaction=False) as pipe:
        pipe.sadd(POOLS, pool)
        pipe.set(KEY.format(pool=pool), json.dumps(board), ex=TTL_S)
        await pipe.execute()


async def read(redis: aioredis.Redis) -> list[dict[str, Any]]:
    """Every live pool's board, sorted by pool name. A board that does not parse (another
    writer, another version) is skipped, so one bad key cannot hide the others; the name of a
    pool whose board expired is forgotten."""
    names = sorted(str(name) for name in await redis.smembers(POOLS))
    if not names:
        return []
    boards, gone = [], []
    for name, raw in zip(names, await redis.mget([KEY.format(pool=name) for name in names]), strict=True):
        if raw is None:
            gone.append(name)
            continue
        try:
            board = json.loads(raw)
        except ValueError:
            log.debug("pool board %s: not JSON, skipped", name)
            continue
        if isinstance(board, dict) and isinstance(board.get("pool"), str):
            boards.append(board)
    if gone:
        await redis.srem(POOLS, *gone)
    return boards
