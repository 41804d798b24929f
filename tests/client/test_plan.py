"""The read planner is pure: block pieces, sparseness and joins checked on numbers alone."""

from __future__ import annotations

from gpufeed.blocks import ObjectBlocks
from gpufeed.client import plan

BLOCKS = ObjectBlocks("0" * 32, size=10_000, block_size=4096)


def test_pieces_split_a_range_at_block_bounds_and_clip_to_the_object() -> None:
    assert plan.pieces(BLOCKS, 0, 10_000) == [(0, 0, 4096), (1, 4096, 8192), (2, 8192, 10_000)]
    assert plan.pieces(BLOCKS, 4000, 4200) == [(0, 4000, 4096), (1, 4096, 4200)]
    assert plan.pieces(BLOCKS, 9000, 20_000) == [(2, 9000, 10_000)]
    assert plan.pieces(BLOCKS, 5000, 5000) == [] and plan.pieces(BLOCKS, 10_000, 10_100) == []


def test_a_batch_is_sparse_when_its_missing_blocks_dwarf_the_bytes_it_wants() -> None:
    assert plan.is_sparse(50, 50 * 4 << 20, 50 * 115_000)
    assert not plan.is_sparse(1, 4 << 20, 1000), "one missing block is always waited for"
    assert not plan.is_sparse(2, 8000, 2001 * 1), "blocks under SPARSE_FACTOR times the wanted bytes"
    assert plan.is_sparse(2, plan.SPARSE_FACTOR * 2000, 2000)


def test_join_hands_one_piece_out_as_it_is_and_concatenates_several() -> None:
    one = memoryview(b"abc")
    assert plan.join([one]) is one
    joined = plan.join([memoryview(b"ab"), memoryview(b"cd"), memoryview(b"e")])
    assert joined == b"abcde"
    assert type(joined.obj) is bytes and joined.nbytes == len(joined.obj), "copied once, into a bytes handed out as it is"
