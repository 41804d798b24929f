"""A directory of DCP checkpoints, one per step (`root/step-00000100`): save and async save, list
the complete ones, resume from the newest, keep the last N. The storage itself (writer, reader,
commit marker last) is `checkpoint.py`'s."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import logging
import os
import posixpath
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import _init_optim_state

import gpufeed
from gpufeed.client import Client
from gpufeed.errors import GpufeedError, InvalidArgument, PathNotFound
from gpufeed.integrations.torch.checkpoint import (
    METADATA,
    GpufeedReader,
    GpufeedWriter,
    gpufeed_errors,
    namespace_path,
    unwrapped,
)
from gpufeed.mount_options import source_options
from gpufeed.sources import open_source
from gpufeed.sources.local import LocalSource

STEP_DIR = "step-{step:08d}"
STEP_NAME = re.compile(r"step-(\d+)")
log = logging.getLogger("gpufeed.checkpoints")


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
        self.root = namespace_path(root).rstrip("/") or "/"
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
            with gpufeed_errors():
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
                future.set_exception(unwrapped(exc))
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
        with gpufeed_errors():
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


def _rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
