"""What a store returns is checked before anyone sees it: length always; a whole object against
the manifest's content hash and, on S3, a plain ETag. A proxy in front of real moto and nginx
flips bytes; a flip is retried, a persistent one is ObjectCorrupted naming both hashes."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufeed.config import Settings
from gpufeed.errors import ObjectChanged, ObjectCorrupted, SourceError
from gpufeed.sources import open_source
from gpufeed.sources.base import ObjectInfo, Source
from tests.conftest import Bucket, HttpServer
from tests.sources.flaky import Flaky, flaky_proxy

DATA = bytes(range(251)) * 400
BIG = bytes(range(256)) * 4096


@pytest.fixture
def s3_proxy(bucket: Bucket) -> Iterator[Flaky]:
    with flaky_proxy(bucket.endpoint) as proxy:
        yield proxy


@pytest.fixture
def web(nginx: HttpServer, tmp_path: Path) -> Iterator[tuple[Source, Flaky, Path]]:
    """An HTTP source through the proxy in front of nginx, and the directory it serves."""
    site = nginx.root / f"integrity-{tmp_path.name}"
    site.mkdir()
    with flaky_proxy(nginx.url) as proxy:
        yield open_source(f"{proxy.url}/{site.name}", {}, Settings.from_env()), proxy, site


def s3_source(bucket: Bucket, proxy: Flaky) -> Source:
    return open_source(bucket.url, {"endpoint": proxy.url}, Settings.from_env())


def test_s3_etag_catches_a_flipped_byte(bucket: Bucket, s3_proxy: Flaky) -> None:
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan(["flip"], match="/obj")
    assert bytes(source.get_range("obj", 0, len(DATA))) == DATA
    assert s3_proxy.count("GET", "/obj") == 2


def test_s3_etag_mismatch_that_persists_is_object_corrupted(bucket: Bucket, s3_proxy: Flaky) -> None:
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan("flip", match="/obj", forever=True)
    with pytest.raises(ObjectCorrupted) as caught:
        source.get_range("obj", 0, len(DATA))
    message = str(caught.value)
    assert f"s3://{bucket.name}/obj" in message
    assert f"ETag says md5:{hashlib.md5(DATA).hexdigest()}" in message and "hash to md5:" in message
    assert "\n" not in message
    assert s3_proxy.count("GET", "/obj") == 5


def test_s3_etag_check_runs_in_the_async_read_too(bucket: Bucket, s3_proxy: Flaky) -> None:
    bucket.put("big", BIG)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan(["flip", "flip"], match="/big")
    assert bytes(asyncio.run(source.get_range_async("big", 0, len(BIG)))) == BIG
    assert s3_proxy.count("GET", "/big") == 3


def test_an_etag_that_is_no_md5_of_the_bytes_is_recognised(
    bucket: Bucket, s3_proxy: Flaky, caplog: pytest.LogCaptureFixture
) -> None:
    """Encrypted S3 objects (SSE-KMS, SSE-C) have 32-hex ETags that are no MD5 of the bytes; two
    reads that agree byte for byte are believed, and the source stops checking ETags."""
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    caplog.set_level(logging.WARNING, logger="gpufeed")
    s3_proxy.plan("flip0", match="/obj", forever=True)
    first = bytes(source.get_range("obj", 0, len(DATA)))
    assert first[1:] == DATA[1:] and first[0] != DATA[0]
    assert s3_proxy.count("GET", "/obj") == 2
    assert any("is not the MD5" in r.getMessage() for r in caplog.records)
    source.get_range("obj", 0, len(DATA))
    assert s3_proxy.count("GET", "/obj") == 3, "no longer checked: one read"


def test_a_listed_s3_object_is_read_in_one_plain_request(bucket: Bucket, s3_proxy: Flaky) -> None:
    """A whole object whose listing names its bytes (a plain MD5 ETag) needs no If-Match: bytes
    that match the listed ETag are the listed version."""
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    listed = source.head("obj")
    s3_proxy.plan([])
    assert bytes(asyncio.run(source.get_range_async("obj", 0, len(DATA), listed))) == DATA
    assert bytes(source.get_range("obj", 0, len(DATA), listed)) == DATA
    assert (s3_proxy.count("GET", "/obj"), s3_proxy.pinned("GET", "/obj")) == (2, 0)


def test_a_flipped_byte_in_a_plain_request_is_read_again_pinned(bucket: Bucket, s3_proxy: Flaky) -> None:
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    listed = source.head("obj")
    s3_proxy.plan(["flip"], match="/obj")
    assert bytes(asyncio.run(source.get_range_async("obj", 0, len(DATA), listed))) == DATA
    assert (s3_proxy.count("GET", "/obj"), s3_proxy.pinned("GET", "/obj")) == (2, 1)


@pytest.mark.parametrize("read_async", [True, False])
def test_a_listed_s3_object_changed_since_is_object_changed(bucket: Bucket, s3_proxy: Flaky, read_async: bool) -> None:
    """The plain request's bytes disagree with the listed ETag; the pinned one that follows
    tells a changed object (412) from a damaged transfer."""
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    listed = source.head("obj")
    bucket.put("obj", DATA[::-1])
    s3_proxy.plan([])
    with pytest.raises(ObjectChanged, match="changed at the source since it was listed"):
        if read_async:
            asyncio.run(source.get_range_async("obj", 0, len(DATA), listed))
        else:
            source.get_range("obj", 0, len(DATA), listed)
    assert (s3_proxy.count("GET", "/obj"), s3_proxy.pinned("GET", "/obj")) == (2, 1)


def test_an_immutable_s3_object_changed_since_reads_as_it_is_now(bucket: Bucket, s3_proxy: Flaky) -> None:
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    listed = source.head("obj")
    bucket.put("obj", DATA[::-1])
    assert bytes(asyncio.run(source.get_range_async("obj", 0, len(DATA), listed, conditional=False))) == DATA[::-1]


def test_a_range_is_only_length_checked(bucket: Bucket, s3_proxy: Flaky) -> None:
    """A part of an object cannot be checked against a hash of the whole (the caller that
    assembles the object can): only its length is."""
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan(["flip0"], match="/obj")
    assert bytes(source.get_range("obj", 10, 1000)) != DATA[10:1000]
    s3_proxy.plan(["short", "short"], match="/obj")
    assert bytes(source.get_range("obj", 10, 1000)) == DATA[10:1000]
    assert s3_proxy.count("GET", "/obj") == 3


def test_a_short_body_that_persists_is_one_error(bucket: Bucket, s3_proxy: Flaky) -> None:
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan("short", match="/obj", forever=True)
    with pytest.raises(SourceError, match=rf"s3://{bucket.name}/obj .*sent 500 bytes for the 1000 of \[0, 1000\)"):
        source.get_range("obj", 0, 1000)


@pytest.mark.parametrize("algorithm", ["sha256", "md5", "sha1"])
@pytest.mark.parametrize("conditional", [True, False])
def test_content_hash_catches_a_flipped_byte(web: tuple[Source, Flaky, Path], algorithm: str, conditional: bool) -> None:
    source, proxy, site = web
    (site / "f.bin").write_bytes(DATA)
    info = source.head("f.bin")
    expect = ObjectInfo(info.key, info.size, info.mtime, info.etag, f"{algorithm}:{hashlib.new(algorithm, DATA).hexdigest()}")
    proxy.plan(["flip", "flip"], match="/f.bin")
    assert bytes(source.get_range("f.bin", 0, len(DATA), expect, conditional=conditional)) == DATA
    assert proxy.count("GET", "/f.bin") == 3


@pytest.mark.parametrize("conditional", [True, False])
def test_content_hash_mismatch_that_persists_names_both_hashes(web: tuple[Source, Flaky, Path], conditional: bool) -> None:
    """Immutable mounts (conditional=False) pin no version, yet are verified all the same."""
    source, proxy, site = web
    (site / "f.bin").write_bytes(DATA)
    wanted = f"sha256:{hashlib.sha256(DATA).hexdigest()}"
    expect = ObjectInfo("f.bin", len(DATA), 0.0, None, wanted)
    proxy.plan("flip", match="/f.bin", forever=True)
    with pytest.raises(ObjectCorrupted) as caught:
        source.get_range("f.bin", 0, len(DATA), expect, conditional=conditional)
    message = str(caught.value)
    assert f"{site.name}/f.bin" in message and f"the manifest says {wanted}" in message
    assert "hash to sha256:" in message and "\n" not in message
    assert proxy.count("GET", "/f.bin") == 5


def test_a_wrong_hash_in_the_manifest_fails_a_local_read_at_once(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(DATA)
    source = open_source(f"file://{tmp_path}", {}, Settings.from_env())
    expect = ObjectInfo("f", len(DATA), 0.0, None, "md5:" + "0" * 32)
    got = hashlib.md5(DATA).hexdigest()
    with pytest.raises(ObjectCorrupted, match=rf"file://{tmp_path}/f: the bytes read hash to md5:{got}"):
        source.get_range("f", 0, len(DATA), expect, conditional=False)
    assert bytes(source.get_range("f", 0, len(DATA), ObjectInfo("f", len(DATA), 0.0), conditional=False)) == DATA


def test_an_immutable_object_that_shrank_is_object_changed(bucket: Bucket) -> None:
    bucket.put("obj", DATA)
    source = open_source(bucket.url, {"endpoint": bucket.endpoint}, Settings.from_env())
    before = source.head("obj")
    bucket.put("obj", DATA[:100])
    with pytest.raises(ObjectChanged, match=r"returned 100 bytes \(\[0, 100\)\) for \[0, 1000\); it is 100 bytes now"):
        source.get_range("obj", 0, 1000, before, conditional=False)
    with pytest.raises(ObjectChanged, match="changed at the source since it was listed"):
        source.get_range("obj", 0, 100, before)
