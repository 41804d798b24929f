"""`gpufeed demo --quick` end to end, its bad input, and Ctrl-C in the middle of it leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

from gpufeed.bench.demo import demo_workload
from gpufeed.bench.runner import OWNER, scratch_dir
from tests.bench.helpers import gpufeed, one_error_line


@pytest.fixture
def temp() -> Iterator[Path]:
    """An empty TMPDIR for the demo, short: multiprocessing puts its forkserver's socket in it,
    and a socket path has at most 107 bytes (a test's tmp_path under a parallel run has ~80)."""
    path = Path(tempfile.mkdtemp(prefix="gfd-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


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


def _holders(pipe: IO[str]) -> list[str]:
    """The processes that hold `pipe`'s other end open, by command line."""
    wanted = f"pipe:[{os.fstat(pipe.fileno()).st_ino}]"
    holders = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == wanted for fd in fd_dir.iterdir()) and int(fd_dir.parent.name) != os.getpid():
                holders.append(f"{fd_dir.parent.name}: {_cmdline(int(fd_dir.parent.name))}")
        except OSError:
            continue
    return holders


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


ROW = re.compile(
    r"^(local disk|direct|gpufeed cold|gpufeed warm) +([\d,]+) +(\d+)% +(\d+\.\d\d)x +(\d+\.\d\d)x +([\d,]+)$", re.M
)


def test_quick_demo_prints_every_way_with_its_ratios_and_writes_under_home(tmp_path: Path, temp: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = gpufeed("demo", "--quick", "--json", env={"TMPDIR": str(temp)}, timeout=90, cwd=cwd)
    assert result.returncode == 0, result.stderr
    out = result.stderr  # with --json the table is on stderr and stdout holds the JSON alone
    assert "20 ms first-byte latency, 400 MB/s bandwidth cap" in out, "the store's shape is stated"
    rows = {m[1]: m for m in ROW.finditer(out)}
    assert list(rows) == ["local disk", "direct", "gpufeed cold", "gpufeed warm"], out
    assert rows["direct"][4] == "1.00" and rows["local disk"][5] == "1.00", "each baseline is 1.00x itself"
    assert all(0 < int(m[3]) <= 100 and float(m[4]) > 0 and float(m[5]) > 0 for m in rows.values())
    assert int(rows["gpufeed warm"][6].replace(",", "")) == 0, "the warm epoch reads nothing from the store"
    text = " ".join(out.split())  # sentences as printed, whatever the terminal's width wrapped
    # the reason follows from the settings (8 workers x 1 request, 20 ms), whatever the machine's speed
    assert "direct starves because every sample waits 20 ms for its first byte" in text
    assert "at most 8 / 20 ms = 400 samples/s, while the accelerator consumes 1,786." in text
    assert re.search(r"gpufeed cold epoch: \d+\.\dx direct \(.*\); warm: \d+\.\d\dx local disk", text), out
    home = Path(os.environ["GPUFEED_HOME"])
    assert f"chart: {home / 'demo' / 'demo.png'}" in out
    assert (home / "demo" / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(result.stdout)
    assert data["chart"] == str(home / "demo" / "demo.png")
    assert [row["way"] for row in data["rows"]] == list(rows)
    assert data["bench"]["latency_ms"] == 20 and data["bench"]["bandwidth_mbps"] == 400
    assert list(cwd.iterdir()) == [], "nothing in the current directory"
    assert list(temp.iterdir()) == [], "the dataset and the run's temp files are gone"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--latency-ms", "-1"), "--latency-ms -1: must be >= 0"),
        (("--bandwidth", "-5"), "--bandwidth -5: must be >= 0 MB/s (0: no cap)"),
        (("--samples", "0"), "--samples 0: must be at least 1"),
        (("--out", "{file}/demo"), "cannot make the output directory"),
    ],
)
def test_bad_input_is_one_line_before_anything_runs(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    (tmp_path / "file").write_text("")
    argv = [arg.format(file=tmp_path / "file") for arg in args]
    assert needle in one_error_line(gpufeed("demo", *argv, cwd=tmp_path), 2)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.parametrize(
    "interrupt",
    [
        lambda p: os.killpg(p.pid, signal.SIGINT),  # Ctrl-C in a terminal: the whole foreground group
        lambda p: p.send_signal(signal.SIGTERM),  # kill PID
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_interrupt_stops_servers_workers_and_removes_temp_files(
    tmp_path: Path, temp: Path, interrupt: Callable[[subprocess.Popen[str]], None]
) -> None:
    out = tmp_path / "out"
    process = subprocess.Popen(  # 200 ms a sample: the direct epoch lasts about half a minute
        [sys.executable, "-m", "gpufeed", "demo", "--quick", "--latency-ms", "200", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(temp)},
        start_new_session=True,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:
            if line.startswith("direct: "):
                break
        else:
            raise AssertionError(f"the demo ended before training: exit code {process.wait()}")
        workers = demo_workload().workers
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the forkserver and every loader worker run
            started = _descendants(process.pid)
            names = " | ".join(_cmdline(pid) for pid in started)
            if names.count("forkserver") > workers:
                break
            time.sleep(0.1)
        assert "nginx" in names and "gpufeed.bench.shaper" in names and names.count("forkserver") > workers, names
        interrupt(process)
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"exit code {process.poll()}; still holding its stderr: {_holders(process.stderr)}") from None
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
    assert not (out / "demo.png").exists()


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


_IGNORES_CTRL_C = """
import signal
from gpufeed.bench import loader

def ignored(answers):
    answers.put(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)

if __name__ == "__main__":
    context = loader._context()
    answers = context.Queue()
    worker = context.Process(target=ignored, args=(answers,))
    worker.start()
    print(answers.get(timeout=60), signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    worker.join(timeout=30)
"""


def test_a_loader_worker_ignores_ctrl_c_from_its_start(tmp_path: Path) -> None:
    """A Ctrl-C while multiprocessing is still starting a worker must not print its traceback:
    the worker ignores SIGINT before its own code runs; the parent handles it. Checked in a new
    process, as `gpufeed bench` is: the forkserver is one per process, and one an earlier test
    started (a pack's workers) has not this preload."""
    script = tmp_path / "ignores_ctrl_c.py"
    script.write_text(_IGNORES_CTRL_C)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"], "the worker ignores Ctrl-C; the benchmark process keeps its own"

