"""How the agent logs: one line per event, as text for people or as one JSON object per line
(`--log-format json`) for a log collector. Messages name stores by URL and endpoint, never by
options or credentials (`sources.objstore.ObstoreSource.where`), so neither format holds secrets."""

from __future__ import annotations

import json
import logging
import time


class JsonFormatter(logging.Formatter):
    """{"time": ISO 8601 UTC, "level", "logger", "message"[, "exception"]} on one line."""

    def format(self, record: logging.LogRecord) -> str:
        event = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event, ensure_ascii=False)


def configure(fmt: str, who: str = "agent") -> None:
    """Log INFO and above to stderr in format `fmt` ("text" or "json")."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {who} %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
