"""A file being written to a writable mount: `gpufeed.open(path, "wb")`.

The bytes go straight into a file in the node agent's staging dir (no copy through a socket),
hashed as they pass; `close()` fsyncs it and hands it to the agent (`Commit`), which records the
object in the manifest and uploads it in the background. When `close()` returns, the write is
durable on this node and every process here reads the new bytes; other nodes read them once the
upload is done (`gpufeed sync` waits for that). `sync=True` makes `close()` wait for the upload
itself (write-through). A writer that fails or leaves its `with` block by an exception commits
nothing: the object keeps its old bytes, and the staged file is removed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import time
from typing import TYPE_CHECKING, Any

from gpufeed.cache.layout import writer_file
from gpufeed.errors import WriteError
from gpufeed.mount_options import source_options
from gpufeed.rpc.messages import Commit, Committed, Credentials, SourceSpec
from gpufeed.sources.credentials import caller_credentials

if TYPE_CHECKING:
    from gpufeed.client.reader import Client

FULL = (errno.ENOSPC, errno.EDQUOT)


class FeedWriter(io.RawIOBase):
    """Write-only, sequential binary file; `fileno()` is the staged file's, so `os.fsync` works."""

    def __init__(self, client: Client, path: str, *, sync: bool = False) -> None:
        super().__init__()
        self._client = client
        self.where = client.namespace.writable_target(path)
        self.path = f"{self.where.mount.path}/{self.where.key}"
        self.sync = sync
        self._staged = writer_file(client.agent.dirs[0])
        self._staged.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fd = os.open(self._staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._hash = hashlib.sha256()
        self._size = 0
        self.committed: Committed | None = None
        """The agent's answer once closed: the object as the manifest records it."""
        self.failure: WriteError | None = None
        """Why a write failed: a serializer that writes through a buffer of its own (torch.save's
        zip writer) reports only that its write came up short."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        self._check_open()
        return self._fd

    def tell(self) -> int:
        return self._size

    def write(self, data: Any) -> int:
        self._check_open()
        try:
            view = memoryview(data).cast("B")
        except TypeError:
            hint = " (encode text first: data.encode())" if isinstance(data, str) else ""
            raise TypeError(f"write() of {self.path}: data must be bytes-like, not {type(data).__name__}{hint}") from None
        done = 0
        try:
            while done < len(view):
                done += os.write(self._fd, view[done:])
        except OSError as exc:
            self._abort()
            if exc.errno in FULL:
                self.failure = WriteError(f"{self.path}: the staging disk is full ({self._staged.parent}): nothing was written")
            else:
                self.failure = WriteError(f"{self.path}: cannot stage it in {self._staged.parent}: {exc.strerror or exc}")
            raise self.failure from None
        self._hash.update(view)
        self._size += len(view)
        return len(view)

    def close(self) -> None:
        if self.closed:
            return
        try:
            try:
                os.fsync(self._fd)
            except OSError as exc:
                raise WriteError(f"{self.path}: cannot stage it in {self._staged.parent}: {exc.strerror or exc}") from None
            os.close(self._fd)
            self._fd = -1
            mount = self.where.mount
            options = source_options(mount)
            request = Commit(
                SourceSpec(mount.url, options), mount.path, self.where.key, self._staged.name, self._size,
                self._hash.hexdigest(), self.sync, Credentials(caller_credentials(mount.url, options)),
            )
            started = time.time()
            self.committed = self._client.agent.request(request, Committed)
            self._client.forget(self.path)
            if self.sync and not self.committed.uploaded:  # still under way when the agent answered
                self._client.sync(self.path, since=started)
        except BaseException:
            self._abort()
            raise
        finally:
            super().close()

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        if kind is not None:
            self._abort()  # the block raised: the object keeps its old bytes
        self.close()

    def _abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._staged.unlink(missing_ok=True)
        if not self.closed:
            super().close()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file.")
