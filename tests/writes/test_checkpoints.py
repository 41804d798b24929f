"""Checkpoints on a writable S3 mount (moto): DCP save, async_save and load through gpufeed, the
commit marker last, retention, an interrupted save never listed, two ranks, torch.save/load, and
kill -9 of the saver and of the agent at 20 random points."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import gpufeed
import gpufeed.torch
from gpufeed.bench.faults import FaultControl
from gpufeed.client.connection import AgentClient
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument, ObjectChanged, PathNotFound, ReadOnlyMount
from gpufeed.namespace import Namespace
from tests.conftest import Bucket
from tests.writes.checkpoint_saver import state
from tests.writes.test_faults import killed, stored
from tests.writes.test_writes import moto_requests

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def quiet_single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@pytest.fixture
def out(bucket: Bucket) -> Bucket:
    Namespace().add_mount("/out", bucket.url, {"endpoint": bucket.endpoint}, writable=True, allow_empty=True)
    return bucket


def zeros_like(saved: dict[str, object]) -> dict[str, object]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in saved.items()}


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a  # type: ignore[arg-type]
    )


def keys(bucket: Bucket, prefix: str) -> list[str]:
    listed = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=prefix)  # type: ignore[attr-defined]
    return sorted(item["Key"] for item in listed.get("Contents", []))


def test_dcp_saves_commit_last_keep_the_last_n_and_restore_from_this_nodes_cache(out: Bucket, server_dir: Path) -> None:
    checkpoints = gpufeed.torch.Checkpoints("/out/run", keep_last=2)
    assert checkpoints.latest() is None and checkpoints.load(zeros_like(state(1))) is None, "a fresh start"
    checkpoints.save(state(1), 1)
    checkpoints.async_save(state(2), 2).result()
    dcp.save(state(3), storage_writer=gpufeed.torch.GpufeedWriter(checkpoints.path(3)))
    checkpoints.prune()
    assert [c.step for c in checkpoints.list()] == [2, 3]
    assert keys(out, "run/step-00000001") == [], "pruned from the store"
    assert [item.path for item in gpufeed.ls("/out/run")] == ["/out/run/step-00000002", "/out/run/step-00000003"]
    assert ".metadata" in {key.rpartition("/")[2] for key in keys(out, "run/step-00000003/")}, "complete in the store"
    loaded = zeros_like(state(3))
    gpufeed._default = None
    assert checkpoints.load(loaded) == 3 and same(loaded, state(3))
    dcp.load(loaded, storage_reader=gpufeed.torch.GpufeedReader("gpufeed:///out/run/step-00000002"))
    assert same(loaded, state(2))
    assert moto_requests(out, server_dir / "moto.log", "PUT", "run/step-", prefix=True) > 0, "the log has this bucket"
    assert moto_requests(out, server_dir / "moto.log", "GET", "run/step-", prefix=True) == 0, "restored from this node's cache"
    with pytest.raises(PathNotFound, match="step-00000001: no complete checkpoint"):
        checkpoints.load(loaded, step=1)


def test_pruning_from_a_local_dir_leaves_no_empty_step_dirs(tmp_path: Path) -> None:
    """A local dir store keeps the dirs its files were in; a pruned step's go with it, whole:
    a file put in a step dir by hand is the step's too, as a checkpoint manager's step dir is
    (Orbax removes it whole)."""
    (tmp_path / "ckpt").mkdir()
    Namespace().add_mount("/local", f"file://{tmp_path / 'ckpt'}", writable=True, allow_empty=True)
    checkpoints = gpufeed.torch.Checkpoints("/local/run", keep_last=2)
    for step in range(1, 5):
        checkpoints.save(state(step), step)
    gpufeed.sync()
    (tmp_path / "ckpt" / "run" / "step-00000003" / "notes.txt").write_text("put there by hand")
    checkpoints.save(state(5), 5)  # prunes step 3
    assert [c.step for c in checkpoints.list()] == [4, 5]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run").iterdir()) == ["step-00000004", "step-00000005"]


def test_a_new_model_and_optimizer_resume_with_the_optimizers_state(out: Bucket) -> None:
    """The README's resume: a fresh process builds its model and optimizer and loads the newest
    checkpoint into them; Adam's moments and step counts come back, so training goes on as if
    never stopped."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    checkpoints = gpufeed.torch.Checkpoints("/out/resume")
    checkpoints.save({"model": model, "optim": optimizer}, 3)
    again = torch.nn.Linear(4, 2)
    resumed = torch.optim.Adam(again.parameters(), lr=0.1)
    assert checkpoints.load({"model": again, "optim": resumed}) == 3
    assert same(again.state_dict(), model.state_dict())
    saved, loaded = optimizer.state_dict()["state"], resumed.state_dict()["state"]
    assert saved.keys() == loaded.keys() == {0, 1}
    assert all(same(saved[k], loaded[k]) for k in saved), "moments and step counts as saved"


