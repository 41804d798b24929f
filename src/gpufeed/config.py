"""Every setting gpufeed reads from the environment, in one place.

Settings are read when a `Settings` is built (not at import), so tests and
child processes can change the environment and get a fresh view.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str, what: str = "size") -> int:
    """'4MiB', '100GB', '512k', '1048576' → bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        from gpufeed.errors import InvalidArgument

        raise InvalidArgument(f"{what} {text!r}: expected a size such as 4MiB, 100GB or 1048576")
    return int(float(match.group(1)) * unit)


def parse_block_size(text: str, what: str) -> int:
    """A block size the cache supports."""
    from gpufeed.blocks import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE

    size = parse_size(text, what)
    if not MIN_BLOCK_SIZE <= size <= MAX_BLOCK_SIZE:
        from gpufeed.errors import InvalidArgument

        raise InvalidArgument(f"{what} {text!r}: a block size must be between 4KiB and 1GiB")
    return size


def size_text(size: int) -> str:
    """`size` as `parse_size` reads it, in the largest binary unit that divides it: 4MiB."""
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if size % unit == 0:
            return f"{size // unit}{name}"
    return str(size)


def human_bytes(size: float) -> str:
    """`size` for people: 1.5 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def parse_quota(text: str, what: str) -> int:
    """A cache quota: a size above zero (a mount reads without caching with cache=off)."""
    size = parse_size(text, what)
    if size <= 0:
        from gpufeed.errors import InvalidArgument

        raise InvalidArgument(f"{what} {text!r}: a cache quota must be above 0 (to read without caching: --opt cache=off)")
    return size


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        from gpufeed.errors import InvalidArgument

        raise InvalidArgument(f"environment variable {name}={raw!r} is not a number") from None


def _positive_env(name: str, default: float) -> float:
    """A duration that must be above zero: 0 seconds between progress lines would print
    thousands a second, a timeout of 0 would fail every request."""
    value = _float_env(name, default)
    if not value > 0:  # NaN too
        from gpufeed.errors import InvalidArgument

        raise InvalidArgument(f"environment variable {name}={os.environ[name]!r} must be a number of seconds above 0")
    return value


def _fraction_env(name: str, default: float) -> float:
    """A share in [0, 1): keeping the whole disk free (or more) would cache nothing, unsaid."""
    value = _float_env(name, default)
    if not 0 <= value < 1:  # NaN too
        from gpufeed.errors import InvalidArgument

        raise InvalidArgument(f"environment variable {name}={os.environ[name]!r} must be a fraction in [0, 1), e.g. 0.1")
    return value


@dataclass(frozen=True)
class Settings:
    """Resolved configuration.

    home: `GPUFEED_HOME`, default `~/.gpufeed`; holds the SQLite metadata and the cache.
    meta_url: `GPUFEED_META`; empty means SQLite at `home/meta.db`, or `redis://host:port/db`.
    connect_timeout / request_timeout: seconds for source connections and whole requests
        (`GPUFEED_CONNECT_TIMEOUT`, `GPUFEED_REQUEST_TIMEOUT`), so an unreachable
        endpoint fails instead of hanging.
    retry_timeout: seconds a request may spend in retries (`GPUFEED_RETRY_TIMEOUT`).
    cache_dirs: `GPUFEED_CACHE_DIRS` (':'-separated), default `home/cache`; the first one names
        the node agent that owns them all.
    cache_size: `GPUFEED_CACHE_SIZE` quota, default 100GiB, always bounded by free space.
    cache_free_ratio: `GPUFEED_CACHE_FREE_RATIO`, fraction of the filesystem kept free (0.1).
    block_size: `GPUFEED_BLOCK_SIZE` default block size of new mounts (4MiB), recorded in the
        mount when it is added, so every reader of it names its blocks alike.
    verify: `GPUFEED_VERIFY` = always | never: checksum every cached read, or trust the disk.
    agent_idle_timeout: seconds an auto-started agent waits with no clients before it exits
        (`GPUFEED_AGENT_IDLE_TIMEOUT`, 300).
    open_blocks: block files a reading process keeps open and mapped between hits
        (`GPUFEED_OPEN_BLOCKS`, 4096; 0 opens and closes one on every hit), at most a quarter of
        its open-file limit.
    metrics_addr: `GPUFEED_METRICS_ADDR`, HOST:PORT (or PORT, on 127.0.0.1) where the agent
        serves Prometheus metrics; empty: not served (`gpufeed metrics` works all the same).
    log_format: `GPUFEED_LOG_FORMAT` = text | json, how the agent and the command line log.
    debug: `GPUFEED_DEBUG=1` (or `gpufeed --debug`): logged errors carry their tracebacks.
    progress_interval: seconds between the plain progress lines a long command writes when
        stderr is not a terminal (`GPUFEED_PROGRESS_INTERVAL`, 5).
    cluster: `GPUFEED_CLUSTER`, the cache cluster's Redis (`redis://HOST:PORT/DB`); empty: this
        node caches alone. The peer token comes from `GPUFEED_CLUSTER_TOKEN_FILE` or
        `GPUFEED_CLUSTER_TOKEN` (`agent.peers.load_token`), never from here.
    peer_addr: `GPUFEED_PEER_ADDR`, HOST:PORT the agent's peer API binds (needed with a cluster).
    advertise: `GPUFEED_PEER_ADVERTISE`, HOST:PORT the other nodes reach it at (default peer_addr).
    replicas: `GPUFEED_CLUSTER_REPLICAS`, owners per block (1; 2 to fail over without the store).
    node_weight: `GPUFEED_NODE_WEIGHT`, this node's share of ownership relative to others (1).
    peer_tls_cert, peer_tls_key, peer_tls_ca: `GPUFEED_PEER_TLS_CERT`, `_KEY`, `_CA`, PEM files:
        all three set, the peer API speaks mutual TLS (this node's certificate and key, and the
        cluster's CA every peer's certificate must be signed by); none set, plain HTTP.
    node_id: `GPUFEED_NODE_ID`, default HOSTNAME@ADVERTISED-ADDRESS.
    pool_quotas: `GPUFEED_POOL_QUOTAS`, GPUs each team may hold in the GPU pool, `team=2,other=0.5`,
        as (team, GPUs) pairs (the settings stay hashable); read when a pool's scheduler is first created.
    pool_idle_timeout: seconds a GPU lease may stay idle before it is reclaimed
        (`GPUFEED_POOL_IDLE_TIMEOUT`, 1800; 0 never reclaims).
    """

    home: Path
    meta_url: str
    connect_timeout: float
    request_timeout: float
    retry_timeout: float
    cache_dirs: tuple[Path, ...]
    cache_size: int
    cache_free_ratio: float
    block_size: int
    verify: bool
    agent_idle_timeout: float
    open_blocks: int
    metrics_addr: str = ""
    log_format: str = "text"
    debug: bool = False
    progress_interval: float = 5.0
    cluster: str = ""
    peer_addr: str = ""
    advertise: str = ""
    replicas: int = 1
    node_weight: float = 1.0
    node_id: str = ""
    peer_tls_cert: str = ""
    peer_tls_key: str = ""
    peer_tls_ca: str = ""
    pool_quotas: tuple[tuple[str, float], ...] = ()
    pool_idle_timeout: float = 1800.0

    @property
    def agent_reply_timeout(self) -> float:
        """How long a client waits on one agent request (a socket timeout): a fetch may spend two
        store requests and their retries."""
        return max(120.0, 2 * self.request_timeout + self.retry_timeout)

    @classmethod
    def from_env(cls) -> Settings:
        home = Path(os.environ.get("GPUFEED_HOME") or Path.home() / ".gpufeed").expanduser()
        if os.path.exists(home) and not os.path.isdir(home):  # False, not an error, where it may not be looked at
            from gpufeed.errors import InvalidArgument

            raise InvalidArgument(f"GPUFEED_HOME={home}: is not a directory (it holds the metadata and the cache)")
        dirs = os.environ.get("GPUFEED_CACHE_DIRS", "")
        return cls(
            home=home,
            meta_url=os.environ.get("GPUFEED_META", ""),
            connect_timeout=_positive_env("GPUFEED_CONNECT_TIMEOUT", 5.0),
            request_timeout=_positive_env("GPUFEED_REQUEST_TIMEOUT", 60.0),
            retry_timeout=_float_env("GPUFEED_RETRY_TIMEOUT", 15.0),
            cache_dirs=tuple(Path(d).expanduser() for d in dirs.split(":") if d) if dirs else (home / "cache",),
            cache_size=parse_size(os.environ.get("GPUFEED_CACHE_SIZE") or "100GiB", "GPUFEED_CACHE_SIZE"),
            cache_free_ratio=_fraction_env("GPUFEED_CACHE_FREE_RATIO", 0.1),
            block_size=parse_block_size(os.environ.get("GPUFEED_BLOCK_SIZE") or "4MiB", "GPUFEED_BLOCK_SIZE"),
            verify=parse_verify(os.environ.get("GPUFEED_VERIFY") or "always", "GPUFEED_VERIFY"),
            agent_idle_timeout=_float_env("GPUFEED_AGENT_IDLE_TIMEOUT", 300.0),
            open_blocks=int(_float_env("GPUFEED_OPEN_BLOCKS", 4096)),
            metrics_addr=_checked(os.environ.get("GPUFEED_METRICS_ADDR", ""), parse_addr, "GPUFEED_METRICS_ADDR"),
            log_format=_checked(os.environ.get("GPUFEED_LOG_FORMAT") or "text", parse_log_format, "GPUFEED_LOG_FORMAT"),
            debug=os.environ.get("GPUFEED_DEBUG") == "1",
            progress_interval=_positive_env("GPUFEED_PROGRESS_INTERVAL", 5.0),
            cluster=os.environ.get("GPUFEED_CLUSTER", ""),
            peer_addr=_checked(os.environ.get("GPUFEED_PEER_ADDR", ""), parse_addr, "GPUFEED_PEER_ADDR"),
            advertise=_checked(os.environ.get("GPUFEED_PEER_ADVERTISE", ""), parse_addr, "GPUFEED_PEER_ADVERTISE"),
            replicas=int(_float_env("GPUFEED_CLUSTER_REPLICAS", 1)),
            node_weight=_float_env("GPUFEED_NODE_WEIGHT", 1.0),
            node_id=os.environ.get("GPUFEED_NODE_ID", ""),
            peer_tls_cert=os.environ.get("GPUFEED_PEER_TLS_CERT", ""),
            peer_tls_key=os.environ.get("GPUFEED_PEER_TLS_KEY", ""),
            peer_tls_ca=os.environ.get("GPUFEED_PEER_TLS_CA", ""),
            pool_quotas=tuple(parse_quotas(os.environ.get("GPUFEED_POOL_QUOTAS", ""), "GPUFEED_POOL_QUOTAS").items()),
            pool_idle_timeout=_float_env("GPUFEED_POOL_IDLE_TIMEOUT", 1800.0),
        )


def _checked(text: str, parse: Callable[[str, str], object], what: str) -> str:
    """`text` once `parse` accepts it (it raises InvalidArgument naming `what`); empty passes."""
    if text:
        parse(text, what)
    return text


def parse_addr(text: str, what: str = "--metrics-addr") -> tuple[str, int]:
    """'HOST:PORT', '[v6]:PORT', ':PORT' or 'PORT' → (host, port); no host means 127.0.0.1 only."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") if sep else ""
    if not port.isdigit() or not 0 < int(port) < 65536:
        from gpufeed.errors import InvalidArgument

        raise InvalidArgument(f"{what} {text!r}: expected HOST:PORT or PORT, e.g. 127.0.0.1:9400")
    return host or "127.0.0.1", int(port)


