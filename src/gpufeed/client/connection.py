"""A reader's connection to the node agent; starts the agent on first use when none runs.

Every thread of every process gets its own socket (DataLoader workers fork; threads must not
interleave frames). If the agent dies mid-request, the request is sent again to a fresh agent:
fetches are idempotent, so a `kill -9` costs a retry, not a failed read.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import msgspec

from gpufeed.client import agent_service
from gpufeed.config import Settings, cluster_argv
from gpufeed.errors import GpufeedError, from_code
from gpufeed.rpc import codec
from gpufeed.rpc.messages import (
    AgentInfo,
    Clear,
    Cleared,
    Done,
    Hello,
    Hits,
    Refused,
    Reply,
    Request,
    Shutdown,
    Stats,
)

R = TypeVar("R", bound=msgspec.Struct)

START_TIMEOUT_S = 20.0
START_BACKOFF_S = 10.0
ATTEMPTS = 4
RETRY_PAUSE_S = 0.025
EXIT_ALREADY_RUNNING = 3  # AgentRunning's exit code: another starter won the race; connect to it


class AgentUnavailable(GpufeedError):
    """No agent could be reached or started for a cache dir."""


class AgentCannotStart(AgentUnavailable):
    """No agent runs and none could be started here (a cache dir that cannot be made or
    written: a read-only home): the blocks already cached may still be read."""


AGENT_ENTRY = (sys.executable, "-m", "gpufeed.agent")
"""The agent's own entry point: it loads no CLI."""


def agent_command(settings: Settings, idle_timeout: float | None) -> list[str]:
    argv = [*AGENT_ENTRY]
    for directory in settings.cache_dirs:
        argv += ["--cache-dir", str(directory)]
    argv += ["--cache-size", str(settings.cache_size)]
    if settings.metrics_addr:
        argv += ["--metrics-addr", settings.metrics_addr]
    argv += ["--log-format", settings.log_format]
    argv += cluster_argv(settings)
    if idle_timeout is not None:
        argv += ["--idle-timeout", str(idle_timeout)]
    return argv


def spawn_agent(settings: Settings, idle_timeout: float | None) -> subprocess.Popen:
    """Start an agent in its own session, logging to agent.log in the primary cache dir: the
    service `agent start` made for that dir, if it made one (`agent_service`), else one with
    these settings."""
    primary = settings.cache_dirs[0]
    make_cache_dir(primary)
    service = agent_service.remembered(primary)
    argv = agent_command(settings, idle_timeout) if service is None else [*AGENT_ENTRY, *service]
    with open(primary / "agent.log", "ab") as log:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )


def make_cache_dir(primary: Path) -> None:
    """The primary cache dir, made if missing; a path in the way is named, not 'File exists'."""
    try:
        primary.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise AgentUnavailable(f"cache dir {primary}: not a directory (a file is in the way)") from None


