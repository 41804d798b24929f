"""The `gpufeed` command: sub-apps are registered here; errors become one line and an exit code."""

from __future__ import annotations

import os
import sys

import typer
from typer.exceptions import TyperException

from gpufeed.cli import agent, bench, cache, demo, files, mount, verify, warmup
from gpufeed.cli.console import err
from gpufeed.errors import GpufeedError

app = typer.Typer(
    name="gpufeed",
    help="Keep GPUs fed: one namespace over every store, cached and prefetched on each node.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors.")) -> None:
    """gpufeed command line."""


app.add_typer(mount.app, name="mount")
app.add_typer(agent.app, name="agent")
app.add_typer(cache.app, name="cache")
app.command("warmup")(warmup.warmup)
app.command("verify")(verify.verify)
app.add_typer(bench.app, name="bench")
app.command("demo")(demo.demo)
files.register(app)


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        import traceback

        traceback.print_exc()
    err.print(f"gpufeed: error: {message}", markup=False, highlight=False, soft_wrap=True)
    return code


def run(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args or os.environ.get("GPUFEED_DEBUG") == "1"
    command = typer.main.get_command(app)
    try:
        code = command.main(args, prog_name="gpufeed", standalone_mode=False)
    except TyperException as exc:  # click's usage errors, as vendored by typer
        code = _fail(exc.format_message(), getattr(exc, "exit_code", 2), debug)
    except typer.Exit as exc:
        code = exc.exit_code
    except typer.Abort:
        code = _fail("aborted", 130, debug)
    except KeyboardInterrupt:
        code = _fail("interrupted", 130, debug)
    except GpufeedError as exc:
        code = _fail(str(exc), exc.exit_code, debug)
    except BrokenPipeError:
        sys.stderr.close()
        code = 0
    except Exception as exc:  # a bug, not bad input: still one line, traceback with --debug
        code = _fail(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", 1, debug)
    sys.exit(code if isinstance(code, int) else 0)