def check_redis_url(url: str, what: str) -> None:
    """A Redis URL's scheme, port and database number, checked before redis-py reads it: it
    takes `redis://host/abc` (a typo in the number) as database 0, which may be another
    cluster's or another namespace's."""
    from urllib.parse import parse_qs, urlsplit

    from gpufeed.errors import InvalidArgument

    expected = "expected redis://HOST:PORT[/DB] (or rediss://, unix:///PATH?db=DB)"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - the property raises on a port that is no number, or out of range
    except ValueError as exc:
        raise InvalidArgument(f"{what} {url!r}: {exc}; {expected}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise InvalidArgument(f"{what} {url!r}: {expected}")
    path = parts.path.strip("/") if parts.scheme != "unix" else ""
    for given in ([path] if path else []) + parse_qs(parts.query).get("db", []):
        if not re.fullmatch(r"[0-9]+", given):
            raise InvalidArgument(f"{what} {url!r}: database {given!r} is not a number; {expected}")


def cluster_node_id(settings: Settings) -> str:
    """The id this node's agent joins the cache cluster with: `node_id`, else HOST@ADVERTISED-ADDRESS
    ("" without a cluster or a peer address). The GPU pool names the node's agent by it too."""
    if settings.node_id:
        return settings.node_id
    address = settings.advertise or settings.peer_addr
    if not (settings.cluster and address):
        return ""
    host, port = parse_addr(address, "--advertise")
    return f"{socket.gethostname()}@{host}:{port}"


CLUSTER_FLAGS = {
    "--cluster": "cluster",
    "--peer-addr": "peer_addr",
    "--advertise": "advertise",
    "--replicas": "replicas",
    "--weight": "node_weight",
    "--node-id": "node_id",
    "--peer-tls-cert": "peer_tls_cert",
    "--peer-tls-key": "peer_tls_key",
    "--peer-tls-ca": "peer_tls_ca",
}
"""The agent's cluster flags and the settings they set (`python -m gpufeed.agent`, `gpufeed agent`)."""


def with_cluster_flags(settings: Settings, flags: dict[str, str | None]) -> Settings:
    """`settings` with the cluster flags given (flag → text; None: not given) applied, checked."""
    changes: dict[str, object] = {}
    for flag, text in flags.items():
        if text is None:
            continue
        field = CLUSTER_FLAGS[flag]
        if field in ("peer_addr", "advertise"):
            parse_addr(text, flag)
        if field in ("replicas", "node_weight"):
            try:
                number = int(text) if field == "replicas" else float(text)
            except ValueError:
                from gpufeed.errors import InvalidArgument

                raise InvalidArgument(f"{flag} {text!r}: expected a number") from None
            changes[field] = number
        else:
            changes[field] = text
    return dataclasses.replace(settings, **changes)  # type: ignore[arg-type]


def cluster_argv(settings: Settings) -> list[str]:
    """The flags that give a spawned agent this node's cluster settings."""
    argv: list[str] = []
    if settings.cluster:
        for flag, field in CLUSTER_FLAGS.items():
            value = getattr(settings, field)
            if value not in ("", None):
                argv += [flag, str(value)]
    return argv


def parse_log_format(text: str, what: str = "--log-format") -> str:
    if text in ("text", "json"):
        return text
    from gpufeed.errors import InvalidArgument

    raise InvalidArgument(f"{what}={text!r}: expected text or json")


def parse_verify(text: str, what: str = "verify") -> bool:
    if text in ("always", "never"):
        return text == "always"
    from gpufeed.errors import InvalidArgument

    raise InvalidArgument(f"{what}={text!r}: expected always or never")


def parse_quotas(text: str, what: str = "quotas") -> dict[str, float]:
    """'team=2,other=0.5' → {"team": 2.0, "other": 0.5}: GPUs each team may hold."""
    quotas: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        team, _, value = item.partition("=")
        try:
            quotas[team.strip()] = float(value)
        except ValueError:
            from gpufeed.errors import InvalidArgument

            raise InvalidArgument(f"{what}={text!r}: expected TEAM=GPUS[,TEAM=GPUS], e.g. vision=2,nlp=0.5") from None
    return quotas
