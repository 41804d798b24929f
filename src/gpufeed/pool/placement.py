"""Data-aware placement, the seam: among the nodes that fit a lease, put first the node whose
gpufeed agent holds most of the job's dataset cached.

The per-node cached fraction comes from the cluster (the cluster issue, not built yet: today each
agent knows only its own cache). Until then the pool runs with no hook and packs GPUs; once the
cluster can answer `cached(dataset) -> {node_id: fraction}`, the scheduler sets
`cached_first(cached)` as its ledger's `order`, and `Request.dataset` carries the job's dataset.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from gpufeed.pool.ledger import NodeOrder, Request

CachedFractions = Callable[[str], Mapping[str, float]]


def cached_first(cached: CachedFractions) -> NodeOrder:
    """A node order that ranks nodes by the cached fraction of the request's dataset, keeping
    the packing order among equals; requests naming no dataset keep the packing order."""

    def order(request: Request, nodes: Sequence[str]) -> Sequence[str]:
        if not request.dataset:
            return nodes
        fractions = cached(request.dataset)
        return sorted(nodes, key=lambda node: -fractions.get(node, 0.0))

    return order
