"""Source adapter over an obstore store: its I/O runs in Rust, without the GIL.

Every kind of store (local dir, S3-compatible, GCS, Azure, HTTP) reads through this one
adapter; kinds differ only in how the store is built and, for HTTP, how it is listed.

Every remote call is retried (`sources.retry`), and what a GET returns is checked before anyone
sees it: its length always; for a read of a whole object, the manifest's content hash and, on
S3, a plain ETag (the MD5 of a single-part upload). A range of an object cannot be checked
against a hash of the whole: the caller that assembles the object checks it. obstore (0.12)
exposes no other checksum of a GET (no S3 x-amz-checksum-*, GCS x-goog-hash or Azure
Content-MD5 header): its GetResult carries only path, size, mtime, ETag, version and
Content-*/Cache-Control/user metadata attributes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import obstore
from obstore import exceptions as obx

from gpufeed.config import Settings
from gpufeed.errors import (
    InvalidArgument,
    ObjectChanged,
    ObjectCorrupted,
    ObjectMissing,
    SourceAuthError,
    SourceError,
    SourceUnreachable,
)
from gpufeed.sources import retry
from gpufeed.sources.base import ObjectInfo, obstore_started
from gpufeed.sources.retry import Retryable

if TYPE_CHECKING:
    from obstore import GetOptions, GetResult, ObjectMeta

T = TypeVar("T")

LIST_CHUNK = 1000
HASH_IN_THREAD = 256 * 1024
UPLOAD_PART = 16 << 20
UPLOAD_CONCURRENCY = 8
"""An upload's parts and how many are in flight: 128 MiB buffered at most per upload."""
"""Bodies at least this long are hashed off the event loop (hashlib releases the GIL)."""

log = logging.getLogger("gpufeed")


