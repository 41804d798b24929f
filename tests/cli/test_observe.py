"""`gpufeed metrics` and `gpufeed top` against a real agent and a real reading process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gpufeed
from gpufeed.namespace import Namespace
from tests.cli.test_cli import fails, ok

FILES = 12
READER = textwrap.dedent("""
    import sys, time
    import gpufeed
    paths = sys.argv[1:]
    for path in paths:
        gpufeed.read(path)  # cold
    gpufeed.client().hits.flush()
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # warm, until the test stops it
        for path in paths:
            gpufeed.read(path)
        time.sleep(0.002)
""")


def test_metrics_and_top_without_an_agent_are_one_line_and_exit_1() -> None:
    assert "no agent running for" in fails(1, "metrics")
    assert "no agent running for" in fails(1, "top", "--once", "--json")
    assert "--interval" in fails(2, "top", "--once", "--interval", "0")


def test_top_once_json_shows_the_reading_process_and_its_rates(tmp_path: Path) -> None:
    root = tmp_path / "src"
    root.mkdir()
    for i in range(FILES):
        (root / f"{i:03d}.bin").write_bytes(bytes([i]) * 20_000)
    Namespace().add_mount("/data", f"file://{root}")
    paths = [f"/data/{i:03d}.bin" for i in range(FILES)]
    reader = subprocess.Popen([sys.executable, "-c", READER, *paths], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
        shot = json.loads(ok("top", "--once", "--json", "--interval", "1"))
    finally:
        reader.kill()
        reader.wait()
    assert set(shot) == {"interval_s", "agent_pid", "clients", "cache", "prefetch", "mounts", "readers"}
    assert shot["cache"]["blocks"] == FILES and shot["cache"]["bytes"] > FILES * 20_000
    assert shot["cache"]["limit"] > 0 and shot["prefetch"] == {"queued": 0, "ahead_blocks": 0, "ahead_samples": 0, "lead_s": None}
    (mount,) = shot["mounts"]
    assert mount["mount"] == "/data" and mount["misses"] == FILES and mount["miss_bytes"] == FILES * 20_000
    assert mount["hit_ratio"] == 1.0 and mount["hits_per_s"] > 0 and mount["cache_mb_per_s"] > 0
    assert mount["store_mb_per_s"] == 0 and mount["stall_pct"] == 0
    (mine,) = [r for r in shot["readers"] if r["pid"] == reader.pid]
    assert mine["hits_per_s"] > 0 and mine["cache_mb_per_s"] > 0 and "python" in mine["command"]
    text = ok("metrics")
    assert 'gpufeed_misses_total{mount="/data",tier="store"} 12.0' in text
    view = ok("top", "--once", "--interval", "0.1")
    assert "/data" in view and "hit ratio" in view


def test_a_table_piped_is_not_cut_to_80_columns(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"a")
    long = "/" + "d" * 90
    Namespace().add_mount(long, f"file://{tmp_path}")
    assert gpufeed.read(f"{long}/a.bin") == b"a"
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    piped = subprocess.run([sys.executable, "-m", "gpufeed", "top", "--once", "--interval", "0.1"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert piped.returncode == 0 and long in piped.stdout, piped.stdout
