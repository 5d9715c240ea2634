"""A block allocator for a fixed pool: contiguous runs when it can (zero-copy views), scattered if not."""

from __future__ import annotations

import itertools

import numpy as np


class BlockAllocator:
    """Hands out block ids in [0, num_blocks). Best-fit contiguous run first, else any free blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = np.ones(num_blocks, dtype=bool)
        self.free_count = num_blocks

    def alloc(self, n: int) -> list[int] | None:
        """`n` free block ids (ascending; contiguous when a run is free), or None if fewer are free."""
        if n < 1:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.free_count:
            return None
        edges = np.diff(np.concatenate(([0], self._free.view(np.int8), [0])))
        starts = np.flatnonzero(edges == 1)
        lengths = np.flatnonzero(edges == -1) - starts
        fits = np.flatnonzero(lengths >= n)
        if fits.size:
            best = fits[np.argmin(lengths[fits])]
            first = int(starts[best])
            ids = list(range(first, first + n))
        else:
            ids = np.flatnonzero(self._free)[:n].tolist()
        self._free[ids] = False
        self.free_count -= n
        return ids

    def take(self, ids: list[int]) -> bool:
        """Allocate exactly `ids` (distinct, in range) if all are free; False (nothing taken) otherwise."""
        if len(set(ids)) != len(ids) or any(not 0 <= i < self.num_blocks for i in ids):
            raise ValueError("block ids must be distinct and in range")
        if not ids or not self._free[ids].all():
            return False
        self._free[ids] = False
        self.free_count -= len(ids)
        return True

    def free(self, ids: list[int]) -> None:
        if not ids:
            return
        if len(set(ids)) != len(ids) or self._free[ids].any():
            raise ValueError("double free of KV blocks")
        self._free[ids] = True
        self.free_count += len(ids)


def is_contiguous(ids: list[int]) -> bool:
    return all(b == a + 1 for a, b in itertools.pairwise(ids))
