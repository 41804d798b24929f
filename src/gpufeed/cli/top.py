"""`gpufeed top`: what the node's readers get from the cache and the store, live.

Two `Usage` counts from the agent, `--interval` apart, make the rates: per mount the hit ratio,
MB/s from the cache and from the store, and stall % (seconds reads waited on misses per second,
summed over readers: 100 % is one reader waiting all the time); the cache's use against its
limit; prefetch queued, samples and blocks ahead, and lead (mean seconds from a prefetched block landing to
its first read, over the interval); the reading processes by pid. Readers report their hits every
2 s or 512 hits, so a rate over a shorter interval moves in steps.
"""

from __future__ import annotations

import os
import time
from typing import Any

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from gpufeed.cli.console import human_bytes, out, print_json
from gpufeed.cli.metrics import running_agent
from gpufeed.client.connection import AgentClient
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument
from gpufeed.rpc.messages import MountUsage, ReaderUsage, Usage, UsageInfo

TOP_READERS = 10
MB = 1e6


def _ratio(hits: int, misses: int) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return "?"
    return " ".join(" ".join(w.decode(errors="replace").split()) for w in words if w)[:60]  # a `python -c` script's newlines too


def snapshot(before: UsageInfo, after: UsageInfo, agent_pid: int) -> dict[str, Any]:
    """Rates over the time between two counts, and the totals: what `--json` prints."""
    dt = max(after.time - before.time, 1e-9)
    earlier = {m.mount: m for m in before.mounts}
    mounts = []
    for m in after.mounts:
        p = earlier.get(m.mount) or MountUsage(m.mount, 0, 0, 0, 0, 0.0)
        hits, misses = m.hits - p.hits, m.misses - p.misses
        mounts.append({
            "mount": m.mount,
            "hit_ratio": _ratio(hits, misses),
            "hit_ratio_total": _ratio(m.hits, m.misses),
            "hits_per_s": hits / dt,
            "misses_per_s": misses / dt,
            "cache_mb_per_s": (m.hit_bytes - p.hit_bytes) / dt / MB,
            "store_mb_per_s": (m.miss_bytes - p.miss_bytes) / dt / MB,
            "stall_pct": 100 * (m.stall_s - p.stall_s) / dt,
            "hits": m.hits,
            "misses": m.misses,
            "hit_bytes": m.hit_bytes,
            "miss_bytes": m.miss_bytes,
            "stall_s": m.stall_s,
        })
    known = {r.pid: r for r in before.readers}
    readers: list[dict[str, Any]] = []
    for r in after.readers:
        if r.pid == os.getpid():
            continue  # this command's own connection
        q = known.get(r.pid) or ReaderUsage(r.pid, 0, 0, 0, 0.0)
        readers.append({
            "pid": r.pid,
            "command": _command(r.pid),
            "hits_per_s": (r.hits - q.hits) / dt,
            "cache_mb_per_s": (r.hit_bytes - q.hit_bytes) / dt / MB,
            "store_mb_per_s": (r.fetched_bytes - q.fetched_bytes) / dt / MB,
            "stall_pct": 100 * (r.stall_s - q.stall_s) / dt,
            "hits": r.hits,
            "stall_s": r.stall_s,
        })
    readers.sort(key=lambda r: (-(r["cache_mb_per_s"] + r["store_mb_per_s"]), -r["hits"], r["pid"]))
    leads = after.prefetch_leads - before.prefetch_leads
    return {
        "interval_s": dt,
        "agent_pid": agent_pid,
        "clients": after.clients,
        "cache": {
            "bytes": after.bytes,
            "limit": after.limit,
            "quota": after.quota,
            "blocks": after.blocks,
            "used_pct": 100 * after.bytes / after.limit if after.limit else None,
        },
        "prefetch": {
            "queued": after.prefetch_queued,
            "ahead_blocks": after.prefetch_ahead,
            "ahead_samples": after.prefetch_ahead_samples,
            "lead_s": (after.prefetch_lead_s - before.prefetch_lead_s) / leads if leads else None,
        },
        "mounts": mounts,
        "readers": readers[:TOP_READERS],
    }


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def render(shot: dict[str, Any]) -> Group:
    cache = shot["cache"]
    used = f" ({cache['used_pct']:.0f} %)" if cache["used_pct"] is not None else ""
    prefetch = shot["prefetch"]
    lead = f", {prefetch['lead_s']:.2f} s lead" if prefetch["lead_s"] is not None else ""
    head = Text(
        f"agent {shot['agent_pid']} · cache {human_bytes(cache['bytes'])} of {human_bytes(cache['limit'])}{used}, "
        f"{cache['blocks']} blocks · {shot['clients']} connections · prefetch {prefetch['queued']} queued, "
        f"{prefetch['ahead_samples']:,} samples / {prefetch['ahead_blocks']} blocks ahead{lead} · over {shot['interval_s']:.1f} s"
    )
    mounts = Table("mount", "hit ratio", "hits/s", "cache MB/s", "store MB/s", "stall %", "hit ratio (all)", box=None)
    for m in shot["mounts"]:
        mounts.add_row(
            m["mount"], _percent(m["hit_ratio"]), f"{m['hits_per_s']:,.0f}", f"{m['cache_mb_per_s']:,.1f}",
            f"{m['store_mb_per_s']:,.1f}", f"{m['stall_pct']:.0f}", _percent(m["hit_ratio_total"]),
        )
    readers = Table("pid", "hits/s", "cache MB/s", "store MB/s", "stall %", "command", box=None)
    for r in shot["readers"]:
        readers.add_row(
            str(r["pid"]), f"{r['hits_per_s']:,.0f}", f"{r['cache_mb_per_s']:,.1f}", f"{r['store_mb_per_s']:,.1f}",
            f"{r['stall_pct']:.0f}", r["command"],
        )
    return Group(head, Text(""), mounts if shot["mounts"] else Text("no reads yet"), Text(""), readers)


def top(
    interval: float = typer.Option(1.0, "--interval", help="Seconds between the two counts a rate is made of."),
    once: bool = typer.Option(False, "--once", help="Print one view and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (one object a line; with --once, one object)."),
) -> None:
    """Live view of the node agent: hit ratio, MB/s from cache and store, stall %, cache use,
    prefetch, top readers (exit 1 when no agent runs)."""
    if not 0.05 <= interval <= 3600:
        raise InvalidArgument(f"--interval {interval}: expected seconds between 0.05 and 3600")
    agent = running_agent(Settings.from_env())
    pid = agent.stats(start=False).pid
    before = _usage(agent)
    try:
        if out.is_terminal and not (once or as_json):
            with Live(console=out, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    after = _usage(agent)
                    live.update(render(snapshot(before, after, pid)), refresh=True)
                    before = after
        while True:  # --once, --json, or not a terminal: one view per interval, printed
            time.sleep(interval)
            after = _usage(agent)
            shot = snapshot(before, after, pid)
            if as_json:
                print_json(shot)
            else:
                out.print(render(shot))
            if once:
                return
            before = after
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a live view ends


def _usage(agent: AgentClient) -> UsageInfo:
    return agent.request(Usage(), UsageInfo, start=False)
