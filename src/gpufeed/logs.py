"""Inference logs: records appended to a directory of a writable mount, batched into segments.

    from gpufeed.logs import Appender
    with Appender("/out/requests") as log:
        log.append({"id": 17, "latency_ms": 12.5})

Acknowledgement. `append()` returns once the record is in a local write-ahead log (WAL) file by
`os.write`: from then on it survives the process being killed (kill -9, an OOM kill) and the
node agent dying, since the kernel holds the bytes. It does not survive a power cut or a kernel
crash unless `fsync=True`, which fsyncs each `append()` (each `append_many()` batch once) before
returning. A record whose `append()` never returned was not acknowledged: recovery drops a torn
last line, so a crash leaves at most that one record out, never half of it.

Segments. The WAL file of the open segment becomes an object of the directory when it reaches
`max_bytes`, or `max_seconds` after its first record, on `flush()` and on `close()`: its bytes
are committed through the write path (`gpufeed.open(path, "wb")`: durable on this node through
the agent's journal, listed in the manifest and readable here at once, uploaded in the
background; other nodes read it once uploaded, through a shared manifest or after `mount
refresh`), then the WAL file is removed. A segment is one record per line, JSON by default.

Names. `{UTC start yyyymmddTHHMMSS.ffffff}Z-{node}-{pid}-{seq}.jsonl`: segments sort by the time
of their first record and never collide across nodes, processes or appenders. The WAL file has
the segment's name, so a crash between the commit and the WAL's removal commits the same bytes
under the same name again: every acknowledged record is in the store once.

Recovery. A new Appender for a directory, `recover(path)` and `gpufeed logs recover PATH` commit
the WAL files that dead processes left. An owner holds an flock on its WAL file from its
creation to its removal, and the kernel releases it when the process dies however it dies: a
free lock is a dead owner. That is why liveness is not `kill(pid, 0)`: a pid is reused, and a
container sharing GPUFEED_HOME sees other pids.

An Appender belongs to the process that made it: a forked child (a DataLoader worker) makes its
own, since the parent's WAL file, lock and timer thread are the parent's.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import itertools
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

import gpufeed
from gpufeed.config import Settings, cluster_node_id
from gpufeed.errors import InvalidArgument, NotADirectory, PathNotFound, ReadOnlyMount, WriteError
from gpufeed.mount_options import is_writable
from gpufeed.paths import FileStat, normalize

if TYPE_CHECKING:
    from gpufeed.client import Client

log = logging.getLogger("gpufeed.logs")

SUFFIX = ".jsonl"
RETRY_S = 1.0
"""How soon a segment whose commit failed (the agent unreachable) is tried again."""

_sequence = itertools.count()
"""Segment numbers of this process: two appenders of one process never pick the same name."""


@dataclass
class _Segment:
    """One WAL file, locked by this process until its bytes are committed and it is removed."""

    wal: Path
    fd: int
    started: float
    size: int = 0

    @property
    def name(self) -> str:
        return self.wal.name


class Appender:
    """Appends records to segments under `path` (a directory in a writable mount); thread-safe.

    `encode` turns a record that is not bytes or str into one line (msgspec's JSON by default);
    `suffix` ends the segments' names. Records are lines, so no record may contain a newline."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int = 8 << 20,
        max_seconds: float = 10.0,
        fsync: bool = False,
        encode: Callable[[Any], bytes] = msgspec.json.encode,
        suffix: str = SUFFIX,
    ) -> None:
        if max_bytes <= 0 or max_seconds <= 0:
            raise InvalidArgument(f"Appender: max_bytes and max_seconds must be > 0, got {max_bytes} and {max_seconds}")
        self._client = gpufeed.client()
        self.path = log_dir(os.fspath(path), self._client, writing=True)
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self.fsync = fsync
        self._encode = encode
        self._suffix = suffix
        settings = Settings.from_env()
        self._wal_dir = wal_dir(self.path, settings)
        self._wal_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._node = re.sub(r"[^A-Za-z0-9._]+", "_", cluster_node_id(settings) or socket.gethostname())
        self._lock = threading.Condition()
        self._commit_lock = threading.Lock()
        self._open: _Segment | None = None
        self._pending: list[_Segment] = []
        self._closed = False
        self._pid = os.getpid()
        recover(self.path)
        self._timer = threading.Thread(target=self._roll_on_time, name=f"gpufeed-appender {self.path}", daemon=True)
        self._timer.start()

    def append(self, record: Any) -> None:
        """Write one record to the WAL; when this returns, the record is acknowledged."""
        self.append_many((record,))

    def append_many(self, records: Iterable[Any]) -> None:
        """Write records as one batch (one write, one fsync with `fsync=True`), in order."""
        data = b"".join(self._line(record) for record in records)
        if not data:
            return
        with self._lock:
            if self._closed:
                raise ValueError(f"Appender for {self.path} is closed")
            if os.getpid() != self._pid:
                raise InvalidArgument(f"Appender for {self.path} was made by process {self._pid}: make one in this process")
            segment = self._open or self._start()
            self._write(segment, data)
            full = segment.size >= self.max_bytes
            if full:
                self._seal()
        if full:
            try:
                self._commit()
            except Exception as exc:  # the records are acknowledged already: retried, not raised
                log.warning("gpufeed: warning: %s: segment not committed yet, retried: %s", self.path, exc)
                with self._lock:
                    self._lock.notify_all()  # the timer retries it

    def flush(self) -> None:
        """Commit the open segment now (and any left from a failed commit)."""
        with self._lock:
            self._seal()
        self._commit()

    def close(self) -> None:
        """Commit what is left and stop. A segment that still cannot be committed stays in the WAL
        dir for the next Appender or `recover()`, and the error is raised."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if os.getpid() != self._pid:  # a forked child's copy: its segments are the parent's to commit
                for segment in [*self._pending, *filter(None, [self._open])]:
                    os.close(segment.fd)
                return
            self._seal()
            self._lock.notify_all()
        self._timer.join()
        try:
            self._commit()
        finally:
            for segment in self._pending:  # releases their locks: recovery takes them over
                os.close(segment.fd)
            self._pending.clear()

    def __enter__(self) -> Appender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self, record: Any) -> bytes:
        if isinstance(record, str):
            line = record.encode()
        elif isinstance(record, bytes | bytearray | memoryview):
            line = bytes(record)
        else:
            line = self._encode(record)
        if b"\n" in line:
            raise InvalidArgument(f"{self.path}: a record is one line; this one contains a newline: {line[:80]!r}")
        return line + b"\n"

    def _start(self) -> _Segment:
        """A new WAL file, locked before it has its name, so recovery never sees it unlocked."""
        started = time.time()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(started)) + f".{int(started % 1 * 1e6):06d}Z"
        name = f"{stamp}-{self._node}-{os.getpid()}-{next(_sequence):06d}{self._suffix}"
        temporary = self._wal_dir / f".{name}.new"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(temporary, self._wal_dir / name)
        self._open = _Segment(self._wal_dir / name, fd, time.monotonic())
        self._lock.notify_all()  # the timer now has a deadline
        return self._open

    def _write(self, segment: _Segment, data: bytes) -> None:
        """All of `data` or none of it: a failed write is cut off again, so no torn line stays
        between acknowledged ones."""
        view = memoryview(data)
        try:
            done = 0
            while done < len(view):
                done += os.write(segment.fd, view[done:])
            if self.fsync:
                os.fsync(segment.fd)
        except OSError as exc:
            try:
                os.ftruncate(segment.fd, segment.size)
            except OSError:
                self._seal()  # its torn last line is dropped when it is committed
            why = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc.strerror or str(exc)
            raise WriteError(f"{self.path}: record not appended to {segment.wal}: {why}") from None
        segment.size += len(data)

    def _seal(self) -> None:
        """End the open segment (under the lock); `_commit` then makes it an object."""
        if self._open is not None:
            self._pending.append(self._open)
            self._open = None

    def _commit(self) -> None:
        """Commit the sealed segments, oldest first; each one's WAL file goes once it is committed."""
        with self._commit_lock:
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    segment = self._pending[0]
                commit_segment(self._client, self.path, segment.wal, segment.fd)
                segment.wal.unlink()
                os.close(segment.fd)
                with self._lock:
                    self._pending.pop(0)

    def _roll_on_time(self) -> None:
        """The timer thread: seals the open segment `max_seconds` after its first record, and
        tries failed commits again every RETRY_S."""
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                if self._open is not None and now >= self._open.started + self.max_seconds:
                    self._seal()
                if not self._pending:
                    due = None if self._open is None else self._open.started + self.max_seconds - now
                    self._lock.wait(due)
                    continue
            try:
                self._commit()
                continue
            except Exception as exc:
                log.warning("gpufeed: warning: %s: segment not committed yet, retried: %s", self.path, exc)
            with self._lock:
                if not self._closed:
                    self._lock.wait(RETRY_S)


