"""The life of a `gpufeed fuse` mount: checks before mounting, the daemon started in the
background, dead mounts cleaned, `stop` and `ls`.

Kept apart from the filesystem (`integrations/fuse.py`) so the CLI can check, list and stop
mounts without loading libfuse. A mount is found in /proc/self/mountinfo (type
`fuse.gpufeed`); its daemon's state file (pid, callbacks, warmup) in `GPUFEED_HOME/fuse`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpufeed.config import Settings
from gpufeed.errors import GpufeedError
from gpufeed.processes import alive


@dataclass
class MountState:
    """What a mount's daemon reports about itself: its identity, the callbacks it served and
    how far its warmup got."""

    mountpoint: str
    nspath: str
    pid: int
    started: float
    warmup: bool
    read_ahead: bool = True
    zero_open: bool = False
    """Opens cost no message (every mount of the view is --immutable and cached): the daemon
    hears of a file first at its first read, and never of a warm open."""
    calls: dict[str, int] = field(default_factory=dict)
    warm_files: int = 0
    warm_total: int = 0
    warm_done: bool = False
    warm_note: str = ""
    """Why the warmup did not cache all of the view: skipped (bigger than the cache), or files
    it could not cache."""
    errors: int = 0
    written: float = 0.0


FUSE_DEVICE = Path("/dev/fuse")
FSTYPE = "fuse.gpufeed"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class FuseError(GpufeedError):
    """A mount that cannot be made, found or stopped; the message names the mountpoint."""

    code = "fuse"


@dataclass(frozen=True)
class LiveMount:
    mountpoint: Path
    nspath: str
    state: dict[str, object] | None
    """The daemon's state file (pid, calls, warmup), when it wrote one."""

    @property
    def alive(self) -> bool:
        return not is_dead(self.mountpoint)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def mounted() -> dict[Path, str]:
    """gpufeed FUSE mounts of this mount namespace: mountpoint → namespace path."""
    found = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, source = (right.split() + ["", ""])[:2]
        if fstype == FSTYPE:
            found[Path(_unescape(left.split()[4]))] = _unescape(source).removeprefix("gpufeed:")
    return found


def is_dead(mountpoint: Path) -> bool:
    """A mount whose daemon died: the kernel answers "Transport endpoint is not connected".
    statvfs always asks the daemon; a stat may be answered from the kernel's attribute cache."""
    try:
        os.statvfs(mountpoint)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def fusermount() -> str:
    found = shutil.which("fusermount3")
    if found is None:
        raise FuseError("fusermount3 not found: install the fuse3 package (apt-get install fuse3)")
    return found


def _unmount(mountpoint: Path, *, lazy: bool) -> None:
    argv = [fusermount(), "-u", *(["-z"] if lazy else []), str(mountpoint)]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
        if "busy" in detail.lower():  # a shell's working dir or an open file in it
            detail += f" (a process uses it: 'fuser -vm {mountpoint}' names it; 'fusermount3 -uz {mountpoint}' detaches it now)"
        raise FuseError(f"{mountpoint}: cannot unmount: {detail.removeprefix('fusermount3: ')}")


