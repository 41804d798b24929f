"""What the benchmark scripts share: a private, throw-away gpufeed home."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gpufeed
from gpufeed.client.connection import stop_agent


@contextmanager
def scratch_home(prefix: str) -> Iterator[Path]:
    """A temp dir whose `home` is GPUFEED_HOME for this process (and the agents it starts);
    the agent is stopped and everything removed at the end, whatever happened."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["GPUFEED_HOME"] = str(work / "home")
    try:
        yield work
    finally:
        stop_agent(gpufeed.client().settings)
        shutil.rmtree(work, ignore_errors=True)


def small_files(root: Path, count: int, size: int) -> list[str]:
    """`count` files of `size` bytes in a new dir `root`, each different (windows of one random
    buffer, cheap to make); returns their names."""
    root.mkdir()
    payload = os.urandom(size + 4096)
    names = [f"{i:06d}.jpg" for i in range(count)]
    for i, name in enumerate(names):
        (root / name).write_bytes(payload[i % 4096 : i % 4096 + size])
    return names
