"""Source adapter over an obstore store: its I/O runs in Rust, without the GIL.

Every kind of store (local dir, S3-compatible, GCS, Azure, HTTP) reads through this one
adapter; kinds differ only in how the store is built and, for HTTP, how it is listed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import obstore
from obstore import exceptions as obx

from gpufeed.errors import (
    InvalidArgument,
    ObjectChanged,
    ObjectMissing,
    SourceAuthError,
    SourceError,
    SourceUnreachable,
)
from gpufeed.sources.base import ObjectInfo

if TYPE_CHECKING:
    from obstore import GetOptions, GetResult, ObjectMeta

LIST_CHUNK = 1000


_XML_CODE = re.compile(r"<Code>([^<]*)</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_STATUS = re.compile(r"status code: (\d{3} [A-Za-z ]+?)(?::|$)", re.MULTILINE)


def _first_line(exc: BaseException) -> str:
    """The useful part of an obstore error: the store's own error code and message when the
    response carried an XML error body, else the first line (the rest is a Rust debug dump)."""
    text = str(exc).strip()
    code = _XML_CODE.search(text)
    if code:
        status = _STATUS.search(text)
        message = _XML_MESSAGE.search(text)
        parts = [status.group(1) if status else "", code.group(1), message.group(1) if message else ""]
        return ": ".join(p for p in parts if p)
    return text.splitlines()[0] if text else type(exc).__name__


def _is_connection_failure(message: str) -> bool:
    lowered = message.lower()
    return any(
        marker in lowered
        for marker in ("error sending request", "connection refused", "timed out", "dns error", "tcp connect")
    )


class ObstoreSource:
    """A `Source` backed by an obstore store rooted at `url`."""

    def __init__(self, url: str, store: Any, endpoint: str | None = None, options: dict[str, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.store = store
        self.endpoint = endpoint
        self.options = dict(options or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where()})"

    def where(self, key: str = "") -> str:
        place = f"{self.url}/{key}" if key else self.url
        return f"{place} (endpoint {self.endpoint})" if self.endpoint else place

    def translate(self, exc: Exception, key: str = "") -> Exception:
        """Map an obstore or OS error to a gpufeed error naming the source and key."""
        where = self.where(key)
        message = _first_line(exc)
        if isinstance(exc, (FileNotFoundError, obx.NotFoundError)):
            return ObjectMissing(f"{where}: not found at the source")
        if isinstance(exc, obx.PreconditionError):
            return ObjectChanged(f"{where}: the object changed at the source since it was listed")
        if "/latest/api/token" in str(exc) or "/latest/meta-data" in str(exc):
            return SourceAuthError(
                f"{where}: no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "or --opt profile=NAME, or --opt anonymous=true for public data)"
            )
        if isinstance(exc, (obx.PermissionDeniedError, obx.UnauthenticatedError, PermissionError)):
            return SourceAuthError(f"{where}: access denied ({message})")
        if isinstance(exc, obx.UnknownConfigurationKeyError):
            return InvalidArgument(f"{where}: {message}")
        if _is_connection_failure(message) or isinstance(exc, (ConnectionError, TimeoutError)):
            return SourceUnreachable(f"{where}: cannot reach the store ({message})")
        if any(code in message for code in ("403 Forbidden", "401 Unauthorized", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")):
            return SourceAuthError(f"{where}: access denied ({message})")
        return SourceError(f"{where}: {message}")

    @staticmethod
    def _info(meta: ObjectMeta) -> ObjectInfo:
        modified: datetime | None = meta.get("last_modified")
        return ObjectInfo(
            key=meta["path"],
            size=int(meta["size"]),
            mtime=modified.timestamp() if modified else 0.0,
            etag=meta.get("e_tag"),
        )

    def list(self) -> Iterator[list[ObjectInfo]]:
        try:
            for chunk in obstore.list(self.store, chunk_size=LIST_CHUNK):
                yield [self._info(meta) for meta in chunk if not meta["path"].endswith("/")]
        except (obx.BaseError, OSError) as exc:
            raise self.translate(exc) from exc

    def head(self, key: str) -> ObjectInfo:
        try:
            return self._info(obstore.head(self.store, key))
        except (obx.BaseError, OSError) as exc:
            raise self.translate(exc, key) from exc

    @staticmethod
    def _get_options(start: int, end: int, expect: ObjectInfo | None) -> GetOptions:
        options: GetOptions = {"range": (start, end)}
        if expect is not None:
            if expect.etag:
                options["if_match"] = expect.etag
            elif expect.mtime > 0:
                options["if_unmodified_since"] = datetime.fromtimestamp(expect.mtime, timezone.utc)
        return options

    @staticmethod
    def _check_size(result: GetResult, expect: ObjectInfo | None) -> None:
        if expect is not None and result.meta["size"] != expect.size:
            raise obx.PreconditionError(f"size {result.meta['size']} != {expect.size}")

    def get_range(self, key: str, start: int, end: int, expect: ObjectInfo | None = None) -> memoryview:
        try:
            result = obstore.get(self.store, key, options=self._get_options(start, end, expect))
            self._check_size(result, expect)
            return memoryview(result.bytes())
        except (obx.BaseError, OSError) as exc:
            raise self.translate(exc, key) from exc

    async def get_range_async(self, key: str, start: int, end: int, expect: ObjectInfo | None = None) -> memoryview:
        try:
            result = await obstore.get_async(self.store, key, options=self._get_options(start, end, expect))
            self._check_size(result, expect)
            return memoryview(await result.bytes_async())
        except (obx.BaseError, OSError) as exc:
            raise self.translate(exc, key) from exc
