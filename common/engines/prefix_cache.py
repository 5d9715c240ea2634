"""A per-worker prefix cache of KV blocks, by block hash (common/prefix_hash.py), as vLLM's.

A block is either in use (referenced by a request the engine holds: its KV cannot go) or
cached (no request uses it; it stays until room is needed, least recently freed first). A
request releases its blocks last block first, so the tail of a prompt is evicted before its
head, which keeps the longest prefixes usable. The owner (the Batcher) says how many blocks may
stay cached beside the work it holds (`trim`).

What entered and left the cache since the last look (`take_events`) is what the worker
summarises to the router.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    def __init__(self, block_tokens: int, capacity_blocks: int) -> None:
        if block_tokens <= 0 or capacity_blocks < 0:
            raise ValueError("block_tokens must be positive and capacity_blocks >= 0")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_blocks
        self._refs: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict()  # cached, unused; least recently freed first
        self._events: dict[int, bool] = {}  # block -> stored (True) or removed (False), last change wins

    def __len__(self) -> int:
        return len(self._refs) + len(self._free)

    def __contains__(self, h: int) -> bool:
        return h in self._refs or h in self._free

    @property
    def in_use(self) -> int:
        return len(self._refs)

    @property
    def cached(self) -> int:
        return len(self._free)

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` held (in use or cached)."""
        n = 0
        for h in hashes:
            if h not in self._refs and h not in self._free:
                break
            n += 1
        return n

    def acquire(self, hashes: Sequence[int]) -> None:
        """A request uses these blocks: held ones are reused, new ones are stored."""
        refs, free = self._refs, self._free
        for h in hashes:
            n = refs.get(h)
            if n is not None:
                refs[h] = n + 1
            else:
                if h in free:
                    del free[h]
                else:
                    self._events[h] = True
                refs[h] = 1

    def release(self, hashes: Sequence[int]) -> None:
        """A request no longer uses these blocks (acquired before): they stay cached."""
        refs, free = self._refs, self._free
        for h in reversed(hashes):
            n = refs.get(h, 0)
            if n > 1:
                refs[h] = n - 1
            elif n == 1:
                del refs[h]
                free[h] = None

    def trim(self, room_blocks: int) -> None:
        """Evict cached blocks, least recently freed first, until at most `room_blocks` stay."""
        free = self._free
        keep = max(0, room_blocks)
        while len(free) > keep:
            h, _ = free.popitem(last=False)
            self._events[h] = False

    def take_events(self) -> tuple[list[int], list[int]]:
        """(stored, removed) since the last call, net: a block stored and evicted since is
        only in `removed`, one evicted and stored again only in `stored`."""
        ev = self._events
        self._events = {}
        return [h for h, s in ev.items() if s], [h for h, s in ev.items() if not s]
