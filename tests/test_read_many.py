"""Batch reads (`Client.read_many`): the bytes of every read, split at block bounds; a sparse
batch reads only what it wants from the source and leaves whole blocks to the agent; a dense
batch waits for the blocks; errors name the file."""

from __future__ import annotations

import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import gpufeed
from gpufeed.client import Client
from gpufeed.client.plan import SPARSE_FACTOR
from gpufeed.client.read_around import READ_AROUND_SHARE
from gpufeed.errors import ObjectChanged, ObjectMissing
from gpufeed.namespace import Namespace

BLOCK = 64 * 1024
BLOCKS = 16


def mount_big_file(tmp_path: Path) -> bytes:
    root = tmp_path / "src"
    root.mkdir()
    data = os.urandom(BLOCKS * BLOCK - 123)
    (root / "big.bin").write_bytes(data)
    Namespace().add_mount("/m", f"file://{root}", {"block_size": str(BLOCK)})
    return data


def cached(client: Client) -> int:
    return sum(size for _, size in client.cached_bytes("/m/big.bin"))


def test_a_batch_of_mixed_reads_returns_each_reads_bytes(tmp_path: Path) -> None:
    data = mount_big_file(tmp_path)
    client = gpufeed.client()
    handle = client.handle("/m/big.bin")
    assert bytes(client.read_range(handle, 0, 10)) == data[:10]  # block 0 is now a hit
    spans = [(5, 20), (BLOCK - 10, BLOCK + 10), (3 * BLOCK, 5 * BLOCK + 7), (len(data) - 5, len(data) + 100), (50, 50)]
    got = client.read_many([(handle, start, end) for start, end in spans])
    assert [bytes(piece) for piece in got] == [data[start:end] for start, end in spans]


