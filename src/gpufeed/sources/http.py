"""http(s):// sources: ranged GETs through obstore; listing from a JSON directory index
(nginx `autoindex_format json`) crawled concurrently, or from a listing file.

A listing file (`--list FILE`) has one object per line: `KEY [SIZE]`, KEY relative to the
source URL; a line with a tab is `KEY<tab>[SIZE]`, so a key may hold spaces. Lines without a
size are completed with a HEAD request.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult

from obstore.store import HTTPStore

from gpufeed.aio import gather_all, run_blocking
from gpufeed.config import Settings
from gpufeed.errors import InvalidArgument
from gpufeed.sources.base import ObjectInfo
from gpufeed.sources.objstore import LIST_CHUNK, ObstoreSource
from gpufeed.sources.stores import client_options, retry_config


class HttpSource(ObstoreSource):
    def __init__(self, url: str, store: Any, settings: Settings, listing_file: Path | None) -> None:
        options = {"list": str(listing_file)} if listing_file else {}
        super().__init__(url, store, options=options, kind="http", settings=settings)
        self.settings = settings
        self.listing_file = listing_file
        self._probed = False

    def list(self) -> Iterator[list[ObjectInfo]]:
        if self.listing_file is not None:
            yield from self._list_file(self.listing_file)
        else:
            from gpufeed.sources.http_index import crawl_index  # aiohttp: only where a listing crawls

            yield from crawl_index(self.url, self.settings, self.retry)

    def _list_file(self, path: Path) -> Iterator[builtins.list[ObjectInfo]]:
        """Only listing needs the file: reads work after it is gone."""
        batch: list[tuple[str, int | None]] = []
        try:
            lines = path.open(encoding="utf-8")
        except OSError as exc:
            raise InvalidArgument(f"{self.url}: listing file {path}: {exc.strerror}") from exc
        with lines:
            for number, line in enumerate(_decoded(lines, path), 1):
                fields = _fields(line)
                if not fields or fields[0].startswith("#"):
                    continue
                if len(fields) > 2 or (len(fields) == 2 and not fields[1].isdigit()):
                    raise InvalidArgument(
                        f"{path}:{number}: expected 'KEY [SIZE]' (a key with spaces: KEY<tab>SIZE), got {line.strip()!r}"
                    )
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
        sized = [(key, size) for key, size in batch if size is not None]
        if sized and not self._probed:
            self._probe(*sized[0])
        return [heads[key] if size is None else ObjectInfo(key, size, 0.0) for key, size in batch]

    def _probe(self, key: str, size: int) -> None:
        """One HEAD of the first `KEY SIZE` line, so a listing of a server that is not there (a
        typo in the URL, a wrong port) or that serves other files fails when it is mounted, not at
        the first read."""
        found = self.head(key)
        self._probed = True
        if found.size != size:
            raise InvalidArgument(
                f"{self.listing_file}: {key} is listed with {size} bytes, but {self.url}/{key} has {found.size}"
            )

    async def _head_many(self, keys: builtins.list[str]) -> builtins.list[ObjectInfo]:
        return await gather_all(self.head_async(key) for key in keys)

def _fields(line: str) -> list[str]:
    """A listing line's key and size: split at its last tab where it has one, else at whitespace."""
    text = line.rstrip("\r\n")
    if "\t" not in text:
        return text.split()
    key, _, size = text.rpartition("\t")
    return [part for part in (key.strip(), size.strip()) if part]


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
