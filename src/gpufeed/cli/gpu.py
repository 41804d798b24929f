"""`gpufeed gpu run|status|resources`: the GPU pool on a Ray cluster (the `pool` extra).

`run` waits in the pool's queue with a status line on stderr, runs the command under the lease
(its output on stdout), releases the lease and exits with the command's code.
"""

from __future__ import annotations

import math
import signal
import time
from typing import Any

import typer

from gpufeed.cli.console import command_group, err, out, print_json
from gpufeed.config import Settings, cluster_node_id, human_bytes, parse_size
from gpufeed.errors import InvalidArgument, PoolError

app = command_group(help="Share, queue and reclaim GPUs on a Ray cluster.", no_args_is_help=True)

ADDRESS = typer.Option(None, "--address", help="Ray cluster HOST:PORT [env: RAY_ADDRESS; default: the one on this machine]")
POOL = typer.Option("default", "--pool", help="Which pool on the cluster (one scheduler each).")


@app.command("run", context_settings={"allow_interspersed_args": False})
def run(
    command: list[str] = typer.Argument(..., help="The command to run under the lease, after --."),
    gpu: float = typer.Option(1.0, "--gpu", help="Share of one GPU (0.5), or a whole number of GPUs on one node (2)."),
    mem: str = typer.Option("", "--mem", help="GPU memory per GPU, e.g. 20GiB [default: the share's part of the GPU]"),
    team: str = typer.Option("default", "--team", help="Team whose quota the lease counts against."),
    priority: int = typer.Option(0, "--priority", help="Higher is served first; FIFO within a priority."),
    nodes: int = typer.Option(1, "--nodes", min=1, help="Run on this many nodes (one process each, DDP environment set)."),
    dataset: str = typer.Option(
        "", "--dataset", help="Namespace path the job reads: placed on the fitting node that holds most of it cached."
    ),
    address: str | None = ADDRESS,
    pool: str = POOL,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No queue status on stderr; errors still print."),
) -> None:
    """Run COMMAND on a pooled GPU lease: `gpufeed gpu run --gpu 0.5 --mem 20GiB -- python train.py`."""
    from gpufeed.paths import normalize
    from gpufeed.pool.client import connect
    from gpufeed.pool.client import run as run_leased
    from gpufeed.pool.ledger import Request

    if not math.isfinite(gpu) or gpu <= 0:
        raise InvalidArgument(f"--gpu {gpu:g}: expected a share > 0 (0.5 is half a GPU, 2 is two GPUs)")
    request = Request(gpu, parse_size(mem, "--mem") if mem else 0, team, priority, nodes, normalize(dataset) if dataset else "")
    connect(address)
    terminated = _interrupt_on_sigterm()
    waiting = _Waiting(request, quiet)
    try:
        outcome = run_leased(command, request, pool, on_wait=waiting)
    except KeyboardInterrupt:
        if terminated:
            raise _terminated() from None
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the job is over: a SIGTERM now just ends this process
    if terminated:
        raise _terminated()
    if outcome.reason:
        stopped = PoolError(f"lease {outcome.lease['lease_id']}: {outcome.reason} (exit {outcome.exit_code})")
        stopped.exit_code = outcome.exit_code or 1  # the command's own (127: not found, 143: stopped), as a shell's
        raise stopped
    raise typer.Exit(outcome.exit_code)


def _interrupt_on_sigterm() -> list[int]:
    """SIGTERM (a batch scheduler cancelling the job, `kill`) ends `gpu run` as Ctrl-C does: the
    job stopped, the lease released. Ray's connect put its own handler there, which printed a
    C++ stack dump and exited 1. Returns the list the handler notes the signal in."""
    received: list[int] = []

    def interrupt(signum: int, frame: Any) -> None:
        received.append(signum)
        if len(received) == 1:  # a second one, during the clean-up the first began, must not cut it short
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    return received


def _terminated() -> PoolError:
    stopped = PoolError("gpu run: terminated (SIGTERM): its request and job were ended")
    stopped.exit_code = 128 + signal.SIGTERM  # as a shell's command killed by it
    return stopped


