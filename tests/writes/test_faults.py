"""Writes against a store that fails: uploads held up while the agent is killed (kill -9) are
resumed by the next agent; a 503 and connection-reset mix still lands every object whole."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import threading
import time

import pytest

import gpufeed
from gpufeed import verify as verifying
from gpufeed.bench.faults import FaultControl
from gpufeed.client import Client
from gpufeed.client.connection import AgentClient
from gpufeed.config import Settings
from gpufeed.errors import GpufeedError, WriteError
from gpufeed.namespace import Namespace
from tests.conftest import Bucket


def writable_through(proxy: FaultControl, bucket: Bucket) -> None:
    Namespace().add_mount("/out", bucket.url, {"endpoint": proxy.url}, writable=True, allow_empty=True)


def killed(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] in "ZX":  # dead (our child, not reaped yet)
                    return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"agent {pid} still alive")


def stored(bucket: Bucket, key: str) -> bytes:
    return bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read()  # type: ignore[attr-defined,no-any-return]


def test_acknowledged_writes_survive_the_agent_killed_mid_upload(bucket: Bucket, moto_faults: FaultControl) -> None:
    writable_through(moto_faults, bucket)
    moto_faults.configure(rates={"stall": 1.0}, stall=60.0, path_filter="batch/")  # every upload hangs
    bodies = {f"batch/{i}.bin": os.urandom(100_000 + i) for i in range(5)}
    for key, body in bodies.items():
        gpufeed.write(f"/out/{key}", body)  # acknowledged: staged durably on this node
    assert gpufeed.read("/out/batch/3.bin") == bodies["batch/3.bin"], "read back while its upload hangs"
    settings = Settings.from_env()
    staging = AgentClient(settings).dirs[0] / "staging"
    assert len(list(staging.glob("*.json"))) == 5
    killed(AgentClient(settings).hello().pid)
    moto_faults.configure(rates={})
    gpufeed._default = None
    assert gpufeed.sync("/out") == 5, "the next agent found the five staged writes and uploaded them"
    assert all(stored(bucket, key) == body for key, body in bodies.items())
    assert not list(staging.glob("*.json")) and not list(staging.glob("*.data")), "nothing left staged"
    assert gpufeed.stat("/out/batch/0.bin").etag is not None, "the manifest has the store's version"


def test_a_write_still_uploading_reads_back_where_the_cache_does_not_keep_it(
    bucket: Bucket, moto_faults: FaultControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mount with cache=off, and a cache too small for the file: the store has no copy yet (its
    upload hangs), so the agent reads the staged bytes for the reader, a read longer than one
    agent reply (32 MiB) in pieces."""
    monkeypatch.setenv("GPUFEED_CACHE_SIZE", "2MiB")
    for path, options in (("/off", {"cache": "off"}), ("/small", {})):
        Namespace().add_mount(path, bucket.url, {"endpoint": moto_faults.url, **options}, writable=True, allow_empty=True)
    moto_faults.configure(rates={"stall": 1.0}, stall=60.0, path_filter="held/")
    body = os.urandom(40 << 20)
    for path in ("/off/held/a.bin", "/small/held/b.bin"):
        gpufeed.write(path, body)
        assert gpufeed.read(path, 5 << 20, 100) == body[5 << 20 : (5 << 20) + 100], path
        assert gpufeed.read(path) == body, path
    assert AgentClient(Settings.from_env()).stats().bytes <= 2 << 20, "the small cache kept to its size"


