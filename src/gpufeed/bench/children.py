"""Helper processes the bench starts (HTTP server, shaper): each dies with its parent and is
stopped by the context that started it, so an interrupted run leaves nothing behind."""

from __future__ import annotations

import asyncio
import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpufeed.errors import GpufeedError

START_TIMEOUT = 20.0
_PR_SET_PDEATHSIG = 1


class HelperFailed(GpufeedError):
    """A helper process (server, shaper) did not start."""


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends SIGTERM when the parent dies, even
    by SIGKILL, and a new session keeps a terminal's Ctrl-C for the parent to handle."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _tail(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f": {lines[-1]}" if lines else ""


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_for_port(process: subprocess.Popen[bytes], port: int, name: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise HelperFailed(f"{name} exited with code {process.returncode}{_tail(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise HelperFailed(f"{name} did not listen on 127.0.0.1:{port} within {START_TIMEOUT:g}s{_tail(log)}")


def _announced_port(process: subprocess.Popen[bytes], name: str, log: Path) -> int:
    """The port a Python helper writes as its first stdout line once it listens."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT)
    line = process.stdout.readline() if ready else b""
    if not line.strip().isdigit():
        process.poll()
        raise HelperFailed(f"{name} did not start (exit code {process.returncode}){_tail(log)}")
    return int(line)


@contextmanager
def helper(
    argv: list[str], name: str, log: Path, port: int | None = None, env: dict[str, str] | None = None
) -> Iterator[int]:
    """Run `argv` until the block ends; yields its port: `port` once something listens there,
    or, when None, the port the helper announces on stdout. `env` is added to ours."""
    with log.open("ab") as sink:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if port is None else sink,
            stderr=sink,
            start_new_session=True,
            preexec_fn=_die_with_parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    try:
        if port is None:
            port = _announced_port(process, name, log)
        else:
            _wait_for_port(process, port, name, log)
        yield port
    finally:
        _stop(process)
        if process.stdout is not None:
            process.stdout.close()


async def until_parent_exits() -> None:
    """Backstop where PR_SET_PDEATHSIG does not exist: a helper whose parent is gone exits."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(0.5)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
