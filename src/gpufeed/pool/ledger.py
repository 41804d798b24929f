"""Lease bookkeeping Ray lacks: which GPU a lease packs onto by share and memory, the queue
(priorities, FIFO within a priority), per-team quotas. Pure data, no Ray: the scheduler actor
owns one `Ledger` and is the only writer, so its state needs no locking and tests run it alone.

Order: the queue is served by priority (higher first), then by arrival. A request that does not
fit for lack of capacity stops the scan, so nothing behind it overtakes it (no backfill: FIFO
within a priority holds, and a big job is not starved by a stream of small ones). A request over
its team's quota waits without blocking other teams.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpufeed.pool.inventory import Gpu

EPSILON = 1e-6
SHARE_STEPS = 10_000
"""Ray counts a custom resource in steps of 0.0001: a finer share cannot be asked of it."""


@dataclass(frozen=True)
class Request:
    """What a job asks for: `share` of one GPU (0 < share <= 1) or a whole number of GPUs on one
    node; `memory` bytes per GPU (0: the share's part of the GPU's memory); `nodes` > 1 asks for
    the same on that many distinct nodes (aggregation)."""

    share: float
    memory: int = 0
    team: str = "default"
    priority: int = 0
    nodes: int = 1
    dataset: str = ""

    @property
    def gpus_per_node(self) -> int:
        return max(1, int(self.share)) if self.share >= 1 else 1

    @property
    def share_per_gpu(self) -> float:
        return 1.0 if self.share >= 1 else self.share

    @property
    def gpu_total(self) -> float:
        """GPUs this request holds in all, what a team quota counts."""
        return self.share * self.nodes


@dataclass(frozen=True)
class Placement:
    """One GPU's part of a lease."""

    node: str
    index: int
    share: float
    memory: int


@dataclass
class Lease:
    lease_id: str
    ticket: int
    request: Request
    placements: list[Placement]
    granted_at: float
    started_at: float = 0.0
    idle_seconds: float = 0.0
    memory_used: int = 0
    candidates: list[str] = field(default_factory=list)
    """The nodes that fitted when it was granted, best first (the placement's reason names them)."""
    reason: str = ""
    """Why it was placed where it is, when that was a choice (data-aware placement)."""


@dataclass
class _Waiting:
    ticket: int
    request: Request
    submitted_at: float


# A placement hook reorders the nodes that fit a request, best first (`placement.py`); without one,
# the nodes whose GPUs would be left fullest come first (packing keeps whole GPUs free).
NodeOrder = Callable[[Request, Sequence[str]], Sequence[str]]


