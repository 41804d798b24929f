"""The crash tests' saver: imports torch once, then for each first step read from stdin forks a
child that saves checkpoints step after step (`Checkpoints.save`, keep_last=2) and prints
`saved N` once each save returned. The test kills the child (and the agent) with SIGKILL at
random points; forking spares a torch import per round."""

from __future__ import annotations

import os
import sys

import torch

from gpufeed.integrations.torch.checkpoint_dir import Checkpoints


def state(step: int) -> dict[str, object]:
    """What step `step` saves: 1 MiB in two tensors and a plain value, a pure function of the step."""
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 1000, generator=generator), "b": torch.randn(6144, generator=generator), "step": step}


def save_from(root: str, step: int) -> None:
    checkpoints = Checkpoints(root, keep_last=2)
    while True:
        checkpoints.save(state(step), step)
        print(f"saved {step}", flush=True)
        step += 1


def main() -> None:
    root = sys.argv[1]
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                save_from(root, int(line))
            except BaseException as exc:  # the agent was killed under it: report, then end
                print(f"failed {type(exc).__name__}", flush=True)
            finally:
                os._exit(code)
        print(f"child {pid}", flush=True)
        os.waitpid(pid, 0)
        print("ended", flush=True)


if __name__ == "__main__":
    main()
