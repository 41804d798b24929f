"""What the launcher enforces, checked without Ray: the PyTorch memory cap shim, MPS variables,
the idle meter; the real-GPU check runs only where NVML answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufeed.pool import inventory
from gpufeed.pool.launcher import SHIM_DIR, lease_env
from gpufeed.pool.watchdog import IdleMeter, cpu_seconds, process_tree

GIB = 1 << 30
QUEUED = "import torch; print(any('exec_and_cap' in getattr(f, '__qualname__', '') for f, _ in torch.cuda._queued_calls))"


def python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=os.environ | env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr, done.stderr
    return done.stdout.strip()


def test_a_fractional_lease_queues_the_torch_memory_cap_for_cuda_init() -> None:
    env = lease_env([(1, 0.5, 20 * GIB, 80 * GIB)], mps=False)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["GPUFEED_GPU_MEM_FRACTION"] == "0.250000"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(SHIM_DIR)
    assert python(QUEUED, env) == "True"
    assert python(QUEUED, {}) == "False"


def test_the_shim_still_runs_the_sitecustomize_it_shadows(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE'] = 'ran'\n")
    env = lease_env([(0, 0.5, 40 * GIB, 80 * GIB)], mps=False)
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    assert python("import os; print(os.environ.get('OTHER_SITE'))", env) == "ran"


def test_a_whole_gpu_gets_no_cap_and_mps_limits_only_with_a_daemon() -> None:
    assert lease_env([(0, 1.0, 80 * GIB, 80 * GIB), (1, 1.0, 80 * GIB, 80 * GIB)], mps=False) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    env = lease_env([(3, 0.25, 20 * GIB, 80 * GIB)], mps=True)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"


def test_idle_means_no_work_since_the_last_busy_sample() -> None:
    meter = IdleMeter(started=0.0)
    assert meter.sample(0.0, 0.0, None) == 0.0
    assert meter.sample(1.0, 0.5, None) == 0.0  # half a CPU: busy
    assert meter.sample(3.0, 0.5, None) == 2.0  # no CPU time since
    assert meter.sample(4.0, 0.5, 0.5) == 0.0  # NVML says the GPU works


def test_cpu_time_counts_the_whole_process_tree() -> None:
    spin = "import time\nend = time.time() + 5\nwhile time.time() < end: pass"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"
    with subprocess.Popen([sys.executable, "-c", parent]) as proc:
        try:
            deadline = time.monotonic() + 10
            while cpu_seconds(process_tree(proc.pid)) < 0.5:  # the grandchild spins, the child waits
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
            assert cpu_seconds([proc.pid]) < 0.5
        finally:
            for pid in reversed(process_tree(proc.pid)):
                os.kill(pid, 9)


@pytest.mark.skipif(not inventory.nvml_available(), reason="no NVIDIA GPU here (NVML does not answer)")
def test_the_memory_cap_holds_on_a_real_gpu() -> None:
    total = inventory.detect()[0].memory
    env = lease_env([(0, 0.5, total // 4, total)], mps=False)
    take = "import sys, torch; torch.empty(int(torch.cuda.mem_get_info(0)[1] * float(sys.argv[1])), device='cuda')"
    over = subprocess.run([sys.executable, "-c", take, "0.1"], env=os.environ | env, capture_output=True, text=True, timeout=120)
    assert over.returncode != 0 and "out of memory" in over.stderr.lower()  # 0.1 x 4 bytes a float: 40 % > the 25 % cap
    assert subprocess.run([sys.executable, "-c", take, "0.025"], env=os.environ | env, timeout=120).returncode == 0