def test_a_checkpoint_root_that_cannot_be_written_or_found_is_one_clear_error(out: Bucket, tmp_path: Path) -> None:
    (tmp_path / "ro").mkdir()
    Namespace().add_mount("/ro", f"file://{tmp_path / 'ro'}", allow_empty=True)
    with pytest.raises(ReadOnlyMount, match="mount it with --writable"):
        gpufeed.torch.Checkpoints("/ro/run").save(state(1), 1)
    with pytest.raises(PathNotFound, match="/nope/run: no mount contains this path"):
        gpufeed.torch.Checkpoints("/nope/run").load(zeros_like(state(1)))  # not a fresh start: a typo
    with pytest.raises(InvalidArgument, match="step=-1"):
        gpufeed.torch.Checkpoints("/out/run").save(state(1), -1)


def test_a_load_that_fails_on_a_gpufeed_error_raises_it_not_torchs_wrapper(out: Bucket) -> None:
    """DCP wraps a rank's failure in CheckpointException, a BaseException a training loop's
    `except Exception` lets through; a gpufeed error (here: a shard rewritten at the source
    since the mount listed it, not in the cache) comes out as itself, naming what to do."""
    checkpoints = gpufeed.torch.Checkpoints("/out/run")
    checkpoints.save(state(3), 3)
    shard = next(key for key in keys(out, "run/step-00000003/") if key.endswith(".distcp"))
    out.put(shard, b"rewritten by another job")
    gpufeed.client().agent.clear()
    try:
        checkpoints.load(zeros_like(state(3)))
    except Exception as exc:  # what a training loop catches
        assert isinstance(exc, ObjectChanged), type(exc)
        assert "changed at the source since mount /out was listed" in str(exc) and shard in str(exc)
    else:
        raise AssertionError("a checkpoint whose shard changed loaded")


def test_a_save_that_fails_midway_leaves_no_checkpoint_that_loads(out: Bucket) -> None:
    checkpoints = gpufeed.torch.Checkpoints("/out/run")
    checkpoints.save(state(4), 4)
    checkpoints.save(state(5), 5)
    broken = {**state(6), "step": lambda: 6}  # pickling it fails after the tensors' files are begun
    with pytest.raises(CheckpointException) as raised:
        checkpoints.save(broken, 5)
    assert "Can't pickle" in str(raised.value.failures), "the writer thread's own error reached the caller"
    assert [c.step for c in checkpoints.list()] == [4], "step 5's marker came down before its files were rewritten"
    loaded = zeros_like(state(4))
    assert checkpoints.load(loaded) == 4 and same(loaded, state(4))


def test_async_saves_that_finish_out_of_order_are_all_kept_whole(out: Bucket, moto_faults: FaultControl) -> None:
    """Async saves run at once: a big one begun first finishes after smaller ones begun later.
    A prune after those must leave the one still being saved (it was removed mid-save, then
    listed once its marker landed, and did not load), and prunes finishing together must not
    fail on files the other one removed."""
    Namespace().add_mount("/slow", out.url, {"endpoint": moto_faults.url}, writable=True, allow_empty=True)
    moto_faults.configure(seed=1, rates={"stall": 1.0}, stall=1.0, path_filter="ooo/step-00000000/")
    checkpoints = gpufeed.torch.Checkpoints("/slow/ooo", keep_last=10)
    saving = [checkpoints.async_save(state(step), step) for step in range(4)]
    for future in saving:
        future.result(timeout=120)
    assert [c.step for c in checkpoints.list()] == [0, 1, 2, 3]
    for step in range(4):
        loaded = zeros_like(state(step))
        assert checkpoints.load(loaded, step) == step and same(loaded, state(step)), step
    last_only = gpufeed.torch.Checkpoints("/out/last", keep_last=1)
    for future in [last_only.async_save(state(step), step) for step in range(5)]:
        future.result(timeout=120)
    assert [c.step for c in last_only.list()] == [4]


