"""`gpufeed fuse` on real mounts: libfuse3, the real agent, nginx and file:// stores; every
reader is a separate process that knows nothing of gpufeed."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from gpufeed.bench.shaper import shaping
from gpufeed.client import Client
from gpufeed.client.connection import AgentUnavailable
from gpufeed.config import Settings
from gpufeed.integrations import fuse_mounts
from gpufeed.namespace import Namespace
from tests.agent.test_agent import agent_pids, make_files, stats
from tests.agent.test_metrics import agent_metrics
from tests.cli.test_cli import fails, ok
from tests.conftest import HttpServer


def until(done: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def mountpoint(tmp_path: Path) -> Iterator[Path]:
    """An empty dir; whatever is mounted there by the test is unmounted after it."""
    point = tmp_path / "mnt"
    point.mkdir()
    yield point
    if point in fuse_mounts.mounted():
        subprocess.run(["fusermount3", "-u", "-z", str(point)], check=False)


def mount(point: Path, nspath: str, *args: str) -> int:
    """`gpufeed fuse` in the background; returns the daemon's pid."""
    out = ok("fuse", str(point), nspath, *args)
    assert f"mounted {nspath} at {point}" in out
    return int(out.split("(pid ")[1].split(")")[0].split(",")[0])


def mount_state(point: Path) -> dict:
    state = fuse_mounts.state(Settings.from_env(), point)
    assert state is not None
    return state


def test_every_file_is_byte_identical_and_ls_lR_asks_the_store_nothing(nginx: HttpServer, mountpoint: Path) -> None:
    root = nginx.root / uuid.uuid4().hex[:8]
    (root / "train" / "cats").mkdir(parents=True)
    (root / "train" / "dogs").mkdir(parents=True)
    (root / "README").write_bytes(b"readme\n")
    (root / "empty.bin").write_bytes(b"")
    for i in range(20):
        (root / "train" / ("cats" if i % 2 else "dogs") / f"{i}.jpg").write_bytes(os.urandom(1000 + 997 * i))
    (root / "big.bin").write_bytes(os.urandom(9 << 20))  # three blocks: read-ahead follows the reader
    Namespace().add_mount("/web", f"{nginx.url}/{root.name}")
    mount(mountpoint, "/web", "--no-warmup")

    requests = len(nginx.access_log.read_text().splitlines())
    listing = subprocess.run(["ls", "-lRn", "--time-style=+%s", str(mountpoint)], capture_output=True, text=True, check=True)
    seen: dict[str, tuple[bool, int]] = {}
    where = ""
    for line in listing.stdout.splitlines():
        if line.endswith(":"):
            where = line[:-1].removeprefix(str(mountpoint)).lstrip("/")
        elif line and not line.startswith("total"):
            mode, _, _, _, size, _, name = line.split(maxsplit=6)
            seen[f"{where}/{name}".lstrip("/")] = (mode.startswith("d"), int(size) if mode.startswith("-") else 0)
    client = Client()
    expected = {f.path.removeprefix("/web/"): (False, f.size) for f in client.walk("/web")}
    expected |= {"train": (True, 0), "train/cats": (True, 0), "train/dogs": (True, 0)}
    assert seen == expected
    assert len(nginx.access_log.read_text().splitlines()) == requests, "ls -lR reached the store"
    listed_at = client.namespace.resolve("/web").mount.listed_at  # type: ignore[union-attr]
    assert abs((mountpoint / "train").stat().st_mtime - listed_at) < 1, "a directory's time is its listing's, not 1970"
    some = next(f for f in client.walk("/web"))
    shown = (mountpoint / some.path.removeprefix("/web/")).stat()
    assert shown.st_atime == shown.st_mtime and abs(shown.st_mtime - some.mtime) < 1e-3, "an atime of the object's, not 1970"

    assert digests(mountpoint) == digests(root)
    assert digests(mountpoint) == digests(root)  # again, from the kernel's page cache and the node cache


