"""`gpufeed agent ...` and `gpufeed cache ...` as a user runs them."""

from __future__ import annotations

import os
from pathlib import Path

from tests.cli.test_cli import fails, ok


def test_agent_lifecycle_and_cache_commands(dataset: Path, gpufeed_home: Path) -> None:
    assert "no agent running" in ok("agent", "stop")
    assert fails_status() == 1
    started = ok("agent", "start")
    assert f"serving {gpufeed_home / 'cache'}" in started
    assert "already serves" in ok("agent", "start")
    assert "0 blocks" in ok("agent", "status")
    ok("mount", "add", "/data", f"file://{dataset}")
    assert ok("cat", "/data/README") == "readme\n"
    ok("cat", "/data/README")
    stats = ok("cache", "stats")
    assert "blocks           1" in stats and "misses           1" in stats and "hits             1" in stats
    listing = ok("cache", "ls", "/data/train").splitlines()
    assert listing[-1].split()[0] == "0.0%" and len(listing) == 7
    ok("cat", "/data/train/cats/0.jpg")
    assert ok("cache", "ls", "/data/train/cats/0.jpg").split()[0] == "100.0%"
    assert "cleared" in ok("cache", "clear")
    assert "blocks           0" in ok("cache", "stats")
    assert "stopped agent" in ok("agent", "stop")
    assert fails_status() == 1


def fails_status() -> int:
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "gpufeed", "agent", "status"], capture_output=True, env=os.environ
    ).returncode


def test_a_second_foreground_agent_is_refused(gpufeed_home: Path) -> None:
    ok("agent", "start")
    assert "an agent already serves" in fails(3, "agent", "--idle-timeout", "5")
    assert "stopped" in ok("agent", "stop")


def test_bad_cache_size_is_one_line() -> None:
    assert "expected a size such as 4MiB" in fails(2, "agent", "--cache-size", "lots", "status")