def log_dir(path: str, client: Client, *, writing: bool) -> str:
    """`path` as a log directory: inside a mount (a writable one when `writing`), not a file."""
    path = normalize(path)
    where = client.namespace.resolve(path)
    if where is None:
        raise PathNotFound(f"{path}: not inside a mount; a log directory is in one (see 'gpufeed mount ls')")
    if writing and not is_writable(where.mount):
        raise ReadOnlyMount(f"{path}: mount {where.mount.path} ({where.mount.url}) is read-only: mount it with --writable")
    try:
        stat = client.namespace.stat(path)
    except PathNotFound:
        if writing:
            return path  # its first segment makes it
        raise PathNotFound(f"{path}: no such log directory (no segment committed yet?)") from None
    if not stat.is_dir:
        raise NotADirectory(f"{path}: is a file; a log directory holds segments")
    return path


def wal_dir(path: str, settings: Settings) -> Path:
    """This node's WAL files for log directory `path`: local disk, under GPUFEED_HOME."""
    return settings.home / "appender" / hashlib.sha256(path.encode()).hexdigest()[:24]


def acknowledged(fd: int) -> bytes:
    """A WAL file's complete lines: a torn last line was never acknowledged."""
    data = bytearray()
    while chunk := os.pread(fd, 8 << 20, len(data)):
        data += chunk
    return bytes(data[: data.rfind(b"\n") + 1])


