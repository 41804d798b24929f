"""`gpufeed gpu` as a user runs it: a killed client frees its lease, bad input is one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import ray
from ray.cluster_utils import Cluster

from gpufeed.bench.children import free_port
from gpufeed.pool import inventory
from gpufeed.pool.client import lease, status
from gpufeed.pool.ledger import Request
from tests.pool.conftest import eventually, running


def gpufeed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpufeed", *args], capture_output=True, text=True, timeout=120)


def test_kill_9_of_a_job_frees_its_lease_and_stops_its_command_and_its_children(cluster: Cluster) -> None:
    """The processes the command started end with it: a DataLoader worker or a rank left
    running would keep the GPU after the lease is freed. (Ray kills the runner's own child, the
    command, with the runner; its children get SIGTERM, here ignored, then SIGKILL.)"""
    job = "trap '' TERM; sleep 150.25 & wait"
    client = subprocess.Popen(
        [sys.executable, "-m", "gpufeed", "gpu", "run", "--address", cluster.address, "--pool", "kill", "--", "sh", "-c", job],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        eventually(lambda: [ls for ls in status("kill")["leases"] if ls["started"]], "the job to start", timeout=60)
        assert eventually(lambda: running("sleep\x00150.25"), "the command's child to run")
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait()
    eventually(lambda: status("kill")["leases"] == [], "the killed job's lease to be freed", timeout=30)
    # a loaded machine: Ray notices the owner's death, the runner exits, the grace period (10 s) passes
    # the job's own command lines, whole: a shell or grep of the marker elsewhere is not the job
    eventually(lambda: not running("sleep\x00150.25\x00") and not running(f"{job}\x00"), "the command and its child to stop",
               timeout=90)


def test_sigterm_of_the_client_stops_the_job_frees_its_lease_and_exits_143(cluster: Cluster) -> None:
    """A batch scheduler cancelling `gpu run` (Slurm's scancel, a pod's deletion) sends SIGTERM:
    one line and 143, as a shell's command killed by it; before, Ray's handler printed a C++
    stack dump and exited 1."""
    client = subprocess.Popen(
        [sys.executable, "-m", "gpufeed", "gpu", "run", "--address", cluster.address, "--pool", "term", "--", "sleep", "140.5"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        eventually(lambda: [ls for ls in status("term")["leases"] if ls["started"]], "the job to start", timeout=60)
        assert eventually(lambda: running("sleep\x00140.5"), "the command to run")
        client.send_signal(signal.SIGTERM)
        _, err = client.communicate(timeout=60)
    finally:
        client.kill()
    assert client.returncode == 143
    assert err.strip() == "gpufeed: error: gpu run: terminated (SIGTERM): its request and job were ended"
    eventually(lambda: status("term")["leases"] == [], "the lease to be freed", timeout=30)
    eventually(lambda: not running("sleep\x00140.5\x00"), "the command to stop", timeout=30)


def test_a_job_ends_with_its_command_not_with_its_background_jobs(cluster: Cluster) -> None:
    """A background process holds the output pipe after the command exits (`tensorboard & train`):
    `gpu run` returns with the command's exit code, and the background process ends with the lease."""
    job = "sleep 62.75 & echo main-exits; exit 3"
    done = subprocess.run(
        [sys.executable, "-m", "gpufeed", "gpu", "run", "--address", cluster.address, "--pool", "bg", "--", "sh", "-c", job],
        capture_output=True, text=True, timeout=45,
    )
    assert (done.returncode, done.stdout) == (3, "main-exits\n"), done.stderr
    eventually(lambda: not running("sleep\x0062.75\x00"), "the background job to end with the lease")


