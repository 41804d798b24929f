"""The client side of the pool: connect to Ray, ask the scheduler for a lease, book it in Ray
(a placement group pinned to the granted nodes), run the job in the lease's actors, release.

Used by `gpufeed gpu run` / `status` and by `remote`. The placement group and the actors are
owned by this process, so if it dies (even by kill -9) Ray removes them and the lease with them.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO

from gpufeed.errors import InvalidArgument, PoolError
from gpufeed.pool import inventory, launcher
from gpufeed.pool.ledger import Request

WaitCallback = Callable[[dict[str, Any]], None]


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise PoolError("the GPU pool needs Ray: pip install 'gpufeed[pool]'") from None
    return ray


def connect(address: str | None = None) -> None:
    """Join the Ray cluster at `address` (else `RAY_ADDRESS`, else the one started on this machine)."""
    ray = _ray()
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    if target != "auto" and not target.startswith("ray://"):
        reachable(target)
    try:
        ray.init(address=target, namespace=_namespace(), log_to_driver=False, logging_level=logging.WARNING)
    except ConnectionError as exc:
        where = f"at {target}" if target != "auto" else "running on this machine (and RAY_ADDRESS is not set)"
        raise PoolError(f"no Ray cluster {where}: {exc}".rstrip(". ") + "; start one with: ray start --head "
                        "--resources \"$(gpufeed gpu resources)\"") from None


def reachable(address: str, option: str = "--address") -> None:
    """Fail fast, in one line, where `ray.init` would retry an absent head for minutes."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not host:
        raise InvalidArgument(f"{option} {address!r}: expected HOST:PORT of a Ray cluster's head, e.g. 127.0.0.1:6379")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
    except OSError as exc:
        raise PoolError(f"no Ray cluster at {address}: {exc.strerror or exc}") from None


def _namespace() -> str:
    from gpufeed.pool.scheduler import NAMESPACE

    return NAMESPACE


def scheduler(
    pool: str = "default", quotas: dict[str, float] | None = None, idle_timeout: float | None = None, cluster: str | None = None
) -> Any:
    """The pool's scheduler actor, created (detached) by the first client that asks. `quotas`,
    `idle_timeout` and `cluster` (the cache cluster's Redis, which data-aware placement reads)
    apply only when this call creates it; defaults come from the environment."""
    from gpufeed.config import Settings
    from gpufeed.pool.scheduler import NAMESPACE, PoolScheduler, actor_name

    settings = Settings.from_env()
    return PoolScheduler.options(  # type: ignore[attr-defined]
        name=actor_name(pool), namespace=NAMESPACE, lifetime="detached", get_if_exists=True
    ).remote(
        dict(settings.pool_quotas) if quotas is None else quotas,
        settings.pool_idle_timeout if idle_timeout is None else idle_timeout,
        cluster=settings.cluster if cluster is None else cluster,
        pool=pool,
    )


def status(pool: str = "default") -> dict[str, Any]:
    return dict(_ray().get(scheduler(pool).status.remote()))


def check_pool(pool: str) -> None:
    """PoolError unless `pool` exists or is the default one, which any request makes: a look at
    a misspelt pool (`gpu status --pool`) must not leave a scheduler of that name running for good."""
    from gpufeed.pool.scheduler import NAMESPACE, actor_name

    ray = _ray()
    if pool == "default":
        return
    try:
        ray.get_actor(actor_name(pool), namespace=NAMESPACE)
    except ValueError:
        prefix = actor_name("")
        pools = sorted(a["name"].removeprefix(prefix) for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["namespace"] == NAMESPACE and a["name"].startswith(prefix))
        raise PoolError(f"no pool {pool!r} on this Ray cluster (pools: {', '.join(pools) or 'none yet'}); "
                        "a job's 'gpu run --pool NAME' makes it") from None


@dataclass
class Granted:
    """A booked lease: its description, its placement group, the scheduler that granted it."""

    lease: dict[str, Any]
    group: Any
    sched: Any

    def bundle(self, node: str) -> dict[str, float]:
        booked: dict[str, float] = {}
        for p in self.lease["placements"]:
            if p["node"] == node:
                booked.update(inventory.booking(p["index"], p["share"], p["memory"]))
        return booked

    @property
    def nodes(self) -> list[str]:
        return list(dict.fromkeys(p["node"] for p in self.lease["placements"]))

    def gpus(self, node: str) -> list[tuple[int, float, int, int]]:
        """(index, share, leased bytes, GPU bytes) of each GPU the lease holds on `node`."""
        return [(p["index"], p["share"], p["memory"], p["gpu_memory"]) for p in self.lease["placements"] if p["node"] == node]

    def actor_env(self, node: str) -> dict[str, str]:
        """The lease's variables for an actor's process (it applies the memory cap itself)."""
        return launcher.lease_env(self.gpus(node), pythonpath=None) | {"GPUFEED_LEASE": self.lease["lease_id"]}

    def strategy(self, rank: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)


