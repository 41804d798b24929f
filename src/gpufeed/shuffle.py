"""The epoch's sample order: one pure function of (seed, epoch, n), shared by the PyTorch
sampler and the benchmark so both read the same order, on every rank, worker and restart.
Kept free of torch so the benchmark can use it without importing torch."""

from __future__ import annotations

import numpy as np

from gpufeed.errors import InvalidArgument


def epoch_permutation(seed: int, epoch: int, n: int, shuffle: bool = True) -> np.ndarray:
    """The order in which epoch `epoch` reads samples 0..n-1."""
    if seed < 0 or epoch < 0 or n < 0:
        raise InvalidArgument(f"seed {seed}, epoch {epoch} and size {n} must be >= 0")
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng((seed, epoch)).permutation(n)
