"""A read-only POSIX view of a namespace path (`gpufeed fuse MOUNTPOINT NSPATH`), so scripts that
open paths (ImageFolder, PIL.Image.open, np.load) read through the cache unchanged.

The daemon is one more client of the node agent: metadata comes from the manifest
(`Client.stat`, `Client.ls`), bytes from `Client.read_range` (a hit is a pread of a published
block, a miss goes to the agent). It never reads a store itself.

Why it is shaped this way:
- libfuse3's high-level API through mfusepy, multithreaded: one Python callback per kernel
  request, and a read request is up to 1 MiB (`max_read`), so there is no Python work per
  4 KiB. The read path copies the reply into libfuse's buffer, once (`_FeedFUSE.read`).
- The kernel keeps attributes and entries for ATTR_TIMEOUT_S and keeps a file's page cache
  across opens (`keep_cache`) while the manifest lists the same version: a warm epoch does
  not call into Python for the bytes at all. Closing a file calls no Python either (no
  release callback, see OPENS_KEPT), so a warm open costs one callback. A refresh that
  changes an object is seen by `_watch`, which invalidates what the kernel holds for it; its
  next open drops the pages.
- A view whose every mount is --immutable and cached has nothing to pin at open: its opens
  cost no message at all (`zero_open`, the kernel's zero-message open), so a warm epoch
  asks the daemon nothing and a cold one asks one read per small file.
- Callbacks arrive on libfuse's threads, whose Python thread state (and so every
  threading.local, the agent connection among them) lives for one callback only. Prefetch
  sessions end with the connection that opened them, so warmup and read-ahead are sent from
  one long-lived thread (`fuse_prefetch.MountPrefetch`), never from a callback.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import itertools
import json
import logging
import os
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import xxhash

from gpufeed.client import Client, ObjectHandle
from gpufeed.config import Settings
from gpufeed.errors import GpufeedError, IsADirectory, NamespacePathError
from gpufeed.integrations.fuse_mounts import FuseError, MountState, state_file
from gpufeed.integrations.fuse_prefetch import MountPrefetch
from gpufeed.logsetup import configure
from gpufeed.mount_options import CachePolicy
from gpufeed.paths import FileStat

# mfusepy takes the first of libfuse2 and libfuse3 it finds; gpufeed is built on libfuse3 (fuse3
# package): its multithreaded loop, fuse_invalidate_path, max_pages.
os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
import mfusepy  # noqa: E402

log = logging.getLogger("gpufeed.fuse")

ATTR_TIMEOUT_S = 3600.0
"""How long the kernel keeps a lookup or an attribute; a refresh invalidates what changed."""
NEGATIVE_TIMEOUT_S = 1.0
"""How long the kernel remembers that a name does not exist (a refresh may add it)."""
IDLE_THREADS = 10
"""Worker threads libfuse keeps when idle: its default of 10 threads in all, all kept (thread
states outlive a callback, `_FeedFUSE._wrapper`). Said explicitly because libfuse 3.14 reads its
own "unset" default as invalid and prints "Ignoring invalid max threads value" at every mount."""
MAX_READ = 1 << 20
"""Bytes one read request may carry: libfuse3 asks the kernel for 256-page requests, and the
mount's read-ahead is raised to match (`_read_ahead_kb`), so a sequential reader costs one
callback per MiB instead of one per 128 KiB."""
BLKSIZE = 128 << 10
"""The I/O size files report (st_blksize): Python's open() buffers that much, so PIL's first
read of a JPEG asks for 128 KiB and the kernel's read-ahead fetches the whole file in one
read request, where an 8 KiB first read took three."""
READ_AHEAD_BLOCKS = 4
"""Blocks fetched ahead of a sequential reader of a big file (16 MiB with 4 MiB blocks); none
on a mount made with --no-read-ahead."""
WATCH_S = 1.0
"""How often the daemon checks the mount table for a refresh and writes its state file."""
LISTINGS_KEPT = 64
"""Listings kept between the kernel's requests for their pages (one abandoned part way stays
until this many newer ones push it out)."""
READDIR_PLUS = 1 << 0
"""libfuse3's FUSE_READDIR_PLUS (`fuse_readdir_flags`): the kernel asked READDIRPLUS."""
FILL_DIR_PLUS = 1 << 1
"""libfuse3's FUSE_FILL_DIR_PLUS (`fuse_fill_dir_flags`): the entry's attributes are complete."""
CAP_READDIRPLUS_AUTO = 1 << 14
"""libfuse3's FUSE_CAP_READDIRPLUS_AUTO: READDIRPLUS for a listing's first page only."""
DOT_ENTRY = {"st_mode": stat.S_IFDIR | 0o555, "st_ino": 1}
"""`.` and `..` in a READDIRPLUS page: libfuse looks neither up, so the entry's inode number is
the one given here, and readdir(3) skips an entry whose number is 0 (`ls -a` showed neither)."""
CAP_NO_OPEN_SUPPORT = 1 << 17
"""libfuse3's FUSE_CAP_NO_OPEN_SUPPORT: the kernel takes ENOSYS from open as "opens need no
message" and from then on opens every file itself, sends no release, and keeps each file's
page cache across opens."""