def test_a_save_below_a_newer_checkpoint_warns_and_the_newer_one_can_be_removed(
    out: Bucket, caplog: pytest.LogCaptureFixture
) -> None:
    """A run rolled back to step 20 from 30: resuming would pick 30, the abandoned run's."""
    checkpoints = gpufeed.torch.Checkpoints("/out/rolled")
    for step in (10, 20, 30):
        checkpoints.save(state(step), step)
    rolled = gpufeed.torch.Checkpoints("/out/rolled")
    rolled.save(state(21), 21)
    assert "/out/rolled: saving step 21 where step 30 is complete" in caplog.text
    rolled.remove(30)
    assert [c.step for c in rolled.list()] == [10, 20, 21] and keys(out, "rolled/step-00000030") == []
    loaded = zeros_like(state(21))
    assert rolled.load(loaded) == 21 and same(loaded, state(21))


OTHER_NODE = """
import sys, torch, gpufeed.torch
from tests.writes.checkpoint_saver import state
checkpoints = gpufeed.torch.Checkpoints("/out/nodes")
print([c.step for c in checkpoints.list()])
loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state(int(sys.argv[1])).items()}
step = checkpoints.load(loaded)
print(step, all(torch.equal(loaded[k], v) for k, v in state(step).items() if isinstance(v, torch.Tensor)))
"""


def test_another_node_without_a_shared_manifest_resumes_from_the_newest_checkpoint(out: Bucket, tmp_path: Path) -> None:
    """A node that listed the mount before the checkpoints were saved read them as none: a
    silent fresh start after a node failure; then, once pruned elsewhere, as steps whose files are gone."""
    env = {**os.environ, "GPUFEED_HOME": str(tmp_path / "other-node"), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
           "PYTHONWARNINGS": "ignore"}
    added = subprocess.run([sys.executable, "-m", "gpufeed", "mount", "add", "/out", out.url, "--opt",
                            f"endpoint={out.endpoint}", "--writable", "--allow-empty"], env=env, capture_output=True, text=True)
    assert added.returncode == 0, added.stderr
    checkpoints = gpufeed.torch.Checkpoints("/out/nodes", keep_last=2)
    try:
        for expected, steps in (("[1, 2]\n2 True\n", (1, 2)), ("[3, 4]\n4 True\n", (3, 4))):
            for step in steps:
                checkpoints.save(state(step), step)
            other = subprocess.run([sys.executable, "-c", OTHER_NODE, str(steps[-1])], env=env, cwd=ROOT,
                                   capture_output=True, text=True, timeout=120)
            assert (other.returncode, other.stdout) == (0, expected), other.stderr[-2000:]
    finally:
        subprocess.run([sys.executable, "-m", "gpufeed", "agent", "stop"], env=env, capture_output=True)


def test_torch_save_and_load_through_a_gpufeed_path(out: Bucket) -> None:
    saved = state(7)
    gpufeed.torch.save(saved, "/out/plain/model.pt", sync=True)
    assert keys(out, "plain/") == ["plain/model.pt"]
    assert same(gpufeed.torch.load("/out/plain/model.pt", weights_only=True), saved)


TWO_RANKS = """
import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp, torch.multiprocessing as mp
import gpufeed.torch

def rank(r, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    g = torch.Generator().manual_seed(r)
    mine = {"shared": torch.arange(1000.0), f"rank{r}": torch.randn(300_000, generator=g)}
    dcp.async_save(mine, storage_writer=gpufeed.torch.GpufeedWriter("/out/ddp/step-00000001")).result()
    back = {k: torch.zeros_like(v) for k, v in mine.items()}
    dist.barrier()
    dcp.load(back, storage_reader=gpufeed.torch.GpufeedReader("/out/ddp/step-00000001"))
    assert all(torch.equal(back[k], mine[k]) for k in mine), r
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.start_processes(rank, args=(int(sys.argv[1]),), nprocs=2, start_method="fork")
    print("ok")
"""


