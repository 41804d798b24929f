"""`gpufeed warmup`: fills the cache, skips what is cached, resumes after kill -9, shows status."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from gpufeed.bench.shaper import shaping
from gpufeed.namespace import Namespace
from tests.cli.test_cli import fails, ok
from tests.conftest import HttpServer


def test_warmup_fills_the_cache_and_skips_what_is_cached(dataset: Path) -> None:
    ok("mount", "add", "/data", f"file://{dataset}")
    assert "0.0% cached" in ok("warmup", "--dry-run", "/data")
    first = ok("warmup", "/data/train", "-p", "4")
    assert "warmed 6 files" in first and "0 B were cached already" in first
    assert "6 files, 8.8 KiB; 100.0% cached" in ok("warmup", "--dry-run", "/data/train")
    assert "7 files, 8.8 KiB; 99.9% cached (7 B to fetch)" in ok("warmup", "--dry-run", "/data/train", "/data/README"), (
        "a few bytes to fetch are not shown as all cached"
    )
    assert json.loads(ok("warmup", "--dry-run", "--json", "/data/train", "/data/README")) == {
        "files": 7, "bytes": 9006 + 7, "cached_bytes": 9006, "to_fetch_bytes": 7
    }
    again = ok("warmup", "/data/train", "/data/train/cats/0.jpg")
    assert "warmed 6 files" in again and "fetched 0 B" in again, "a file under two of the paths is warmed once"
    listing = Path(dataset.parent / "paths.txt")
    listing.write_text("/data/README\n# comment\n/data/empty.bin\n")
    assert "warmed 2 files" in ok("warmup", "--list", str(listing))
    assert "no warmup running" in ok("warmup", "status")
    assert json.loads(ok("warmup", "status", "--json")) == []
    assert "give one or more namespace paths" in fails(2, "warmup")
    assert "no such file or directory in mount /data" in fails(1, "warmup", "/data/nope")


def test_a_warmup_goes_on_when_its_progress_file_cannot_be_written(dataset: Path, gpufeed_home: Path) -> None:
    """The progress file only lists the warmup in `warmup status`; a cache dir that cannot take
    it (here its place is taken by a file) does not stop the warmup."""
    ok("mount", "add", "/data", f"file://{dataset}")
    (gpufeed_home / "cache").mkdir(parents=True, exist_ok=True)
    (gpufeed_home / "cache" / "warmups").write_text("not a directory")
    assert "warmed 6 files" in ok("warmup", "/data/train")
    assert "100.0% cached" in ok("warmup", "--dry-run", "/data/train")


def test_a_warmup_the_cache_cannot_take_says_so_and_fails(tmp_path: Path) -> None:
    """A script that warms before training must not be told the cache is warm when the agent
    could not start or its cache cannot hold the files."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "big.bin").write_bytes(os.urandom(3_000_000))
    ok("mount", "add", "/d", f"file://{data}")
    no_agent = subprocess.run([sys.executable, "-m", "gpufeed", "warmup", "/d"], capture_output=True, text=True,
                              env={**os.environ, "GPUFEED_CACHE_DIRS": "/proc/nope"}, timeout=120)
    assert no_agent.returncode == 1, no_agent
    assert "2.9 MiB not cached" in no_agent.stdout and "0 B were cached already" in no_agent.stdout
    *warning, error = no_agent.stderr.strip().splitlines()
    assert "reading without the cache" in warning[0]
    assert error == ("gpufeed: error: warmup: 2.9 MiB of 2.9 MiB could not be cached (see the warning "
                     "above); reads of them go to the store")
    ok("agent", "start", "--cache-size", "2MiB")
    too_small = subprocess.run([sys.executable, "-m", "gpufeed", "warmup", "--json", "/d"], capture_output=True,
                               text=True, timeout=120)
    assert too_small.returncode == 1, too_small
    assert json.loads(too_small.stdout)["uncached_bytes"] == 3_000_000
    assert "cannot hold more blocks" in too_small.stderr and "could not be cached" in too_small.stderr

    many = tmp_path / "many"
    many.mkdir()
    for i in range(10):
        (many / f"{i}.bin").write_bytes(os.urandom(400_000))  # each fits, all 10 do not
    ok("mount", "add", "/m", f"file://{many}")
    cycled = subprocess.run([sys.executable, "-m", "gpufeed", "warmup", "/m", "-p", "1"], capture_output=True, text=True,
                            timeout=120)
    assert cycled.returncode == 1, cycled
    evicted = re.search(r"fetched 3\.8 MiB, 0 B were cached already, ([\d.]+) MiB evicted again", cycled.stdout)
    assert evicted and 1.5 < float(evicted[1]) < 3.8, cycled.stdout
    assert cycled.stderr.strip().splitlines()[-1] == (
        f"gpufeed: error: warmup: {evicted[1]} MiB of 3.8 MiB did not stay cached: the cache holds 2.0 MiB "
        "(gpufeed agent start --cache-size); reads of them go to the store"
    )


