"""The shaper adds the latency and caps the bandwidth it was asked for; the loopback servers
serve ranges and a JSON index the http source can mount; remote emulation works for S3."""

from __future__ import annotations

import http.client
import os
import time
from pathlib import Path

import pytest

from gpufeed.bench.remote import emulate_remote
from gpufeed.bench.server import serving
from gpufeed.bench.shaper import shaping
from gpufeed.client import Client
from gpufeed.errors import InvalidArgument
from gpufeed.namespace import Namespace
from tests.conftest import Bucket


@pytest.fixture
def www(tmp_path: Path) -> Path:
    root = tmp_path / "www"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "blob.bin").write_bytes(os.urandom(2_000_000))
    return root


def _timed_get(conn: http.client.HTTPConnection, path: str, first: int, last: int) -> tuple[float, bytes]:
    started = time.perf_counter()
    conn.request("GET", path, headers={"Range": f"bytes={first}-{last}"})
    response = conn.getresponse()
    body = response.read()
    assert response.status == 206
    return time.perf_counter() - started, body


@pytest.mark.parametrize("prefer_nginx", [True, False], ids=["nginx", "python-server"])
def test_every_request_on_a_keepalive_connection_pays_the_latency(www: Path, tmp_path: Path, prefer_nginx: bool) -> None:
    with serving(www, tmp_path / "run", prefer_nginx=prefer_nginx) as url:
        upstream = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        with shaping(upstream, 50, None, tmp_path / "shaper.log") as port:
            conn = http.client.HTTPConnection("127.0.0.1", port)
            for first in (0, 1000, 5000):
                elapsed, body = _timed_get(conn, "/sub/blob.bin", first, first + 99)
                assert elapsed >= 0.050
                assert body == (www / "sub" / "blob.bin").read_bytes()[first : first + 100]
            conn.close()


def test_bandwidth_cap_paces_the_bytes(www: Path, tmp_path: Path) -> None:
    with serving(www, tmp_path / "run") as url:
        upstream = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
        with shaping(upstream, 0, 10, tmp_path / "shaper.log") as port:  # 10 MB/s
            conn = http.client.HTTPConnection("127.0.0.1", port)
            elapsed, body = _timed_get(conn, "/sub/blob.bin", 0, 1_999_999)
            assert len(body) == 2_000_000
            assert elapsed >= 0.9 * 2_000_000 / 10e6


def test_python_server_index_mounts_like_nginx(www: Path, tmp_path: Path) -> None:
    with serving(www, tmp_path / "run", prefer_nginx=False) as url:
        Namespace().add_mount("/w", url, {})
        client = Client()
        assert [(s.path, s.size) for s in client.walk("/w")] == [("/w/sub/blob.bin", 2_000_000)]
        assert client.read("/w/sub/blob.bin", 10, 20) == (www / "sub" / "blob.bin").read_bytes()[10:30]


def test_an_s3_endpoint_is_shaped_where_it_stands(bucket: Bucket, tmp_path: Path) -> None:
    bucket.put("data/x.bin", b"0123456789" * 100)
    options = {"endpoint": bucket.endpoint}
    with emulate_remote(bucket.url + "/data", options, 30, None, tmp_path) as (url, shaped):
        assert url == bucket.url + "/data" and shaped["endpoint"] != bucket.endpoint
        Namespace().add_mount("/s3", url, shaped, immutable=True)
        client = Client()
        handle = client.handle("/s3/x.bin")
        started = time.perf_counter()
        assert bytes(client.read_range(handle, 5, 15)) == b"5678901234"
        assert time.perf_counter() - started >= 0.030


def test_tls_endpoints_cannot_be_shaped(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="only plain http"):
        with emulate_remote("https://example.com/data", {}, 20, None, tmp_path):
            pass
    with pytest.raises(InvalidArgument, match="--opt endpoint="):
        with emulate_remote("s3://bucket/data", {}, 20, None, tmp_path):
            pass
