"""A node's GPUs: from NVML when the driver answers, else a declared fake inventory.

The inventory becomes the node's Ray resources (`resources`), so Ray itself is where the pool
learns what each node has: one `gpufeed_gpu_<i>` resource of 1.0 per GPU (its compute share)
and one `gpufeed_gpu_<i>_mem` per GPU (its memory in MiB). Leases book both, so Ray never lets
two leases oversubscribe a GPU's share or memory, whoever else schedules on the cluster.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import xxhash

from gpufeed.errors import InvalidArgument

MIB = 1 << 20
SHARE = "gpufeed_gpu_{index}"
MEMORY = "gpufeed_gpu_{index}_mem"
_SHARE_RE = re.compile(r"gpufeed_gpu_(\d+)")
AGENT = "gpufeed_agent_{digest}"
_AGENT_RE = re.compile(r"gpufeed_agent_([0-9a-f]{16})")


@dataclass(frozen=True)
class Gpu:
    """One GPU of one node; `memory` in bytes."""

    node: str
    index: int
    memory: int
    name: str = "fake"

    @property
    def key(self) -> tuple[str, int]:
        return self.node, self.index


def fake(count: int, memory: int) -> list[Gpu]:
    """A declared inventory for machines without GPUs (tests, CI, planning)."""
    if count < 1:
        raise InvalidArgument(f"--fake-gpus {count}: expected at least 1")
    if memory < MIB:
        raise InvalidArgument(f"--fake-gpu-mem {memory}: expected at least 1MiB")
    return [Gpu("", i, memory) for i in range(count)]


def nvml_available() -> bool:
    """True when `nvidia-ml-py` is installed and the driver answers (false on CPU machines)."""
    try:
        import pynvml
    except ImportError:
        return False
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    return True


def detect() -> list[Gpu]:
    """This node's GPUs from NVML; empty when there is no driver or no `nvidia-ml-py`."""
    if not nvml_available():
        return []
    import pynvml

    gpus = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(handle)
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        gpus.append(Gpu("", i, memory, name.decode() if isinstance(name, bytes) else str(name)))
    return gpus


def utilisation(index: int) -> float | None:
    """The GPU's compute utilisation in [0, 1] from NVML, None without NVML."""
    if not nvml_available():
        return None
    import pynvml

    return float(pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(index)).gpu) / 100


def process_memory(index: int) -> dict[int, int]:
    """Bytes of GPU memory per pid on GPU `index` (NVML); empty without NVML."""
    if not nvml_available():
        return {}
    import pynvml

    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return {p.pid: int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}


def resources(gpus: list[Gpu]) -> dict[str, float]:
    """The custom resources a Ray node declares for these GPUs (`ray start --resources`)."""
    declared: dict[str, float] = {}
    for gpu in gpus:
        declared[SHARE.format(index=gpu.index)] = 1.0
        declared[MEMORY.format(index=gpu.index)] = float(gpu.memory // MIB)
    return declared


def from_resources(node: str, declared: dict[str, float]) -> list[Gpu]:
    """The GPUs a Ray node declared (inverse of `resources`)."""
    gpus = []
    for name in declared:
        match = _SHARE_RE.fullmatch(name)
        if match:
            index = int(match.group(1))
            gpus.append(Gpu(node, index, int(declared.get(MEMORY.format(index=index), 0)) * MIB))
    return sorted(gpus, key=lambda g: g.index)


def booking(index: int, share: float, memory: int) -> dict[str, float]:
    """The Ray resources one lease books on GPU `index`."""
    return {SHARE.format(index=index): share, MEMORY.format(index=index): float(-(-memory // MIB))}


def agent_marker(agent_id: str) -> dict[str, float]:
    """A resource nothing books that says which gpufeed agent (cache cluster node id) runs on a
    Ray node, so data-aware placement can tell nodes apart even when they share an address."""
    return {AGENT.format(digest=agent_digest(agent_id)): 1.0}


def agent_digest(agent_id: str) -> str:
    return xxhash.xxh3_64_hexdigest(agent_id.encode())


def marked_agent(declared: dict[str, float]) -> str | None:
    """The digest of the agent a Ray node declared with `agent_marker`, or None."""
    for name in declared:
        match = _AGENT_RE.fullmatch(name)
        if match:
            return match.group(1)
    return None
