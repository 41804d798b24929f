"""Progress of long commands (mount add, warmup, pack, verify) when stderr is not a terminal,
`--quiet`, `--json`, and Ctrl-C on a warmup of a big object: real processes over a real HTTP
store behind the latency shaper."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from gpufeed.bench.shaper import shaping
from tests.agent.test_metrics import agent_metrics
from tests.cli.test_cli import gpufeed, ok
from tests.conftest import HttpServer

FAST_LINES = {"GPUFEED_PROGRESS_INTERVAL": "0.05"}


@pytest.fixture
def slow_site(nginx: HttpServer, tmp_path: Path) -> Iterator[str]:
    """An http:// URL of a fresh site behind 20 ms first-byte latency and a 8 MB/s cap."""
    site = nginx.root / f"progress-{tmp_path.name}"
    site.mkdir()
    for i in range(12):
        (site / f"{i:02d}.bin").write_bytes(os.urandom(4000))
    upstream = urlsplit(nginx.url)
    with shaping((upstream.hostname or "127.0.0.1", upstream.port or 80), 20, 8, tmp_path / "shaper.log") as port:
        yield f"http://127.0.0.1:{port}/{site.name}"


def test_plain_progress_lines_when_stderr_is_not_a_terminal(slow_site: str) -> None:
    listed = gpufeed("mount", "add", "/slow", slow_site, env=FAST_LINES)
    assert listed.returncode == 0, listed.stderr
    assert "mount add: listed: 12 objects, 46.9 KiB" in listed.stderr.splitlines()[-1]
    warm = gpufeed("warmup", "/slow", "-p", "1", env=FAST_LINES)
    assert warm.returncode == 0, warm.stderr
    lines = warm.stderr.splitlines()
    assert len(lines) >= 3, "periodic lines while 12 files take 20 ms each, then one at the end"
    assert all(line.startswith("warmup: ") for line in lines), lines
    assert lines[-1].startswith("warmup: 12/12 files, 46.9 KiB/46.9 KiB, "), lines[-1]
    assert "\x1b" not in warm.stderr, "no terminal escapes in a log"
    assert "warmed 12 files" in warm.stdout and "warmup:" not in warm.stdout, "progress stays off stdout"


def test_quiet_prints_no_progress_and_json_parses(slow_site: str) -> None:
    mounted = gpufeed("mount", "add", "/slow", slow_site, "--quiet", "--json", env=FAST_LINES)
    assert mounted.returncode == 0 and mounted.stderr == "", mounted.stderr
    record = json.loads(mounted.stdout)
    assert (record["path"], record["files"], record["bytes"]) == ("/slow", 12, 48000)
    warm = gpufeed("warmup", "/slow", "--quiet", "--json", env=FAST_LINES)
    assert warm.returncode == 0 and warm.stderr == "", warm.stderr
    summary = json.loads(warm.stdout)
    assert (summary["files"], summary["bytes"], summary["fetched_bytes"]) == (12, 48000, 48000)
    assert json.loads(ok("warmup", "/slow", "-q", "--json"))["fetched_bytes"] == 0


