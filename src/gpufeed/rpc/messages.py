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
    reads: list[int] = []
    """In a prefetch, how many of the job's coming reads need each of `blocks` (empty: one
    each): a pinned block is kept until that many are reported."""
    sums: bytes = b""
    """For an object whose listing names chunk sums (`ObjectInfo.sums_id`, a pack's shard): the
    listed sums of each of `blocks`, in order, which the agent checks the fetched bytes against.
    Only the wanted blocks' sums travel (128 bytes a 4 MiB block), never a whole shard's."""


class Group(msgspec.Struct):
    """The objects of one source."""

    source: SourceSpec
    objects: list[ObjectWant]
    credentials: Credentials = msgspec.field(default_factory=Credentials)
    mount: str = ""
    """The namespace path of the objects' mount: the agent counts by it (never by URL or options,
    which may hold secrets)."""
    owner_only: bool = False
    """The mount's `copies=owner-only`: in a cache cluster, blocks another node owns are kept
    here as copies that eviction takes first."""


class Hello(msgspec.Struct, tag="hello"):
    """The first message on every connection: the agent refuses a reader of another protocol."""

    protocol: int


class Stats(msgspec.Struct, tag="stats"):
    pass


class Fetch(msgspec.Struct, tag="fetch"):
    """Demand reads: the reply comes once every block is published, known uncached, or failed."""

    groups: list[Group]
    at_owners: bool = False
    """A cluster warmup: each block is fetched by its owner in the cache cluster and cached
    there only (this node keeps the blocks it owns), every owner at once."""


class Prefetch(msgspec.Struct, tag="prefetch"):
    """Blocks a job will read soon, in order; the reply comes at once. With `pin`, fetched blocks
    are not evicted until read or until the session ends."""

    session: str
    groups: list[Group]
    pin: bool = True
    ahead_samples: int = 0
    """Samples the job had asked for ahead of the one it consumes, when it sent this: the
    prefetch lead in samples (0: the sender does not count samples)."""


class RangeWant(msgspec.Struct, array_like=True):
    """Bytes [start, end) of the object numbered `object` in its request (across groups, in order)."""

    object: int
    start: int
    end: int


class ReadRanges(msgspec.Struct, tag="read_ranges"):
    """Object ranges read straight from their stores and handed back, never cached: for a reader
    that cannot reach a store itself (a forked DataLoader worker: obstore's runtime does not
    survive a fork) and reads around blocks or past a full cache. The groups name the objects;
    their `blocks` lists are empty."""

    groups: list[Group]
    ranges: list[RangeWant]


class Cancel(msgspec.Struct, tag="cancel"):
    session: str


class Served(msgspec.Struct, array_like=True):
    """What one process's reads of one mount did since its last report: hits it served from the
    cache itself, their bytes, the wall time its reads spent waiting on misses (stall), and the
    reads it made of the store itself, past the cache (a mount with cache=off, a full cache,
    `verify`), and their bytes."""

    mount: str
    hits: int
    hit_bytes: int
    stall_s: float
    direct: int = 0
    direct_bytes: int = 0


class Hits(msgspec.Struct, tag="hits"):
    """Blocks read from disk since the last report, by `BlockId.name`, space-separated (cheap to
    encode), and what the reads did per mount. One way unless `reply`."""

    names: str
    reply: bool = False
    served: list[Served] = []
    read: str = ""
    """Blocks read another way (fetched for the read, or read around), one name per piece read:
    counted against prefetch announcements, not as hits."""


class Clear(msgspec.Struct, tag="clear"):
    pass


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Metrics(msgspec.Struct, tag="metrics"):
    """The agent's metrics in Prometheus' text format (what its HTTP endpoint serves)."""


class Usage(msgspec.Struct, tag="usage"):
    """The counts `gpufeed top` turns into rates: per mount, per reading process, the cache."""


class Commit(msgspec.Struct, tag="commit"):
    """A file a writer closed: its bytes are the file `staged` in the agent's staging dir, which
    the writer filled and fsynced; the agent takes it over, records the object in the mount's
    manifest and uploads it. The reply comes once that is durable on this node (write-back), or
    with `sync` once the store has the object (write-through)."""

    source: SourceSpec
    mount: str
    key: str
    staged: str
    size: int
    sha256: str
    sync: bool = False
    credentials: Credentials = msgspec.field(default_factory=Credentials)


