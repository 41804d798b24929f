"""The node agent with real processes: races, kill -9, corruption, quotas, a full disk."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import gpufeed
from gpufeed.bench.shaper import shaping
from gpufeed.client import Client
from gpufeed.client.connection import AgentClient, AgentUnavailable, connect, gone, stop_agent
from gpufeed.config import Settings
from gpufeed.errors import ObjectChanged
from gpufeed.namespace import Namespace
from gpufeed.rpc import codec
from gpufeed.rpc.messages import Done, Hello, Shutdown
from tests.agent.test_metrics import agent_metrics
from tests.conftest import Bucket, HttpServer


def make_files(root: Path, count: int, size: int) -> dict[str, bytes]:
    root.mkdir(parents=True, exist_ok=True)
    files = {}
    for i in range(count):
        data = os.urandom(size + i)
        (root / f"{i:05d}.bin").write_bytes(data)
        files[f"{i:05d}.bin"] = data
    return files


def stats() -> dict:
    return AgentClient(Settings.from_env()).stats()


def block_files(cache: Path) -> list[Path]:
    return sorted((cache / "blocks").rglob("*-*"))


def agent_pids(cache: Path) -> list[int]:
    """Live agent processes (`python -m gpufeed.agent`) serving `cache` (zombies excluded)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().split(") ")[1].split()[0]
        except OSError:
            continue
        if state != "Z" and b"gpufeed.agent" in cmdline and str(cache).encode() in cmdline:
            pids.append(int(proc.name))
    return pids


