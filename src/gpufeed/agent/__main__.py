"""`python -m gpufeed.agent`: the agent's own entry point, which readers start on first use.

Kept apart from the CLI so a reader's agent starts without loading typer, rich or the
benchmark. `gpufeed agent` runs the same `main`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from gpufeed.agent.manager import AgentConfig
from gpufeed.agent.service import run_agent
from gpufeed.config import CLUSTER_FLAGS, Settings, parse_addr, parse_log_format, parse_quota, with_cluster_flags
from gpufeed.errors import GpufeedError
from gpufeed.logsetup import configure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpufeed.agent", description="Run the node agent in the foreground.")
    parser.add_argument("--cache-dir", action="append", type=Path, default=[], help="cache dir (repeatable)")
    parser.add_argument("--cache-size", help="quota, e.g. 200GiB; always bounded by free space")
    parser.add_argument("--idle-timeout", type=float, help="exit after this many seconds without clients")
    parser.add_argument("--metrics-addr", help="serve Prometheus metrics on HOST:PORT (PORT alone: 127.0.0.1)")
    parser.add_argument("--log-format", help="text (default) or json: one JSON object per line")
    for flag in CLUSTER_FLAGS:
        parser.add_argument(flag, dest=flag)
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
        if args.metrics_addr is not None:
            parse_addr(args.metrics_addr)
            settings = dataclasses.replace(settings, metrics_addr=args.metrics_addr)
        if args.log_format is not None:
            settings = dataclasses.replace(settings, log_format=parse_log_format(args.log_format))
        settings = with_cluster_flags(settings, {flag: getattr(args, flag) for flag in CLUSTER_FLAGS})
        configure(settings.log_format, debug=settings.debug)
        dirs = tuple(d.expanduser().absolute() for d in args.cache_dir) or settings.cache_dirs
        size = parse_quota(args.cache_size, "--cache-size") if args.cache_size else settings.cache_size
        run_agent(AgentConfig(dirs, size, settings.cache_free_ratio, args.idle_timeout), settings)
    except GpufeedError as exc:
        sys.stderr.write(f"gpufeed agent: error: {exc}\n")  # the process's one error line, logging or not
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
