"""Known answers: AU is compute / (compute + exposed I/O), and the report files are written.

One worker with prefetch makes the prediction simple: the worker reads a batch (its samples
all in flight at once, so about one store latency) while the accelerator computes the previous
one, so each step takes max(compute, latency) and AU = compute / max(compute, latency).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufeed.bench.modes import MODES
from gpufeed.bench.runner import BenchConfig, run_bench
from tests.bench.helpers import dataset, gpufeed, one_error_line, tiny

DIRECT = (MODES["direct"],)


def test_zero_latency_local_source_keeps_the_accelerator_busy(tmp_path: Path) -> None:
    # 100 ms steps: a loaded 2-core machine can take 10 ms to schedule the worker, which is not I/O
    work = tiny(samples=48, batch=4, compute=0.1)
    report = run_bench(BenchConfig(work, dataset(tmp_path, work), modes=DIRECT))
    (epoch,) = report.modes[0].epochs
    assert (epoch.mode, epoch.epoch, epoch.samples, epoch.steps) == ("direct", 1, 48, 12)
    assert epoch.au >= 0.9
    assert epoch.compute_s == pytest.approx(12 * 0.1)


def test_injected_latency_lowers_au_as_predicted(tmp_path: Path) -> None:
    # 50 ms of latency against 20 ms steps: a loaded machine's scheduling delays stay small beside both
    work = tiny(samples=48, batch=4, compute=0.02)
    report = run_bench(BenchConfig(work, dataset(tmp_path, work), modes=DIRECT, latency_ms=50))
    (epoch,) = report.modes[0].epochs
    latency = epoch.latency_mean_ms / 1000
    assert latency >= 0.050
    predicted = work.compute / max(work.compute, latency)  # about 0.4
    assert predicted < 0.6
    assert epoch.au == pytest.approx(predicted, rel=0.2)


def test_latency_hidden_behind_longer_compute_costs_no_au(tmp_path: Path) -> None:
    work = tiny(samples=32, batch=4, compute=0.15)  # reading a batch takes ~21 ms < 150 ms
    report = run_bench(BenchConfig(work, dataset(tmp_path, work), modes=DIRECT, latency_ms=20))
    (epoch,) = report.modes[0].epochs
    assert epoch.latency_p50_ms >= 20
    assert epoch.au >= 0.9


def test_copy_reads_the_source_once_then_trains_locally(tmp_path: Path) -> None:
    work = tiny(samples=24, batch=4, compute=0.01, epochs=2)
    report = run_bench(BenchConfig(work, dataset(tmp_path, work), modes=(MODES["copy"], MODES["direct"])))
    copy, direct = report.modes
    size = 24 * 114_660
    assert report.dataset_bytes == size and report.record_size == 114_660
    assert copy.setup_s > 0 and copy.setup_bytes == size
    assert [e.source_bytes for e in copy.epochs] == [0, 0]
    assert [e.source_bytes for e in direct.epochs] == [size, size]
    assert copy.source_bytes == size and direct.source_bytes == 2 * size


def test_cached_reads_the_source_in_epoch_one_only_and_stops_its_agent(tmp_path: Path) -> None:
    # 80 ms steps: a warm epoch's six (480 ms) leave 48 ms of waiting at 90 % busy, more than a
    # loaded 2-core machine's scheduling takes; 10 ms steps once fell under in CI, 40 ms under load
    work = tiny(samples=24, batch=4, compute=0.08, epochs=3, workers=2)
    others = _bench_agents()  # another run's on this machine, not this one's
    report = run_bench(BenchConfig(work, dataset(tmp_path / "data", work), modes=(MODES["cached"],), latency_ms=20))
    (cached,) = report.modes
    first, *warm = cached.epochs
    assert first.source_bytes == 24 * 114_660, "every block fetched once, across both workers"
    assert [e.source_bytes for e in warm] == [0, 0]
    assert all(e.latency_p50_ms < 20 for e in warm), "warm samples come from local disk"
    assert all(e.au >= 0.9 for e in warm)
    assert _bench_agents() - others == set(), "the run's private agent is gone"


def _bench_agents() -> set[Path]:
    return {p for p in Path("/proc").glob("[0-9]*") if b"gpufeed-bench-" in _cmdline(p) and b"agent" in _cmdline(p)}


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_getitem_reads_a_batch_one_sample_after_another(tmp_path: Path) -> None:
    work = tiny(samples=16, batch=4, compute=0.0)
    report = run_bench(BenchConfig(work, dataset(tmp_path, work), modes=(MODES["getitem"],), latency_ms=20))
    (epoch,) = report.modes[0].epochs
    assert epoch.latency_p50_ms >= 4 * 20, "each of a batch's 4 samples waits the store's latency in turn"
    assert epoch.source_bytes == 16 * 114_660


def test_local_reads_the_files_in_place_behind_an_emulated_store_for_its_own_epochs(tmp_path: Path) -> None:
    work = tiny(samples=16, batch=4, compute=0.0)
    config = BenchConfig(work, dataset(tmp_path, work), modes=(MODES["local"],), latency_ms=1000, mode_epochs={"local": 2})
    (local,) = run_bench(config).modes
    assert [e.epoch for e in local.epochs] == [1, 2]
    assert all(e.source_bytes == 0 and e.latency_p99_ms < 1000 for e in local.epochs), "no batch waited for the store"


def test_accelerators_step_in_lockstep(tmp_path: Path) -> None:
    work = tiny(samples=32, batch=4, compute=0.02, accelerators=2)
    report = run_bench(BenchConfig(work, dataset(tmp_path, work), modes=DIRECT))
    (epoch,) = report.modes[0].epochs
    assert (epoch.samples, epoch.steps) == (32, 4)


def test_cli_prints_table_and_json_and_writes_png(tmp_path: Path) -> None:
    work = tiny(samples=24)
    source = dataset(tmp_path / "data", work)
    result = gpufeed(
        "bench", "--workload", "resnet50", "--source", source, "--samples", "24", "--batch", "4",
        "--compute", "0.01", "--workers", "1", "--epochs", "2", "--latency-ms", "5",
        "--json", "--plot", str(tmp_path / "out.png"),
    )
    assert result.returncode == 0, result.stderr
    assert all(m in result.stderr for m in ("direct", "copy", "cached")) and "emulated remote: 5 ms" in result.stderr
    data = json.loads(result.stdout)  # stdout holds the JSON alone; the table went to stderr
    assert data["latency_ms"] == 5 and data["workload"]["name"] == "resnet50"
    results = data["results"]
    assert [(r["mode"], r["epoch"]) for r in results] == [
        (mode, epoch) for mode in ("direct", "copy", "cached") for epoch in (1, 2)
    ]
    assert all(0 < r["au"] <= 1 for r in results)
    assert {m["mode"] for m in data["modes"]} == {"direct", "copy", "cached"}
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_source_too_small_for_the_run_is_refused(tmp_path: Path) -> None:
    source = dataset(tmp_path, tiny(samples=8, samples_per_file=4))
    line = one_error_line(gpufeed("bench", "-w", "resnet50", "-s", source, "--samples", "16", "--samples-per-file", "4"), 2)
    assert f"{source}: has 2 files" in line and "needs 4" in line and "gpufeed bench generate" in line, "the source given"


def test_an_epoch_of_one_step_is_refused_not_reported_as_full_use(tmp_path: Path) -> None:
    """AU leaves the first step out: one step would be reported as an idle-free accelerator."""
    source = dataset(tmp_path, tiny(samples=8, samples_per_file=4))
    line = one_error_line(gpufeed("bench", "-w", "resnet50", "-s", source, "--samples", "8", "--samples-per-file", "4",
                                  "--batch", "8", "--mode", "direct"), 2)
    assert line == ("gpufeed: error: --samples 8: an epoch needs 2 steps of 1 × 8 samples or more (AU leaves the first "
                    "step out); give more samples or a smaller --batch")


def test_a_source_of_another_record_size_is_refused_with_the_way_out(tmp_path: Path) -> None:
    source = dataset(tmp_path, tiny(samples=8))  # one file of 8 records
    line = one_error_line(gpufeed("bench", "-w", "resnet50", "-s", source, "--samples", "16"), 2)
    assert "average 57,330 B" in line and "--samples-per-file 8" in line
    one_file_of_eight = gpufeed(
        "bench", "-w", "resnet50", "-s", source, "--samples", "4", "--samples-per-file", "8", "--batch", "2",
        "--compute", "0", "--workers", "1", "--epochs", "1", "--mode", "direct",
    )
    assert one_file_of_eight.returncode == 0, one_file_of_eight.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("-w", "resnet", "-s", "file:///tmp"), "unknown workload 'resnet' (valid: resnet50, unet3d, cosmoflow, bert"),
        (("-w", "bert", "-s", "file:///tmp", "--mode", "direct,warm"), "unknown mode warm (valid: direct, getitem, copy"),
        (("-w", "bert",), "--source URL is required"),
        (("-w", "bert", "-s", "file:///tmp", "--plot", "/no/such/dir/out.png"), "directory /no/such/dir does not exist"),
        (("-w", "bert", "-s", "https://example.com/x", "--latency-ms", "5", "--samples", "1"), "only plain http"),
    ],
)
def test_bad_input_is_one_line(args: tuple[str, ...], needle: str) -> None:
    assert needle in one_error_line(gpufeed("bench", *args), 2)
