"""Logs are one line per event: an unexpected error adds its type and message, its traceback
only under --debug (the command line's JSON logs: tests/sources/test_retry.py)."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from gpufeed.logsetup import CliFormatter, JsonFormatter, TextFormatter


def _failed_record() -> logging.LogRecord:
    try:
        raise OSError("disk on fire\nsecond line")
    except OSError:
        return logging.getLogger("gpufeed.agent").makeRecord(
            "gpufeed.agent", logging.ERROR, __file__, 1, "block %d of %s", (3, "a/b.bin"), sys.exc_info()
        )


@pytest.mark.parametrize("debug", [False, True])
def test_an_unexpected_error_is_one_line_unless_debug(debug: bool) -> None:
    record = _failed_record()
    text = TextFormatter("%(levelname)s %(message)s", debug).format(record)
    cli = CliFormatter("%(message)s", debug).format(record)
    event = json.loads(JsonFormatter(debug).format(record))
    assert text.splitlines()[0] == "ERROR block 3 of a/b.bin: OSError: disk on fire second line"
    assert cli.splitlines()[0] == "gpufeed: error: block 3 of a/b.bin: OSError: disk on fire second line"
    assert event["error"] == "OSError: disk on fire second line" and event["message"] == "block 3 of a/b.bin"
    for shown in (text, cli):
        assert ("Traceback (most recent call last)" in shown) is debug
        assert (len(shown.splitlines()) == 1) is not debug
    assert ("traceback" in event) is debug
