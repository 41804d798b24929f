"""Writes: staged on this node's disk, recorded in the manifest, uploaded in the background.

A writer (`client.writer.FeedWriter`) fills a file in the staging dir and fsyncs it; on close it
sends `Commit`. The agent renames the file to an upload id and writes a journal record beside it
(fsynced, then renamed into place): once the reply leaves, the write survives a crash of the
agent or of the node. It records the object in its mount's manifest with a sha256 of its bytes
(the bytes' name: `blocks.object_blocks`), so this node reads it at once: misses of its blocks
are served from the staged bytes (`StagedBlocks`, first in the fetcher's chain). The upload is
one obstore put (multipart, parts in parallel, retried with backoff; a throttling store's
503 SlowDown included): the object appears in the store whole or not at all. Then the manifest
records the store's ETag, the blocks go into the cache from the staged bytes (reads on this node
stay local) and the staged files are removed. An agent that starts finds the journal records
left and uploads them again; a writer's file that was never committed (its process died) is
removed once its process is gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpufeed import errors
from gpufeed.agent.manager import CacheManager
from gpufeed.agent.metrics import Metrics
from gpufeed.blocks import object_blocks, source_identity
from gpufeed.cache.layout import WRITER_FILE, staging_dir
from gpufeed.config import Settings
from gpufeed.mount_options import CachePolicy
from gpufeed.namespace import Namespace
from gpufeed.paths import normalize
from gpufeed.processes import alive
from gpufeed.rpc.messages import (
    Commit,
    Committed,
    Credentials,
    Failure,
    Group,
    ObjectWant,
    Remove,
    SourceSpec,
    Sync,
    Synced,
)
from gpufeed.sources import Source, open_source
from gpufeed.sources.base import ObjectInfo

if TYPE_CHECKING:
    from gpufeed.agent.fetcher import Job

log = logging.getLogger("gpufeed.agent")

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 30.0
SYNC_GIVES_UP_AFTER = 3
"""Failed attempts in a row, counted from when a `Sync` (or a write-through commit) began, after
which it reports an upload as failing instead of waiting on."""
SYNC_REPLY_MARGIN_S = 15.0
"""A `Sync` (or write-through commit) answers this long before its client would give up on the
agent, with the uploads still under way; the client asks again, failures counted from its first
ask (asked afresh, a store that needs minutes to fail each try was never given up on)."""


@dataclass
class Upload:
    """One committed write: what it is, where its bytes wait, how its upload goes."""

    upload_id: str
    mount: str
    source: SourceSpec
    info: ObjectInfo
    """The object as the manifest records it until the upload adds the store's ETag."""
    block_size: int
    checked: bool
    credentials: Credentials = field(default_factory=Credentials)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    retry: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by a `Sync`: the upload tries again now instead of at the end of its backoff."""
    failures: int = 0
    """Failed attempts in a row."""
    failed_at: list[float] = field(default_factory=list)
    """Wall-clock times of the latest failed attempts in a row (SYNC_GIVES_UP_AFTER at most)."""
    last_error: errors.GpufeedError | None = None
    task: asyncio.Task[None] | None = None

    @property
    def path(self) -> str:
        return f"{self.mount}/{self.info.key}"

    @property
    def identity(self) -> tuple[str, str]:
        return source_identity(self.source.url, self.source.options), self.info.key

    def record(self) -> dict[str, object]:
        info = self.info
        return {
            "mount": self.mount, "url": self.source.url, "options": self.source.options, "key": info.key, "size": info.size,
            "mtime": info.mtime, "content_hash": info.content_hash, "block_size": self.block_size, "checked": self.checked,
        }

    @classmethod
    def of_record(cls, upload_id: str, raw: dict) -> Upload:
        info = ObjectInfo(raw["key"], raw["size"], raw["mtime"], None, raw["content_hash"])
        return cls(upload_id, raw["mount"], SourceSpec(raw["url"], raw["options"]), info, raw["block_size"], raw["checked"])


class Uploads:
    """The node's committed writes until their stores have them."""

    def __init__(self, settings: Settings, primary: Path, manager: CacheManager, metrics: Metrics) -> None:
        self.settings = settings
        self.dir = staging_dir(primary)
        self.manager = manager
        self.metrics = metrics
        self.pending: dict[str, Upload] = {}
        self.by_object: dict[tuple[str, str], Upload] = {}

    # -- requests -------------------------------------------------------------------------

    async def commit(self, request: Commit) -> Committed:
        if not WRITER_FILE.fullmatch(request.staged):
            raise errors.InvalidArgument(f"{request.staged!r}: not a staging file name")
        staged = self.dir / request.staged
        try:
            size = staged.stat().st_size
        except FileNotFoundError:
            raise errors.WriteError(f"{request.mount}/{request.key}: its staged bytes are gone ({staged})") from None
        if size != request.size:
            raise errors.WriteError(f"{request.mount}/{request.key}: staged {size} bytes, the writer wrote {request.size}")
        mount = await asyncio.to_thread(self._mount, request.mount)
        policy = CachePolicy.of(mount, self.settings)
        info = ObjectInfo(request.key, request.size, time.time(), None, f"sha256:{request.sha256}")
        upload = Upload(secrets.token_hex(12), request.mount, request.source, info, policy.block_size,
                        not mount.immutable, request.credentials)
        try:
            os.rename(staged, self._data(upload.upload_id))
            await asyncio.to_thread(self._journal, upload)
        except OSError as exc:
            self._data(upload.upload_id).unlink(missing_ok=True)
            raise errors.WriteError(f"{upload.path}: cannot stage it in {self.dir}: {exc.strerror or exc}") from None
        self._replace(upload)
        await asyncio.to_thread(self._record, upload.mount, info, None)
        self._start(upload)
        self.metrics.count("writes")
        if request.sync:
            started = time.time()
            await self._wait([upload], started)
            if not upload.done.is_set() and self._given_up(upload, started):
                failed = upload.last_error
                assert failed is not None
                raise type(failed)(
                    f"{upload.path}: written and kept on this node, not in the store yet; its upload is "
                    f"retried in the background ('gpufeed sync' waits for it): {failed}"
                )
        return Committed(upload.info, upload.done.is_set())

    async def sync(self, request: Sync) -> Synced:
        prefix = normalize(request.path).rstrip("/") + "/"
        uploads = [u for u in self.pending.values() if (u.path + "/").startswith(prefix) or prefix == "/"]
        since = request.since or time.time()
        await self._wait(uploads, since)
        failures = [Failure(u.last_error.code, str(u.last_error)) for u in uploads  # type: ignore[union-attr]
                    if not u.done.is_set() and self._given_up(u, since)]
        pending = sum(1 for u in uploads if not u.done.is_set() and not self._given_up(u, since))
        return Synced(len(uploads), failures, pending)

    async def remove(self, request: Remove) -> None:
        upload = self.by_object.get((source_identity(request.source.url, request.source.options), request.key))
        if upload is not None:
            self._drop(upload)
        source = open_source(request.source.url, {**request.source.options, **request.credentials.values}, self.settings)
        # the manifest first: an agent killed in between leaves an object nobody lists (a later
        # removal or refresh settles it), never a listed object the store no longer holds
        await asyncio.to_thread(self._forget, request.mount, request.key)
        await source.delete_async(request.key)  # type: ignore[attr-defined]

    # -- reads of staged bytes ------------------------------------------------------------

    def staged(self, url: str, options: dict[str, str], info: ObjectInfo) -> Upload | None:
        """The pending upload holding exactly these bytes (same size and hash), if any."""
        upload = self.by_object.get((source_identity(url, options), info.key))
        if upload is None or upload.info.size != info.size or upload.info.content_hash != info.content_hash:
            return None
        return upload

    async def read(self, upload: Upload, start: int, end: int) -> memoryview:
        return await asyncio.to_thread(self._pread, upload.upload_id, start, end)

    # -- start and stop -------------------------------------------------------------------

    def recover(self) -> int:
        """Queue every upload a previous agent acknowledged but did not finish; remove files of
        writers that died before committing. Returns how many uploads were queued."""
        self.dir.mkdir(mode=0o700, exist_ok=True)
        for leftover in self.dir.iterdir():
            name = leftover.name
            writer = WRITER_FILE.fullmatch(name)
            if writer and not alive(int(writer.group(1))):
                leftover.unlink(missing_ok=True)
            elif name.endswith(".data") and not self._journal_path(name[: -len(".data")]).exists():
                leftover.unlink(missing_ok=True)  # renamed, never acknowledged: its journal was not written
            elif name.endswith(".json.tmp"):
                leftover.unlink(missing_ok=True)
        queued = 0
        for journal in sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime):
            upload_id = journal.name[: -len(".json")]
            try:
                upload = Upload.of_record(upload_id, json.loads(journal.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("staged write %s: unreadable journal record (%s): left in place", journal, exc)
                continue
            if not self._data(upload_id).exists():
                log.warning("staged write %s: its bytes are missing: dropped", upload.path)
                journal.unlink(missing_ok=True)
                continue
            self._replace(upload)
            self._start(upload)
            queued += 1
        if queued:
            log.info("resuming %d staged upload(s) from %s", queued, self.dir)
        return queued

    async def stop(self) -> None:
        tasks = [u.task for u in self.pending.values() if u.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the upload -----------------------------------------------------------------------

    def _start(self, upload: Upload) -> None:
        upload.task = asyncio.get_running_loop().create_task(self._upload(upload))

    async def _upload(self, upload: Upload) -> None:
        delay = RETRY_FIRST_S
        source = self._source(upload)
        while True:
            try:
                stored = await source.put_file_async(upload.info.key, str(self._data(upload.upload_id)))  # type: ignore[attr-defined]
                break
            except errors.GpufeedError as exc:
                if not isinstance(exc, errors.SourceDown):  # that one was not tried: not a try that failed
                    upload.failures += 1
                    upload.failed_at = [*upload.failed_at[1 - SYNC_GIVES_UP_AFTER :], time.time()]
                    upload.last_error = exc
                    if upload.failures == 1 or upload.failures % 10 == 0:
                        log.warning("upload of %s failed (attempt %d, retrying in %.1f s): %s", upload.path,
                                    upload.failures, delay, exc)
                try:
                    await asyncio.wait_for(upload.retry.wait(), delay)
                except TimeoutError:
                    delay = min(2 * delay, RETRY_MAX_S)
                else:  # a sync waits on it: its backoff starts afresh, so three tries take seconds, not minutes
                    delay = RETRY_FIRST_S
                upload.retry.clear()
        self.metrics.count("uploads")
        self.metrics.count("upload_bytes", upload.info.size)
        if stored.size != upload.info.size:
            log.warning("upload of %s: the store reports %d bytes, %d were written", upload.path, stored.size, upload.info.size)
        recorded = ObjectInfo(upload.info.key, upload.info.size, stored.mtime, stored.etag, upload.info.content_hash)
        if await asyncio.to_thread(self._record, upload.mount, recorded, upload.info):
            await self._cache(upload, recorded)
        upload.info = recorded
        upload.last_error = None
        self._finish(upload)

    async def _cache(self, upload: Upload, info: ObjectInfo) -> None:
        """Publish the object's blocks from its staged bytes, so this node keeps reading it locally."""
        blocks = object_blocks(upload.source.url, upload.source.options, info, upload.block_size, upload.checked)
        for index in range(blocks.count):
            block = blocks.block(index)
            if self.manager.present(block) or not self.manager.can_hold(blocks.length(index)):
                continue
            start = index * blocks.block_size
            data = await asyncio.to_thread(self._pread, upload.upload_id, start, start + blocks.length(index))
            if not await asyncio.shield(self.manager.publish(block, data)):
                return

    def _finish(self, upload: Upload) -> None:
        self._journal_path(upload.upload_id).unlink(missing_ok=True)  # first: a crash now leaves nothing to upload again
        self._data(upload.upload_id).unlink(missing_ok=True)
        self.pending.pop(upload.upload_id, None)
        if self.by_object.get(upload.identity) is upload:
            del self.by_object[upload.identity]
        upload.done.set()

    def _drop(self, upload: Upload) -> None:
        """A pending upload made pointless (its object removed, or written again)."""
        if upload.task is not None:
            upload.task.cancel()
        self._finish(upload)

    def _replace(self, upload: Upload) -> None:
        earlier = self.by_object.get(upload.identity)
        if earlier is not None:
            self._drop(earlier)  # a later write of the same object wins; the earlier need not reach the store
        self.pending[upload.upload_id] = upload
        self.by_object[upload.identity] = upload

    @staticmethod
    def _given_up(upload: Upload, since: float) -> bool:
        """The upload failed SYNC_GIVES_UP_AFTER times in a row since `since`."""
        return upload.last_error is not None and sum(1 for t in upload.failed_at if t >= since) >= SYNC_GIVES_UP_AFTER

    async def _wait(self, uploads: list[Upload], since: float) -> None:
        """Until each upload is done or given up on (failures since `since`), or until the client
        is about to give up on this answer; one waiting out a backoff tries again at once (the
        store may be back)."""
        deadline = time.monotonic() + self.settings.agent_reply_timeout - SYNC_REPLY_MARGIN_S
        for upload in uploads:
            upload.retry.set()
        done = {u.upload_id: asyncio.ensure_future(u.done.wait()) for u in uploads}
        try:
            while True:
                waiting = [u for u in uploads if not u.done.is_set() and not self._given_up(u, since)]
                if not waiting or time.monotonic() >= deadline:
                    return
                await asyncio.wait([done[u.upload_id] for u in waiting], timeout=0.5)
        finally:
            for waiter in done.values():
                waiter.cancel()

    # -- files and metadata (run in threads) ----------------------------------------------

    def _data(self, upload_id: str) -> Path:
        return self.dir / f"{upload_id}.data"

    def _journal_path(self, upload_id: str) -> Path:
        return self.dir / f"{upload_id}.json"

    def _journal(self, upload: Upload) -> None:
        final = self._journal_path(upload.upload_id)
        temporary = final.with_name(final.name + ".tmp")
        with open(temporary, "w") as f:
            json.dump(upload.record(), f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(temporary, final)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)  # the renames themselves survive a power cut
        finally:
            os.close(fd)

    def _pread(self, upload_id: str, start: int, end: int) -> memoryview:
        with open(self._data(upload_id), "rb", buffering=0) as f:
            buffer = bytearray(end - start)
            view = memoryview(buffer)
            done = 0
            while done < len(buffer):
                n = os.preadv(f.fileno(), [view[done:]], start + done)
                if n == 0:
                    raise errors.WriteError(f"staged bytes {self._data(upload_id)} end at {start + done}, not {end}")
                done += n
            return view

    def _mount(self, path: str):  # type: ignore[no-untyped-def]
        namespace = Namespace(self.settings)
        try:
            return namespace.mount(path)
        finally:
            namespace.close()

    def _record(self, mount: str, info: ObjectInfo, replacing: ObjectInfo | None) -> bool:
        namespace = Namespace(self.settings)
        try:
            return namespace.record_written(mount, info, replacing=replacing)
        except errors.MountNotFound:
            return False
        finally:
            namespace.close()

    def _forget(self, mount: str, key: str) -> None:
        namespace = Namespace(self.settings)
        try:
            namespace.record_removed(mount, key)
        finally:
            namespace.close()

    def _source(self, upload: Upload) -> Source:
        spec, secrets_ = upload.source, upload.credentials.values
        return open_source(spec.url, {**spec.options, **secrets_}, self.settings)


class StagedBlocks:
    """Committed writes not yet uploaded: a block source ahead of peers and the store."""

    def __init__(self, uploads: Uploads) -> None:
        self.uploads = uploads

    async def read(self, job: Job, start: int, end: int) -> memoryview | None:
        return None if job.group is None else await self.range(job.group, job.want, start, end)

    async def range(self, group: Group, want: ObjectWant, start: int, end: int) -> memoryview | None:
        upload = self.uploads.staged(group.source.url, group.source.options, want.info)
        if upload is None:
            return None
        return await self.uploads.read(upload, start, end)

    def only_blocks(self, job: Job) -> bool:
        return False