def commit_segment(client: Client, path: str, wal: Path, fd: int) -> None:
    """Commit a WAL file's acknowledged records as the segment of the same name: the one write
    path, write-back (durable on this node when this returns)."""
    data = acknowledged(fd)
    if data:
        client.write(f"{path}/{wal.name}", data)


def recover(path: str | os.PathLike[str]) -> int:
    """Commit the segments of this node's dead appenders of `path`; how many were committed."""
    client = gpufeed.client()
    path = log_dir(os.fspath(path), client, writing=True)
    directory = wal_dir(path, Settings.from_env())
    committed = 0
    for wal in sorted(directory.iterdir()) if directory.is_dir() else ():
        try:
            fd = os.open(wal, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:  # its owner committed it meanwhile
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner is alive
            try:
                if os.stat(wal).st_ino != os.fstat(fd).st_ino:
                    continue
            except FileNotFoundError:  # another recovery took it first
                continue
            if wal.name.startswith("."):  # created, never named: it holds no record
                wal.unlink()
                continue
            commit_segment(client, path, wal, fd)
            wal.unlink()
            committed += 1
        finally:
            os.close(fd)
    return committed


def segments(path: str | os.PathLike[str], suffix: str = SUFFIX) -> list[FileStat]:
    """The committed segments of log directory `path`, oldest first (from the manifest)."""
    client = gpufeed.client()
    path = log_dir(os.fspath(path), client, writing=False)
    found = [item for item in client.ls(path) if not item.is_dir and item.path.endswith(suffix)]
    return sorted(found, key=lambda item: item.path)


def lines(segment: FileStat) -> list[bytes]:
    """A segment's records, as lines without their newlines."""
    return gpufeed.client().read(segment.path).splitlines()


def json_or_line(line: bytes) -> Any:
    """A JSON record decoded; a line that is not JSON (a bytes or str record) as its bytes."""
    try:
        return msgspec.json.decode(line)
    except msgspec.DecodeError:
        return line


def read(
    path: str | os.PathLike[str], *, decode: Callable[[bytes], Any] | None = json_or_line, suffix: str = SUFFIX
) -> Iterator[Any]:
    """Every committed record of log directory `path`, segment by segment in name order (the
    order of each appender's appends), decoded by `decode`; `decode=None` yields the lines as
    bytes."""
    for segment in segments(path, suffix):
        for line in lines(segment):
            yield line if decode is None else decode(line)
