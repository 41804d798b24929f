"""The bench DataLoader's worker processes end with the process that started them, however it ends."""

from __future__ import annotations

import multiprocessing
import multiprocessing.popen_forkserver
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gpufeed.bench.dataset import Dataset
from gpufeed.bench.loader import DataLoader
from gpufeed.bench.modes import LocalReaderSpec
from gpufeed.bench.runner import interruptible

RECORD = 4096


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that will never reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children_of(parent: int) -> list[int]:
    return [int(pid) for pid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def _one_file(tmp_path: Path) -> tuple[LocalReaderSpec, Dataset]:
    path = tmp_path / "samples"
    path.write_bytes(bytes(4 * RECORD))
    return LocalReaderSpec((str(path),)), Dataset((str(path),), np.array([4 * RECORD]), 4, 4)


def test_workers_of_a_loader_killed_with_sigkill_exit_on_their_own(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, time
        from pathlib import Path
        import numpy as np
        from gpufeed.bench.dataset import Dataset
        from gpufeed.bench.loader import DataLoader
        from gpufeed.bench.modes import LocalReaderSpec

        if __name__ == "__main__":
            path = "{tmp_path / 'samples'}"
            Path(path).write_bytes(bytes({4 * RECORD}))
            dataset = Dataset((path,), np.array([{4 * RECORD}]), 4, 4)
            with DataLoader(LocalReaderSpec((path,)), dataset, batch=2, workers=2, prefetch=1, seed=0) as loader:
                assert sum(batch.samples for batch in loader.epoch(0)) == 4
                print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
                time.sleep(600)
    """))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None
        workers = [int(pid) for pid in trainer.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers), workers
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 30
    while (left := [pid for pid in workers if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, "workers outlived the training process"


def test_sigterm_while_a_worker_starts_stops_every_worker_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signal lands after the forkserver forked the second worker and before its pid is
    known, with another thread running for the kernel to hand it to."""
    spec, dataset = _one_file(tmp_path)
    forkserver = multiprocessing.popen_forkserver.forkserver
    read_pid = forkserver.read_signed
    starts: set[int] = set()  # a worker's pid, then its exit status, come through its own pipe

    def read_pid_signalled(fd: int) -> int:
        starts.add(fd)
        if len(starts) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return read_pid(fd)

    monkeypatch.setattr(forkserver, "read_signed", read_pid_signalled)
    bystander = threading.Event()
    thread = threading.Thread(target=bystander.wait)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt), interruptible():
            with DataLoader(spec, dataset, batch=2, workers=3, prefetch=1, seed=0):
                pytest.fail("the loader started although SIGTERM arrived while it was starting")
    finally:
        bystander.set()
        thread.join()
    assert len(starts) == 2, "the third worker was not started"
    (server,) = [pid for pid in _children_of(os.getpid()) if b"multiprocessing.forkserver" in _cmdline(pid)]
    assert [pid for pid in _children_of(server) if _alive(pid)] == [], "a worker outlived the loader"
