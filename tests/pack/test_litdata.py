"""A LitData optimized directory read in place: each sample's leaf is a file whose bytes are a range
of its chunk. The chunks are written here as LitData's `optimize` lays out its PyTree format
(litdata/streaming/writer.py `_create_chunk` and item_loader.py `PyTreeLoader.encode_data`: a chunk
is a u32 count, u32 offsets, then the samples; a sample is a u32 size per leaf, then the leaves'
bytes), with `data_spec` as torch's pytree `treespec_dumps` writes it; benchmarks/pack.py reads
the real `optimize` output the same way."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest

import gpufeed
from gpufeed.namespace import Namespace
from gpufeed.pack.in_place import leaf_names
from tests.cli.test_cli import fails
from tests.conftest import Bucket

LEAF = {"type": None, "context": None, "children_spec": []}


def dict_spec(keys: list[str], children: list[dict] | None = None) -> dict:
    return {"type": "builtins.dict", "context": json.dumps(keys), "children_spec": children or [LEAF] * len(keys)}


def data_spec(spec: dict) -> str:
    return json.dumps([1, spec])


def chunk(samples: list[list[bytes]]) -> bytes:
    encoded = [struct.pack(f"<{len(leaves)}I", *map(len, leaves)) + b"".join(leaves) for leaves in samples]
    offsets = [4 + 4 * (len(encoded) + 1)]
    for item in encoded:
        offsets.append(offsets[-1] + len(item))
    return struct.pack(f"<I{len(offsets)}I", len(encoded), *offsets) + b"".join(encoded)


def index(chunks: list[tuple[str, bytes, int]], spec: str, formats: list[str], **config: object) -> bytes:
    entries = [{"chunk_bytes": len(data), "chunk_size": count, "dim": None, "filename": name} for name, data, count in chunks]
    return json.dumps({
        "chunks": entries,
        "config": {"chunk_bytes": 1 << 26, "chunk_size": None, "compression": None, "data_format": formats,
                   "data_spec": spec, "encryption": None, "item_loader": "PyTreeLoader", **config},
        "updated_at": "0",
    }).encode()


def test_litdata_samples_read_in_place(bucket: Bucket) -> None:
    """Two workers' chunks, samples {"image": bytes, "label": int, "meta": {"name": str}}: each
    leaf is the file `{n:08d}.{path}`, n numbered across chunks in index order as LitData does."""
    rng = random.Random(0)
    spec = data_spec(dict_spec(["image", "label", "meta"], [LEAF, LEAF, dict_spec(["name"])]))
    expected: dict[str, bytes] = {}
    chunks = []
    n = 0
    for name in ("chunk-1-0.bin", "chunk-0-0.bin", "chunk-0-1.bin"):
        samples = []
        for _ in range(rng.randint(1, 20)):
            leaves = [rng.randbytes(rng.randint(0, 40_000)), struct.pack("<q", n % 10), f"sample-{n}".encode()]
            samples.append(leaves)
            expected.update(zip([f"{n:08d}.image", f"{n:08d}.label", f"{n:08d}.meta.name"], leaves, strict=True))
            n += 1
        data = chunk(samples)
        bucket.put(f"ld/{name}", data)
        chunks.append((name, data, len(samples)))
    bucket.put("ld/index.json", index(chunks, spec, ["bytes", "int", "str"]))
    _, stats = Namespace().add_mount("/ld", f"{bucket.url}/ld", {"endpoint": bucket.endpoint, "format": "litdata"})
    assert (stats.files, stats.bytes) == (len(expected), sum(map(len, expected.values())))  # members, not the chunks too
    assert {f.path.removeprefix("/ld/"): f.size for f in gpufeed.walk("/ld")} == {k: len(v) for k, v in expected.items()}
    got = gpufeed.client().read_files([f"/ld/{k}" for k in expected])
    assert [bytes(g) for g in got] == list(expected.values())


def test_tuples_and_bare_values_are_named_by_position(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs"
    pairs.mkdir()
    data = chunk([[b"jpeg-0", b"\x01" * 8], [b"jpeg-1", b"\x02" * 8]])
    (pairs / "chunk-0-0.bin").write_bytes(data)
    tuple_spec = {"type": "builtins.tuple", "context": "null", "children_spec": [LEAF, LEAF]}
    (pairs / "index.json").write_bytes(index([("chunk-0-0.bin", data, 2)], data_spec(tuple_spec), ["jpeg", "int"]))
    bare = tmp_path / "bare"
    bare.mkdir()
    data = chunk([[b"first"], [b"second"]])
    (bare / "chunk-0-0.bin").write_bytes(data)
    (bare / "index.json").write_bytes(index([("chunk-0-0.bin", data, 2)], data_spec(LEAF), ["bytes"]))
    Namespace().add_mount("/pairs", f"file://{pairs}", {"format": "litdata"})
    Namespace().add_mount("/bare", f"file://{bare}", {"format": "litdata"})
    assert gpufeed.read("/pairs/00000001.0") == b"jpeg-1"
    assert gpufeed.read("/pairs/00000000.1") == b"\x01" * 8
    assert [f.path for f in gpufeed.walk("/bare")] == ["/bare/00000000.0", "/bare/00000001.0"]
    assert gpufeed.read("/bare/00000001.0") == b"second"


def test_chunks_without_samples_are_refused_as_empty(tmp_path: Path) -> None:
    data = chunk([])
    (tmp_path / "chunk-0-0.bin").write_bytes(data)
    (tmp_path / "index.json").write_bytes(index([("chunk-0-0.bin", data, 0)], data_spec(LEAF), ["bytes"]))
    line = fails(1, "mount", "add", "/empty", f"file://{tmp_path}", "--opt", "format=litdata")
    assert line.endswith(f"file://{tmp_path}: its litdata shards hold no members (--allow-empty mounts it anyway)")
    (tmp_path / "index.json").write_text("{}")
    line = fails(1, "mount", "add", "/empty", f"file://{tmp_path}", "--opt", "format=litdata")
    assert line.endswith(f"file://{tmp_path}/index.json: not a LitData index (no 'chunks' field)"), line


def test_leaf_names_fall_back_to_positions_where_a_key_cannot_name_a_file() -> None:
    assert leaf_names(data_spec(dict_spec(["image", "label"])), 2) == ["image", "label"]
    assert leaf_names(data_spec(dict_spec(["a/b", "c"])), 2) == ["0", "1"]
    assert leaf_names(data_spec(dict_spec(["image"])), 2) == ["0", "1"]  # the spec disagrees with the formats
    assert leaf_names("not json", 3) == ["0", "1", "2"]
    assert leaf_names(None, 1) == ["0"]


@pytest.mark.parametrize(
    ("config", "chunk_bytes", "message"),
    [
        ({"compression": "zstd"}, None, "only uncompressed, unencrypted PyTreeLoader chunks can be read in place "
                                        "(found compression=zstd)"),
        ({"item_loader": "TokensLoader"}, None, "(found item_loader=TokensLoader)"),
        ({}, struct.pack("<4I", 2, 16, 16, 16) + b"ARROW1\0\0", "its samples are in an Arrow footer"),
        ({}, struct.pack("<I", 1000), "chunk-0-0.bin: ends inside a header (1001 numbers at byte 4 of 4)"),
        ({}, struct.pack("<3I", 1, 12, 19) + struct.pack("<I", 2) + b"abc", "LitData sample 0 does not fill its offsets"),
        ({}, chunk([[b"abc"]])[:-1], "chunk-0-0.bin: its offsets run past its 18 bytes"),
    ],
    ids=["compressed", "tokens", "arrow", "truncated-header", "sizes-disagree", "truncated-sample"],
)
def test_unreadable_litdata_is_refused_in_one_line(tmp_path: Path, config: dict, chunk_bytes: bytes | None, message: str) -> None:
    data = chunk_bytes if chunk_bytes is not None else chunk([[b"abc"]])
    count = 2 if b"ARROW1" in data else 1 if len(data) > 4 else 1000
    (tmp_path / "chunk-0-0.bin").write_bytes(data)
    (tmp_path / "index.json").write_bytes(index([("chunk-0-0.bin", data, count)], data_spec(LEAF), ["bytes"], **config))
    line = fails(1, "mount", "add", "/bad", f"file://{tmp_path}", "--opt", "format=litdata")
    assert message in line
