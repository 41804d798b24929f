"""Which nodes own a block: weighted rendezvous (highest random weight) hashing.

Every node computes the same owners from the same member list without asking anyone. A node
that joins takes about weight/total of the blocks from the others and a node that leaves hands
only its own blocks on: nothing else moves (unlike modulo hashing). Scores follow Schindelhauer
and Schomaker's weighted form, -weight / ln(u), u uniform in (0, 1) from a hash of (node, block).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

_SCALE = 2.0**-64


@dataclass(frozen=True, slots=True)
class Node:
    """A member as every other node sees it."""

    id: str
    address: str
    """HOST:PORT of its peer API."""
    weight: float = 1.0
    capacity: int = 0
    """Its cache limit in bytes (shown; weight is what ownership follows)."""


def _score(node: Node, key: str) -> float:
    u = (xxhash.xxh3_64_intdigest(f"{node.id}\0{key}".encode()) + 0.5) * _SCALE
    return -node.weight / math.log(u)


def owners(key: str, nodes: Sequence[Node], replicas: int = 1) -> list[Node]:
    """The `replicas` nodes that own `key` (a block name), the first one first."""
    if replicas == 1:
        best = max(nodes, key=lambda node: _score(node, key), default=None)
        return [] if best is None else [best]
    return sorted(nodes, key=lambda node: _score(node, key), reverse=True)[:replicas]