def test_a_write_through_that_cannot_reach_the_store_says_the_write_is_kept(
    bucket: Bucket, moto_faults: FaultControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() raises, saying the write is kept; once the store is back, `sync` has the upload
    try again at once, not at the end of its backoff."""
    monkeypatch.setenv("GPUFEED_RETRY_TIMEOUT", "0.2")  # each upload attempt gives up fast
    writable_through(moto_faults, bucket)
    moto_faults.configure(rates={"503": 1.0}, path_filter="through/")
    with pytest.raises(GpufeedError, match="through/a.bin: written and kept on this node, not in the store yet"):
        with gpufeed.open("/out/through/a.bin", "wb", sync=True) as f:
            f.write(b"abc")
    assert gpufeed.read("/out/through/a.bin") == b"abc", "kept, as the error says"
    with pytest.raises(WriteError, match="upload not done, still retried"):
        gpufeed.sync("/out")  # the store still refuses: three more tries, in seconds, then the answer
    moto_faults.configure(rates={})
    assert gpufeed.sync("/out") == 1 and stored(bucket, "through/a.bin") == b"abc"


def test_an_upload_counts_only_the_tries_that_reached_for_the_store(
    bucket: Bucket, moto_faults: FaultControl, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store found unreachable is tried once a second at most (`sources.retry`); an upload's
    turn in between is not a try, so `sync` still gives up after three that went to the store."""
    monkeypatch.setenv("GPUFEED_RETRY_TIMEOUT", "0")  # no time for retries: a try is one request
    writable_through(moto_faults, bucket)
    moto_faults.configure(rates={"reset": 1.0}, path_filter="down/")
    with pytest.raises(GpufeedError, match="written and kept on this node"):
        with gpufeed.open("/out/down/a.bin", "wb", sync=True) as f:
            f.write(b"abc")
    moto_faults.configure(rates={"reset": 1.0}, path_filter="down/")  # counts afresh
    with pytest.raises(WriteError, match="upload not done, still retried"):
        gpufeed.sync("/out")
    assert moto_faults.counts()["injected"]["reset"] >= 3, "three tries reached the store"
    moto_faults.configure(rates={})
    assert gpufeed.sync("/out") == 1 and stored(bucket, "down/a.bin") == b"abc"


def test_a_503_and_reset_mix_still_lands_every_object_whole(bucket: Bucket, moto_faults: FaultControl) -> None:
    writable_through(moto_faults, bucket)
    moto_faults.configure(seed=7, rates={"503": 0.2, "reset": 0.1}, path_filter="mix/")
    # The faults are a function of each request's path, and the bucket's name is random: 40 small
    # objects make a run with no fault drawn (0.7 ** 42 of them) practically impossible.
    sizes = [10 + i for i in range(40)] + [300_000, 20 << 20]  # the last one multipart
    bodies = {f"mix/{i}.bin": os.urandom(size) for i, size in enumerate(sizes)}
    for key, body in bodies.items():
        gpufeed.write(f"/out/{key}", body)
    gpufeed.sync("/out/mix")
    injected = moto_faults.counts()["injected"]
    moto_faults.configure(rates={})
    assert injected.get("503", 0) + injected.get("reset", 0) > 0, injected
    for key, body in bodies.items():
        assert hashlib.sha256(stored(bucket, key)).digest() == hashlib.sha256(body).digest(), key


def test_a_removal_cut_by_kill_9_leaves_no_listed_object_the_store_lacks(bucket: Bucket, moto_faults: FaultControl) -> None:
    """The manifest forgets an object before the store deletes it: an agent killed in between
    leaves an unlisted object in the store, never a listed one that reads fail on."""
    writable_through(moto_faults, bucket)
    bodies = {"keep/a.bin": os.urandom(50_000), "gone/b.bin": os.urandom(60_000)}
    for key, body in bodies.items():
        gpufeed.write(f"/out/{key}", body, sync=True)
    moto_faults.configure(rates={"stall": 1.0}, stall=60.0, path_filter="delete")  # the store's delete (POST ?delete) hangs

    def remove() -> None:
        with contextlib.suppress(GpufeedError):  # its agent is killed under it
            gpufeed.remove("/out/gone/b.bin")

    threading.Thread(target=remove, daemon=True).start()
    deadline = time.monotonic() + 30
    while not moto_faults.counts()["events"]:
        assert time.monotonic() < deadline, "the removal never reached the store"
        time.sleep(0.05)
    killed(AgentClient(Settings.from_env()).hello().pid)
    moto_faults.configure(rates={})
    gpufeed._default = None
    listed = [item.path for item in gpufeed.walk("/out")]
    assert listed == ["/out/keep/a.bin"], "the removal under way is not listed"
    assert stored(bucket, "keep/a.bin") == gpufeed.read("/out/keep/a.bin") == bodies["keep/a.bin"]


def test_verify_leaves_writes_still_uploading_and_an_unreachable_store_to_the_cache(
    bucket: Bucket, moto_faults: FaultControl, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A write not yet in the store is no 'deleted at the source'; a store that cannot be asked
    whether cached files changed leaves them to the cache-only check, with one warning."""
    monkeypatch.setenv("GPUFEED_RETRY_TIMEOUT", "0.2")
    writable_through(moto_faults, bucket)
    gpufeed.write("/out/landed.bin", b"in the store")
    gpufeed.sync("/out")
    client = Client()
    try:
        moto_faults.configure(rates={"503": 1.0}, path_filter="pending/")
        gpufeed.write("/out/pending/a.bin", b"staged here")  # its upload fails: only this node holds it
        with caplog.at_level(logging.WARNING, logger="gpufeed"):
            done = verifying.verify(client, verifying.listed(client, "/out/pending"))
        assert (done.files, done.matched, done.mismatches) == (1, 1, []) and "cannot ask" not in caplog.text
        moto_faults.configure(rates={"503": 1.0}, path_filter="")
        with caplog.at_level(logging.WARNING, logger="gpufeed"):
            done = verifying.verify(client, verifying.listed(client, "/out/landed.bin"))
        assert (done.files, done.matched, done.mismatches) == (1, 1, [])
        assert f"cannot ask {bucket.url} whether files under /out changed" in caplog.text
    finally:
        moto_faults.configure(rates={})
        client.close()
