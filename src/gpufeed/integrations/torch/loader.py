"""FeedLoader: a DataLoader that tells its FeedSampler what the training loop consumed.

A batch counts as consumed when the loader hands it to the loop, so a checkpoint taken while
processing batch b resumes at batch b+1, however many batches the workers had read ahead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch.utils.data

from gpufeed.errors import InvalidArgument
from gpufeed.integrations.torch.sampler import FeedSampler


class FeedLoader(torch.utils.data.DataLoader):
    """`torch.utils.data.DataLoader` with a FeedSampler, every argument as there;
    `sampler.state_dict()` then reflects exactly the batches this loader handed out."""

    def __init__(self, dataset: Any, batch_size: int | None = 1, *, sampler: FeedSampler, **kwargs: Any) -> None:
        if not isinstance(sampler, FeedSampler):
            raise InvalidArgument(f"FeedLoader needs sampler=FeedSampler(...), not {type(sampler).__name__}")
        if "batch_sampler" in kwargs:
            raise InvalidArgument("FeedLoader batches with batch_size; a batch_sampler would hide what was consumed")
        super().__init__(dataset, batch_size, sampler=sampler, **kwargs)
        sampler.mark_consumed(0)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        per_batch = self.batch_size or 1
        sampler: FeedSampler = self.sampler  # type: ignore[assignment]
        for batch in super().__iter__():
            sampler.mark_consumed(per_batch)
            yield batch
