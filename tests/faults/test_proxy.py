"""The fault proxy does what each fault says, against real upstreams (nginx, moto), passes
everything else through byte for byte with the client's headers (Host included, which S3
signatures cover), and gives the same faults for the same seed."""

from __future__ import annotations

import http.client
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import obstore
import pytest
from obstore.store import S3Store

from gpufeed.bench.children import free_port, helper
from gpufeed.bench.faults import FaultControl, injecting, main
from tests.conftest import AWS_TEST_ENV, HttpServer, need_binary
from tests.faults.conftest import Site


def _get(port: int, path: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def _store_saw(nginx: HttpServer, site: Site) -> int:
    """Requests for the site that reached nginx (its access log)."""
    return sum(1 for line in nginx.access_log.read_text().splitlines() if f" {site.prefix}/" in line)


@pytest.fixture
def blob(site: Site) -> bytes:
    data = os.urandom(50_000)
    (site.root / "blob.bin").write_bytes(data)
    return data


def test_without_faults_everything_passes_untouched(nginx_faults: FaultControl, site: Site, blob: bytes) -> None:
    status, headers, body = _get(nginx_faults.port, f"{site.prefix}/blob.bin", {"Range": "bytes=100-199"})
    assert (status, body, headers["Content-Range"]) == (206, blob[100:200], "bytes 100-199/50000")
    status, headers, body = _get(nginx_faults.port, f"{site.prefix}/blob.bin", method="HEAD")
    assert (status, headers["Content-Length"], body) == (200, "50000", b"")
    etag = headers["ETag"]
    assert _get(nginx_faults.port, f"{site.prefix}/blob.bin", {"If-Match": '"other"'})[0] == 412
    assert _get(nginx_faults.port, f"{site.prefix}/blob.bin", {"If-Match": etag})[2] == blob
    index = json.loads(_get(nginx_faults.port, f"{site.prefix}/")[2])
    assert [(e["name"], e["size"]) for e in index] == [("blob.bin", 50000)]
    counts = nginx_faults.counts()
    assert counts["requests"] == 5 and sum(counts["injected"].values()) == 0


def test_503_is_an_s3_slowdown_the_store_never_sees(
    nginx_faults: FaultControl, nginx: HttpServer, site: Site, blob: bytes
) -> None:
    nginx_faults.configure(rates={"503": 1.0})
    status, _, body = _get(nginx_faults.port, f"{site.prefix}/blob.bin")
    assert status == 503 and b"<Code>SlowDown</Code>" in body
    assert nginx_faults.counts()["injected"]["503"] == 1
    assert _store_saw(nginx, site) == 0


def test_reset_drops_the_connection_before_any_response(
    nginx_faults: FaultControl, nginx: HttpServer, site: Site, blob: bytes
) -> None:
    nginx_faults.configure(rates={"reset": 1.0})
    with pytest.raises(ConnectionResetError):
        _get(nginx_faults.port, f"{site.prefix}/blob.bin")
    assert nginx_faults.counts()["injected"]["reset"] == 1
    assert _store_saw(nginx, site) == 0


def test_truncate_promises_the_whole_body_and_sends_part(nginx_faults: FaultControl, site: Site, blob: bytes) -> None:
    nginx_faults.configure(rates={"truncate": 1.0})
    conn = http.client.HTTPConnection("127.0.0.1", nginx_faults.port, timeout=10)
    conn.request("GET", f"{site.prefix}/blob.bin")
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Length") == "50000"
    with pytest.raises(http.client.IncompleteRead) as cut:
        response.read()
    conn.close()
    assert len(cut.value.partial) < len(blob) and cut.value.partial == blob[: len(cut.value.partial)]
    # A HEAD has no body to cut: it passes, uncounted.
    assert _get(nginx_faults.port, f"{site.prefix}/blob.bin", method="HEAD")[1]["Content-Length"] == "50000"
    assert nginx_faults.counts()["injected"]["truncate"] == 1


def test_stall_holds_the_response_then_sends_it_whole(nginx_faults: FaultControl, site: Site, blob: bytes) -> None:
    nginx_faults.configure(rates={"stall": 1.0}, stall=0.3)
    started = time.monotonic()
    status, _, body = _get(nginx_faults.port, f"{site.prefix}/blob.bin")
    assert time.monotonic() - started >= 0.3
    assert (status, body) == (200, blob)
    assert nginx_faults.counts()["injected"]["stall"] == 1


def test_flip_inverts_one_byte_of_a_2xx_body(nginx_faults: FaultControl, site: Site, blob: bytes) -> None:
    nginx_faults.configure(rates={"flip": 1.0})
    status, headers, body = _get(nginx_faults.port, f"{site.prefix}/blob.bin", {"Range": "bytes=1000-8999"})
    assert status == 206 and headers["Content-Length"] == "8000" and len(body) == 8000
    differ = [n for n in range(8000) if body[n] != blob[1000 + n]]
    assert len(differ) == 1 and body[differ[0]] == blob[1000 + differ[0]] ^ 0xFF
    assert _get(nginx_faults.port, f"{site.prefix}/missing.bin")[0] == 404  # error bodies are left alone
    assert nginx_faults.counts()["injected"]["flip"] == 1


def test_path_filter_leaves_other_requests_untouched(nginx_faults: FaultControl, site: Site, blob: bytes) -> None:
    (site.root / "other.bin").write_bytes(b"x" * 100)
    nginx_faults.configure(rates={"503": 1.0}, path_filter=r"blob\.bin$")
    for _ in range(2):
        status, _, body = _get(nginx_faults.port, f"{site.prefix}/other.bin")
        assert (status, body) == (200, b"x" * 100)
    assert _get(nginx_faults.port, f"{site.prefix}/blob.bin")[0] == 503
    counts = nginx_faults.counts()
    assert (counts["requests"], counts["matched"], counts["injected"]["503"]) == (3, 1, 1)
    assert counts["events"] == [{"fault": "503", "method": "GET", "target": f"{site.prefix}/blob.bin"}]


def _run(proxy: FaultControl, site: Site, ranges: list[int], workers: int) -> Counter[tuple[str, str]]:
    """Every range read once, in `workers` threads; the faults injected, as a multiset."""

    def one(first: int) -> None:
        try:
            _get(proxy.port, f"{site.prefix}/blob.bin", {"Range": f"bytes={first}-{first + 99}"})
        except (ConnectionError, http.client.HTTPException):
            pass

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, ranges))
    return Counter((e["fault"], e["target"]) for e in proxy.counts()["events"])


