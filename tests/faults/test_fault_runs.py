"""Issue 11's fault runs: real stores (moto's S3, nginx) behind the fault proxy, read through the
read path (the agent fetches, the cache serves warm reads). Every test asserts that the proxy
really injected faults, so none can pass because nothing went wrong.

The mix is issue 11's: 5 % S3 SlowDown 503s, 2 % resets, 2 % truncated bodies, 1 % one flipped
byte. What the read path must show under it: 0 missing, 0 wrong, 0 duplicated, cold and warm.
"""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

import gpufeed
from gpufeed.bench.faults import FaultControl
from gpufeed.blocks import CHUNK
from gpufeed.errors import GpufeedError, ObjectCorrupted
from gpufeed.namespace import Namespace
from tests.cli.test_cli import fails, ok
from tests.conftest import AWS_TEST_ENV, HttpServer
from tests.faults.conftest import Site

MIX = {"503": 0.05, "reset": 0.02, "truncate": 0.02, "flip": 0.01}
MIX_NO_FLIP = {name: rate for name, rate in MIX.items() if name != "flip"}
BATCH = 50
PARTS = 5  # the objects lie under p0/ .. p4/, 200 in each, 20 in each of 10 directories
FIXED_NAME = "gpufeed-fault-runs"
"""The bucket and the HTTP directory: a fault depends on the request's path, so with fixed
names (and fixed seeds) every run injects the same faults."""


def _objects(count: int = 1000, seed: int = 11) -> dict[str, bytes]:
    """Known content: 1-8 KB of seeded random bytes per key (no two alike)."""
    rng = random.Random(seed)
    per_part = count // PARTS
    return {
        f"p{n // per_part}/d{n % 10}/o{n:04}.bin": rng.randbytes(rng.randint(1024, 8192))
        for n in range(count)
    }


@dataclass
class Dataset:
    objects: dict[str, bytes]
    url: str
    """The URL to mount (through the proxy) with `options`."""
    options: dict[str, str]

    def under(self, prefix: str) -> dict[str, bytes]:
        """The objects under `prefix`/, keyed relative to it."""
        return {key[len(prefix) + 1 :]: data for key, data in self.objects.items() if key.startswith(prefix + "/")}


@pytest.fixture(scope="module")
def s3_objects(moto_endpoint: str) -> tuple[str, dict[str, bytes]]:
    """A bucket of 1,000 objects, written once for the module straight to moto (obstore puts:
    moto is the bottleneck, and boto3 would add its own CPU time on this small machine)."""
    import asyncio

    import boto3  # type: ignore[import-untyped]
    import obstore
    from obstore.store import S3Store

    key_id, secret = AWS_TEST_ENV["AWS_ACCESS_KEY_ID"], AWS_TEST_ENV["AWS_SECRET_ACCESS_KEY"]
    client = boto3.client(
        "s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id=key_id, aws_secret_access_key=secret
    )
    client.create_bucket(Bucket=FIXED_NAME)
    store = S3Store(
        FIXED_NAME, endpoint=moto_endpoint, region="us-east-1", access_key_id=key_id, secret_access_key=secret,
        client_options={"allow_http": True},
    )
    objects = _objects()

    async def put_all() -> None:
        slots = asyncio.Semaphore(16)

        async def put(key: str, data: bytes) -> None:
            async with slots:
                await obstore.put_async(store, key, data)

        await asyncio.gather(*(put(key, data) for key, data in objects.items()))

    asyncio.run(put_all())
    return FIXED_NAME, objects


@pytest.fixture
def s3_data(s3_objects: tuple[str, dict[str, bytes]], moto_faults: FaultControl) -> Dataset:
    name, objects = s3_objects
    return Dataset(objects, f"s3://{name}", {"endpoint": moto_faults.url})


@pytest.fixture(scope="module")
def http_objects(nginx: HttpServer) -> tuple[str, dict[str, bytes]]:
    """1,000 files under a directory of nginx's root, written once for the module."""
    prefix = FIXED_NAME
    objects = _objects()
    for key, data in objects.items():
        path = nginx.root / prefix / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return prefix, objects


@pytest.fixture
def http_data(http_objects: tuple[str, dict[str, bytes]], nginx_faults: FaultControl) -> Dataset:
    prefix, objects = http_objects
    return Dataset(objects, f"{nginx_faults.url}/{prefix}", {})


@dataclass
class Tally:
    missing: int = 0
    wrong: int = 0
    duplicates: int = 0
    first_error: str = ""

    def __str__(self) -> str:
        text = f"{self.missing} missing, {self.wrong} wrong, {self.duplicates} duplicates"
        return f"{text} (first error: {self.first_error})" if self.first_error else text


