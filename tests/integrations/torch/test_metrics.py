"""The agent's metrics count what DataLoader workers read: their hits and stalls reach the agent
with their hit reports (a worker exits without atexit handlers), so the counts are exact."""

from __future__ import annotations

import time
from pathlib import Path

from torch.utils.data import DataLoader

from gpufeed.integrations.torch import FeedDataset, FeedSampler
from tests.agent.test_metrics import agent_metrics
from tests.integrations.torch.helpers import N, content, decode, mount_files


def test_cold_then_warm_epochs_in_two_workers_are_counted_exactly(tmp_path: Path) -> None:
    data = FeedDataset(mount_files(tmp_path), transform=decode)
    size = sum(len(content(i)) for i in range(N))
    warm_epochs = 2
    for _ in range(1 + warm_epochs):  # the first epoch is cold: every file a miss
        loader = DataLoader(data, batch_size=8, num_workers=2, collate_fn=list)
        assert sorted(i for batch in loader for i in batch) == list(range(N))
    seen = agent_metrics()
    disk, store = (("mount", "/data"), ("tier", "disk")), (("mount", "/data"), ("tier", "store"))
    assert seen[("gpufeed_misses_total", store)] == N
    assert seen[("gpufeed_miss_bytes_total", store)] == size
    assert seen[("gpufeed_hits_total", disk)] == warm_epochs * N
    assert seen[("gpufeed_hit_bytes_total", disk)] == warm_epochs * size
    assert seen[("gpufeed_stall_seconds_total", (("mount", "/data"),))] > 0  # the cold epoch waited on the agent


def test_prefetch_ahead_and_lead_are_counted(tmp_path: Path) -> None:
    import gpufeed

    data = FeedDataset(mount_files(tmp_path), transform=decode)
    indices = iter(FeedSampler(data))  # held: a dropped iterator ends (cancels) its prefetch
    first = next(indices)
    deadline = time.monotonic() + 10
    while agent_metrics()[("gpufeed_prefetch_ahead_blocks", ())] < N:  # every file prefetched, none read yet
        assert time.monotonic() < deadline, "the sampler did not prefetch every file"
        time.sleep(0.05)
    order = [first] + [next(indices) for _ in range(N - 1)]  # the iterator stays alive: its pins too
    assert sorted(data[i] for i in order) == list(range(N))
    gpufeed.client().hits.flush()  # the hits reach the agent while the session holds its pins
    seen = agent_metrics()
    assert seen[("gpufeed_prefetched_total", ())] == N
    assert seen[("gpufeed_prefetch_ahead_blocks", ())] == 0  # each read released its pin
    assert seen[("gpufeed_prefetch_lead_seconds_count", ())] == N and seen[("gpufeed_prefetch_lead_seconds_sum", ())] > 0
