"""Objects the manifest holds a content hash for: their bytes are never returned or cached
unchecked, whatever path they take (the agent, a full cache, cache=off, an immutable mount)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gpufeed.client import Client
from gpufeed.errors import ObjectChanged, ObjectCorrupted


def mount_hashed(tmp_path: Path, data: bytes, options: dict[str, str] | None = None, **kwargs: object) -> tuple[Client, Path]:
    root = tmp_path / "src"
    root.mkdir()
    (root / "a.bin").write_bytes(data)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(data).hexdigest()}  a.bin\n")
    client = Client()
    client.namespace.add_mount("/d", f"file://{root}", options or {}, checksums=str(sums), **kwargs)  # type: ignore[arg-type]
    assert client.stat("/d/a.bin").content_hash is not None
    return client, root


def test_an_immutable_hashed_object_that_grew_is_never_served(tmp_path: Path) -> None:
    client, root = mount_hashed(tmp_path, b"A" * 1000, immutable=True)
    (root / "a.bin").write_bytes(b"B" * 1001)
    with pytest.raises(ObjectChanged):
        client.read("/d/a.bin")
    assert client.agent.stats().blocks == 0, "nothing cached"


def test_a_part_of_a_hashed_object_read_past_the_cache_is_checked(tmp_path: Path) -> None:
    """cache=off: a 10-byte read is cut from one read of the whole object, checked against its
    hash, so a same-size change on an immutable mount is caught, not handed out."""
    client, root = mount_hashed(tmp_path, b"A" * 5000, {"cache": "off"}, immutable=True)
    assert client.read("/d/a.bin", 10, 10) == b"A" * 10
    (root / "a.bin").write_bytes(b"B" * 5000)
    with pytest.raises(ObjectCorrupted, match="the manifest says sha256:"):
        client.read("/d/a.bin", 10, 10)


def test_a_hashed_object_near_the_cache_size_is_not_evicted_by_its_own_arrival(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent fetches it whole and publishes it block by block; eviction leaves its blocks
    alone meanwhile, so the reader finds them all and reads nothing from the store itself."""
    monkeypatch.setenv("GPUFEED_CACHE_SIZE", "1MiB")
    data = bytes(range(256)) * 3906 + b"x" * 64
    client, _ = mount_hashed(tmp_path, data, {"block_size": "64KiB"})
    assert client.read("/d/a.bin") == data
    assert client.direct_bytes == 0 and client.agent.stats().evictions == 0
