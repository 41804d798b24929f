"""Inference logs on moto: records batched into segments by size and by time, read back in
order while the appender runs and from the store after sync; appenders killed (kill -9) at
random points, once with the agent killed too, lose no acknowledged record and duplicate none;
`gpufeed logs tail` and its errors."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest

import gpufeed
from gpufeed import logs
from gpufeed.client.connection import AgentClient
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument, NotADirectory, PathNotFound, ReadOnlyMount
from gpufeed.logs import Appender
from gpufeed.namespace import Namespace
from tests.cli.test_cli import gpufeed as gpufeed_cli
from tests.conftest import Bucket
from tests.writes.test_faults import killed, stored
from tests.writes.test_writes import out

__all__ = ["out"]

APPENDER = """
import sys
from gpufeed.logs import Appender

log = Appender(sys.argv[1], max_bytes=2000, max_seconds=0.2)
n = int(sys.argv[2])
while True:
    log.append({"n": n, "pad": "x" * (n % 40)})
    sys.stdout.write(f"{n}\\n")
    sys.stdout.flush()
    n += 1
"""


def eventually(check: Callable[[], bool], what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s: {what}")
        time.sleep(0.05)


def committed(path: str) -> int:
    try:
        return len(logs.segments(path))
    except PathNotFound:
        return 0


def store_lines(bucket: Bucket, prefix: str) -> list[bytes]:
    """Every line of every segment under `prefix` in the store, segments in name order."""
    listed = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=prefix)  # type: ignore[attr-defined]
    keys = sorted(item["Key"] for item in listed.get("Contents", []))
    return [line for key in keys for line in stored(bucket, key).splitlines()]


def test_records_roll_by_size_and_by_time_and_read_back_in_order(out: Bucket) -> None:
    records = [{"n": i, "prompt": f"question {i}", "latency_ms": i / 7} for i in range(600)]
    with Appender("/out/logs/req", max_bytes=4096, max_seconds=600) as log:
        log.append_many(records[:100])
        for record in records[100:]:
            log.append(record)
        rolled = logs.segments("/out/logs/req")
        assert len(rolled) >= 5, "segments are files while the appender runs"
        assert list(logs.read("/out/logs/req")) == records[: sum(len(logs.lines(s)) for s in rolled)]
    assert list(logs.read("/out/logs/req")) == records
    assert not list(logs.wal_dir("/out/logs/req", Settings.from_env()).iterdir()), "no WAL file left"

    with Appender("/out/logs/slow", max_seconds=0.3) as log:
        log.append({"n": 1})
        log.append(b'{"n": 2}')
        eventually(lambda: committed("/out/logs/slow") == 1, "the timer commits the segment")
        assert [s.size for s in logs.segments("/out/logs/slow")] == [len(b'{"n":1}\n{"n": 2}\n')]

    gpufeed.sync("/out")
    expected = [msgspec.json.encode(record) for record in records]
    assert store_lines(out, "logs/req/") == expected, "the store holds every record once, in order"
    for segment in logs.segments("/out/logs/req"):
        key = segment.path.removeprefix("/out/")
        assert stored(out, key) == gpufeed.read(segment.path)
        assert key.endswith(".jsonl") and f"-{os.getpid()}-" in key


def test_bad_records_and_paths_are_refused(out: Bucket, tmp_path: os.PathLike[str]) -> None:
    os.mkdir(f"{tmp_path}/ro")
    Namespace().add_mount("/ro", f"file://{tmp_path}/ro", {}, allow_empty=True)
    assert gpufeed.logs.Appender is Appender, "reachable after a bare import gpufeed"
    with Appender("/out/x") as log:
        with pytest.raises(InvalidArgument, match="contains a newline"):
            log.append("two\nlines")
        log.append("one line")
    assert list(logs.read("/out/x", decode=None)) == [b"one line"], "the refused record is not there"
    assert list(logs.read("/out/x")) == [b"one line"], "a line that is not JSON comes back as it was"
    with pytest.raises(NotADirectory, match="is a file"):
        Appender(logs.segments("/out/x")[0].path)
    with pytest.raises(PathNotFound, match="no mount contains"):
        Appender("/nowhere/logs")
    with pytest.raises(ReadOnlyMount, match="mount it with --writable"):
        Appender("/ro/logs")


def test_killed_appenders_lose_no_acknowledged_record_and_duplicate_none(out: Bucket) -> None:
    rng = random.Random(17)
    acknowledged: list[int] = []
    started: list[int] = []
    for round_ in range(5):
        first = round_ * 1_000_000
        started.append(first)
        child = subprocess.Popen([sys.executable, "-c", APPENDER, "/out/crash", str(first)], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        for _ in range(rng.randint(1, 300)):
            acknowledged.append(int(child.stdout.readline()))
        if round_ == 2:  # the agent dies under the appender; its next commits start another
            killed(AgentClient(Settings.from_env()).hello().pid)
            gpufeed._default = None
            for _ in range(rng.randint(100, 200)):
                acknowledged.append(int(child.stdout.readline()))
        child.send_signal(signal.SIGKILL)
        acknowledged.extend(int(line) for line in child.stdout.read().split())  # printed before the kill
        child.wait(timeout=10)
        child.stdout.close()

    left = list(logs.wal_dir("/out/crash", Settings.from_env()).iterdir())
    assert left, "the last appender died with records in its WAL"
    for wal in left:  # as if killed in the middle of writing one more
        with open(wal, "ab") as torn:
            torn.write(b'{"n": 999999')
    # each round's Appender recovered the rounds before; the command recovers the last one
    recovered = gpufeed_cli("logs", "recover", "/out/crash")
    assert recovered.returncode == 0 and recovered.stdout.startswith("recovered /out/crash: "), recovered
    assert logs.recover("/out/crash") == 0, "nothing left to recover"
    found = Counter(record["n"] for record in logs.read("/out/crash"))  # a torn line would not decode
    assert not [n for n, count in found.items() if count > 1], "no record twice"
    assert set(acknowledged) <= set(found), f"lost: {sorted(set(acknowledged) - set(found))[:10]}"
    for first in started:  # each round appended its numbers in order: at most the one in flight unacknowledged
        ours = sorted(n for n in found if first <= n < first + 1_000_000)
        assert ours == list(range(first, first + len(ours)))
        assert len(ours) - len([n for n in acknowledged if first <= n < first + 1_000_000]) <= 1
    gpufeed.sync("/out")
    assert sorted(msgspec.json.decode(line)["n"] for line in store_lines(out, "crash/")) == sorted(found)


def test_logs_tail_prints_the_last_records_and_follows(out: Bucket) -> None:
    with Appender("/out/serve", max_bytes=100) as log:
        log.append_many({"n": i} for i in range(50))
    commands = [("-n", "3"), ("-n", "1000"), ("/out/absent",), ("/elsewhere/logs",), ("-n", "-1"), ("/out",)]
    with ThreadPoolExecutor(len(commands)) as pool:  # one CLI start-up is over a second here: run them side by side
        last3, last1000, absent, elsewhere, negative, not_a_log = pool.map(lambda args: cli_tail(*args), commands)
    assert ok_lines(not_a_log) == [] and "/out: no committed log segments (*.jsonl) here yet" in not_a_log.stderr
    assert ok_lines(last3) == ['{"n":47}', '{"n":48}', '{"n":49}']
    assert len(ok_lines(last1000)) == 50
    assert one_error(absent, 1).endswith("/out/absent: no such log directory (no segment committed yet?)")
    assert "no mount contains this path" in one_error(elsewhere, 1)
    assert "-n must be >= 0" in one_error(negative, 2)

    argv = [sys.executable, "-m", "gpufeed", "logs", "tail", "/out/serve", "-n", "1", "-f", "--interval", "0.1"]
    follow = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert follow.stdout is not None
        assert follow.stdout.readline() == '{"n":49}\n'
        with Appender("/out/serve") as log:
            log.append({"n": 50})
        assert select.select([follow.stdout], [], [], 30)[0], "the new segment is printed"
        assert follow.stdout.readline() == '{"n":50}\n'
    finally:
        follow.kill()
        follow.wait()
        assert follow.stdout is not None
        follow.stdout.close()


def cli_tail(*args: str) -> subprocess.CompletedProcess[str]:
    """`gpufeed logs tail` of /out/serve, or of the path given first."""
    path, rest = (args[0], args[1:]) if args[0].startswith("/") else ("/out/serve", args)
    return gpufeed_cli("logs", "tail", path, *rest)


def ok_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def one_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one stderr line of a failed command, after checking the CLI's error contract."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == code and len(lines) == 1 and lines[0].startswith("gpufeed: error: "), result
    return lines[0]
