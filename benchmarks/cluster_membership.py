"""What membership costs the cluster's Redis: N simulated members heartbeat once a second
through the real `Membership` class against a fresh redis-server, for --seconds; the server's
own CPU (INFO cpu) and command count per heartbeat are measured, then scaled to 1,000 nodes.

    python benchmarks/cluster_membership.py [--members 300] [--seconds 10] [--churn 0.01]

--churn is the fraction of members that leave and rejoin each second (restarts, preemption),
which makes every member read the member list again.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

from gpufeed.bench.children import free_port, helper
from gpufeed.cluster.membership import Membership
from gpufeed.cluster.ownership import Node


async def measure(url: str, members: int, seconds: float, churn: float) -> tuple[float, float, int]:
    nodes = [Membership(url, Node(f"node{i:04d}", f"10.0.{i // 250}.{i % 250}:7070", 1.0, 1 << 40), dict) for i in range(members)]
    for node in nodes:
        await node.join()
    probe = aioredis.Redis.from_url(url)
    before = await probe.info("cpu"), (await probe.info("stats"))["total_commands_processed"]
    beats = 0
    rng = random.Random(0)
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        tick = time.monotonic()
        for node in rng.sample(nodes, int(churn * members)):
            await node.leave()
            node.redis = aioredis.Redis.from_url(url, decode_responses=True)
            await node.join()
        await asyncio.gather(*(node.beat() for node in nodes))
        beats += members
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    after = await probe.info("cpu"), (await probe.info("stats"))["total_commands_processed"]
    cpu = sum(after[0][k] - before[0][k] for k in ("used_cpu_sys", "used_cpu_user"))
    assert all(len(node.nodes) == members for node in nodes), "every member sees every other"
    for node in nodes:
        await node.leave()
    await probe.aclose()
    return cpu, after[1] - before[1], beats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--churn", type=float, default=0.01)
    args = parser.parse_args()
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="gpufeed-membership-"))
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)]
    try:
        with helper(argv, "redis-server", work / "redis.log", port=port):
            cpu, commands, beats = asyncio.run(measure(f"redis://127.0.0.1:{port}/0", args.members, args.seconds, args.churn))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    per_beat_us = cpu / beats * 1e6
    print(f"{args.members} members, {beats:,} heartbeats in {args.seconds:g} s, churn {args.churn:.0%}/s")
    print(f"redis CPU per heartbeat {per_beat_us:.1f} us, commands per heartbeat {commands / beats:.1f}")
    print(f"scaled to 1,000 nodes at 1 heartbeat/s: {per_beat_us * 1000 / 1e6:.1%} of one Redis core, "
          f"{commands / beats * 1000:,.0f} commands/s")


if __name__ == "__main__":
    main()
