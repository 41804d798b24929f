"""Workloads carry the published reference figures; overrides and --scale shrink them."""

from __future__ import annotations

import numpy as np
import pytest

from gpufeed.bench.modes import MODES, parse_modes
from gpufeed.bench.workloads import WORKLOADS, workload
from gpufeed.errors import InvalidArgument
from gpufeed.shuffle import epoch_permutation as epoch_order


def test_reference_defaults() -> None:
    r = WORKLOADS["resnet50"]
    assert (r.samples, r.samples_per_file, r.record_size, r.batch, r.compute, r.workers, r.au_pass) == (
        1024 * 1251, 1251, 114_660, 400, 0.224, 8, 0.90,
    )
    u = WORKLOADS["unet3d"]
    assert (u.files, u.record_size, u.record_sd, u.batch, u.compute, u.format) == (168, 146_600_628, 68_341_808, 7, 0.323, "npz")
    assert WORKLOADS["cosmoflow"].compute == 0.00350 and WORKLOADS["bert"].record_size == 2_500


def test_scale_shrinks_the_sample_count_and_keeps_the_file_shape() -> None:
    assert workload("resnet50", scale=0.002).files == 2
    assert workload("resnet50", scale=0.002).samples_per_file == 1251
    small = workload("resnet50", scale=0.0001)
    assert (small.samples, small.files, small.samples_per_file) == (128, 1, 128)
    assert workload("unet3d", scale=0.1).samples == 17


def test_overrides() -> None:
    w = workload("resnet50", record_size=1000, batch=2, compute=0.5, workers=3, accelerators=2, epochs=4)
    assert (w.record_size, w.record_sd, w.batch, w.compute, w.workers, w.accelerators, w.epochs) == (1000, 0, 2, 0.5, 3, 2, 4)
    assert workload("unet3d", record_size=1000).record_sd == 466  # the reference's relative spread


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: workload("resnet5"), "valid: resnet50, unet3d, cosmoflow, bert"),
        (lambda: workload(None), "--workload is required"),
        (lambda: workload("bert", batch=0), "--batch 0"),
        (lambda: workload("bert", scale=0), "--scale 0"),
        (lambda: workload("bert", compute=-1), "--compute -1"),
        (lambda: parse_modes("direct,cahced"), "unknown mode cahced (valid: direct, getitem, copy"),
    ],
)
def test_bad_input_is_one_clear_error(call, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgument) as info:
        call()
    assert needle in str(info.value)


def test_modes_default_is_the_three_ways_a_job_is_fed_from_any_source() -> None:
    assert [m.name for m in parse_modes(None)] == ["direct", "copy", "cached"]
    assert {"getitem", "local"} <= set(MODES), "the demo's ways are asked for by name"
    assert [m.name for m in parse_modes("copy, direct,copy")] == ["copy", "direct"]


def test_epoch_order_is_a_pure_function_of_seed_and_epoch() -> None:
    assert np.array_equal(epoch_order(1, 2, 100), epoch_order(1, 2, 100))
    assert not np.array_equal(epoch_order(1, 2, 100), epoch_order(1, 3, 100))
    assert sorted(epoch_order(0, 1, 50).tolist()) == list(range(50))
