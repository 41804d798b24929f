"""Every store call is retried, against real moto and nginx behind a proxy that spoils exactly
the responses a test names: bounded, jittered, logged once, listings resumed, nothing final
retried."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpufeed.config import Settings
from gpufeed.errors import ObjectChanged, ObjectMissing, PathNotFound, SourceDown, SourceError, SourceUnreachable
from gpufeed.namespace import Namespace
from gpufeed.sources import open_source, retry
from gpufeed.sources.base import ObjectInfo, Source
from gpufeed.sources.retry import Retryable, RetryPolicy, call
from tests.conftest import Bucket, HttpServer
from tests.sources.flaky import Flaky, flaky_proxy

DATA = bytes(range(256)) * 64


@pytest.fixture
def s3_proxy(bucket: Bucket) -> Iterator[Flaky]:
    with flaky_proxy(bucket.endpoint) as proxy:
        yield proxy


def s3_source(bucket: Bucket, proxy: Flaky) -> Source:
    return open_source(bucket.url, {"endpoint": proxy.url}, Settings.from_env())


def gpufeed(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gpufeed", *args]
    return subprocess.run(argv, check=False, capture_output=True, text=True, env={**os.environ, **env}, timeout=120)


@pytest.mark.parametrize(("fault", "times"), [("503", 6), ("reset", 6), ("truncate", 6), ("short", 3)])
def test_a_get_survives_each_kind_of_failure(bucket: Bucket, s3_proxy: Flaky, fault: str, times: int) -> None:
    """More failures in a row than obstore's own 3 retries absorb (it cannot see a short body)."""
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan([fault] * times, match="/obj")
    assert bytes(source.get_range("obj", 100, 5000)) == DATA[100:5000]
    assert s3_proxy.count("GET", "/obj") == times + 1, "the spoiled answers, then the good one"


