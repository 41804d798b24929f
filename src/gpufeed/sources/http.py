"""http(s):// sources: ranged GETs through obstore; listing from a JSON directory index
(nginx `autoindex_format json`) crawled concurrently, or from a listing file.

A listing file (`--list FILE`) has one object per line: `KEY [SIZE]`, KEY relative to the
source URL. Lines without a size are completed with a HEAD request.
"""

from __future__ import annotations

import asyncio
import builtins
import json
from collections import deque
from collections.abc import Awaitable, Iterable, Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import SplitResult, quote

import aiohttp
from obstore.store import HTTPStore

from gpufeed.aio import blocking_runner, run_blocking
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument, PathNotFound, SourceError, SourceUnreachable
from gpufeed.sources import retry
from gpufeed.sources.base import ObjectInfo
from gpufeed.sources.objstore import LIST_CHUNK, ObstoreSource
from gpufeed.sources.retry import Retryable
from gpufeed.sources.stores import client_options, retry_config

INDEX_CONCURRENCY = 16

T = TypeVar("T")


class HttpSource(ObstoreSource):
    def __init__(self, url: str, store: Any, settings: Settings, listing_file: Path | None) -> None:
        options = {"list": str(listing_file)} if listing_file else {}
        super().__init__(url, store, options=options, kind="http", settings=settings)
        self.settings = settings
        self.listing_file = listing_file

    def list(self) -> Iterator[list[ObjectInfo]]:
        if self.listing_file is not None:
            yield from self._list_file(self.listing_file)
        else:
            yield from self._crawl_index()

    def _list_file(self, path: Path) -> Iterator[builtins.list[ObjectInfo]]:
        """Only listing needs the file: reads work after it is gone."""
        batch: list[tuple[str, int | None]] = []
        try:
            lines = path.open(encoding="utf-8")
        except OSError as exc:
            raise InvalidArgument(f"{self.url}: listing file {path}: {exc.strerror}") from exc
        with lines:
            for number, line in enumerate(_decoded(lines, path), 1):
                fields = line.split()
                if not fields or fields[0].startswith("#"):
                    continue
                if len(fields) > 2 or (len(fields) == 2 and not fields[1].isdigit()):
                    raise InvalidArgument(f"{path}:{number}: expected 'KEY [SIZE]', got {line.strip()!r}")
                batch.append((fields[0].lstrip("/"), int(fields[1]) if len(fields) == 2 else None))
                if len(batch) == LIST_CHUNK:
                    yield self._complete(batch)
                    batch = []
        if batch:
            yield self._complete(batch)

    def _complete(self, batch: builtins.list[tuple[str, int | None]]) -> builtins.list[ObjectInfo]:
        """Lines without a size get one, and a version, from a HEAD. A `KEY SIZE` line costs no
        request and carries no version (mtime 0, no ETag): the first open of it pins one
        (`Namespace.open_object`), so reads are conditional from then on."""
        missing = [key for key, size in batch if size is None]
        heads: dict[str, ObjectInfo] = {}
        if missing:
            heads = dict(zip(missing, run_blocking(self._head_many(missing)), strict=True))
        return [heads[key] if size is None else ObjectInfo(key, size, 0.0) for key, size in batch]

    async def _head_many(self, keys: builtins.list[str]) -> builtins.list[ObjectInfo]:
        return await _all(self.head_async(key) for key in keys)

    def _crawl_index(self) -> Iterator[builtins.list[ObjectInfo]]:
        """Breadth-first over directories, INDEX_CONCURRENCY index pages at a time, each page
        retried on its own; memory holds only the frontier of directories, never the whole
        listing. The loop is a Runner, so however the crawl ends (failure, a consumer that
        stops early) the session closes and no task is left pending on a closed loop."""
        with blocking_runner() as run:
            session = run(self._open_session())
            try:
                frontier: deque[str] = deque([""])
                while frontier:
                    level = [frontier.popleft() for _ in range(min(len(frontier), INDEX_CONCURRENCY))]
                    pages = run(_all(self._index_page(session, d) for d in level))
                    batch: list[ObjectInfo] = []
                    for directory, page in zip(level, pages, strict=True):
                        for item in page:
                            key = f"{directory}{item['name']}"
                            if item.get("type") == "directory":
                                frontier.append(key + "/")
                            elif item.get("type") == "file":
                                mtime = parsedate_to_datetime(item["mtime"]).timestamp() if item.get("mtime") else 0.0
                                batch.append(ObjectInfo(key, int(item.get("size", 0)), mtime))
                    if batch:
                        yield batch
            finally:
                run(session.close())

    async def _open_session(self) -> aiohttp.ClientSession:
        timeout = aiohttp.ClientTimeout(total=self.settings.request_timeout, connect=self.settings.connect_timeout)
        return aiohttp.ClientSession(timeout=timeout)

    async def _index_page(self, session: aiohttp.ClientSession, directory: str) -> builtins.list[dict[str, Any]]:
        url = f"{self.url}/{quote(directory)}"
        return await retry.call_async(self.retry, lambda: self._index_page_once(session, url))

    async def _index_page_once(self, session: aiohttp.ClientSession, url: str) -> builtins.list[dict[str, Any]]:
        """One GET of an index page. 5xx, a dropped connection and a body that breaks off (or is
        not JSON though the server says it is) are Retryable; 404 and other 4xx are final."""
        try:
            async with session.get(url) as response:
                if response.status == 404:
                    raise PathNotFound(f"{url}: not found (HTTP 404)")
                if response.status >= 500:
                    raise Retryable("server error", SourceError(f"{url}: HTTP {response.status} {response.reason}"))
                if response.status >= 400:
                    raise SourceError(f"{url}: HTTP {response.status} {response.reason}")
                body = await response.read()
                says_json = "json" in response.content_type
        except aiohttp.ClientPayloadError as exc:
            raise Retryable("broken response body", SourceError(f"{url}: the index page broke off ({exc})")) from exc
        except (TimeoutError, aiohttp.ClientConnectionError) as exc:
            error = SourceUnreachable(f"{url}: cannot reach the server ({exc or type(exc).__name__})")
            raise Retryable("connection failure", error) from exc
        try:
            page = json.loads(body)
        except ValueError:
            if says_json:
                garbled = SourceError(f"{url}: the JSON index page is cut short or garbled")
                raise Retryable("broken response body", garbled) from None
            page = None
        if not isinstance(page, list):
            raise SourceError(
                f"{url}: the server does not serve a JSON directory index; "
                "give a listing file with --list FILE (or --opt list=FILE)"
            )
        return page


async def _all(awaitables: Iterable[Awaitable[T]]) -> builtins.list[T]:
    """Await all; then raise the first failure. Unlike a bare gather, no sibling is still
    running (and retrying) when the caller's loop closes."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results  # type: ignore[return-value]


def _decoded(lines: Iterator[str], path: Path) -> Iterator[str]:
    try:
        yield from lines
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"listing file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def http_source(url: str, parts: SplitResult, options: dict[str, str], settings: Settings) -> HttpSource:
    config = dict(options)
    listing = config.pop("list", None)
    if config:
        raise InvalidArgument(f"{url}: unknown option(s) {', '.join(sorted(config))} (http sources take: list)")
    listing_file = Path(listing).expanduser().absolute() if listing else None
    if not parts.netloc:
        raise InvalidArgument(f"{url}: missing host")
    root = url.rstrip("/")
    store = HTTPStore(root, client_options=client_options(settings, root), retry_config=retry_config(settings))
    return HttpSource(root, store, settings, listing_file)
