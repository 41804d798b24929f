"""Readers hold block files open between hits; the agent's deletions make them let go, so
evicted or cleared blocks free their space while the readers keep reading."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import pytest

from gpufeed.agent.client import HIT_CHECK_EVERY, AgentClient
from gpufeed.cache.openfiles import capacity_for
from gpufeed.client import Client
from gpufeed.namespace import Namespace
from tests.agent.test_agent import make_files


def block_fds() -> list[str]:
    """What this process's open descriptors under a cache's blocks dir point to."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "/blocks/" in target:
            links.append(target)
    return links


def deleted(links: list[str]) -> list[str]:
    return [link for link in links if link.endswith(" (deleted)")]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, bytes]:
    data = make_files(tmp_path / "src", 40, 5_000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    return data


def read_all(client: Client, files: dict[str, bytes], names: list[str] | None = None) -> None:
    for name in names or sorted(files):
        assert client.read(f"/data/{name}") == files[name]


def test_a_reader_holds_at_most_its_limit(files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFEED_OPEN_BLOCKS", "5")
    client = Client()
    before = len(block_fds())
    for _ in range(2):
        read_all(client, files)
    assert len(block_fds()) - before == 5
    client.close()
    assert len(block_fds()) == before


def test_a_cleared_cache_is_let_go_at_the_next_open(files: dict[str, bytes]) -> None:
    client = Client()
    *held, last = sorted(files)
    read_all(client, files, held)
    AgentClient(client.settings).request({"op": "clear"})
    assert len(deleted(block_fds())) == len(held), "held until this reader looks"
    read_all(client, files, [last])  # a file it never opened: opening it looks
    assert deleted(block_fds()) == []
    client.close()


def test_a_reader_that_only_hits_lets_go_within_a_few_dozen_hits(files: dict[str, bytes]) -> None:
    reader, other = Client(), Client()
    read_all(reader, files)
    AgentClient(reader.settings).request({"op": "clear"})
    read_all(other, files)  # the blocks are back, as new files; the reader still holds the old
    assert len(deleted(block_fds())) >= len(files)
    names = sorted(files)
    for i in range(HIT_CHECK_EVERY):
        read_all(reader, files, [names[i % len(names)]])  # hits on held (deleted) files: right bytes
    assert deleted(block_fds()) == []
    reader.close()
    other.close()


def test_the_limit_leaves_most_descriptors_to_the_program() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (100, hard))
    try:
        assert capacity_for(4096) == 25
        assert capacity_for(10) == 10
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
