"""`gpufeed agent ...` and `gpufeed cache ...` as a user runs them."""

from __future__ import annotations

import os
from pathlib import Path

from tests.cli.test_cli import fails, gpufeed, ok


def test_agent_lifecycle_and_cache_commands(dataset: Path, gpufeed_home: Path) -> None:
    assert "no agent running" in ok("agent", "stop")
    assert fails_status() == 1
    started = ok("agent", "start")
    assert f"serving {gpufeed_home / 'cache'}" in started
    assert "already serves" in ok("agent", "start")
    status = ok("agent", "status")
    assert "0 blocks" in status and "0 clients" in status, "not counting its own connection"
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
    cleared = ok("cache", "stats")
    assert "blocks           0" in cleared and "evictions        0" in cleared, "a clear asked for is no eviction"
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


def test_an_agent_started_for_other_dirs_says_how_readers_reach_it(gpufeed_home: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-cache"
    started = gpufeed("agent", "start", "--cache-dir", str(other))
    assert started.returncode == 0 and f"serving {other}" in started.stdout
    assert f"readers here use the agent of {gpufeed_home / 'cache'}, not this one; set GPUFEED_CACHE_DIRS={other}" in (
        started.stderr
    )
    assert "stopped agent" in ok("agent", "stop", env={"GPUFEED_CACHE_DIRS": str(other)})
    plain = gpufeed("agent", "start")
    assert plain.returncode == 0 and plain.stderr == "", "the readers' own agent: no note"
    ok("agent", "stop")
