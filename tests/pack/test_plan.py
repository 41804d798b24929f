"""The pack layout rules and the index format, on numbers alone."""

from __future__ import annotations

import msgspec
import pytest

from gpufeed.errors import PackError
from gpufeed.pack import index as idx
from gpufeed.pack.members import MemberTable
from gpufeed.pack.plan import ALIGN, Item, pack_digest, place, plan

MiB = 1 << 20


def test_small_members_never_straddle_a_block_and_big_ones_are_page_aligned() -> None:
    assert place(100, 5000, 4 * MiB) == 100, "small members are packed tight"
    assert place(4 * MiB - 10, 5000, 4 * MiB) == 4 * MiB, "a small member that would straddle a block starts the next"
    assert place(4 * MiB - 10, 3 * MiB, 4 * MiB) == 4 * MiB - 10 + 10, "a big one starts on the next 4 KiB boundary"
    assert place(5, 2 * MiB, 4 * MiB) % ALIGN == 0


def test_shards_hold_at_most_their_size_and_keys_name_their_contents() -> None:
    items = [Item(f"f{n}", 300_000, "v1") for n in range(20)]
    shards = plan(items, 1 * MiB, 4 * MiB)
    assert [len(s.members) for s in shards] == [3] * 6 + [2]
    assert all(s.size <= 1 * MiB for s in shards)
    assert [n for s in shards for n, _ in s.members] == list(range(20)), "order kept"
    again = plan(items, 1 * MiB, 4 * MiB)
    assert [s.key for s in again] == [s.key for s in shards]
    changed = plan([*items[:4], Item("f4", 300_000, "v2"), *items[5:]], 1 * MiB, 4 * MiB)
    assert [s.key == t.key for s, t in zip(shards, changed, strict=True)] == [True, False] + [True] * 5
    assert pack_digest(changed, 4 * MiB) != pack_digest(shards, 4 * MiB)
    assert len(plan([Item("huge", 3 * MiB, "v")], 1 * MiB, 4 * MiB)) == 1, "a file larger than a shard gets one alone"


def test_index_round_trip_and_corruption_is_caught() -> None:
    rows = [(f"d/{n}.jpg", n % 2, n * 10, 10, 1.5, bytes([n]) * 32) for n in range(4)]
    index = idx.build("digest", 4 * MiB, [("s0", 100), ("s1", 100)], rows, bytes(16))
    data = idx.encode(index)
    back = idx.decode(data, "here")
    assert back == index
    assert [(m.path, m.shard, m.offset, m.length) for m in back.members()] == [
        ("d/0.jpg", "s0", 0, 10), ("d/1.jpg", "s1", 10, 10), ("d/2.jpg", "s0", 20, 10), ("d/3.jpg", "s1", 30, 10)
    ]
    with pytest.raises(PackError, match="here: corrupt pack index"):
        idx.decode(data[:-7], "here")
    for at in range(len(data)):  # a flipped bit anywhere, in an offset, a length, a path: refused, not served
        damaged = bytearray(data)
        damaged[at] ^= 1 << at % 8
        with pytest.raises(PackError, match="here: corrupt pack index"):
            idx.decode(bytes(damaged), "here")
    with pytest.raises(PackError, match=r"here: corrupt pack index \(a version 3 index without its checksum\)"):
        idx.decode(idx.MAGIC + msgspec.msgpack.encode(index), "here")
    legacy = idx.MAGIC + msgspec.msgpack.encode(msgspec.structs.replace(index, version=2))
    assert idx.decode(legacy, "here").paths == index.paths, "an index from before checksums is still read"
    with pytest.raises(PackError, match="here: corrupt pack index"):
        idx.decode(legacy.replace(b"d/1.jpg", b"d/1.jp\xe7"), "here")
    with pytest.raises(PackError, match="a member ends past its shard"):
        idx.decode(idx.encode(idx.build("d", 4 * MiB, [("s0", 15)], [rows[0], rows[2]], bytes(8))), "here")


def test_chunk_sums_are_checked_against_the_shards_and_a_version_1_index_reads_without_them() -> None:
    rows = [(f"d/{n}.jpg", 0, n * 10, 10, 1.5, bytes([n]) * 32) for n in range(4)]
    shards = [("s0", 300_000), ("s1", 40)]  # two chunks of 256 KiB, then one
    sums = bytes(range(24))
    index = idx.build("d", 4 * MiB, shards, rows, sums)
    table = MemberTable.build(idx.decode(idx.encode(index), "here"))
    assert (table.chunk_sums("s0"), table.chunk_sums("s1"), table.chunk_sums("s2")) == (sums[:16], sums[16:], None)
    with pytest.raises(PackError, match=r"here: corrupt pack index \(16 bytes of chunk sums for shards that need 24\)"):
        idx.decode(idx.encode(idx.build("d", 4 * MiB, shards, rows, sums[:16])), "here")
    old = idx.decode(idx.encode(msgspec.structs.replace(index, version=1, chunk_sums=b"")), "here")
    assert MemberTable.build(old).chunk_sums("s0") is None and [m.path for m in old.members()] == [r[0] for r in rows]
    with pytest.raises(PackError, match="pack index version 4; this gpufeed reads versions 1 to 3"):
        idx.decode(idx.encode(msgspec.structs.replace(index, version=4)), "here")
