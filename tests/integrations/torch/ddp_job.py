"""One rank of a two-process DDP job over the /data mount: it builds its datasets and sampler
before `init_process_group`, as training scripts do, then reads one epoch through each with an
all_reduce per step, as DDP's gradient sync does, and writes what it read to OUT:
`python -m tests.integrations.torch.ddp_job INIT_FILE RANK OUT`."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from gpufeed.integrations.torch import FeedDataset, FeedIterableDataset, FeedSampler
from tests.integrations.torch.helpers import decode

WORLD = 2
SEED = 7


def steps(loader: Iterable[torch.Tensor]) -> dict[str, list[int]]:
    """Every index read, and the all_reduce result of each step (WORLD when all ranks took part)."""
    indices, reduced = [], []
    for batch in loader:
        indices += batch.tolist()
        grad = torch.ones(1)
        dist.all_reduce(grad)
        reduced.append(int(grad))
    return {"indices": indices, "reduced": reduced}


def main(init_file: Path, rank: int, out: Path) -> None:
    data = FeedDataset("/data", transform=decode)
    sampler = FeedSampler(data, seed=SEED)
    stream = FeedIterableDataset("/data", transform=decode, shuffle=True, seed=SEED)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
    try:
        report = {
            "sampler": {"len": len(sampler), **steps(DataLoader(data, batch_size=4, sampler=sampler, num_workers=2))},
            "stream": {"len": len(stream), **steps(DataLoader(stream, batch_size=4, num_workers=2))},
        }
    finally:
        dist.destroy_process_group()
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
