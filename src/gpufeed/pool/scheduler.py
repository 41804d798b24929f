"""The pool's single owner of lease state: one named, detached Ray actor per pool and cluster.

It learns the GPUs from Ray (the nodes' declared `gpufeed_gpu_*` resources), keeps the `Ledger`
(queue, quotas, packing) and hands out leases; Ray then books them (a placement group pinned to
the chosen nodes) and the lease's actors hold them. It never trusts a polite release alone:
- a waiting request whose client stops polling for `ticket_ttl` seconds is dropped;
- a granted lease is watched through its actors' `held` calls, which fail the moment an actor
  dies (its owner was killed, its node was lost), and end when the job ends;
- a lease granted but never started (client died in between) expires after `ticket_ttl`.

With a cache cluster (`cluster`, its Redis URL), it reads once a second what each node's agent
holds cached and puts a job that names its dataset on the fitting node that holds most of it
(`placement.py`), and publishes its status there for the agents' dashboards (`poolboard`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import Any

import ray
from redis.exceptions import RedisError

from gpufeed.cluster import poolboard
from gpufeed.cluster.membership import connect
from gpufeed.pool import inventory
from gpufeed.pool.ledger import Lease, Ledger, Placement, Request
from gpufeed.pool.placement import CacheMap, cached_first, read_cache_map

log = logging.getLogger("gpufeed.pool")

_actor: Any = ray.remote  # Ray's stubs reject concurrency_groups

NAMESPACE = "gpufeed"
TICK = 0.1


def actor_name(pool: str) -> str:
    return f"gpufeed-pool-{pool}"


@_actor(num_cpus=0)
class PoolScheduler:
    def __init__(
        self, quotas: dict[str, float], idle_timeout: float, ticket_ttl: float = 10.0, cluster: str = "", pool: str = "default"
    ) -> None:
        self.ledger = Ledger(quotas=dict(quotas))
        self.cluster, self.pool = cluster, pool
        self.cache = CacheMap()
        self.ray_nodes: list[dict[str, Any]] = []
        self.cluster_failing = False
        self.exchanged = 0.0
        self.redis: Any = None
        if cluster:
            self.ledger.order = cached_first(lambda dataset: self.cache.cached(dataset))
        self.idle_timeout, self.ticket_ttl = idle_timeout, ticket_ttl
        self.seen: dict[int, float] = {}
        self.released: dict[int, str] = {}
        self.refreshed = 0.0
        self.loop: asyncio.Task[None] | None = None
        self.watches: set[asyncio.Task[None]] = set()

    def settings(self) -> dict[str, Any]:
        return {"quotas": self.ledger.quotas, "idle_timeout": self.idle_timeout, "cluster": bool(self.cluster)}

    async def submit(self, request: dict[str, Any]) -> dict[str, Any]:
        """`{"ticket": n}`, or `{"error": why}` when the request can never be granted here."""
        self._start()
        self._refresh(force=True)
        parsed = Request(**request)
        error = self.ledger.check(parsed)
        if error:
            return {"error": error}
        if parsed.dataset and self.cluster:
            await self._exchange()  # place by what is cached now, not by a view up to a second old
        ticket = self.ledger.submit(parsed)
        self.seen[ticket] = time.monotonic()
        self._tick()
        return {"ticket": ticket}

    async def poll(self, ticket: int) -> dict[str, Any]:
        """Where a request stands: queued (position, why), granted (the lease) or gone (why)."""
        self.seen[ticket] = time.monotonic()
        self._tick()
        position = self.ledger.position(ticket)
        if position is not None:
            return {"state": "queued", "position": position, "queued": len(self.ledger.queue), "why": self._why(ticket)}
        for lease in self.ledger.leases.values():
            if lease.ticket == ticket:
                return {"state": "granted", "lease": _lease_dict(lease, self.ledger)}
        return {"state": "gone", "why": self.released.get(ticket, "unknown ticket")}

    async def started(self, lease_id: str, actors: list[Any]) -> bool:
        """The lease's actors hold it now; watch them. False if the lease is gone already."""
        lease = self.ledger.leases.get(lease_id)
        if lease is None:
            return False
        lease.started_at = time.time()
        for actor in actors:
            task = asyncio.get_running_loop().create_task(self._watch(lease_id, actor))
            self.watches.add(task)
            task.add_done_callback(self.watches.discard)
        return True

    async def release(self, lease_id: str, reason: str = "released") -> None:
        self._release(lease_id, reason)
        self._tick()

    async def cancel(self, ticket: int) -> None:
        """The client gives up on `ticket`: queued, or granted in the moment before it heard so."""
        self.ledger.drop(ticket)
        self.seen.pop(ticket, None)
        for lease in list(self.ledger.leases.values()):
            if lease.ticket == ticket and not lease.started_at:
                self._release(lease.lease_id, "cancelled before it started")
        self._tick()

    async def report(self, lease_id: str, idle_seconds: float, memory_used: int = 0) -> None:
        """A lease's watchdog: seconds idle, GPU memory its processes use (NVML; 0 without)."""
        lease = self.ledger.leases.get(lease_id)
        if lease is not None:
            lease.idle_seconds, lease.memory_used = idle_seconds, memory_used

    async def status(self) -> dict[str, Any]:
        self._start()
        self._refresh(force=True)
        self._tick()
        return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        now = time.time()
        free = self.ledger.free()
        gpus = [
            {
                "node": g.node,
                "index": g.index,
                "memory": g.memory,
                "free_share": round(free[g.key][0], 6),
                "free_memory": free[g.key][1],
                "leases": [lid for lid, ls in self.ledger.leases.items() if g.key in {(p.node, p.index) for p in ls.placements}],
            }
            for g in sorted(self.ledger.gpus.values(), key=lambda g: g.key)
        ]
        leases = [_lease_dict(ls, self.ledger) | {"age": now - ls.granted_at} for ls in self.ledger.leases.values()]
        queue = [
            asdict(w.request)
            | {"ticket": w.ticket, "waiting": now - w.submitted_at, "position": i + 1, "why": self._why(w.ticket)}
            for i, w in enumerate(self.ledger.queue)
        ]
        teams: dict[str, dict[str, Any]] = {}
        for team, used in self.ledger.team_usage().items():
            teams.setdefault(team, {"in_use": 0.0, "waiting": 0})["in_use"] = round(used, 6)
        for w in self.ledger.queue:
            teams.setdefault(w.request.team, {"in_use": 0.0, "waiting": 0})["waiting"] += 1
        for team, info in teams.items():
            info["quota"] = self.ledger.quotas.get(team)
        return {"gpus": gpus, "leases": leases, "queue": queue, "teams": teams, "idle_timeout": self.idle_timeout,
                "agents": dict(self.cache.agents)}

    def _why(self, ticket: int) -> str:
        usage = self.ledger.team_usage()
        for waiting in self.ledger.queue:
            quota = self.ledger.quotas.get(waiting.request.team)
            over = quota is not None and usage.get(waiting.request.team, 0.0) + waiting.request.gpu_total > quota + 1e-6
            if waiting.ticket == ticket:
                return f"team {waiting.request.team!r} at its quota of {quota:g} GPUs" if over else "waiting for a GPU to free"
        return ""

    async def _watch(self, lease_id: str, actor: Any) -> None:
        try:
            reason = await actor.held.remote()
        except Exception as exc:  # the actor died: its owner was killed or its node was lost
            reason = f"holder died ({type(exc).__name__})"
        self._release(lease_id, reason or "job ended")
        self._tick()

    def _release(self, lease_id: str, reason: str) -> None:
        lease = self.ledger.release(lease_id)
        if lease is not None:
            self.released[lease.ticket] = reason
            self.seen.pop(lease.ticket, None)

    def _start(self) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop().create_task(self._background())

    async def _background(self) -> None:
        while True:
            self._refresh()
            if self.cluster and time.monotonic() - self.exchanged >= 1.0:
                await self._exchange()
            self._tick()
            await asyncio.sleep(TICK)

    async def _exchange(self) -> None:
        """Learn what each node holds cached; publish this pool's status for the dashboards. An
        unreachable cluster keeps the last view (and GPU-fit packing for nodes it never saw)."""
        self.exchanged = time.monotonic()
        if self.redis is None:
            self.redis = connect(self.cluster)  # on the actor's loop, where it is used
        try:
            self.cache = await read_cache_map(self.redis, self.ray_nodes)
            await poolboard.publish(self.redis, self.pool, self._snapshot())
            if self.cluster_failing:
                log.info("cache cluster reachable again")
            self.cluster_failing = False
        except (RedisError, OSError) as exc:
            if not self.cluster_failing:
                log.warning("cache cluster unreachable (%s): placing by the last view", exc)
            self.cluster_failing = True

    def _refresh(self, force: bool = False) -> None:
        """The GPUs, from the alive Ray nodes' declared resources (at most once a second)."""
        if not force and time.monotonic() - self.refreshed < 1.0:
            return
        self.refreshed = time.monotonic()
        gpus = []
        self.ray_nodes = [node for node in ray.nodes() if node.get("Alive")]
        for node in self.ray_nodes:
            gpus.extend(inventory.from_resources(node["NodeID"], node.get("Resources", {})))
        self.ledger.set_gpus(gpus)

    def _tick(self) -> None:
        now = time.monotonic()
        for ticket, seen in list(self.seen.items()):
            if now - seen < self.ticket_ttl:
                continue
            if self.ledger.position(ticket) is not None:
                self.ledger.drop(ticket)
                self.seen.pop(ticket, None)
                self.released[ticket] = f"its client was silent for {self.ticket_ttl:g} s (stopped or gone)"
            else:
                for lease in list(self.ledger.leases.values()):
                    if lease.ticket == ticket and not lease.started_at:
                        self._release(lease.lease_id, "never started (client gone)")
        for lease in self.ledger.schedule():
            self.seen[lease.ticket] = now
            if lease.request.dataset:
                lease.reason = self.cache.reason(lease, bool(self.cluster))


def _lease_dict(lease: Lease, ledger: Ledger) -> dict[str, Any]:
    return {
        "lease_id": lease.lease_id,
        "ticket": lease.ticket,
        "team": lease.request.team,
        "priority": lease.request.priority,
        "dataset": lease.request.dataset,
        "reason": lease.reason,
        "share": lease.request.share,
        "nodes": lease.request.nodes,
        "placements": [asdict(p) | {"gpu_memory": _gpu_memory(ledger, p)} for p in lease.placements],
        "started": bool(lease.started_at),
        "idle_seconds": lease.idle_seconds,
        "memory_used": lease.memory_used,
    }


def _gpu_memory(ledger: Ledger, placement: Placement) -> int:
    gpu = ledger.gpus.get((placement.node, placement.index))
    return gpu.memory if gpu is not None else placement.memory