def run_python(code: str, **popen: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], **popen)  # type: ignore[call-overload]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, bytes]:
    data = make_files(tmp_path / "src", 40, 20_000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    return data


def test_cold_then_warm_reads_are_right_and_counted(files: dict[str, bytes], gpufeed_home: Path) -> None:
    for name, data in files.items():
        assert gpufeed.read(f"/data/{name}") == data
    cold = stats()
    assert (cold.misses, cold.blocks) == (40, 40)
    assert cold.bytes_fetched == sum(map(len, files.values()))
    for name, data in files.items():
        assert gpufeed.read(f"/data/{name}", 100, 1000) == data[100:1100]
    gpufeed.client().hits.flush()
    warm = stats()
    assert (warm.misses, warm.hits) == (40, 40)


def test_hits_need_no_agent(files: dict[str, bytes], gpufeed_home: Path) -> None:
    client = Client()
    for name in files:
        client.read(f"/data/{name}")
    AgentClient(client.settings).request(Shutdown(), Done)
    deadline = time.monotonic() + 10
    while connect(gpufeed_home / "cache") is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    for name, data in files.items():
        assert client.read(f"/data/{name}") == data
    client.hits.flush()
    assert connect(gpufeed_home / "cache") is None, "hits and hit reports never start an agent"


def test_an_agent_dying_at_the_handshake_is_replaced_not_taken_for_another_release(
    files: dict[str, bytes], gpufeed_home: Path
) -> None:
    """An agent killed with kill -9 keeps its socket until its last thread has exited: a reader
    that connects in that moment sees the connection closed. It starts a new agent and reads
    through it, instead of reading uncached as if an old release were running."""
    dying = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dying.bind(codec.address(gpufeed_home / "cache"))
    dying.listen()

    def die() -> None:
        conn, _ = dying.accept()
        conn.close()
        dying.close()

    threading.Thread(target=die, daemon=True).start()
    client = Client()
    for name, data in files.items():
        assert client.read(f"/data/{name}") == data
    assert stats().misses == len(files), "every read went through a new agent"
    assert len(block_files(gpufeed_home / "cache")) == len(files)


def test_an_agent_of_another_release_is_left_alone_with_one_warning(
    files: dict[str, bytes], gpufeed_home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After an upgrade the old agent may still run: readers read uncached instead of
    exchanging messages either side could misread, and say how to replace it."""
    started = subprocess.run([sys.executable, "-m", "gpufeed", "agent", "start"], capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    current = codec.VERSION
    monkeypatch.setattr(codec, "VERSION", current + 1)  # this reader is the newer release
    client = Client()
    with caplog.at_level("WARNING", logger="gpufeed"):
        for name, data in files.items():
            assert client.read(f"/data/{name}") == data
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "another gpufeed release" in warnings[0] and "gpufeed agent stop" in warnings[0]
    monkeypatch.setattr(codec, "VERSION", current)
    assert (stats().misses, block_files(gpufeed_home / "cache")) == (0, []), "nothing went through the old agent"
    stopped = subprocess.run([sys.executable, "-m", "gpufeed", "agent", "stop"], capture_output=True, text=True)
    assert stopped.returncode == 0 and connect(gpufeed_home / "cache") is None


def test_multi_block_objects_and_small_blocks(tmp_path: Path) -> None:
    data = os.urandom(10 * 4096 + 7)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "obj").write_bytes(data)
    Namespace().add_mount("/big", f"file://{tmp_path / 'big'}", {"block_size": "4KiB"})
    assert gpufeed.read("/big/obj", 4000, 9000) == data[4000:13000]
    assert stats().blocks == 4, "only the blocks [4000, 13000) touches"
    assert gpufeed.read("/big/obj") == data
    assert stats().blocks == 11


def test_one_agent_however_many_clients_race(tmp_path: Path, gpufeed_home: Path) -> None:
    code = """
        from gpufeed.client.connection import AgentClient
        from gpufeed.config import Settings
        print(AgentClient(Settings.from_env()).hello().pid)
    """
    racers = [run_python(code, stdout=subprocess.PIPE, text=True) for _ in range(8)]
    pids = {int(p.communicate(timeout=60)[0]) for p in racers}
    assert len(pids) == 1
    deadline = time.monotonic() + 30  # agents that lost the lock race exit as soon as they try it
    while len(agent_pids(gpufeed_home / "cache")) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent_pids(gpufeed_home / "cache") == list(pids)


def test_idle_agent_exits(files: dict[str, bytes], gpufeed_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFEED_AGENT_IDLE_TIMEOUT", "1")
    reader = run_python("import gpufeed; gpufeed.read('/data/00000.bin')")
    assert reader.wait(timeout=60) == 0
    deadline = time.monotonic() + 20
    while agent_pids(gpufeed_home / "cache") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert agent_pids(gpufeed_home / "cache") == []
    assert not (gpufeed_home / "cache" / "agent.json").exists()


def test_kill_9_agent_during_cold_read_loop(tmp_path: Path, gpufeed_home: Path) -> None:
    expected = make_files(tmp_path / "many", 600, 3000)
    Namespace().add_mount("/many", f"file://{tmp_path / 'many'}")
    reader = run_python(
        """
        import hashlib, sys, gpufeed
        names = sorted(n.path for n in gpufeed.ls("/many"))
        for i, name in enumerate(names):
            print(i, name, hashlib.sha256(gpufeed.read(name)).hexdigest(), flush=True)
        """,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdout is not None
    seen: dict[str, str] = {}
    killed: set[int] = set()
    for line in reader.stdout:
        i, name, digest = line.split()
        seen[name] = digest
        if int(i) in (50, 250, 450):
            for pid in agent_pids(gpufeed_home / "cache"):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
    assert reader.wait(timeout=60) == 0
    assert len(killed) >= 2, "the loop outlived several agents"
    assert seen == {f"/many/{k}": hashlib.sha256(v).hexdigest() for k, v in expected.items()}


def test_corrupted_block_is_repaired(files: dict[str, bytes], gpufeed_home: Path) -> None:
    data = files["00003.bin"]
    assert gpufeed.read("/data/00003.bin") == data
    [block] = block_files(gpufeed_home / "cache")
    raw = bytearray(block.read_bytes())
    raw[-100] ^= 0xFF
    block.write_bytes(bytes(raw))
    assert gpufeed.read("/data/00003.bin") == data
    assert stats().repairs == 1
    os.truncate(block, 50)
    assert gpufeed.read("/data/00003.bin") == data
    assert stats().repairs == 2


def test_quota_smaller_than_working_set(files: dict[str, bytes], gpufeed_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quota = 200_000
    monkeypatch.setenv("GPUFEED_CACHE_SIZE", str(quota))
    for _ in range(2):
        for name, data in files.items():
            assert gpufeed.read(f"/data/{name}") == data
        on_disk = sum(p.stat().st_size for p in block_files(gpufeed_home / "cache"))
        assert on_disk <= quota
    info = stats()
    assert info.bytes <= quota and info.evictions > 0


def test_a_lowered_quota_is_met_when_the_agent_starts(
    files: dict[str, bytes], gpufeed_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quota lowered for the next agent (to give a disk back) is met once it serves, not only
    once a new block is cached: a quota below one block would otherwise never evict anything."""
    for name, data in files.items():
        assert gpufeed.read(f"/data/{name}") == data
    assert stats().bytes > 300_000
    stop_agent(Settings.from_env())
    monkeypatch.setenv("GPUFEED_CACHE_SIZE", "100000")
    info = stats()
    on_disk = sum(p.stat().st_size for p in block_files(gpufeed_home / "cache"))
    assert info.bytes <= 100_000 and on_disk == info.bytes and info.evictions > 0
    assert gpufeed.read("/data/00000.bin") == files["00000.bin"]


def test_cache_off_mount_writes_no_blocks(tmp_path: Path, gpufeed_home: Path) -> None:
    make_files(tmp_path / "nc", 3, 100)
    Namespace().add_mount("/nc", f"file://{tmp_path / 'nc'}", {"cache": "off"})
    assert len(gpufeed.read("/nc/00001.bin")) == 101
    assert block_files(gpufeed_home / "cache") == []


def test_a_cache_dir_that_is_a_file_is_named_and_reads_go_on(tmp_path: Path, files: dict[str, bytes]) -> None:
    (tmp_path / "cache").write_bytes(b"someone's file")
    env = {**os.environ, "GPUFEED_CACHE_DIRS": str(tmp_path / "cache")}
    read = subprocess.run([sys.executable, "-m", "gpufeed", "cat", "/data/00001.bin"], capture_output=True, env=env, timeout=120)
    assert (read.returncode, read.stdout) == (0, files["00001.bin"])
    assert read.stderr.decode() == (
        f"gpufeed: warning: cache dir {tmp_path / 'cache'}: not a directory (a file is in the way); reading without the cache\n"
    )
    assert (tmp_path / "cache").read_bytes() == b"someone's file"


def test_a_cache_dir_that_cannot_be_made_is_tried_once_not_per_read(
    files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A home the agent cannot use (read-only, gone): each new file would otherwise try to make
    the cache dir again, three times with pauses between (0.35 s a file)."""
    from gpufeed.client import connection

    tries: list[Path] = []
    make = connection.make_cache_dir
    monkeypatch.setattr(connection, "make_cache_dir", lambda primary: (tries.append(primary), make(primary)))
    monkeypatch.setenv("GPUFEED_CACHE_DIRS", "/proc/no-such-cache")
    client = Client()
    for name, data in files.items():
        assert client.read(f"/data/{name}") == data
    assert tries == [Path("/proc/no-such-cache")]
    assert [record.getMessage() for record in caplog.records] == [
        "gpufeed: warning: cannot start the agent for /proc/no-such-cache: No such file or directory; reading without the cache"
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="making the home read-only takes a bind mount: root")
def test_a_read_only_home_still_reads_the_blocks_cached_there(
    tmp_path: Path, files: dict[str, bytes], gpufeed_home: Path
) -> None:
    """A home that became read-only (or a cache baked into an image): no agent can start, but
    the blocks cached there are read, checked as every hit is; the rest comes from the store."""
    for name in ("00001.bin", "00002.bin"):
        assert gpufeed.read(f"/data/{name}") == files[name]
    stop_agent(Settings.from_env())
    (tmp_path / "src" / "00001.bin").unlink()  # only the cache has it now
    subprocess.run(["mount", "--bind", str(gpufeed_home), str(gpufeed_home)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(gpufeed_home)], check=True)
        read = subprocess.run([sys.executable, "-m", "gpufeed", "cat", "/data/00001.bin", "/data/00003.bin"],
                              capture_output=True, timeout=120)
        assert (read.returncode, read.stdout) == (0, files["00001.bin"] + files["00003.bin"]), read.stderr
        assert read.stderr.decode().strip() == (
            f"gpufeed: warning: cannot start the agent for {gpufeed_home / 'cache'}: Read-only file system; reading the "
            f"blocks cached in {gpufeed_home / 'cache'} without it, the rest from the store"
        )
        listed = subprocess.run([sys.executable, "-m", "gpufeed", "cache", "ls", "/data"], capture_output=True, text=True,
                                timeout=120)
        assert listed.returncode == 0, listed.stderr
        shares = {line.split()[-1]: line.split()[0] for line in listed.stdout.splitlines()}
        assert (shares["/data/00002.bin"], shares["/data/00003.bin"]) == ("100.0%", "0.0%"), listed.stdout
    finally:
        subprocess.run(["umount", str(gpufeed_home)], check=True)


def test_full_filesystem_serves_uncached_with_one_warning(tmp_path: Path, files: dict[str, bytes]) -> None:
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(tiny)], check=True)
    try:
        filler = os.open(tiny / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(filler, b"\0" * 4096):
                pass
        except OSError:
            pass
        os.close(filler)
        reader = run_python(
            """
            import json, gpufeed
            print(json.dumps({n.path: gpufeed.read(n.path).hex() for n in gpufeed.ls("/data")}))
            """,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GPUFEED_CACHE_DIRS": str(tiny / "cache")},
        )
        out, err = reader.communicate(timeout=120)
        assert reader.returncode == 0, err
        assert json.loads(out) == {f"/data/{k}": v.hex() for k, v in files.items()}
        warnings = [line for line in err.splitlines() if "warning" in line]
        assert len(warnings) == 1 and "cannot hold more blocks" in warnings[0], err
    finally:
        stop_agent(dataclasses.replace(Settings.from_env(), cache_dirs=(tiny / "cache",)))
        subprocess.run(["umount", "-l", str(tiny)], check=False)


def test_a_short_write_on_a_full_disk_shrinks_the_cache_to_what_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A block written short because the disk filled up is disk-full, not a failed read: the
    partial file goes, the cache evicts, reads are served uncached with one warning, and
    every read is right. (The evicted files' space comes back once this reader lets go of the
    files it holds, `cache.openfiles`.)"""
    files = make_files(tmp_path / "src", 8, 100_000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tiny)], check=True)
    settings = dataclasses.replace(Settings.from_env(), cache_dirs=(tiny / "cache",))
    try:
        with open(tiny / "filler", "wb") as filler:
            filler.write(b"\0" * (1024 * 1024 - 250 * 1024))  # room for two blocks, and part of a third
        monkeypatch.setenv("GPUFEED_CACHE_DIRS", str(tiny / "cache"))
        monkeypatch.setenv("GPUFEED_CACHE_FREE_RATIO", "0")
        client = Client()
        with caplog.at_level("WARNING", logger="gpufeed"):
            for _ in range(2):
                for name, data in files.items():
                    assert client.read(f"/data/{name}") == data
        info = client.agent.stats()
        assert info.evictions > 0 and info.uncached > 0 and info.bytes <= 250 * 1024
        assert list((tiny / "cache" / "tmp").iterdir()) == [], "no partial block left behind"
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "cannot hold more blocks" in warnings[0]
    finally:
        stop_agent(settings)
        subprocess.run(["umount", "-l", str(tiny)], check=False)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "prefetching"])
