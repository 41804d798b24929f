"""Whether a process named in a file (a writer's staged file, a FUSE daemon's state, a warmup's
progress, a benchmark's scratch dir) still runs, so what it left can be cleaned up."""

from __future__ import annotations

import os
from pathlib import Path


def alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) has stopped. A
    process of another user, which this one may not signal, runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