_XML_CODE = re.compile(r"<Code>([^<]*)</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_STATUS = re.compile(r"status code: (\d{3} [A-Za-z ]+?)(?::|$)", re.MULTILINE)
_SERVER_ERROR = re.compile(r"status code: 5\d\d|<Code>(SlowDown|InternalError|ServiceUnavailable)</Code>")
_GATEWAY_ERROR = re.compile(r"status code: (502 Bad Gateway|504 Gateway Time-?out)")
"""What a proxy in front of a store (an ingress before MinIO, a load balancer) answers when the
store behind it is down or silent: the store is unreachable, as a refused connection says."""
_BODY_ERRORS = ("response body", "error decoding", "invalid list response", "connection reset", "unexpected eof")
_AUTH_CODES = ("403 Forbidden", "401 Unauthorized", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")
_MD5_HEX = re.compile(r"[0-9a-fA-F]{32}")
_METADATA_MARKERS = ("/latest/api/token", "/latest/meta-data", "/computeMetadata/", "/metadata/identity/oauth2/token")
"""Where a store client asks the cloud's metadata server for credentials when none are given
(AWS IMDS, GCE metadata, Azure IMDS): its failure means no credentials, not a denial."""
_CREDENTIALS_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or --opt profile=NAME, or ",
    "gcs": "set GOOGLE_APPLICATION_CREDENTIALS or GOOGLE_SERVICE_ACCOUNT, or ",
    "azure": "set AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_KEY or AZURE_CLIENT_ID/AZURE_CLIENT_SECRET/AZURE_TENANT_ID, or ",
}
_OS_MESSAGE = re.compile(r'(?:message|error): "([^"]+)"')
_WAITED = re.compile(r"Error performing \w+ \S+ in ([\d.]+)s, after (\d+) retries")


def _bare_etag(etag: str) -> str:
    """An ETag without its weak mark and quotes: the same version whichever way a response wrote it."""
    return etag.removeprefix("W/").strip('"')


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


def _unreachable_why(exc: BaseException, message: str) -> str:
    """The system's words for a connection failure ("Connection refused", "failed to lookup
    address information: Name or service not known"), which obstore keeps deep in its debug
    dump, rather than its own ("error sending request"); for a store that took the connection
    and never answered, how long it was given; else its first line."""
    os_error = _OS_MESSAGE.search(str(exc))
    if os_error:
        return os_error.group(1)
    waited = _WAITED.search(message)
    if waited and "error sending request" in message and "kind: Timeout" in str(exc):
        tries = int(waited.group(2)) + 1
        return f"no answer in {float(waited.group(1)):.0f} s, {tries} tr{'y' if tries == 1 else 'ies'}"
    return message


def _is_connection_failure(message: str) -> bool:
    lowered = message.lower()
    return any(
        marker in lowered
        for marker in ("error sending request", "connection refused", "timed out", "dns error", "tcp connect")
    )


class ObstoreSource:
    """A `Source` backed by an obstore store rooted at `url`. `kind` is the store kind ("file",
    "s3", "gcs", "azure", "http"): local reads are not retried, and only S3 ETags are MD5s."""

    def __init__(
        self,
        url: str,
        store: Any,
        endpoint: str | None = None,
        options: dict[str, str] | None = None,
        *,
        kind: str = "file",
        settings: Settings | None = None,
    ) -> None:
        obstore_started()
        self.url = url.rstrip("/")
        self.store = store
        self.endpoint = endpoint
        self.options = dict(options or {})
        self.kind = kind
        self.etag_is_md5 = kind == "s3"
        self.local = kind == "file"
        timeout = (settings or Settings.from_env()).retry_timeout
        self.retry = retry.RetryPolicy(self.where(), timeout, attempts=1 if kind == "file" else 5)

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
        if any(marker in str(exc) for marker in _METADATA_MARKERS):  # no credentials given: the cloud's metadata server was asked
            return SourceAuthError(f"{where}: no credentials found ({_CREDENTIALS_HINTS.get(self.kind, '')}"
                                   "--opt anonymous=true for public data)")
        if isinstance(exc, (obx.PermissionDeniedError, obx.UnauthenticatedError, PermissionError)):
            return SourceAuthError(f"{where}: access denied ({message})")
        if isinstance(exc, obx.UnknownConfigurationKeyError):
            return InvalidArgument(f"{where}: {message}")
        if isinstance(exc, obx.InvalidPathError):  # a name with a newline or bytes that are not UTF-8: shown whole, escaped
            name = str(exc).partition("\n\nDebug source:")[0].replace("\n", "\\n")
            return SourceError(f"{where}: {name} (rename that file, or mount a directory without it)")
        if isinstance(exc, obx.NotSupportedError) and "Range request not supported" in message:
            return SourceError(
                f"{where}: the server ignores Range requests, so only whole files can be read from it "
                "(files up to one cache block, with the cache on); serve the files with one that honours "
                "them (nginx, any object store)"
            )
        if _is_connection_failure(message) or isinstance(exc, (ConnectionError, TimeoutError)):
            return SourceUnreachable(f"{where}: cannot reach the store ({_unreachable_why(exc, message)})")
        if gateway := _GATEWAY_ERROR.search(message):
            return SourceUnreachable(f"{where}: cannot reach the store (a proxy in front of it answered {gateway[1]})")
        if any(code in message for code in _AUTH_CODES):
            return SourceAuthError(f"{where}: access denied ({message})")
        return SourceError(f"{where}: {message}")

    def failure(self, exc: Exception, key: str = "") -> Exception:
        """`translate`, wrapped in `Retryable` when another attempt may succeed: the store was
        unreachable, answered 5xx (SlowDown), or the body broke off. Not found, changed,
        denied and invalid are final."""
        error = self.translate(exc, key)
        if self.kind == "file":
            return error
        text = str(exc)
        if type(error) is SourceUnreachable:
            return Retryable("connection failure", error)
        if type(error) is SourceError and _SERVER_ERROR.search(text):
            return Retryable("server error", error)
        if type(error) is SourceError and any(marker in text.lower() for marker in _BODY_ERRORS):
            return Retryable("broken response body", error)
        return error

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
        """Keys come in order, so a listing that breaks resumes after the last key it got:
        nothing twice, nothing dropped. Attempts count from the last page that arrived."""
        attempts = self.retry.begin()
        last: str | None = None
        while True:
            try:
                for chunk in obstore.list(self.store, offset=last, chunk_size=LIST_CHUNK):
                    if chunk:
                        last = chunk[-1]["path"]
                    attempts.progress()
                    yield [self._info(meta) for meta in chunk if not meta["path"].endswith("/")]
                attempts.progress()  # an empty listing is an answer too
                return
            except (obx.BaseError, OSError) as exc:
                failure = self.failure(exc)
                if not isinstance(failure, Retryable):
                    if isinstance(failure, SourceError):
                        retry.answered(self.retry, failure)
                    raise failure from exc
                attempts.failed(failure)

    def head(self, key: str) -> ObjectInfo:
        def attempt() -> ObjectInfo:
            try:
                return self._info(obstore.head(self.store, key))
            except (obx.BaseError, OSError) as exc:
                raise self.failure(exc, key) from exc

        return retry.call(self.retry, attempt)

    async def head_async(self, key: str) -> ObjectInfo:
        async def attempt() -> ObjectInfo:
            try:
                return self._info(await obstore.head_async(self.store, key))
            except (obx.BaseError, OSError) as exc:
                raise self.failure(exc, key) from exc

        return await retry.call_async(self.retry, attempt)

    def put(self, key: str, data: bytes | bytearray | memoryview) -> ObjectInfo:
        """One PUT (S3, GCS and Azure make it visible whole; a local store writes a temp file and
        renames it), retried like reads; then the object as a HEAD reports it."""

        def attempt() -> None:
            try:
                obstore.put(self.store, key, memoryview(data), mode="overwrite")
            except (obx.BaseError, OSError) as exc:
                raise self.failure(exc, key) from exc

        retry.call(self.retry, attempt)
        return self.head(key)

    async def put_file_async(self, key: str, path: str) -> ObjectInfo:
        """Upload a local file as `key`: parts of UPLOAD_PART in parallel for a big one (obstore's
        multipart upload), one PUT otherwise; the object appears whole or not at all. Retried like
        every store call (a throttling store's 503 SlowDown backs off); then the object as a HEAD
        reports it."""

        async def attempt() -> None:
            try:
                await obstore.put_async(
                    self.store, key, Path(path), mode="overwrite", chunk_size=UPLOAD_PART, max_concurrency=UPLOAD_CONCURRENCY
                )
            except (obx.BaseError, OSError) as exc:
                raise self.failure(exc, key) from exc

        await retry.call_async(self.retry, attempt)
        return await self.head_async(key)

    def delete(self, keys: Sequence[str]) -> None:
        """Delete `keys` (a bulk delete where the store has one), retried like every store call;
        an object already gone is no error."""

        def attempt() -> None:
            try:
                obstore.delete(self.store, list(keys))
            except (obx.BaseError, OSError) as exc:
                failure = self.failure(exc, keys[0] if len(keys) == 1 else "")
                if not isinstance(failure, ObjectMissing):
                    raise failure from exc

        if keys:
            retry.call(self.retry, attempt)

    async def delete_async(self, key: str) -> None:
        """Delete `key`; an object already gone is no error."""

        async def attempt() -> None:
            try:
                await obstore.delete_async(self.store, key)
            except (obx.BaseError, OSError) as exc:
                failure = self.failure(exc, key)
                if not isinstance(failure, ObjectMissing):
                    raise failure from exc

        await retry.call_async(self.retry, attempt)

    @staticmethod
    def _get_options(start: int, end: int, expect: ObjectInfo | None, conditional: bool) -> GetOptions:
        """A whole object pinned to its version is asked for without a Range header: servers
        that ignore ranges (Python's http.server, many static sites) then serve every file up to
        a block whole. An unpinned read (an immutable mount) keeps its range, so an object grown
        since it was listed is read up to its listed size."""
        whole = conditional and expect is not None and start == 0 and end == expect.size
        options: GetOptions = {} if whole else {"range": (start, end)}
        if expect is not None and conditional:
            if expect.etag:
                options["if_match"] = expect.etag
            elif expect.mtime > 0:
                options["if_unmodified_since"] = datetime.fromtimestamp(expect.mtime, UTC)
        return options

    def get_range(
        self, key: str, start: int, end: int, expect: ObjectInfo | None = None, *, conditional: bool = True
    ) -> memoryview:
        """Bytes [start, end) of `key`, checked (see the module doc); `expect` is what the caller
        knows of the object, `conditional` pins its version (see `Source.get_range`)."""
        options = self._get_options(start, end, expect, conditional)
        mismatches: set[str] = set()
        one_request = self._one_request(start, end, expect, conditional)

        def attempt() -> memoryview:
            nonlocal one_request
            if one_request:
                one_request = False
                data = self._one_request_read(key, start, end, expect)
                if data is not None:
                    return data
            try:
                result = obstore.get(self.store, key, options=options)
                data = memoryview(result.bytes())
            except (obx.BaseError, OSError) as exc:
                raise self.failure(exc, key) from exc
            if self._whole(key, start, end, expect, conditional, result, data):
                self._check_hashes(key, data, expect, result.meta.get("e_tag"), mismatches)
            return data

        return retry.call(self.retry, attempt)

    async def get_range_async(
        self, key: str, start: int, end: int, expect: ObjectInfo | None = None, *, conditional: bool = True
    ) -> memoryview:
        """`get_range` for the agent's event loop; the I/O and the hashing run without the GIL."""
        options = self._get_options(start, end, expect, conditional)
        mismatches: set[str] = set()
        one_request = self._one_request(start, end, expect, conditional)

        async def attempt() -> memoryview:
            nonlocal one_request
            if one_request:
                one_request = False
                data = await self._one_request_read_async(key, start, end, expect)
                if data is not None:
                    return data
            try:
                result = await obstore.get_async(self.store, key, options=options)
                data = memoryview(await result.bytes_async())
            except (obx.BaseError, OSError) as exc:
                raise self.failure(exc, key) from exc
            if self._whole(key, start, end, expect, conditional, result, data):
                await self._hashing(data, self._check_hashes, key, data, expect, result.meta.get("e_tag"), mismatches)
            return data

        return await retry.call_async(self.retry, attempt)

    def _one_request(self, start: int, end: int, expect: ObjectInfo | None, conditional: bool) -> bool:
        """Whether a read may go without the response's metadata: one plain ranged GET, whose
        bytes arrive in one completion instead of two (`benchmarks/epochs.py --immutable` against
        strict mounts: the agent's CPU per cold object over HTTP a quarter less). So may a read
        that pins no version (an immutable mount), and a read of a whole object on an object
        store whose listing names its bytes (a manifest content hash, a plain S3 ETag): bytes
        that match it are the listed version, which is what `If-Match` makes sure of. HTTP
        servers may ignore ranges, so their pinned reads stay as they are; local files gain
        nothing. Only a first attempt goes so: a retry asks in full, which tells a changed
        object from a damaged transfer."""
        if end <= start or self.kind == "file":
            return False
        if not conditional:
            return True
        if expect is None or start != 0 or end != expect.size or self.kind == "http":
            return False
        return bool(expect.content_hash) or bool(self.etag_is_md5 and _MD5_HEX.fullmatch((expect.etag or "").strip('"')))

    def _one_request_read(self, key: str, start: int, end: int, expect: ObjectInfo | None) -> memoryview | None:
        """A one-request read's bytes (`_one_request`), checked against the listing: a
        disagreement is retried (asked in full). None when the store refused it in a way a full
        request says better (an object that shrank or is gone, a server that ignores ranges):
        that request follows at once."""
        try:
            data = memoryview(obstore.get_range(self.store, key, start=start, end=end))
        except (obx.BaseError, OSError) as exc:
            self._raise_if_retryable(exc, key)
            return None
        self._check_listed(key, start, end, expect, data)
        return data

    async def _one_request_read_async(self, key: str, start: int, end: int, expect: ObjectInfo | None) -> memoryview | None:
        try:
            data = memoryview(await obstore.get_range_async(self.store, key, start=start, end=end))
        except (obx.BaseError, OSError) as exc:
            self._raise_if_retryable(exc, key)
            return None
        await self._hashing(data, self._check_listed, key, start, end, expect, data)
        return data

    def _raise_if_retryable(self, exc: Exception, key: str) -> None:
        failure = self.failure(exc, key)
        if isinstance(failure, Retryable):
            raise failure from exc

    def _check_listed(self, key: str, start: int, end: int, expect: ObjectInfo | None, data: memoryview) -> None:
        """A one-request read's length, and a whole object's hashes as the listing names them."""
        self._check_length(key, data, start, end)
        if expect is not None and start == 0 and end == expect.size:
            self._check_hashes(key, data, expect, expect.etag, set())

    @staticmethod
    async def _hashing(data: memoryview, check: Callable[..., T], *args: Any) -> T:
        """`check(*args)`, which hashes `data`: a long body's off the event loop (hashlib
        releases the GIL)."""
        if len(data) >= HASH_IN_THREAD:
            return await asyncio.to_thread(check, *args)
        return check(*args)

    def _whole(
        self, key: str, start: int, end: int, expect: ObjectInfo | None, conditional: bool, result: GetResult, data: memoryview
    ) -> bool:
        """Check the length of what arrived; True when it is the whole object, so hashes apply."""
        where = self.where(key)
        size = int(result.meta["size"])
        hashed_whole = expect is not None and expect.content_hash and start == 0 and end == expect.size
        if (conditional or hashed_whole) and expect is not None and size != expect.size:
            # a hashed object whose size changed can never match its hash (immutable mounts too)
            raise ObjectChanged(
                f"{where}: the object changed at the source since it was listed ({size} bytes, not {expect.size})"
            )
        if conditional and expect is not None:
            self._check_version(where, expect, result.meta)
        first, last = result.range
        self._check_length(key, data, first, last)
        if (first, last) != (start, end):
            raise ObjectChanged(
                f"{where}: the source returned {len(data)} bytes ([{first}, {last})) for [{start}, {end}); it is {size} bytes now"
            )
        return start == 0 and end == size

    @staticmethod
    def _check_version(where: str, expect: ObjectInfo, meta: ObjectMeta) -> None:
        """A pinned read answered with another version: a server that ignores If-Match and
        If-Unmodified-Since (Python's http.server) sends what it has now, which its response's
        ETag tells apart, else its Last-Modified when it is later than the listed time by more
        than HTTP dates' whole seconds can round (If-Unmodified-Since's own test)."""
        etag, modified = meta.get("e_tag"), meta.get("last_modified")
        if expect.etag and etag:
            if _bare_etag(etag) != _bare_etag(expect.etag):
                raise ObjectChanged(f"{where}: the object changed at the source since it was listed "
                                    f"(ETag {etag}, not {expect.etag})")
        elif not expect.etag and expect.mtime > 0 and modified is not None and modified.timestamp() > expect.mtime + 1:
            listed = datetime.fromtimestamp(expect.mtime, UTC).isoformat(timespec="seconds")
            raise ObjectChanged(f"{where}: the object changed at the source since it was listed "
                                f"(modified {modified.isoformat(timespec='seconds')}, not {listed})")

    def _check_length(self, key: str, data: memoryview, first: int, last: int) -> None:
        """A body that is not as long as the range it answers broke off (or ran on): retried."""
        if len(data) != last - first:
            raise Retryable(
                "broken response body",
                SourceError(f"{self.where(key)}: the store sent {len(data)} bytes for the {last - first} of [{first}, {last})"),
            )

    def _check_hashes(
        self, key: str, data: memoryview, expect: ObjectInfo | None, etag: str | None, mismatches: set[str]
    ) -> None:
        """Compare a whole object's bytes with the manifest's content hash, and on S3 with a
        plain ETag. A mismatch is retried. Some S3 ETags are 32 hex digits yet no MD5 of the
        bytes (SSE-KMS, SSE-C): when two reads bring the same bytes that disagree with the
        ETag, it is such an ETag, not a bad transfer, and this source stops checking ETags."""
        where = self.where(key)
        if expect is not None and expect.content_hash:
            algorithm, _, wanted = expect.content_hash.partition(":")
            try:
                got = hashlib.new(algorithm.lower(), data).hexdigest()
            except ValueError:
                raise InvalidArgument(f"{where}: content hash {expect.content_hash!r}: unknown hash algorithm") from None
            if got != wanted.lower():
                raise Retryable(
                    "integrity mismatch",
                    ObjectCorrupted(
                        f"{where}: the bytes read hash to {algorithm}:{got}, the manifest says {expect.content_hash}"
                    ),
                )
        plain = (etag or "").strip('"')
        if not (self.etag_is_md5 and _MD5_HEX.fullmatch(plain)):
            return
        got = hashlib.md5(data).hexdigest()
        if got == plain.lower():
            return
        if got in mismatches:
            self.etag_is_md5 = False
            log.warning(
                "%s: ETag %s is not the MD5 of the object's bytes (%s) on two reads (an encrypted object?); "
                "ETags of this source are no longer checked", where, plain, got,
            )
            return
        mismatches.add(got)
        raise Retryable(
            "integrity mismatch",
            ObjectCorrupted(f"{where}: the bytes read hash to md5:{got}, the store's ETag says md5:{plain.lower()}"),
        )
