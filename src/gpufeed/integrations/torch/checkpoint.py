"""Checkpoints on gpufeed paths: `torch.distributed.checkpoint` (DCP) storage, a directory of
checkpoints with retention, and `save`/`load` for plain `torch.save` users.

    writer = GpufeedWriter("/ckpt/run1/step-00000100")       # a mount added with --writable
    future = dcp.async_save(state, storage_writer=writer)    # blocks for the copy to host memory
    dcp.load(state, storage_reader=GpufeedReader("/ckpt/run1/step-00000100"))

What a save does, and why a crash never leaves a checkpoint that loads wrong:
1. Each rank writes its files through the one write path (`client.writer`): staged on this
   node's disk, durable there when closed, uploaded in the background.
2. Each rank's `write_data` then waits until this node's files of the checkpoint are in the
   store (`gpufeed.sync`); with `async_save` that wait is in DCP's background thread.
3. The coordinator writes `.metadata` last and write-through (`sync=True`): the checkpoint is
   complete once the store has it, and by then every file it names is in the store.
A save into a directory that holds a checkpoint first removes that `.metadata`, so files being
rewritten are never named by a commit marker of other bytes. `Checkpoints` lists only
directories with a `.metadata` (complete ones), resumes from the newest and keeps the last N.

Restore reads through the cache: each file's blocks are fetched together (a restart on the same
node finds them on local disk, published from the staged bytes after the upload), files in
parallel.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import io
import logging
import os
import pickle
import posixpath
import queue
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    FileSystemBase,
    FileSystemReader,
    FileSystemWriter,
    _write_files_from_queue,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

import gpufeed
from gpufeed.client import Client
from gpufeed.client.writer import FeedWriter
from gpufeed.errors import GpufeedError, InvalidArgument, PathNotFound
from gpufeed.mount_options import source_options
from gpufeed.sources import open_source
from gpufeed.sources.local import LocalSource

METADATA = ".metadata"
"""DCP's commit marker: a checkpoint directory is complete when it holds this file."""
SCHEME = "gpufeed://"
WRITE_BUFFER = 8 << 20
"""Bytes gathered before each write into the staged file (DCP writes a tensor in many pieces)."""
READ_BUFFER = 1 << 20
STEP_DIR = "step-{step:08d}"
STEP_NAME = re.compile(r"step-(\d+)")
log = logging.getLogger("gpufeed.checkpoints")


def _path(path: str | os.PathLike[str]) -> str:
    """A namespace path from a path or a `gpufeed://` URL."""
    text = os.fspath(path)
    return "/" + text[len(SCHEME) :].lstrip("/") if text.startswith(SCHEME) else text


