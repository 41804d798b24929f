"""A training job whose DataLoader worker is killed mid-epoch. Like a real job it checkpoints
the sampler's state (and, for the test, the samples it consumed) after every batch, until the
crash ends it: `python -m tests.integrations.torch.crashing_job CHECKPOINT MARKER CRASH_AT`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from gpufeed.integrations.torch import FeedDataset, FeedLoader, FeedSampler
from tests.integrations.torch.helpers import CrashOnce

SEED = 6


def main(checkpoint: Path, marker: Path, crash_at: int) -> None:
    data = FeedDataset("/data", transform=CrashOnce(crash_at, marker))
    sampler = FeedSampler(data, seed=SEED)
    seen: list[int] = []
    for batch in FeedLoader(data, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=True):
        seen += [int(i) for i in batch]
        checkpoint.with_suffix(".tmp").write_text(json.dumps({"sampler": sampler.state_dict(), "seen": seen}))
        os.replace(checkpoint.with_suffix(".tmp"), checkpoint)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
