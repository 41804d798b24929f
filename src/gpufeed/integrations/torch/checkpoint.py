"""Checkpoints on gpufeed paths: `torch.distributed.checkpoint` (DCP) storage, and `save`/`load`
for plain `torch.save` users (a directory of checkpoints with retention: `checkpoint_dir.py`).

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
rewritten are never named by a commit marker of other bytes. `Checkpoints` (checkpoint_dir.py)
lists only directories with a `.metadata` (complete ones), resumes from the newest and keeps the last N.

Restore reads through the cache: each file's blocks are fetched together (a restart on the same
node finds them on local disk, published from the staged bytes after the upload), files in
parallel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import posixpath
import queue
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
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
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

import gpufeed
from gpufeed.client import Client
from gpufeed.client.writer import FeedWriter
from gpufeed.errors import GpufeedError, InvalidArgument, PathNotFound

METADATA = ".metadata"
"""DCP's commit marker: a checkpoint directory is complete when it holds this file."""
SCHEME = "gpufeed://"
WRITE_BUFFER = 8 << 20
"""Bytes gathered before each write into the staged file (DCP writes a tensor in many pieces)."""
READ_BUFFER = 1 << 20


def namespace_path(path: str | os.PathLike[str]) -> str:
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
            with FeedWriter(self.client, namespace_path(path)) as raw, _staging_failures(raw):
                stream = io.BufferedWriter(raw, WRITE_BUFFER)
                yield stream
                if not stream.closed:
                    stream.flush()  # DCP closes it (a commit) itself; a caller that did not is committed here
        elif mode == "rb":
            with self.client.open(namespace_path(path), "rb") as readable:
                yield io.BufferedReader(readable, READ_BUFFER)
        else:
            raise InvalidArgument(f"{path}: mode {mode!r}: checkpoints are written 'wb' and read 'rb'")

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return posixpath.join(namespace_path(path), suffix)

    def init_path(self, path: str | os.PathLike[str], **kwargs: Any) -> str:
        return namespace_path(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Object stores have no rename: the bytes under the new name, then the old removed."""
        self.client.write(namespace_path(new_path), self.client.read(namespace_path(path)))
        self.client.remove(namespace_path(path))

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Directories are implied by the files in them."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith(SCHEME)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        try:
            self.client.stat(namespace_path(path))
        except PathNotFound:
            return False
        return True

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.client.remove(namespace_path(path))

    def ls(self, path: str | os.PathLike[str]) -> list[str]:
        return [item.path for item in self.client.ls(namespace_path(path))]


class GpufeedWriter(FileSystemWriter):
    """DCP `StorageWriter` for a gpufeed path (`dcp.save`, `dcp.async_save`). `thread_count`
    files per rank are written at once. As an `AsyncStager` it copies the state to host memory
    for `async_save` (reusing that copy across saves with `cache_staged_state_dict=True`)."""

    def __init__(
        self, path: str | os.PathLike[str], *, thread_count: int = 2, cache_staged_state_dict: bool = False,
        overwrite: bool = True, client: Client | None = None,
    ) -> None:
        super().__init__(namespace_path(path), single_file_per_rank=True, sync_files=False, thread_count=thread_count,
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
        super().__init__(namespace_path(path))
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


def save(obj: object, path: str | os.PathLike[str], *, sync: bool = False) -> None:
    """`torch.save` to a gpufeed path: written whole or not at all (write-back; `sync=True` waits
    for the upload)."""
    with gpufeed.open(namespace_path(path), "wb", sync=sync) as raw, _staging_failures(raw):
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



@contextlib.contextmanager
def gpufeed_errors() -> Iterator[None]:
    try:
        yield
    except CheckpointException as exc:
        failure = unwrapped(exc)
        if failure is exc:
            raise
        raise failure from None


def unwrapped(exc: BaseException) -> BaseException:
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
    with gpufeed.open(namespace_path(path), "rb") as raw:
        return torch.load(io.BufferedReader(raw, READ_BUFFER), **kwargs)