class Sync(msgspec.Struct, tag="sync"):
    """Wait until every upload under the namespace path `path` ("/": all) is in its store."""

    path: str
    since: float = 0.0
    """Wall-clock time the caller began waiting (0: now): failures from then on count, across the
    Syncs it sends again while uploads are still under way (`Synced.pending`)."""


class Remove(msgspec.Struct, tag="remove"):
    """Delete an object from a writable mount's store and manifest (a pending upload of it too)."""

    source: SourceSpec
    mount: str
    key: str
    credentials: Credentials = msgspec.field(default_factory=Credentials)


Request = (
    Hello | Stats | Fetch | Prefetch | ReadRanges | Cancel | Hits | Clear | Shutdown | Metrics | Usage | Commit | Sync | Remove
)


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
    direct_bytes: int
    """Of `bytes_fetched`, what readers read from stores themselves, past the cache (`Served.direct`)."""


class MetricsText(msgspec.Struct, tag="metrics_text"):
    text: str


class MountUsage(msgspec.Struct):
    """Totals since the agent started for one mount (label "other" past the label limit)."""

    mount: str
    hits: int
    hit_bytes: int
    misses: int
    miss_bytes: int
    stall_s: float


class ReaderUsage(msgspec.Struct):
    """Totals of one reading process connected now (by its pid, from SO_PEERCRED)."""

    pid: int
    hits: int
    hit_bytes: int
    fetched_bytes: int
    stall_s: float


class UsageInfo(msgspec.Struct, tag="usage_info"):
    time: float
    """The agent's monotonic clock when counted: rates are deltas over it."""
    bytes: int
    limit: int
    quota: int
    blocks: int
    clients: int
    prefetch_queued: int
    prefetch_ahead: int
    """Prefetched blocks not read yet: how far prefetch runs ahead, in blocks."""
    prefetch_lead_s: float
    prefetch_leads: int
    """Sum and count of prefetch leads (a prefetched block's first read after it landed)."""
    prefetch_ahead_samples: int
    """Samples the live prefetch sessions have asked for ahead of their consumers."""
    mounts: list[MountUsage]
    readers: list[ReaderUsage]


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


class RangeBytes(msgspec.Struct, tag="range_bytes"):
    """The reply to `ReadRanges`: each range's bytes, in the order asked (empty where it failed)."""

    parts: list[bytes]
    failures: list[Failure]


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


class Committed(msgspec.Struct, tag="committed"):
    info: ObjectInfo
    """The object as the manifest records it now."""
    uploaded: bool


class Synced(msgspec.Struct, tag="synced"):
    uploads: int
    """Uploads waited for."""
    failures: list[Failure]
    """Uploads that failed and are still retried (their staged bytes are kept), one per object."""
    pending: int = 0
    """Uploads still under way when the agent answered (before the client's timeout): ask again."""


Reply = AgentInfo | Fetched | RangeBytes | Queued | Cleared | Done | Refused | MetricsText | UsageInfo | Committed | Synced


class PeerFetch(msgspec.Struct, tag="peer_fetch"):
    """A peer's request to the owner of blocks it misses (the peer HTTP API, not the local
    socket): one object and one block a group, as its readers named them, credentials included.
    Several blocks when its reads of that owner queued up while its last request was out."""

    groups: list[Group]


class PeerBlock(msgspec.Struct, array_like=True):
    """One block of the owner's reply to a `PeerFetch`, sent as soon as the owner has it: its
    group's number in the request; status 200 with its bytes and their xxh3-64, which the asker
    checks; 404, the owner cannot cache it (the asker reads the store itself); 502, the store
    failed the owner (`data` holds the message)."""

    number: int
    status: int
    data: bytes
    xxh3: str = ""
    code: str = ""
    """With 502: the error's code (`errors.GpufeedError.code`), so the asker can tell the store's
    verdict on the object (missing, changed, corrupted) from the owner's own trouble."""


class PeerWarm(msgspec.Struct, tag="peer_warm"):
    """A warming node's request to an owner (the peer HTTP API): fetch these blocks, all of them
    its own, into its cache; the reply is a msgpack `Fetched` counting by these groups' objects."""

    groups: list[Group]