def _read_all(mount: str, objects: dict[str, bytes], wrong_paths: set[str] | None = None) -> Tally:
    """Every object once through the read path: most in batches (`read_files`, as a DataLoader
    worker reads), every tenth alone (`gpufeed.read`). A read that fails counts its objects as
    missing; bytes of another object count as a duplicate, any other difference as wrong."""
    tally = Tally()
    owner = {data: key for key, data in objects.items()}
    keys = sorted(objects)
    alone = keys[::10]
    batched = sorted(set(keys) - set(alone))
    results: list[tuple[str, bytes]] = []
    for first in range(0, len(batched), BATCH):
        batch = batched[first : first + BATCH]
        try:
            got = gpufeed.client().read_files([f"{mount}/{key}" for key in batch])
        except GpufeedError as exc:
            tally.missing += len(batch)
            tally.first_error = tally.first_error or str(exc)
            continue
        tally.duplicates += max(0, len(got) - len(batch))
        tally.missing += max(0, len(batch) - len(got))
        results += [(key, bytes(data)) for key, data in zip(batch, got, strict=True)]
    for key in alone:
        try:
            results.append((key, gpufeed.read(f"{mount}/{key}")))
        except GpufeedError as exc:
            tally.missing += 1
            tally.first_error = tally.first_error or str(exc)
    for key, data in results:
        if data == objects[key]:
            continue
        if owner.get(data, key) != key:
            tally.duplicates += 1
        else:
            tally.wrong += 1
            if wrong_paths is not None:
                wrong_paths.add(key)
    return tally


def _manifest(mount: str, namespace: Namespace | None = None) -> list[tuple[str, int]]:
    return sorted((item.path, item.size) for item in (namespace or gpufeed.client()).walk(mount))


def _expected(mount: str, objects: dict[str, bytes]) -> list[tuple[str, int]]:
    return sorted((f"{mount}/{key}", len(data)) for key, data in objects.items())


def _cold_and_warm(proxy: FaultControl, data: Dataset, rates: dict[str, float], seed: int) -> None:
    proxy.configure(seed=seed, rates=rates)
    Namespace().add_mount("/d", data.url, data.options)
    assert _manifest("/d") == _expected("/d", data.objects)
    cold = _read_all("/d", data.objects)
    injected = proxy.counts()["injected"]
    warm = _read_all("/d", data.objects)
    assert (str(cold), str(warm)) == (str(Tally()), str(Tally())), injected
    assert all(injected[name] > 0 for name in rates), injected


def test_s3_1000_objects_cold_and_warm_under_the_mix(moto_faults: FaultControl, s3_data: Dataset) -> None:
    _cold_and_warm(moto_faults, s3_data, MIX, seed=1)


def test_http_1000_objects_cold_and_warm_under_the_mix_without_flips(nginx_faults: FaultControl, http_data: Dataset) -> None:
    """Without flips: nothing on a plain HTTP server vouches for an object's bytes (see the
    test below), so flips there are a separate, documented case."""
    _cold_and_warm(nginx_faults, http_data, MIX_NO_FLIP, seed=1)


@pytest.mark.parametrize("kind", ["s3", "http"])
def test_mount_add_under_the_mix_succeeds_for_30_seeds(
    kind: str, moto_faults: FaultControl, nginx_faults: FaultControl, request: pytest.FixtureRequest
) -> None:
    """No path filter: every LIST page and index page is as likely to fail as a data read.
    Each seed mounts p0/: over HTTP its 200 objects in one mount (eleven index pages); on S3,
    whose listing of 200 keys is one request, half of it as five directories (five LISTs: moto
    takes some 40 ms a LIST here, and the whole directory of tests should stay near a minute)."""
    proxy = moto_faults if kind == "s3" else nginx_faults
    data: Dataset = request.getfixturevalue(f"{kind}_data")
    places = [f"p0/d{n}" for n in range(5)] if kind == "s3" else ["p0"]
    namespace = Namespace()
    failed: dict[int, str] = {}
    injected: Counter[str] = Counter()
    for seed in range(30):
        proxy.configure(seed=seed, rates=MIX)
        for n, place in enumerate(places):
            mount = f"/m{seed}-{n}"
            try:
                namespace.add_mount(mount, f"{data.url}/{place}", data.options)
                if _manifest(mount, namespace) != _expected(mount, data.under(place)):
                    failed[seed] = f"{mount}: the manifest differs from the store"
            except GpufeedError as exc:
                failed[seed] = str(exc)
        injected.update(proxy.counts()["injected"])
    assert failed == {}
    assert sum(injected.values()) >= 5, injected