def test_reads_resume_when_the_agent_is_killed(tmp_path: Path, mountpoint: Path, gpufeed_home: Path) -> None:
    expected = make_files(tmp_path / "src", 400, 3000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    mount(mountpoint, "/data", "--no-warmup")
    reader = subprocess.Popen(
        [sys.executable, "-c", "import hashlib, os, sys\nfor n in sorted(os.listdir(sys.argv[1])):\n"
         "    print(n, hashlib.sha256(open(os.path.join(sys.argv[1], n), 'rb').read()).hexdigest(), flush=True)",
         str(mountpoint)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert reader.stdout is not None
    seen: dict[str, str] = {}
    killed: set[int] = set()
    for i, line in enumerate(reader.stdout):
        name, digest = line.split()
        seen[name] = digest
        if i in (50, 200):
            for pid in agent_pids(gpufeed_home / "cache"):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
    assert reader.wait(timeout=60) == 0
    assert len(killed) == 2
    assert seen == {k: hashlib.sha256(v).hexdigest() for k, v in expected.items()}


def test_a_killed_daemon_leaves_a_dead_mount_that_the_next_mount_cleans(tmp_path: Path, mountpoint: Path) -> None:
    make_files(tmp_path / "src", 5, 1000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    pid = mount(mountpoint, "/data", "--no-warmup")
    os.kill(pid, signal.SIGKILL)
    until(lambda: fuse_mounts.is_dead(mountpoint), what="the mount to die")
    with pytest.raises(OSError) as dead:
        os.listdir(mountpoint)
    assert dead.value.errno == errno.ENOTCONN
    assert "dead" in ok("fuse", "ls")
    mount(mountpoint, "/data", "--no-warmup")
    assert sorted(os.listdir(mountpoint)) == sorted(os.listdir(tmp_path / "src"))
    ok("fuse", "stop", str(mountpoint))
    assert mountpoint not in fuse_mounts.mounted()


def test_three_mounts_on_one_mountpoint_at_once_make_one_mount(tmp_path: Path, mountpoint: Path) -> None:
    """A launch script run by every rank: one mount comes up, the others find it there; a
    different namespace path there is refused."""
    make_files(tmp_path / "src", 3, 1000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    runs = [subprocess.Popen([sys.executable, "-m", "gpufeed", "fuse", str(mountpoint), "/data", "--no-warmup"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(run.wait(timeout=120), *run.communicate()) for run in runs]
    assert [code for code, _, _ in results] == [0, 0, 0], results
    said = sorted(out.split(" (pid")[0] for _, out, _ in results)
    assert said == [f"/data is mounted at {mountpoint} already", f"/data is mounted at {mountpoint} already",
                    f"mounted /data at {mountpoint}"], said
    stacked = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if f" {mountpoint} " in line]
    assert len(stacked) == 1, stacked
    relative = subprocess.run([sys.executable, "-m", "gpufeed", "fuse", f"{mountpoint.name}/../{mountpoint.name}", "/data"],
                              capture_output=True, text=True, cwd=mountpoint.parent, timeout=120)
    assert (relative.returncode, relative.stdout.split(" (pid")[0]) == (0, f"/data is mounted at {mountpoint} already"), relative
    with open(mountpoint / "00001.bin", "rb"):
        busy = fails(1, "fuse", "stop", str(mountpoint))
    assert busy.startswith(f"gpufeed: error: {mountpoint}: cannot unmount: ") and "busy" in busy, busy
    assert busy.endswith(f"(a process uses it: 'fuser -vm {mountpoint}' names it; "
                         f"'fusermount3 -uz {mountpoint}' detaches it now)"), busy
    Namespace().add_mount("/other", f"file://{tmp_path / 'src'}")
    assert fails(1, "fuse", str(mountpoint), "/other") == (
        f"gpufeed: error: {mountpoint}: a gpufeed mount is already there; stop it first with 'gpufeed fuse stop {mountpoint}'"
    )
    elsewhere = {**os.environ, "GPUFEED_HOME": str(tmp_path / "another-home")}  # another user's, say: not this one's to stop
    assert "mounted from another GPUFEED_HOME" in fails(1, "fuse", "stop", str(mountpoint), env=elsewhere)
    ok("fuse", "stop", str(mountpoint))
    assert mountpoint not in fuse_mounts.mounted()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_unmounts_a_foreground_mount(tmp_path: Path, mountpoint: Path, stop: signal.Signals) -> None:
    make_files(tmp_path / "src", 3, 1000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    daemon = subprocess.Popen([sys.executable, "-m", "gpufeed", "fuse", str(mountpoint), "/data", "--foreground"])
    until(lambda: mountpoint in fuse_mounts.mounted() or daemon.poll() is not None, what="the mount")
    assert len(os.listdir(mountpoint)) == 3
    daemon.send_signal(stop)
    assert daemon.wait(timeout=20) == 0
    assert mountpoint not in fuse_mounts.mounted()


def test_an_unchanged_imagefolder_script_runs_on_the_mount(tmp_path: Path, mountpoint: Path) -> None:
    from PIL import Image

    src = tmp_path / "images"
    for label in ("ants", "bees"):
        (src / label).mkdir(parents=True)
        for i in range(12):
            Image.frombytes("RGB", (32, 32), os.urandom(32 * 32 * 3)).save(src / label / f"{i}.jpg", quality=90)
    Namespace().add_mount("/images", f"file://{src}")
    mount(mountpoint, "/images")
    script = textwrap.dedent(
        """
        import hashlib, os, sys
        import torch
        from PIL import Image
        from torch.utils.data import DataLoader, Dataset

        class ImageFolder(Dataset):  # torchvision.datasets.ImageFolder's contract: class dirs of images
            def __init__(self, root):
                self.classes = sorted(os.listdir(root))
                self.samples = [(os.path.join(root, c, f), n) for n, c in enumerate(self.classes)
                                for f in sorted(os.listdir(os.path.join(root, c)))]
            def __len__(self):
                return len(self.samples)
            def __getitem__(self, i):
                path, label = self.samples[i]
                with Image.open(path) as image:
                    pixels = image.convert("RGB").tobytes()
                return hashlib.sha256(pixels).hexdigest(), label

        loader = DataLoader(ImageFolder(sys.argv[1]), batch_size=5, num_workers=2)
        for digests, labels in loader:
            for digest, label in zip(digests, labels.tolist()):
                print(label, digest)
        """
    )
    got = {subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, check=True).stdout
           for root in (mountpoint, src)}  # fmt: skip
    assert len(got) == 1 and len(got.pop().splitlines()) == 24


def test_the_background_warmup_caches_the_mounted_path(tmp_path: Path, mountpoint: Path) -> None:
    make_files(tmp_path / "src", 30, 50_000)
    (tmp_path / "src" / "big.bin").write_bytes(os.urandom(10 << 20))
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    mount(mountpoint, "/data")
    until(lambda: mount_state(mountpoint).get("warm_done"), what="the warmup")
    client = Client()
    assert all(cached == item.size for item, cached in client.cached_bytes("/data"))
    assert "warmup done" in ok("fuse", "ls")
    log = fuse_mounts.log_file(Settings.from_env(), mountpoint).read_text()
    assert "warmup of /data done" in log and "Ignoring invalid" not in log, "libfuse has nothing to complain of"


def test_a_view_bigger_than_the_cache_is_not_warmed(tmp_path: Path, mountpoint: Path) -> None:
    """Warming 3 MiB into a 2 MiB cache would evict what readers fetched and fetch it again."""
    make_files(tmp_path / "src", 30, 100_000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    ok("agent", "start", "--cache-size", "2MiB")
    mount(mountpoint, "/data")
    until(lambda: mount_state(mountpoint).get("warm_done"), what="the warmup")
    assert stats().bytes_fetched == 0
    note = "skipped: 2.9 MiB does not fit the cache's 2.0 MiB"
    assert f"warmup done ({note})" in ok("fuse", "ls")
    log = fuse_mounts.log_file(Settings.from_env(), mountpoint).read_text()
    assert f"warmup of /data {note}; reads fill the cache as they go" in log
    assert hashlib.sha256((mountpoint / "00003.bin").read_bytes()).digest() == hashlib.sha256(
        (tmp_path / "src" / "00003.bin").read_bytes()).digest()


def test_the_warmup_skips_a_file_it_cannot_open_and_caches_the_rest(tmp_path: Path, mountpoint: Path) -> None:
    """Files are looked up a batch at a time; one that fails (gone from the store of a --max-age
    mount, which checks at each open) is named in the log and skipped, even as the last one."""
    make_files(tmp_path / "src", 30, 50_000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}", max_age=0.001)
    gone = sorted((tmp_path / "src").iterdir())[-1]
    size = gone.stat().st_size
    gone.unlink()
    mount(mountpoint, "/data")
    until(lambda: mount_state(mountpoint).get("warm_done"), what="the warmup")
    cached = {item.path: (item.size, got) for item, got in Client().cached_bytes("/data")}
    assert cached.pop(f"/data/{gone.name}") == (size, 0)
    assert len(cached) == 29 and all(size == got for size, got in cached.values())
    log = fuse_mounts.log_file(Settings.from_env(), mountpoint).read_text()
    assert f"warmup skips /data/{gone.name}" in log


def test_getattr_of_a_file_the_warmup_opened_asks_the_manifest_nothing(tmp_path: Path, mountpoint: Path) -> None:
    """The warmup's handles answer the kernel's getattr: a manifest entry changed behind the
    daemon's back (size 1) shows through a mount without a warmup, not through the warmed one."""
    files = make_files(tmp_path / "src", 3, 5000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    mount(mountpoint, "/data")
    until(lambda: mount_state(mountpoint).get("warm_done"), what="the warmup")
    namespace = Namespace()
    generation = namespace.mount("/data").generation
    entry = namespace.engine.lookup(generation, "", "00001.bin")
    assert entry is not None
    namespace.engine.put_entries(generation, [entry._replace(size=1)])
    cold = tmp_path / "cold"
    cold.mkdir()
    mount(cold, "/data", "--no-warmup")
    try:
        assert os.stat(mountpoint / "00001.bin").st_size == len(files["00001.bin"])
        assert os.stat(cold / "00001.bin").st_size == 1
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(cold)], check=False)


def test_a_refresh_shows_the_new_bytes_and_a_store_failure_is_eio(tmp_path: Path, mountpoint: Path, gpufeed_home: Path) -> None:
    src = tmp_path / "src"
    make_files(src, 3, 1000)
    Namespace().add_mount("/data", f"file://{src}")
    mount(mountpoint, "/data", "--no-warmup")
    first = (mountpoint / "00000.bin").read_bytes()
    assert first == (src / "00000.bin").read_bytes()

    (src / "00001.bin").write_bytes(b"changed since listing")
    with pytest.raises(OSError) as failed:
        (mountpoint / "00001.bin").read_bytes()
    assert failed.value.errno == errno.EIO
    log = fuse_mounts.log_file(Settings.from_env(), mountpoint).read_text().splitlines()
    assert len([line for line in log if "/data/00001.bin" in line]) == 1

    (src / "00000.bin").write_bytes(b"new bytes, new size")
    ok("mount", "refresh", "/data")
    until(lambda: (mountpoint / "00000.bin").stat().st_size == 19, what="the refresh to reach the kernel's attributes")
    assert (mountpoint / "00000.bin").read_bytes() == b"new bytes, new size"
    assert (mountpoint / "00001.bin").read_bytes() == b"changed since listing"


def test_bad_input_is_one_line(tmp_path: Path, mountpoint: Path) -> None:
    make_files(tmp_path / "src", 2, 100)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    assert "no such directory" in fails(1, "fuse", str(tmp_path / "missing"), "/data")
    (mountpoint / "x").write_bytes(b"")
    assert "not empty" in fails(1, "fuse", str(mountpoint), "/data")
    (mountpoint / "x").unlink()
    assert "is a file" in fails(1, "fuse", str(mountpoint), "/data/00000.bin")
    assert "no such file or directory in mount /data" in fails(1, "fuse", str(mountpoint), "/data/nope")
    assert "no mount contains" in fails(1, "fuse", str(mountpoint), "/elsewhere")
    assert "Missing argument 'MOUNTPOINT [NSPATH]'" in fails(2, "fuse")
    empty = tmp_path / "bin"
    empty.mkdir()
    assert "fusermount3 not found" in fails(1, "fuse", str(mountpoint), "/data", env={"PATH": str(empty)})
    with pytest.raises(fuse_mounts.FuseError, match="/nodev/fuse does not exist"):
        fuse_mounts.check(Settings.from_env(), mountpoint, device=Path("/nodev/fuse"))
    assert "no gpufeed mount there" in fails(1, "fuse", "stop", str(mountpoint))
    # as another user (the check alone: the CLI's other imports need nothing of this test)
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable, "-c"]
    code = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from gpufeed.config import Settings
        from gpufeed.integrations import fuse_mounts
        try:
            fuse_mounts.check(Settings.from_env(), Path(sys.argv[1]), *map(Path, sys.argv[2:]))
        except fuse_mounts.FuseError as exc:
            print(exc)
        """
    )
    # a /dev/fuse this user may not open: a copy of the device node, root's, mode 0600, in a
    # directory anyone may search (tmp_path's parents are root's alone)
    public = Path(tempfile.mkdtemp(prefix="gpufeed-dev-"))
    try:
        public.chmod(0o755)
        device = public / "fuse"
        real = os.stat(fuse_mounts.FUSE_DEVICE)
        try:
            os.mknod(device, stat.S_IFCHR | 0o600, real.st_rdev)
        except PermissionError:
            pytest.skip("no CAP_MKNOD here: cannot make a copy of /dev/fuse")
        os.close(os.open(device, os.O_RDWR))  # the node works: root opens it
        refused = subprocess.run([*nobody, code, str(mountpoint), str(device)], capture_output=True, text=True, check=True)
        denied = "permission denied: add the user to the 'fuse' group or make the device readable"
        assert refused.stdout.strip() == f"{device}: {denied}"
        device.chmod(0o666)  # the same node, open to all: the check goes past it to the mountpoint
        allowed = subprocess.run([*nobody, code, str(mountpoint), str(device)], capture_output=True, text=True, check=True)
        assert allowed.stdout.strip() == f"{mountpoint}: permission denied: mount on a directory you own and can write"
    finally:
        shutil.rmtree(public)


def test_ls_lists_mounts_with_their_callbacks(tmp_path: Path, mountpoint: Path) -> None:
    make_files(tmp_path / "src", 4, 1000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    mount(mountpoint, "/data", "--no-warmup")
    for name in os.listdir(mountpoint):
        (mountpoint / name).read_bytes()
    # read is each file's last callback (closing one calls no Python): a state file that counts 4 has counted the rest
    until(lambda: mount_state(mountpoint)["calls"].get("read") == 4, what="the state file")
    [row] = [r for r in json.loads(ok("fuse", "ls", "--json")) if r["mountpoint"] == str(mountpoint)]  # not another test's
    assert row["mountpoint"] == str(mountpoint) and row["nspath"] == "/data" and row["alive"]
    calls = row["calls"]
    assert (calls["open"], calls["read"]) == (4, 4), "one read callback a small file"
    assert "release" not in calls, "closing a file calls no Python"
    assert not row["zero_open"], "a strict mount pins each open's version"
    listed = ok("fuse", "ls", env={"GPUFEED_HOME": str(tmp_path / "other-home")}).splitlines()
    assert f"{mountpoint}  /data  alive  no state in this GPUFEED_HOME (another home's mount, or starting)" in listed


def test_an_immutable_view_opens_files_without_a_callback_and_still_sees_a_refresh(tmp_path: Path, mountpoint: Path) -> None:
    """Every mount of the view --immutable and cached: the first open answers ENOSYS and the
    kernel opens every file itself from then on, keeping its pages across opens, so the
    daemon hears of a file once, at its first read. A refresh still reaches readers: the
    daemon invalidates what changed."""
    src = tmp_path / "src"
    files = make_files(src, 20, 3000)
    Namespace().add_mount("/data", f"file://{src}", immutable=True)
    mount(mountpoint, "/data", "--no-warmup")
    for _ in range(3):
        assert {name: (mountpoint / name).read_bytes() for name in files} == files
    read_at = time.time()
    until(lambda: mount_state(mountpoint)["written"] > read_at, what="a state file written after the reads")
    state = mount_state(mountpoint)
    assert state["zero_open"]
    assert state["calls"]["open"] == 1 and state["calls"]["read"] == len(files), state["calls"]
    assert "opens cost no callback" in ok("fuse", "ls")

    (src / "00000.bin").write_bytes(b"new bytes, new size")
    ok("mount", "refresh", "/data")
    until(lambda: (mountpoint / "00000.bin").stat().st_size == 19, what="the refresh to reach the kernel's attributes")
    assert (mountpoint / "00000.bin").read_bytes() == b"new bytes, new size"
    assert (mountpoint / "00001.bin").read_bytes() == files["00001.bin"]


def test_a_view_with_one_strict_mount_pins_every_open(tmp_path: Path) -> None:
    """Zero-message opens only where no mount of the view has a version to pin, and only with
    the node cache on (the kernel then keeps every file's pages)."""
    from gpufeed.integrations.fuse import _immutable_view

    for name in ("a", "b", "c"):
        make_files(tmp_path / name, 1, 100)
    client = Client()
    client.namespace.add_mount("/data/a", f"file://{tmp_path / 'a'}", immutable=True)
    client.namespace.add_mount("/data/b", f"file://{tmp_path / 'b'}")
    client.namespace.add_mount("/other", f"file://{tmp_path / 'c'}", {"cache": "off"}, immutable=True)
    assert _immutable_view(client, "/data/a") and _immutable_view(client, "/data/a/sub")
    assert not _immutable_view(client, "/data") and not _immutable_view(client, "/")
    assert not _immutable_view(client, "/other")


def test_a_listed_directory_is_opened_without_a_lookup_callback_per_file(tmp_path: Path, mountpoint: Path) -> None:
    """READDIRPLUS: a listing hands the kernel every entry's attributes, as ImageFolder lists a
    directory and then opens its files; 3,000 files asked 3,001 getattr callbacks before."""
    files = make_files(tmp_path / "src", 300, 2000)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    mount(mountpoint, "/data", "--no-warmup")
    listed = {entry.name: entry.stat().st_size for entry in os.scandir(mountpoint)}
    assert listed == {name: len(data) for name, data in files.items()}
    shown = subprocess.run(["ls", "-a", str(mountpoint)], capture_output=True, text=True, check=True).stdout.split()
    assert shown == [".", "..", *sorted(files)], "ls -a shows . and .. too"
    assert all((mountpoint / name).read_bytes() == data for name, data in files.items())
    until(lambda: mount_state(mountpoint)["calls"].get("read") == len(files), what="the state file")
    calls = mount_state(mountpoint)["calls"]
    assert calls.get("getattr", 0) <= 1, calls  # the mount's root
    assert 1 <= calls["readdir"] <= 10 and calls["open"] == len(files), calls


@pytest.mark.parametrize("immutable", [False, True], ids=["strict", "immutable"])
def test_a_sequential_reader_of_a_big_file_has_the_next_blocks_prefetched(
    tmp_path: Path, mountpoint: Path, immutable: bool
) -> None:
    """Read-ahead follows an open file; with zero-message opens (immutable) there is no open
    to follow, and it follows the path."""
    data = os.urandom(20 << 20)  # five 4 MiB blocks
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(data)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}", immutable=immutable)
    mount(mountpoint, "/data", "--no-warmup")
    with open(mountpoint / "big.bin", "rb") as f:
        assert f.read(1 << 20) == data[: 1 << 20]
        until(lambda: stats().prefetched >= 2, what="blocks 1 and 2 prefetched while block 0 is read")
        assert f.read() == data[1 << 20 :]


def test_no_read_ahead_leaves_the_next_blocks_to_the_reader(tmp_path: Path, mountpoint: Path) -> None:
    """The mirror of the test above: the same reader, the same file, nothing fetched ahead of it.
    (With read-ahead on, the blocks a reader reaches were asked for before it reached them, and
    the agent counts a prefetched block before it answers the read that waited on it.)"""
    data = os.urandom(20 << 20)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.bin").write_bytes(data)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    assert "no read-ahead" in ok("fuse", str(mountpoint), "/data", "--no-warmup", "--no-read-ahead")
    with open(mountpoint / "big.bin", "rb") as f:
        assert f.read(1 << 20) == data[: 1 << 20]
        assert f.read() == data[1 << 20 :]
    after = stats()
    assert after.prefetched == 0, "a block was fetched ahead of the reader"
    assert after.bytes_fetched == len(data), "every block came on demand"
    until(lambda: fuse_mounts.state(Settings.from_env(), mountpoint), what="the state file")
    assert mount_state(mountpoint)["read_ahead"] is False
    assert "read-ahead off" in ok("fuse", "ls")


def test_a_demand_read_passes_the_background_warmup(nginx: HttpServer, tmp_path: Path, mountpoint: Path) -> None:
    """480 files of 64 KiB behind 20 ms and 8 MB/s: the warmup queues them all at the agent and
    needs 4 s. A script that opens the last of them (the warmup reaches it last), once the
    warmup fetches at full width with hundreds of blocks behind, has its bytes while the warmup
    has cached less than half of the rest: the read did not wait its turn in the warmup's queue.
    (It does share the store's link with the warmup's fetches in flight, so it takes about one
    round of them: 48 files here.)"""
    site = nginx.root / f"warm-{tmp_path.name}"
    site.mkdir()
    for i in range(480):
        (site / f"{i:03d}.bin").write_bytes(os.urandom(64 << 10))
    upstream = urlsplit(nginx.url)
    with shaping((upstream.hostname or "127.0.0.1", upstream.port or 80), 20, 8, tmp_path / "shaper.log") as port:
        Namespace().add_mount("/slow", f"http://127.0.0.1:{port}/{site.name}")
        client = Client()
        mount(mountpoint, "/slow")

        def warming() -> bool:
            try:
                metrics = agent_metrics()
            except AgentUnavailable:  # the daemon's first request starts it
                return False
            return metrics[("gpufeed_fetches_in_flight", ())] >= 40 and metrics[("gpufeed_prefetch_queued", ())] >= 400

        until(warming, what="the warmup to queue the prefix and fetch at full width")
        assert dict((f.path, n) for f, n in client.cached_bytes("/slow"))["/slow/479.bin"] == 0, "the warmup got there first"
        assert (mountpoint / "479.bin").read_bytes() == (site / "479.bin").read_bytes()
        cached = {f.path: n == f.size for f, n in client.cached_bytes("/slow")}
        assert cached.pop("/slow/479.bin")
        warmed = sum(cached.values())
        assert warmed < len(cached) / 2, f"the demand read waited for {warmed} of the warmup's {len(cached)} files"
        ok("fuse", "stop", str(mountpoint))


def test_bench_reads_through_a_plain_fuse_view_and_through_the_cached_mount(tmp_path: Path) -> None:
    from gpufeed.bench.modes import MODES
    from gpufeed.bench.runner import BenchConfig, run_bench
    from tests.bench.helpers import dataset, tiny

    work = tiny(samples=24, batch=4, compute=0.01, epochs=2, workers=2)
    modes = (MODES["cached"], MODES["fuse-direct"], MODES["fuse"])
    api, plain, cached = run_bench(BenchConfig(work, dataset(tmp_path / "data", work), modes=modes, latency_ms=20)).modes
    assert [e.samples for e in plain.epochs + cached.epochs] == [24] * 4
    assert api.epochs[0].source_bytes == 24 * 114_660
    assert cached.epochs[0].source_bytes == 24 * 114_660, "cold, though `cached` ran before it on the same store"
    assert cached.epochs[1].source_bytes == 0
    assert cached.epochs[1].latency_p50_ms < 20, "warm samples come from the mount's page cache"
    assert plain.epochs[1].latency_p50_ms >= 20, "a plain view asks the store again"
    assert not [p for p in fuse_mounts.mounted() if "gpufeed-bench-" in str(p)], "the run's mounts are gone"


def test_an_open_file_whose_state_was_dropped_reads_its_version_or_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon hears of opens, not closes, and keeps the newest opens' state. A read through
    an older file handle finds its object again by path: the same bytes while the version is the
    one it opened, EIO once a refresh changed it (never another version's bytes)."""
    from types import SimpleNamespace

    from gpufeed.integrations import fuse

    monkeypatch.setattr(fuse, "OPENS_KEPT", 1)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a" * 1000)
    (src / "b.bin").write_bytes(b"b" * 1000)
    client = Client()
    client.namespace.add_mount("/data", f"file://{src}")
    operations = fuse.FeedOperations(client, "/data", fuse.MountState("/mnt", "/data", os.getpid(), 0.0, False))
    first, second = SimpleNamespace(flags=os.O_RDONLY, fh=0, keep_cache=0), SimpleNamespace(flags=os.O_RDONLY, fh=0, keep_cache=0)
    operations.open("/a.bin", first)
    operations.open("/b.bin", second)  # the newest open: the first one's state is dropped
    assert first.fh not in operations._opens
    assert bytes(operations.read("/a.bin", 4096, 0, first)) == b"a" * 1000
    (src / "a.bin").write_bytes(b"A" * 2000)
    client.namespace.refresh("/data")
    operations.open("/b.bin", second)
    with pytest.raises(fuse.mfusepy.FuseOSError) as failed:
        operations.read("/a.bin", 4096, 0, first)
    assert failed.value.errno == errno.EIO
    third = SimpleNamespace(flags=os.O_RDONLY, fh=0, keep_cache=0)
    operations.open("/a.bin", third)
    assert bytes(operations.read("/a.bin", 4096, 0, third)) == b"A" * 2000


def test_removing_a_mount_a_view_serves_is_refused_unless_forced(tmp_path: Path, mountpoint: Path) -> None:
    make_files(tmp_path / "src", 2, 100)
    Namespace().add_mount("/data", f"file://{tmp_path / 'src'}")
    mount(mountpoint, "/data", "--no-warmup")
    refused = fails(1, "mount", "rm", "/data")
    assert f"/data: gpufeed fuse serves it at {mountpoint}; stop that first" in refused
    assert sorted(os.listdir(mountpoint)) == ["00000.bin", "00001.bin"], "the view still shows the mount's files"
    assert "removed mount /data" in ok("mount", "rm", "/data", "--force")
    assert "no such mount" in fails(1, "mount", "rm", "/data")


def test_each_mountpoint_has_its_own_state_and_log_file(tmp_path: Path) -> None:
    """`/` is written `_` in the file's name: an `_` of the path must not make two mountpoints one."""
    named = [fuse_mounts.state_file(tmp_path, Path(p)).name for p in ("/tmp/mnt", "/x/a_b/c", "/x/a/b_c", "/x/a%5Fb/c")]
    assert named[0] == "tmp_mnt.json" and len(set(named)) == 4, named
