"""Every message between a reader and the node agent, one class each, checked when decoded.

A request is one of `Request`; the agent answers each with one `Reply` (`Hits` may go one
way). Types are enforced by msgspec at decode time, so a malformed or foreign message is
refused as a whole instead of being half-read. Credentials travel in their own field, which
is never printed or logged.
"""

from __future__ import annotations

import msgspec

from gpufeed.sources.base import ObjectInfo


class SourceSpec(msgspec.Struct, frozen=True):
    """What rebuilds a store in the agent: the mount's URL and source options (no credentials)."""

    url: str
    options: dict[str, str]


class Credentials(msgspec.Struct, frozen=True):
    """A reader's own store credentials (same user only), so the agent fetches with its identity."""

    values: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"Credentials({len(self.values)} hidden)"


class ObjectWant(msgspec.Struct):
    """One object at one version (the manifest's record of it), and which of its blocks a
    request is about."""

    info: ObjectInfo
    check: bool
    """Whether fetches pin the version at the store (If-Match…); false on immutable mounts."""
    block_size: int
    blocks: list[int]
    repair: list[int] = []
    """Blocks the reader found damaged: discard and fetch again."""


class Group(msgspec.Struct):
    """The objects of one source."""

    source: SourceSpec
    objects: list[ObjectWant]
    credentials: Credentials = msgspec.field(default_factory=Credentials)


class Hello(msgspec.Struct, tag="hello"):
    """The first message on every connection: the agent refuses a reader of another protocol."""

    protocol: int


class Stats(msgspec.Struct, tag="stats"):
    pass


class Fetch(msgspec.Struct, tag="fetch"):
    """Demand reads: the reply comes once every block is published, known uncached, or failed."""

    groups: list[Group]


class Prefetch(msgspec.Struct, tag="prefetch"):
    """Blocks a job will read soon, in order; the reply comes at once. With `pin`, fetched blocks
    are not evicted until read or until the session ends."""

    session: str
    groups: list[Group]
    pin: bool = True


class Cancel(msgspec.Struct, tag="cancel"):
    session: str


class Hits(msgspec.Struct, tag="hits"):
    """Blocks read from disk since the last report, by `BlockId.name`, space-separated (cheap to
    encode). One way unless `reply`."""

    names: str
    reply: bool = False


class Clear(msgspec.Struct, tag="clear"):
    pass


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


Request = Hello | Stats | Fetch | Prefetch | Cancel | Hits | Clear | Shutdown


class AgentInfo(msgspec.Struct, tag="info"):
    """The agent's state: the reply to Hello and Stats."""

    pid: int
    dirs: list[str]
    protocol: int
    quota: int
    limit: int
    bytes: int
    blocks: int
    clients: int
    uptime_s: float
    pinned_bytes: int
    latency_ms: float
    hits: int
    misses: int
    bytes_fetched: int
    repairs: int
    evictions: int
    uncached: int
    prefetched: int
    prefetch_errors: int


class Failure(msgspec.Struct):
    """An error as the agent saw it: `code` is a `gpufeed.errors` code; `object` numbers the
    object in the request (across groups, in order) when the failure is about one."""

    code: str
    message: str
    object: int | None = None


class Fetched(msgspec.Struct, tag="fetched"):
    uncached: list[tuple[int, int]]
    """(object number, block index) the cache could not hold: the reader reads those itself."""
    failures: list[Failure]
    fetched: int
    """Bytes this request made the agent read from stores."""


class Queued(msgspec.Struct, tag="queued"):
    queued: int
    latency_s: float
    """How long a prefetched block takes from being asked for to being on disk, as the agent
    measures it (`Metrics.prefetch_s`): prefetch windows are sized from it."""


class Cleared(msgspec.Struct, tag="cleared"):
    removed_bytes: int


class Done(msgspec.Struct, tag="done"):
    pass


class Refused(msgspec.Struct, tag="refused"):
    """The request failed as a whole."""

    failure: Failure


Reply = AgentInfo | Fetched | Queued | Cleared | Done | Refused