def test_s3_one_byte_corruption_is_never_delivered(moto_faults: FaultControl, s3_data: Dataset) -> None:
    """1 % of GETs carry one flipped byte; each is caught against the object's ETag (the MD5
    of a single-part upload), retried, and neither delivered nor cached."""
    Namespace().add_mount("/d", s3_data.url, s3_data.options)
    moto_faults.configure(seed=2, rates={"flip": 0.01}, path_filter=r"\.bin")
    cold = _read_all("/d", s3_data.objects)
    flips = moto_faults.counts()["injected"]["flip"]
    warm = _read_all("/d", s3_data.objects)
    assert (str(cold), str(warm)) == (str(Tally()), str(Tally()))
    assert flips > 0


def test_http_without_hashes_delivers_flipped_bytes(nginx_faults: FaultControl, http_data: Dataset) -> None:
    """What happens, documented: an HTTP server sends no hash of an object (nginx's ETag is
    mtime-size, not a content hash), so a byte flipped in transit cannot be told from data.
    The length check passes (a flip keeps the length), the object is delivered with the flipped
    byte, and it is cached, so warm reads repeat it. Exactly the objects whose response was
    flipped are wrong, nothing else. A checksums file (`mount add --checksums FILE`) is what
    closes this hole; without one, `verify=always` only protects the cache, not the transfer."""
    Namespace().add_mount("/d", http_data.url, http_data.options)
    nginx_faults.configure(seed=3, rates={"flip": 0.01}, path_filter=r"\.bin$")
    cold_wrong: set[str] = set()
    cold = _read_all("/d", http_data.objects, cold_wrong)
    counts = nginx_faults.counts()
    flipped = {event["target"].split("/", 2)[2] for event in counts["events"]}
    warm_wrong: set[str] = set()
    warm = _read_all("/d", http_data.objects, warm_wrong)
    assert counts["injected"]["flip"] == len(flipped) > 0
    assert cold.missing == cold.duplicates == 0
    assert cold_wrong == flipped
    assert (warm, warm_wrong) == (cold, flipped)
    assert nginx_faults.counts()["requests"] == counts["requests"]  # warm reads never went to the store


def _mount_with_checksums(data: Dataset, sums: Path, *options: str) -> None:
    """`gpufeed mount add /d … --checksums` with a sha256sum file of `data`'s objects."""
    import hashlib

    from gpufeed.cli.main import run

    sums.write_text("".join(f"{hashlib.sha256(body).hexdigest()}  {key}\n" for key, body in data.objects.items()))
    with pytest.raises(SystemExit) as done:
        run(["mount", "add", "/d", data.url, "--checksums", str(sums), *options])
    assert done.value.code == 0


def _flips_never_delivered(faults: FaultControl, objects: dict[str, bytes], seed: int, rate: float) -> None:
    """Read every object cold, then warm, with `rate` of data GETs carrying a flipped byte: none
    missing, wrong or duplicated, and flips did happen."""
    faults.configure(seed=seed, rates={"flip": rate}, path_filter=r"\.bin$")
    cold = _read_all("/d", objects)
    flips = faults.counts()["injected"]["flip"]
    warm = _read_all("/d", objects)
    assert (str(cold), str(warm)) == (str(Tally()), str(Tally()))
    assert flips > 0


def test_http_flip_with_checksums_file(nginx_faults: FaultControl, http_data: Dataset, tmp_path: Path) -> None:
    """With a sha256sum file (`mount add --checksums`), a flipped byte on HTTP is caught like an
    S3 ETag mismatch, retried, and never delivered or cached."""
    _mount_with_checksums(http_data, tmp_path / "SHA256SUMS")
    _flips_never_delivered(nginx_faults, http_data.objects, seed=3, rate=0.01)



def test_http_flip_in_multi_block_objects_with_checksums(nginx_faults: FaultControl, http_data: Dataset, tmp_path: Path) -> None:
    """Objects larger than a block: the agent fetches a hashed object whole, checks it, then caches
    its blocks, so a flipped byte in any block is retried and never delivered or cached."""
    _mount_with_checksums(http_data, tmp_path / "SHA256SUMS", "--opt", "block_size=4KiB")
    assert sum(len(data) > 4096 for data in http_data.objects.values()) > 300, "most objects span blocks"
    _flips_never_delivered(nginx_faults, http_data.objects, seed=5, rate=0.02)


