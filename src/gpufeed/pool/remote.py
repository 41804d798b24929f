"""`remote(fn_or_module)`: run a callable or model on a pooled GPU from any machine in the Ray
cluster, even one without a GPU. The target lives in a `Hosted` actor on the leased node (its
environment carries the lease: `CUDA_VISIBLE_DEVICES`, the PyTorch memory cap); each call is one
actor call, arguments and results through Ray's object store; CPU torch tensors travel as numpy
arrays (`codec.CpuTensor`), which Ray moves without pickling. The lease lasts until `close()` or this process exits.
"""

from __future__ import annotations

import contextlib
from typing import Any

from gpufeed.config import parse_size
from gpufeed.pool.client import Granted, _ray, lease
from gpufeed.pool.codec import pack, unpack
from gpufeed.pool.ledger import Request


class Remote:
    """A handle on a hosted callable: call it like the original; `.method(name, ...)` for others."""

    def __init__(self, actor: Any, stack: contextlib.ExitStack, granted: Granted, graph: Any = None) -> None:
        self._actor, self._stack, self.lease, self._graph = actor, stack, granted.lease, graph

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        packed = (pack(args), {k: pack(v) for k, v in kwargs.items()})
        if self._graph is not None:
            return unpack(_ray().get(self._graph.execute(packed)))
        return unpack(_ray().get(self._actor.call.remote(*packed)))

    def method(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return unpack(_ray().get(self._actor.method.remote(name, pack(args), {k: pack(v) for k, v in kwargs.items()})))

    def env(self) -> dict[str, str]:
        """The hosted side's CUDA_* and GPUFEED_* variables (what the lease set up)."""
        return dict(_ray().get(self._actor.env.remote()))

    def close(self) -> None:
        """Release the lease (the actor ends)."""
        self._stack.close()

    def __enter__(self) -> Remote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remote(
    target: Any,
    gpu: float = 0.25,
    mem: str | int = 0,
    team: str = "default",
    priority: int = 0,
    pool: str = "default",
    compiled: bool = False,
) -> Remote:
    """Host `target` (a function or an object with `__call__`, e.g. a torch module) on a lease of
    `gpu` of one GPU and `mem` bytes (or a size such as "4GiB"); waits in the queue if needed.

    `compiled`: calls go through a Ray compiled graph (shared-memory channels set up once, about a
    quarter of an actor call's cost on loopback) instead of one actor task each; a call must then
    finish within Ray's compiled-graph timeout (`RAY_CGRAPH_get_timeout`, 10 s), and calls are one
    at a time per handle."""
    from gpufeed.pool.client import connect
    from gpufeed.pool.runner import Hosted

    connect()
    memory = parse_size(mem, "mem") if isinstance(mem, str) else mem
    stack = contextlib.ExitStack()
    try:
        granted = stack.enter_context(lease(Request(gpu, memory, team, priority), pool))
        node = granted.nodes[0]
        actor = Hosted.options(  # type: ignore[attr-defined]
            resources=granted.bundle(node),
            scheduling_strategy=granted.strategy(0),
        ).remote(target, granted.actor_env(node))
        stack.callback(_ray().kill, actor)
        _ray().get(granted.sched.started.remote(granted.lease["lease_id"], [actor]))
        graph = _compile(actor) if compiled else None
        if graph is not None:
            stack.callback(graph.teardown)
    except BaseException:
        stack.close()
        raise
    return Remote(actor, stack, granted, graph)


def _compile(actor: Any) -> Any:
    from ray.dag import InputNode

    with InputNode() as packed:
        graph = actor.call_packed.bind(packed)
    return graph.experimental_compile()
