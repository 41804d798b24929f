"""The pool on a real two-node Ray cluster with fake GPUs: packing and queueing, quotas, the
lease environment, idle reclaim, aggregation with a working DDP environment, remote calls."""

from __future__ import annotations

import io
import os
import signal
import sys
from contextlib import ExitStack
from dataclasses import asdict

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from gpufeed.pool import remote
from gpufeed.pool.client import lease, run, scheduler, status
from gpufeed.pool.ledger import Request
from tests.pool.conftest import GIB, eventually, running


def test_two_halves_share_a_gpu_a_whole_takes_the_other_and_a_third_half_queues(cluster: Cluster) -> None:
    with ExitStack() as stack:
        first = stack.enter_context(lease(Request(0.5, team="a"), pool="pack"))
        second = stack.enter_context(lease(Request(0.5, 4 * GIB, team="b"), pool="pack"))
        whole = stack.enter_context(lease(Request(1.0), pool="pack"))
        spots = [(p["node"], p["index"]) for g in (first, second, whole) for p in g.lease["placements"]]
        assert spots[0] == spots[1] != spots[2]
        sched = scheduler("pack")
        ticket = ray.get(sched.submit.remote({"share": 0.5}))["ticket"]
        state = ray.get(sched.poll.remote(ticket))
        assert (state["state"], state["position"]) == ("queued", 1)
        assert [g["free_share"] for g in status("pack")["gpus"]] == [0.0, 0.0]
        stack.pop_all().close()
    granted = eventually(lambda: ray.get(sched.poll.remote(ticket)).get("lease"), "the queued half to be granted")
    ray.get(sched.release.remote(granted["lease_id"]))


def test_a_higher_priority_is_served_first_and_fifo_holds_within_a_priority(cluster: Cluster) -> None:
    sched = scheduler("priority")
    with lease(Request(1.0, nodes=2), pool="priority"):  # both GPUs taken: everything below queues
        tickets = {name: ray.get(sched.submit.remote({"share": 1.0, "priority": p}))["ticket"]
                   for name, p in [("low", 0), ("first high", 5), ("second high", 5)]}
        positions = {name: ray.get(sched.poll.remote(t))["position"] for name, t in tickets.items()}
        assert positions == {"first high": 1, "second high": 2, "low": 3}
    granted = eventually(lambda: [name for name, t in tickets.items() if ray.get(sched.poll.remote(t))["state"] == "granted"],
                         "the two GPUs to be granted again")
    assert sorted(granted) == ["first high", "second high"], "the low priority job waits for the next free GPU"
    assert ray.get(sched.poll.remote(tickets["low"]))["position"] == 1
    for name in granted:
        ray.get(sched.release.remote(ray.get(sched.poll.remote(tickets[name]))["lease"]["lease_id"]))
    low = eventually(lambda: ray.get(sched.poll.remote(tickets["low"])).get("lease"), "the low priority job's turn")
    ray.get(sched.release.remote(low["lease_id"]))


def test_a_team_at_its_quota_waits_while_another_team_runs(cluster: Cluster) -> None:
    sched = scheduler("quota", quotas={"vision": 0.5})
    with lease(Request(0.5, team="vision"), pool="quota"):
        over = ray.get(sched.submit.remote({"share": 0.5, "team": "vision"}))["ticket"]
        with lease(Request(0.5, team="nlp"), pool="quota"):
            state = ray.get(sched.poll.remote(over))
            assert state["state"] == "queued" and "quota of 0.5" in state["why"]
            teams = status("quota")["teams"]
            assert teams["vision"] == {"in_use": 0.5, "waiting": 1, "quota": 0.5} and teams["nlp"]["in_use"] == 0.5
        ray.get(sched.cancel.remote(over))
    assert "at most 0.5 GPUs" in ray.get(sched.submit.remote({"share": 1.0, "team": "vision"}))["error"]


def test_a_job_runs_with_its_lease_in_its_environment(cluster: Cluster) -> None:
    out = io.BytesIO()
    probe = "import os; print(*(os.environ[k] for k in ('CUDA_VISIBLE_DEVICES', 'GPUFEED_GPU_MEM_FRACTION', 'PYTHONPATH')))"
    outcome = run([sys.executable, "-c", probe], Request(0.5, 4 * GIB), pool="env", output=out)
    visible, fraction, path = out.getvalue().decode().split()
    assert (outcome.exit_code, outcome.reason, visible, float(fraction)) == (0, "", "0", 0.25)
    assert path.split(":")[0].endswith("gpufeed/pool/shim")
    assert status("env")["leases"] == []
    failed = run([sys.executable, "-c", "raise SystemExit(3)"], Request(0.5), pool="env", output=io.BytesIO())
    assert failed.exit_code == 3
    killed = run(["sh", "-c", "kill -9 $$"], Request(0.5), pool="env", output=io.BytesIO())
    assert killed.exit_code == 137 and status("env")["leases"] == []
    missing = run(["no-such-command-here"], Request(0.5), pool="env", output=io.BytesIO())
    assert missing.exit_code == 127 and missing.reason.startswith("cannot start 'no-such-command-here'")


class KillsTheRunner(io.BytesIO):
    """An output sink that SIGKILLs the process named by the first line (the job's runner)."""

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if not self.getvalue():
            os.kill(int(data), signal.SIGKILL)
        return super().write(data)


