"""The console script's entry: `cli.main` imports typer, rich and every command (about 0.3 s),
and a Ctrl-C meanwhile is 'interrupted', exit 130, as one during a command is, not a traceback."""

from __future__ import annotations

import sys


def run() -> None:
    try:
        from gpufeed.cli.main import run as main
    except KeyboardInterrupt:
        sys.stderr.write("gpufeed: error: interrupted\n")  # as cli.main says it
        raise SystemExit(130) from None
    main()
