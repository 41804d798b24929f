"""`gpufeed.torch`: the PyTorch side of gpufeed under one short name. Datasets, the sampler and
the loader (`gpufeed.integrations.torch`), and checkpoints: DCP storage for gpufeed paths, a
directory of checkpoints with retention, and `save`/`load` for plain `torch.save` users.

    import gpufeed.torch
    gpufeed.torch.save(model.state_dict(), "/ckpt/model.pt")
    checkpoints = gpufeed.torch.Checkpoints("/ckpt/run1", keep_last=3)
    checkpoints.async_save({"model": model, "optim": optimizer}, step)
"""

from __future__ import annotations

from gpufeed.integrations.torch import (
    FeedDataset,
    FeedIterableDataset,
    FeedLoader,
    FeedSampler,
    FolderLabels,
    Shard,
    block_permutation,
    epoch_permutation,
    rank_and_world,
)
from gpufeed.integrations.torch.checkpoint import GpufeedReader, GpufeedWriter, load, save
from gpufeed.integrations.torch.checkpoint_dir import Checkpoint, Checkpoints

__all__ = [
    "Checkpoint",
    "Checkpoints",
    "FeedDataset",
    "FeedIterableDataset",
    "FeedLoader",
    "FeedSampler",
    "FolderLabels",
    "GpufeedReader",
    "GpufeedWriter",
    "Shard",
    "block_permutation",
    "epoch_permutation",
    "load",
    "rank_and_world",
    "save",
]