def test_retries_are_bounded_by_attempts(bucket: Bucket, s3_proxy: Flaky, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFEED_RETRY_TIMEOUT", "60")  # time for every attempt, however slow this machine
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan("truncate", match="/obj", forever=True)
    with pytest.raises(SourceError, match=rf"s3://{bucket.name}/obj .*body error") as caught:
        source.get_range("obj", 0, 4096)
    assert "\n" not in str(caught.value)
    assert s3_proxy.count("GET", "/obj") == 5 * 4, "five attempts of gpufeed, each a request and obstore's 3 retries"


def test_retries_are_bounded_by_retry_timeout(bucket: Bucket, s3_proxy: Flaky, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket.put("obj", DATA)
    monkeypatch.setenv("GPUFEED_RETRY_TIMEOUT", "0")
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan("truncate", match="/obj", forever=True)
    with pytest.raises(SourceError):
        source.get_range("obj", 0, 4096)
    assert s3_proxy.count("GET", "/obj") == 1, "no time for retries: one attempt"


def test_an_attempt_that_cannot_end_before_the_deadline_is_not_made() -> None:
    """A store unreachable after a long wait is tried again only while another wait as long fits:
    obstore retries inside each attempt, so retrying past the deadline multiplies the wait."""
    made = []

    def fails(seconds: float, error: SourceError) -> None:
        made.append(seconds)
        time.sleep(seconds)
        raise Retryable("connection failure" if isinstance(error, SourceUnreachable) else "broken response body", error)

    unreachable, broken = SourceUnreachable("somewhere: timed out"), SourceError("somewhere: the body broke off")
    for seconds, error, attempts in ((0.6, unreachable, 1), (0.0, unreachable, 5), (0.4, broken, 3)):
        made.clear()
        with pytest.raises(type(error)):
            call(RetryPolicy("somewhere", timeout=1.0, base=0.0), lambda: fails(seconds, error))  # noqa: B023
        assert len(made) == attempts, (seconds, error, "a quick failure, or a slow one of another kind, is retried")


def test_a_store_unreachable_through_a_calls_retries_fails_the_next_calls_at_once_until_it_answers(
    bucket: Bucket, s3_proxy: Flaky, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead store costs one call its retry budget, not every call: a job reading 10,000 files
    got an error every few seconds, for hours. Tried again once a second (here: when the test
    says), it answers and every call goes through again."""
    monkeypatch.setenv("GPUFEED_RETRY_TIMEOUT", "60")
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan("reset", match="/obj", forever=True)
    with pytest.raises(SourceUnreachable, match="cannot reach the store"):
        source.get_range("obj", 0, 4096)
    assert s3_proxy.count("GET", "/obj") == 5 * 4, "the first call: all its attempts"
    monkeypatch.setattr(retry, "DOWN_PROBE_S", 3600.0)
    for _ in range(10):
        with pytest.raises(SourceUnreachable, match=rf"s3://{bucket.name} .*cannot reach the store \(no answer for"):
            source.get_range("obj", 0, 4096)
        with pytest.raises(SourceUnreachable):
            source.head("obj")
    assert s3_proxy.count("GET", "/obj") == 20 and s3_proxy.count("HEAD", "/obj") == 0, "the store was not asked"
    monkeypatch.setattr(retry, "DOWN_PROBE_S", 0.0)
    with pytest.raises(SourceUnreachable, match="cannot reach the store \\((?!no answer)"):
        source.get_range("obj", 0, 4096)
    assert s3_proxy.count("GET", "/obj") == 20 + 4, "tried once, without gpufeed's retries"
    s3_proxy.plan([], match="/obj")
    assert bytes(source.get_range("obj", 0, 4096)) == DATA[:4096]
    monkeypatch.setattr(retry, "DOWN_PROBE_S", 3600.0)
    s3_proxy.plan(["reset"] * 6, match="/obj")
    assert bytes(source.get_range("obj", 100, 5000)) == DATA[100:5000], "it answered: retried in full again"


def test_a_gateway_error_from_a_proxy_in_front_of_a_store_is_unreachable(
    bucket: Bucket, s3_proxy: Flaky, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ingress before a stopped MinIO answers 502: the store is unreachable, marked down as a
    refused connection is, not retried in full by every call."""
    monkeypatch.setenv("GPUFEED_RETRY_TIMEOUT", "60")
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan("502", match="/obj", forever=True)
    with pytest.raises(SourceUnreachable, match=r"cannot reach the store \(a proxy in front of it answered 502 Bad Gateway\)"):
        source.get_range("obj", 0, 4096)
    monkeypatch.setattr(retry, "DOWN_PROBE_S", 3600.0)
    asked = s3_proxy.count("GET", "/obj")
    with pytest.raises(SourceDown):
        source.get_range("obj", 0, 4096)
    assert s3_proxy.count("GET", "/obj") == asked


def test_a_store_that_answers_other_calls_is_not_marked_down_and_a_probe_that_gets_somewhere_retries() -> None:
    policy = RetryPolicy("somewhere", timeout=5.0, base=0.0)
    unreachable = SourceUnreachable("somewhere: timed out")

    def slow_one() -> None:
        policy.reached()  # another call got an answer while this one failed
        raise Retryable("connection failure", unreachable)

    with pytest.raises(SourceUnreachable):
        call(policy, slow_one)
    assert policy.down_since is None, "one slow request on a store that answers others"
    with pytest.raises(SourceUnreachable):
        call(policy, lambda: (_ for _ in ()).throw(Retryable("connection failure", unreachable)))
    assert policy.down_since is not None
    policy.probe_at = 0.0
    probe = policy.begin()
    with pytest.raises(SourceDown):
        policy.begin()  # one probe at a time
    probe.progress()  # its first page came: a listing goes on with every retry
    probe.failed(Retryable("connection failure", unreachable))
    assert policy.down_since is None and policy.begin().attempts == 5

    def cut_off() -> None:
        raise KeyboardInterrupt  # a probe that ends without a result (its reader gone, its task cancelled)

    with pytest.raises(SourceUnreachable):
        call(policy, lambda: (_ for _ in ()).throw(Retryable("connection failure", unreachable)))
    policy.probe_at = 0.0
    with pytest.raises(KeyboardInterrupt):
        call(policy, cut_off)
    assert not policy.probing, "the next probe may go"
    policy.probe_at = 0.0
    with pytest.raises(PathNotFound):  # a 404 is an answer: no longer down
        call(policy, lambda: (_ for _ in ()).throw(PathNotFound("somewhere/x: not found")))
    assert policy.down_since is None


def test_backoff_is_jittered_and_capped() -> None:
    policy = RetryPolicy("somewhere", timeout=10, base=0.05, cap=0.3, rng=random.Random(1))
    for attempt in range(1, 8):
        delays = [policy.delay(attempt) for _ in range(50)]
        bound = min(0.3, 0.05 * 2 ** (attempt - 1))
        assert all(0 <= d <= bound for d in delays)
        assert len(set(delays)) == 50, "each wait drawn anew, so clients that failed together spread out"
        assert max(delays) > bound / 2


def test_a_kind_of_failure_is_logged_once_per_source(
    bucket: Bucket, s3_proxy: Flaky, caplog: pytest.LogCaptureFixture
) -> None:
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    caplog.set_level(logging.WARNING, logger="gpufeed")
    for _ in range(3):
        s3_proxy.plan(["truncate"] * 5, match="/obj")
        assert bytes(source.get_range("obj", 0, 1000)) == DATA[:1000]
    s3_proxy.plan(["503"] * 8, match="/obj")
    assert bytes(source.get_range("obj", 0, 1000)) == DATA[:1000]
    warnings = [r.getMessage() for r in caplog.records if r.name == "gpufeed"]
    assert len(warnings) == 2, warnings
    assert "broken response body" in warnings[0] and f"s3://{bucket.name}" in warnings[0]
    assert "server error" in warnings[1] and "SlowDown" in warnings[1]
    caplog.clear()
    fresh = s3_source(bucket, s3_proxy)
    s3_proxy.plan("short", match="/obj", forever=True)
    with pytest.raises(SourceError):
        fresh.get_range("obj", 0, 1000)
    assert caplog.records == [], "a call that fails for good says so in its error alone"


def test_final_failures_are_not_retried(bucket: Bucket, s3_proxy: Flaky) -> None:
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan([], match="/")
    with pytest.raises(ObjectMissing):
        source.get_range("nothing-here", 0, 10)
    assert s3_proxy.count("GET", "/nothing-here") == 1
    stale = ObjectInfo("obj", len(DATA), 0.0, '"0123456789abcdef0123456789abcdef"')
    with pytest.raises(ObjectChanged):
        source.get_range("obj", 0, 10, stale)
    assert s3_proxy.count("GET", "/obj") == 1


def test_head_is_retried(bucket: Bucket, s3_proxy: Flaky) -> None:
    bucket.put("obj", DATA)
    source = s3_source(bucket, s3_proxy)
    s3_proxy.plan(["reset", "reset"], method="HEAD")
    assert source.head("obj").size == len(DATA)
    assert s3_proxy.count("HEAD") == 3


@pytest.fixture(scope="module")
def many_keys(moto_endpoint: str) -> tuple[Bucket, list[str]]:
    """A bucket of 1,100 keys: two LIST pages."""
    import boto3

    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    bucket = Bucket("many-keys-for-listing", moto_endpoint, client)
    client.create_bucket(Bucket=bucket.name)
    keys = [f"k{i:05d}" for i in range(1100)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: bucket.put(k, b"x"), keys))
    return bucket, keys


@pytest.mark.parametrize(("fault", "times"), [("503", 6), ("reset", 6), ("truncate", 3), ("short", 3)])
def test_a_broken_listing_resumes_after_the_last_key(many_keys: tuple[Bucket, list[str]], fault: str, times: int) -> None:
    """The second page fails, more times than obstore's own retries absorb."""
    bucket, keys = many_keys
    with flaky_proxy(bucket.endpoint) as proxy:
        source = s3_source(bucket, proxy)
        proxy.plan(["ok"] + [fault] * times, match="list-type=2")
        listed = [info.key for batch in source.list() for info in batch]
        requests = list(proxy.script.requests)
    assert listed == keys, "every key once, in order"
    resumed = [r for r in requests if "start-after=k00999" in r]
    assert resumed, "the listing went on after the last key of the first page"


def test_http_index_crawl_is_retried_per_page(nginx: HttpServer, tmp_path: Path) -> None:
    site = nginx.root / f"crawl-{tmp_path.name}"
    for d in range(4):
        (site / f"d{d}" / "sub").mkdir(parents=True)
        (site / f"d{d}" / "sub" / "f").write_bytes(b"f" * d)
        (site / f"d{d}" / "g").write_bytes(b"g")
    with flaky_proxy(nginx.url) as proxy:
        proxy.plan(["503", "truncate", "reset", "short", "ok", "503", "truncate"])
        source = open_source(f"{proxy.url}/{site.name}", {}, Settings.from_env())
        listed = sorted(info.key for batch in source.list() for info in batch)
    assert listed == sorted([f"d{d}/g" for d in range(4)] + [f"d{d}/sub/f" for d in range(4)])


def test_http_index_that_keeps_failing_is_one_line(nginx: HttpServer, tmp_path: Path) -> None:
    site = nginx.root / f"failing-{tmp_path.name}"
    for d in range(20):
        (site / f"d{d}").mkdir(parents=True)
        (site / f"d{d}" / "f").write_bytes(b"f")
    with flaky_proxy(nginx.url) as proxy:
        proxy.plan("503", match="/d1", forever=True)
        started = time.monotonic()
        result = gpufeed("mount", "add", "/web", f"{proxy.url}/{site.name}", env={"GPUFEED_RETRY_TIMEOUT": "2"})
    assert result.returncode != 0
    assert result.stderr.startswith("gpufeed: error: ") and "d1/: HTTP 503" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, "one line: no warning beside the error, no traceback"
    assert time.monotonic() - started < 60
    assert Namespace().mounts() == []


def test_http_listing_file_heads_are_retried(nginx: HttpServer, tmp_path: Path) -> None:
    site = nginx.root / f"heads-{tmp_path.name}"
    site.mkdir()
    for i in range(3):
        (site / f"f{i}").write_bytes(b"z" * (i + 1))
    listing = tmp_path / "list.txt"
    listing.write_text("f0\nf1\nf2\n")
    with flaky_proxy(nginx.url) as proxy:
        proxy.plan(["reset", "reset", "503"], method="HEAD")
        source = open_source(f"{proxy.url}/{site.name}", {"list": str(listing)}, Settings.from_env())
        sizes = {info.key: info.size for batch in source.list() for info in batch}
    assert sizes == {"f0": 1, "f1": 2, "f2": 3}


def test_the_command_line_logs_its_warnings_as_json_when_asked(bucket: Bucket, s3_proxy: Flaky) -> None:
    bucket.put("obj", DATA)
    Namespace().add_mount("/flaky", bucket.url, {"endpoint": s3_proxy.url, "cache": "off"})
    s3_proxy.plan(["503"] * 6, match="/obj")
    read = subprocess.run(
        [sys.executable, "-m", "gpufeed", "--log-format", "json", "cat", "/flaky/obj"], capture_output=True, timeout=120
    )
    assert read.returncode == 0 and read.stdout == DATA, read.stderr
    events = [json.loads(line) for line in read.stderr.decode().splitlines()]
    assert len(events) == 1 and events[0]["level"] == "warning", events
    assert "server error" in events[0]["message"] and "retried with backoff" in events[0]["message"]
    bad = gpufeed("--log-format", "yaml", "ls", "/", env={})
    assert bad.returncode == 2 and bad.stderr.splitlines() == ["gpufeed: error: --log-format='yaml': expected text or json"]