class NamespaceFiles(FileSystemBase):
    """DCP's file operations on the gpufeed namespace. Files are written through `client.writer`
    (a stream that raises commits nothing) and read through the cache."""

    def __init__(self, client: Client | None = None) -> None:
        self.client = client or gpufeed.client()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode == "wb":
            with FeedWriter(self.client, _path(path)) as raw, _staging_failures(raw):
                stream = io.BufferedWriter(raw, WRITE_BUFFER)
                yield stream
                if not stream.closed:
                    stream.flush()  # DCP closes it (a commit) itself; a caller that did not is committed here
        elif mode == "rb":
            with self.client.open(_path(path), "rb") as readable:
                yield io.BufferedReader(readable, READ_BUFFER)
        else:
            raise InvalidArgument(f"{path}: mode {mode!r}: checkpoints are written 'wb' and read 'rb'")

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return posixpath.join(_path(path), suffix)

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str:
        return _path(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Object stores have no rename: the bytes under the new name, then the old removed."""
        self.client.write(_path(new_path), self.client.read(_path(path)))
        self.client.remove(_path(path))

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Directories are implied by the files in them."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith(SCHEME)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        try:
            self.client.stat(_path(path))
        except PathNotFound:
            return False
        return True

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.client.remove(_path(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return [item.path for item in self.client.ls(_path(path))]


class GpufeedWriter(FileSystemWriter):
    """DCP `StorageWriter` for a gpufeed path (`dcp.save`, `dcp.async_save`). `thread_count`
    files per rank are written at once. As an `AsyncStager` it copies the state to host memory
    for `async_save` (reusing that copy across saves with `cache_staged_state_dict=True`)."""

    def __init__(
        self, path: str | os.PathLike[str], *, thread_count: int = 2, cache_staged_state_dict: bool = False,
        overwrite: bool = True, client: Client | None = None,
    ) -> None:
        super().__init__(_path(path), single_file_per_rank=True, sync_files=False, thread_count=thread_count,
                         cache_staged_state_dict=cache_staged_state_dict, overwrite=overwrite)
        self.files = NamespaceFiles(client)
        self.fs = self.files  # type: ignore[assignment]  # DCP's own code reaches the namespace through this
        self.path = self.files.init_path(path)
        self.is_coordinator = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The host copy `async_save` blocks for. With `cache_staged_state_dict` torch keeps it
        in pinned memory, which needs an accelerator; without one the copy is kept in plain memory,
        so a CPU job too skips reallocating (and page-faulting) it on every save."""
        if not self.cache_staged_state_dict or torch.accelerator.is_available():
            return super().stage(state_dict)  # type: ignore[no-any-return]
        self.per_thread_copy_ahead = 0
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict)
        return _copy_state_dict(state_dict, self.state_dict_cache)  # type: ignore[no-any-return]

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """The coordinator takes down an existing commit marker before any rank writes (every rank
        waits for the global plan, which comes after this), so a crash mid-save cannot leave an
        old `.metadata` naming new bytes."""
        if self.is_coordinator and self._metadata_exists():
            if not self.overwrite:
                raise InvalidArgument(f"{self.path}: a checkpoint is there already (overwrite=False)")
            self.files.rm_file(self._get_metadata_path(None if self.use_collectives else self.rank))
        return super().prepare_local_plan(plan)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        """This rank's files, staged and then in the store: the commit marker may follow."""
        written = super().write_data(plan, planner)
        written.wait()
        self.files.client.sync(self.path)
        return written

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue[Any]) -> TorchFuture[list[WriteResult]]:
        """DCP's file writers on `thread_count` threads, whose errors reach the caller: torch's own
        loop lets a helper thread's exception go (the save then commits without that thread's
        files, and the checkpoint fails only when loaded)."""
        results: queue.Queue[list[WriteResult]] = queue.Queue()
        arguments = (self.files.create_stream, file_queue, results, planner, self.transforms, self.per_thread_copy_ahead,
                     self.sync_files, self.thread_count, self.serialization_format)
        with ThreadPoolExecutor(self.thread_count, thread_name_prefix="gpufeed-checkpoint") as pool:
            writers = [pool.submit(_write_files_from_queue, *arguments) for _ in range(self.thread_count)]
        for writer in writers:
            writer.result()
        written: list[WriteResult] = []
        while not results.empty():
            written += results.get_nowait()
        future: TorchFuture[list[WriteResult]] = TorchFuture()
        future.set_result(written)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """`.metadata` last, write-through: once this returns the checkpoint is complete in the store."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {result.index: result.storage_data for rank in results for result in rank}
        metadata.storage_meta = self.storage_meta()
        rank = None if self.use_collectives or self.rank is None else self.rank
        with self.files.client.open(self._get_metadata_path(rank), "wb", sync=True) as f:
            pickle.dump(metadata, f)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return NamespaceFiles.validate_checkpoint_id(checkpoint_id)


class GpufeedReader(FileSystemReader):
    """DCP `StorageReader` for a gpufeed path (`dcp.load`): every file this rank needs is read
    through the cache, `thread_count` files at once, each file's missing blocks fetched together
    before its tensors are parsed."""

    def __init__(self, path: str | os.PathLike[str], *, thread_count: int = 4, client: Client | None = None) -> None:
        super().__init__(_path(path))
        self.files = NamespaceFiles(client)
        self.fs = self.files  # type: ignore[assignment]  # DCP's own code reaches the namespace through this
        self.path = self.files.init_path(path)
        self.thread_count = thread_count

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        if len(per_file) <= 1:
            self._warm(list(per_file))
            return super().read_data(plan, planner)

        def read_one(relative: str) -> None:
            self._warm([relative])
            super(GpufeedReader, self).read_data(dataclasses.replace(plan, items=per_file[relative]), planner).wait()

        with ThreadPoolExecutor(min(self.thread_count, len(per_file)), thread_name_prefix="gpufeed-restore") as pool:
            for done in [pool.submit(read_one, relative) for relative in per_file]:
                done.result()
        future: TorchFuture[None] = TorchFuture()
        future.set_result(None)
        return future

    def _warm(self, relatives: list[str]) -> None:
        client = self.files.client
        for relative in relatives:
            client.warm(client.handle(self.files.concat_path(self.path, relative)))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return NamespaceFiles.validate_checkpoint_id(checkpoint_id)


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its step and directory."""

    step: int
    path: str


