"""What a mount's options mean: which belong to the read path (the cache's policy, the
format, writes, cluster copies) and which are handed to the source; and `--opt key=value`."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass

from gpufeed.config import Settings, parse_block_size, parse_verify
from gpufeed.errors import InvalidArgument
from gpufeed.meta import Mount

CACHE_OPTIONS = ("cache", "block_size", "verify", "format", "writable", "copies")
"""Mount options the read path consumes (`format`: how the source's objects become files, see
`pack.layout.FORMATS`); every other option belongs to the source."""


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """How a mount's reads use the node cache: `cache=on|off`, `block_size=4MiB`, `verify=always|never`,
    `copies=local|owner-only` (in a cache cluster: whether blocks other nodes own are kept like
    this node's own, or as copies evicted first)."""

    enabled: bool
    block_size: int
    verify: bool

    @classmethod
    def of(cls, mount: Mount, settings: Settings) -> CachePolicy:
        options = mount.options
        cache = options.get("cache", "on")
        if cache not in ("on", "off"):
            raise InvalidArgument(f"{mount.path}: option cache={cache!r}: expected on or off")
        given = options.get("block_size")
        block_size = settings.block_size if given is None else parse_block_size(given, f"{mount.path}: option block_size")
        verify = parse_verify(options["verify"], "option verify") if "verify" in options else settings.verify
        copies = options.get("copies", "local")
        if copies not in ("local", "owner-only"):
            raise InvalidArgument(f"{mount.path}: option copies={copies!r}: expected local or owner-only")
        return cls(cache == "on", block_size, verify)


def owner_only(mount: Mount) -> bool:
    """Whether blocks other cluster nodes own are kept as copies evicted first (`copies=owner-only`)."""
    return mount.options.get("copies") == "owner-only"


def is_writable(mount: Mount) -> bool:
    """Whether writes through gpufeed may go to the mount's store (`mount add --writable`)."""
    return mount.options.get("writable") == "true" and not packed(mount)


def packed(mount: Mount) -> bool:
    """Whether the mount shows pack members (its reserved pack directory is then hidden)."""
    return mount.options.get("format", "files") != "files"


def source_options(mount: Mount) -> dict[str, str]:
    return {k: v for k, v in mount.options.items() if k not in CACHE_OPTIONS}


def parse_options(pairs: list[str]) -> dict[str, str]:
    """`key=value` strings from the command line into a dict; malformed ones are refused."""
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InvalidArgument(f"--opt {pair!r}: expected key=value")
        options[key] = value
    return options


BOOL_WORDS = {"cache": ("on", "off"), "verify": ("always", "never")}
"""How options that are not true/false say yes and no."""


def option_texts(options: Mapping[str, object]) -> dict[str, str]:
    """Options as the command line gives them: a Python caller's `4096` (or numpy integer) is
    "4096", `True` is "on" for `cache`, "always" for `verify`, "true" for the rest; anything
    else names the option."""
    texts = {}
    for key, value in options.items():
        if isinstance(value, bool):
            texts[key] = BOOL_WORDS.get(key, ("true", "false"))[0 if value else 1]
        elif isinstance(value, (str, numbers.Real)):
            texts[key] = str(value)
        else:
            raise TypeError(f"option {key}={value!r}: expected a string (or a number or bool), got {type(value).__name__}")
    return texts
