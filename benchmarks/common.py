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
