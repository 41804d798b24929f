"""A Mosaic MDS directory read in place: each sample's column is a file whose bytes are a range of
its shard. The shards are written here exactly as streaming's MDSWriter lays them out
(streaming/base/format/mds/writer.py: sorted columns, a u32 size per variable-size column, then
the columns' bytes; a shard is a u32 count, u32 offsets, then the samples); benchmarks/pack.py
reads the real MDSWriter's output the same way."""

from __future__ import annotations

import json
import random
import struct

import gpufeed
from gpufeed.namespace import Namespace
from tests.cli.test_cli import fails
from tests.conftest import Bucket

COLUMNS = {"image": ("bytes", None), "label": ("int", 8), "name": ("str", None)}


def encode(sample: dict[str, bytes]) -> bytes:
    names = sorted(COLUMNS)
    sizes = [len(sample[n]) for n in names if COLUMNS[n][1] is None]
    return struct.pack(f"<{len(sizes)}I", *sizes) + b"".join(sample[n] for n in names)


def mds_shard(samples: list[dict[str, bytes]]) -> bytes:
    encoded = [encode(s) for s in samples]
    offsets = [4 + 4 * (len(encoded) + 1)]
    for e in encoded:
        offsets.append(offsets[-1] + len(e))
    return struct.pack(f"<I{len(offsets)}I", len(encoded), *offsets) + b"".join(encoded)


def shard_entry(basename: str, data: bytes, count: int) -> dict:
    names = sorted(COLUMNS)
    return {
        "column_encodings": [COLUMNS[n][0] for n in names], "column_names": names,
        "column_sizes": [COLUMNS[n][1] for n in names], "compression": None, "format": "mds", "hashes": [],
        "raw_data": {"basename": basename, "bytes": len(data), "hashes": {}}, "samples": count,
        "size_limit": 1 << 26, "version": 2, "zip_data": None,
    }


def test_mds_samples_read_in_place(bucket: Bucket) -> None:
    rng = random.Random(0)
    expected: dict[str, bytes] = {}
    shards = []
    n = 0
    for number in range(2):
        samples = []
        for _ in range(25):
            sample = {"image": rng.randbytes(rng.randint(0, 50_000)), "label": struct.pack("<q", n % 10),
                      "name": f"sample-{n}".encode()}
            samples.append(sample)
            expected.update({f"{n:08d}.{column}": value for column, value in sample.items()})
            n += 1
        data = mds_shard(samples)
        bucket.put(f"mds/shard.{number:05d}.mds", data)
        shards.append(shard_entry(f"shard.{number:05d}.mds", data, len(samples)))
    bucket.put("mds/index.json", json.dumps({"shards": shards, "version": 2}).encode())
    Namespace().add_mount("/mds", f"{bucket.url}/mds", {"endpoint": bucket.endpoint, "format": "mds"})
    assert {f.path.removeprefix("/mds/"): f.size for f in gpufeed.walk("/mds")} == {k: len(v) for k, v in expected.items()}
    got = gpufeed.client().read_files([f"/mds/{k}" for k in expected])
    assert [bytes(g) for g in got] == list(expected.values())


def test_compressed_mds_is_refused_in_one_line(bucket: Bucket) -> None:
    entry = shard_entry("shard.00000.mds", b"", 0)
    entry["compression"] = "zstd"
    bucket.put("z/index.json", json.dumps({"shards": [entry], "version": 2}).encode())
    line = fails(1, "mount", "add", "/z", f"{bucket.url}/z", "--opt", f"endpoint={bucket.endpoint}", "--opt", "format=mds")
    assert "only uncompressed MDS shards can be read in place" in line


def test_a_truncated_mds_shard_is_refused_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = mds_shard([{"image": b"x" * 100, "label": struct.pack("<q", 1), "name": b"a"}])
    (tmp_path / "shard.00000.mds").write_bytes(data[:-50])
    (tmp_path / "index.json").write_text(json.dumps({"shards": [shard_entry("shard.00000.mds", data, 1)], "version": 2}))
    line = fails(1, "mount", "add", "/t", f"file://{tmp_path}", "--opt", "format=mds")
    assert f"shard.00000.mds: its offsets run past its {len(data) - 50} bytes" in line


def test_a_malformed_mds_index_is_refused_in_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = mds_shard([])
    (tmp_path / "shard.00000.mds").write_bytes(data)
    entry = shard_entry("shard.00000.mds", data, 0)
    del entry["column_sizes"]
    (tmp_path / "index.json").write_text(json.dumps({"shards": [entry], "version": 2}))
    line = fails(1, "mount", "add", "/m", f"file://{tmp_path}", "--opt", "format=mds")
    assert line.endswith("index.json: not an MDS index (no 'column_sizes' field)")
