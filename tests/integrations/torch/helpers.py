"""What the torch tests share, importable by spawned DataLoader workers: a dataset whose file i
holds its own index, and transforms over it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch.utils.data

from gpufeed.namespace import Namespace

N = 60


def content(i: int) -> bytes:
    """File i: its index in six digits, then a filler of a size that varies with i."""
    return f"{i:06d}".encode() + bytes([i % 251]) * (100 + 37 * i % 500)


def make_files(root: Path, n: int = N) -> None:
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"f{i:05d}.bin").write_bytes(content(i))


def mount_files(tmp_path: Path, n: int = N, at: str = "/data") -> str:
    """n files on a file:// mount; the manifest lists them in name order, so sample i is file i."""
    make_files(tmp_path / "files", n)
    Namespace().add_mount(at, f"file://{tmp_path / 'files'}")
    return at


def decode(data: bytes) -> int:
    """The sample index a file holds, checking the rest of its bytes on the way."""
    i = int(data[:6])
    if data != content(i):
        raise AssertionError(f"file {i}: wrong bytes")
    return i


class CrashOnce:
    """A transform that kills its DataLoader worker (SIGKILL) at sample `index`, once: the marker
    file it removes first keeps the resumed run alive."""

    def __init__(self, index: int, marker: Path) -> None:
        self.index = index
        self.marker = marker

    def __call__(self, data: bytes) -> int:
        i = decode(data)
        if i == self.index and torch.utils.data.get_worker_info() is not None and self.marker.exists():
            self.marker.unlink()
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
