"""Each mount's cached fraction, for the dashboard and Prometheus.

The agent names blocks by object hash and does not know their mounts, so a thread walks the
mounts' manifests (`gpufeed.coverage`) now and then. A pass stats one block file per block, about
a second per 100,000 files, so passes are spaced at least `SPACING` times their own length: the
count costs at most a few per cent of one core; its figures are a few seconds old on a small
mount (passes at least `MIN_INTERVAL_S` apart), minutes on a mount of millions of files."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from gpufeed.config import Settings
from gpufeed.coverage import mount_coverage
from gpufeed.errors import GpufeedError
from gpufeed.namespace import Namespace

log = logging.getLogger("gpufeed.agent")

FIRST_PASS_S = 1.0
MIN_INTERVAL_S = 5.0
SPACING = 20


class MountCoverage:
    def __init__(self, settings: Settings, dirs: tuple[Path, ...]) -> None:
        self.settings = settings
        self.dirs = dirs
        self.latest: dict[str, tuple[int, int]] = {}
        """Mount path → (bytes in its manifest, bytes of them cached), as of the last pass."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpufeed-mount-coverage", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        delay = FIRST_PASS_S
        while not self._stop.wait(delay):
            began = time.monotonic()
            self.count()
            delay = max(MIN_INTERVAL_S, SPACING * (time.monotonic() - began))

    def count(self) -> None:
        """One pass; a namespace that cannot be read keeps the last figures (logged at debug level)."""
        try:
            namespace = Namespace(self.settings)
            try:
                self.latest = mount_coverage(namespace, self.settings, self.dirs)
            finally:
                namespace.close()
        except (GpufeedError, OSError) as exc:
            log.debug("cannot count the mounts' cached bytes: %s", exc)
