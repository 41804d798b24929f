"""Ends a leased command's whole process group, and outlives its runner to do so.

PR_SET_PDEATHSIG reaches only the runner's direct child, and Ray kills a dead worker's children
with it: when the runner dies (its actor killed as the lease ends, `gpu run` interrupted or
killed), the command's own children (DataLoader workers, ranks, a shell's background jobs)
would keep running, and keep the GPU, after the lease is freed. `python reaper.py GRACE FD`
starts before the command, leaves the runner's children at once (a second fork, in a session of
its own) and reads FD, the read end of a pipe only the runner and the command's first process
write: that process writes its group id (`"<pid>\n"`) before it runs the command, so no moment
exists where the command runs unwatched (a reaper started after it was killed with its runner, on
a loaded node, and left the command's children running). Then a byte is the runner saying the
group is ended; the end of the pipe without one is the runner's death (the kernel closes its
end), and the group is then ended as the runner would: SIGTERM, SIGKILL to what is left after
GRACE seconds. It imports nothing of gpufeed, and runs as a script: it starts with every leased
command.
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
    grace, watch = float(sys.argv[1]), int(sys.argv[2])
    if os.fork():
        os._exit(0)
    with os.fdopen(watch, "rb", buffering=0) as pipe:
        group = pipe.readline()
        if group.endswith(b"\n") and pipe.read(1) == b"":
            end_group(int(group), grace)


if __name__ == "__main__":
    main()
