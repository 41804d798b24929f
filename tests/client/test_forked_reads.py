"""Reads in a process forked from one that used obstore, as a DataLoader worker is: obstore's
runtime does not survive a fork, so the agent reads such a process's remote ranges for it."""

from __future__ import annotations

import hashlib
import multiprocessing
from typing import Any

import gpufeed
from gpufeed.namespace import Namespace
from tests.conftest import Bucket


def _read_in_child(paths: list[str], out: Any) -> None:
    client = gpufeed.client()
    try:
        hashes = [hashlib.sha256(v).hexdigest() for v in client.read_files(paths)]
    except Exception as exc:
        out.put(f"{type(exc).__name__}: {exc}")
        return
    out.put((hashes, client.source_bytes, client.direct_bytes))


def in_forked_child(paths: list[str]) -> Any:
    """What `_read_in_child` reports from a process forked as a DataLoader worker is."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_read_in_child, args=(paths, results))
    child.start()
    try:
        return results.get(timeout=60)
    finally:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()


def test_forked_worker_reads_a_mount_with_the_cache_off(bucket: Bucket) -> None:
    """Before the agent read for it, the worker's own GET never completed."""
    data = bytes(range(256)) * 400
    bucket.put("d/a.bin", data)
    Namespace().add_mount("/off", f"{bucket.url}/d", {"endpoint": bucket.endpoint, "cache": "off"})
    assert gpufeed.read("/off/a.bin") == data  # the parent's own read: obstore's runtime starts here
    hashes, source_bytes, direct_bytes = in_forked_child(["/off/a.bin"])
    assert hashes == [hashlib.sha256(data).hexdigest()]
    assert (source_bytes, direct_bytes) == (len(data), 0)
