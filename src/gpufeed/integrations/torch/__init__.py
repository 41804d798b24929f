"""PyTorch datasets and a sampler over the gpufeed namespace.

    dataset = FeedDataset("/data/train", transform=decode)
    sampler = FeedSampler(dataset, seed=0)          # prefetches what the epoch reads next
    loader = FeedLoader(dataset, batch_size=32, sampler=sampler, num_workers=4)
    sampler.load_state_dict(checkpoint["sampler"])  # when resuming
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...
            checkpoint["sampler"] = sampler.state_dict()
"""

from __future__ import annotations

from gpufeed.integrations.torch.dataset import FeedDataset, FeedIterableDataset
from gpufeed.integrations.torch.distributed import rank_and_world
from gpufeed.integrations.torch.labels import FolderLabels
from gpufeed.integrations.torch.loader import FeedLoader
from gpufeed.integrations.torch.order import Shard, epoch_permutation
from gpufeed.integrations.torch.sampler import FeedSampler
from gpufeed.shuffle import block_permutation

__all__ = [
    "FeedDataset",
    "FeedIterableDataset",
    "FeedLoader",
    "FeedSampler",
    "FolderLabels",
    "Shard",
    "block_permutation",
    "epoch_permutation",
    "rank_and_world",
]