def test_sigterm_stops_the_agent_cleanly(tmp_path: Path, gpufeed_home: Path, busy: bool) -> None:
    """A service manager's SIGTERM ends the agent with exit code 0 and nothing in its log but
    the start and stop lines, even with a reader connected and prefetches queued."""
    make_files(tmp_path / "src", 400, 50_000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    client = Client()
    client.read("/data/00000.bin")
    if busy:
        handles = [client.handle(f"/data/{i:05d}.bin") for i in range(1, 400)]
        client.fetches.prefetch([(handle, [0]) for handle in handles], "job")
    pid = client.agent.stats().pid
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone(pid) and connect(gpufeed_home / "cache") is None
    log = (gpufeed_home / "cache" / "agent.log").read_text()
    assert "Traceback" not in log and "Error" not in log, log
    assert f"agent {pid} stopped" in log


def test_an_agent_whose_cache_dir_is_removed_exits_and_the_next_reader_starts_another(tmp_path: Path, gpufeed_home: Path) -> None:
    """`rm -rf` of the cache dir under a serving agent: the agent exits with one line in its
    log, rather than refusing every reader's handshake until it is killed by hand, and the
    next read starts an agent that makes the dir again."""
    files = make_files(tmp_path / "src", 2, 1000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    assert Client().read("/data/00000.bin") == files["00000.bin"]
    pid = stats().pid
    shutil.rmtree(gpufeed_home / "cache")
    deadline = time.monotonic() + 30
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone(pid)
    client = Client()
    assert client.read("/data/00001.bin") == files["00001.bin"]
    assert client.agent.stats().pid != pid and block_files(gpufeed_home / "cache")


def test_single_flight_across_processes_and_threads(nginx: HttpServer, tmp_path: Path) -> None:
    site = nginx.root / f"sf-{tmp_path.name}"
    expected = make_files(site, 120, 2000)
    Namespace().add_mount("/web", f"{nginx.url}/{site.name}")
    log = nginx.access_log
    before = log.read_text().count(f"GET /{site.name}/0")
    code = """
        import hashlib, sys, threading, gpufeed
        names = sorted(n.path for n in gpufeed.ls("/web"))
        client = gpufeed.client()
        results = {}
        def run(offset):
            order = names[offset:] + names[:offset]
            results[offset] = {n: hashlib.sha256(client.read(n)).hexdigest() for n in order}
        threads = [threading.Thread(target=run, args=(k * 7,)) for k in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert results[0] == results[7]
        print(len(results[0]))
    """
    readers = [run_python(code, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    assert [int(r.communicate(timeout=120)[0]) for r in readers] == [120] * 3
    time.sleep(0.2)  # nginx writes its access log line after the response; let the last lines land
    gets = log.read_text().count(f"GET /{site.name}/0") - before
    assert gets == len(expected) == 120


def test_an_agent_reading_http_objects_never_loads_the_index_crawler(nginx: HttpServer, tmp_path: Path) -> None:
    """aiohttp (0.25 s of CPU to import) is for crawling index pages, which readers never do:
    an agent that only fetched objects has not mapped it."""
    site = nginx.root / f"lean-{tmp_path.name}"
    expected = make_files(site, 3, 2000)
    Namespace().add_mount("/web", f"{nginx.url}/{site.name}")
    assert {name: gpufeed.read(f"/web/{name}") for name in expected} == expected
    maps = Path(f"/proc/{gpufeed.client().agent.stats(start=False).pid}/maps").read_text()
    assert "/obstore/" in maps and "/aiohttp/" not in maps


def test_immutable_and_strict_mounts_never_share_blocks(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    make_files(root, 1, 5000)
    Namespace().add_mount("/imm", f"file://{root}", immutable=True)
    Namespace().add_mount("/strict", f"file://{root}")
    (root / "00000.bin").write_bytes(b"version two " * 417)
    assert gpufeed.read("/imm/00000.bin").startswith(b"version two"), "immutable: no version check"
    with pytest.raises(ObjectChanged):
        gpufeed.read("/strict/00000.bin")


def test_a_short_read_from_the_source_is_never_published(tmp_path: Path) -> None:
    root = tmp_path / "shrinks"
    make_files(root, 1, 100_000)
    Namespace().add_mount("/s", f"file://{root}", {"verify": "never"}, immutable=True)
    os.truncate(root / "00000.bin", 30_000)
    with pytest.raises(ObjectChanged, match="it is 30000 bytes now"):
        gpufeed.read("/s/00000.bin", 1000, 16)
    assert stats().blocks == 0


def test_a_block_deleted_behind_the_agents_back_is_fetched_again(files: dict[str, bytes], gpufeed_home: Path) -> None:
    assert gpufeed.read("/data/00007.bin") == files["00007.bin"]
    [block] = block_files(gpufeed_home / "cache")
    block.unlink()
    assert gpufeed.read("/data/00007.bin") == files["00007.bin"], "this process still holds the file"
    other = run_python("import gpufeed, sys; sys.stdout.buffer.write(gpufeed.read('/data/00007.bin'))", stdout=subprocess.PIPE)
    assert other.communicate(timeout=60)[0] == files["00007.bin"]  # one that holds nothing asks the agent
    assert block.exists() and stats().misses == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_another_user_cannot_use_the_agent(files: dict[str, bytes], gpufeed_home: Path) -> None:
    gpufeed.read("/data/00001.bin")
    child = os.fork()
    if child == 0:  # become nobody, then ask the agent for its stats
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = connect(gpufeed_home / "cache", 5)
            assert sock is not None
            sock.sendall(codec.frame(Hello(codec.VERSION)))
            codec.recv_reply(sock)
        except ConnectionError:
            code = 7
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 7, "the agent answered another user"
    assert oct((gpufeed_home / "cache").stat().st_mode & 0o777) == "0o700"


def test_threads_racing_to_start_the_agent_spawn_it_once(gpufeed_home: Path) -> None:
    import threading

    client = AgentClient(Settings.from_env())
    pids: list[int] = []
    threads = [threading.Thread(target=lambda: pids.append(client.stats().pid)) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(pids)) == 1 and len(pids) == 16
    log = (gpufeed_home / "cache" / "agent.log").read_text()
    assert log.count("serving") == 1 and "already serves" not in log, "one process was started, not sixteen"


def test_the_agent_reads_with_the_callers_credentials(bucket: Bucket, gpufeed_home: Path) -> None:
    """An agent started without credentials (a service, or started by another shell) still
    fetches for a reader that has them: the reader sends its own with each request."""
    bucket.put("k.bin", b"payload")
    Namespace().add_mount("/s3", bucket.url, {"endpoint": bucket.endpoint})
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    started = subprocess.run([sys.executable, "-m", "gpufeed", "agent", "start"], env=env, capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    assert gpufeed.read("/s3/k.bin") == b"payload"
    assert stats().misses == 1, "the agent fetched it"


def test_a_malformed_message_ends_its_connection_only(files: dict[str, bytes], gpufeed_home: Path) -> None:
    """Messages are typed: a frame that is not one (or a request before Hello) is refused whole,
    that connection closes, and the agent goes on serving everyone else."""
    assert gpufeed.read("/data/00001.bin") == files["00001.bin"]
    for first, then in [(Hello(codec.VERSION), b"\x92\x01\x02"), (None, codec.frame(Shutdown())[4:])]:
        sock = connect(gpufeed_home / "cache", 5)
        assert sock is not None
        if first is not None:
            sock.sendall(codec.frame(first))
            codec.recv_reply(sock)
        sock.sendall(len(then).to_bytes(4, "little") + then)
        with pytest.raises(ConnectionResetError):
            codec.recv_reply(sock)
        sock.close()
    assert Client().read("/data/00002.bin") == files["00002.bin"]
    assert stats().pid == AgentClient(Settings.from_env()).hello().pid, "the same agent, still serving"


def _metric(key: tuple[str, tuple[tuple[str, str], ...]]) -> float:
    """One of the agent's metrics; 0 while no agent runs yet."""
    try:
        return agent_metrics().get(key, 0.0)
    except AgentUnavailable:
        return 0.0


def test_a_reader_that_hangs_up_mid_fetch_leaves_the_block_to_the_next(nginx: HttpServer, tmp_path: Path) -> None:
    """Reader A asks for a slow block and is killed while it is fetched; reader B, waiting for the
    same block, gets it (the agent fetches it for B) with no error in the agent's log."""
    site = nginx.root / f"hangup-{tmp_path.name}"
    site.mkdir()
    body = os.urandom(3 << 20)
    (site / "slow.bin").write_bytes(body)
    upstream = urlsplit(nginx.url)
    with shaping((upstream.hostname or "127.0.0.1", upstream.port or 80), 20, 2, tmp_path / "shaper.log") as port:
        Namespace().add_mount("/slow", f"http://127.0.0.1:{port}/{site.name}")
        first = run_python('import gpufeed; gpufeed.read("/slow/slow.bin")')
        deadline = time.monotonic() + 20
        while not _metric(("gpufeed_fetches_in_flight", ())) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert agent_metrics()[("gpufeed_fetches_in_flight", ())] == 1, "reader A's fetch never started"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            second = pool.submit(Client().read, "/slow/slow.bin")
            while agent_metrics()[("gpufeed_requests_total", (("kind", "fetch"),))] < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            first.kill()
            first.wait()
            assert second.result(timeout=60) == body
        assert agent_metrics()[("gpufeed_requests_total", (("kind", "fetch"),))] == 2, "B's one request was answered"
    assert not [value for (name, _), value in agent_metrics().items() if name == "gpufeed_errors_total" and value]
    log = (Path(os.environ["GPUFEED_HOME"]) / "cache" / "agent.log").read_text()
    assert "Traceback" not in log and "rror" not in log, log
