"""Every way a source can fail, against real servers: one clear error naming the place."""

from __future__ import annotations

import functools
import http.server
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from obstore import exceptions as obx

import gpufeed
from gpufeed.client.connection import stop_agent
from gpufeed.config import Settings
from gpufeed.errors import (
    InvalidArgument,
    ObjectChanged,
    ObjectMissing,
    PathNotFound,
    SourceAuthError,
    SourceError,
    SourceUnreachable,
)
from gpufeed.meta.manifest import ManifestStats, entries_from_listing
from gpufeed.namespace import Namespace
from gpufeed.sources import open_source
from gpufeed.sources.base import ObjectInfo
from gpufeed.sources.objstore import ObstoreSource
from tests.conftest import Bucket, HttpServer


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A TCP server that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("s3://some-bucket/p", {"endpoint": "ENDPOINT"}),
        ("gs://some-bucket/p", {"endpoint": "ENDPOINT", "anonymous": "true"}),
        ("az://container/p", {"endpoint": "ENDPOINT", "account": "acct", "anonymous": "true"}),
        ("ENDPOINT/site", {}),
    ],
)
@pytest.mark.parametrize("server", ["refused", "silent"])
def test_unreachable_endpoint_fails_within_timeout(
    url: str, options: dict[str, str], server: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUFEED_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("GPUFEED_CONNECT_TIMEOUT", "1")
    monkeypatch.setenv("GPUFEED_RETRY_TIMEOUT", "2")
    endpoint = closed_port() if server == "refused" else request.getfixturevalue("blackhole")
    url = url.replace("ENDPOINT", endpoint)
    options = {k: v.replace("ENDPOINT", endpoint) for k, v in options.items()}
    started = time.monotonic()
    with pytest.raises(SourceUnreachable) as caught:
        Namespace().add_mount("/remote", url, options)
    assert time.monotonic() - started < 30, "an unreachable endpoint must fail, not hang"
    assert endpoint.removeprefix("http://") in str(caught.value)
    assert not str(caught.value).startswith(f"{url}/.gpufeed-pack"), "named as the mount's URL, whatever request found it out"
    if server == "refused":
        assert str(caught.value).endswith("(Connection refused)"), "the system's words, not the client library's"
    elif url.startswith(("s3:", "gs:", "az:")):  # an HTTP index listing says "timed out" itself
        assert re.search(r"cannot reach the store \(no answer in \d+ s, \d+ tr(y|ies)\)$", str(caught.value)), caught.value
    assert Namespace().mounts() == []


def test_wrong_credentials(moto_auth_endpoint: str) -> None:
    with pytest.raises(SourceAuthError, match=r"s3://guarded .*access denied .*InvalidAccessKeyId"):
        Namespace().add_mount("/s3", "s3://guarded", {"endpoint": moto_auth_endpoint})


def test_no_credentials_at_all(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    options = {"endpoint": moto_endpoint, "metadata_endpoint": closed_port()}  # not the cloud's real one
    with pytest.raises(SourceAuthError, match="no credentials found"):
        Namespace().add_mount("/s3", "s3://some-bucket", options)


def test_missing_bucket_names_bucket_and_endpoint(moto_endpoint: str) -> None:
    with pytest.raises(SourceError, match=rf"s3://no-such-bucket \(endpoint {moto_endpoint}\): .*NoSuchBucket"):
        Namespace().add_mount("/s3", "s3://no-such-bucket", {"endpoint": moto_endpoint})


def test_s3_credentials_from_a_profile(bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket.put("k", b"v")
    credentials = tmp_path / "credentials"
    credentials.write_text("[ml]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    _, stats = Namespace().add_mount("/s3", bucket.url, {"endpoint": bucket.endpoint, "profile": "ml", "region": "us-east-1"})
    assert stats.files == 1
    with pytest.raises(InvalidArgument, match="profile 'nope'"):
        Namespace().add_mount("/s3b", bucket.url, {"endpoint": bucket.endpoint, "profile": "nope"})


@pytest.mark.parametrize(
    ("url", "options", "message"),
    [
        ("ftp://host/x", {}, "unsupported URL scheme 'ftp'"),
        ("/plain/path", {}, "unsupported URL scheme ''"),
        ("s3:///prefix", {}, "missing bucket name"),
        ("gs://", {}, "missing bucket name"),
        ("az:///x", {}, "missing bucket name"),
        ("s3://b", {"not_a_key": "1"}, "not_a_key"),
        ("gs://b", {"not_a_key": "1", "anonymous": "true"}, "not_a_key"),
        ("az://c", {"not_a_key": "1", "anonymous": "true"}, "not_a_key"),
        ("s3://b", {"anonymous": "perhaps"}, "anonymous='perhaps': expected true or false"),
        ("file://relative/dir", {}, "absolute path"),
        ("file:///tmp", {"endpoint": "x"}, "unknown option"),
        ("http://host/x", {"region": "x"}, "http sources take: list"),
        ("http:///x", {}, "missing host"),
        ("http://[::1", {}, "not a valid URL (Invalid IPv6 URL)"),
        ("http://host:abc/x", {}, "not a valid URL"),
        ("file:///tmp", {"list": "x"}, "--list (a listing file) applies to http(s) sources only"),
        ("s3://b", {"list": "x"}, "--list (a listing file) applies to http(s) sources only"),
    ],
)
def test_bad_urls_and_options(url: str, options: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        open_source(url, options, Settings.from_env())


@pytest.mark.parametrize("url", ["s3://b", "gs://b", "az://c"])
@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("127.0.0.1:9000", "endpoint must start with http:// or https://"),
        ("ftp://host", "endpoint must start with http:// or https://"),
        ("http://", "missing host"),
        ("http://host:port", "Port could not be cast"),
    ],
)
def test_a_malformed_endpoint_is_one_line(url: str, endpoint: str, message: str) -> None:
    """obstore panics (45 lines of Rust) on an endpoint without a scheme; gpufeed answers first."""
    result = subprocess.run(
        [sys.executable, "-m", "gpufeed", "mount", "add", "/x", url, "-o", f"endpoint={endpoint}", "-o", "anonymous=true"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith(f"gpufeed: error: {url}: endpoint {endpoint!r}: {message}"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "panicked" not in result.stderr


def test_an_endpoint_without_scheme_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "localhost:9000")
    with pytest.raises(InvalidArgument, match="endpoint 'localhost:9000': endpoint must start with http:// or https://"):
        open_source("s3://b", {}, Settings.from_env())


def test_gcs_and_azure_urls_parse(tmp_path: Path) -> None:
    gcs = open_source("gs://bucket/some/prefix/", {"anonymous": "true"}, Settings.from_env())
    assert gcs.url == "gs://bucket/some/prefix"
    azure = open_source("az://container/p", {"account": "acct", "anonymous": "true"}, Settings.from_env())
    assert azure.url == "az://container/p"


def test_missing_local_directory(tmp_path: Path) -> None:
    with pytest.raises(PathNotFound, match="file:///no/such/dir: no such directory"):
        Namespace().add_mount("/data", "file:///no/such/dir")
    (tmp_path / "a.txt").write_bytes(b"a")
    with pytest.raises(InvalidArgument, match=f"a.txt: is a file; a mount's source is a directory \\(file://{tmp_path}\\)"):
        Namespace().add_mount("/data", f"file://{tmp_path}/a.txt")


def test_entries_no_key_can_name_are_skipped_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One odd name in a dataset directory (a newline, bytes that are not UTF-8, a symlink loop)
    must not make the whole directory unmountable: it is skipped and named, as rsync does."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "ok.bin").write_bytes(b"ok")
    (src / "new\nline.bin").write_bytes(b"x")
    (src / "sub" / "fine.bin").write_bytes(b"fine")
    os.symlink(src, src / "sub" / "loop")
    os.symlink(src / "l2", src / "l1")
    os.symlink(src / "l1", src / "l2")
    os.symlink(tmp_path / "nowhere", src / "dangling")
    (src / "upload#3").write_bytes(b"an obstore upload part")
    os.mkfifo(src / "sub" / "pipe")
    with open(os.fsencode(src / "sub") + b"/caf\xe9.txt", "wb") as odd:
        odd.write(b"x")
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        mount, stats = Namespace().add_mount("/data", f"file://{src}")
    assert (stats.files, stats.bytes) == (2, 6)
    assert sorted(info.path for info in Namespace().walk("/data")) == ["/data/ok.bin", "/data/sub/fine.bin"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"file://{src}: skipped 7 entries: "), warning
    assert "new\\nline.bin (a control character)" in warning and "sub/caf\\xe9.txt (not UTF-8)" in warning
    assert "sub/loop (a symlink loop)" in warning and "l1 (a symlink loop)" in warning and "l2 (a symlink loop)" in warning
    assert "dangling (a symlink that leads nowhere)" in warning and "sub/pipe (not a regular file)" in warning
    assert gpufeed.read("/data/sub/fine.bin") == b"fine"


def test_a_local_mount_whose_directory_is_gone_still_serves_what_the_cache_holds(tmp_path: Path) -> None:
    """An NFS export down, a dataset moved: the cached files read as before; one that must reach
    the directory names the directory, not a deleted file; a refresh refuses and keeps the mount."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "cached.bin").write_bytes(b"c" * 5000)
    (src / "not-cached.bin").write_bytes(b"n" * 5000)
    Namespace().add_mount("/data", f"file://{src}")
    assert gpufeed.read("/data/cached.bin") == b"c" * 5000
    src.rename(tmp_path / "away")
    stop_agent(Settings.from_env())  # a new agent and a new reader: neither saw the directory
    gpufeed._default = None
    assert gpufeed.read("/data/cached.bin") == b"c" * 5000
    with pytest.raises(PathNotFound, match=f"file://{src}: no such directory"):
        gpufeed.read("/data/not-cached.bin")
    with pytest.raises(PathNotFound, match=f"file://{src}: no such directory"):
        Namespace().refresh("/data")
    (tmp_path / "away").rename(src)
    assert gpufeed.read("/data/not-cached.bin") == b"n" * 5000


def test_a_percent_encoded_file_url_names_its_directory_and_a_literal_percent_still_works(tmp_path: Path) -> None:
    """gpufeed's own file URLs hold the path as it is (`as_url`); one written the standard way
    (`Path.as_uri()`: a space as %20) names the same directory, so the same blocks."""
    spaced, literal = tmp_path / "my data", tmp_path / "100%20done"
    for root in (spaced, literal):
        root.mkdir()
        (root / "a.txt").write_bytes(root.name.encode())
    assert open_source(spaced.as_uri(), {}, Settings.from_env()).url == f"file://{spaced}"
    assert open_source(f"file://{literal}", {}, Settings.from_env()).url == f"file://{literal}", "an existing path wins"


class _HtmlHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_http_without_json_index_asks_for_a_listing_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"a")
    handler = functools.partial(_HtmlHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(SourceError, match="does not serve a JSON directory index; give a listing file with --list"):
            Namespace().add_mount("/web", f"http://127.0.0.1:{server.server_address[1]}/")
    finally:
        server.shutdown()
        thread.join()


class _JsonIndexHandler(http.server.BaseHTTPRequestHandler):
    pages: dict[str, bytes] = {}

    def do_GET(self) -> None:
        body = self.pages.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


def test_a_json_index_with_bad_entries_is_one_error_naming_the_page() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _JsonIndexHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    good = {"name": "x.bin", "type": "file", "size": 3, "mtime": "Sun, 29 Nov 2026 10:00:00 GMT"}
    cases = {
        "/size/": ([good | {"size": "abc"}], "not an nginx JSON index (Expected `int`, got `str` - at `$[0].size`)"),
        "/negative/": ([good | {"size": -5}], "not an nginx JSON index (Expected `int` >= 0 - at `$[0].size`)"),
        "/nosize/": ([{"name": "x.bin", "type": "file"}], "not an nginx JSON index (file 'x.bin' has no size)"),
        "/noname/": ([good | {"name": None}], "not an nginx JSON index (Expected `str`, got `null` - at `$[0].name`)"),
        "/ints/": ([1, 2, 3], "not an nginx JSON index (Expected `object`, got `int` - at `$[0]`)"),
        "/date/": ([good | {"mtime": "yesterday"}], "entry 'x.bin': mtime 'yesterday' is not an HTTP date"),
        "/huge/": ([good | {"size": 2**70}], "not an nginx JSON index (Expected `int` <= 9223372036854775807 - at `$[0].size`)"),
    }
    lenient = [good | {"size": 3.0, "mtime": None}, {"name": "sub", "type": "directory"}, {"name": "odd", "size": 1}]
    _JsonIndexHandler.pages = {path: json.dumps(page).encode() for path, (page, _) in cases.items()}
    _JsonIndexHandler.pages |= {"/lenient/": json.dumps(lenient).encode(), "/lenient/sub/": b"[]"}
    try:
        for path, (_, message) in cases.items():
            with pytest.raises(SourceError) as raised:
                Namespace().add_mount("/web", url + path)
            assert str(raised.value) == f"{url}{path}: {message}"
        _, stats = Namespace().add_mount("/web", url + "/lenient")  # what nginx never writes but the old reader took
        assert (stats.files, stats.bytes) == (1, 3)
    finally:
        server.shutdown()
        thread.join()


def test_a_server_that_ignores_ranges_serves_whole_files(tmp_path: Path) -> None:
    """Python's http.server answers every GET with the whole file: files up to a block are read
    whole (no Range header), a bigger one fails in one line that says why."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "small.bin").write_bytes(b"s" * 1000)
    (site / "big.bin").write_bytes(bytes(range(256)) * 1024)
    listing = tmp_path / "list.txt"
    listing.write_text(f"small.bin 1000\nbig.bin {256 * 1024}\n")
    handler = functools.partial(_HtmlHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        import gpufeed

        url = f"http://127.0.0.1:{server.server_address[1]}/"
        Namespace().add_mount("/plain", url, {"list": str(listing), "block_size": "64KiB"})
        assert gpufeed.read("/plain/small.bin") == b"s" * 1000
        with pytest.raises(SourceError, match=r"big.bin: the server ignores Range requests, so only whole files"):
            gpufeed.read("/plain/big.bin")
    finally:
        server.shutdown()
        thread.join()


def test_a_server_that_ignores_conditions_cannot_pass_off_a_changed_file(tmp_path: Path) -> None:
    """Python's http.server ignores If-Match and If-Unmodified-Since: a pinned read compares the
    response's Last-Modified with the pinned version, and the new bytes are neither served nor
    cached under the old version's name."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "t.bin").write_bytes(b"A" * 8)
    listing = tmp_path / "list.txt"
    listing.write_text("t.bin\n")
    handler = functools.partial(_HtmlHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        import gpufeed

        ns = Namespace()
        ns.add_mount("/plain", f"http://127.0.0.1:{server.server_address[1]}/", {"list": str(listing)})
        (site / "t.bin").write_bytes(b"B" * 8)  # same size, a later time: another version
        later = (site / "t.bin").stat().st_mtime + 10
        os.utime(site / "t.bin", (later, later))
        with pytest.raises(ObjectChanged, match=r"t.bin: changed at the source since mount /plain was listed .*modified "):
            gpufeed.read("/plain/t.bin")
        ns.refresh("/plain")
        assert gpufeed.read("/plain/t.bin") == b"B" * 8
    finally:
        server.shutdown()
        thread.join()


def test_a_response_time_rounded_to_the_second_is_the_listed_version() -> None:
    """HTTP dates are whole seconds: a listing at .9 s and a Last-Modified rounded up to the
    next second are one version; a later one is another."""
    listed = ObjectInfo("k", 8, 1_800_000_000.9)
    at = datetime.fromtimestamp
    ObstoreSource._check_version("here", listed, {"last_modified": at(1_800_000_001, UTC), "e_tag": None})
    ObstoreSource._check_version("here", listed, {"last_modified": at(1_800_000_000, UTC), "e_tag": None})
    with pytest.raises(ObjectChanged, match=r"here: the object changed at the source since it was listed \(modified "):
        ObstoreSource._check_version("here", listed, {"last_modified": at(1_800_000_005, UTC), "e_tag": None})
    tagged = ObjectInfo("k", 8, 0.0, '"abc"')
    ObstoreSource._check_version("here", tagged, {"last_modified": None, "e_tag": 'W/"abc"'})
    with pytest.raises(ObjectChanged, match=r"\(ETag \"abd\", not \"abc\"\)"):
        ObstoreSource._check_version("here", tagged, {"last_modified": None, "e_tag": '"abd"'})


def test_http_listing_file_with_and_without_sizes(nginx: HttpServer, tmp_path: Path) -> None:
    site = nginx.root / f"listed-{tmp_path.name}"
    (site / "d").mkdir(parents=True)
    (site / "d" / "one").write_bytes(b"1" * 11)
    (site / "two").write_bytes(b"2" * 22)
    (site / "d" / "with space.jpg").write_bytes(b"3" * 33)
    (site / "d" / "no size.jpg").write_bytes(b"4" * 4)
    listing = tmp_path / "files.txt"
    listing.write_text("# key size\nd/one 11\n\n/two\nd/with space.jpg\t33\nd/no size.jpg\t\n")
    ns = Namespace()
    _, stats = ns.add_mount("/web", f"{nginx.url}/{site.name}", {"list": str(listing)})
    assert (stats.files, stats.bytes) == (4, 70)
    assert ns.stat("/web/two").size == 22 and ns.stat("/web/d/no size.jpg").size == 4
    assert gpufeed.read("/web/d/with space.jpg") == b"3" * 33, "a key with a space, read from nginx"
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("d/one 999\ntwo 22\n")
    with pytest.raises(InvalidArgument, match=f"wrong.txt: d/one is listed with 999 bytes, but {nginx.url}/.*/d/one has 11"):
        ns.add_mount("/wrong", f"{nginx.url}/{site.name}", {"list": str(wrong)})
    with pytest.raises(ObjectMissing, match="-typo/d/one: not found at the source"):
        ns.add_mount("/typo", f"{nginx.url}/{site.name}-typo", {"list": str(wrong)})
    bad = tmp_path / "bad.txt"
    bad.write_text("d/one eleven\n")
    with pytest.raises(InvalidArgument, match=r"bad.txt:1: expected 'KEY \[SIZE\]' \(a key with spaces: KEY<tab>SIZE\)"):
        ns.add_mount("/web2", f"{nginx.url}/{site.name}", {"list": str(bad)})


def test_http_missing_site_is_not_found(nginx: HttpServer) -> None:
    with pytest.raises(PathNotFound, match="HTTP 404"):
        Namespace().add_mount("/web", f"{nginx.url}/no-such-site")


def test_listing_file_is_needed_only_to_list(nginx: HttpServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = nginx.root / f"rel-{tmp_path.name}"
    site.mkdir()
    (site / "a.bin").write_bytes(b"abc")
    monkeypatch.chdir(tmp_path)
    Path("list.txt").write_text("a.bin 3\n")
    mount, _ = Namespace().add_mount("/web", f"{nginx.url}/{site.name}", {"list": "list.txt"})
    assert mount.options["list"] == str(tmp_path / "list.txt"), "stored absolute"
    Path("list.txt").unlink()
    monkeypatch.chdir("/")
    import gpufeed

    assert gpufeed.read("/web/a.bin") == b"abc"
    with pytest.raises(InvalidArgument, match="listing file .*list.txt: No such file"):
        Namespace().refresh("/web")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 3\n")
    with pytest.raises(InvalidArgument, match="is not UTF-8 text"):
        Namespace().add_mount("/web2", f"{nginx.url}/{site.name}", {"list": str(tmp_path / "latin1.txt")})


def test_an_endpoint_from_the_environment_is_recorded_in_the_mount(bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket.put("k", b"v")
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.endpoint)
    mount, _ = Namespace().add_mount("/s3", bucket.url)
    assert mount.options == {"endpoint": bucket.endpoint, "block_size": "4MiB"}
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    import gpufeed

    assert gpufeed.read("/s3/k") == b"v", "readers and the agent reach the same store"


def test_an_http_source_is_listed_from_code_that_runs_an_event_loop(nginx: HttpServer) -> None:
    """A notebook cell or an async app mounts an HTTP source: the crawl runs on a loop of its own."""
    import asyncio
    import uuid

    from gpufeed.client import Client

    name = f"t-{uuid.uuid4().hex[:8]}"
    (nginx.root / name).mkdir()
    (nginx.root / name / "a.bin").write_bytes(b"q" * 100)
    client = Client()

    async def cell() -> int:
        _, stats = client.namespace.add_mount("/h", f"{nginx.url}/{name}")
        return stats.files

    assert asyncio.run(cell()) == 1
    assert client.read("/h/a.bin") == b"q" * 100


def test_a_key_that_is_also_a_directory_is_named_not_hidden(bucket: Bucket, caplog: pytest.LogCaptureFixture) -> None:
    """S3 holds `a` beside `a/b`; a path is one or the other. The directory stands (as in
    mountpoint-s3), and the file it hides is counted out and named, whichever the listing gives first."""
    for key in ("set/a", "set/a.txt", "set/a/b", "set/z/c"):
        bucket.put(key, key.encode())
    bucket.put("set/z/", b"")  # a folder marker, as the S3 console makes: no file is lost
    with caplog.at_level(logging.WARNING, logger="gpufeed"):
        _, stats = Namespace().add_mount("/set", f"{bucket.url}/set", {"endpoint": bucket.endpoint})
    assert (stats.files, stats.bytes, stats.shadowed) == (3, len(b"set/a.txt" b"set/a/b" b"set/z/c"), 1)
    assert sorted(info.path for info in Namespace().walk("/set")) == ["/set/a.txt", "/set/a/b", "/set/z/c"]
    assert f"{bucket.url}/set: 1 file(s) not shown, a directory of the same name stands there (a)" in caplog.text
    stats = ManifestStats()
    rows = [ObjectInfo(key, 1, 0.0, None, None) for key in ("z/c", "z", "a/b", "a")]  # a listing in no order
    entries = [e for batch in entries_from_listing([rows], stats) for e in batch]
    assert (stats.files, stats.shadowed) == (2, 2) and not [e for e in entries if not e.is_dir and e.name in ("a", "z")]


@pytest.mark.parametrize(
    ("url", "options", "asked", "hint"),
    [
        ("gs://b/p", {}, "http://169.254.169.254/computeMetadata/v1/instance/service-accounts/default/token", "GOOGLE_"),
        ("az://c/p", {"account": "acct"}, "http://169.254.169.254/metadata/identity/oauth2/token?api-version=2019", "AZURE_"),
    ],
)
def test_no_credentials_on_gcs_and_azure_says_what_to_set(url: str, options: dict[str, str], asked: str, hint: str) -> None:
    """Without credentials the store client asks the cloud's metadata server; its refusal (as
    obstore reports it: a cloud we cannot run here, so the error is made at that boundary) is
    'no credentials found' with the variables to set, not 'access denied'."""
    source = open_source(url, options, Settings.from_env())
    refused = obx.GenericError(f"Error performing token request: HTTP status client error (403 Forbidden) for url ({asked})")
    error = source.translate(refused, "k")  # type: ignore[attr-defined]
    assert isinstance(error, SourceAuthError) and "no credentials found (set " in str(error) and hint in str(error), error
    assert str(error).startswith(f"{url}/k: ") and str(error).endswith("or --opt anonymous=true for public data)")
