"""gpufeed lease shim: caps a PyTorch job's CUDA memory at its lease.

On `PYTHONPATH` only for leased jobs (`gpufeed.pool.launcher`). When the job imports torch, the
cap (`GPUFEED_GPU_MEM_FRACTION` of each visible GPU) is queued to run as CUDA initialises, so a
job that never uses CUDA pays nothing. Any other `sitecustomize` on the path still runs. It
imports nothing of gpufeed: the job may run in another Python environment.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any


def gpufeed_memory_cap(torch: Any, fraction: float) -> None:
    for device in range(torch.cuda.device_count()):
        torch.cuda.set_per_process_memory_fraction(fraction, device)


class _TorchHook(importlib.abc.MetaPathFinder):
    """Wraps torch's loader once, to queue the cap after torch has loaded."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader, fraction = spec.loader, self.fraction
        exec_module = loader.exec_module

        def exec_and_cap(module: ModuleType) -> None:
            exec_module(module)
            module.cuda._lazy_call(lambda: gpufeed_memory_cap(module, fraction))

        loader.exec_module = exec_and_cap  # type: ignore[method-assign]
        return spec


def install(fraction: float) -> None:
    """Cap this process: now if torch is loaded (queued until CUDA initialises), else once it is."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.cuda._lazy_call(lambda: gpufeed_memory_cap(torch, fraction))
    else:
        sys.meta_path.insert(0, _TorchHook(fraction))


def leased_fraction() -> float:
    """`GPUFEED_GPU_MEM_FRACTION` when it caps anything (0 < f < 1), else 0."""
    try:
        fraction = float(os.environ.get("GPUFEED_GPU_MEM_FRACTION") or 0)
    except ValueError:
        return 0.0
    return fraction if 0 < fraction < 1 else 0.0


def _chain() -> None:
    """Run the next `sitecustomize` on the path, the one this shim shadows."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    me = sys.modules.pop(__name__)
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        sys.modules.setdefault(__name__, me)


if __name__ == "sitecustomize":  # loaded by the interpreter at start, not by `launcher.cap_this_process`
    if leased_fraction():
        install(leased_fraction())
    _chain()