def test_an_interrupted_warmup_does_not_count_what_the_cache_refused_as_cached(nginx: HttpServer, tmp_path: Path) -> None:
    """Ctrl-C on a warmup after the cache refused a file too big for it: that file is not cached."""
    site = nginx.root / f"uncached-{tmp_path.name}"
    site.mkdir()
    (site / "0-big.bin").write_bytes(os.urandom(3_000_000))
    for i in range(1, 31):
        (site / f"{i:02d}.bin").write_bytes(os.urandom(1000))
    upstream = urlsplit(nginx.url)
    with shaping((upstream.hostname, upstream.port), 50, None, tmp_path / "shaper.log") as port:
        ok("mount", "add", "/slow", f"http://127.0.0.1:{port}/{site.name}", "-q")
        ok("agent", "start", "--cache-size", "2MiB")
        warmup = subprocess.Popen(
            [sys.executable, "-m", "gpufeed", "warmup", "/slow", "-p", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, "GPUFEED_PROGRESS_INTERVAL": "0.05"},
        )
        assert warmup.stderr is not None
        while not re.match(r"warmup: ([3-9]|\d\d)/31 ", line := warmup.stderr.readline()):
            assert line, "the warmup ended before it was interrupted"
        warmup.send_signal(signal.SIGINT)
        _, rest = warmup.communicate(timeout=60)
    assert warmup.returncode == 130, rest
    stopped = rest.splitlines()[-1]
    assert re.fullmatch(r"gpufeed: interrupted: \d+/31 files complete, [\d.]+ KiB of 2\.9 MiB cached "
                        r"\(2\.9 MiB not cached\); run the same warmup again to resume", stopped), stopped


def test_a_killed_warmup_resumes_where_it_stopped(nginx: HttpServer, tmp_path: Path) -> None:
    site = nginx.root / f"warm-{tmp_path.name}"
    site.mkdir()
    for i in range(150):
        (site / f"{i:04d}.bin").write_bytes(os.urandom(2000))
    upstream = urlsplit(nginx.url)
    # 80 ms a request, 2 in flight; the warmup is stopped (SIGSTOP) while the two status commands
    # look at it, so a slow machine cannot let it finish before the kill
    with shaping((upstream.hostname, upstream.port), 80, None, tmp_path / "shaper.log") as port:
        Namespace().add_mount("/slow", f"http://127.0.0.1:{port}/{site.name}")

        def gets() -> int:
            return len(re.findall(rf'"GET /{site.name}/\d+\.bin ', nginx.access_log.read_text()))

        warmup = subprocess.Popen(
            [sys.executable, "-m", "gpufeed", "warmup", "/slow", "-p", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while gets() < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        warmup.send_signal(signal.SIGSTOP)
        assert f"pid {warmup.pid}: /slow" in ok("warmup", "status")
        [running] = json.loads(ok("warmup", "status", "--json", "/slow"))
        assert (running["pid"], running["paths"], running["files"]) == (warmup.pid, ["/slow"], 150)
        warmup.send_signal(signal.SIGKILL)
        warmup.wait()
        assert 40 <= gets() < 150, "killed part way"
        resumed = ok("warmup", "/slow")
        assert "warmed 150 files" in resumed
        time.sleep(0.3)  # nginx logs a request after answering it
        # the agent drops a killed warmup's fetches: at most its 2 in flight are fetched again
        assert 150 <= gets() <= 152, "nothing else fetched twice"
        assert "no warmup running" in ok("warmup", "status")