@dataclass
class Ledger:
    """GPUs, the queue and the leases of one pool; `quotas` caps each named team's GPUs in use."""

    quotas: dict[str, float] = field(default_factory=dict)
    order: NodeOrder | None = None
    gpus: dict[tuple[str, int], Gpu] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    queue: list[_Waiting] = field(default_factory=list)
    _tickets: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def set_gpus(self, gpus: Sequence[Gpu]) -> None:
        """The cluster's GPUs now (nodes come and go; leases on a gone node stay until released)."""
        self.gpus = {g.key: g for g in gpus}

    def check(self, request: Request) -> str | None:
        """Why `request` can never be granted on this cluster, or None."""
        if not math.isfinite(request.share) or request.share <= 0:
            return f"--gpu {request.share:g}: expected a share > 0 (0.5 is half a GPU, 2 is two GPUs)"
        if request.share > 1 and not float(request.share).is_integer():
            return f"--gpu {request.share:g}: above 1 a lease takes whole GPUs (2, not 1.5)"
        if request.share < 1 and abs(request.share * SHARE_STEPS - round(request.share * SHARE_STEPS)) > 1e-6:
            return f"--gpu {request.share:g}: a share is counted in steps of {1 / SHARE_STEPS:g} (Ray's resource precision)"
        if request.nodes < 1:
            return f"--nodes {request.nodes}: expected at least 1"
        if not self.gpus:
            return "the Ray cluster declares no GPUs (start nodes with `--resources \"$(gpufeed gpu resources)\"`)"
        per_node: dict[str, list[Gpu]] = {}
        for gpu in self.gpus.values():
            per_node.setdefault(gpu.node, []).append(gpu)
        most = max(len(g) for g in per_node.values())
        if request.gpus_per_node > most:
            return f"--gpu {request.share:g}: no node has {request.gpus_per_node} GPUs (the most on one node is {most})"
        if request.nodes > len(per_node):
            return f"--nodes {request.nodes}: the cluster has {len(per_node)} node(s) with GPUs"
        biggest = max(g.memory for g in self.gpus.values())
        if request.memory > biggest:
            return f"--mem {_gib(request.memory)}: more than the largest GPU's memory ({_gib(biggest)})"
        holding = sum(1 for gpus in per_node.values() if sum(g.memory >= request.memory for g in gpus) >= request.gpus_per_node)
        if request.nodes > holding:
            memory = f" of {_gib(request.memory)}" if request.memory else ""
            return (f"--nodes {request.nodes} --gpu {request.share:g}: only {holding} node(s) have {request.gpus_per_node} "
                    f"GPUs{memory} (a lease takes the same on each node)")
        team_quota = self.quotas.get(request.team)
        if team_quota is not None and request.gpu_total > team_quota + EPSILON:
            return f"--gpu {request.share:g}: team {request.team!r} may use at most {team_quota:g} GPUs"
        return None

    def submit(self, request: Request, now: float | None = None) -> int:
        ticket = next(self._tickets)
        self.queue.append(_Waiting(ticket, request, time.time() if now is None else now))
        self.queue.sort(key=lambda w: (-w.request.priority, w.ticket))
        return ticket

    def drop(self, ticket: int) -> None:
        """A waiting request goes away (its job ended before a grant)."""
        self.queue = [w for w in self.queue if w.ticket != ticket]

    def release(self, lease_id: str) -> Lease | None:
        return self.leases.pop(lease_id, None)

    def position(self, ticket: int) -> int | None:
        """1 for the head of the queue; None when not waiting."""
        for i, waiting in enumerate(self.queue):
            if waiting.ticket == ticket:
                return i + 1
        return None

    def team_usage(self) -> dict[str, float]:
        usage: dict[str, float] = {}
        for lease in self.leases.values():
            usage[lease.request.team] = usage.get(lease.request.team, 0.0) + sum(p.share for p in lease.placements)
        return usage

    def schedule(self, now: float | None = None) -> list[Lease]:
        """Grant what fits, in queue order; returns the new leases."""
        granted = []
        usage = self.team_usage()
        for waiting in list(self.queue):
            request = waiting.request
            quota = self.quotas.get(request.team)
            if quota is not None and usage.get(request.team, 0.0) + request.gpu_total > quota + EPSILON:
                continue
            fitted = self._fit(request)
            if fitted is None:
                break
            placements, ranked = fitted
            granted_at = time.time() if now is None else now
            lease = Lease(f"L{waiting.ticket}", waiting.ticket, request, placements, granted_at, candidates=ranked)
            self.leases[lease.lease_id] = lease
            self.queue.remove(waiting)
            usage[request.team] = usage.get(request.team, 0.0) + request.gpu_total
            granted.append(lease)
        return granted

    def free(self) -> dict[tuple[str, int], tuple[float, int]]:
        """Free (share, memory bytes) per GPU."""
        free = {key: (1.0, gpu.memory) for key, gpu in self.gpus.items()}
        for lease in self.leases.values():
            for p in lease.placements:
                if (p.node, p.index) in free:
                    share, memory = free[(p.node, p.index)]
                    free[(p.node, p.index)] = (share - p.share, memory - p.memory)
        return free

    def _fit(self, request: Request) -> tuple[list[Placement], list[str]] | None:
        """Best fit: on each node the GPUs that would be left fullest; then nodes in the hook's order.
        Returns the placements and every node that fitted, best first."""
        free = self.free()
        per_node: dict[str, list[Placement]] = {}
        for node in {gpu.node for gpu in self.gpus.values()}:
            fits = []
            for (gpu_node, index), (share, memory) in free.items():
                need = request.memory or int(self.gpus[(gpu_node, index)].memory * request.share_per_gpu)
                if gpu_node == node and share + EPSILON >= request.share_per_gpu and memory >= need:
                    fits.append((share - request.share_per_gpu, index, need))
            fits.sort()
            if len(fits) >= request.gpus_per_node:
                per_node[node] = [Placement(node, i, request.share_per_gpu, m) for _, i, m in fits[: request.gpus_per_node]]
        if len(per_node) < request.nodes:
            return None
        ranked = sorted(per_node, key=lambda n: (sum(free[(n, p.index)][0] for p in per_node[n]), n))
        if self.order is not None:
            ranked = list(self.order(request, ranked))
        return [p for node in ranked[: request.nodes] for p in per_node[node]], ranked


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.1f}GiB"
