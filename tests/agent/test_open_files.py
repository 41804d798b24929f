"""Readers hold block files open between hits; the agent's deletions make them let go, so
evicted or cleared blocks free their space while the readers keep reading."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from gpufeed.cache.openfiles import DELETIONS, capacity_for
from gpufeed.client import Client
from gpufeed.client.connection import AgentClient
from gpufeed.client.hit_reports import HIT_CHECK_EVERY
from gpufeed.namespace import Namespace
from tests.agent.test_agent import make_files


def block_fds() -> list[str]:
    """What this process's open descriptors under this test's cache point to."""
    blocks = os.path.join(os.environ["GPUFEED_HOME"], "cache", "blocks")
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(blocks):
            links.append(target)
    return links


def deleted(links: list[str]) -> list[str]:
    return [link for link in links if link.endswith(" (deleted)")]


REFETCH = "import gpufeed; [gpufeed.read(f.path) for f in gpufeed.ls('/data')]"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, bytes]:
    data = make_files(tmp_path / "src", 40, 5_000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    return data


def read_all(client: Client, files: dict[str, bytes], names: list[str] | None = None) -> None:
    for name in names or sorted(files):
        assert client.read(f"/data/{name}") == files[name]


def test_a_process_holds_at_most_its_limit_however_many_clients(files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFEED_OPEN_BLOCKS", "5")
    before = len(block_fds())
    clients = [Client(), Client()]
    for client in clients * 2:
        read_all(client, files)
    assert len(block_fds()) - before == 5


def test_a_cleared_cache_is_let_go_at_the_next_open(files: dict[str, bytes]) -> None:
    client = Client()
    *held, last = sorted(files)
    for _ in range(2):  # held from the second read
        read_all(client, files, held)
    AgentClient(client.settings).clear()
    assert len(deleted(block_fds())) == len(held), "held until this reader looks"
    read_all(client, files, [last])  # a file it never opened: opening it looks
    assert deleted(block_fds()) == []


def test_a_reader_that_only_hits_lets_go_within_a_few_dozen_hits(files: dict[str, bytes]) -> None:
    reader = Client()
    for _ in range(2):  # held from the second read
        read_all(reader, files)
    AgentClient(reader.settings).clear()
    other = subprocess.run([sys.executable, "-c", REFETCH], capture_output=True, text=True)
    assert other.returncode == 0, other.stderr  # the blocks are back, as new files; the reader holds the old
    assert len(deleted(block_fds())) >= len(files)
    names = sorted(files)
    for i in range(HIT_CHECK_EVERY):
        read_all(reader, files, [names[i % len(names)]])  # hits on held (deleted) files: right bytes
    assert deleted(block_fds()) == []


def test_a_forked_child_lets_go_of_the_parents_files_at_once(files: dict[str, bytes]) -> None:
    client = Client()
    for _ in range(2):  # held from the second read
        read_all(client, files)
    held = len(block_fds())
    assert held >= len(files)
    out, into = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(into, str(len(block_fds())).encode())
        os._exit(0)
    os.close(into)
    assert os.read(out, 100) == b"0"
    os.close(out)
    os.waitpid(child, 0)
    assert len(block_fds()) == held, "the parent keeps its own"
    del client
    assert block_fds() == [], "and lets go when no client reads the cache any more"


def test_a_wiped_count_makes_readers_hold_nothing(files: dict[str, bytes], gpufeed_home: Path) -> None:
    other = subprocess.run([sys.executable, "-c", REFETCH], capture_output=True, text=True)
    assert other.returncode == 0, other.stderr  # every file cached
    client = Client()
    *held, last = sorted(files)
    read_all(client, files, held)
    (gpufeed_home / "cache" / DELETIONS).unlink()  # as when the cache dir is wiped under a reader
    read_all(client, files, [last])  # a hit on a file it does not hold: opening it looks
    for _ in range(HIT_CHECK_EVERY):
        read_all(client, files, held[:1])
    read_all(client, files)
    assert block_fds() == []


def test_the_limit_leaves_most_descriptors_to_the_program() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard))
    try:
        assert capacity_for(4096) == 25
        assert capacity_for(10) == 10
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_what_a_hit_hands_out_is_a_copy_that_holds_no_file(files: dict[str, bytes]) -> None:
    client = Client()
    handle = client.handle("/data/00001.bin")
    client.read_range(handle, 0, handle.size)  # a miss: the agent fetches, this process reads it
    views = [client.read_range(handle, 100, 3000) for _ in range(3)]  # read again: it maps it
    assert len(block_fds()) == 1
    assert all(type(view.obj) is bytes and view == files["00001.bin"][100:3000] for view in views)
    AgentClient(client.settings).clear()
    read_all(client, files, ["00002.bin"])  # opening a file looks, and lets go of the rest
    assert deleted(block_fds()) == []
    assert views[0] == files["00001.bin"][100:3000]


def test_a_batch_bigger_than_the_open_file_limit(tmp_path: Path) -> None:
    """Results hold no descriptor: a batch of 300 hits reads fine in a process that may open 128."""
    make_files(tmp_path / "many", 300, 1000)
    Namespace().add_mount("/many", f"file://{tmp_path / 'many'}")
    code = """
        import resource, gpufeed
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        paths = sorted(f.path for f in gpufeed.ls("/many"))
        for _ in range(3):
            assert sum(map(len, gpufeed.client().read_files(paths))) == sum(1000 + i for i in range(300))
    """
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_threads_read_right_bytes_while_the_cache_is_cleared_under_them(files: dict[str, bytes]) -> None:
    """Held files are let go by one thread while others read from them: every read is right."""
    client = Client()
    failures: list[BaseException] = []
    done = threading.Event()

    def reader() -> None:
        try:
            while not done.is_set():
                read_all(client, files)
        except BaseException as exc:  # reported by the assert below
            failures.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for thread in threads:
        thread.start()
    agent = AgentClient(client.settings)
    cleared = 0
    for _ in range(10):
        read_all(Client(), files)
        cleared += agent.clear()
    done.set()
    for thread in threads:
        thread.join(timeout=60)
    assert failures == []
    assert cleared >= sum(map(len, files.values())), "the files were cached, and cleared under the readers"
    assert agent.stats().repairs == 0, "no file was misread as damaged"


def test_a_file_is_held_from_its_second_read(files: dict[str, bytes]) -> None:
    """Mapping a file costs more than one pread: a process that reads each cached file once (a
    DataLoader worker that lives one epoch) holds nothing; a file read again is held."""
    other = subprocess.run([sys.executable, "-c", REFETCH], capture_output=True, text=True)
    assert other.returncode == 0, other.stderr  # every file cached, by another process
    before = len(block_fds())
    client = Client()
    read_all(client, files)
    assert len(block_fds()) == before, "read once: nothing held"
    read_all(client, files)
    assert len(block_fds()) - before == len(files)