@dataclass
class _Open:
    """One open file: the handle pins the version every read of it sees; `next` and `ahead`
    follow a sequential reader to fetch the blocks after the one it reads."""

    handle: ObjectHandle
    next: int = 0
    ahead: int = 0


OPENS_KEPT = 16384
"""Open files whose state the daemon keeps. It is told of opens, not of closes (a release
callback would cost every open one more Python callback), so the oldest state is dropped; a
read through a file handle whose state was dropped finds its object again by path and checks
the version against the one its open saw (`_version_tag`)."""


def _version_tag(handle: ObjectHandle) -> int:
    """32 bits naming the version a handle reads, carried in the low half of the file handle."""
    return xxhash.xxh32_intdigest(f"{handle.info.version}|{handle.size}|{handle.info.key}".encode())


class FeedOperations(mfusepy.Operations):
    """The filesystem: FUSE path `/a/b` is namespace path `NSPATH/a/b`."""

    use_ns = True

    def __init__(self, client: Client, nspath: str, state: MountState) -> None:
        self.client = client
        self.base = nspath.rstrip("/")
        self.state = state
        self.calls: Counter[str] = Counter()
        self.uid, self.gid = os.getuid(), os.getgid()
        self._opens: dict[int | str, _Open] = {}
        """File handle (or, with zero-message opens, FUSE path) → its open file's state, the
        OPENS_KEPT newest."""
        self._opened = 0
        self._lock = threading.Lock()
        self._listings: dict[str, list[tuple[str, FileStat | None]]] = {}
        """FUSE path → the entries of a listing the kernel is part way through (READDIRPLUS)."""
        self._served: dict[str, tuple[str | None, int]] = {}
        """FUSE path → (version, size) the kernel was told: what a refresh must invalidate."""
        self._fuse: int | None = None
        self.started = False
        self._logged: set[str] = set()
        self.prefetcher = MountPrefetch(client, nspath, state)
        self.mounted_at = time.time()

    def _ns(self, path: str) -> str:
        return self.base + path if path != "/" else self.base or "/"

    def init_with_config(self, conn_info: Any, config_3: Any) -> None:
        self._fuse = mfusepy._libfuse.fuse_get_context().contents.fuse
        self.started = True
        if conn_info is not None:
            conn_info.max_readahead = MAX_READ
            conn_info.want &= ~CAP_READDIRPLUS_AUTO  # READDIRPLUS for every page of a listing, not its first only
        self.state.zero_open = bool(
            self.state.zero_open and conn_info is not None and conn_info.capable & CAP_NO_OPEN_SUPPORT
        )
        self.prefetcher.start()
        threading.Thread(target=self._watch, name="gpufeed-fuse-watch", daemon=True).start()

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        self.calls["getattr"] += 1
        try:
            item = self.client.stat_opened(self._ns(path)) or self.client.stat(self._ns(path))
        except NamespacePathError:
            raise mfusepy.FuseOSError(errno.ENOENT) from None
        return self._attributes(path, item)

    def _attributes(self, path: str, item: FileStat) -> dict[str, Any]:
        """What the kernel is told of `path`; for a file, its version and size are remembered, so
        a refresh that changes them invalidates what the kernel keeps."""
        if item.is_dir:
            mtime = self._dir_mtime(path)
            return {"st_mode": stat.S_IFDIR | 0o555, "st_nlink": 2, "st_uid": self.uid, "st_gid": self.gid,
                    "st_mtime": mtime, "st_ctime": mtime, "st_atime": mtime}
        mtime = int(item.mtime * 1e9)
        self._served[path] = (item.version, item.size)
        return {
            "st_mode": stat.S_IFREG | 0o444,
            "st_nlink": 1,
            "st_size": item.size,
            "st_blocks": (item.size + 511) // 512,
            "st_blksize": BLKSIZE,
            "st_uid": self.uid,
            "st_gid": self.gid,
            "st_mtime": mtime,
            "st_ctime": mtime,
            "st_atime": mtime,  # reads are not tracked; the object's time, not 1970
        }

    def _dir_mtime(self, path: str) -> int:
        """A directory's time (ns): when its mount was listed, as the manifest keeps no time for
        directories; above every mount, when this daemon started. Not 1970."""
        try:
            where = self.client.namespace.resolve(self._ns(path))
        except NamespacePathError:
            where = None
        listed = where.mount.listed_at if where is not None else 0.0
        return int((listed or self.mounted_at) * 1e9)

    def _listing(self, path: str) -> list[tuple[str, FileStat]]:
        """The directory's entries by name."""
        try:
            return [(item.path.rsplit("/", 1)[1], item) for item in self.client.ls(self._ns(path))]
        except NamespacePathError:
            raise mfusepy.FuseOSError(errno.ENOENT) from None

    def readdir(self, path: str, fh: int) -> list[Any]:
        self.calls["readdir"] += 1
        kinds = [(name, stat.S_IFDIR if item.is_dir else stat.S_IFREG) for name, item in self._listing(path)]
        return [".", "..", *((name, {"st_mode": mode}, 0) for name, mode in kinds)]

    def readdir_plus(self, path: str, offset: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """The directory's entries from `offset` on, each with all its attributes (READDIRPLUS):
        the kernel keeps them as it keeps a lookup's, so a script that lists a directory and then
        opens its files costs no lookup callback per file. The kernel asks a page of entries at
        a time, `offset` the number it has; the listing is read at offset 0 and kept for the
        requests after it, and an entry's attributes are made as its page is filled."""
        self.calls["readdir"] += 1
        with self._lock:
            entries = self._listings.pop(path, None) if offset else None
        if entries is None:
            entries = [(".", None), ("..", None), *self._listing(path)]
        if offset < len(entries):
            with self._lock:
                self._listings[path] = entries
                while len(self._listings) > LISTINGS_KEPT:
                    del self._listings[next(iter(self._listings))]
        parent = path.rstrip("/")
        for name, item in itertools.islice(entries, offset, None):
            yield name, DOT_ENTRY if item is None else self._attributes(f"{parent}/{name}", item)

    def open(self, path: str, fi: Any) -> int:
        self.calls["open"] += 1
        if fi.flags & os.O_ACCMODE != os.O_RDONLY:
            raise mfusepy.FuseOSError(errno.EROFS)
        if self.state.zero_open:  # the first open's answer: the kernel opens every file itself from now on
            raise mfusepy.FuseOSError(errno.ENOSYS)
        try:
            handle = self.client.handle(self._ns(path))
        except IsADirectory:
            raise mfusepy.FuseOSError(errno.EISDIR) from None
        except NamespacePathError:
            raise mfusepy.FuseOSError(errno.ENOENT) from None
        except GpufeedError as exc:
            self._failed("open", path, exc)
        seen = (handle.info.version, handle.size)
        # a changed object's old pages are dropped; a mount with the cache off keeps none
        fi.keep_cache = int(self._served.get(path) == seen and handle.blocks is not None)
        self._served[path] = seen
        with self._lock:
            self._opened += 1
            fi.fh = (self._opened & 0xFFFFFFFF) << 32 | _version_tag(handle)
        self._keep(fi.fh, _Open(handle))
        return 0

    def _path_open(self, path: str) -> _Open:
        """With zero-message opens no open pins a version: a read takes the path's current
        handle (an immutable mount's listed object, remembered by the client), and a
        sequential reader's state follows the path until a refresh gives it a new handle."""
        try:
            handle = self.client.handle(self._ns(path))
        except GpufeedError as exc:
            self._failed("read", path, exc)
        opened = self._opens.get(path)
        if opened is None or opened.handle is not handle:
            opened = _Open(handle)
            self._keep(path, opened)
        return opened

    def _keep(self, fh: int | str, opened: _Open) -> None:
        with self._lock:
            self._opens[fh] = opened
            if len(self._opens) > OPENS_KEPT:
                del self._opens[next(iter(self._opens))]

    def read(self, path: str, size: int, offset: int, fh: Any) -> memoryview:
        buffer = memoryview(bytearray(size))
        return buffer[: self.read_into(path, buffer, offset, fh)]

    def read_into(self, path: str, target: memoryview, offset: int, fh: Any) -> int:
        """A read request into libfuse's reply buffer (`_FeedFUSE.read`): cached bytes are copied
        there once, from where they lie (`Client.read_into`)."""
        self.calls["read"] += 1
        if self.state.zero_open:
            opened = self._path_open(path)
        else:
            opened = self._opens.get(fh.fh) or self._reopened(path, fh.fh)
        handle = opened.handle
        try:
            length = self.client.read_into(handle, offset, target)
        except GpufeedError as exc:
            self._failed("read", path, exc)
        ref = handle.blocks
        end = offset + length
        if self.state.read_ahead and ref is not None and offset == opened.next and ref.blocks.count > 1:
            self._read_ahead(opened, end // ref.block_size, ref.blocks.count)
        opened.next = end
        return length

    def _read_ahead(self, opened: _Open, block: int, count: int) -> None:
        """A sequential reader in block `block`: keep the READ_AHEAD_BLOCKS after it asked
        for, asking again once fewer than half of them lie ahead."""
        if opened.ahead >= min(count, block + 1 + READ_AHEAD_BLOCKS // 2):
            return
        last = min(count, block + 1 + READ_AHEAD_BLOCKS)
        self.prefetcher.ahead.put((opened.handle, list(range(max(block + 1, opened.ahead), last))))
        opened.ahead = last

    def _reopened(self, path: str, fh: int) -> _Open:
        """The state of an open file that was dropped (OPENS_KEPT newer opens since), found
        again by path: the same version, or EIO rather than another version's bytes."""
        try:
            handle = self.client.handle(self._ns(path))
        except GpufeedError as exc:
            self._failed("read", path, exc)
        if _version_tag(handle) != fh & 0xFFFFFFFF:
            self._failed("read", path, GpufeedError(f"{self._ns(path)}: changed since this file was opened; open it again"))
        opened = _Open(handle)
        self._keep(fh, opened)
        return opened

    def _failed(self, what: str, path: str, exc: GpufeedError) -> Any:
        """EIO to the reader, and one line naming the object: the kernel retries a failed page
        read once more on its own, so a failure already logged is not logged again."""
        self.state.errors += 1
        name = self._ns(path)
        message = str(exc) if name in str(exc) else f"{name}: {exc}"
        if message not in self._logged:
            self._logged.add(message)
            log.error("gpufeed fuse: %s failed, EIO: %s", what, message)
        raise mfusepy.FuseOSError(errno.EIO) from None

    def _watch(self) -> None:
        """Every WATCH_S: write the state file, and when a mount's generation changed, tell the
        kernel to forget what it holds of objects whose version or size changed."""
        generations = {m.path: m.generation for m in self.client.namespace.mounts(fresh=True)}
        self.write_state()
        _read_ahead_kb(Path(self.state.mountpoint), MAX_READ >> 10)
        while True:
            time.sleep(WATCH_S)
            self.write_state()
            try:
                now = {m.path: m.generation for m in self.client.namespace.mounts(fresh=True)}
            except GpufeedError:
                continue
            if now != generations:
                generations = now
                self._invalidate()

    def _invalidate(self) -> None:
        for path, seen in list(self._served.items()):
            try:
                item = self.client.stat(self._ns(path))
                current = (item.version, item.size)
            except GpufeedError:
                current = None
            if current != seen:
                self._served.pop(path, None)
                if self._fuse is not None:
                    mfusepy._libfuse.fuse_invalidate_path(ctypes.c_void_p(self._fuse), path.encode())

    def write_state(self) -> None:
        self.state.calls = dict(self.calls)
        self.state.written = time.time()
        target = state_file(self.client.settings.home, Path(self.state.mountpoint))
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            temp = target.with_suffix(f".{os.getpid()}.tmp")
            temp.write_text(json.dumps(asdict(self.state)))
            temp.rename(target)
        except OSError as exc:
            log.debug("state file not written: %s", exc)


def _read_ahead_kb(mountpoint: Path, kib: int) -> None:
    """Raise the mount's read-ahead window (its bdi in sysfs; the kernel starts a FUSE mount at
    128 KiB) where this process may: as root, or never (a user's mount keeps 128 KiB reads)."""
    try:
        device = os.stat(mountpoint).st_dev
        Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb").write_text(str(kib))
    except OSError as exc:
        log.debug("read-ahead of %s left as it is: %s", mountpoint, exc)


class _FeedFUSE(mfusepy.FUSE):
    """mfusepy's FUSE with a read that has the read path copy the bytes into libfuse's reply
    buffer, once, from the mapped block (no bytes object in between); and with Python thread
    states that outlive a callback."""

    _kept: set[int] = set()

    def _wrapper(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        """ctypes gives a libfuse thread a Python thread state for one callback and drops it
        after, and with it every threading.local: the agent connection (a handshake per
        miss), the SQLite connection (one open per getattr), the read buffers. One extra
        PyGILState_Ensure on a thread's first callback keeps its state for the thread's life
        (libfuse keeps its few worker threads)."""
        ident = threading.get_ident()
        if ident not in self._kept:
            self._kept.add(ident)
            ctypes.pythonapi.PyGILState_Ensure()
        return super()._wrapper(func, *args, **kwargs)

    def readdir_fuse_3(self, path: bytes | None, buf: Any, filler: Any, offset: int, fip: Any, flags: int) -> int:
        """READDIRPLUS, which mfusepy answers without attributes: each entry with all of them and
        its own offset (libfuse's high-level API makes the kernel's entry only for an entry filled
        with an offset), from the one the kernel asked for until its page is full."""
        if not flags & READDIR_PLUS:
            return super().readdir_fuse_3(path, buf, filler, offset, fip, flags)
        entries = self.operations.readdir_plus(path.decode() if path else "/", offset)
        st = mfusepy.c_stat()
        for index, (name, attributes) in enumerate(entries, offset):
            ctypes.memset(ctypes.byref(st), 0, ctypes.sizeof(st))
            mfusepy.set_st_attrs(st, attributes, use_ns=True)
            if filler(buf, name.encode(), st, index + 1, FILL_DIR_PLUS) != 0:
                break
        return 0

    def read(self, path: bytes | None, buf: Any, size: int, offset: int, fip: Any) -> int:
        target = memoryview(ctypes.cast(buf, ctypes.POINTER(ctypes.c_ubyte * size)).contents).cast("B")
        return self.operations.read_into(path.decode() if path else "", target, offset, fip.contents)


mfusepy._libfuse.fuse_invalidate_path.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


def _immutable_view(client: Client, nspath: str) -> bool:
    """Whether every mount under `nspath` (or holding it) is --immutable with the node cache on:
    such a view has no version to pin at open, so its opens may cost no message. Decided when
    the view is mounted: a strict mount added under it later is read without an open to pin
    its versions until the view is mounted again."""
    below = nspath.rstrip("/") + "/"
    mounts = [m for m in client.namespace.mounts() if m.path.startswith(below) or f"{nspath}/".startswith(f"{m.path}/")]
    return bool(mounts) and all(m.immutable and CachePolicy.of(m, client.settings).enabled for m in mounts)


def serve(mountpoint: Path, nspath: str, *, warmup: bool = True, read_ahead: bool = True, client: Client | None = None) -> None:
    """Mount and serve until unmounted (`gpufeed fuse stop`, fusermount3 -u) or SIGTERM/SIGINT,
    which libfuse turns into an unmount; blocks in the foreground."""
    client = client or Client()
    item = client.stat(nspath)
    if not item.is_dir:
        raise GpufeedError(f"{nspath}: is a file; mount a directory of the namespace")
    state = MountState(str(mountpoint), nspath, os.getpid(), time.time(), warmup, read_ahead, _immutable_view(client, nspath))
    operations = FeedOperations(client, nspath, state)
    operations.write_state()  # before the mount is seen: `mount rm` tells this home's views by it
    try:
        _FeedFUSE(
            operations,
            str(mountpoint),
            raw_fi=True,
            foreground=True,
            ro=True,
            default_permissions=True,
            fsname=f"gpufeed:{nspath}",
            subtype="gpufeed",
            entry_timeout=ATTR_TIMEOUT_S,
            attr_timeout=ATTR_TIMEOUT_S,
            negative_timeout=NEGATIVE_TIMEOUT_S,
            max_idle_threads=IDLE_THREADS,
        )
    except RuntimeError as exc:  # libfuse printed why on stderr
        if operations.started:
            return  # the loop ended on a signal after serving: libfuse's exit code 8 is not a failure
        raise FuseError(f"{mountpoint}: libfuse could not mount (code {exc})") from None
    finally:
        state_file(client.settings.home, mountpoint).unlink(missing_ok=True)
        client.close()


def main(argv: list[str] | None = None) -> int:
    """`python -m gpufeed.integrations.fuse MOUNTPOINT NSPATH`: the daemon `gpufeed fuse` starts."""
    parser = argparse.ArgumentParser(prog="python -m gpufeed.integrations.fuse", description="Serve a gpufeed FUSE mount.")
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("nspath")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--no-read-ahead", action="store_true")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
        configure(settings.log_format, "fuse", debug=settings.debug)
        serve(args.mountpoint.absolute(), args.nspath, warmup=not args.no_warmup, read_ahead=not args.no_read_ahead)
    except GpufeedError as exc:
        sys.stderr.write(f"gpufeed: error: {exc}\n")  # the daemon's one error line, logging or not
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
