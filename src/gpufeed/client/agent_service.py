"""The agent `gpufeed agent start` made, remembered: its flags are kept in the primary cache dir,
so a reader that finds that agent gone (kill -9, the OOM killer) starts the same service again,
with the operator's quota, metrics address and cluster settings and no idle timeout, rather
than one with the reader's own environment. `gpufeed agent stop` (any `stop_agent`) ends the
service and forgets it."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

SERVICE_FILE = "agent-service.json"


def remember(primary: Path, flags: list[str]) -> None:
    """Keep the flags of the agent just started for `primary` (written whole or not at all)."""
    path = primary / SERVICE_FILE
    temporary = path.with_name(f".{SERVICE_FILE}.{os.getpid()}")
    temporary.write_text(json.dumps({"flags": flags}))
    os.replace(temporary, path)


def remembered(primary: Path) -> list[str] | None:
    """The flags of the service started for `primary`; None when none was, or the file is unreadable."""
    try:
        flags = json.loads((primary / SERVICE_FILE).read_text())["flags"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return flags if isinstance(flags, list) and all(isinstance(f, str) for f in flags) else None


def forget(primary: Path) -> None:
    with contextlib.suppress(OSError):
        (primary / SERVICE_FILE).unlink()


def flag(flags: list[str], name: str) -> str | None:
    """The value `flags` give `name` (the last one), or None."""
    found = None
    for n, given in enumerate(flags[:-1]):
        if given == name:
            found = flags[n + 1]
    return found