def test_same_seed_same_faults_in_any_order(nginx_faults: FaultControl, site: Site, blob: bytes) -> None:
    """A fault is a function of the seed and the request, not of arrival order: a concurrent
    run in reverse order injects the same faults as a sequential one."""
    rates = {"503": 0.1, "reset": 0.1, "truncate": 0.1, "flip": 0.1}
    ranges = [n * 100 for n in range(300)]
    nginx_faults.configure(seed=7, rates=rates)
    first = _run(nginx_faults, site, ranges, 1)
    first_faults = nginx_faults.counts()["injected"]
    nginx_faults.configure(seed=7, rates=rates)
    again = _run(nginx_faults, site, ranges[::-1], 8)
    nginx_faults.configure(seed=8, rates=rates)
    other = _run(nginx_faults, site, ranges, 1)
    assert all(first_faults[name] > 0 for name in rates)
    assert first == again
    assert first != other


def test_repeats_of_one_request_draw_afresh(nginx_faults: FaultControl, site: Site, blob: bytes) -> None:
    """A retry is the same request again: it must be able to succeed."""
    nginx_faults.configure(seed=1, rates={"503": 0.5})
    statuses = [_get(nginx_faults.port, f"{site.prefix}/blob.bin")[0] for _ in range(40)]
    assert 0 < statuses.count(503) < 40 and set(statuses) == {200, 503}


@dataclass
class SignedMoto:
    endpoint: str
    key_id: str
    secret: str
    bucket: str


