"""The ways a training job can be fed, one registry entry each.

A mode prepares (for `copy`: copies the dataset, timed) and hands the loader a picklable
`ReaderSpec`; each worker process opens its own reader from it after start-up. A new mode
(the node cache's `cached`) is one more entry in MODES; nothing else changes.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol
from urllib.parse import unquote, urlsplit

from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument

if TYPE_CHECKING:  # annotations only: `gpufeed bench --help` reads MODES without importing numpy or the reader
    import numpy as np

    from gpufeed.bench.dataset import Dataset
    from gpufeed.client import Client, ObjectHandle

NO_CACHE = MappingProxyType({"cache": "off"})
"""Mount option of the modes that must read the source itself, never the node cache."""
COPY_CHUNK = 8 << 20
COPY_STREAMS = 8


class SampleReader(Protocol):
    @property
    def source_bytes(self) -> int:
        """Bytes this reader fetched from the source (not from local disk or a cache); read-only,
        so a reader may compute it."""
        ...

    def read_batch(self, reads: list[tuple[int, int, int]]) -> list[int]:
        """Read bytes [start, end) of dataset file `file` for each (file, start, end) of a
        batch, as a dataset's `__getitems__` does; returns the bytes read for each."""
        ...

    def close(self) -> None: ...


class ReaderSpec(Protocol):
    """Small and picklable: sent to each worker, which calls `open` in its own process."""

    def open(self, max_record: int) -> SampleReader: ...


@dataclass(frozen=True)
class Prepared:
    """`ahead`, when set, is given each epoch's sample order in the loader's process and
    returns an iterator the loader advances one sample per sample it hands to a worker: a mode
    that prefetches watches the job's exact order through it."""

    reader: ReaderSpec
    setup_s: float = 0.0
    setup_bytes: int = 0
    ahead: Callable[[np.ndarray], Iterator[object]] | None = None
    source_bytes: Callable[[], int] | None = None
    """Where readers alone cannot see every source byte (the agent fetches blocks on its own),
    the agent's total so far; epochs then report its growth plus the readers' own reads."""
    start: Callable[[], object] | None = None
    """Run as epoch 1's clock starts: what must not get a head start on the job (a mount
    whose background warmup begins with it)."""


@dataclass(frozen=True)
class RunContext:
    settings: Settings
    dataset: Dataset
    workdir: Path
    progress: Callable[[str], None]


@dataclass(frozen=True)
class Mode:
    """`mount_options` are added to the source's when the bench mounts it for this mode:
    where the read path's behaviour (caching) is a mount option, a mode sets it here.
    `remote` False mounts the source as given even when the run emulates a remote store:
    the local-disk baseline reads the files themselves."""

    name: str
    summary: str
    prepare: Callable[[RunContext], AbstractContextManager[Prepared]]
    mount_options: Mapping[str, str] = field(default_factory=dict)
    remote: bool = True


# -- direct: every sample through the namespace read path -----------------------------------


@dataclass(frozen=True)
class NamespaceReaderSpec:
    settings: Settings
    paths: tuple[str, ...]
    one_by_one: bool = False

    def open(self, max_record: int) -> NamespaceReader:
        from gpufeed.client import Client

        return NamespaceReader(Client(self.settings), self.paths, self.one_by_one)


class NamespaceReader:
    """Pins each file's version once per worker (one manifest lookup), then reads each batch
    through `Client.read_many`, one ranged read per sample, all in flight together; or, `one_by_one`,
    each sample with its own `read_range` after the one before, as a map-style dataset's
    `__getitem__` does. Source bytes are what it read from the source itself: every byte without
    a cache; with one, the ranges of sparse batches (the blocks are the agent's, counted by the mode)."""

    def __init__(self, client: Client, paths: tuple[str, ...], one_by_one: bool = False) -> None:
        self.client = client
        self.paths = paths
        self.one_by_one = one_by_one
        self.handles: dict[int, ObjectHandle] = {}

    @property
    def source_bytes(self) -> int:
        return self.client.direct_bytes

    def _handle(self, file: int) -> ObjectHandle:
        handle = self.handles.get(file)
        if handle is None:
            handle = self.handles[file] = self.client.handle(self.paths[file])
        return handle

    def read_batch(self, reads: list[tuple[int, int, int]]) -> list[int]:
        if self.one_by_one:
            return [len(self.client.read_range(self._handle(file), start, end)) for file, start, end in reads]
        data = self.client.read_many([(self._handle(file), start, end) for file, start, end in reads])
        return [len(piece) for piece in data]

    def close(self) -> None:
        self.client.close()