def test_a_sparse_batch_reads_only_its_bytes_then_waits_for_the_blocks(tmp_path: Path) -> None:
    data = mount_big_file(tmp_path)
    client = gpufeed.client()
    handle = client.handle("/m/big.bin")
    spans = [(i * BLOCK + 100, i * BLOCK + 1100) for i in range(0, BLOCKS - 1, 2)]
    assert (BLOCKS // 2) * BLOCK >= SPARSE_FACTOR * 1000 * len(spans)
    assert 1000 * len(spans) <= READ_AROUND_SHARE * (BLOCKS // 2) * BLOCK < 2 * 1000 * len(spans)
    got = client.read_many([(handle, start, end) for start, end in spans])
    assert [bytes(piece) for piece in got] == [data[start:end] for start, end in spans]
    assert client.source_bytes == client.direct_bytes == 1000 * len(spans)
    # the same bytes again would pass the budget (READ_AROUND_SHARE of the blocks): now it waits
    again = client.read_many([(handle, start, end) for start, end in spans])
    assert [bytes(piece) for piece in again] == [data[start:end] for start, end in spans]
    assert client.direct_bytes == 1000 * len(spans)
    assert cached(client) == len(spans) * BLOCK
    before = client.source_bytes
    assert [bytes(piece) for piece in client.read_many([(handle, s, e) for s, e in spans])] == [data[s:e] for s, e in spans]
    assert client.source_bytes == before  # hits: nothing more from the source


def test_a_sparse_batch_past_the_budget_waits_for_its_blocks(tmp_path: Path) -> None:
    """Bytes read around are fetched twice (again in their blocks): a batch that would read
    around more than READ_AROUND_SHARE of the bytes of its blocks waits for them instead, so
    the store sends each byte once."""
    data = mount_big_file(tmp_path)
    client = gpufeed.client()
    handle = client.handle("/m/big.bin")
    spans = [(i * BLOCK, i * BLOCK + 2000) for i in range(0, BLOCKS - 1, 2)]
    assert (BLOCKS // 2) * BLOCK >= SPARSE_FACTOR * 2000 * len(spans), "sparse"
    assert 2000 * len(spans) > READ_AROUND_SHARE * (BLOCKS // 2) * BLOCK, "but past the budget"
    got = client.read_many([(handle, start, end) for start, end in spans])
    assert [bytes(piece) for piece in got] == [data[start:end] for start, end in spans]
    assert client.direct_bytes == 0 and client.source_bytes == len(spans) * BLOCK


def test_a_dense_batch_waits_for_the_blocks(tmp_path: Path) -> None:
    data = mount_big_file(tmp_path)
    client = gpufeed.client()
    handle = client.handle("/m/big.bin")
    spans = [(i * BLOCK, i * BLOCK + BLOCK // 2) for i in range(4)]
    got = client.read_many([(handle, start, end) for start, end in spans])
    assert [bytes(piece) for piece in got] == [data[start:end] for start, end in spans]
    assert client.source_bytes == 4 * BLOCK
    assert cached(client) == 4 * BLOCK


def test_small_reads_that_share_one_block_wait_for_it(tmp_path: Path) -> None:
    data = mount_big_file(tmp_path)
    client = gpufeed.client()
    handle = client.handle("/m/big.bin")
    spans = [(3 * BLOCK + k * 1000, 3 * BLOCK + k * 1000 + 100) for k in range(8)]
    got = client.read_many([(handle, start, end) for start, end in spans])
    assert [bytes(piece) for piece in got] == [data[start:end] for start, end in spans]
    assert client.source_bytes == BLOCK and client.direct_bytes == 0
    assert cached(client) == BLOCK


def test_a_sparse_batch_over_a_deleted_object_names_it(tmp_path: Path) -> None:
    mount_big_file(tmp_path)
    client = gpufeed.client()
    handle = client.handle("/m/big.bin")
    (tmp_path / "src" / "big.bin").unlink()
    with pytest.raises(ObjectMissing, match="/m/big.bin: deleted at the source"):
        client.read_many([(handle, i * BLOCK, i * BLOCK + 10) for i in range(4)])


def test_reads_by_path_remember_the_handle_until_a_refresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = mount_big_file(tmp_path)
    client = Client()
    lookups = []
    open_object = client.namespace.open_object
    monkeypatch.setattr(client.namespace, "open_object", lambda path: lookups.append(path) or open_object(path))
    for _ in range(3):
        assert client.read("/m/big.bin", 10, 100) == data[10:110]
    assert lookups == ["/m/big.bin"]
    changed = os.urandom(len(data))
    (tmp_path / "src" / "big.bin").write_bytes(changed)
    Namespace().refresh("/m")  # elsewhere: this client learns of it from its mount table (1 s) ...
    far = 5 * BLOCK
    assert client.read("/m/big.bin", far, 100) == changed[far : far + 100]  # ... or a failed read
    assert client.read_files(["/m/big.bin"])[0] == changed
    assert lookups == ["/m/big.bin"] * 2


def test_a_sparse_batch_read_from_async_code(tmp_path: Path) -> None:
    """A notebook runs an event loop in the thread that calls the (blocking) read API."""
    data = mount_big_file(tmp_path)
    client = gpufeed.client()
    handle = client.handle("/m/big.bin")
    spans = [(i * BLOCK, i * BLOCK + 10) for i in range(4)]

    async def in_a_loop() -> list[bytes]:
        return [bytes(piece) for piece in client.read_many([(handle, start, end) for start, end in spans])]

    assert asyncio.run(in_a_loop()) == [data[start:end] for start, end in spans]


def test_a_batch_bigger_than_one_agent_request_is_sent_in_several(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = mount_big_file(tmp_path)
    monkeypatch.setattr(sys.modules["gpufeed.client.fetches"], "FETCH_BATCH", 3)
    client = gpufeed.client()
    handle = client.handle("/m/big.bin")
    assert bytes(client.read_many([(handle, 0, len(data))])[0]) == data
    assert cached(client) == len(data) and client.direct_bytes == 0


def test_threads_share_the_remembered_handles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "many"
    root.mkdir()
    files = {f"f{i:03d}": os.urandom(100 + i) for i in range(64)}
    for name, content in files.items():
        (root / name).write_bytes(content)
    Namespace().add_mount("/many", f"file://{root}")
    monkeypatch.setattr(sys.modules["gpufeed.client.handles"], "HANDLE_CACHE", 4)  # evictions all the time
    client = Client()

    def read_all(offset: int) -> bool:
        names = list(files)[offset:] + list(files)[:offset]
        return all(client.read(f"/many/{name}") == files[name] for name in names * 3)

    with ThreadPoolExecutor(8) as threads:
        assert all(threads.map(read_all, range(0, 64, 8)))


def test_read_around_hints_pin_nothing(tmp_path: Path) -> None:
    mount_big_file(tmp_path)
    client = gpufeed.client()
    handle = client.handle("/m/big.bin")
    spans = [(i * BLOCK, i * BLOCK + 10) for i in range(0, BLOCKS, 2)]
    client.read_many([(handle, start, end) for start, end in spans])
    assert client.direct_bytes == 10 * len(spans)
    client.fetches.fetch([(handle, [i for i in range(0, BLOCKS, 2)], [])])  # the hinted blocks, now surely fetched
    assert client.agent.stats().pinned_bytes == 0


def test_a_short_read_from_the_source_is_an_error_not_zeros(tmp_path: Path) -> None:
    root = tmp_path / "imm"
    root.mkdir()
    (root / "x.bin").write_bytes(os.urandom(50_000))
    Namespace().add_mount("/imm", f"file://{root}", {"cache": "off"}, immutable=True)
    client = Client()
    handle = client.handle("/imm/x.bin")
    (root / "x.bin").write_bytes(os.urandom(20_000))  # "immutable", and yet it shrank
    with pytest.raises(ObjectChanged, match="/imm/x.bin: changed at the source"):
        client.read_many([(handle, 0, 10_000), (handle, 10_000, 50_000)])