class _Waiting:
    """The queue status line: when the position changes, else every progress interval."""

    def __init__(self, request: Any, quiet: bool) -> None:
        self.quiet, self.started, self.last, self.shown = quiet, time.monotonic(), 0.0, ""
        self.interval = Settings.from_env().progress_interval
        memory = f", {human_bytes(request.memory)}" if request.memory else ""
        self.what = f"{request.share:g} GPU{memory} x {request.nodes} node(s), team {request.team}, priority {request.priority}"

    def __call__(self, state: dict[str, Any]) -> None:
        line = f"gpu run: queued for {self.what}: position {state['position']} of {state['queued']}, {state['why']}"
        now = time.monotonic()
        if self.quiet or (line == self.shown and now - self.last < self.interval):
            return
        self.shown, self.last = line, now
        err.print(f"{line}, {now - self.started:.0f} s", highlight=False, markup=False, soft_wrap=True)


@app.command("status")
def status(
    address: str | None = ADDRESS,
    pool: str = POOL,
    as_json: bool = typer.Option(False, "--json", help="Print GPUs, leases, queue and teams as one JSON object."),
) -> None:
    """GPUs (free share and memory), leases (idle time), the queue and each team's use."""
    from gpufeed.pool.client import check_pool, connect
    from gpufeed.pool.client import status as pool_status

    connect(address)
    check_pool(pool)
    state = pool_status(pool)
    if as_json:
        print_json(state, indent=2)
        return
    _table(state)


def _table(state: dict[str, Any]) -> None:
    from rich.table import Table

    gpus = Table("node", "gpu", "memory", "free share", "free memory", "leases", title="GPUs", title_justify="left")
    for g in state["gpus"]:
        gpus.add_row(g["node"][:12], str(g["index"]), human_bytes(g["memory"]), f"{g['free_share']:g}",
                     human_bytes(g["free_memory"]), " ".join(g["leases"]) or "-")
    leases = Table("lease", "team", "priority", "gpus", "memory", "used", "age", "idle", "placed", title="Leases",
                   title_justify="left")
    for ls in state["leases"]:
        where = " ".join(f"{p['node'][:8]}:{p['index']}@{p['share']:g}" for p in ls["placements"])
        memory = human_bytes(sum(p["memory"] for p in ls["placements"]))
        age, idle = f"{ls['age']:.0f} s", f"{ls['idle_seconds']:.0f} s"
        used = human_bytes(ls["memory_used"]) if ls["memory_used"] else "-"
        placed = ls["reason"] or "by GPU fit"
        leases.add_row(ls["lease_id"], ls["team"], str(ls["priority"]), where, memory, used, age, idle, placed)
    queue = Table("pos", "team", "priority", "gpu", "nodes", "waiting", "why", title="Queue", title_justify="left")
    for w in state["queue"]:
        waited = f"{w['waiting']:.0f} s"
        queue.add_row(str(w["position"]), w["team"], str(w["priority"]), f"{w['share']:g}", str(w["nodes"]), waited, w["why"])
    teams = Table("team", "in use", "quota", "waiting", title="Teams", title_justify="left")
    for name, t in sorted(state["teams"].items()):
        teams.add_row(name, f"{t['in_use']:g}", "-" if t["quota"] is None else f"{t['quota']:g}", str(t["waiting"]))
    for table in (gpus, leases, queue, teams):
        out.print(table)


@app.command("resources")
def resources(
    fake_gpus: int = typer.Option(0, "--fake-gpus", help="Declare this many fake GPUs (0, the default: ask NVML)."),
    fake_gpu_mem: str = typer.Option("80GiB", "--fake-gpu-mem", help="Memory of each fake GPU."),
    agent_node: str = typer.Option(
        "", "--agent-node", help="This node's agent's id in the cache cluster [default: as the agent derives it]"
    ),
) -> None:
    """This node's GPUs as Ray resources, for `ray start --resources "$(gpufeed gpu resources)"`;
    with the node's cache-cluster agent named, data-aware placement finds the node's cache."""
    from gpufeed.pool import inventory

    gpus = inventory.fake(fake_gpus, parse_size(fake_gpu_mem, "--fake-gpu-mem")) if fake_gpus else inventory.detect()
    if not gpus:
        raise PoolError("no GPU found (no NVIDIA driver or no nvidia-ml-py); declare fake ones with --fake-gpus N")
    agent = agent_node or cluster_node_id(Settings.from_env())
    print_json(inventory.resources(gpus) | (inventory.agent_marker(agent) if agent else {}))

