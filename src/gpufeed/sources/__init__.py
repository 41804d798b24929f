"""Sources: one module per store kind behind the `Source` protocol; `open_source` picks one by URL."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import SplitResult, urlsplit

from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument
from gpufeed.sources.base import ObjectInfo, Source
from gpufeed.sources.http import http_source
from gpufeed.sources.stores import azure_source, gcs_source, local_source, s3_source

Builder = Callable[[str, SplitResult, dict[str, str], Settings], Source]

BUILDERS: dict[str, Builder] = {
    "file": local_source,
    "s3": s3_source,
    "s3a": s3_source,
    "gs": gcs_source,
    "gcs": gcs_source,
    "az": azure_source,
    "azure": azure_source,
    "abfs": azure_source,
    "http": http_source,
    "https": http_source,
}


def open_source(url: str, options: dict[str, str], settings: Settings) -> Source:
    """Build the source for `url`; raises InvalidArgument for a URL or option it cannot use."""
    parts = urlsplit(url)
    builder = BUILDERS.get(parts.scheme.lower())
    if builder is None:
        known = ", ".join(sorted({"file", "s3", "gs", "az", "http", "https"}))
        raise InvalidArgument(f"{url}: unsupported URL scheme {parts.scheme!r} (supported: {known})")
    return builder(url, parts, options, settings)


__all__ = ["ObjectInfo", "Source", "open_source"]