def test_run_waits_in_the_queue_with_a_status_line_then_runs(cluster: Cluster) -> None:
    with lease(Request(1.0, nodes=2), pool="wait"):
        client = subprocess.Popen(
            [sys.executable, "-m", "gpufeed", "gpu", "run", "--address", cluster.address, "--pool", "wait", "--gpu", "0.5",
             "--team", "vision", "--", "echo", "ran"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        eventually(lambda: status("wait")["queue"], "the job to queue")
    out, err = client.communicate(timeout=60)
    assert (client.returncode, out) == (0, "ran\n"), err
    assert "gpu run: queued for 0.5 GPU x 1 node(s), team vision, priority 0: position 1 of 1, waiting for a GPU to free" in err


def test_without_ray_the_pool_commands_say_how_to_get_it() -> None:
    code = "import sys; sys.modules['ray'] = None; from gpufeed.cli.main import run; run()"
    done = subprocess.run([sys.executable, "-c", code, "gpu", "status"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (1, "gpufeed: error: the GPU pool needs Ray: pip install 'gpufeed[pool]'\n")


def test_status_shows_gpus_leases_queue_and_teams(cluster: Cluster) -> None:
    with lease(Request(0.5, team="vision", dataset="/imagenet"), pool="status") as granted:
        # started, as `gpu run` marks it: a granted lease nobody starts expires after 10 s, which
        # two CLI calls on a loaded 2-core machine can take
        assert ray.get(granted.sched.started.remote(granted.lease["lease_id"], []))
        done = gpufeed("gpu", "status", "--json", "--address", cluster.address, "--pool", "status")
        table = gpufeed("gpu", "status", "--address", cluster.address, "--pool", "status")
    state = json.loads(done.stdout)
    assert done.returncode == 0 and set(state) == {"gpus", "leases", "queue", "teams", "idle_timeout", "agents"}
    assert sorted((g["free_share"], g["memory"]) for g in state["gpus"]) == [(0.5, 16 << 30), (1.0, 16 << 30)]
    assert [(ls["team"], ls["share"], ls["started"]) for ls in state["leases"]] == [("vision", 0.5, True)]
    assert state["leases"][0]["reason"].startswith("/imagenet: no cache cluster to ask"), "this pool has no GPUFEED_CLUSTER"
    titles = ("GPUs", "Leases", "Queue", "Teams", "vision", "placed")
    assert table.returncode == 0 and all(title in table.stdout for title in titles)


def test_bad_input_is_one_clear_line(cluster: Cluster) -> None:
    cases = [
        (["--gpu", "0"], 2, "--gpu 0: expected a share > 0"),
        (["--gpu", "nan"], 2, "--gpu nan: expected a share > 0"),
        (["--address", cluster.address, "--gpu", "0.00001"], 2, "--gpu 1e-05: a share is counted in steps of 0.0001"),
        (["--address", cluster.address, "--gpu", "3"], 2, "--gpu 3: no node has 3 GPUs (the most on one node is 1)"),
        (["--address", cluster.address, "--mem", "20GiB"], 2, "--mem 20.0GiB: more than the largest GPU's memory (16.0GiB)"),
        (["--address", f"127.0.0.1:{free_port()}"], 1, "no Ray cluster at 127.0.0.1:"),
    ]
    for args, code, message in cases:
        done = gpufeed("gpu", "run", *args, "--", "true")
        assert (done.returncode, done.stdout) == (code, ""), done.stderr
        assert done.stderr.startswith(f"gpufeed: error: {message}") and done.stderr.count("\n") == 1, done.stderr
    missing = gpufeed("gpu", "run", "--address", cluster.address, "--pool", "missing", "--", "/nonexistent/train")
    assert missing.returncode == 127, "as a shell says a command was not found"
    assert missing.stderr.endswith("cannot start '/nonexistent/train': No such file or directory (exit 127)\n"), missing.stderr
    typo = gpufeed("gpu", "status", "--address", cluster.address, "--pool", "no-such-pool")
    assert typo.returncode == 1 and typo.stderr.startswith("gpufeed: error: no pool 'no-such-pool' on this Ray cluster"), typo
    with pytest.raises(ValueError):  # a look at a misspelt pool leaves no scheduler of that name behind
        ray.get_actor("gpufeed-pool-no-such-pool", namespace="gpufeed")


def test_resources_name_the_nodes_agent_for_data_aware_placement() -> None:
    named = gpufeed("gpu", "resources", "--fake-gpus", "1", "--fake-gpu-mem", "1GiB", "--agent-node", "agent-x")
    assert json.loads(named.stdout) == {"gpufeed_gpu_0": 1.0, "gpufeed_gpu_0_mem": 1024.0} | inventory.agent_marker("agent-x")
    env = {**os.environ, "GPUFEED_CLUSTER": "redis://127.0.0.1:1/0", "GPUFEED_PEER_ADDR": "10.0.0.7:7070"}
    derived = subprocess.run([sys.executable, "-m", "gpufeed", "gpu", "resources", "--fake-gpus", "1"],
                             capture_output=True, text=True, timeout=60, env=env)
    assert inventory.agent_marker(f"{socket.gethostname()}@10.0.0.7:7070").keys() <= json.loads(derived.stdout).keys()
    alone = gpufeed("gpu", "resources", "--fake-gpus", "1")
    assert not [name for name in json.loads(alone.stdout) if name.startswith("gpufeed_agent_")], "no cluster: no agent to name"
