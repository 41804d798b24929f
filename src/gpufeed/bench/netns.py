"""Separate hosts on one machine, for the cluster's tests and benchmark: network namespaces,
each joined to a bridge on the host by a veth pair (optionally shaped with `tc tbf`, so that
links, not this machine's cores, are the limit: `shaped_link`). Only addresses in a subnet of
its own are used; everything is removed after. Needs root."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Host:
    name: str
    """Its network namespace."""
    address: str
    link: str
    """Its end of the veth pair, inside the namespace."""

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def link_down(self) -> None:
        ip("-n", self.name, "link", "set", self.link, "down")

    def link_up(self) -> None:
        ip("-n", self.name, "link", "set", self.link, "up")


PURE_ACK = ["match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0",
            "match", "u16", "0x0000", "0xff80", "at", "2"]
"""A TCP packet under 128 bytes with a plain IP header: an ACK with no data (u32 offsets)."""


def shaped_link(device: str, link_mbit: float) -> list[list[str]]:
    """`tc` rules for one direction of a link: `tbf` at `link_mbit` with a 50 ms queue of data,
    and bare ACKs sent ahead of that queue. A single FIFO is not what a real link does with
    traffic both ways: the ACKs of one direction waited up to 50 ms behind the other's data, so
    whichever node happened to send more slowed the other's downloads, and a plain HTTP download
    got 5.5-6.0 MB/s of 6.25 depending on the run (6.0 both ways, every run, with the ACKs first)."""
    return [
        ["qdisc", "add", "dev", device, "root", "handle", "1:", "tbf", "rate", f"{link_mbit}mbit", "burst", "256kb",
         "latency", "50ms"],
        ["qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", "htb", "default", "20"],
        ["class", "add", "dev", device, "parent", "10:", "classid", "10:10", "htb", "rate", "10gbit", "quantum", "60000",
         "prio", "0"],
        ["class", "add", "dev", device, "parent", "10:", "classid", "10:20", "htb", "rate", "10gbit", "quantum", "60000",
         "prio", "1"],
        ["qdisc", "add", "dev", device, "parent", "10:20", "bfifo", "limit", f"{int(link_mbit * 1e6 / 8 * 0.05)}"],
        ["filter", "add", "dev", device, "parent", "10:", "protocol", "ip", "prio", "10", "u32", *PURE_ACK,
         "flowid", "10:10"],
    ]


@contextmanager
def bridged_hosts(count: int, link_mbit: float | None = None) -> Iterator[tuple[str, list[Host]]]:
    """`count` hosts and the host machine's address on their bridge; with `link_mbit`, each
    host's link sends and receives at most that many Mbit/s."""
    tag = f"{os.getpid() % 10000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    bridge = f"gfbr{tag}"
    hosts = [Host(f"gfns{tag}-{i}", f"{subnet}.{10 + i}", f"gfp{tag}-{i}"[:15]) for i in range(count)]
    try:
        ip("link", "add", bridge, "type", "bridge")
        ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for i, host in enumerate(hosts):
            outside = f"gfv{tag}-{i}"[:15]
            ip("netns", "add", host.name)
            ip("link", "add", outside, "type", "veth", "peer", "name", host.link)
            ip("link", "set", host.link, "netns", host.name)
            ip("link", "set", outside, "master", bridge)
            ip("link", "set", outside, "up")
            ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.link)
            ip("-n", host.name, "link", "set", host.link, "up")
            ip("-n", host.name, "link", "set", "lo", "up")
            if link_mbit:
                for side in (["tc"], ["ip", "netns", "exec", host.name, "tc"]):
                    for rule in shaped_link(outside if side == ["tc"] else host.link, link_mbit):
                        subprocess.run([*side, *rule], check=True, capture_output=True, timeout=30)
        yield f"{subnet}.1", hosts
    finally:
        for i, host in enumerate(hosts):
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", f"gfv{tag}-{i}"[:15]], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)