def test_a_lost_runner_frees_the_lease_and_its_command_dies_with_it(cluster: Cluster) -> None:
    job = ["sh", "-c", "echo $PPID; exec sleep 62.5"]  # sh's parent is the runner's worker process
    outcome = run(job, Request(0.5), pool="lost", output=KillsTheRunner())
    assert outcome.exit_code == 1 and outcome.reason.startswith("rank 0's runner was lost")
    eventually(lambda: status("lost")["leases"] == [], "the lost runner's lease to be freed")
    eventually(lambda: not running("62.5"), "the command to die with its runner")


def test_an_idle_lease_is_reclaimed_and_freed(cluster: Cluster) -> None:
    scheduler("idle", idle_timeout=1.0)
    out = io.BytesIO()
    outcome = run(["sh", "-c", "echo started; exec sleep 60"], Request(1.0), pool="idle", output=out, grace=2.0)
    assert out.getvalue() == b"started\n"
    assert "idle for" in outcome.reason and outcome.exit_code == 143
    assert status("idle")["leases"] == []


def test_a_chatty_job_that_ended_is_not_reclaimed_while_its_output_drains(cluster: Cluster) -> None:
    """Output crossed Ray a line at a time (2,400 lines/s here): the job had long ended, its
    lease still held, and the watchdog called it idle and the run failed."""
    scheduler("chatty", idle_timeout=2.0)
    out = io.BytesIO()
    outcome = run(["seq", "1", "300000"], Request(0.5), pool="chatty", output=out)
    assert (outcome.exit_code, outcome.reason) == (0, "")
    assert out.getvalue() == b"".join(b"%d\n" % n for n in range(1, 300001))


def test_a_request_cancelled_as_it_is_granted_frees_its_lease(cluster: Cluster) -> None:
    """Ctrl-C between the grant and the client's next poll: the lease stayed booked for ever."""
    sched = scheduler("cancelled")
    ticket = ray.get(sched.submit.remote(asdict(Request(0.5))))["ticket"]
    eventually(lambda: status("cancelled")["leases"], "the request to be granted")
    ray.get(sched.cancel.remote(ticket))
    assert status("cancelled")["leases"] == []


def test_a_busy_job_is_not_idle(cluster: Cluster) -> None:
    scheduler("busy", idle_timeout=1.0)
    spin = "import time\nend = time.time() + 2.5\nwhile time.time() < end: pass\nprint('done')"
    out = io.BytesIO()
    outcome = run([sys.executable, "-c", spin], Request(0.5), pool="busy", output=out)
    assert (outcome.exit_code, outcome.reason, out.getvalue()) == (0, "", b"done\n")


ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], int(x.item()))
dist.destroy_process_group()
"""


def test_aggregation_across_two_nodes_sets_a_working_ddp_environment(cluster: Cluster) -> None:
    out = io.BytesIO()
    outcome = run([sys.executable, "-c", ALL_REDUCE], Request(1.0, nodes=2), pool="ddp", output=out)
    assert outcome.exit_code == 0, out.getvalue()
    assert sorted(out.getvalue().decode().splitlines()) == ["0 2 0 3", "[rank 1] 1 2 0 3"]
    assert len({p["node"] for p in outcome.lease["placements"]}) == 2


def test_a_rank_that_fails_stops_the_others(cluster: Cluster) -> None:
    """As torchrun does: a DDP rank left waiting for a dead peer holds its GPU until NCCL times out."""
    job = 'if [ "$RANK" = 1 ]; then exit 3; fi; echo waiting; exec sleep 47.25'
    out = io.BytesIO()
    outcome = run(["sh", "-c", job], Request(1.0, nodes=2), pool="ranks", output=out, grace=1.0)
    assert (outcome.exit_code, outcome.reason) == (3, "stopped: rank 1 failed (exited with code 3)")
    assert not running("sleep\x0047.25\x00")


class Doubler:
    def __call__(self, x: int) -> int:
        return 2 * x

    def capped(self) -> bool:
        """The lease's memory cap waits for CUDA to initialise in this process."""
        return any("exec_and_cap" in f.__qualname__ or "install" in f.__qualname__ for f, _ in torch.cuda._queued_calls)


def test_remote_runs_a_callable_on_a_pooled_gpu(cluster: Cluster) -> None:
    with remote(Doubler(), gpu=0.25, mem="2GiB", pool="remote") as hosted:
        assert hosted(21) == 42
        doubled = hosted(torch.arange(3.0))
        assert isinstance(doubled, torch.Tensor) and doubled.tolist() == [0.0, 2.0, 4.0]
        assert hosted.env()["CUDA_VISIBLE_DEVICES"] == "0" and hosted.env()["GPUFEED_GPU_MEM_FRACTION"] == "0.125000"
        assert hosted.method("capped")
        assert [ls["share"] for ls in status("remote")["leases"]] == [0.25]
    eventually(lambda: status("remote")["leases"] == [], "the remote lease to be released")


def test_remote_calls_through_a_compiled_graph(cluster: Cluster) -> None:
    with remote(Doubler(), gpu=0.25, pool="compiled", compiled=True) as hosted:
        assert hosted(21) == 42 and hosted(torch.ones(2)).tolist() == [2.0, 2.0]
        with pytest.raises(TypeError):
            hosted(None)
        assert hosted(1) == 2 and hosted.method("capped")  # other methods still answer beside the graph
    eventually(lambda: status("compiled")["leases"] == [], "the compiled remote lease to be released")