@contextmanager
def _direct(run: RunContext) -> Iterator[Prepared]:
    yield Prepared(NamespaceReaderSpec(run.settings, run.dataset.paths))


@contextmanager
def _getitem(run: RunContext) -> Iterator[Prepared]:
    """How people read object storage from a DataLoader today: a map-style dataset whose
    `__getitem__` GETs one sample, so the store sees the loader's own concurrency, workers x 1
    request, and each sample waits a full first-byte latency."""
    yield Prepared(NamespaceReaderSpec(run.settings, run.dataset.paths, one_by_one=True))


# -- copy: the whole dataset to local disk first, then train from it --------------------------


@dataclass(frozen=True)
class LocalReaderSpec:
    paths: tuple[str, ...]

    def open(self, max_record: int) -> LocalReader:
        return LocalReader(self.paths, max_record)


class LocalReader:
    """open + pread into one preallocated buffer per worker, as a loader over local files."""

    def __init__(self, paths: tuple[str, ...], max_record: int) -> None:
        self.paths = paths
        self.buffer = memoryview(bytearray(max_record))
        self.source_bytes = 0

    def read_batch(self, reads: list[tuple[int, int, int]]) -> list[int]:
        return [self._read(file, start, end) for file, start, end in reads]

    def _read(self, file: int, start: int, end: int) -> int:
        fd = os.open(self.paths[file], os.O_RDONLY)
        try:
            return os.preadv(fd, [self.buffer[: end - start]], start)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.buffer.release()


def copy_dataset(client: Client, dataset: Dataset, target: Path) -> tuple[str, ...]:
    """Copy every file through the read path, COPY_STREAMS chunk reads in flight, each chunk
    written in place with pwrite; returns the local paths."""
    free = shutil.disk_usage(target.parent).free
    if dataset.bytes > free:
        raise InvalidArgument(f"copy mode needs {dataset.bytes} bytes in {target.parent}, only {free} are free")
    handles = client.handle_many(dataset.paths)
    local = tuple(str(target / path.lstrip("/")) for path in dataset.paths)
    fds: list[int] = []
    try:
        for path, handle in zip(local, handles, strict=True):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            os.ftruncate(fds[-1], handle.size)
        chunks = [(i, start) for i, h in enumerate(handles) for start in range(0, h.size, COPY_CHUNK)]

        def fetch(chunk: tuple[int, int]) -> None:
            i, start = chunk
            os.pwrite(fds[i], client.read_range(handles[i], start, start + COPY_CHUNK), start)

        with ThreadPoolExecutor(COPY_STREAMS) as pool:
            for _ in pool.map(fetch, chunks):
                pass
    finally:
        for fd in fds:
            os.close(fd)
    return local


@contextmanager
def _local(run: RunContext) -> Iterator[Prepared]:
    """The files of a file:// source read where they lie: what a job with the dataset on its
    own disk gets, the baseline the other modes are measured against."""
    from gpufeed.client import Client

    client = Client(run.settings)
    try:
        local = []
        for path in run.dataset.paths:
            handle = client.handle(path)
            parts = urlsplit(handle.mount.url)
            if parts.scheme != "file":
                raise InvalidArgument(f"mode local reads file:// sources only, not {handle.mount.url}")
            local.append(str(Path(unquote(parts.path)) / handle.info.key))
    finally:
        client.close()
    yield Prepared(LocalReaderSpec(tuple(local)))


@contextmanager
def _copy(run: RunContext) -> Iterator[Prepared]:
    from gpufeed.client import Client

    target = run.workdir / "copy"
    client = Client(run.settings)
    try:
        run.progress(f"copy: copying {len(run.dataset.paths)} files to local disk")
        started = time.perf_counter()
        local = copy_dataset(client, run.dataset, target)
        elapsed = time.perf_counter() - started
        yield Prepared(LocalReaderSpec(local), elapsed, run.dataset.bytes)
    finally:
        client.close()
        shutil.rmtree(target, ignore_errors=True)


# -- cached: the same read path with the node cache on -----------------------------------------


def _agent_fetched(client: Client) -> int:
    """The bytes the agent fetched itself: readers count their own store reads (`Prepared.source_bytes`)."""
    info = client.agent.stats()
    return info.bytes_fetched - info.direct_bytes


def _cold_agent(client: Client) -> None:
    """Start the run's private agent, as a node's agent runs before a job does (its start-up
    is not the cold epoch's), with an empty cache: the modes of one run share it, and blocks
    are named by the store's object, not the mount, so a mode run after another would start
    warm."""
    client.agent.clear()


