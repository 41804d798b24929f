"""What the GPU pool costs: a remote call against a local one, and two jobs sharing a lease.

    python benchmarks/pool.py [--calls 2000] [--rounds 5] [--work 3.0] [--json]

Starts a one-node Ray cluster on this machine that declares one fake GPU (no GPU needed).

Remote call: a small model (a 3-layer MLP, batch 1, CPU) called directly, then through
`gpufeed.pool.remote` (a Ray actor on a 0.25 lease of the fake GPU, on loopback: arguments
and result through Ray), once with one actor call per call and once with `compiled=True` (a Ray
compiled graph). Each round times `--calls` calls of each, taking turns; the overhead is the
median over rounds of (remote - local) per call. Issue 18's goal: <= 0.8 ms.
Beside it, Ray's floor on this machine: an empty actor call (an int there and back).

Sharing: a CPU "job" (single-threaded matrix products for `--work` seconds' worth when alone)
run under `gpufeed gpu run`'s machinery alone on a 0.5 lease, then two such jobs at once on two
0.5 leases of the same fake GPU. Efficiency is the pair's throughput over twice the lone job's:
1.0 when sharing costs nothing, 0.5 when the two only took turns. On a fake GPU this measures the
pool's own overhead and the CPU the jobs contend for, not a GPU's.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import threading
import time
from typing import Any

import ray
import torch

from gpufeed.pool import inventory, remote
from gpufeed.pool.client import connect, run
from gpufeed.pool.ledger import Request

JOB = """
import sys, time, torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
start = time.perf_counter()
for _ in range(int(sys.argv[1])):
    a = torch.tanh(a @ a)
print(time.perf_counter() - start)
"""


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)]
    return torch.nn.Sequential(*layers).eval()


def per_call(fn: Any, x: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls


@ray.remote(num_cpus=0)
class Echo:
    """Ray's own floor: the cheapest actor call there is (an int there and back)."""

    def call(self, x: int) -> int:
        return x


def remote_overhead(calls: int, rounds: int, compiled: bool) -> dict[str, float]:
    local = model()
    x = torch.randn(1, 64)
    echo = Echo.remote()
    with torch.no_grad(), remote(local, gpu=0.25, pool="bench", compiled=compiled) as hosted:
        assert torch.equal(hosted(x), local(x))
        per_call(hosted, x, 200)
        local_s, remote_s, floor_s = [], [], []
        for _ in range(rounds):
            local_s.append(per_call(local, x, calls))
            remote_s.append(per_call(hosted, x, calls))
            floor_s.append(per_call(lambda i: ray.get(echo.call.remote(1)), x, calls))
    ray.kill(echo)
    overhead = statistics.median(r - loc for r, loc in zip(remote_s, local_s, strict=True))
    return {
        "ray_floor_ms": statistics.median(floor_s) * 1e3,
        "local_ms": statistics.median(local_s) * 1e3,
        "remote_ms": statistics.median(remote_s) * 1e3,
        "overhead_ms": overhead * 1e3,
        "ratio": statistics.median(remote_s) / statistics.median(local_s),
    }


def job(iterations: int, results: list[float]) -> None:
    out = io.BytesIO()
    outcome = run([sys.executable, "-c", JOB, str(iterations)], Request(0.5), pool="bench", output=out)
    assert outcome.exit_code == 0, out.getvalue()
    results.append(float(out.getvalue()))


def sharing(work: float) -> dict[str, float]:
    probe: list[float] = []
    job(50, probe)
    iterations = max(50, int(50 * work / probe[0]))
    alone: list[float] = []
    job(iterations, alone)
    pair: list[float] = []
    threads = [threading.Thread(target=job, args=(iterations, pair)) for _ in range(2)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    return {
        "iterations": iterations,
        "alone_s": alone[0],
        "pair_s": max(pair),
        "pair_wall_s": wall,
        "efficiency": alone[0] / max(pair),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", type=float, default=3.0, help="seconds one sharing job computes when alone")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ray.init(num_cpus=2, resources=inventory.resources(inventory.fake(1, 16 << 30)), include_dashboard=False,
             namespace="gpufeed", log_to_driver=False, logging_level="WARNING")
    try:
        connect()
        results = {
            "remote_call": remote_overhead(args.calls, args.rounds, compiled=False),
            "remote_call_compiled": remote_overhead(args.calls, args.rounds, compiled=True),
            "sharing": sharing(args.work),
        }
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for key, how in (("remote_call", "actor calls"), ("remote_call_compiled", "compiled graph")):
        call = results[key]
        print(f"remote call ({how}), MLP batch 1: local {call['local_ms']:.3f} ms, remote {call['remote_ms']:.3f} ms, "
              f"overhead {call['overhead_ms']:.3f} ms per call ({call['ratio']:.1f}x local; goal <= 0.8 ms over local); "
              f"Ray's floor here (an empty actor call): {call['ray_floor_ms']:.3f} ms")
    share = results["sharing"]
    print(f"sharing one fake GPU, 2 jobs x 0.5: alone {share['alone_s']:.2f} s, each of the pair {share['pair_s']:.2f} s "
          f"for the same work: efficiency {share['efficiency']:.2f} (1.0 = sharing is free, 0.5 = turns)")


if __name__ == "__main__":
    main()