class Claim:
    """This process's turn to mount on a mountpoint: an flock on the directory as it is before
    the mount. Two `gpufeed fuse` on one mountpoint at once (a launch script run by every rank)
    would otherwise both find it empty and stack two mounts there; the second waits here, then
    finds the first one's mount. Released once the mount is up (or failed)."""

    def __init__(self, mountpoint: Path) -> None:
        self.fd: int | None = None
        self._lock = threading.Lock()  # released by a watching thread or at the block's end
        try:
            self.fd = os.open(canonical(mountpoint), os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return  # no directory to mount on: `check` says so
        deadline = time.monotonic() + 2 * START_TIMEOUT_S  # the holder may wait START_TIMEOUT_S for its daemon
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.release()
                    raise FuseError(f"{mountpoint}: another gpufeed fuse has been mounting there for "
                                    f"{2 * START_TIMEOUT_S:.0f} s") from None
                time.sleep(0.02)
            except OSError:  # a filesystem without flock (Lustre without -o flock, NFS without lockd)
                self.release()
                return

    def release(self) -> None:
        with self._lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def canonical(mountpoint: Path) -> Path:
    """The mountpoint as the kernel's mount table writes it: absolute, without `..` or links."""
    return Path(os.path.realpath(mountpoint.expanduser()))


def release_when_mounted(claim: Claim, mountpoint: Path) -> None:
    """For a mount served in this process (`--foreground`): let the claim go once the mount is
    up, from a thread, as serving blocks."""

    def watch() -> None:
        wait_until(lambda: mountpoint in mounted(), START_TIMEOUT_S)
        claim.release()

    threading.Thread(target=watch, name="gpufeed-fuse-claim", daemon=True).start()


def check(settings: Settings, mountpoint: Path, device: Path = FUSE_DEVICE) -> Path:
    """The absolute mountpoint, ready to mount on: a dead gpufeed mount there is cleaned
    (`fusermount3 -u -z`); every other obstacle is one FuseError naming it."""
    fusermount()
    try:
        fd = os.open(device, os.O_RDWR)
        os.close(fd)
    except FileNotFoundError:
        raise FuseError(
            f"{device} does not exist: load the fuse module (modprobe fuse) or run the container with --device /dev/fuse"
        ) from None
    except PermissionError:
        raise FuseError(f"{device}: permission denied: add the user to the 'fuse' group or make the device readable") from None
    mountpoint = canonical(mountpoint)
    if is_dead(mountpoint):
        _unmount(mountpoint, lazy=True)
        state_file(settings.home, mountpoint).unlink(missing_ok=True)
    if mountpoint in mounted():
        raise FuseError(f"{mountpoint}: a gpufeed mount is already there; stop it first with 'gpufeed fuse stop {mountpoint}'")
    try:
        _usable(mountpoint)
    except PermissionError:  # a parent or the dir itself this user may not search or read
        raise FuseError(f"{mountpoint}: {DENIED}") from None
    return mountpoint


DENIED = "permission denied: mount on a directory you own and can write"


def _usable(mountpoint: Path) -> None:
    if not mountpoint.exists():
        raise FuseError(f"{mountpoint}: no such directory; create it first (mkdir -p {mountpoint})")
    if not mountpoint.is_dir():
        raise FuseError(f"{mountpoint}: not a directory")
    if os.path.ismount(mountpoint):
        raise FuseError(f"{mountpoint}: something else is mounted there")
    if any(mountpoint.iterdir()):
        raise FuseError(f"{mountpoint}: not empty; mount on an empty directory")
    if os.getuid() != 0 and (mountpoint.stat().st_uid != os.getuid() or not os.access(mountpoint, os.W_OK)):
        raise FuseError(f"{mountpoint}: {DENIED}")


def _tail(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    said = [line for line in lines if line.startswith(("fuse:", "gpufeed: error:"))]  # libfuse's reason, or ours
    return (said or lines or [""])[0].removeprefix("gpufeed: error: ")


def daemon_argv(mountpoint: Path, nspath: str, warmup: bool, read_ahead: bool = True) -> list[str]:
    switches = [*([] if warmup else ["--no-warmup"]), *([] if read_ahead else ["--no-read-ahead"])]
    return [sys.executable, "-m", "gpufeed.integrations.fuse", str(mountpoint), nspath, *switches]


def state_file(home: Path, mountpoint: Path) -> Path:
    """Where a mount's daemon writes its state (`gpufeed fuse ls` reads it): the mountpoint with
    its `/` as `_` (`tmp_mnt.json`), and `_` and `%` escaped so `/a_b/c` and `/a/b_c` differ."""
    name = str(mountpoint).strip("/").replace("%", "%25").replace("_", "%5F").replace("/", "_")
    return home / "fuse" / (name + ".json")


def log_file(settings: Settings, mountpoint: Path) -> Path:
    return state_file(settings.home, mountpoint).with_suffix(".log")


def wait_until(done: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def _environment(settings: Settings) -> dict[str, str]:
    """Ours, with `settings`' home, metadata and cache dirs: the daemon serves the namespace and
    cache its starter uses (a benchmark's private home, say), not the environment's."""
    env = {**os.environ, "GPUFEED_HOME": str(settings.home), "GPUFEED_CACHE_DIRS": ":".join(map(str, settings.cache_dirs))}
    if settings.meta_url:
        env["GPUFEED_META"] = settings.meta_url
    else:
        env.pop("GPUFEED_META", None)
    return env


def start(settings: Settings, mountpoint: Path, nspath: str, *, warmup: bool, read_ahead: bool = True) -> int:
    """Start the daemon in the background and wait until the mount is up; returns its pid.
    The daemon logs to GPUFEED_HOME/fuse/<mountpoint>.log."""
    log = log_file(settings, mountpoint)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        daemon = subprocess.Popen(
            daemon_argv(mountpoint, nspath, warmup, read_ahead),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            env=_environment(settings),
        )
    up = wait_until(lambda: mountpoint in mounted() or daemon.poll() is not None, START_TIMEOUT_S)
    if daemon.poll() is not None:
        raise FuseError(f"{mountpoint}: the mount failed: {_tail(log) or f'exit {daemon.returncode}'} (log: {log})")
    if not up:
        daemon.kill()
        raise FuseError(f"{mountpoint}: the mount did not come up within {START_TIMEOUT_S:.0f} s (log: {log})")
    return daemon.pid


def state(settings: Settings, mountpoint: Path) -> dict[str, object] | None:
    try:
        return json.loads(state_file(settings.home, mountpoint).read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return None


def live(settings: Settings) -> list[LiveMount]:
    return [LiveMount(point, nspath, state(settings, point)) for point, nspath in sorted(mounted().items())]


def stop(settings: Settings, mountpoint: Path) -> None:
    """Unmount; the daemon's loop ends and it exits. A dead mount is cleaned lazily."""
    mountpoint = canonical(mountpoint)
    if mountpoint not in mounted():
        raise FuseError(f"{mountpoint}: no gpufeed mount there (see 'gpufeed fuse ls')")
    found = state(settings, mountpoint)
    dead = is_dead(mountpoint)
    pid = found.get("pid") if found else None
    ours = isinstance(pid, int) and alive(pid)  # a state left by a killed daemon of this home is not the mount there now
    if not ours and not dead:  # a daemon writes its state before its mount appears
        raise FuseError(f"{mountpoint}: mounted from another GPUFEED_HOME (no daemon of {settings.home} serves it); "
                        f"stop it with that home, or: fusermount3 -u {mountpoint}")
    _unmount(mountpoint, lazy=dead)
    if isinstance(pid, int):
        wait_until(lambda: not alive(pid), STOP_TIMEOUT_S)