@contextmanager
def _cached(run: RunContext) -> Iterator[Prepared]:
    """Epoch 1 starts cold (`_cold_agent`) with sampler-aware prefetch: the agent fetches the
    samples the workers will read next, in the epoch's order; later epochs are warm. The run's
    private agent is stopped before its cache dir is removed."""
    from gpufeed.client import Client
    from gpufeed.client.connection import stop_agent
    from gpufeed.prefetch import Prefetcher, Read

    client = Client(run.settings)
    prefetcher = Prefetcher(client)
    dataset = run.dataset

    def ahead(order: np.ndarray) -> Iterator[object]:
        files, starts, ends = dataset.ranges(order)
        paths = dataset.paths
        return prefetcher.ahead(
            range(len(order)), lambda k: Read(paths[files[k]], int(starts[k]), int(ends[k]))
        )

    try:
        _cold_agent(client)

        def fetched() -> int:
            return _agent_fetched(client)

        yield Prepared(NamespaceReaderSpec(run.settings, dataset.paths), ahead=ahead, source_bytes=fetched)
    finally:
        prefetcher.close()
        client.close()
        stop_agent(run.settings)


# -- fuse: an unchanged script reading files at a gpufeed fuse mount ------------------------------


@contextmanager
def _fuse(run: RunContext) -> Iterator[Prepared]:
    """The mode's mount served by `gpufeed fuse` (background warmup on, as it is by default);
    workers open and pread files at the mountpoint as a script that knows nothing of gpufeed
    does. With the mount's cache off (`fuse-direct`) it is a plain FUSE view of the store:
    seed 003's comparison of a FUSE mount of the remote against the cached mount. The mount
    is made as epoch 1 starts, so its warmup gets no head start on the job's clock."""
    from gpufeed.client import Client
    from gpufeed.client.connection import stop_agent
    from gpufeed.integrations import fuse_mounts

    client = Client(run.settings)
    where = client.namespace.resolve(run.dataset.paths[0])
    assert where is not None
    nspath = where.mount.path
    point = run.workdir / f"fuse{nspath.replace('/', '-')}"
    point.mkdir()
    fuse_mounts.check(run.settings, point)
    try:
        _cold_agent(client)
        local = tuple(str(point / path[len(nspath) + 1 :]) for path in run.dataset.paths)
        yield Prepared(
            LocalReaderSpec(local),
            source_bytes=lambda: _agent_fetched(client),
            start=lambda: fuse_mounts.start(run.settings, point, nspath, warmup=True),
        )
    finally:
        if point in fuse_mounts.mounted():
            fuse_mounts.stop(run.settings, point)
        client.close()
        stop_agent(run.settings)


MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode(
            "direct",
            "every batch read from the source through the namespace, its samples in flight together, no cache",
            _direct,
            NO_CACHE,
        ),
        Mode(
            "getitem",
            "each worker reads one sample at a time from the source, as a plain map-style dataset does "
            "(workers x 1 request in flight), no cache",
            _getitem,
            NO_CACHE,
        ),
        Mode("copy", "the dataset copied to local disk first (copy time counted), then read locally", _copy, NO_CACHE),
        Mode("cached", "read through the node cache: epoch 1 cold, later epochs from local blocks", _cached),
        Mode(
            "fuse",
            "an unchanged script's open+pread of the files at a `gpufeed fuse` mount: epoch 1 cold with the "
            "mount's background warmup, later epochs warm",
            _fuse,
        ),
        Mode(
            "fuse-direct",
            "the same at a mount with the cache off: a plain FUSE view of the store, every read a request",
            _fuse,
            NO_CACHE,
        ),
        Mode(
            "local",
            "a file:// source's files read in place with open+pread, never through an emulated remote: the baseline",
            _local,
            NO_CACHE,
            remote=False,
        ),
    )
}
DEFAULT_MODES = ("direct", "copy", "cached")
"""What `gpufeed bench` runs unless --mode says otherwise."""


def parse_modes(text: str | None) -> list[Mode]:
    """`direct,copy` into modes; unknown names are refused naming the valid ones."""
    if not text:
        return [MODES[name] for name in DEFAULT_MODES]
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODES]
    if unknown or not names:
        raise InvalidArgument(f"unknown mode {', '.join(unknown) or repr(text)} (valid: {', '.join(MODES)})")
    return [MODES[name] for name in dict.fromkeys(names)]
