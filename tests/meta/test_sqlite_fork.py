"""A process that forks while another of its threads is inside SQLite (a DataLoader forking
workers while the prefetch thread opens its connection): every child must open its own
connection and read, never hang on a mutex it inherited locked."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from gpufeed.meta.base import Entry, Mount
from gpufeed.meta.sqlite import SqliteEngine

FORKS = 60


def test_forks_while_a_thread_connects_and_queries_never_hang(tmp_path: Path) -> None:
    engine = SqliteEngine(tmp_path / "meta.db")
    generation = engine.new_generation()
    engine.put_entries(generation, [Entry("", f"f{i:04d}", False, i) for i in range(2000)])
    engine.commit_mount(Mount("/data", "file:///x", generation=generation), previous=None)
    stop = threading.Event()

    def busy() -> None:  # new threads open new connections (sqlite3_open holds SQLite's global mutexes)
        while not stop.is_set():
            worker = threading.Thread(target=lambda: sum(1 for _ in engine.walk(generation, "")))
            worker.start()
            worker.join()

    churn = threading.Thread(target=busy, daemon=True)
    churn.start()
    children = []
    try:
        for _ in range(FORKS):
            pid = os.fork()
            if pid == 0:  # the child: a fresh connection, one lookup, out
                ok = engine.lookup(generation, "", "f0007") == Entry("", "f0007", False, 7)
                os._exit(0 if ok else 1)
            children.append(pid)
    finally:
        stop.set()
        churn.join(timeout=30)
    deadline = time.monotonic() + 30
    stuck = []
    for pid in children:
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            stuck.append(pid)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        else:
            assert os.waitstatus_to_exitcode(done[1]) == 0
    assert stuck == [], f"{len(stuck)} of {FORKS} forked children hung in SQLite"
