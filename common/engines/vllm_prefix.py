"""vLLM's KV cache events, renamed into `common.prefix_hash` block hashes.

vLLM 0.32's block pool records what its prefix cache stores and evicts (`BlockStored`,
`BlockRemoved`, `AllBlocksCleared` of vllm.distributed.kv_events) when kv cache events are
enabled; its scheduler hands them to an event publisher once per step. Kairos enables them with
the "null" publisher (no ZMQ socket) and `KairosScheduler` swaps that publisher for one that keeps
them in the process, translates them here, and sends the result with the step's record.

Naming. vLLM's block hashes depend on its hash function and seed, so they mean nothing to the
router; `BlockStored` carries the blocks' token ids and the parent's vLLM hash, which is enough to
compute `block_hashes(token_ids, block_size, parent=<our hash of the parent>)`. A map from vLLM's
hash to ours, one entry per cached block, lets `BlockRemoved` (which carries only vLLM's hash)
translate too. vLLM may cache the same content in two physical blocks (two requests computing one
prefix at once) and evicts them one by one, so each entry counts its copies and the hash is
reported removed only when the last copy goes.

What is not translated, and why (counted in `skipped`):
- blocks with extra keys (LoRA, multimodal inputs, cache salt): our hash covers token ids only,
  so two such blocks with equal ids and different extra keys would get one name;
- events of a block size other than the engine's (vLLM's partial-block entries, hybrid models'
  other KV cache groups) and of another medium (an offloading connector's CPU tier);
- blocks whose parent is unknown (already evicted, or itself skipped): vLLM cannot reach them
  from a prompt's start either, so they can never be a prefix hit.

The map is bounded (`limit` entries): past it the oldest entry is dropped and reported removed,
which can only make the router underestimate what is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from common.prefix_hash import ROOT, block_hashes

GPU = "GPU"  # vllm.distributed.kv_events.MEDIUM_GPU: the engine's own KV cache, on every platform


class PrefixTranslator:
    """Feeds on vLLM's KV cache events, in order; `take()` returns the net change since the last
    take: (stored, removed, cleared), with `cleared` meaning everything reported before is gone."""

    def __init__(self, block_size: int, limit: int) -> None:
        self.block_size = block_size
        self.limit = max(limit, 1)
        self._ours: OrderedDict[Any, list[int]] = OrderedDict()  # vLLM hash -> [our hash, copies]
        self._net: dict[int, bool] = {}  # our hash -> stored (True) or removed (False), since take()
        self._cleared = False
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._ours)

    def feed(self, events: list[Any]) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                if ev.medium in (None, GPU):
                    for vh in ev.block_hashes:
                        self._removed(vh)
            elif isinstance(ev, AllBlocksCleared):
                self._ours.clear()
                self._net.clear()
                self._cleared = True

    def _stored(self, ev: Any) -> None:
        n = len(ev.block_hashes)
        if (ev.medium not in (None, GPU) or ev.block_size != self.block_size
                or len(ev.token_ids) != n * self.block_size or (ev.extra_keys and any(ev.extra_keys))
                or ev.lora_name is not None or ev.lora_id is not None):
            self.skipped += n
            return
        if ev.parent_block_hash is None:
            parent = ROOT
        else:
            entry = self._ours.get(ev.parent_block_hash)
            if entry is None:
                self.skipped += n
                return
            parent = entry[0]
        for vh, h in zip(ev.block_hashes, block_hashes(ev.token_ids, self.block_size, parent), strict=True):
            entry = self._ours.get(vh)
            if entry is not None:
                entry[1] += 1
                self._ours.move_to_end(vh)
                continue
            self._ours[vh] = [h, 1]
            self._net[h] = True
            if len(self._ours) > self.limit:
                _, (old, _) = self._ours.popitem(last=False)
                self._net[old] = False

    def _removed(self, vh: Any) -> None:
        entry = self._ours.get(vh)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0:
            del self._ours[vh]
            self._net[entry[0]] = False

    def take(self) -> tuple[list[int], list[int], bool]:
        stored = [h for h, s in self._net.items() if s]
        removed = [h for h, s in self._net.items() if not s]
        cleared, self._cleared = self._cleared, False
        self._net.clear()
        return stored, removed, cleared

    def put_back(self, stored: list[int], removed: list[int], cleared: bool) -> None:
        """Undo a `take()` whose result could not be delivered (no events fed since)."""
        later = self._net
        self._net = {h: True for h in stored}
        self._net.update((h, False) for h in removed)
        self._net.update(later)
        self._cleared = self._cleared or cleared
