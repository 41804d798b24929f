"""`gpufeed top`: what the node's readers get from the cache and the store, live.

Two counts from the agent, `--interval` apart, make the rates: per mount the hit ratio, MB/s
from the cache and from the store (and, on a node of a cache cluster, from peers apart from the
store's), and stall % (seconds reads waited on misses per second, summed over readers: 100 % is
one reader waiting all the time); the cache's use against its limit; prefetch queued, samples
and blocks ahead, and lead (mean seconds from a prefetched block landing to its first read, over
the interval); the reading processes by pid. Readers report their hits every 2 s or 512 hits,
so a rate over a shorter interval moves in steps.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, NamedTuple

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from gpufeed.cli.console import counted, out, print_json
from gpufeed.cli.metrics import running_agent
from gpufeed.config import Settings, human_bytes
from gpufeed.errors import InvalidArgument
from gpufeed.rpc.messages import Metrics, MetricsText, MountUsage, ReaderUsage, Usage, UsageInfo

if TYPE_CHECKING:
    from gpufeed.client.connection import AgentClient

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


class Count(NamedTuple):
    """What the agent had counted at one moment."""

    usage: UsageInfo
    peer_bytes: dict[str, int]
    """Mount → of its `miss_bytes`, the bytes fetched from cache-cluster peers (the rest came from
    the store), from the agent's `gpufeed_miss_bytes_total{tier="peer"}`."""


def snapshot(before: Count, after: Count, agent_pid: int) -> dict[str, Any]:
    """Rates over the time between two counts, and the totals: what `--json` prints. A mount's
    `miss_bytes` are what the agent fetched for it, `store_bytes` and `peer_bytes` where from."""
    dt = max(after.usage.time - before.usage.time, 1e-9)
    earlier = {m.mount: m for m in before.usage.mounts}
    mounts = []
    for m in after.usage.mounts:
        p = earlier.get(m.mount) or MountUsage(m.mount, 0, 0, 0, 0, 0.0)
        hits, misses = m.hits - p.hits, m.misses - p.misses
        peer, peer_before = after.peer_bytes.get(m.mount, 0), before.peer_bytes.get(m.mount, 0)
        mounts.append({
            "mount": m.mount,
            "hit_ratio": _ratio(hits, misses),
            "hit_ratio_total": _ratio(m.hits, m.misses),
            "hits_per_s": hits / dt,
            "misses_per_s": misses / dt,
            "cache_mb_per_s": (m.hit_bytes - p.hit_bytes) / dt / MB,
            "store_mb_per_s": max(0, (m.miss_bytes - peer) - (p.miss_bytes - peer_before)) / dt / MB,
            "peer_mb_per_s": (peer - peer_before) / dt / MB,
            "stall_pct": 100 * (m.stall_s - p.stall_s) / dt,
            "hits": m.hits,
            "misses": m.misses,
            "hit_bytes": m.hit_bytes,
            "miss_bytes": m.miss_bytes,
            "store_bytes": m.miss_bytes - peer,
            "peer_bytes": peer,
            "stall_s": m.stall_s,
        })
    known = {r.pid: r for r in before.usage.readers}
    readers: list[dict[str, Any]] = []
    for r in after.usage.readers:
        if r.pid == os.getpid():
            continue  # this command's own connection
        q = known.get(r.pid) or ReaderUsage(r.pid, 0, 0, 0, 0.0)
        readers.append({
            "pid": r.pid,
            "command": _command(r.pid),
            "hits_per_s": (r.hits - q.hits) / dt,
            "cache_mb_per_s": (r.hit_bytes - q.hit_bytes) / dt / MB,
            "fetched_mb_per_s": (r.fetched_bytes - q.fetched_bytes) / dt / MB,
            "stall_pct": 100 * (r.stall_s - q.stall_s) / dt,
            "hits": r.hits,
            "stall_s": r.stall_s,
        })
    readers.sort(key=lambda r: (-(r["cache_mb_per_s"] + r["fetched_mb_per_s"]), -r["hits"], r["pid"]))
    was, now = before.usage, after.usage
    leads = now.prefetch_leads - was.prefetch_leads
    return {
        "interval_s": dt,
        "agent_pid": agent_pid,
        "clients": now.clients,
        "cache": {
            "bytes": now.bytes,
            "limit": now.limit,
            "quota": now.quota,
            "blocks": now.blocks,
            "used_pct": 100 * now.bytes / now.limit if now.limit else None,
        },
        "prefetch": {
            "queued": now.prefetch_queued,
            "ahead_blocks": now.prefetch_ahead,
            "ahead_samples": now.prefetch_ahead_samples,
            "lead_s": (now.prefetch_lead_s - was.prefetch_lead_s) / leads if leads else None,
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
        f"{counted(cache['blocks'], 'block')} · {counted(shot['clients'], 'connection')} · prefetch {prefetch['queued']} queued, "
        f"{prefetch['ahead_samples']:,} samples / {prefetch['ahead_blocks']} blocks ahead{lead} · over {shot['interval_s']:.1f} s"
    )
    peers = any(m["peer_bytes"] for m in shot["mounts"])  # a column only on a node that read from peers
    mounts = Table(
        "mount", "hit ratio", "hits/s", "cache MB/s", "store MB/s", *(["peer MB/s"] if peers else []), "stall %",
        "hit ratio (all)", box=None,
    )
    for m in shot["mounts"]:
        mounts.add_row(
            m["mount"], _percent(m["hit_ratio"]), f"{m['hits_per_s']:,.0f}", f"{m['cache_mb_per_s']:,.1f}",
            f"{m['store_mb_per_s']:,.1f}", *([f"{m['peer_mb_per_s']:,.1f}"] if peers else []), f"{m['stall_pct']:.0f}",
            _percent(m["hit_ratio_total"]),
        )
    readers = Table("pid", "hits/s", "cache MB/s", "fetched MB/s", "stall %", "command", box=None)
    for r in shot["readers"]:
        readers.add_row(
            str(r["pid"]), f"{r['hits_per_s']:,.0f}", f"{r['cache_mb_per_s']:,.1f}", f"{r['fetched_mb_per_s']:,.1f}",
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
            from rich.live import Live

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


def _usage(agent: AgentClient) -> Count:
    """The agent's counts now. Its metrics are asked first, so the peer bytes never exceed the
    fetched bytes in the usage counted just after."""
    from prometheus_client.parser import text_string_to_metric_families

    text = agent.request(Metrics(), MetricsText, start=False).text
    peer = {
        sample.labels["mount"]: int(sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "gpufeed_miss_bytes"
        for sample in family.samples
        if sample.labels.get("tier") == "peer"
    }
    return Count(agent.request(Usage(), UsageInfo, start=False), peer)
