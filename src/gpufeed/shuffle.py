"""The epoch's sample order: one pure function of (seed, epoch, n), shared by the PyTorch
sampler and the benchmark so both read the same order, on every rank, worker and restart.
Kept free of torch so the benchmark can use it without importing torch.

Two kinds of shuffle. The exact one is a uniform permutation of the samples. The block-aware
one (`block_permutation`, Mosaic Streaming's py1e idea over cache blocks) serves packed
datasets, whose samples lie many to a cache block: it shuffles the blocks, then moves each
sample within a window of `window` consecutive blocks of that order, so a block's samples are
all read while about `window` blocks are being read, and a cache of a few blocks fetches each
block once per epoch instead of once per eviction. The price is randomness: two samples of
one block are never more than 2·window−1 blocks' worth of reads apart.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from gpufeed.errors import InvalidArgument

BLOCK: Literal["block"] = "block"
"""`shuffle=BLOCK`: the block-aware order."""

Shuffle = bool | Literal["block"]
DEFAULT_WINDOW = 4
"""Cache blocks a sample may move across in the block-aware shuffle, unless told otherwise."""


def shuffle_mode(shuffle: object, window: object) -> Shuffle:
    """`shuffle` as the sampler keeps and records it (True, False or "block"), refusing
    anything else and a window that is not an integer >= 1."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InvalidArgument(f"shuffle_window {window!r}: expected an integer >= 1 (cache blocks a sample may move across)")
    if isinstance(shuffle, str):
        if shuffle != BLOCK:
            raise InvalidArgument(f"shuffle={shuffle!r}: expected True, False or {BLOCK!r}")
        return BLOCK
    return bool(shuffle)


def _check(seed: int, epoch: int, n: int) -> None:
    if seed < 0 or epoch < 0 or n < 0:
        raise InvalidArgument(f"seed {seed}, epoch {epoch} and size {n} must be >= 0")


def epoch_permutation(seed: int, epoch: int, n: int, shuffle: bool = True) -> np.ndarray:
    """The order in which epoch `epoch` reads samples 0..n-1."""
    _check(seed, epoch, n)
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng((seed, epoch)).permutation(n)


def block_permutation(seed: int, epoch: int, groups: np.ndarray, window: int) -> np.ndarray:
    """The block-aware order of epoch `epoch` over samples 0..len(groups)-1, `groups[i]` being
    sample i's group (any int64 naming its cache block; equal ids share a block).

    The groups are put in a random order; group at place g of that order gives each of its
    samples a key drawn uniformly from [g, g + window), and the samples are read by key. So
    window=1 reads the groups one after the other, each shuffled inside; a larger window
    interleaves neighbouring groups. Every sample of the group at place g is read after every
    sample of the groups at places <= g - window and before every sample of those at places
    >= g + window. Vectorised: about 0.2 s for a million samples."""
    groups = np.asarray(groups)
    _check(seed, epoch, len(groups))
    if groups.ndim != 1 or not np.issubdtype(groups.dtype, np.integer):
        raise InvalidArgument(f"groups: expected one integer id per sample, got {groups.dtype} of shape {groups.shape}")
    shuffle_mode(BLOCK, window)
    ids, dense = np.unique(groups, return_inverse=True)
    rng = np.random.default_rng((seed, epoch))
    place = np.empty(len(ids), dtype=np.int64)
    place[rng.permutation(len(ids))] = np.arange(len(ids), dtype=np.int64)
    keys = place[dense] + window * rng.random(len(groups))
    return np.argsort(keys, kind="stable")


def epoch_order(
    seed: int, epoch: int, n: int, shuffle: Shuffle = True, window: int = 1, groups: np.ndarray | None = None
) -> np.ndarray:
    """The order of epoch `epoch` for either kind of shuffle; the block-aware one needs each
    sample's group (`groups`, one per sample)."""
    if shuffle != BLOCK:
        return epoch_permutation(seed, epoch, n, bool(shuffle))
    if groups is None or len(groups) != n:
        have = "none" if groups is None else f"{len(groups)}"
        raise InvalidArgument(f"shuffle={BLOCK!r} needs one group per sample: {n} samples, {have} groups")
    return block_permutation(seed, epoch, groups, window)
