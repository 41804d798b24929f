"""A GPU pool on Ray: share GPUs by fractions of compute and memory, queue with priorities and
team quotas, reclaim idle and dead leases, use a GPU remotely, aggregate GPUs across nodes.

Needs the `pool` extra (Ray). Modules: `inventory` (what a node has), `ledger` (queue, quotas,
packing), `scheduler` (the Ray actor that owns lease state), `launcher` and `watchdog`
(enforcement on the node), `runner` (the actors that hold a lease), `client` (`gpufeed gpu`),
`remote`, `placement` (the data-aware placement seam).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpufeed.pool.remote import Remote

__all__ = ["remote"]


def remote(target: Any, **options: Any) -> Remote:
    """Host `target` on a pooled GPU; see `gpufeed.pool.remote.remote`."""
    from gpufeed.pool.remote import remote as _remote

    return _remote(target, **options)