@contextmanager
def node_start_lock(primary: Path) -> Iterator[None]:
    """Held while starting the agent for `primary`; waits at most START_TIMEOUT_S for another
    starter (then goes ahead: the agent's own lock still admits only one). AgentCannotStart
    when the cache dir cannot be made or written (a read-only home)."""
    try:
        make_cache_dir(primary)
        fd = os.open(primary / "start.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise AgentCannotStart(f"cannot start the agent for {primary}: {exc.strerror or exc}") from exc
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def connect(primary: Path, timeout: float | None = None) -> socket.socket | None:
    """A connection to the agent for `primary`, or None when none listens. `timeout` bounds
    each send and receive, so a hung agent cannot hang its readers."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(codec.address(primary))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    sock.settimeout(timeout)
    return sock


def _log_tail(primary: Path) -> str:
    try:
        lines = (primary / "agent.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return f": {lines[-1]}" if lines else ""


class AgentClient:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.primary = settings.cache_dirs[0]
        self._local = threading.local()
        self._hello: AgentInfo | None = None
        self._dirs: tuple[Path, ...] = ()
        self._dirs_of: AgentInfo | None = None
        self._start_after = 0.0
        self._start_lock = threading.Lock()
        self.timeout = settings.agent_reply_timeout

    def _socket(self, start: bool) -> socket.socket:
        sock = getattr(self._local, "sock", None)
        if sock is not None and self._local.pid == os.getpid():
            return sock
        sock = self._connect_or_start() if start else connect(self.primary, self.timeout)
        if sock is None:
            raise ConnectionRefusedError(f"no agent is running for {self.primary}")
        try:
            self._hello = self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        self._local.sock, self._local.pid = sock, os.getpid()
        return sock

    def _handshake(self, sock: socket.socket) -> AgentInfo:
        """Every connection starts with a Hello: an agent still running from another gpufeed
        release (after an upgrade) is not used, so no message is misread on either side."""
        sock.sendall(codec.frame(Hello(codec.VERSION)))
        try:
            reply = codec.recv_reply(sock)
        except ConnectionResetError:
            # an agent killed a moment ago still holds its socket until its last thread exits:
            # an OSError, so request() retries and starts a new one once the old one is gone
            raise ConnectionResetError(
                f"the agent for {self.primary} closed the connection at its handshake "
                "(it is stopping, or runs another gpufeed release: `gpufeed agent stop` replaces it)"
            ) from None
        except codec.ProtocolError:
            reply = None
        if isinstance(reply, AgentInfo):
            return reply
        said = f" ({reply.failure.message})" if isinstance(reply, Refused) else ""
        raise AgentUnavailable(
            f"the agent for {self.primary} runs another gpufeed release{said}; "
            "stop it with `gpufeed agent stop` and the next read starts a current one"
        )

    def _drop(self) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is not None and self._local.pid == os.getpid():
            sock.close()
        self._local.sock = None

    def close(self) -> None:
        self._drop()

    def _connect_or_start(self) -> socket.socket:
        sock = connect(self.primary, self.timeout)
        if sock is not None:
            return sock
        # One starter per node: threads queue on a lock, processes on an flock; whoever gets
        # it second finds the agent the first one started. A Python start-up per racing
        # thread (64 warmup threads, 8 DataLoader workers) would starve a small machine.
        with self._start_lock:
            if time.monotonic() < self._start_after:
                raise AgentCannotStart(f"the agent for {self.primary} failed to start moments ago")
            try:
                with node_start_lock(self.primary):
                    sock = connect(self.primary, self.timeout)
                    return sock if sock is not None else self.start(self.settings.agent_idle_timeout)
            except AgentUnavailable as exc:
                # don't try again per read: a cache dir that cannot be made (a read-only home)
                # would cost every read a start-up and the request's retries
                self._start_after = time.monotonic() + START_BACKOFF_S
                if isinstance(exc, AgentCannotStart):
                    raise
                raise AgentCannotStart(str(exc)) from exc

    def start(self, idle_timeout: float | None) -> socket.socket:
        """Start an agent and connect to it (or to the one that won a race to start)."""
        try:
            process = spawn_agent(self.settings, idle_timeout)
        except OSError as exc:
            raise AgentUnavailable(f"cannot start the agent for {self.primary}: {exc}") from exc
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            sock = connect(self.primary, self.timeout)
            if sock is not None:
                return sock
            code = process.poll()
            if code not in (None, 0, EXIT_ALREADY_RUNNING):
                raise AgentUnavailable(f"the agent for {self.primary} exited with code {code}{_log_tail(self.primary)}")
            time.sleep(0.01)
        raise AgentUnavailable(f"the agent for {self.primary} did not start within {START_TIMEOUT_S:.0f} s")

    def request(self, message: Request, reply_type: type[R], *, start: bool = True) -> R:
        """Send one request and wait for its reply; with start=False never start an agent. An
        error the agent reports is raised as the gpufeed error it names."""
        data = codec.frame(message)
        failure: Exception | None = None
        for attempt in range(ATTEMPTS if start else 1):
            if failure is not None:
                time.sleep(RETRY_PAUSE_S * 2**attempt)  # a dying agent's socket lingers a moment
            try:
                sock = self._socket(start)
                sock.sendall(data)
                reply: Reply = codec.recv_reply(sock)
                break
            except (OSError, codec.ProtocolError) as exc:  # includes ConnectionError: the agent died; start another
                self._drop()
                failure = exc
        else:
            raise AgentUnavailable(f"agent for {self.primary}: {failure}")
        if isinstance(reply, Refused):
            raise from_code(reply.failure.code, reply.failure.message)
        if not isinstance(reply, reply_type):
            self._drop()
            raise AgentUnavailable(f"agent for {self.primary}: {type(reply).__name__} in reply to {type(message).__name__}")
        return reply

    def notify(self, message: Hits) -> None:
        """Send a one-way message on this thread's connection; never starts an agent. A hint:
        the caller does not wait for it to be read."""
        try:
            self._socket(False).sendall(codec.frame(message))
        except OSError as exc:
            self._drop()
            raise AgentUnavailable(f"agent for {self.primary}: {exc}") from exc

    def hello(self) -> AgentInfo:
        """The agent's greeting on this client's first connection."""
        failure: OSError | None = None
        for attempt in range(ATTEMPTS):
            if self._hello is not None:
                break
            if failure is not None:
                time.sleep(RETRY_PAUSE_S * 2**attempt)  # a dying agent's socket lingers a moment
            try:
                self._socket(True)
            except OSError as exc:  # no agent could be reached or started (a read-only cache dir)
                self._drop()
                failure = exc
        if self._hello is None:
            assert failure is not None
            raise AgentUnavailable(f"agent for {self.primary}: {failure.strerror or failure}") from failure
        return self._hello

    def stats(self, *, start: bool = True) -> AgentInfo:
        return self.request(Stats(), AgentInfo, start=start)

    def clear(self) -> int:
        """Drop every block that is not being fetched or pinned; returns the bytes freed."""
        return self.request(Clear(), Cleared).removed_bytes

    @property
    def dirs(self) -> tuple[Path, ...]:
        """The agent's cache dirs, as of its last handshake (every new handle asks: made once)."""
        hello = self.hello()
        if self._dirs_of is not hello:
            self._dirs, self._dirs_of = tuple(Path(d) for d in hello.dirs), hello
        return self._dirs

    def readable_dirs(self) -> tuple[tuple[Path, ...], AgentCannotStart | None]:
        """The cache dirs to read hits from, and why there is no agent to fetch misses into them
        (None when there is one). With no agent able to start (a read-only home, a cache baked
        into an image) the blocks already cached are still read where this node's settings put
        them: every hit checks its block's identity and sums, and nothing is written there.
        Raises AgentUnavailable when there is no cache dir to read (none was ever made)."""
        try:
            return self.dirs, None
        except AgentCannotStart as exc:
            if not self.settings.cache_dirs[0].is_dir():
                raise
            return self.settings.cache_dirs, exc


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie counts: it only waits for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _pid_of(primary: Path, sock: socket.socket) -> int | None:
    """The pid of the agent at the other end of `sock`, as the kernel tells it (its state file
    may be gone with its cache dir); else the one it wrote in its state file."""
    with contextlib.suppress(OSError):
        pid, uid = codec.peer(sock)
        if pid > 0 and uid == os.getuid():
            return int(pid)
    try:
        return int(json.loads((primary / "agent.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stop_agent(settings: Settings, timeout: float = 10.0) -> int | None:
    """Ask the agent for the settings' cache dir to exit and wait until its process is gone;
    returns its pid, or None when no agent was running. An agent of another release, which
    refuses this one's messages (or whose cache dir is gone), is sent SIGTERM by the pid the
    kernel gives for its socket."""
    agent = AgentClient(settings)
    agent_service.forget(settings.cache_dirs[0])
    pid: int | None
    try:
        pid = agent.stats(start=False).pid
        agent.request(Shutdown(), Done, start=False)
    except AgentUnavailable:
        sock = connect(settings.cache_dirs[0])
        if sock is None:
            return None
        with sock:
            pid = _pid_of(settings.cache_dirs[0], sock)
        if pid is None:
            return None
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pid
