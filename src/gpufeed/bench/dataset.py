"""The samples a run reads, as the mount's manifest lists them: files in path order, each
split into `samples_per_file` records; sample i is record i % spf of file i // spf.

Only sizes and names are kept (numpy arrays and a tuple), never bytes, so every worker
gets the same small index.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gpufeed.bench.workloads import Workload
from gpufeed.client import Client
from gpufeed.errors import InvalidArgument


@dataclass(frozen=True)
class Dataset:
    paths: tuple[str, ...]
    sizes: np.ndarray
    samples_per_file: int
    samples: int

    @classmethod
    def from_mount(cls, client: Client, root: str, work: Workload, source: str | None = None) -> Dataset:
        """The first `work.samples` samples under `root` (the mount of `source`, the URL the
        user gave, which errors name); a source too small for them, or whose records are not the
        workload's size, is refused with the way out."""
        listed = sorted((s.path, s.size) for s in client.walk(root))
        spf = work.samples_per_file
        needed = math.ceil(work.samples / spf)
        if len(listed) < needed:
            raise InvalidArgument(
                f"{source or root}: has {len(listed)} files, the {work.name} run needs {needed} "
                f"({work.samples} samples, {spf} per file); write them with "
                f"'gpufeed bench generate --workload {work.name} ... URL' or lower --samples/--scale"
            )
        paths, sizes = zip(*listed[:needed], strict=True)
        dataset = cls(tuple(paths), np.asarray(sizes, dtype=np.int64), spf, work.samples)
        dataset._check_record_size(work)
        return dataset

    def _check_record_size(self, work: Workload) -> None:
        """Within 5% of the workload's record size, plus 4 standard errors where sizes vary."""
        tolerance = 0.05 * work.record_size + 4 * work.record_sd / math.sqrt(len(self.paths))
        if abs(self.record_size - work.record_size) <= tolerance:
            return
        per_file = max(1, round(float(np.median(self.sizes)) / work.record_size))
        raise InvalidArgument(
            f"at {self.samples_per_file} records per file the source's records average {self.record_size:,.0f} B, "
            f"not the {work.record_size:,} B of {work.name}: its files hold about {per_file} such records "
            f"(pass --samples-per-file {per_file}), or pass --record-size to match the data"
        )

    @property
    def bytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def record_size(self) -> float:
        """Mean bytes per sample."""
        return self.bytes / (len(self.paths) * self.samples_per_file)

    @property
    def max_record(self) -> int:
        spf = self.samples_per_file
        return int(self.sizes.max() // spf + self.sizes.max() % spf)

    def ranges(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(file index, start, end) of each sample; a file's last record takes its tail bytes."""
        spf = self.samples_per_file
        files, records = np.divmod(samples, spf)
        sizes = self.sizes[files]
        slot = sizes // spf
        starts = records * slot
        ends = np.where(records == spf - 1, sizes, starts + slot)
        return files, starts, ends
