"""Ends a leased command's whole process group, and outlives its runner to do so.

PR_SET_PDEATHSIG reaches only the runner's direct child, and Ray kills a dead worker's children
with it: when the runner dies (its actor killed as the lease ends, `gpu run` interrupted or
killed), the command's own children (DataLoader workers, ranks, a shell's background jobs)
would keep running, and keep the GPU, after the lease is freed. `python reaper.py GROUP GRACE FD`
leaves the runner's children at once (a second fork, in a session of its own)
and reads FD, the read end of a pipe only the runner can write: a byte is the runner saying its
command's group is ended; the end of the pipe without one is the runner's death (the kernel
closes its end), and GROUP is then ended as the runner would: SIGTERM, SIGKILL to what is left
after GRACE seconds. It imports nothing of gpufeed, and runs as a script: it starts with every
leased command.
"""

from __future__ import annotations

import os
import signal
import sys
import time

KILL_WAIT_S = 5.0
POLL_S = 0.05


def members(group: int) -> int:
    """Processes of `group` still running (zombies, which only wait to be reaped, not counted)."""
    alive = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        alive += fields[0] != "Z" and int(fields[2]) == group
    return alive


def end_group(group: int, grace: float) -> None:
    """SIGTERM to every process of `group`, SIGKILL to those left after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, KILL_WAIT_S)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while members(group):
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        else:
            return


def main() -> None:
    group, grace, watch = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    if os.fork():
        os._exit(0)
    if os.read(watch, 1) == b"":
        end_group(group, grace)


if __name__ == "__main__":
    main()
