"""`bench generate`: the dataset has the workload's shape, and npz/JPEG files are valid."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from gpufeed.bench.generate import file_sizes, generate
from gpufeed.bench.workloads import workload
from tests.bench.helpers import gpufeed
from tests.conftest import Bucket


def test_tfrecord_files_hold_samples_per_file_records(tmp_path: Path) -> None:
    work = workload("resnet50", samples=30, samples_per_file=8, record_size=1000)
    result = generate(work, f"file://{tmp_path}/d")
    files = sorted((tmp_path / "d" / "train").iterdir())
    assert (result.files, len(files)) == (4, 4)
    assert all(f.stat().st_size == 8000 for f in files)
    assert files[0].read_bytes() != files[1].read_bytes()


def test_npz_loads_and_has_the_drawn_size(tmp_path: Path) -> None:
    work = workload("unet3d", samples=3, record_size=50_000)
    generate(work, f"file://{tmp_path}", seed=7)
    paths = sorted((tmp_path / "train").iterdir())
    assert [p.stat().st_size for p in paths] == file_sizes(work, seed=7)
    for path in paths:
        with np.load(path) as npz:
            assert npz["x"].dtype == np.uint8 and npz["x"].size > 0.9 * path.stat().st_size


def test_one_sample_files_keep_the_reference_spread(tmp_path: Path) -> None:
    work = workload("unet3d", samples=40, record_size=10_000)
    assert work.record_sd == round(68_341_808 * 10_000 / 146_600_628)
    generate(work, f"file://{tmp_path}")
    sizes = [p.stat().st_size for p in (tmp_path / "train").iterdir()]
    assert len(sizes) == 40 and len(set(sizes)) > 30
    assert abs(np.mean(sizes) - work.record_size) < 4 * work.record_sd / np.sqrt(len(sizes))


def test_jpeg_decodes(tmp_path: Path) -> None:
    generate(workload("retinanet", samples=2, record_size=200_000), f"file://{tmp_path}")
    for path in (tmp_path / "train").iterdir():
        data = path.read_bytes()
        assert len(data) == 200_000 and data[:2] == b"\xff\xd8" and data[-2:] == b"\xff\xd9"
        image = Image.open(io.BytesIO(data))
        image.load()
        assert (image.format, image.size) == ("JPEG", (8, 8))


def test_generate_to_s3_through_the_cli(bucket: Bucket) -> None:
    result = gpufeed(
        "bench", "generate", "--workload", "resnet50", "--samples", "6", "--samples-per-file", "3",
        "--opt", f"endpoint={bucket.endpoint}", f"s3://{bucket.name}/resnet",
    )
    assert result.returncode == 0, result.stderr
    assert "wrote 2 tfrecord files" in result.stdout
    listed = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix="resnet/")  # type: ignore[attr-defined]
    assert sorted(o["Size"] for o in listed["Contents"]) == [3 * 114_660, 3 * 114_660]
