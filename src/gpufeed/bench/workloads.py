"""Named training workloads with the public DLIO / MLPerf Storage reference figures
(../shared/WORKLOADS.md), and the overrides that shrink them to a small machine.

A dataset is `files` files of `samples_per_file` records each; a sample is one record, read
as one ranged request, as a tfrecord reader or a one-image-per-file loader does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from gpufeed.errors import InvalidArgument


@dataclass(frozen=True)
class Workload:
    """The shape of a dataset and of the training job that reads it.

    compute: emulated accelerator seconds per batch (DLIO sleeps for it).
    workers: DataLoader worker processes per accelerator (the reference "read threads").
    au_pass: the AU a storage system must sustain to pass (MLPerf Storage), or None.
    """

    name: str
    format: str
    samples: int
    samples_per_file: int
    record_size: int
    record_sd: int
    batch: int
    compute: float
    workers: int
    accelerators: int = 1
    epochs: int = 2
    prefetch: int = 2
    au_pass: float | None = None

    @property
    def files(self) -> int:
        return math.ceil(self.samples / self.samples_per_file)

    @property
    def dataset_bytes(self) -> int:
        return self.files * self.samples_per_file * self.record_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("resnet50", "tfrecord", 1024 * 1251, 1251, 114_660, 0, 400, 0.224, 8, au_pass=0.90),
        Workload("unet3d", "npz", 168, 1, 146_600_628, 68_341_808, 7, 0.323, 4, au_pass=0.90),
        Workload("cosmoflow", "tfrecord", 524_288, 1, 2_828_486, 71_311, 1, 0.00350, 4, au_pass=0.70),
        Workload("bert", "tfrecord", 500 * 313_532, 313_532, 2_500, 0, 48, 0.968, 1),
        Workload("retinanet", "jpeg", 1_743_042, 1, 153_600, 0, 16, 0.180, 4, au_pass=0.85),
    )
}

_INT_FIELDS = ("samples", "samples_per_file", "record_size", "batch", "workers", "accelerators", "epochs", "prefetch")


def workload(
    name: str | None,
    *,
    scale: float | None = None,
    compute: float | None = None,
    **overrides: int | None,
) -> Workload:
    """The named workload with overrides applied; `scale` multiplies the sample count,
    rounded to whole files. A dataset smaller than one file is a single file holding every
    sample (unless --samples-per-file says otherwise), so a scaled run still reads records
    from one big file where the reference does.
    """
    if name is None:
        raise InvalidArgument(f"--workload is required (one of: {', '.join(WORKLOADS)})")
    base = WORKLOADS.get(name)
    if base is None:
        raise InvalidArgument(f"unknown workload {name!r} (valid: {', '.join(WORKLOADS)})")
    changes: dict[str, Any] = {}
    for field in _INT_FIELDS:
        value = overrides.pop(field, None)
        if value is not None:
            if value < 1:
                raise InvalidArgument(f"--{field.replace('_', '-')} {value}: must be at least 1")
            changes[field] = value
    if overrides:
        raise InvalidArgument(f"unknown workload parameter(s): {', '.join(sorted(overrides))}")
    if compute is not None:
        if compute < 0:
            raise InvalidArgument(f"--compute {compute}: must be >= 0 seconds")
        changes["compute"] = compute
    if "record_size" in changes:  # keep the reference's relative spread
        changes["record_sd"] = round(base.record_sd * changes["record_size"] / base.record_size)
    result = replace(base, **changes)
    if scale is not None:
        if not scale > 0:
            raise InvalidArgument(f"--scale {scale}: must be > 0")
        wanted = result.samples * scale
        spf = result.samples_per_file
        whole_files = round(wanted / spf) * spf  # as DLIO scales: fewer files of the same size
        result = replace(result, samples=whole_files if whole_files else max(1, round(wanted)))
    if result.samples < result.samples_per_file and "samples_per_file" not in changes:
        result = replace(result, samples_per_file=result.samples)
    return result
