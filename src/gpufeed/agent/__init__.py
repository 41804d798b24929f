"""The node agent: the one process that writes a cache dir.

Its parts, each testable without a socket: `service` (socket, handshake, dispatch), `fetcher`
(BlockId → bytes through disk, peers, store; single flight; checks before publish), `manager`
(cache contents, quota, eviction, repair), `sessions` (prefetch sessions, pins, hit reports),
`metrics` (counters). Readers talk to it through `gpufeed.client.connection`; it starts from its
own entry point, `python -m gpufeed.agent`, which loads no CLI.
"""
