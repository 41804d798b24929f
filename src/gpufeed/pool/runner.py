"""Ray actors that hold a lease on its node: `JobRunner` runs a command there, `Hosted` keeps a
callable or model there for `remote`. Each books the lease's GPU resources inside the lease's
placement group, so the lease lives exactly as long as the actor: when its owner (the `gpufeed gpu
run` process, or the Python driver) dies, Ray kills the actor, frees the resources, and the
scheduler's watch on `held` fails at once and frees the lease."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import ray

from gpufeed.pool import launcher
from gpufeed.pool.codec import pack, unpack
from gpufeed.pool.watchdog import Watchdog

_actor: Any = ray.remote  # Ray's stubs reject concurrency_groups

JOB_GROUPS = {"watch": 1, "control": 1}
"""`held` waits in "watch" for the whole job; "control" takes `stop` while `run` streams."""
HOSTED_GROUPS = {"watch": 1}


@_actor(num_cpus=0, concurrency_groups=JOB_GROUPS)
class JobRunner:
    """Runs one command for one lease on this node and streams its output back."""

    def __init__(self, lease_id: str, scheduler: Any, idle_timeout: float, grace: float) -> None:
        self.lease_id, self.scheduler, self.idle_timeout, self.grace = lease_id, scheduler, idle_timeout, grace
        self.done = threading.Event()
        self.reason = ""
        self.proc: Any = None

    def node(self) -> tuple[str, str]:
        """(node id, address) of the node this runner is on."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def run(self, argv: list[str], env: dict[str, str], cwd: str, gpus: list[tuple[int, float, int, int]]) -> Iterator[Any]:
        """Runs `argv` in `env` plus the lease on this node's `gpus` (index, share, leased bytes, GPU
        bytes each); yields its output in chunks of whole lines, then `{"exit": code, "reason": why stopped}`."""
        env = env | launcher.lease_env(gpus, env.get("PYTHONPATH", ""))
        tell = None
        try:
            tell = launcher.guard(self.grace)
            self.proc = launcher.spawn(argv, env, cwd, tell)
        except Exception as exc:  # no such command, a NUL in its arguments, no reaper: the job ends here
            if tell is not None:
                launcher.release(tell)
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            self.reason = f"cannot start {argv[0]!r}: {why}"
            self.done.set()
            yield {"exit": 127, "reason": self.reason}
            return
        proc, dog = self.proc, None
        try:
            if self.reason:  # stopped (another rank failed) while this one was starting
                launcher.stop(proc, self.grace)
            dog = Watchdog(proc.pid, [g[0] for g in gpus], max(g[2] for g in gpus), self.idle_timeout, self._report, self._stop)
            dog.start()
            for line in launcher.output(proc, self.grace):  # noqa: UP028 - a generator Ray streams: no `yield from`
                yield line
            code = proc.wait()
        finally:
            if dog is not None:
                dog.finished.set()
            try:
                launcher.stop(proc, self.grace)  # its processes left behind too: the lease ends with them
            finally:
                launcher.release(tell)
                self.done.set()
        yield {"exit": code, "reason": self.reason}

    def _report(self, idle: float, memory_used: int) -> None:
        self.scheduler.report.remote(self.lease_id, idle, memory_used)

    @ray.method(concurrency_group="control")
    def stop(self, reason: str) -> None:
        """End the command (SIGTERM, then SIGKILL after the grace period), saying why; one not
        started yet is ended as it starts."""
        self._stop(reason)

    def _stop(self, reason: str) -> None:
        if self.done.is_set():
            return  # ended and reaped: its group id may be another's by now
        self.reason = self.reason or reason
        if self.proc is not None:  # its main process may have exited, leaving processes of its group
            launcher.stop(self.proc, self.grace)

    @ray.method(concurrency_group="watch")
    def held(self) -> str:
        """Returns when the command has ended (why, if it was stopped); fails if this actor dies."""
        self.done.wait()
        return self.reason


@_actor(num_cpus=0, concurrency_groups=HOSTED_GROUPS)
class Hosted:
    """A callable (a function, or a model: any object with `__call__`) kept on a leased GPU."""

    def __init__(self, target: Any, env: dict[str, str]) -> None:
        """`env`: the lease's variables, set before anything here initialises CUDA (unpickling
        `target` may import torch, never initialise CUDA on its own)."""
        os.environ.update(env)
        launcher.cap_this_process()
        self.target = target
        self.closed = threading.Event()

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return pack(self.target(*unpack(args), **{k: unpack(v) for k, v in kwargs.items()}))

    def call_packed(self, packed: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        """`call` as a compiled graph's one input (`remote(..., compiled=True)`)."""
        return self.call(*packed)

    def method(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return pack(getattr(self.target, name)(*unpack(args), **{k: unpack(v) for k, v in kwargs.items()}))

    def env(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k.startswith(("CUDA_", "GPUFEED_"))}

    def close(self) -> None:
        self.closed.set()

    @ray.method(concurrency_group="watch")
    def held(self) -> str:
        self.closed.wait()
        return ""

