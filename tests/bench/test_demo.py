"""`gpufeed demo` end to end, and Ctrl-C in the middle of it leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufeed.bench.runner import OWNER, scratch_dir
from tests.bench.helpers import gpufeed


def _children() -> dict[int, int]:
    """pid -> parent pid of every live (non-zombie) process."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
    return parents


def _descendants(root: int) -> set[int]:
    parents = _children()
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_demo_runs_every_mode_and_cleans_up(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = gpufeed(
        "demo", "--samples", "1251", "--epochs", "1",
        "--plot", str(tmp_path / "demo.png"), "--json", str(tmp_path / "demo.json"),
        env={"TMPDIR": str(temp)}, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "direct" in result.stdout and "copy" in result.stdout and "AU" in result.stdout
    assert f"chart: {tmp_path / 'demo.png'}" in result.stdout
    assert (tmp_path / "demo.png").stat().st_size > 0
    modes = {m["mode"]: m for m in json.loads((tmp_path / "demo.json").read_text())["modes"]}
    # which mode wins is the demo's to show, not a timed assert
    assert set(modes) >= {"direct", "copy"} and all(0 < m["au"] <= 1 for m in modes.values())
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize(
    "interrupt",
    [
        lambda p: os.killpg(p.pid, signal.SIGINT),  # Ctrl-C in a terminal: the whole foreground group
        lambda p: p.send_signal(signal.SIGTERM),  # kill PID
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_interrupt_stops_servers_workers_and_removes_temp_files(
    tmp_path: Path, interrupt: Callable[[subprocess.Popen[str]], None]
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "gpufeed", "demo", "--samples", "1251", "--epochs", "20", "--plot", str(tmp_path / "x.png")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(temp)},
        start_new_session=True,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:
            if "direct: epoch 1/" in line:
                break
        else:
            raise AssertionError(f"the demo ended before training: exit code {process.wait()}")
        started = _descendants(process.pid)
        names = " | ".join(_cmdline(pid) for pid in started)
        assert "nginx" in names and "gpufeed.bench.shaper" in names, names
        interrupt(process)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    deadline = time.monotonic() + 10
    while (left := started & set(_children())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, [_cmdline(pid) for pid in left]
    assert list(temp.iterdir()) == []
    assert not (tmp_path / "x.png").exists()


def test_a_killed_runs_scratch_dir_is_swept_by_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "gpufeed-bench-killed").mkdir()
    (tmp_path / "gpufeed-bench-killed" / OWNER).write_text(str(dead.pid))
    (tmp_path / "gpufeed-bench-running").mkdir()
    (tmp_path / "gpufeed-bench-running" / OWNER).write_text(str(os.getpid()))
    with scratch_dir("gpufeed-bench-") as mine:
        assert mine.is_dir() and mine.parent == tmp_path
        assert not (tmp_path / "gpufeed-bench-killed").exists()
        assert (tmp_path / "gpufeed-bench-running").exists()
    assert not mine.exists()