def test_a_hash_that_never_matches_fails_in_one_line_naming_both(nginx: HttpServer, tmp_path: Path) -> None:
    """A checksums file that disagrees with the store: every attempt fails the check, the read
    fails with ObjectCorrupted naming the object and both hashes, and nothing is cached."""
    import hashlib

    site = nginx.root / f"wrong-{tmp_path.name}"
    site.mkdir()
    data = os.urandom(10_000)
    (site / "a.bin").write_bytes(data)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{'0' * 64}  a.bin\n")
    gpufeed_cli = [sys.executable, "-m", "gpufeed"]
    added = subprocess.run([*gpufeed_cli, "mount", "add", "/v", f"{nginx.url}/{site.name}", "--checksums", str(sums)],
                           capture_output=True, text=True)
    assert added.returncode == 0, added.stderr
    cat = subprocess.run([*gpufeed_cli, "cat", "/v/a.bin"], capture_output=True)
    lines = cat.stderr.decode().strip().splitlines()
    assert cat.returncode == 1 and cat.stdout == b"" and len(lines) == 1, cat.stderr
    assert "a.bin" in lines[0] and "0" * 64 in lines[0] and hashlib.sha256(data).hexdigest() in lines[0]
    assert gpufeed.client().agent.stats().blocks == 0, "nothing was cached"


def test_verify_records_what_the_store_holds_not_a_copy_flipped_in_transit(nginx_faults: FaultControl, site: Site) -> None:
    """On HTTP a byte flipped in transit before any hash was known is delivered and cached (see
    above); `gpufeed verify` hashes the store's bytes, not that copy, so the recorded hash is the
    right one and later reads of the object succeed."""
    from gpufeed import verify as verifying
    from gpufeed.client import Client

    good = bytes(range(256)) * 20
    (site.root / "a.bin").write_bytes(good)
    client = Client()
    client.namespace.add_mount("/h", f"{nginx_faults.url}{site.prefix}")
    nginx_faults.configure(seed=0, rates={"flip": 1.0}, path_filter=r"\.bin$")
    assert client.read("/h/a.bin") != good, "the flipped copy is what the cache holds now"
    nginx_faults.configure(seed=0, rates={}, path_filter=None)
    done = verifying.verify(client, verifying.listed(client, "/h"))
    assert (done.recorded, done.mismatches) == (1, [])
    assert client.stat("/h/a.bin").content_hash == "sha256:" + hashlib.sha256(good).hexdigest()
    assert Client().read("/h/a.bin") == good, "a hashed object's blocks have names of their own: fetched anew, checked"


def _packed_site(site: Site, tmp_path: Path, objects: dict[str, bytes]) -> tuple[str, ...]:
    """`objects` packed in 1 MiB shards under `site`'s directory of nginx: the pack's URL path,
    then what mounts it (HTTP sources are not probed for a pack: the format is said)."""
    raw = tmp_path / "raw"
    for key, data in objects.items():
        (raw / key).parent.mkdir(parents=True, exist_ok=True)
        (raw / key).write_bytes(data)
    ok("mount", "add", "/raw", raw.as_uri())
    pack = site.root / "pack"
    ok("pack", "/raw", pack.as_uri(), "--shard-size", "1MiB")
    return f"{site.prefix}/pack", "--opt", "format=gpufeed-pack"


def test_http_flip_in_a_packs_shards_is_caught_by_its_chunk_sums(nginx_faults: FaultControl, site: Site, tmp_path: Path) -> None:
    """Nothing on a plain HTTP server vouches for a shard's bytes (see above), but a gpufeed
    pack's index lists each shard's chunk sums: a byte flipped in the GET of a shard block is
    caught as the block's header is made and read again; no flipped byte is delivered or cached.
    A block flipped on both of its reads fails them, as a damaged shard does; which GETs are
    flipped depends on timing (a batch reads around blocks being cached), so the test counts:
    every read is right or fails for its chunk sums, and more flips were caught than failed."""
    objects = _objects(3000, seed=14)
    pack, *how = _packed_site(site, tmp_path, objects)
    ok("mount", "add", "/d", f"{nginx_faults.url}{pack}", *how, "--opt", "block_size=256KiB")
    nginx_faults.configure(seed=1, rates={"flip": 0.15}, path_filter=r"\.gfp$")
    keys = sorted(objects)
    cold: dict[str, bytes] = {}
    failed: set[str] = set()
    for first in range(0, len(keys), BATCH):
        batch = keys[first : first + BATCH]
        try:
            cold.update(zip(batch, map(bytes, gpufeed.client().read_files([f"/d/{key}" for key in batch])), strict=True))
        except ObjectCorrupted as exc:
            assert "its pack index lists xxh3:" in str(exc)
            failed.add(str(exc).split(": ", 1)[1].split(" hash to")[0])  # the shard and the chunk
    flips = nginx_faults.counts()["injected"]["flip"]
    assert flips > 2 * len(failed), "more flips were caught by a second read than failed twice"
    assert len(cold) > len(objects) // 2 and all(data == objects[key] for key, data in cold.items())
    nginx_faults.configure(seed=1, rates={}, path_filter=None)
    warm = dict(zip(cold, map(bytes, gpufeed.client().read_files([f"/d/{key}" for key in cold])), strict=True))
    assert warm == cold and nginx_faults.counts()["requests"] == 0, "all of it cached, and right"


