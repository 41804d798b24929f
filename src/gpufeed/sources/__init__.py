"""Sources: one module per store kind behind the `Source` protocol; `open_source` picks one by URL.

A scheme names the module and function that build its source; the module is imported the
first time its scheme is opened, so naming a block or an object (`gpufeed.sources.base`)
loads no store client (obstore, aiohttp).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import SplitResult, urlsplit

from gpufeed.errors import InvalidArgument
from gpufeed.sources.base import ObjectInfo, Source

if TYPE_CHECKING:
    from gpufeed.config import Settings

Builder = Callable[[str, SplitResult, dict[str, str], "Settings"], Source]

BUILDERS: dict[str, tuple[str, str]] = {
    "file": ("gpufeed.sources.stores", "local_source"),
    "s3": ("gpufeed.sources.stores", "s3_source"),
    "s3a": ("gpufeed.sources.stores", "s3_source"),
    "gs": ("gpufeed.sources.stores", "gcs_source"),
    "gcs": ("gpufeed.sources.stores", "gcs_source"),
    "az": ("gpufeed.sources.stores", "azure_source"),
    "azure": ("gpufeed.sources.stores", "azure_source"),
    "abfs": ("gpufeed.sources.stores", "azure_source"),
    "http": ("gpufeed.sources.http", "http_source"),
    "https": ("gpufeed.sources.http", "http_source"),
}
"""URL scheme -> (module, builder function in it)."""


def builder(scheme: str) -> Builder | None:
    """The function that builds a source for `scheme`, importing its module; None if unknown."""
    where = BUILDERS.get(scheme.lower())
    if where is None:
        return None
    module, name = where
    found: Builder = getattr(importlib.import_module(module), name)
    return found


def split_url(url: str) -> SplitResult:
    """`url`'s parts; one that cannot be parsed (`http://[::1`, a port that is not a number) is
    an InvalidArgument naming it."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        raise InvalidArgument(f"{url}: not a valid URL ({exc})") from None
    return parts


def as_url(location: str) -> str:
    """`location` as a source URL: a local path without a scheme (`/data`, `./data`, `~/data`)
    becomes the absolute file:// URL it means, so a mount added from one directory reads the
    same directory from any other; `file:/data` and `file://localhost/data` become `file:///data`,
    so a directory has one URL and one set of cached blocks; any other URL is returned as it is."""
    parts = split_url(location)
    if location and not parts.scheme:
        return f"file://{Path(location).expanduser().absolute()}"
    if parts.scheme.lower() == "file" and parts.netloc in ("", "localhost") and parts.path.startswith("/"):
        return f"file://{parts.path}" + (f"?{parts.query}" if parts.query else "")
    return location


def open_source(url: str, options: dict[str, str], settings: Settings) -> Source:
    """Build the source for `url`; raises InvalidArgument for a URL or option it cannot use."""
    parts = split_url(url)
    build = builder(parts.scheme)
    if build is None:
        known = ", ".join(sorted({"file", "s3", "gs", "az", "http", "https"}))
        raise InvalidArgument(f"{url}: unsupported URL scheme {parts.scheme!r} (supported: {known})")
    if "list" in options and parts.scheme.lower() not in ("http", "https"):  # `mount add --list`: name the flag
        raise InvalidArgument(f"{url}: --list (a listing file) applies to http(s) sources only; this source lists itself")
    return build(url, parts, options, settings)


__all__ = ["ObjectInfo", "Source", "as_url", "open_source"]
