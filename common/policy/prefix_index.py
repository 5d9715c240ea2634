"""The router's prefix index: which workers hold which KV blocks, by block hash
(common/prefix_hash.py). The live router and `kairos sim` both keep one.

Fed by the workers' summaries of what their prefix caches stored and evicted, and by the
router's own dispatches (a prompt sent to a worker will be cached there: the index need not
wait for the summary). Bounded: at most `max_blocks` hashes, the least recently seen dropped
first (a dropped hash only costs a missed hit). A worker that restarts (a new incarnation),
departs, or reports a cleared cache is forgotten at once: its entries are tagged with the
worker's epoch, and entries of an older epoch do not count (they are dropped when next seen).

`version` changes whenever an answer of `hits` could: a block newly held, one removed or evicted,
a worker joining, cleared or forgotten. A caller that asks again for the same prompt at the same
version may keep the answer it had (the router does for its waiting requests: RouterPrefix.lookup).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_MAX_BLOCKS = 1 << 20  # ~100 MB at most with a few workers per block


class PrefixIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, dict[str, int]] = OrderedDict()  # hash -> {worker: epoch}
        self._epoch: dict[str, int] = {}   # worker -> its current epoch
        self._incarnation: dict[str, str] = {}
        self.block_tokens: dict[str, int] = {}  # worker -> its KV block size (tokens)
        self._epochs = itertools.count(1)
        self.version = 0  # changes with every change an answer of `hits` could see (module docstring)

    def __len__(self) -> int:
        return len(self._blocks)

    def workers(self) -> list[str]:
        return list(self._epoch)

    # -- membership -----------------------------------------------------------------------
    def join(self, worker_id: str, block_tokens: int, incarnation: str = "") -> None:
        """A worker with a prefix cache of `block_tokens`-token blocks; a new incarnation of a
        known worker starts empty."""
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        same = (worker_id in self._epoch and self._incarnation.get(worker_id) == incarnation
                and self.block_tokens.get(worker_id) == block_tokens)
        if not same:
            self.version += 1
            self._epoch[worker_id] = next(self._epochs)
            self._incarnation[worker_id] = incarnation
            self.block_tokens[worker_id] = block_tokens

    def forget(self, worker_id: str) -> None:
        """The worker left (or its cache was dropped): none of its entries count any more."""
        if worker_id in self._epoch:
            self.version += 1
        self._epoch.pop(worker_id, None)
        self._incarnation.pop(worker_id, None)
        self.block_tokens.pop(worker_id, None)

    def clear(self, worker_id: str) -> None:
        if worker_id in self._epoch:
            self.version += 1
            self._epoch[worker_id] = next(self._epochs)

    # -- updates --------------------------------------------------------------------------
    def stored(self, worker_id: str, hashes: Iterable[int]) -> list[int]:
        """The worker holds these blocks; returns those it was not known to hold before."""
        epoch = self._epoch.get(worker_id)
        if epoch is None:
            return []
        blocks = self._blocks
        new: list[int] = []
        for h in hashes:
            holders = blocks.get(h)
            if holders is None:
                blocks[h] = {worker_id: epoch}
                new.append(h)
            else:
                if holders.get(worker_id) != epoch:
                    new.append(h)
                holders[worker_id] = epoch
                blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
        if new:  # (an eviction above only follows a new block)
            self.version += 1
        return new

    def removed(self, worker_id: str, hashes: Iterable[int]) -> None:
        blocks = self._blocks
        for h in hashes:
            holders = blocks.get(h)
            if holders is not None and holders.pop(worker_id, None) is not None:
                self.version += 1
                if not holders:
                    del blocks[h]

    # -- queries --------------------------------------------------------------------------
    def hits(self, hashes: Sequence[int], among: Iterable[str] | None = None) -> dict[str, int]:
        """Per worker (of `among`, default all known) that holds the first block: how many
        leading blocks of `hashes` it holds."""
        epoch = self._epoch
        live = set(epoch) if among is None else {w for w in among if w in epoch}
        out: dict[str, int] = {}
        blocks = self._blocks
        n = 0
        for h in hashes:
            if not live:
                break
            holders = blocks.get(h)
            if holders is None:
                break
            still = set()
            stale = []
            for w, e in holders.items():
                if epoch.get(w) != e:
                    stale.append(w)
                elif w in live:
                    still.add(w)
            for w in stale:
                del holders[w]
            if not holders:
                del blocks[h]
            elif still:
                blocks.move_to_end(h)
            for w in live - still:
                out[w] = n
            live = still
            n += 1
        for w in live:
            out[w] = n
        return {w: k for w, k in out.items() if k > 0}