def test_a_damaged_shard_fails_its_members_in_one_line_and_caches_nothing(nginx: HttpServer, site: Site, tmp_path: Path) -> None:
    """A shard changed at rest behind the store's back (same size, same mtime, so the same
    nginx ETag): its blocks fail their chunk sums, so its members' reads fail in one line naming
    the member and the shard, nothing of it is cached, and the other shards' members read. With
    the cache off a read is checked by the chunks it lies in: only members in the damaged chunk fail."""
    rng = random.Random(7)
    objects = {f"d/{n:03}.bin": rng.randbytes(20_000) for n in range(100)}
    pack, *how = _packed_site(site, tmp_path, objects)
    ok("mount", "add", "/d", f"{nginx.url}{pack}", *how)
    ok("mount", "add", "/off", f"{nginx.url}{pack}", *how, "--opt", "cache=off")
    members = {key: gpufeed.client().handle(f"/d/{key}").member for key in objects}
    spans = {key: (m.pack_key, m.pack_offset or 0, (m.pack_offset or 0) + m.size) for key, m in members.items() if m is not None}
    shard = spans["d/000.bin"][0]
    path = site.root / "pack" / str(shard)
    before = path.stat()
    with open(path, "r+b") as f:  # one byte of the shard's second chunk
        f.seek(CHUNK + 100)
        byte = f.read(1)
        f.seek(CHUNK + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    in_shard = {key for key, (key_shard, _, _) in spans.items() if key_shard == shard}
    in_chunk = {key for key in in_shard if spans[key][1] < 2 * CHUNK and spans[key][2] > CHUNK}
    assert len(spans) == len(objects) and 0 < len(in_chunk) < len(in_shard) < len(objects)

    def failures(mount: str) -> dict[str, str]:
        """Key → error of each object whose read failed; the others must be right."""
        failed = {}
        for key, data in objects.items():
            try:
                assert gpufeed.read(f"{mount}/{key}") == data, key
            except GpufeedError as exc:
                failed[key] = str(exc)
        return failed

    cold = failures("/d")
    assert set(cold) == in_shard
    assert all(f"{shard}: bytes [{CHUNK}, {2 * CHUNK}) hash to xxh3:" in error for error in cold.values())
    other_shards = len({key_shard for key_shard, _, _ in spans.values()}) - 1
    assert gpufeed.client().agent.stats().blocks == other_shards, "one block per other shard, none of the damaged one"
    line = fails(1, "cat", f"/d/{sorted(in_shard - in_chunk)[0]}")
    assert str(shard) in line and "its pack index lists xxh3:" in line

    off = failures("/off")
    assert set(off) == in_chunk
    assert all(error.startswith(f"/off/{key}: ") and "its pack index lists" in error for key, error in off.items())
    with pytest.raises(ObjectCorrupted) as caught:  # one batch sharing reads of chunks: it names a file of the bad one
        gpufeed.client().read_files([f"/off/{key}" for key in sorted(in_shard)])
    assert str(caught.value).split(": ", 1)[0] in {f"/off/{key}" for key in in_chunk}, str(caught.value)


def test_an_http_directory_without_a_pack_mounted_as_one_is_one_line(nginx: HttpServer, site: Site, tmp_path: Path) -> None:
    """Where the index hides the pack's directory, its index and shards are looked up by HEAD: a
    directory holding no pack, or a pack missing a shard, says so in one line."""
    (site.root / "a.bin").write_bytes(b"x")
    url = f"{nginx.url}{site.prefix}"
    line = fails(1, "mount", "add", "/p", url, "--opt", "format=gpufeed-pack")
    assert line.endswith(f"{url}/.gpufeed-pack/index: no pack index (was 'gpufeed pack' interrupted? run it again)"), line
    pack, *how = _packed_site(site, tmp_path, {"d/a.bin": b"a" * 1000})
    shard = next((site.root / "pack" / ".gpufeed-pack" / "shards").glob("*.gfp"))
    shard.unlink()
    line = fails(1, "mount", "add", "/p", f"{nginx.url}{pack}", *how)
    assert f"{shard.name}: shard missing, the index says 1000 bytes" in line, line