def test_pack_and_verify_show_progress_and_take_quiet_and_json(slow_site: str, tmp_path: Path) -> None:
    ok("mount", "add", "/slow", slow_site, "-q")
    packed = gpufeed("pack", "/slow", f"file://{tmp_path}/pack", "--workers", "1", env=FAST_LINES)
    assert packed.returncode == 0, packed.stderr
    lines = packed.stderr.splitlines()
    assert lines and all(line.startswith("pack: ") for line in lines), lines
    assert lines[-1].startswith("pack: 12/12 files, 46.9 KiB/46.9 KiB, "), lines[-1]
    assert "\x1b" not in packed.stderr and packed.stdout.startswith("packed 12 files"), packed.stdout
    quiet = gpufeed("pack", "/slow", f"file://{tmp_path}/again", "-q", "--json", env=FAST_LINES)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert (json.loads(quiet.stdout)["files"], json.loads(quiet.stdout)["up_to_date"]) == (12, False)

    verified = gpufeed("verify", "/slow", env=FAST_LINES)
    assert verified.returncode == 0, verified.stderr
    lines = verified.stderr.splitlines()
    assert lines and all(line.startswith("verify: ") for line in lines), lines
    assert lines[-1].startswith("verify: 12/12 files, 46.9 KiB/46.9 KiB, "), lines[-1]
    assert "verified 12 files" in verified.stdout and "verify:" not in verified.stdout
    again = gpufeed("verify", "/slow", "--quiet", "--json", env=FAST_LINES)
    assert again.returncode == 0 and again.stderr == "", again.stderr
    result = json.loads(again.stdout)
    assert (result["files"], result["bytes"], result["recorded"], result["matched"]) == (12, 48000, 0, 12)
    assert result["mismatches"] == []


def test_ctrl_c_on_a_warmup_of_a_big_object_returns_at_once_and_says_what_is_cached(
    nginx: HttpServer, tmp_path: Path, gpufeed_home: Path
) -> None:
    """64 MiB at 8 MB/s takes 8 s; SIGINT after the first progress line must end the process
    within 1.5 s (the issue asks 1 s; the margin is for a loaded CI machine), exit 130."""
    site = nginx.root / f"big-{tmp_path.name}"
    site.mkdir()
    (site / "shard.bin").write_bytes(os.urandom(64 << 20))
    upstream = urlsplit(nginx.url)
    with shaping((upstream.hostname or "127.0.0.1", upstream.port or 80), 20, 8, tmp_path / "shaper.log") as port:
        ok("mount", "add", "/big", f"http://127.0.0.1:{port}/{site.name}", "-q")
        warmup = subprocess.Popen(
            [sys.executable, "-m", "gpufeed", "warmup", "/big"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GPUFEED_PROGRESS_INTERVAL": "0.2"},
        )
        assert warmup.stderr is not None
        first = warmup.stderr.readline()
        assert first.startswith("warmup: 0/1 files"), first
        warmup.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, rest = warmup.communicate(timeout=30)
        took = time.monotonic() - sent
        assert warmup.returncode == 130, rest
        assert took < 1.5, f"Ctrl-C took {took:.2f} s"
        stopped = rest.splitlines()[-1]
        assert stopped.startswith("gpufeed: interrupted: 0/1 files complete, ") and "of 64.0 MiB cached" in stopped, rest
        assert "Traceback" not in rest
        # the agent drops the warmup's fetches with its connection, not seconds later at 8 MB/s
        deadline = time.monotonic() + 3
        while (inflight := agent_metrics()[("gpufeed_fetches_in_flight", ())]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inflight == 0, "the agent still fetches for a warmup that is gone"
    assert "Traceback" not in (gpufeed_home / "cache" / "agent.log").read_text()


def test_a_terminal_gets_a_live_bar_and_stdout_keeps_only_the_result(slow_site: str) -> None:
    """stderr on a real pseudo-terminal: rich redraws one bar in place (cursor escapes), with
    files, bytes of the total and the rate; stdout, a pipe, gets the result alone."""
    ok("mount", "add", "/slow", slow_site, "-q")
    main, side = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"}
    warmup = subprocess.Popen(
        [sys.executable, "-m", "gpufeed", "warmup", "/slow", "-p", "1"], stdout=subprocess.PIPE, stderr=side, env=env
    )
    os.close(side)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the command closed the terminal's last writer
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    stdout, _ = warmup.communicate(timeout=60)
    assert warmup.returncode == 0
    screen = shown.decode(errors="replace")
    assert "\x1b[" in screen, "a bar drawn with terminal escapes"
    assert "warmup" in screen and "12/12 files" in screen and "46.9/46.9 KiB" in screen, screen
    assert stdout.decode().startswith("warmed 12 files") and b"\x1b" not in stdout, stdout
