"""The reaper, checked without Ray: a runner killed at any moment after its command started
leaves none of the command's processes running."""

from __future__ import annotations

import subprocess
import sys

from tests.pool.conftest import eventually, running

RUNNER = """
import os, signal, sys
from gpufeed.pool import launcher
tell = launcher.guard(0.5)
proc = launcher.spawn(["sh", "-c", sys.argv[1]], dict(os.environ), None, tell)
proc.stdout.readline()  # the command's child runs
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_runner_killed_right_after_its_command_started_leaves_nothing_of_it() -> None:
    """The reaper is there before the command: one started after it died with its runner on a
    loaded node, and the command's children ran on, holding the GPU after the lease was freed."""
    job = "trap '' TERM; sleep 71.25 & echo started; wait"
    runner = subprocess.run([sys.executable, "-c", RUNNER, job], capture_output=True, timeout=60)
    assert runner.returncode == -9, runner.stderr
    eventually(lambda: not running("sleep\x0071.25\x00") and not running(f"{job}\x00"), "the command and its child to end",
               timeout=30)


def test_a_reaper_told_the_group_ended_exits_whether_its_command_started_or_not() -> None:
    """Else a reaper would wait for each runner's death, one a job, for as long as the runner lives."""
    code = """
import os, sys
from gpufeed.pool import launcher
for argv in (["/nonexistent/train"], ["true"]):
    tell = launcher.guard(0.375)
    try:
        launcher.stop(launcher.spawn(argv, dict(os.environ), None, tell), 0.375)
    except OSError:
        pass
    launcher.release(tell)
print("released", flush=True)
sys.stdin.read()
"""
    runner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert runner.stdout is not None and runner.stdout.readline() == "released\n"
        eventually(lambda: not running("reaper.py\x000.375\x00"), "both reapers to exit while their runner lives")
    finally:
        runner.communicate("", timeout=30)