class Checkpoints:
    """A directory of DCP checkpoints, one per step (`root/step-00000100`): save, list the complete
    ones, load the newest, keep the last `keep_last`."""

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int | None = None, client: Client | None = None) -> None:
        if keep_last is not None and keep_last < 1:
            raise InvalidArgument(f"keep_last={keep_last}: keep at least one checkpoint")
        self.root = _path(root).rstrip("/") or "/"
        self.keep_last = keep_last
        self.client = client or gpufeed.client()
        self._process_group: dist.ProcessGroup | None = None
        self._pruning = threading.Lock()
        self._saving: set[int] = set()
        """Steps this object is saving: incomplete until their `.metadata` lands, never pruned
        (async saves run at once and finish out of order)."""
        self._saved_before = False

    def path(self, step: int) -> str:
        if step < 0:
            raise InvalidArgument(f"step={step}: a checkpoint's step is 0 or more")
        return posixpath.join(self.root, STEP_DIR.format(step=step))

    def list(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first; a directory without `.metadata` is not one. A root
        no mount holds is an error, not an empty list: a typo would restart training from scratch."""
        self._relist()
        try:
            entries = self.client.ls(self.root)
        except PathNotFound:
            return []
        found = []
        for entry in entries:
            match = STEP_NAME.fullmatch(posixpath.basename(entry.path))
            if entry.is_dir and match and self._complete(entry.path):
                found.append(Checkpoint(int(match.group(1)), entry.path))
        return sorted(found, key=lambda c: c.step)

    def _relist(self) -> None:
        """Add to this node's manifest the root's files it lacks, and drop those gone from the
        store (one listing of the root): checkpoints another node saved or pruned since this
        node listed the mount (without a shared manifest) would otherwise read as a fresh start,
        or as steps whose files are gone. A file it knows keeps the version it knows (one changed
        since fails its read as changed, never mixes into a checkpoint), and this node's uploads
        still under way (no ETag yet) stay. A store that cannot be listed leaves the manifest as
        it is, with a warning."""
        namespace = self.client.namespace
        where = namespace.resolve(self.root)  # PathNotFound for a root no mount holds
        if where is None:
            return
        mount, prefix = where.mount, where.key
        try:
            source = open_source(posixpath.join(mount.url, prefix) if prefix else mount.url, source_options(mount),
                                 self.client.settings)
            stored = {posixpath.join(prefix, info.key): info for batch in source.list() for info in batch}
            known = {entry.key: entry.object_info() for entry in namespace.engine.walk(mount.generation, prefix)}
            for key, info in stored.items():
                if key not in known:  # one known keeps its version: changed since, its read says so
                    namespace.record_written(mount.path, dataclasses.replace(info, key=key))
            for key, info in known.items():
                if key not in stored and info.etag is not None:
                    namespace.record_removed(mount.path, key)
        except GpufeedError as exc:
            log.warning("%s: checkpoints listed as this node last saw them: %s", self.root, exc)

    def latest(self) -> Checkpoint | None:
        complete = self.list()
        return complete[-1] if complete else None

    def save(self, state_dict: dict[str, Any], step: int, **writer: Any) -> None:
        path = self._writable(step)
        self._begin(step)
        try:
            with _gpufeed_errors():
                dcp.save(state_dict, storage_writer=GpufeedWriter(path, client=self.client, **writer))
        finally:
            self._end(step)
        self._prune_after_save()

    def _writable(self, step: int) -> str:
        """The step's directory, checked before DCP starts: a read-only or unknown root is one
        clear error here, not an exception DCP gathers from its writer into a traceback dump."""
        path = self.path(step)
        self.client.namespace.writable_target(posixpath.join(path, METADATA))
        return path

    def async_save(self, state_dict: dict[str, Any], step: int, **writer: Any) -> Future[Any]:
        """Returns once the state is copied to host memory; the future is done when the
        checkpoint is complete in the store (and older ones beyond `keep_last` are pruned)."""
        writer_ = GpufeedWriter(self._writable(step), client=self.client, **writer)
        self._begin(step)
        try:
            saving = dcp.async_save(state_dict, storage_writer=writer_, process_group=self._group())
        except BaseException:
            self._end(step)
            raise
        assert isinstance(saving, Future)
        future: Future[Any] = Future()

        def pruned(saved: Future[Any]) -> None:
            self._end(step)
            try:
                metadata = saved.result()
                self._prune_after_save()
            except BaseException as exc:
                future.set_exception(_unwrapped(exc))
            else:
                future.set_result(metadata)

        saving.add_done_callback(pruned)
        return future

    def _begin(self, step: int) -> None:
        """`step` is being saved: prunes leave it alone until `_end`. The first save of this
        object, on rank 0, warns when a newer complete step is there."""
        with self._pruning:
            first, self._saved_before = not self._saved_before, True
        newer = [c.step for c in self.list() if c.step > step] if first and _rank_zero() else []
        if newer:  # a run rolled back to an earlier step: the diverged one would win every resume
            log.warning(
                "%s: saving step %d where step %d is complete (a run this one rolled back from?): load() resumes from "
                "the highest step%s; Checkpoints.remove(step) the newer ones if that run is abandoned",
                self.root, step, newer[-1], " and keep_last keeps the highest" if self.keep_last else "",
            )
        with self._pruning:
            self._saving.add(step)

    def _end(self, step: int) -> None:
        """The save of `step` is over (complete, or failed): its own prune, which follows, may take it."""
        with self._pruning:
            self._saving.discard(step)

    def _prune_after_save(self) -> None:
        """One rank prunes (rank 0): every rank removing the same files would race the others."""
        if _rank_zero():
            self.prune()

    def load(self, state_dict: dict[str, Any], step: int | None = None, **reader: Any) -> int | None:
        """Load `step`, or the newest complete checkpoint, into `state_dict` in place; returns the
        step loaded, or None when there is no complete checkpoint (a fresh start)."""
        if step is None:
            latest = self.latest()
            if latest is None:
                return None
            step = latest.step
        elif not self._complete(self.path(step)):
            raise PathNotFound(f"{self.path(step)}: no complete checkpoint (its {METADATA} is missing)")
        for value in state_dict.values():
            if isinstance(value, torch.optim.Optimizer):
                # DCP loads only the keys a state dict has, and a new optimizer's has no state yet:
                # its moments and steps would be dropped without a word. A step with zero grads
                # and lr 0 creates them (what torch's get_optimizer_state_dict does first).
                _init_optim_state(value)
        with _gpufeed_errors():
            dcp.load(state_dict, storage_reader=GpufeedReader(self.path(step), client=self.client, **reader))
        return step

    def prune(self) -> builtins.list[int]:
        """Remove complete checkpoints older than the last `keep_last`, and incomplete ones older
        than the newest complete one (saves that died; not one this object is still saving);
        returns the steps removed."""
        if self.keep_last is None:
            return []
        with self._pruning:
            complete = self.list()
            if not complete:
                return []
            keep = {c.step for c in complete[-self.keep_last :]} | self._saving
            newest = complete[-1].step
            removed = []
            for entry in self.client.ls(self.root):
                match = STEP_NAME.fullmatch(posixpath.basename(entry.path))
                if not (entry.is_dir and match):
                    continue
                step = int(match.group(1))
                if step not in keep and step < newest:
                    self._remove(entry.path)
                    removed.append(step)
            return removed

    def remove(self, step: int) -> None:
        """Remove checkpoint `step` (its commit marker first), complete or not."""
        path = self.path(step)
        if not any(entry.path == path for entry in self.client.ls(self.root)):
            raise PathNotFound(f"{path}: no such checkpoint")
        with self._pruning:
            self._remove(path)

    def _group(self) -> dist.ProcessGroup | None:
        """A gloo group of its own for the saves' collectives: an async save gathers plans from a
        background thread, which must not interleave with the job's own collectives on the
        default group. Made on the first async save, which every rank reaches together."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._process_group is None:
            self._process_group = dist.new_group(backend="gloo")
        return self._process_group

    def _complete(self, directory: str) -> bool:
        try:
            self.client.stat(posixpath.join(directory, METADATA))
        except PathNotFound:
            return False
        return True

    def _remove(self, directory: str) -> None:
        """The commit marker first: a checkpoint stops being listed before any of its files go.
        A file already gone (another process pruned it) is no error."""
        marker = posixpath.join(directory, METADATA)
        try:
            files = [item.path for item in self.client.walk(directory) if not item.is_dir and item.path != marker]
        except PathNotFound:
            files = []
        for item in [marker, *files]:
            with contextlib.suppress(PathNotFound):
                self.client.remove(item)
        self._remove_local_dirs(directory)

    def _remove_local_dirs(self, directory: str) -> None:
        """A local dir store keeps the directories its files were in: a pruned step's empty ones
        go too, or `keep_last` leaves one empty dir per checkpoint ever saved. Only here, where
        nothing writes into an old step (a store-wide clean-up would race writes making them)."""
        where = self.client.namespace.resolve(directory)
        if where is None or not where.mount.url.startswith("file://"):
            return
        source = open_source(where.mount.url, source_options(where.mount), self.client.settings)
        if not isinstance(source, LocalSource):
            return
        for parent, _, _ in os.walk(os.path.join(source.root, where.key), topdown=False):
            with contextlib.suppress(OSError):  # not empty: something else is there
                os.rmdir(parent)


def save(obj: object, path: str | os.PathLike[str], *, sync: bool = False) -> None:
    """`torch.save` to a gpufeed path: written whole or not at all (write-back; `sync=True` waits
    for the upload)."""
    with gpufeed.open(_path(path), "wb", sync=sync) as raw, _staging_failures(raw):
        stream = io.BufferedWriter(raw, WRITE_BUFFER)
        torch.save(obj, stream)
        stream.flush()


@contextlib.contextmanager
def _staging_failures(raw: FeedWriter) -> Iterator[None]:
    """torch.save's zip writer turns a failed write into `RuntimeError: unexpected pos`: the
    write's own error (a full staging disk, named) is raised in its place."""
    try:
        yield
    except RuntimeError:
        if raw.failure is not None:
            raise raw.failure from None
        raise


def _rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@contextlib.contextmanager
def _gpufeed_errors() -> Iterator[None]:
    try:
        yield
    except CheckpointException as exc:
        failure = _unwrapped(exc)
        if failure is exc:
            raise
        raise failure from None


def _unwrapped(exc: BaseException) -> BaseException:
    """A failed DCP call raises torch's CheckpointException: a BaseException, which a training
    loop's `except Exception` does not catch, with every rank's traceback in its text. Where
    every failed rank failed on a gpufeed error (bytes changed at the source, a read-only mount,
    a store down), the lowest failed rank's stands for it, the same on every rank: its one line
    says what to do. Any other failure is left as torch raised it, so none is hidden."""
    if isinstance(exc, CheckpointException):
        failures = [exc.failures[rank][0] for rank in sorted(exc.failures)]
        if failures and all(isinstance(failure, GpufeedError) for failure in failures):
            return failures[0]
    return exc


def load(path: str | os.PathLike[str], **kwargs: Any) -> Any:
    """`torch.load` from a gpufeed path, read through the cache; `kwargs` go to `torch.load`."""
    with gpufeed.open(_path(path), "rb") as raw:
        return torch.load(io.BufferedReader(raw, READ_BUFFER), **kwargs)
