"""`gpufeed verify` and `mount add --checksums`, as a user runs them."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from gpufeed import verify as verifying
from gpufeed.client import Client
from gpufeed.namespace import Namespace
from tests.cli.test_cli import fails, gpufeed, ok


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_verify_records_then_matches(dataset: Path) -> None:
    ok("mount", "add", "/data", f"file://{dataset}")
    first = gpufeed("verify", "/data/train")
    assert first.returncode == 0, first.stderr
    assert "verified 6 files" in first.stdout and "6 hashes recorded, 0 matched, 0 mismatched" in first.stdout
    assert first.stderr.startswith("verify: 6/6 files"), "the progress line of a non-terminal"
    ns = Namespace()
    assert ns.stat("/data/train/dogs/1.jpg").content_hash == f"sha256:{sha256(dataset / 'train/dogs/1.jpg')}"
    assert ns.stat("/data/README").content_hash is None, "only what is under NSPATH"
    again = ok("verify", "/data")
    assert "verified 8 files" in again and "2 hashes recorded, 6 matched, 0 mismatched" in again


def test_verify_reports_each_mismatch_and_exits_1(dataset: Path, tmp_path: Path) -> None:
    wrong = "f" * 64
    right = sha256(dataset / "train/cats/1.jpg")
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{right}  train/cats/1.jpg\n{wrong}  ./train/cats/2.jpg\n{'0' * 64}  nowhere.bin\n")
    added = ok("mount", "add", "/data", f"file://{dataset}", "--checksums", str(sums))
    assert "6 listed files without a hash, 1 hash naming no listed object" in added
    shown = json.loads(ok("mount", "add", "/again", f"file://{dataset}", "--checksums", str(sums), "--json"))
    assert (shown["files"], shown["unhashed"], shown["unlisted"], shown["skipped"]) == (8, 6, 1, 0), "--json counts them too"
    result = gpufeed("verify", "/data/train/cats")
    assert result.returncode == 1, (result.stdout, result.stderr)
    [line] = [line for line in result.stderr.splitlines() if "mismatch" in line]
    assert "/data/train/cats/2.jpg" in line and f"sha256:{wrong}" in line
    assert "Traceback" not in result.stderr
    assert "1 hash recorded, 1 matched, 1 mismatched" in result.stdout


def _change_one_delete_one_and_verify(dataset: Path, nspath: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Change train/cats/1.jpg, delete train/dogs/2.jpg, verify: the run and its two mismatch lines."""
    (dataset / "train/cats/1.jpg").write_bytes(b"a new version, another size")
    (dataset / "train/dogs/2.jpg").unlink()
    result = gpufeed("verify", nspath)
    assert result.returncode == 1, (result.stdout, result.stderr)
    reported = ("gpufeed: mismatch: ", "gpufeed: not verified: ")
    failed = sorted(line for line in result.stderr.splitlines() if line.startswith(reported))
    assert len(failed) == 2, result.stderr
    return result, failed


def test_files_changed_or_deleted_at_the_source_are_reported_and_the_rest_still_checked(dataset: Path) -> None:
    ok("mount", "add", "/data", f"file://{dataset}")
    result, failed = _change_one_delete_one_and_verify(dataset, "/data/train")
    assert failed[0].startswith("gpufeed: not verified: /data/train/cats/1.jpg: the read failed: ")
    assert failed[1].startswith("gpufeed: not verified: /data/train/dogs/2.jpg: the read failed: ")
    assert "changed at the source" in failed[0] and "deleted at the source" in failed[1]
    assert "4 hashes recorded, 0 matched, 0 mismatched, 2 could not be read" in result.stdout, result.stdout
    shown = gpufeed("verify", "/data/train", "--json", "--quiet")
    assert shown.returncode == 1, shown.stderr
    counts = json.loads(shown.stdout)
    unread = sorted(m["path"] for m in counts["not_verified"])
    assert (counts["mismatches"], unread) == ([], ["/data/train/cats/1.jpg", "/data/train/dogs/2.jpg"])
    assert Namespace().stat("/data/train/dogs/0.jpg").content_hash == f"sha256:{sha256(dataset / 'train/dogs/0.jpg')}"


def test_cached_files_changed_or_deleted_at_the_source_are_reported(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hashed file is read through the cache, which holds the listed version: the store is
    asked whether it still has it, by a HEAD each for a few objects, by one listing for many."""
    ok("mount", "add", "/data", f"file://{dataset}")
    ok("verify", "/data")
    ok("warmup", "/data")
    result, failed = _change_one_delete_one_and_verify(dataset, "/data")
    assert failed[0].startswith("gpufeed: mismatch: /data/train/cats/1.jpg: recorded sha256:")
    assert f"; file://{dataset}/train/cats/1.jpg: changed at the source since mount /data was listed" in failed[0]
    assert f"; file://{dataset}/train/dogs/2.jpg: deleted at the source since mount /data was listed" in failed[1]
    assert "0 hashes recorded, 6 matched, 2 mismatched" in result.stdout, result.stdout
    monkeypatch.setattr(verifying, "HEAD_AT_MOST", 0)
    client = Client()
    try:
        done = verifying.verify(client, verifying.listed(client, "/data"))
    finally:
        client.close()
    assert (done.files, done.matched) == (8, 6)
    assert [(m.path, ": changed at" in m.detail, ": deleted at" in m.detail) for m in done.mismatches] == [
        ("/data/train/cats/1.jpg", True, False), ("/data/train/dogs/2.jpg", False, True)]


def test_malformed_checksums_line_is_one_line_and_records_nothing(dataset: Path, tmp_path: Path) -> None:
    sums = tmp_path / "SUMS"
    sums.write_text(f"{'0' * 64}  README\nnot a checksum line\n")
    failed = fails(2, "mount", "add", "/data", f"file://{dataset}", "--checksums", str(sums))
    assert f"{sums}:2: expected '<hex>  <path>'" in failed
    assert "no mounts" in ok("mount", "ls")


def test_empty_prefix_fails_with_a_hint(dataset: Path) -> None:
    (dataset / "trian").mkdir()
    line = fails(1, "mount", "add", "/data", f"file://{dataset}/trian")
    assert f"no objects under this prefix; did you mean file://{dataset}/train? (--allow-empty mounts it anyway)" in line
    assert "mounted" in ok("mount", "add", "/data", f"file://{dataset}/trian", "--allow-empty")
    (dataset / "trian").rmdir()
    line = fails(1, "mount", "add", "/other", f"file://{dataset}/tarin")
    assert line.endswith(f"/tarin: no such directory; did you mean file://{dataset}/train?"), "a missing directory too"


def test_mount_ls_shows_full_values(dataset: Path, tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120) / ("e" * 120)
    deep.mkdir(parents=True)
    (deep / "f.bin").write_bytes(b"f")
    ok("mount", "add", "/data", f"file://{deep}", "-o", "block_size=64KiB", "--max-age", "30")
    shown = ok("mount", "ls")
    assert f"source:   file://{deep}\n" in shown and "option:   block_size=64KiB" in shown and "max-age 30s" in shown
    [record] = json.loads(ok("mount", "ls", "--json"))
    assert (record["path"], record["source"], record["options"]) == ("/data", f"file://{deep}", {"block_size": "64KiB"})
