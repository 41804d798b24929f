"""Credentials passed as mount options never reach the agent's log (JSON lines here) or its
metrics, even while the store fails and the agent logs and counts retries."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import boto3
import pytest

import gpufeed
from gpufeed.bench.children import free_port
from gpufeed.bench.faults import FaultControl
from gpufeed.client.connection import stop_agent
from gpufeed.config import Settings
from gpufeed.namespace import Namespace
from tests.agent.test_metrics import agent_metrics
from tests.conftest import Bucket

KEY_ID = "AKIAGPUFEEDSECRETID7"
SECRET = "gpufeed/Secret+Key+Never+Logged+0123456789"


def test_mount_credentials_stay_out_of_logs_and_metrics(
    moto_endpoint: str, moto_faults: FaultControl, gpufeed_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fixed bucket name: the proxy draws each fault from the request's path, so the faults below
    # are the same on every run (a random name left no flip, and so no gpufeed retry, in ~1 run of 10).
    bucket = Bucket("secrets-in-logs", moto_endpoint, boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1"))
    bucket.client.create_bucket(Bucket=bucket.name)  # type: ignore[attr-defined]
    objects = {f"o{i:02d}.bin": bytes([i]) * (2000 + i) for i in range(20)}
    for key, body in objects.items():
        bucket.put(key, body)
    options = {"endpoint": moto_faults.url, "access_key_id": KEY_ID, "secret_access_key": SECRET}
    Namespace().add_mount("/secret", bucket.url, options)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # the mount's options are the only credentials
        monkeypatch.delenv(name)
    port = free_port()
    monkeypatch.setenv("GPUFEED_LOG_FORMAT", "json")
    monkeypatch.setenv("GPUFEED_METRICS_ADDR", str(port))
    moto_faults.configure(seed=3, rates={"truncate": 0.3, "flip": 0.1})  # retried by gpufeed, warned once each
    for key, body in objects.items():
        assert gpufeed.read(f"/secret/{key}") == body
    assert moto_faults.counts()["injected"]["flip"] > 0, "no flip, the fault obstore cannot retry itself"
    seen = agent_metrics()
    retried = sum(value for (name, _), value in seen.items() if name == "gpufeed_retries_total")
    assert retried > 0
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        scraped = response.read().decode()
    assert 'gpufeed_misses_total{mount="/secret",tier="store"} 20.0' in scraped
    stop_agent(Settings.from_env())
    log = (gpufeed_home / "cache" / "agent.log").read_text()
    events = [json.loads(line) for line in log.splitlines()]  # every line one JSON object
    assert any(e["level"] == "warning" and "retried with backoff" in e["message"] for e in events), log
    for text in (log, scraped):
        assert KEY_ID not in text and SECRET not in text
        assert "Secret+Key" not in text and "AKIAGPUFEED" not in text
