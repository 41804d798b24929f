"""How gpufeed logs: one line per event, as text for people or as one JSON object per line
(`--log-format json`) for a log collector. An unexpected error adds its type and message to its
line; its traceback only under `--debug` (`GPUFEED_DEBUG=1`), so a log stays one line per event.
Messages name stores by URL and endpoint, never by options or credentials
(`sources.objstore.ObstoreSource.where`), so neither format holds secrets."""

from __future__ import annotations

import json
import logging
import time

LIBRARY_PREFIX = "gpufeed: warning: "
"""What the library's own warnings start with, so that a script that never configured logging
(Python prints bare messages then) still sees where they come from; formatters drop it."""


def _message(record: logging.LogRecord) -> str:
    return record.getMessage().removeprefix(LIBRARY_PREFIX)


def _error(record: logging.LogRecord) -> str:
    """The exception a record carries, as `Type: message` on one line."""
    assert record.exc_info and record.exc_info[0] is not None
    kind, value, _ = record.exc_info
    return f"{kind.__name__}: {value}".replace("\n", " ")


class TextFormatter(logging.Formatter):
    def __init__(self, fmt: str, debug: bool) -> None:
        super().__init__(fmt)
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        if not record.exc_info:
            return super().format(record)
        kept = record.exc_info if self.debug else None
        brief = logging.makeLogRecord({**record.__dict__, "exc_info": kept, "exc_text": None})
        brief.msg, brief.args = f"{_message(record)}: {_error(record)}", None
        return super().format(brief)


class CliFormatter(TextFormatter):
    """`gpufeed: warning: …`, like the command line's own error lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        return f"gpufeed: {record.levelname.lower()}: {record.message.removeprefix(LIBRARY_PREFIX)}"


class JsonFormatter(logging.Formatter):
    """{"time": ISO 8601 UTC, "level", "logger", "message"[, "error"[, "traceback"]]} on one line."""

    def __init__(self, debug: bool = False) -> None:
        super().__init__()
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        event = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": _message(record),
        }
        if record.exc_info:
            event["error"] = _error(record)
            if self.debug:
                event["traceback"] = self.formatException(record.exc_info)
        return json.dumps(event, ensure_ascii=False)


def configure(fmt: str, who: str = "agent", *, debug: bool = False, level: int = logging.INFO) -> None:
    """Log `level` and above to stderr in format `fmt` ("text" or "json"). A daemon's text lines
    (`who`: agent, fuse) carry a time and its name; the command line's read like its error lines."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(debug))
    elif who == "cli":
        handler.setFormatter(CliFormatter("%(message)s", debug))
    else:
        handler.setFormatter(TextFormatter(f"%(asctime)s {who} %(levelname)s %(message)s", debug))
    logging.basicConfig(level=level, handlers=[handler], force=True)