@pytest.fixture(scope="module")
def signed_moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SignedMoto]:
    """A moto server that checks every S3 signature, with one IAM user allowed everything (the
    three IAM calls that make the user are the only unsigned actions it takes)."""
    import boto3  # type: ignore[import-untyped]

    port = free_port()
    argv = [need_binary("moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    log = tmp_path_factory.mktemp("signed-moto") / "moto.log"
    with helper(argv, "moto_server (signatures)", log, port=port, env={**AWS_TEST_ENV, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}):
        endpoint = f"http://127.0.0.1:{port}"
        iam = boto3.client(
            "iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
        )
        iam.create_user(UserName="reader")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="reader", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        s3 = boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"],
        )
        bucket = f"b-{uuid.uuid4().hex[:12]}"
        s3.create_bucket(Bucket=bucket)
        s3.put_object(Bucket=bucket, Key="dir/a-b.bin", Body=b"0123456789" * 1000)
        yield SignedMoto(endpoint, key["AccessKeyId"], key["SecretAccessKey"], bucket)


def test_s3_signatures_hold_through_the_proxy(signed_moto: SignedMoto, tmp_path: Path) -> None:
    """The client signs for the proxy's host:port; the proxy forwards that Host, so moto,
    which checks every signature here, accepts the request. A request whose Host differs from
    the one signed is refused, so the check is real."""
    with injecting(signed_moto.endpoint, tmp_path / "faults.log") as proxy:
        store = S3Store(
            signed_moto.bucket, endpoint=proxy.url, region="us-east-1",
            access_key_id=signed_moto.key_id, secret_access_key=signed_moto.secret, client_options={"allow_http": True},
        )
        result = obstore.get(store, "dir/a-b.bin", options={"range": (5, 25)})
        assert bytes(result.bytes()) == b"56789012345678901234"
        assert [m["path"] for m in obstore.list(store).collect()] == ["dir/a-b.bin"]
        assert proxy.counts()["requests"] == 2

        from botocore.auth import SigV4Auth  # type: ignore[import-untyped]
        from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
        from botocore.credentials import Credentials  # type: ignore[import-untyped]

        signed_elsewhere = AWSRequest("GET", f"http://127.0.0.1:1/{signed_moto.bucket}/dir/a-b.bin")
        SigV4Auth(Credentials(signed_moto.key_id, signed_moto.secret), "s3", "us-east-1").add_auth(signed_elsewhere)
        headers = {k: v for k, v in signed_elsewhere.headers.items() if k.lower() != "host"}
        status, _, body = _get(proxy.port, f"/{signed_moto.bucket}/dir/a-b.bin", headers)
        assert status == 403 and b"SignatureDoesNotMatch" in body


def test_an_unreachable_upstream_is_a_502_naming_it(tmp_path: Path) -> None:
    upstream = f"http://127.0.0.1:{free_port()}"
    with injecting(upstream, tmp_path / "faults.log", seed=5, rates={"503": 0.5}, path_filter="never") as proxy:
        status, _, body = _get(proxy.port, "/any")
        assert status == 502 and upstream.encode() in body
        assert (proxy.counts()["seed"], proxy.counts()["rates"]) == (5, {"503": 0.5})


def test_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for args, expected in (
        (["--rate", "bogus=0.1"], "unknown fault 'bogus'"),
        (["--rate", "503=2"], "must be between 0 and 1"),
        (["--rate", "503=0.6", "--rate", "reset=0.6"], "at most 1"),
        (["--rate", "503"], "expected FAULT=RATE"),
        (["--path-filter", "("], "missing ), unterminated subpattern"),
        (["--upstream", "127.0.0.1:9"], "expected http://HOST:PORT"),
    ):
        with pytest.raises(SystemExit) as done:
            main(["--upstream", "http://127.0.0.1:9", *args])
        error = capsys.readouterr().err
        assert done.value.code == 2 and expected in error.splitlines()[-1] and "Traceback" not in error
