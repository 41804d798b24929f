"""`gpufeed.verify` in process: large files hashed in chunks through one open file, and a
refresh during a verify records nothing in the dropped generation."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gpufeed import verify as verifying
from gpufeed.client import Client
from gpufeed.errors import MountConflict
from tests.conftest import HttpServer


def test_large_files_are_hashed_in_chunks(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verifying, "CHUNK", 1500)  # the 2000-byte dogs go through one open file, 1500 bytes a read
    client = Client()
    client.namespace.add_mount("/data", f"file://{dataset}")
    done = verifying.verify(client, verifying.listed(client, "/data"))
    assert (done.files, done.recorded, done.matched, done.mismatches) == (8, 8, 0, [])
    for name in ("train/dogs/2.jpg", "train/cats/0.jpg", "empty.bin"):
        expected = hashlib.sha256((dataset / name).read_bytes()).hexdigest()
        assert client.stat(f"/data/{name}").content_hash == f"sha256:{expected}"


def test_a_refresh_meanwhile_records_nothing(dataset: Path) -> None:
    client = Client()
    mount, _ = client.namespace.add_mount("/data", f"file://{dataset}")
    target = verifying.listed(client, "/data/train")
    client.namespace.refresh("/data")
    with pytest.raises(MountConflict, match="/data was refreshed meanwhile; run verify again"):
        verifying.verify(client, target)
    assert list(client.namespace.engine.walk(mount.generation, "")) == [], "nothing left in the old generation"
    assert all(item.content_hash is None for item in client.walk("/data"))


def test_verify_records_on_its_first_run_over_a_listing_without_versions(nginx: HttpServer, tmp_path: Path) -> None:
    """A `KEY SIZE` listing: the read pins each file's version, and its hash is recorded for
    that version on the first run."""
    import uuid

    name = f"t-{uuid.uuid4().hex[:8]}"
    (nginx.root / name).mkdir()
    for i in range(3):
        (nginx.root / name / f"{i}.bin").write_bytes(bytes([i]) * 5000)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{i}.bin 5000\n" for i in range(3)))
    client = Client()
    client.namespace.add_mount("/h", f"{nginx.url}/{name}", {"list": str(listing)})
    done = verifying.verify(client, verifying.listed(client, "/h"))
    assert (done.files, done.recorded, done.mismatches) == (3, 3, [])
    assert all(item.content_hash is not None for item in client.walk("/h"))