def test_two_ranks_save_one_checkpoint_and_each_loads_its_part(out: Bucket, tmp_path: Path) -> None:
    from tests.conftest import free_port

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0 and done.stdout.split() == ["ok"], done.stderr[-3000:]
    stored_keys = keys(out, "ddp/step-00000001/")
    assert {k.rpartition("/")[2] for k in stored_keys} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}, stored_keys
    assert [c.step for c in gpufeed.torch.Checkpoints("/out/ddp").list()] == [1]


def test_kill_9_of_saver_and_agent_at_20_points_always_leaves_the_latest_complete_checkpoint(
    out: Bucket, moto_faults: FaultControl, tmp_path: Path
) -> None:
    Namespace().add_mount("/slow", out.url, {"endpoint": moto_faults.url}, writable=True, allow_empty=True)
    moto_faults.configure(seed=3, rates={"stall": 0.3}, stall=0.4, path_filter="crash/")  # kills land in uploads too
    checkpoints = gpufeed.torch.Checkpoints("/slow/crash", keep_last=2)
    settings = Settings.from_env()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PYTHONWARNINGS": "ignore"}
    saver = subprocess.Popen([sys.executable, "-m", "tests.writes.checkpoint_saver", "/slow/crash"], cwd=ROOT, env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "saver.log", "w"), text=True)
    assert saver.stdin is not None and saver.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in saver.stdout], daemon=True).start()  # type: ignore[union-attr]

    def until(prefix: str) -> list[str]:
        seen = [lines.get(timeout=120)]
        while not seen[-1].startswith(prefix):
            seen.append(lines.get(timeout=120))
        return seen

    chance = random.Random(17)
    acknowledged, kills, saved, failed = 0, {"saver": 0, "agent": 0}, [], []
    try:
        for round_ in range(20):
            latest = checkpoints.latest()
            saver.stdin.write(f"{(latest.step if latest else 0) + 1}\n")
            saver.stdin.flush()
            seen = until("child ")
            child = int(seen[-1].split()[1])
            time.sleep(chance.uniform(0.2, 1.8))  # a random point of the save loop
            if round_ % 2 == 1:  # the agent dies under the saver, which goes on with the next agent
                killed(AgentClient(settings).hello().pid)
                kills["agent"] += 1
                time.sleep(chance.uniform(0.0, 0.6))
            with contextlib.suppress(ProcessLookupError):  # the agent's death may have ended it already
                os.kill(child, signal.SIGKILL)
            kills["saver"] += 1
            seen += until("ended")
            failed += [line for line in seen if line.startswith("failed ")]
            saved += [int(line.split()[1]) for line in seen if line.startswith("saved ")]
            acknowledged = max([acknowledged, *saved])
            gpufeed._default = None
            listed = checkpoints.list()
            assert (listed[-1].step if listed else 0) >= acknowledged, (round_, listed, acknowledged)
            for checkpoint in listed:  # every listed checkpoint is complete and holds what was saved
                loaded = zeros_like(state(checkpoint.step))
                try:
                    assert checkpoints.load(loaded, checkpoint.step) == checkpoint.step
                except PathNotFound:
                    # its commit marker went as we read: the killed saver's prune had sent that
                    # delete to the agent, which finishes a request whatever becomes of its sender
                    # (a fault stall held it). A prune never takes one of the newest two.
                    assert checkpoint not in listed[-2:], (round_, listed, checkpoint)
                    continue
                assert same(loaded, state(checkpoint.step)), (round_, checkpoint)
    finally:
        saver.kill()
        saver.wait()
    assert kills == {"saver": 20, "agent": 10} and saved, (kills, saved, failed)
    moto_faults.configure(rates={})
    gpufeed.sync("/slow")  # staged uploads of killed agents resumed and finished
    staging = AgentClient(settings).dirs[0] / "staging"
    assert not list(staging.glob("*.json")), "nothing left to upload"
    assert checkpoints.list()[-1].step >= 3, "saving went on between the kills"
    for checkpoint in checkpoints.list():
        for item in gpufeed.walk(checkpoint.path):
            key = item.path.removeprefix("/slow/")
            assert stored(out, key) == gpufeed.read(item.path), key
