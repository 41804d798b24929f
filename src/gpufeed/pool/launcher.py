"""Start a leased command with the lease enforced as far as the platform allows.

- `CUDA_VISIBLE_DEVICES`: the job sees only its GPUs (every CUDA program honours it).
- Memory cap, PyTorch only: `GPUFEED_GPU_MEM_FRACTION` and the `shim/` directory first on
  `PYTHONPATH`. Its `sitecustomize` queues `torch.cuda.set_per_process_memory_fraction` to run
  when the job first initialises CUDA (`torch.cuda._lazy_call`), so the cap holds in every Python
  process the job starts (DataLoader workers, torchrun ranks) without touching the job's code and
  without initialising CUDA early; then it runs any other `sitecustomize` on the path. Chosen over
  `PYTHONSTARTUP` (interactive sessions only) and over an env the job must read (opt-in).
- MPS limits: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` and `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, only when
  an MPS control daemon runs on the node (the driver ignores them otherwise).
- The command runs in its own session; `stop` ends its whole process group, whatever is left
  of it when the command exits too. It gets SIGTERM when the runner dies (`PR_SET_PDEATHSIG`),
  and a reaper (`pool.reaper`, started before it) then ends its group as `stop` would, so a killed runner leaves
  none of the command's processes holding the GPU; one that left the group (`setsid`, a daemon)
  is not followed: that would take a cgroup per job.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

from gpufeed.pool import reaper
from gpufeed.pool.inventory import MIB
from gpufeed.pool.reaper import KILL_WAIT_S, POLL_S, end_group

SHIM_DIR = Path(__file__).with_name("shim")
OUTPUT_CHUNK = 256 << 10
_PR_SET_PDEATHSIG = 1


def mps_running() -> bool:
    """An MPS control daemon listens in its pipe directory."""
    pipe_dir = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    return (pipe_dir / "control").exists()


def lease_env(
    gpus: Sequence[tuple[int, float, int, int]], pythonpath: str | None = "", mps: bool | None = None
) -> dict[str, str]:
    """What to add to a job's environment on this node for holding `gpus` (index, share, leased
    bytes, GPU bytes each): the shim goes first on the job's `pythonpath`; None leaves it out
    (a Ray actor caps itself: `cap_this_process`)."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(index) for index, _, _, _ in gpus)}
    fraction = min(leased / total for _, _, leased, total in gpus)
    if fraction < 1:
        env["GPUFEED_GPU_MEM_FRACTION"] = f"{fraction:.6f}"
        if pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM_DIR), pythonpath) if p)
    if mps_running() if mps is None else mps:
        share = min(share for _, share, _, _ in gpus)
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, round(share * 100)))
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
            f"{ordinal}={leased // MIB}M" for ordinal, (_, _, leased, _) in enumerate(gpus)
        )
    return env


def cap_this_process() -> None:
    """Apply the lease's PyTorch memory cap to this (already running) process, with the shim's code."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("gpufeed_pool_shim", SHIM_DIR / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    shim = module_from_spec(spec)
    spec.loader.exec_module(shim)
    if shim.leased_fraction():
        shim.install(shim.leased_fraction())


def guard(grace: float) -> int:
    """Start the reaper that ends a command's process group if this process dies first, before
    the command (`spawn`); returns the pipe the command's first process names its group on, and
    this process says the group is ended on (`release`)."""
    watch, tell = os.pipe()  # not inherited by anything else this process starts: its death closes `tell`
    try:
        argv = [sys.executable, "-I", reaper.__file__, str(grace), str(watch)]  # no package to import
        subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(watch,),
                       start_new_session=True, check=True)
    except BaseException:
        os.close(tell)
        raise
    finally:
        os.close(watch)
    return tell


def spawn(argv: Sequence[str], env: dict[str, str], cwd: str | None, tell: int) -> subprocess.Popen[bytes]:
    """The command in a session of its own, stdout and stderr merged into one pipe for the runner
    to stream. Its first process, between fork and exec, asks for SIGTERM when the runner dies
    (`PR_SET_PDEATHSIG`) and names its group to the reaper on `tell` (from `guard`)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def watched() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        os.write(tell, b"%d\n" % os.getpid())

    return subprocess.Popen(
        list(argv),
        env=env,
        cwd=cwd if cwd and os.path.isdir(cwd) else None,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=watched,
    )


def release(tell: int) -> None:
    """Tell the reaper the command's group is ended: it exits without a signal sent. A reaper
    already gone (killed by an admin, the OOM killer) is no error: there is nothing left to end."""
    try:
        os.write(tell, b"x")
    except OSError:
        pass
    finally:
        os.close(tell)


def output(proc: subprocess.Popen[bytes], grace: float) -> Iterator[bytes]:
    """The command's output, whole lines gathered up to about OUTPUT_CHUNK bytes (each item crosses
    Ray as an object of its own: one a line made a chatty job's output lag minutes behind it), until
    its pipe closes. A process the command started in the background holds the pipe open after
    the command exits (`sh -c 'tensorboard & train'`): once the command has exited, what is left
    of its group is ended, so the lease ends with the command, not with its last background job.
    A process that left the group (setsid) and still holds the pipe is waited for KILL_WAIT_S,
    then let be."""
    assert proc.stdout is not None
    lines: queue.Queue[bytes | None] = queue.Queue()

    def pump(stdout: IO[bytes]) -> None:
        """Whole lines, read in bulk (a job blocked writing to a pipe drained a line at a time
        uses no CPU, and would look idle); a line longer than OUTPUT_CHUNK goes in pieces."""
        rest = b""
        while data := os.read(stdout.fileno(), OUTPUT_CHUNK):
            data = rest + data
            cut = data.rfind(b"\n") + 1 or (len(data) if len(data) >= OUTPUT_CHUNK else 0)
            if cut:
                lines.put(data[:cut])
            rest = data[cut:]
        if rest:
            lines.put(rest)
        lines.put(None)

    threading.Thread(target=pump, args=(proc.stdout,), name="gpufeed-job-output", daemon=True).start()
    ended_at = None
    while True:
        if ended_at is None and proc.poll() is not None:  # each turn: a background job may never fall silent
            stop(proc, grace)
            ended_at = time.monotonic()
        try:
            line = lines.get(timeout=POLL_S)
        except queue.Empty:
            if ended_at is not None and time.monotonic() - ended_at > KILL_WAIT_S:
                return
            continue
        if line is None:
            return
        chunk, size = [line], len(line)
        while size < OUTPUT_CHUNK:
            try:
                more = lines.get_nowait()
            except queue.Empty:
                break
            if more is None:
                yield b"".join(chunk)
                return
            chunk.append(more)
            size += len(more)
        yield b"".join(chunk)


def stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM to the command's process group, SIGKILL to what is left after `grace` seconds."""
    end_group(proc.pid, grace)
    proc.poll()
