"""Which rank this process is, asked when iteration starts: a dataset or sampler is often built
before `init_process_group` runs, and reading the rank then silently turns sharding off."""

from __future__ import annotations

import os

import torch.distributed as dist

from gpufeed.errors import InvalidArgument


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(f"environment variable {name}={value!r}: expected an integer") from None


def rank_and_world() -> tuple[int, int]:
    """(rank, world size): torch.distributed when it is initialised, else RANK and WORLD_SIZE
    from the environment (torchrun sets them), else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if world < 1 or not 0 <= rank < world:
        raise InvalidArgument(f"RANK={rank} WORLD_SIZE={world}: need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE")
    return rank, world
