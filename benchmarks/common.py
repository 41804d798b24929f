"""What the benchmark scripts share: a private, throw-away gpufeed home, and checks of how
costly creating a file, and filling new memory, are on this machine."""

from __future__ import annotations

import gc
import os
import resource
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import gpufeed
from gpufeed.client.connection import stop_agent


@contextmanager
def scratch_home(prefix: str) -> Iterator[Path]:
    """A temp dir whose `home` is GPUFEED_HOME for this process (and the agents it starts);
    the agent is stopped and everything removed at the end, whatever happened."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ["GPUFEED_HOME"] = str(work / "home")
    report_file_creation(work)
    report_first_touch(work)
    try:
        yield work
    finally:
        stop_agent(gpufeed.client().settings)
        shutil.rmtree(work, ignore_errors=True)


def settle() -> None:
    """Before a timed loop: what the set-up left behind is not the loop's to pay. Its dirty
    pages are written back (the files it wrote, uploads to a store), and its garbage collected:
    a set-up that imports a big library (boto3 for an upload) or builds thousands of objects
    leaves the collector owing a full pass, which otherwise lands in whichever epoch crosses
    the threshold next (measured: a 0.11 s pause of the training loop in a warm epoch, 0.9x of
    local disk instead of 1.0x)."""
    os.sync()
    gc.collect()


SLOW_CREATE_US = 200


def report_file_creation(where: Path, count: int = 300) -> None:
    """Print the kernel CPU, in µs, to create one empty file under `where`. Every
    cold block gpufeed caches is a new file, and on ext4 without a journal (this project's
    VMs) a file created within minutes of thousands being deleted nearby scans past the
    recently freed inodes: about 1 ms each instead of about 35 µs. The baselines read files
    that exist and never pay it, so a cold result taken then is this filesystem's, not
    gpufeed's; the line says so, and `TMPDIR=` on another filesystem avoids it."""
    probe = Path(tempfile.mkdtemp(dir=where, prefix="create-probe-"))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    for i in range(count):
        os.close(os.open(probe / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    each_us = (resource.getrusage(resource.RUSAGE_SELF).ru_stime - before) / count * 1e6
    note = ""
    if each_us > SLOW_CREATE_US:
        note = (" - slow: cold results below include it for every block cached (ext4 without a journal, files deleted"
                " nearby in the last minutes; TMPDIR= on another filesystem, or a wait, avoids it)")
    print(f"creating a file under {where}: {each_us:.0f} µs of kernel CPU{note}", flush=True)


SLOW_FIRST_TOUCH_MS = 1.0
PROBE_MIB = 64
PAGE_REPORTING = "/sys/module/page_reporting/parameters/page_reporting_order"
"""Free 2^order-page blocks the guest reports to the host; above the largest order (10), none."""


def report_first_touch(where: Path) -> None:
    """Print the kernel CPU, in ms, to write one MiB of a new file under `where`. A cold epoch
    puts every block it caches into new page-cache pages; a VM whose host takes back the memory
    the guest frees (virtio-balloon free page reporting) and backs it again only when touched
    charges that to the writer: measured on this project's VMs, 2.9 ms a MiB (0.33 ms per 113 KB
    file), against 0.25 for pages not handed back. The agent pays it for every cold block, and
    the baselines, reading files already in memory, never do; the line says so and how to stop it."""
    probe = where / "first-touch-probe"
    chunk = os.urandom(1 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    with probe.open("wb") as out:
        for _ in range(PROBE_MIB):
            out.write(chunk)
    each_ms = (resource.getrusage(resource.RUSAGE_SELF).ru_stime - before) / PROBE_MIB * 1000
    probe.unlink()
    note = ""
    if each_ms > SLOW_FIRST_TOUCH_MS:
        note = (
            " - slow: the host backs memory the guest freed only when it is touched again, and cold results below"
            f" include it for every block cached; as root, stop handing it back ({PAGE_REPORTING}: 11) and touch"
            " most of the free memory once (N GiB: python -c 'import numpy; numpy.ones(N << 27)')"
        )
    try:
        reporting = "on" if int(Path(PAGE_REPORTING).read_text()) <= 10 else "off"
    except (OSError, ValueError):
        reporting = "absent"
    cost = f"{each_ms:.2f} ms of kernel CPU a MiB (free page reporting {reporting})"
    print(f"writing new data under {where}: {cost}{note}", flush=True)


def small_files(root: Path, count: int, size: int) -> list[str]:
    """`count` files of `size` bytes in a new dir `root`, each different (windows of one random
    buffer, cheap to make); returns their names."""
    root.mkdir()
    payload = os.urandom(size + 4096)
    names = [f"{i:06d}.jpg" for i in range(count)]
    for i, name in enumerate(names):
        (root / name).write_bytes(payload[i % 4096 : i % 4096 + size])
    return names
