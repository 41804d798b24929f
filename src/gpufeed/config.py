"""Every setting gpufeed reads from the environment, in one place.

Settings are read when a `Settings` is built (not at import), so tests and
child processes can change the environment and get a fresh view.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        from gpufeed.errors import InvalidArgument

        raise InvalidArgument(f"environment variable {name}={raw!r} is not a number") from None


@dataclass(frozen=True)
class Settings:
    """Resolved configuration.

    home: `GPUFEED_HOME`, default `~/.gpufeed`; holds the SQLite metadata and the cache.
    meta_url: `GPUFEED_META`; empty means SQLite at `home/meta.db`, or `redis://host:port/db`.
    connect_timeout / request_timeout: seconds for source connections and whole requests
        (`GPUFEED_CONNECT_TIMEOUT`, `GPUFEED_REQUEST_TIMEOUT`), so an unreachable
        endpoint fails instead of hanging.
    retry_timeout: seconds a request may spend in retries (`GPUFEED_RETRY_TIMEOUT`).
    """

    home: Path
    meta_url: str
    connect_timeout: float
    request_timeout: float
    retry_timeout: float

    @classmethod
    def from_env(cls) -> Settings:
        home = Path(os.environ.get("GPUFEED_HOME") or Path.home() / ".gpufeed").expanduser()
        return cls(
            home=home,
            meta_url=os.environ.get("GPUFEED_META", ""),
            connect_timeout=_float_env("GPUFEED_CONNECT_TIMEOUT", 5.0),
            request_timeout=_float_env("GPUFEED_REQUEST_TIMEOUT", 60.0),
            retry_timeout=_float_env("GPUFEED_RETRY_TIMEOUT", 15.0),
        )
