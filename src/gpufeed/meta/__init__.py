"""Metadata engines: SQLite (embedded default) and Redis (clusters), one protocol."""

from __future__ import annotations

from gpufeed.config import Settings, check_redis_url
from gpufeed.errors import InvalidArgument
from gpufeed.meta.base import Entry, MetaEngine, Mount


def open_engine(settings: Settings) -> MetaEngine:
    url = settings.meta_url
    if not url:
        from gpufeed.meta.sqlite import SqliteEngine

        return SqliteEngine(settings.home / "meta.db")
    if url.startswith(("redis://", "rediss://", "unix://")):
        from gpufeed.meta.redis import RedisEngine

        check_redis_url(url, "GPUFEED_META")

        return RedisEngine(url)
    if url.startswith("sqlite://"):
        from pathlib import Path

        from gpufeed.meta.sqlite import SqliteEngine

        return SqliteEngine(Path(url.removeprefix("sqlite://")))
    raise InvalidArgument(f"GPUFEED_META={url!r}: expected redis://HOST:PORT/DB or sqlite:///PATH")


__all__ = ["Entry", "MetaEngine", "Mount", "open_engine"]
