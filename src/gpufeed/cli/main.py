"""The `gpufeed` command: sub-apps are registered here; errors become one line and an exit code."""

from __future__ import annotations

import os
import sys

import typer
from typer.exceptions import TyperException

from gpufeed.cli import (
    agent,
    bench,
    cache,
    cluster,
    demo,
    files,
    fuse,
    gpu,
    logs,
    metrics,
    mount,
    pack,
    sync,
    top,
    verify,
    warmup,
)
from gpufeed.cli.console import command_group, err, out
from gpufeed.errors import GpufeedError

app = command_group(
    name="gpufeed",
    help="Keep GPUs fed: one namespace over every store, cached and prefetched on each node.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(show: bool) -> None:
    if show:
        out.print(f"gpufeed {package_version()}", highlight=False)
        raise typer.Exit()


def package_version() -> str:
    """The installed distribution's version: one number, kept in pyproject.toml only."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpufeed")
    except PackageNotFoundError:
        return "(not installed: run 'pip install -e .')"


@app.callback()
def main(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    log_format: str | None = typer.Option(
        None, "--log-format", help="text (default) or json: warnings as one JSON object per line [env: GPUFEED_LOG_FORMAT]"
    ),
    show_version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """gpufeed command line."""
    import logging

    from gpufeed.config import parse_log_format
    from gpufeed.logsetup import configure

    fmt = parse_log_format(log_format) if log_format else os.environ.get("GPUFEED_LOG_FORMAT") or "text"
    configure(parse_log_format(fmt, "GPUFEED_LOG_FORMAT"), "cli", debug=debug, level=logging.WARNING)


app.add_typer(mount.app, name="mount")
app.add_typer(agent.app, name="agent")
app.add_typer(cache.app, name="cache")
app.add_typer(cluster.app, name="cluster")
app.command("warmup")(warmup.warmup)
app.command("verify")(verify.verify)
app.command("sync")(sync.sync)
app.add_typer(logs.app, name="logs")
app.command("pack")(pack.pack)
app.add_typer(bench.app, name="bench")
app.command("demo")(demo.demo)
app.command("metrics")(metrics.metrics)
app.command("top")(top.top)
app.command("fuse")(fuse.fuse)
app.add_typer(gpu.app, name="gpu")
files.register(app)


def _fail(message: str, code: int, debug: bool) -> int:
    if debug:
        import traceback

        traceback.print_exc()
    err.print(f"gpufeed: error: {message}", markup=False, highlight=False, soft_wrap=True)
    return code


def _usage(exc: TyperException) -> str:
    """A usage error names the command it is about and where its help is."""
    message = exc.format_message().rstrip(".")
    ctx = getattr(exc, "ctx", None)
    if ctx is None:
        return message
    command = ctx.command_path.partition(" ")[2]
    return f"{command + ': ' if command else ''}{message} (see '{ctx.command_path} --help')"


def run(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    args = sys.argv[1:] if argv is None else argv
    end = args.index("--") if "--" in args else len(args)  # after "--", every word is an argument
    options, rest = args[:end], args[end:]
    if "--debug" in options:  # `gpufeed cat X --debug` as `gpufeed --debug cat X`: users put it last
        args = ["--debug", *(arg for arg in options if arg != "--debug"), *rest]
    debug = "--debug" in options or os.environ.get("GPUFEED_DEBUG") == "1"
    if debug:
        os.environ["GPUFEED_DEBUG"] = "1"  # an agent this command starts logs tracebacks too
    command = typer.main.get_command(app)
    try:
        code = command.main(args, prog_name="gpufeed", standalone_mode=False)
    except TyperException as exc:  # click's usage errors, as vendored by typer
        if type(exc).__name__ == "NoArgsIsHelpError":  # `gpufeed mount` alone: its help was printed, as typer does
            code = 2
        else:
            code = _fail(_usage(exc), getattr(exc, "exit_code", 2), False)  # the traceback of a typo helps nobody
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
