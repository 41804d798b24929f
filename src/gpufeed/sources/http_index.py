"""Listing an http(s) source from its JSON directory index (nginx `autoindex_format json`).

The one part of an HTTP source that needs aiohttp, in a module of its own: a process that reads
objects and never lists (the node agent, a DataLoader worker) does not import it. Importing
aiohttp costs about 0.25 s of CPU here, which the agent paid inside its first cold read.
"""

from __future__ import annotations

import json
import os
import socket
from collections import deque
from collections.abc import Iterator
from email.utils import parsedate_to_datetime
from typing import Annotated
from urllib.parse import quote

import aiohttp
import msgspec

from gpufeed.aio import blocking_runner, gather_all
from gpufeed.config import Settings
from gpufeed.errors import NoDirectoryIndex, PathNotFound, SourceError, SourceUnreachable
from gpufeed.sources import retry
from gpufeed.sources.base import ObjectInfo
from gpufeed.sources.retry import Retryable

INDEX_CONCURRENCY = 16


def crawl_index(url: str, settings: Settings, policy: retry.RetryPolicy) -> Iterator[list[ObjectInfo]]:
    """Breadth-first over directories, INDEX_CONCURRENCY index pages at a time, each page
    retried on its own; memory holds only the frontier of directories, never the whole
    listing. The loop is a Runner, so however the crawl ends (failure, a consumer that
    stops early) the session closes and no task is left pending on a closed loop."""
    with blocking_runner() as run:
        session = run(_open_session(settings))
        try:
            frontier: deque[str] = deque([""])
            while frontier:
                level = [frontier.popleft() for _ in range(min(len(frontier), INDEX_CONCURRENCY))]
                pages = run(gather_all(_index_page(session, f"{url}/{quote(d)}", policy) for d in level))
                batch: list[ObjectInfo] = []
                for directory, page in zip(level, pages, strict=True):
                    for item in page:
                        key = f"{directory}{item.name}"
                        if item.type == "directory":
                            frontier.append(key + "/")
                        elif item.type == "file":
                            batch.append(ObjectInfo(key, item.size, item.modified(f"{url}/{quote(directory)}")))
                if batch:
                    yield batch
        finally:
            run(session.close())


async def _open_session(settings: Settings) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=settings.request_timeout, connect=settings.connect_timeout)
    return aiohttp.ClientSession(timeout=timeout)


def why_failed(exc: BaseException) -> str:
    """What a user can act on in a connection failure: the system's words for it ("Connection
    refused", "Name or service not known"), not aiohttp's ("Cannot connect to host … ssl:default")."""
    cause = getattr(exc, "os_error", None)
    if isinstance(cause, OSError) and cause.errno is not None:
        return (cause.strerror or str(cause)) if isinstance(cause, socket.gaierror) else os.strerror(cause.errno)
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


class IndexEntry(msgspec.Struct):
    """One entry of nginx's JSON index (`autoindex_format json`); a file's size is required."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    type: str = ""
    size: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] = -1
    mtime: str | None = None

    def modified(self, page: str) -> float:
        try:
            return parsedate_to_datetime(self.mtime).timestamp() if self.mtime else 0.0
        except (ValueError, TypeError):
            raise SourceError(f"{page}: entry {self.name!r}: mtime {self.mtime!r} is not an HTTP date") from None


async def _index_page(session: aiohttp.ClientSession, url: str, policy: retry.RetryPolicy) -> list[IndexEntry]:
    return await retry.call_async(policy, lambda: _index_page_once(session, url))


async def _index_page_once(session: aiohttp.ClientSession, url: str) -> list[IndexEntry]:
    """One GET of an index page. 5xx, a dropped connection and a body that breaks off (or is
    not JSON though the server says it is) are Retryable; 404 and other 4xx are final."""
    try:
        async with session.get(url) as response:
            if response.status == 404:
                raise PathNotFound(f"{url}: not found (HTTP 404)")
            if response.status >= 500:
                raise Retryable("server error", SourceError(f"{url}: HTTP {response.status} {response.reason}"))
            if response.status >= 400:
                raise NoDirectoryIndex(f"{url}: HTTP {response.status} {response.reason}")
            body = await response.read()
            says_json = "json" in response.content_type
    except aiohttp.ClientPayloadError as exc:
        raise Retryable("broken response body", SourceError(f"{url}: the index page broke off ({exc})")) from exc
    except (TimeoutError, aiohttp.ClientConnectionError) as exc:
        error = SourceUnreachable(f"{url}: cannot reach the server ({why_failed(exc)})")
        raise Retryable("connection failure", error) from exc
    try:
        page = json.loads(body)
    except ValueError:
        if says_json:
            garbled = SourceError(f"{url}: the JSON index page is cut short or garbled")
            raise Retryable("broken response body", garbled) from None
        page = None
    if not isinstance(page, list):
        raise NoDirectoryIndex(
            f"{url}: the server does not serve a JSON directory index; "
            "give a listing file with --list FILE (or --opt list=FILE)"
        )
    try:
        entries = msgspec.convert(page, list[IndexEntry], strict=False)  # a size of 12.0 is 12, as before
    except msgspec.ValidationError as exc:
        raise SourceError(f"{url}: not an nginx JSON index ({exc})") from None
    for entry in entries:
        if entry.type == "file" and entry.size < 0:
            raise SourceError(f"{url}: not an nginx JSON index (file {entry.name!r} has no size)")
    return entries
