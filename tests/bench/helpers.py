"""Shared helpers for the bench tests: tiny datasets and the CLI as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpufeed.bench.generate import generate
from gpufeed.bench.workloads import Workload, workload


def tiny(samples: int = 40, batch: int = 4, compute: float = 0.05, **overrides: int) -> Workload:
    """A resnet50-shaped job small enough for a test: one file of `samples` records."""
    settings: dict[str, int] = {"workers": 1, "epochs": 1, **overrides}
    return workload("resnet50", samples=samples, batch=batch, compute=compute, **settings)


def dataset(root: Path, work: Workload) -> str:
    url = f"file://{root}"
    generate(work, url)
    return url


def gpufeed(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpufeed", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        timeout=timeout,
        cwd=cwd,
    )


def one_error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpufeed: error: "), result.stderr
    return lines[0]