@contextmanager
def lease(request: Request, pool: str = "default", on_wait: WaitCallback | None = None, poll: float = 0.2) -> Iterator[Granted]:
    """Wait in the pool's queue for `request`, book it in Ray, and release it on exit."""
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    sched = scheduler(pool)
    reply = ray.get(sched.submit.remote(asdict(request)))
    if "error" in reply:
        raise InvalidArgument(reply["error"])
    ticket = reply["ticket"]
    try:
        while True:
            state = ray.get(sched.poll.remote(ticket))
            if state["state"] == "granted":
                break
            if state["state"] == "gone":
                raise PoolError(f"request {ticket} left the queue: {state['why']}")
            if on_wait is not None:
                on_wait(state)
            time.sleep(poll)
    except BaseException:
        sched.cancel.remote(ticket)
        raise
    granted = Granted(state["lease"], None, sched)
    try:
        nodes = granted.nodes
        granted.group = placement_group(
            [granted.bundle(n) for n in nodes], strategy="PACK", bundle_label_selector=[{"ray.io/node-id": n} for n in nodes]
        )
        while not _ready(ray, granted.group, ticket, sched):
            pass
        yield granted
    finally:
        sched.release.remote(granted.lease["lease_id"])
        if granted.group is not None:
            remove_placement_group(granted.group)


def _ready(ray: Any, group: Any, ticket: int, sched: Any) -> bool:
    """Ray books what the ledger granted; it waits only if something outside the pool holds the
    resources. Keep the ticket alive meanwhile."""
    ready, _ = ray.wait([group.ready()], timeout=1.0)
    if not ready:
        ray.get(sched.poll.remote(ticket))
    return bool(ready)


@dataclass
class Outcome:
    exit_code: int
    reason: str
    lease: dict[str, Any]


def run(
    argv: list[str],
    request: Request,
    pool: str = "default",
    on_wait: WaitCallback | None = None,
    output: BinaryIO | None = None,
    grace: float = 10.0,
) -> Outcome:
    """Run `argv` under a lease: one process per node (`request.nodes` > 1: a DDP environment,
    rank 0's output unprefixed, others' lines prefixed `[rank N]`). Returns its exit code."""
    ray = _ray()
    from gpufeed.pool.runner import JobRunner

    sink = output or sys.stdout.buffer
    with lease(request, pool, on_wait) as granted:
        idle = ray.get(granted.sched.settings.remote())["idle_timeout"]
        runners = [
            JobRunner.options(  # type: ignore[attr-defined]
                resources=granted.bundle(node), scheduling_strategy=granted.strategy(rank)
            ).remote(granted.lease["lease_id"], granted.sched, idle, grace)
            for rank, node in enumerate(granted.nodes)
        ]
        if not ray.get(granted.sched.started.remote(granted.lease["lease_id"], runners)):
            raise PoolError(f"lease {granted.lease['lease_id']} expired before its job started")
        envs = [dict(os.environ) | {"GPUFEED_LEASE": granted.lease["lease_id"]} for _ in granted.nodes]
        if len(runners) > 1:
            _distributed(ray, runners, envs)
        lock = threading.Lock()
        results: list[dict[str, Any]] = [{} for _ in runners]
        failed: list[int] = []
        """Ranks in the order they failed: the first one's exit code is the job's, and the others
        are stopped then (a DDP rank left waiting for a dead peer holds its GPU until NCCL times out)."""

        def ended(rank: int, result: dict[str, Any]) -> None:
            with lock:
                results[rank] = result
                if not result.get("exit"):
                    return
                failed.append(rank)
                if len(failed) > 1 or len(runners) == 1:
                    return
            why = f"stopped: rank {rank} failed ({result.get('reason') or _exit_text(result['exit'])})"
            for other, runner in enumerate(runners):
                if other != rank and not results[other]:
                    runner.stop.remote(why)

        def pump(rank: int) -> None:
            prefix = f"[rank {rank}] ".encode() if rank else b""
            try:
                for ref in runners[rank].run.remote(argv, envs[rank], os.getcwd(), granted.gpus(granted.nodes[rank])):
                    item = ray.get(ref)
                    if isinstance(item, dict):
                        ended(rank, item)
                        continue
                    with lock:
                        sink.write(_prefixed(prefix, item))
                        sink.flush()
            except ray.exceptions.RayError as exc:  # its node was lost, or Ray killed the runner
                ended(rank, {"exit": 1, "reason": f"rank {rank}'s runner was lost ({type(exc).__name__})"})

        threads = [threading.Thread(target=pump, args=(rank,), daemon=True) for rank in range(1, len(runners))]
        for thread in threads:
            thread.start()
        pump(0)
        for thread in threads:
            thread.join()
        for rank, result in enumerate(results):
            if not result:  # its pump failed on something else (the output it wrote to)
                ended(rank, {"exit": 1, "reason": f"rank {rank}'s output was lost"})
        for runner in runners:
            ray.kill(runner)
    first = results[failed[0]] if failed else {"exit": 0}
    code = first.get("exit", 1)
    reason = str(first.get("reason") or next((r["reason"] for r in results if r.get("reason")), ""))
    return Outcome(128 - code if code < 0 else code, reason, granted.lease)


def _prefixed(prefix: bytes, chunk: bytes) -> bytes:
    """Each line of `chunk` behind `prefix` (lines end at newlines only: a progress bar's
    carriage returns stay in its line)."""
    if not prefix:
        return chunk
    lines = chunk.split(b"\n")
    last = lines.pop()  # what follows the last newline: nothing, for a chunk of whole lines
    return b"".join(prefix + line + b"\n" for line in lines) + (prefix + last if last else b"")


def _exit_text(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _distributed(ray: Any, runners: list[Any], envs: list[dict[str, str]]) -> None:
    """The torchrun/DDP variables, one process per node: rank 0's node is the rendezvous."""
    _, master = ray.get(runners[0].node.remote())
    port = ray.get(runners[0].free_port.remote())
    world = len(runners)
    for rank, env in enumerate(envs):
        env.update(
            MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1", NODE_RANK=str(rank), NNODES=str(world),
        )
