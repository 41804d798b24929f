"""`gpufeed agent ...` and `gpufeed cache ...` as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from gpufeed.client.connection import AgentClient
from gpufeed.config import Settings
from tests.cli.test_cli import fails, gpufeed, ok
from tests.conftest import free_port
from tests.writes.test_faults import killed


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
    assert "no agent running for" in fails(1, "cache", "stats")
    assert fails_status() == 1, "a look at the cache starts no agent"


def fails_status() -> int:
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


def test_an_agent_killed_comes_back_as_it_was_started(dataset: Path, gpufeed_home: Path) -> None:
    """The reader that finds the agent gone starts the service `agent start` made, not one with
    the reader's own settings; `agent stop` ends the service."""
    port, other = free_port(), free_port()
    ok("agent", "start", "--cache-size", "20MiB", "--metrics-addr", f"127.0.0.1:{port}")
    ok("mount", "add", "/data", f"file://{dataset}")
    killed(AgentClient(Settings.from_env()).stats(start=False).pid)
    assert ok("cat", "/data/README") == "readme\n"  # starts it again
    assert "with a 20.0 MiB quota" in ok("agent", "status")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert b"gpufeed_hits_total" in reply.read()
    assert f"not --metrics-addr 127.0.0.1:{other}" in fails(1, "agent", "start", "--metrics-addr", f"127.0.0.1:{other}")
    assert "already serves" in ok("agent", "start", "--metrics-addr", str(port)), "the same address, written short"
    ok("agent", "stop")
    assert ok("cat", "/data/README") == "readme\n"  # a reader's own agent now
    assert "20.0 MiB" not in ok("agent", "status")
    ok("agent", "stop")


def test_two_agent_starts_at_once_with_other_settings_do_not_both_succeed(gpufeed_home: Path) -> None:
    """Every rank of a job running `agent start`: one starts its agent, the other finds it and
    compares, as one after the other would."""
    runs = [subprocess.Popen([sys.executable, "-m", "gpufeed", "agent", "start", *flags], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for flags in (["--cache-size", "1GiB"], ["--cache-size", "2GiB"])]
    results = [(run.wait(timeout=120), *run.communicate()) for run in runs]
    assert sorted(code for code, _, _ in results) == [0, 1], results
    started = [out for code, out, _ in results if code == 0 and "serving" in out]
    assert len(started) == 1, results
    [why] = [err for code, _, err in results if code == 1]
    assert "an agent already serves" in why and "stop it first with 'gpufeed agent stop'" in why, why


def test_agent_start_on_a_cache_dir_that_cannot_be_made_is_one_line() -> None:
    assert fails(1, "agent", "start", env={"GPUFEED_CACHE_DIRS": "/proc/no-such-cache"}) == (
        "gpufeed: error: cannot start the agent for /proc/no-such-cache: No such file or directory"
    )
