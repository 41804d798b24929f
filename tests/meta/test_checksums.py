"""Checksums files (sha256sum/md5sum output) into manifest content hashes, and refresh keeping them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gpufeed.errors import InvalidArgument
from gpufeed.meta.checksums import parse_checksums
from gpufeed.namespace import Namespace


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_formats_datasets_publish(tmp_path: Path) -> None:
    md5, sha1, s256 = "A" * 32, "b" * 40, "c" * 64
    file = tmp_path / "SUMS"
    file.write_text(
        f"{md5}  plain.txt\n{sha1} *binary.bin\n{s256}  ./dir/dotted.jpg\n\n"
        f"\\{s256}  back\\\\slash\\nnewline\n{s256}  name with  spaces\r\n"
    )
    assert parse_checksums(file) == {
        "plain.txt": "md5:" + "a" * 32,
        "binary.bin": "sha1:" + sha1,
        "dir/dotted.jpg": "sha256:" + s256,
        "back\\slash\nnewline": "sha256:" + s256,
        "name with  spaces": "sha256:" + s256,
    }


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("nothex  a.txt", "expected '<hex>  <path>'"),
        ("abc123", "expected '<hex>  <path>'"),
        ("a" * 63 + "  a.txt", "63-digit hash is none of md5"),
        ("d" * 32 + "  a.txt", "a.txt has two different hashes"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    file = tmp_path / "SUMS"
    file.write_text(f"{'0' * 32}  a.txt\n{line}\n")
    with pytest.raises(InvalidArgument, match=f"{file}:2: .*{message}"):
        parse_checksums(file)


def test_unreadable_file_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="--checksums .*missing: cannot read it"):
        parse_checksums(tmp_path / "missing")


def test_mount_records_hashes_and_counts_both_gaps(namespace: Namespace, dataset: Path, tmp_path: Path) -> None:
    readme = (dataset / "README").read_bytes()
    cat0 = (dataset / "train/cats/0.jpg").read_bytes()
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{sha256(readme)}  ./README\n{sha256(cat0)} *train/cats/0.jpg\n{'e' * 64}  train/lions/0.jpg\n")
    mount, stats = namespace.add_mount("/data", f"file://{dataset}", checksums=str(sums))
    assert (stats.files, stats.unhashed, stats.unlisted) == (8, 6, 1)
    assert namespace.stat("/data/README").content_hash == f"sha256:{sha256(readme)}"
    assert namespace.stat("/data/train/cats/0.jpg").content_hash == f"sha256:{sha256(cat0)}"
    assert namespace.stat("/data/train/cats/1.jpg").content_hash is None

    (dataset / "README").write_bytes(b"a new readme, another size\n")
    refreshed, stats = namespace.refresh("/data")
    assert (stats.changed, stats.kept_hashes) == (1, 1)
    assert namespace.stat("/data/README").content_hash is None, "a changed object loses its hash"
    assert namespace.stat("/data/train/cats/0.jpg").content_hash == f"sha256:{sha256(cat0)}"
    assert refreshed.generation != mount.generation


def test_bad_checksums_file_records_nothing(namespace: Namespace, dataset: Path, tmp_path: Path) -> None:
    sums = tmp_path / "SUMS"
    sums.write_text("zz  README\n")
    with pytest.raises(InvalidArgument, match=f"{sums}:1"):
        namespace.add_mount("/data", f"file://{dataset}", checksums=str(sums))
    assert namespace.mounts() == []
